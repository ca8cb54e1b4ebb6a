//! Starting and stopping the broker: open the store, recover the engine,
//! listen, serve connections, and shut down gracefully.

use crate::config::Config;
use crate::engine::Engine;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinSet;
use weir_backend::log::{LogOptions, LogStore};
use weir_backend::Store;
use weir_engine::auth::{AuthFailure, Authenticator, Principal};
use weir_engine::login::{Entry, LoginGate, LoginRefused};
use weir_protocols::amqp::ServerConfig;

/// What every connection task shares.
pub struct Shared {
    /// The engine.
    pub engine: Arc<Engine>,
    /// AMQP limits and identity.
    pub amqp: ServerConfig,
    /// MQTT limits, connected client ids, delayed wills.
    pub mqtt: crate::mqtt::MqttShared,
    /// Users and their password hashes (every protocol logs in here).
    pub auth: Arc<Authenticator>,
    /// How long a delivery may stay unacknowledged (None = forever).
    pub consumer_timeout: Option<Duration>,
    /// Resource alarms (memory, disk), set and cleared by the monitors in
    /// [`Broker::run`]; every session subscribes.
    pub alarms: watch::Sender<Alarms>,
    /// How long a partly received message may make no progress (None = forever).
    pub partial_content_timeout: Option<Duration>,
    /// Logins per source address: failure budgets and delays, and fair
    /// turns at the slow password verifications (one per CPU at once: each
    /// holds ~19 MiB for tens of milliseconds).
    pub logins: LoginGate,
    /// Set after large frees (purge, delete): the memory monitor trims the
    /// heap on its next tick.
    trim_wanted: AtomicBool,
    /// Live client connections, for the management API (see
    /// [`crate::connections`]).
    pub connections: Arc<crate::connections::Connections>,
}

impl Shared {
    /// Checks credentials (see [`weir_engine::auth`] and
    /// [`weir_engine::login`]). A source over its failure budget is refused
    /// before anything else. Logins that already succeeded are answered
    /// from the authenticator's cache; others wait for their source's turn
    /// at a verification slot and run the slow hash on the blocking pool,
    /// never on a runtime worker. A refusal is recorded against the source
    /// here and carries the delay to serve before answering. The default
    /// user `guest` is accepted from loopback only unless configured
    /// otherwise, as in RabbitMQ.
    pub async fn login(
        &self,
        user: &str,
        pass: &str,
        peer: SocketAddr,
    ) -> Result<Principal, LoginRefused> {
        let ip = peer.ip();
        let failed = move |gate: &LoginGate| LoginRefused::Failed {
            delay: gate.failed(ip, Instant::now()),
        };
        let over_budget = move |gate: &LoginGate| {
            gate.over_budget(ip, Instant::now())
                .then(|| LoginRefused::OverBudget {
                    delay: gate.failed(ip, Instant::now()),
                })
        };
        if let Some(refused) = over_budget(&self.logins) {
            return Err(refused);
        }
        if let Some(r) = self.auth.check_cached(user, pass.as_bytes(), ip) {
            return r.map_err(|AuthFailure| failed(&self.logins));
        }
        let slot = match self.logins.enter(ip, Instant::now()) {
            Entry::Run(slot) => slot,
            Entry::Wait(w) => w.wait().await.ok_or(LoginRefused::Busy)?,
            Entry::Busy => return Err(LoginRefused::Busy),
        };
        // While it waited, its source may have run out of budget, or
        // another connection of the same client may have filled the cache.
        if let Some(refused) = over_budget(&self.logins) {
            return Err(refused);
        }
        if let Some(r) = self.auth.check_cached(user, pass.as_bytes(), ip) {
            return r.map_err(|AuthFailure| failed(&self.logins));
        }
        let (auth, gate, user, pass) = (
            self.auth.clone(),
            self.logins.clone(),
            user.to_owned(),
            pass.to_owned(),
        );
        tokio::task::spawn_blocking(move || {
            let r = auth.authenticate(&user, pass.as_bytes(), ip);
            // Recorded before the slot goes back, so this source's next
            // login in line sees the failure when it checks its budget.
            let r = r.map_err(|AuthFailure| failed(&gate));
            drop(slot);
            r
        })
        .await
        .unwrap_or_else(|_| Err(failed(&self.logins)))
    }

    /// Records a login refused without a password check (a certificate
    /// naming no user) against its source; returns the refusal to serve.
    pub fn login_refused(&self, peer: SocketAddr) -> LoginRefused {
        LoginRefused::Failed {
            delay: self.logins.failed(peer.ip(), Instant::now()),
        }
    }

    /// A login by verified client certificate (its subject CN is `user`):
    /// the user must exist; no password is checked.
    pub fn login_certificate(
        &self,
        user: &str,
        peer: SocketAddr,
    ) -> Result<Principal, AuthFailure> {
        self.auth.known_user(user, peer.ip())
    }

    /// Asks the memory monitor to return freed heap memory to the system soon
    /// (after a purge or a delete freed many messages).
    pub fn request_trim(&self) {
        self.trim_wanted.store(true, Ordering::Relaxed);
    }
}

/// Which resource alarms are set. While any is, publishing connections are
/// not read and clients get `connection.blocked`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Alarms {
    /// Resident memory above `--memory-limit`.
    pub memory: bool,
    /// Free space of the data directory's filesystem below `--disk-free-limit`.
    pub disk: bool,
}

impl Alarms {
    /// Whether publishers are blocked.
    pub fn any(&self) -> bool {
        self.memory || self.disk
    }

    /// The reason given in `connection.blocked`, as RabbitMQ words it.
    pub fn reason(&self) -> &'static str {
        match (self.memory, self.disk) {
            (true, _) => "low on memory",
            (false, true) => "low on disk space",
            (false, false) => "",
        }
    }
}

/// Startup failures.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// The store could not be opened.
    #[error("opening store in {dir}: {source}")]
    Store {
        /// Directory.
        dir: String,
        /// Error.
        source: weir_backend::StoreError,
    },
    /// A configured policy could not be set.
    #[error("tenants and policies: {0}")]
    Policy(String),
    /// The configured users are invalid (a bad password hash, a duplicate).
    #[error("users: {0}")]
    Auth(#[from] weir_engine::auth::AuthError),
    /// The engine could not recover.
    #[error("recovering engine: {0}")]
    Engine(#[from] crate::engine::EngineError),
    /// The TLS files are unusable.
    #[error("{0}")]
    Tls(#[from] crate::tls::TlsError),
    /// A listener could not bind.
    #[error("binding {addr}: {source}")]
    Bind {
        /// Address.
        addr: SocketAddr,
        /// Error.
        source: std::io::Error,
    },
}

/// A running broker.
pub struct Broker {
    shared: Arc<Shared>,
    store: Arc<dyn Store>,
    listener: TcpListener,
    mqtt_listener: TcpListener,
    mqtt_ws_listener: TcpListener,
    http_listener: TcpListener,
    tls: Option<TlsListeners>,
    limits: Limits,
    /// When the store began opening (uptime).
    started: std::time::Instant,
    /// `[http]`: /metrics options, connection limit and timeouts.
    http: crate::config::HttpConfig,
}

/// The TLS listeners (with `[tls]`) and the certificates they share.
struct TlsListeners {
    tls: Arc<crate::tls::Tls>,
    /// SIGHUP, listened for from startup on (taken by the reload task).
    hup: crate::tls::Hangup,
    amqps: TcpListener,
    mqtts: TcpListener,
    mqtt_wss: TcpListener,
}

/// Which session a TLS connection is handed to after its handshake.
#[derive(Clone, Copy)]
enum TlsProtocol {
    Amqp,
    Mqtt,
    /// MQTT over secure WebSocket.
    MqttWs,
}

/// Runs the TLS handshake of an accepted connection (in its own task, so a
/// slow client holds up no one), then serves it like a plain one.
async fn serve_tls(
    protocol: TlsProtocol,
    acceptor: tokio_rustls::TlsAcceptor,
    tcp: tokio::net::TcpStream,
    peer: SocketAddr,
    shared: Arc<Shared>,
    shutdown: watch::Receiver<bool>,
) {
    let _ = tcp.set_nodelay(true);
    // An MQTT socket counts from its accept, before the TLS handshake.
    let _slot = match protocol {
        TlsProtocol::Amqp => None,
        TlsProtocol::Mqtt | TlsProtocol::MqttWs => match shared.mqtt.admit() {
            Some(s) => Some(s),
            None => {
                tracing::debug!(%peer, "too many MQTT connections: closed");
                return;
            }
        },
    };
    let (stream, identity) = match crate::tls::accept(acceptor, tcp).await {
        Ok(s) => s,
        Err(e) => {
            tracing::info!(%peer, error = %e, "TLS handshake failed");
            return;
        }
    };
    match protocol {
        TlsProtocol::Amqp => {
            crate::amqp::session::serve_tls(stream, peer, identity, shared, shutdown).await
        }
        TlsProtocol::Mqtt => {
            let cert_user = identity.verified.then_some(identity.common_name).flatten();
            let (rd, wr) = tokio::io::split(stream);
            crate::mqtt::session::serve_tls(rd, wr, peer, cert_user, shared, shutdown).await
        }
        TlsProtocol::MqttWs => {
            let cert_user = identity.verified.then_some(identity.common_name).flatten();
            crate::mqtt::websocket::serve_stream(stream, peer, cert_user, shared, shutdown).await
        }
    }
}

/// Accepts on `l`; never resolves without a listener.
async fn accept_opt(
    l: Option<&TcpListener>,
) -> std::io::Result<(tokio::net::TcpStream, SocketAddr)> {
    match l {
        Some(l) => l.accept().await,
        None => std::future::pending().await,
    }
}

/// The resource watermarks the monitors check.
#[derive(Clone, Debug)]
struct Limits {
    memory: u64,
    disk_free: u64,
    data_dir: PathBuf,
}

impl Broker {
    /// Opens the store, recovers the engine and binds the listeners.
    pub async fn start(cfg: &Config) -> Result<Self, ServerError> {
        let users = configured_users(cfg).await?;
        let store = open_log_store(cfg)?;
        Self::start_on(cfg, users, store).await
    }

    /// [`Self::start`] over a store the caller opened: in-process tests run
    /// the real listeners and sessions over `weir_backend::testing::MemStore`
    /// (whose durability they can hold). The data directory of `cfg` is still
    /// the one the disk monitor watches.
    pub async fn start_with_store(
        cfg: &Config,
        store: Arc<dyn Store>,
    ) -> Result<Self, ServerError> {
        let users = configured_users(cfg).await?;
        Self::start_on(cfg, users, store).await
    }

    async fn start_on(
        cfg: &Config,
        users: Vec<weir_engine::permissions::UserDef>,
        store: Arc<dyn Store>,
    ) -> Result<Self, ServerError> {
        let log_cfg = &cfg.store.log;
        let started = std::time::Instant::now();
        // Before any session or the store records a figure.
        crate::metrics::install();
        let engine = Engine::open(store.clone())?;
        engine.set_codecs(Arc::new(crate::header_codecs::registry()));
        for t in &cfg.tenants {
            let (tenant, wait) = engine
                .add_tenant(&t.name)
                .map_err(|e| ServerError::Policy(e.to_string()))?;
            // Limits come from the file at every start (not stored).
            tenant.set_limits(t.limits().map_err(|e| ServerError::Policy(e.to_string()))?);
            if let Some(wait) = wait {
                wait.await
                    .map_err(|_| ServerError::Policy("the store closed".into()))?
                    .map_err(|e| ServerError::Policy(e.to_string()))?;
                tracing::info!(tenant = %t.name, "tenant created");
            }
        }
        for u in &cfg.quota_users {
            let limits = u.limits().map_err(|e| ServerError::Policy(e.to_string()))?;
            engine.user_quotas.set(&u.name, limits);
        }
        let rules = cfg
            .quota_connections
            .iter()
            .map(|c| c.rule())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| ServerError::Policy(e.to_string()))?;
        engine.connection_quotas.set(rules);
        apply_users(&engine, cfg, users).await?;
        for p in &cfg.policies {
            let tenant = engine.tenant(&p.vhost).ok_or_else(|| {
                ServerError::Policy(format!("policy '{}': no vhost '{}'", p.name, p.vhost))
            })?;
            let wait = tenant
                .set_policy(p.to_def())
                .map_err(|e| ServerError::Policy(e.to_string()))?;
            // Durable before the first client can see it.
            wait.await
                .map_err(|_| ServerError::Policy("the store closed".into()))?
                .map_err(|e| ServerError::Policy(e.to_string()))?;
        }
        release_recovery_memory();
        tracing::info!(elapsed_ms = started.elapsed().as_millis() as u64, data_dir = %log_cfg.data_dir.display(), "store opened");
        let defaults = ServerConfig::default();
        let amqp = ServerConfig {
            frame_max: cfg.amqp.frame_max,
            channel_max: cfg.amqp.channel_max,
            heartbeat: cfg.amqp.heartbeat,
            // A persistent message is one store record, which must fit in a
            // segment: refuse larger ones up front with 406, not with a
            // store error after the body arrived.
            max_message_size: defaults.max_message_size.min(
                log_cfg
                    .segment_bytes()
                    .saturating_sub(u64::from(cfg.amqp.frame_max) + 1024),
            ),
            ..defaults
        };
        let listener =
            TcpListener::bind(cfg.amqp.listen)
                .await
                .map_err(|source| ServerError::Bind {
                    addr: cfg.amqp.listen,
                    source,
                })?;
        let mqtt_listener =
            TcpListener::bind(cfg.mqtt.listen)
                .await
                .map_err(|source| ServerError::Bind {
                    addr: cfg.mqtt.listen,
                    source,
                })?;
        let mqtt_ws_listener = TcpListener::bind(cfg.mqtt.ws_listen)
            .await
            .map_err(|source| ServerError::Bind {
                addr: cfg.mqtt.ws_listen,
                source,
            })?;
        let http_listener =
            TcpListener::bind(cfg.http.listen)
                .await
                .map_err(|source| ServerError::Bind {
                    addr: cfg.http.listen,
                    source,
                })?;
        let tls = match &cfg.tls {
            Some(files) => {
                let tls = crate::tls::Tls::load(files)?;
                let hup = crate::tls::sighup();
                let bind = |addr: Option<SocketAddr>, default: SocketAddr| async move {
                    let addr = addr.unwrap_or(default);
                    TcpListener::bind(addr)
                        .await
                        .map_err(|source| ServerError::Bind { addr, source })
                };
                Some(TlsListeners {
                    tls,
                    hup,
                    amqps: bind(cfg.amqp.tls_listen, crate::config::AMQPS_DEFAULT_LISTEN).await?,
                    mqtts: bind(cfg.mqtt.tls_listen, crate::config::MQTTS_DEFAULT_LISTEN).await?,
                    mqtt_wss: bind(cfg.mqtt.wss_listen, crate::config::MQTT_WSS_DEFAULT_LISTEN)
                        .await?,
                })
            }
            None => None,
        };
        let m = &cfg.mqtt;
        engine.set_retained_limits(weir_engine::retained::RetainedLimits {
            max_messages_per_tenant: m.max_retained_per_tenant,
            max_bytes_per_tenant: m.max_retained_bytes_per_tenant,
            max_total_bytes: m.max_retained_bytes,
        });
        let mqtt_defaults = weir_protocols::mqtt::ServerConfig::default();
        let mqtt = crate::mqtt::MqttShared {
            server: weir_protocols::mqtt::ServerConfig {
                // A persistent message is one store record: it must fit a segment.
                maximum_packet_size: m.max_packet_size.min(
                    log_cfg
                        .segment_bytes()
                        .saturating_sub(64 * 1024)
                        .min(u64::from(u32::MAX)) as u32,
                ),
                receive_maximum: m.receive_maximum.max(1),
                maximum_connect_size: m.max_connect_size.max(256),
                topic_alias_maximum: m.topic_alias_maximum,
                max_topic_levels: m.max_topic_levels.max(1),
                server_keep_alive: (m.server_keep_alive > 0).then_some(m.server_keep_alive),
                ..mqtt_defaults
            },
            registry: Default::default(),
            max_connections: m.max_connections,
            open: Default::default(),
            max_queued_messages: m.max_queued_messages,
            max_session_expiry_secs: m.max_session_expiry,
            ssl_cert_login: m.ssl_cert_login,
            max_subscriptions: m.max_subscriptions,
        };
        let auth = engine.authenticator().clone();
        Ok(Broker {
            shared: Arc::new(Shared {
                engine,
                amqp,
                mqtt,
                auth,
                consumer_timeout: (cfg.amqp.consumer_timeout > 0)
                    .then(|| Duration::from_secs(cfg.amqp.consumer_timeout)),
                alarms: watch::Sender::new(Alarms::default()),
                partial_content_timeout: (cfg.amqp.partial_content_timeout > 0)
                    .then(|| Duration::from_secs(cfg.amqp.partial_content_timeout)),
                logins: LoginGate::new(std::thread::available_parallelism().map_or(2, |n| n.get())),
                trim_wanted: AtomicBool::new(false),
                connections: Default::default(),
            }),
            store,
            listener,
            mqtt_listener,
            mqtt_ws_listener,
            http_listener,
            tls,
            started,
            http: cfg.http.clone(),
            limits: Limits {
                memory: cfg.quota.memory_limit,
                disk_free: cfg.quota.disk_free_limit,
                data_dir: log_cfg.data_dir.clone(),
            },
        })
    }

    /// The bound AMQP address.
    pub fn amqp_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// The bound HTTP address (management API, `/metrics`, dashboard).
    pub fn http_addr(&self) -> std::io::Result<SocketAddr> {
        self.http_listener.local_addr()
    }

    /// Serves until `stop` resolves, then closes every connection with
    /// connection.close (320), waits briefly for them, and closes the store.
    pub async fn run(mut self, stop: impl std::future::Future<Output = ()>) {
        let (shutdown_tx, shutdown_rx) = watch::channel(false);
        let mut conns = JoinSet::new();
        let timers = tokio::spawn(run_timers(self.shared.engine.clone()));
        let engine = self.shared.engine.clone();
        let compactor = tokio::spawn(async move {
            // Every 5 s; while rounds find work, again after 100 ms, so small
            // rounds (short stalls, little memory) keep up with churn.
            let mut next = Duration::from_secs(5);
            loop {
                tokio::time::sleep(next).await;
                let e = engine.clone();
                next = Duration::from_secs(5);
                // Expired retained messages go too (else only the next
                // retained publish of their tenant or a restart drops them).
                engine.sweep_retained(crate::engine::message::now_ms());
                match tokio::task::spawn_blocking(move || e.compact()).await {
                    Ok(Ok(n)) if n > 0 => {
                        tracing::info!(relocated = n, "compacted sparse segments");
                        next = Duration::from_millis(100);
                    }
                    Ok(Err(e)) => tracing::warn!(error = %e, "compaction failed"),
                    _ => {}
                }
            }
        });
        // The monitors are threads, not tasks: a connection that keeps the
        // runtime's workers busy (a publisher flooding us) must not delay
        // the alarm that stops it.
        let monitors_stop = Arc::new(AtomicBool::new(false));
        let monitors = [
            spawn_monitor("weir-memory", monitors_stop.clone(), {
                let (shared, limit) = (self.shared.clone(), self.limits.memory);
                move |stop| monitor_memory(&shared, limit, stop)
            }),
            spawn_monitor("weir-disk", monitors_stop.clone(), {
                let (shared, limits) = (self.shared.clone(), self.limits.clone());
                move |stop| monitor_disk(&shared, &limits.data_dir, limits.disk_free, stop)
            }),
        ];
        if let Ok(addr) = self.amqp_addr() {
            tracing::info!(%addr, "AMQP listener ready");
        }
        if let Ok(addr) = self.mqtt_listener.local_addr() {
            tracing::info!(%addr, "MQTT listener ready");
        }
        if let Ok(addr) = self.mqtt_ws_listener.local_addr() {
            tracing::info!(%addr, "MQTT WebSocket listener ready");
        }
        if let Ok(addr) = self.http_listener.local_addr() {
            tracing::info!(%addr, "HTTP listener ready");
        }
        let http = tokio::spawn(crate::http::serve(
            self.http_listener,
            crate::http::HttpState::new(self.shared.clone(), self.started, &self.http),
            crate::http::Limits::of(&self.http),
            shutdown_rx.clone(),
        ));
        let tls_watch = self.tls.as_mut().map(|t| {
            for (l, what) in [
                (&t.amqps, "AMQPS"),
                (&t.mqtts, "MQTTS"),
                (&t.mqtt_wss, "MQTT secure WebSocket"),
            ] {
                if let Ok(addr) = l.local_addr() {
                    tracing::info!(%addr, "{what} listener ready");
                }
            }
            tokio::spawn(t.tls.clone().watch(t.hup.take()))
        });
        tokio::pin!(stop);
        loop {
            tokio::select! {
                _ = &mut stop => break,
                accepted = self.listener.accept() => match accepted {
                    Ok((stream, peer)) => {
                        conns.spawn(crate::amqp::session::serve(stream, peer, self.shared.clone(), shutdown_rx.clone()));
                    }
                    Err(e) => {
                        // Out of file descriptors and the like: back off, keep serving.
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                },
                accepted = self.mqtt_listener.accept() => match accepted {
                    Ok((stream, peer)) => {
                        conns.spawn(crate::mqtt::session::serve(stream, peer, self.shared.clone(), shutdown_rx.clone()));
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "MQTT accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                },
                accepted = self.mqtt_ws_listener.accept() => match accepted {
                    Ok((stream, peer)) => {
                        conns.spawn(crate::mqtt::websocket::serve(stream, peer, self.shared.clone(), shutdown_rx.clone()));
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "MQTT WebSocket accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                },
                accepted = accept_opt(self.tls.as_ref().map(|t| &t.amqps)) => match accepted {
                    Ok((stream, peer)) => {
                        let acceptor = self.tls.as_ref().map(|t| t.tls.acceptor());
                        if let Some(acceptor) = acceptor {
                            conns.spawn(serve_tls(TlsProtocol::Amqp, acceptor, stream, peer, self.shared.clone(), shutdown_rx.clone()));
                        }
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "AMQPS accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                },
                accepted = accept_opt(self.tls.as_ref().map(|t| &t.mqtts)) => match accepted {
                    Ok((stream, peer)) => {
                        let acceptor = self.tls.as_ref().map(|t| t.tls.acceptor());
                        if let Some(acceptor) = acceptor {
                            conns.spawn(serve_tls(TlsProtocol::Mqtt, acceptor, stream, peer, self.shared.clone(), shutdown_rx.clone()));
                        }
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "MQTTS accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                },
                accepted = accept_opt(self.tls.as_ref().map(|t| &t.mqtt_wss)) => match accepted {
                    Ok((stream, peer)) => {
                        let acceptor = self.tls.as_ref().map(|t| t.tls.acceptor());
                        if let Some(acceptor) = acceptor {
                            conns.spawn(serve_tls(TlsProtocol::MqttWs, acceptor, stream, peer, self.shared.clone(), shutdown_rx.clone()));
                        }
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "MQTT secure WebSocket accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                },
                Some(_) = conns.join_next(), if !conns.is_empty() => {}
            }
        }
        tracing::info!(
            connections = conns.len(),
            "shutting down: closing connections"
        );
        drop(self.listener);
        drop(self.mqtt_listener);
        drop(self.mqtt_ws_listener);
        drop(self.tls);
        if let Some(w) = tls_watch {
            w.abort();
        }
        let _ = shutdown_tx.send(true);
        let drained = tokio::time::timeout(Duration::from_secs(5), async {
            while conns.join_next().await.is_some() {}
        })
        .await;
        if drained.is_err() {
            tracing::warn!("some connections did not close in time");
            conns.abort_all();
        }
        // Requests in flight had the same grace as the connections.
        http.abort();
        compactor.abort();
        timers.abort();
        monitors_stop.store(true, Ordering::Relaxed);
        for m in monitors.into_iter().flatten() {
            let _ = m.join();
        }
        match self.store.close() {
            Ok(()) => tracing::info!("store flushed and closed"),
            Err(e) => tracing::error!(error = %e, "closing store"),
        }
    }
}

/// Recovery builds large temporary indexes (every live message of every
/// partition) out of many small allocations; once they are freed, glibc keeps
/// the fragmented heap, and a restarted broker would hold far more memory than
/// the same broker before the restart. Hand the free pages back.
fn release_recovery_memory() {
    trim_heap();
}

/// How often resident memory is sampled.
const MEMORY_SAMPLE: Duration = Duration::from_millis(150);
/// How often free disk space is sampled.
const DISK_SAMPLE: Duration = Duration::from_secs(1);
/// While the memory alarm is set, the heap is trimmed at most this often.
const TRIM_IN_ALARM: Duration = Duration::from_secs(1);
/// Outside alarms, how often the heap's free memory is checked for a trim.
const TRIM_CHECK: Duration = Duration::from_secs(5);
/// Free heap memory worth handing back without being asked.
const TRIM_FREE_MIN: usize = 64 << 20;

/// Starts a monitor thread; `None` (logged) if the thread cannot be created.
fn spawn_monitor(
    name: &str,
    stop: Arc<AtomicBool>,
    f: impl FnOnce(&AtomicBool) + Send + 'static,
) -> Option<std::thread::JoinHandle<()>> {
    match std::thread::Builder::new()
        .name(name.into())
        .spawn(move || f(&stop))
    {
        Ok(h) => Some(h),
        Err(e) => {
            tracing::error!(error = %e, thread = name, "cannot start a resource monitor");
            None
        }
    }
}

/// Samples the process's resident memory and sets or clears the memory
/// alarm; hands freed heap memory back to the system after large frees.
fn monitor_memory(shared: &Shared, limit: u64, stop: &AtomicBool) {
    tracing::info!(limit_bytes = limit, "memory watermark");
    let mut last_trim = Instant::now();
    let mut last_check = Instant::now();
    while !stop.load(Ordering::Relaxed) {
        let Some(mut rss) = resident_bytes() else {
            std::thread::sleep(MEMORY_SAMPLE);
            continue;
        };
        // glibc keeps freed memory: trim when someone freed a lot (purge,
        // delete), while over the watermark (so the alarm can clear once
        // consumers drained the queues), or when much of the heap is free.
        // At most once a second: a trim walks the whole heap.
        let may_trim = last_trim.elapsed() >= TRIM_IN_ALARM;
        let asked = may_trim && shared.trim_wanted.swap(false, Ordering::Relaxed);
        let due = (rss > limit && may_trim)
            || (last_check.elapsed() >= TRIM_CHECK && {
                last_check = Instant::now();
                heap_free_bytes() >= TRIM_FREE_MIN
            });
        if asked || due {
            last_trim = Instant::now();
            trim_heap();
            rss = resident_bytes().unwrap_or(rss);
        }
        set_alarm(shared, |a| &mut a.memory, rss > limit, "memory", rss, limit);
        std::thread::sleep(MEMORY_SAMPLE);
    }
}

/// Samples the free space of the data directory's filesystem and sets or
/// clears the disk alarm.
fn monitor_disk(shared: &Shared, dir: &std::path::Path, limit: u64, stop: &AtomicBool) {
    tracing::info!(limit_bytes = limit, "free-disk watermark");
    let mut last = Instant::now()
        .checked_sub(DISK_SAMPLE)
        .unwrap_or_else(Instant::now);
    while !stop.load(Ordering::Relaxed) {
        // Short sleeps so shutdown does not wait a whole sample period.
        if last.elapsed() < DISK_SAMPLE {
            std::thread::sleep(MEMORY_SAMPLE);
            continue;
        }
        last = Instant::now();
        let Ok(free) = weir_backend::free_bytes(dir) else {
            continue;
        };
        set_alarm(shared, |a| &mut a.disk, free < limit, "disk", free, limit);
    }
}

/// Sets or clears one alarm (`field` of [`Alarms`]) and logs the change:
/// WARN when it is set, INFO when it clears. `reading` is the measured
/// value (resident or free bytes) and `limit` the watermark.
fn set_alarm(
    shared: &Shared,
    field: fn(&mut Alarms) -> &mut bool,
    on: bool,
    what: &str,
    reading: u64,
    limit: u64,
) {
    let mut changed = false;
    shared.alarms.send_if_modified(|a| {
        let flag = field(a);
        changed = *flag != on;
        *flag = on;
        changed
    });
    if changed && on {
        tracing::warn!(
            reading_bytes = reading,
            limit_bytes = limit,
            "{what} alarm set: publishers blocked"
        );
    } else if changed {
        tracing::info!(
            reading_bytes = reading,
            limit_bytes = limit,
            "{what} alarm cleared: publishers unblocked"
        );
    }
}

/// Resident memory of this process (`/proc/self/statm`, second field, in pages).
pub(crate) fn resident_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = s.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * page_size())
}

fn page_size() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 {
        p as u64
    } else {
        4096
    }
}

/// Free bytes inside the heap's arenas (memory glibc holds but no one uses).
fn heap_free_bytes() -> usize {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallinfo2 only reads allocator statistics.
        let m = unsafe { libc::mallinfo2() };
        m.fordblks
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        0
    }
}

/// Pins glibc's mmap threshold at 1 MiB (unless `MALLOC_MMAP_THRESHOLD_`
/// is set). glibc raises the threshold to the size of any mmapped chunk that
/// is freed; one argon2 verification (19 MiB) at the first login would move
/// it to 19 MiB, and from then on a growing queue's ready list (a 15 MiB
/// buffer at 256k entries) comes from the heap and stays there once freed:
/// measured, 78 instead of 61 bytes of RSS per queued message at 1M. A
/// fixed threshold keeps buffers of 1 MiB and more in their own mappings,
/// returned to the system when freed. Call once at startup.
pub fn pin_mmap_threshold() {
    if std::env::var_os("MALLOC_MMAP_THRESHOLD_").is_some() {
        return;
    }
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes an allocator tunable; called before the
    // runtime starts, and glibc serialises it with allocations anyway.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 20);
    }
}

/// Returns free heap pages to the system.
fn trim_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only releases free heap memory; no pointers change.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// The authenticator of `cfg`'s users. First, so a bad user table fails
/// before the store is touched; plain passwords are hashed here: slow, off
/// the runtime's workers.
/// The configured users with their hashes resolved (plain passwords are
/// hashed here, on the blocking pool: slow).
async fn configured_users(
    cfg: &Config,
) -> Result<Vec<weir_engine::permissions::UserDef>, ServerError> {
    let specs = cfg.auth.user_specs();
    let users = tokio::task::spawn_blocking(move || {
        let mut seen = std::collections::HashSet::new();
        specs
            .into_iter()
            .map(|s| {
                if !seen.insert(s.name.clone()) {
                    return Err(weir_engine::auth::AuthError::Duplicate(s.name));
                }
                Ok(weir_engine::permissions::UserDef {
                    password_hash: weir_engine::auth::resolve_credential(&s)?,
                    name: s.name,
                    tags: s.tags,
                    loopback_only: s.loopback_only,
                    from_config: true,
                })
            })
            .collect::<Result<Vec<_>, _>>()
    })
    .await
    .map_err(|e| weir_engine::auth::AuthError::Hash(e.to_string()))??;
    Ok(users)
}

/// Makes the configuration's users, permissions and topic permissions the
/// engine's durable definitions (see `Engine::apply_configured`), durable
/// before the first client connects.
async fn apply_users(
    engine: &Arc<Engine>,
    cfg: &Config,
    users: Vec<weir_engine::permissions::UserDef>,
) -> Result<(), ServerError> {
    let (permissions, topic_permissions, defaulted) = cfg.auth.permission_defs();
    if !defaulted.is_empty() {
        tracing::info!(users = ?defaulted, "users without a `permissions` key get every permission on vhost '/' only");
    }
    let waits = engine
        .apply_configured(weir_engine::definitions::Configured {
            users,
            permissions,
            topic_permissions,
        })
        .map_err(|e| ServerError::Policy(format!("users and permissions: {e}")))?;
    for w in waits {
        w.await
            .map_err(|_| ServerError::Policy("the store closed".into()))?
            .map_err(|e| ServerError::Policy(e.to_string()))?;
    }
    tracing::info!(users = engine.authenticator().len(), "authentication ready");
    Ok(())
}

/// Opens (and with `--repair` first repairs) the embedded log store.
fn open_log_store(cfg: &Config) -> Result<Arc<dyn Store>, ServerError> {
    let log_cfg = &cfg.store.log;
    std::fs::create_dir_all(&log_cfg.data_dir).map_err(|e| ServerError::Store {
        dir: log_cfg.data_dir.display().to_string(),
        source: weir_backend::StoreError::io("creating data directory", e),
    })?;
    let opts = LogOptions {
        segment_size: log_cfg.segment_bytes(),
        sync: log_cfg.fsync,
        ..LogOptions::default()
    };
    if cfg.repair {
        let report =
            weir_backend::log::repair(&log_cfg.data_dir).map_err(|source| ServerError::Store {
                dir: log_cfg.data_dir.display().to_string(),
                source,
            })?;
        for (d, q) in report.damages.iter().zip(&report.quarantined) {
            tracing::warn!(damage = %d, quarantine = %q.display(), "repaired the store");
        }
        if !report.damages.is_empty() {
            tracing::warn!(lost_message_ids = ?report.lost_message_ids(), "messages lost to damage");
        }
    }
    let store = LogStore::open(&log_cfg.data_dir, opts).map_err(|source| ServerError::Store {
        dir: log_cfg.data_dir.display().to_string(),
        source,
    })?;
    Ok(store)
}

/// Resolves on SIGTERM or SIGINT.
pub async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(error = %e, "cannot listen for SIGTERM");
                    let _ = ctrl_c.await;
                    return;
                }
            };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}

/// The engine's timer task: runs expiry and dead-lettering when due, each
/// round on a blocking thread (it may read the store), sleeping until the
/// next deadline or until an earlier one is scheduled.
async fn run_timers(engine: Arc<Engine>) {
    use crate::engine::message::now_ms;
    loop {
        let now = now_ms();
        let e = engine.clone();
        let started = std::time::Instant::now();
        let next = tokio::task::spawn_blocking(move || e.run_timers(now))
            .await
            .unwrap_or(None);
        let took = started.elapsed();
        if took >= Duration::from_millis(5) {
            tracing::debug!(ms = took.as_secs_f64() * 1e3, "slow timer round");
        }
        match next {
            // More is due (a partition hands out a bounded batch per round):
            // go again, letting other tasks run first.
            Some(at) if at <= now_ms() => tokio::task::yield_now().await,
            Some(at) => {
                let wait = Duration::from_millis(at.saturating_sub(now_ms()));
                tokio::select! {
                    _ = tokio::time::sleep(wait) => {}
                    _ = engine.timers.changed() => {}
                }
            }
            None => engine.timers.changed().await,
        }
    }
}
