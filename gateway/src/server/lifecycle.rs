//! The broker's life: open the store, recover the engine, apply the
//! configured tenants, users and policies, bind the listeners, serve, and
//! shut down gracefully.

use super::listeners::Listeners;
use super::monitors::{self, Limits};
use super::{Alarms, Services};
use crate::config::Config;
use crate::engine::Engine;
use crate::session::durable::settled;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinSet;
use weir_backend::log::{LogOptions, LogStore};
use weir_backend::Store;
use weir_engine::login::LoginGate;
use weir_protocols::amqp::ServerConfig;

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
    services: Arc<Services>,
    store: Arc<dyn Store>,
    /// The protocol listeners (AMQP, MQTT, MQTT over WebSocket, and their
    /// TLS variants with `[tls]`).
    listeners: Listeners,
    http_listener: TcpListener,
    /// With `[tls]`: the certificates and SIGHUP, for the reload task.
    tls_reload: Option<(Arc<crate::tls::Tls>, crate::tls::Hangup)>,
    limits: Limits,
    /// When the store began opening (uptime).
    started: std::time::Instant,
    /// `[http]`: /metrics options, connection limit and timeouts.
    http: crate::config::HttpConfig,
}

impl Broker {
    /// Opens the store, recovers the engine and binds the listeners.
    pub async fn start(cfg: &Config) -> Result<Self, ServerError> {
        let users = configured_users(cfg).await?;
        let store = match cfg.store.kind {
            crate::config::StoreKind::Log => open_log_store(cfg)?,
            crate::config::StoreKind::Fdb => open_fdb_store(cfg)?,
        };
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
        let engine = Engine::open(store.clone(), crate::engine::SystemClock::shared())?;
        engine.set_codecs(Arc::new(crate::header_codecs::registry()));
        for t in &cfg.tenants {
            let (tenant, wait) = engine
                .add_tenant(&t.name)
                .map_err(|e| ServerError::Policy(e.to_string()))?;
            // Limits come from the file at every start (not stored).
            tenant.set_limits(t.limits().map_err(|e| ServerError::Policy(e.to_string()))?);
            if wait.is_some() {
                settled(&engine, wait)
                    .await
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
            settled(&engine, Some(wait))
                .await
                .map_err(|e| ServerError::Policy(e.to_string()))?;
        }
        let shovels = crate::shovel::Shovels::load(Some(&log_cfg.data_dir))
            .map_err(|e| ServerError::Policy(e.to_string()))?;
        for s in &cfg.shovels {
            shovels
                .put(
                    &s.vhost,
                    &s.name,
                    serde_json::Value::Object(s.value.clone()),
                    &s.user,
                    true,
                )
                .map_err(|e| ServerError::Policy(format!("shovel '{}': {e}", s.name)))?;
        }
        monitors::release_recovery_memory();
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
        // SIGHUP is listened for before the listeners open (see
        // `crate::tls::sighup`).
        let tls = match &cfg.tls {
            Some(files) => Some((crate::tls::Tls::load(files)?, crate::tls::sighup())),
            None => None,
        };
        let listeners = Listeners::bind(cfg, tls.as_ref().map(|(t, _)| t.clone())).await?;
        let http_listener =
            TcpListener::bind(cfg.http.listen)
                .await
                .map_err(|source| ServerError::Bind {
                    addr: cfg.http.listen,
                    source,
                })?;
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
            anonymous_user: m.allow_anonymous.then(|| m.default_user.clone()),
            max_subscriptions: m.max_subscriptions,
        };
        let auth = engine.authenticator().clone();
        Ok(Broker {
            services: Arc::new(Services {
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
                shovels: Arc::new(shovels),
            }),
            store,
            listeners,
            http_listener,
            tls_reload: tls,
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
        self.listener_addr("AMQP")
    }

    /// The bound address of a protocol listener by its name in the logs
    /// ("AMQP", "MQTT", "MQTT WebSocket", "AMQPS", "MQTTS", "MQTT secure
    /// WebSocket").
    pub fn listener_addr(&self, name: &str) -> std::io::Result<SocketAddr> {
        self.listeners.addr(name).ok_or_else(|| {
            std::io::Error::new(std::io::ErrorKind::NotFound, format!("no {name} listener"))
        })
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
        let timers = tokio::spawn(run_timers(self.services.engine.clone()));
        let engine = self.services.engine.clone();
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
                engine.sweep_retained();
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
        // The monitors are threads, not tasks: a connection that keeps
        // the runtime's workers busy (a publisher flooding us) must not delay
        // the alarm that stops it.
        let monitors_stop = Arc::new(AtomicBool::new(false));
        let monitors = monitors::start(&self.services, &self.limits, &monitors_stop);
        self.listeners.log_ready();
        // Shovels start once the broker serves (their local ends are
        // engine clients; their remote ends may take a while).
        self.services.shovels.start(&self.services);
        if let Ok(addr) = self.http_listener.local_addr() {
            tracing::info!(%addr, "HTTP listener ready");
        }
        let http = tokio::spawn(crate::http::serve(
            self.http_listener,
            crate::http::HttpState::new(self.services.clone(), self.started, &self.http),
            crate::http::Limits::of(&self.http),
            shutdown_rx.clone(),
        ));
        let tls_watch = self
            .tls_reload
            .take()
            .map(|(tls, hup)| tokio::spawn(tls.watch(hup)));
        tokio::pin!(stop);
        loop {
            tokio::select! {
                _ = &mut stop => break,
                (i, accepted) = self.listeners.accept() => match accepted {
                    Ok(conn) => {
                        self.listeners.spawn(i, &mut conns, conn, &self.services, &shutdown_rx);
                    }
                    Err(e) => {
                        // Out of file descriptors and the like: back off, keep serving.
                        tracing::warn!(error = %e, "{} accept failed", self.listeners.name(i));
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
        drop(self.listeners);
        if let Some(w) = tls_watch {
            w.abort();
        }
        let _ = shutdown_tx.send(true);
        self.services.shovels.stop();
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
        settled(engine, Some(w))
            .await
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

/// Opens the FoundationDB store (`[store.fdb]`).
#[cfg(feature = "fdb")]
fn open_fdb_store(cfg: &Config) -> Result<Arc<dyn Store>, ServerError> {
    let fdb = &cfg.store.fdb;
    let file = fdb
        .cluster_file
        .as_ref()
        .map_or_else(String::new, |p| p.display().to_string());
    let dir = if file.is_empty() {
        "the default FoundationDB cluster".to_string()
    } else {
        file.clone()
    };
    // The disk monitor still watches the data directory (the spill and
    // nothing else of the store lives there).
    let _ = std::fs::create_dir_all(&cfg.store.log.data_dir);
    let config = weir_store_fdb::FdbStoreConfig::new(&fdb.namespace, &fdb.node_id);
    let store = weir_store_fdb::open_cluster(&file, config)
        .map_err(|source| ServerError::Store { dir, source })?;
    tracing::info!(cluster_file = %file, node = %fdb.node_id, namespace = %fdb.namespace, "FoundationDB store opened");
    Ok(store)
}

/// Refused at configuration load already; kept for the match.
#[cfg(not(feature = "fdb"))]
fn open_fdb_store(_cfg: &Config) -> Result<Arc<dyn Store>, ServerError> {
    Err(ServerError::Store {
        dir: "FoundationDB".into(),
        source: weir_backend::StoreError::Invalid(
            "this weir was built without the fdb feature".into(),
        ),
    })
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
    // Deadlines are on the engine's clock (the system clock here): the
    // engine decides what is due; this task only sleeps until then.
    let now_ms = || engine.clock().now_ms();
    loop {
        let e = engine.clone();
        let started = std::time::Instant::now();
        let next = tokio::task::spawn_blocking(move || e.run_timers())
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
