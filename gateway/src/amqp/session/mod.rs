//! One AMQP connection's session: the mapping of the sans-IO adapter's
//! events onto the engine's [`Client`], run by the session driver
//! ([`crate::session`]), which owns the socket loop.
//!
//! Each turn of the driver hands every complete frame to
//! `Session::handle_event`, then closes the batch (one store append for
//! its settles, one store barrier for every confirm and reply of the batch
//! that waits for the store), and encodes pending deliveries straight into
//! the write buffer. Nothing in event handling waits but a login: replies
//! that must wait for the store (declare-ok and friends) are queued
//! ([`replies`]) with a ticket ([`crate::session::durable`]) and sent when durable, while deliveries,
//! heartbeats and shutdown go on.
//!
//! Where a method's code is:
//! * [`channel`]: per-channel state; channel open/close/flow; releasing.
//! * [`exchange`], [`queue`], [`basic`]: the methods of each class.
//! * [`publish`]: basic.publish (routing, storing, returns).
//! * [`deliver`]: delivery encoding, consumer cancel notices, confirms.
//! * [`replies`]: method replies waiting for durability, in order.
//! * [`tx`]: transactions (tx.select, tx.commit, tx.rollback).
//! * [`failure`]: how an error closes a channel or the connection.

mod basic;
mod channel;
mod deliver;
mod exchange;
mod failure;
mod publish;
mod queue;
mod replies;
mod tx;

use self::channel::Channel;
use self::deliver::PendingConfirm;
use self::failure::{hard, Failure};
use self::replies::Replies;
use crate::amqp::headers::table_to_json;
use crate::engine::consumer::Scope;
use crate::engine::{Client, Engine};
use crate::metrics::{ConnMetrics, Protocol};
use crate::server::Services;
use crate::session::durable::Durability;
use crate::session::io::{Buffers, PollWriter, ReadSide, WriteSide};
use crate::session::{Adapter, Flow, Woken};
use crate::tenant_gate::TenantGate;
use bytes::BytesMut;
use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::net::TcpStream;
use tokio::sync::watch;
use tracing::Instrument as _;
use weir_engine::login::LoginRefused;
use weir_protocols::amqp::methods::{confirm, connection, AMQPClass};
use weir_protocols::amqp::{reply, Connection, Event, Timeout};

/// Bytes of room kept in the read buffer for each read.
const READ_BUFFER: usize = 64 * 1024;
/// How often expired leases are looked for while the client holds any (the
/// engine keeps no expiry deadline; the consumer timeout counts in seconds).
const LEASE_CHECK: Duration = Duration::from_secs(1);

/// Serves one accepted AMQP connection until it closes.
pub async fn serve(
    stream: TcpStream,
    peer: SocketAddr,
    services: Arc<Services>,
    shutdown: watch::Receiver<bool>,
) {
    let _ = stream.set_nodelay(true);
    // The socket's own readiness and non-blocking calls.
    serve_on(&stream, &stream, peer, None, services, shutdown).await;
}

/// Serves one AMQP connection over TLS (handshake done) until it closes.
/// A verified client certificate (`identity`) makes SASL EXTERNAL
/// available, logging in as the certificate's subject CN.
pub async fn serve_tls(
    stream: crate::tls::TlsStream,
    peer: SocketAddr,
    identity: crate::tls::PeerIdentity,
    services: Arc<Services>,
    shutdown: watch::Receiver<bool>,
) {
    let (rd, wr) = tokio::io::split(stream);
    serve_on(
        rd,
        PollWriter::new(wr),
        peer,
        Some(identity),
        services,
        shutdown,
    )
    .await;
}

/// Serves one connection over a reader and a writer; `tls` is the client's
/// TLS identity on a TLS listener.
async fn serve_on<R: ReadSide, W: WriteSide>(
    rd: R,
    wr: W,
    peer: SocketAddr,
    tls: Option<crate::tls::PeerIdentity>,
    services: Arc<Services>,
    shutdown: watch::Receiver<bool>,
) {
    let server_cfg = services.amqp.clone();
    // EXTERNAL is offered only to a client whose certificate verified.
    let tls_session = tls.is_some();
    let cert_user = tls
        .filter(|t| t.verified)
        .map(|t| t.common_name.unwrap_or_default());
    let mut conn = Connection::new_at(server_cfg, Instant::now());
    if cert_user.is_some() {
        conn.offer_external();
    }
    let mut s = Session {
        flow: Flow::new(services.alarms.subscribe()),
        shared: services.clone(),
        engine: services.engine.clone(),
        conn,
        client: None,
        user: String::new(),
        user_tags: Vec::new(),
        cert_user,
        peer,
        channels: HashMap::new(),
        durability: Durability::default(),
        confirms: VecDeque::new(),
        replies: Replies::default(),
        notices: Vec::new(),
        held: Vec::new(),
        next_epoch: 0,
        next_consumer_tag: 0,
        login_refusal: None,
        blocked_sent: false,
        tx_bytes: 0,
        peer_closed: false,
        metrics: None,
        pre_open: Default::default(),
        registration: None,
        tls: tls_session,
        stall: None,
        lease_check: None,
    };
    // One span per connection: every event of the session logs inside it;
    // `user` and `vhost` are filled in at login and connection.open.
    let span = tracing::info_span!(
        "amqp",
        %peer,
        user = tracing::field::Empty,
        vhost = tracing::field::Empty
    );
    tracing::debug!(parent: &span, "AMQP connection accepted");
    let result = crate::session::run(&mut s, rd, wr, shutdown)
        .instrument(span.clone())
        .await;
    let _in = span.enter();
    s.release_all();
    match result {
        Ok(()) => tracing::debug!(%peer, "AMQP connection closed"),
        Err(e) => tracing::info!(%peer, error = %e, "AMQP connection ended"),
    }
}

/// A refused login, answered once the throttle's delay has passed.
struct LoginRefusal {
    at: tokio::time::Instant,
    text: String,
}

/// A login, checked off the event loop (the password hash is slow).
pub(crate) struct Login {
    mechanism: String,
    username: String,
    password: weir_protocols::Secret,
}

/// What woke the session besides its socket.
pub(crate) enum Wake {
    /// The engine's outbox (deliveries, notices, durable answers) or the
    /// flow.
    Turn,
    /// A refused login's delay is over.
    LoginRefusal,
}

pub(crate) struct Session {
    /// The broker's services (engine, login throttle, limits, registry).
    shared: Arc<Services>,
    engine: Arc<Engine>,
    conn: Connection,
    /// The engine client, from connection.open on.
    client: Option<Client>,
    /// Who logged in.
    user: String,
    /// Their tags at login (`impersonator` lets publishes carry another
    /// `user_id`).
    user_tags: Vec<String>,
    /// On TLS with a verified client certificate: its subject CN (empty if
    /// it has none), the user of a SASL EXTERNAL login.
    cert_user: Option<String>,
    peer: SocketAddr,
    channels: HashMap<u16, Channel>,
    /// Tickets of the confirms, replies and commit-oks waiting for the
    /// store.
    durability: Durability,
    /// Publisher confirms waiting for their ticket, in ticket order.
    confirms: VecDeque<PendingConfirm>,
    /// Method replies waiting for the store, and those queued behind them.
    replies: Replies,
    notices: Vec<crate::engine::consumer::Notice>,
    /// Deliveries of consumers whose consume-ok is still queued (reused).
    held: Vec<crate::engine::consumer::Delivery>,
    /// Counter behind [`Channel::epoch`].
    next_epoch: u64,
    /// Counter behind server-generated consumer tags.
    next_consumer_tag: u64,
    /// A refused login waiting out its delay: no input is interpreted
    /// meanwhile.
    login_refusal: Option<LoginRefusal>,
    /// The broker's resource alarms and the tenant's gate (from
    /// connection.open on). (As in RabbitMQ, a connection that only
    /// consumes, acks, purges or deletes is never blocked: that is what
    /// frees resources.)
    flow: Flow,
    /// connection.blocked was sent and not yet followed by unblocked.
    blocked_sent: bool,
    /// Bytes held by the uncommitted transactions of every channel
    /// (bounded by [`tx::MAX_TX_BYTES`]).
    tx_bytes: usize,
    /// The client sent connection.close (and got close-ok): what it still
    /// sends is read and dropped until it hangs up
    /// ([`Adapter::lingers`]).
    peer_closed: bool,
    /// Its tenant's and protocol's counters (from connection.open on).
    metrics: Option<ConnMetrics>,
    /// The handshake's traffic, until there are metrics to add it to.
    pre_open: crate::metrics::PreOpen,
    /// In the registry of live connections (management API), from
    /// connection.open on.
    registration: Option<crate::connections::Registration>,
    /// Over TLS.
    tls: bool,
    /// Partly received content: how much, and since when it has not grown
    /// (only while it counts, see [`Adapter::deadline`]).
    stall: Option<(usize, Instant)>,
    /// When to look for leases past the consumer timeout.
    lease_check: Option<Instant>,
}

/// The engine scope of an AMQP channel.
fn scope(ch: u16) -> Scope {
    Scope::from(ch)
}

/// The AMQP channel of an engine scope (scopes are only made from channels).
fn channel_of(scope: Scope) -> u16 {
    debug_assert!(scope <= Scope::from(u16::MAX), "scope is a channel number");
    u16::try_from(scope).unwrap_or(0)
}

/// Resolves when `client`'s outbox is notified; never without a client.
async fn notified(client: Option<&Client>) {
    match client {
        Some(c) => c.handle().notified().await,
        None => std::future::pending().await,
    }
}

/// Resolves at `at`; never without a time. (A disabled `select!` branch
/// still builds its future: this builds no timer unless one is wanted.)
async fn sleep_until(at: Option<tokio::time::Instant>) {
    match at {
        Some(t) => tokio::time::sleep_until(t).await,
        None => std::future::pending().await,
    }
}

impl Adapter for Session {
    type Event = Event;
    type Await = Login;
    type Wake = Wake;
    const BUFFERS: Buffers = Buffers::Fixed(READ_BUFFER);

    fn out(&mut self) -> &mut BytesMut {
        self.conn.out()
    }

    fn flow(&mut self) -> &mut Flow {
        &mut self.flow
    }

    fn is_finished(&self) -> bool {
        self.conn.is_finished()
    }

    fn begin_turn(&mut self) {
        // Closed through the management API (320, its reason): the
        // registry wakes the engine connection, so this runs.
        if let Some(reason) = self.registration.as_ref().and_then(|r| r.close_reason()) {
            self.registration = None;
            self.release_all();
            self.conn.shutdown(&reason);
        }
        self.send_durable();
    }

    fn poll_event(&mut self, input: &mut BytesMut) -> Option<Event> {
        if self.login_refusal.is_some() {
            return None;
        }
        self.conn.poll(input)
    }

    fn handle_event(&mut self, ev: Event) -> Option<Login> {
        self.handle_event(ev)
    }

    fn complete(&mut self, l: Login) -> impl Future<Output = ()> + Send {
        self.login(l)
    }

    fn end_batch(&mut self) {
        self.close_batch();
        self.flow.end_batch(self.client.as_mut());
        self.signal_alarm();
    }

    fn deliver(&mut self) -> bool {
        self.conn.is_open() && self.write_deliveries()
    }

    fn on_clock(&mut self, now: Instant, read: bool, fired: bool) {
        if read {
            self.conn.on_read(now);
        }
        if fired {
            self.on_timer(now);
        }
    }

    fn on_read(&mut self, n: usize) {
        match self.metrics.as_mut() {
            Some(m) => m.bytes_in(n),
            None => self.pre_open.read(n),
        }
    }

    fn wrote(&mut self, n: usize, now: Instant) {
        if n > 0 {
            self.conn.on_write(now);
        }
        match self.metrics.as_mut() {
            Some(m) => {
                if n > 0 {
                    m.bytes_out(n);
                }
                m.flush();
            }
            None if n > 0 => self.pre_open.wrote(n),
            None => {}
        }
    }

    fn on_eof(&mut self) {
        // The peer went away: nothing more can be written.
        self.conn.out().clear();
        self.conn.abandon();
    }

    fn wants_input(&mut self) -> bool {
        // While a resource alarm is set, a connection that publishes is not
        // read (after the publish in hand, or in the middle of one); one
        // that only consumes is.
        if self.flow.alarmed() && !self.flow.blocked && self.conn.partial_content_bytes() > 0 {
            self.flow.blocked = true;
            self.signal_alarm();
        }
        !self.replies.is_full() && self.login_refusal.is_none()
    }

    fn deadline(&mut self, now: Instant, reading: bool, buffered: usize) -> Option<Instant> {
        if reading {
            self.conn.resume_reads(now);
        } else {
            // We stopped reading, not the client: its heartbeats are
            // waiting in the socket.
            self.conn.pause_reads(now);
        }
        // A client that stops in the middle of a message holds its
        // buffered frames: it is cut off once its content has not grown
        // for the timeout. Time we did not read it does not count, except
        // a message of several frames held through a resource alarm: that
        // memory is what the alarm waits for. (A publish cut off between
        // its frames by the block is small: it waits for the alarm like
        // the rest of the publisher.)
        let stall_at = match self.shared.partial_content_timeout {
            Some(limit) => {
                let assembling = self.conn.partial_content_bytes();
                let partial = assembling + buffered;
                let held_through_alarm = self.flow.blocked && assembling > self.conn.frame_max();
                let paused = !reading && !held_through_alarm;
                if partial == 0 || paused || !self.conn.is_open() {
                    self.stall = None;
                } else if self.stall.is_none_or(|(bytes, _)| bytes != partial) {
                    self.stall = Some((partial, now));
                }
                self.stall.map(|(_, since)| since + limit)
            }
            None => None,
        };
        if self.lease_check.is_none() && self.client.is_some() {
            // No lease is older than the client.
            self.lease_check = self.shared.consumer_timeout.map(|t| now + t);
        }
        [self.conn.poll_timeout(), stall_at, self.lease_check]
            .into_iter()
            .flatten()
            .min()
    }

    fn wait(&mut self) -> (&mut BytesMut, impl Future<Output = Wake> + Send + '_) {
        let refusal_at = self.login_refusal.as_ref().map(|r| r.at);
        let client = self.client.as_ref();
        let flow = &mut self.flow;
        let wake = async move {
            tokio::select! {
                biased;
                // Deliveries, notices, and answers made durable.
                _ = notified(client) => Wake::Turn,
                () = flow.changed() => Wake::Turn,
                _ = sleep_until(refusal_at), if refusal_at.is_some() => Wake::LoginRefusal,
            }
        };
        (self.conn.out(), wake)
    }

    fn woken(&mut self, w: Wake) -> Woken {
        if let Wake::LoginRefusal = w {
            if let Some(r) = self.login_refusal.take() {
                self.conn.refuse_login(&r.text);
            }
        }
        Woken::Turn
    }

    fn on_shutdown(&mut self) {
        self.release_all();
        self.conn.shutdown("broker shutdown");
    }

    fn lingers(&self) -> bool {
        self.peer_closed
    }
}

impl Session {
    /// Maps one adapter event onto the engine. Nothing here waits: durable
    /// replies go through [`Replies`], and a login is handed back to be
    /// checked by [`Session::login`].
    fn handle_event(&mut self, ev: Event) -> Option<Login> {
        match ev {
            Event::Login {
                mechanism,
                username,
                password,
            } => {
                return Some(Login {
                    mechanism,
                    username,
                    password,
                })
            }
            Event::OpenVhost { vhost } => match Client::open(&self.engine, &vhost, &self.user) {
                Ok(mut client) => {
                    client.set_tags(&self.user_tags);
                    tracing::Span::current().record("vhost", vhost.as_str());
                    let mut metrics = ConnMetrics::open(Protocol::Amqp, &vhost);
                    metrics.before_open(&std::mem::take(&mut self.pre_open));
                    // `[[quota.connections]]`: by login and connection name.
                    let rule = self
                        .engine
                        .connection_quotas
                        .find(&self.user, self.conn.client_connection_name());
                    self.flow.gate = TenantGate::for_client(&client, rule.as_deref()).map(Box::new);
                    // max-channels-per-connection (a connection rule's
                    // replaces the tenant's and user's), refused by the
                    // adapter before channel.open-ok.
                    let channels = rule
                        .and_then(|r| r.max_channels_per_connection)
                        .or(client.max_channels());
                    self.conn.limit_open_channels(channels);
                    let engine = client.handle().clone();
                    self.client = Some(client);
                    let registration =
                        self.shared
                            .connections
                            .register(crate::connections::NewConnection {
                                protocol: "AMQP 0-9-1",
                                peer: self.peer,
                                local: None,
                                user: &self.user,
                                vhost: &vhost,
                                tls: self.tls,
                                client_id: "",
                                engine: &engine,
                                client_properties: Some(table_to_json(
                                    &self.conn.take_client_properties(),
                                )),
                            });
                    metrics.report_to(registration.info().clone());
                    self.metrics = Some(metrics);
                    self.registration = Some(registration);
                    self.conn.accept_open();
                }
                // The tenant's max-connections: 530 with RabbitMQ's text.
                Err(crate::engine::EngineError::Quota(q)) => {
                    crate::metrics::quota_refused(Protocol::Amqp);
                    self.conn.refuse_open(&q.to_string())
                }
                // No such vhost, or no permissions there: 530 NOT_ALLOWED
                // with RabbitMQ's texts.
                Err(e) => {
                    let text = match e {
                        crate::engine::EngineError::AccessRefused(t) => t,
                        _ => format!("vhost {vhost} not found"),
                    };
                    tracing::info!(peer = %self.peer, user = %self.user, %vhost, "vhost access refused");
                    self.conn.refuse_open(&text);
                }
            },
            Event::UpdateSecret { secret: _, reason } => {
                // RabbitMQ hands the new secret to its auth backends; its
                // internal (password) backend accepts any and keeps the
                // user as it is, and so does Weir: the secret is for
                // credentials that expire (tokens), which Weir's users do
                // not have. What is checked again is the user: it must
                // still exist (and pass the loopback rule) and still have
                // access to the vhost; otherwise 530 with RabbitMQ's text.
                let still = self
                    .shared
                    .login_certificate(&self.user, self.peer)
                    .ok()
                    .filter(|_| {
                        self.client
                            .as_mut()
                            .is_some_and(|c| c.recheck_access().is_ok())
                    });
                match still {
                    Some(p) => {
                        tracing::debug!(peer = %self.peer, user = %self.user, %reason, "secret updated");
                        self.user_tags = p.tags;
                        if let Some(c) = self.client.as_mut() {
                            c.set_tags(&self.user_tags);
                        }
                        self.conn.accept_update_secret();
                    }
                    None => {
                        tracing::info!(peer = %self.peer, user = %self.user, "secret update refused");
                        self.conn
                            .refuse_update_secret("New secret was refused by one of the backends");
                    }
                }
            }
            Event::ChannelOpened(ch) => {
                self.on_channel_opened(ch);
                if let Some(r) = &self.registration {
                    r.channel_opened(ch);
                }
            }
            Event::ChannelClosed(ch) => {
                self.release_channel(ch);
                if let Some(r) = &self.registration {
                    r.channel_closed(ch);
                }
            }
            Event::Closed => {
                self.peer_closed = true;
                self.release_all();
            }
            Event::Flow { channel, active } => {
                if self.channels.contains_key(&channel) {
                    if let Some(c) = self.client.as_mut() {
                        c.set_flow(scope(channel), active);
                    }
                }
            }
            Event::Qos {
                channel,
                prefetch_size,
                prefetch_count,
                global,
            } => {
                if self.usable(channel) {
                    self.on_qos(channel, prefetch_size, prefetch_count, global);
                }
            }
            Event::Publish { channel, message } => {
                if !self.usable(channel) {
                    return None;
                }
                // The publish in hand is taken; then no more reads until
                // the alarm (or the tenant's block) clears.
                self.flow.published(message.body.len());
                if let Some(m) = self.metrics.as_mut() {
                    m.received();
                }
                if let Err(f) = self.on_publish(channel, message) {
                    self.fail(channel, f, 60, 40);
                }
            }
            Event::Ack {
                channel,
                delivery_tag,
                multiple,
            } => {
                if !self.usable(channel) {
                    return None;
                }
                if let Err(f) = self.on_settle(
                    channel,
                    delivery_tag,
                    multiple,
                    crate::engine::lease::Settle::Ack,
                ) {
                    self.fail(channel, f, 60, 80);
                }
            }
            Event::Method { channel, method } => {
                if !self.usable(channel) {
                    return None;
                }
                let (class_id, method_id) =
                    (method.get_amqp_class_id(), method.get_amqp_method_id());
                // Methods other than publish and ack: cheap enough for a
                // span each (debug level, so nothing unless asked for).
                let _op =
                    tracing::debug_span!("amqp.method", channel, class_id, method_id).entered();
                if let Err(f) = self.on_method(channel, method) {
                    self.fail(channel, f, class_id, method_id);
                }
            }
        }
        None
    }

    /// Checks a login (the only event that waits: the password check runs
    /// off the runtime's workers, behind the login throttle).
    async fn login(&mut self, l: Login) {
        let Login {
            mechanism,
            username,
            password,
        } = l;
        // EXTERNAL: the verified certificate's CN is the user (the
        // adapter only lets it through when offered).
        let (username, principal) = match (mechanism.as_str(), &self.cert_user) {
            ("EXTERNAL", Some(cn)) => {
                let p = self.shared.login_certificate(cn, self.peer);
                (
                    cn.clone(),
                    p.map_err(|_| self.shared.login_refused(self.peer)),
                )
            }
            ("EXTERNAL", None) => (username, Err(self.shared.login_refused(self.peer))),
            _ => {
                let p = self.shared.login(&username, &password, self.peer).await;
                (username, p)
            }
        };
        match principal {
            Ok(p) => {
                tracing::Span::current().record("user", username.as_str());
                self.user = username;
                self.user_tags = p.tags;
                self.conn.accept_login();
            }
            Err(refused) => {
                // Slow down guessing from this address: the refusal
                // is sent after the delay, and this connection's
                // input is not interpreted meanwhile (its task keeps
                // running).
                crate::metrics::auth_failure(Protocol::Amqp);
                let delay = refused.delay();
                tracing::info!(peer = %self.peer, user = %username, %mechanism, delay_ms = delay.as_millis() as u64, reason = %refused, "login refused");
                let text = match refused {
                    LoginRefused::Failed { .. } => {
                        format!("Login was refused using authentication mechanism {mechanism}.")
                    }
                    // Said, so an operator sees why a right password fails.
                    _ => format!(
                        "Login was refused using authentication mechanism {mechanism}: {refused}."
                    ),
                };
                self.login_refusal = Some(LoginRefusal {
                    at: tokio::time::Instant::now() + delay,
                    text,
                });
            }
        }
    }

    /// Whether events of `ch` are to be interpreted: open in the adapter,
    /// and not failed while earlier replies were still queued.
    fn usable(&self, ch: u16) -> bool {
        self.conn.channel_is_usable(ch) && !self.channels.get(&ch).is_some_and(|c| c.failed)
    }

    /// The engine client; methods arrive only after connection.open.
    fn client(&mut self) -> Result<&mut Client, Failure> {
        self.client
            .as_mut()
            .ok_or_else(|| hard(reply::COMMAND_INVALID, "connection not open".into()))
    }

    /// Closes the batch: the engine client's settles and dispatches, each
    /// channel's confirms, then one store barrier for every ticket the
    /// batch handed out (confirms, replies, commit-oks), and what can be
    /// answered now (a refused barrier fails its answers at once).
    fn close_batch(&mut self) {
        if let Some(c) = self.client.as_mut() {
            c.commit();
        }
        self.send_confirms();
        if let Err(e) = self.durability.end_batch(self.client.as_mut()) {
            tracing::error!(error = %e, "store refused a durability barrier");
        }
        self.send_durable();
    }

    /// Sends the confirms and replies whose tickets are settled.
    fn send_durable(&mut self) {
        self.send_ready_confirms();
        self.send_ready_replies();
    }

    /// The driver's timer fired (possibly early: every check looks at
    /// `now`). `self.stall` is the partly received content and since when
    /// it has not grown, as of the last turn; `self.lease_check` when to
    /// look for expired leases.
    fn on_timer(&mut self, now: Instant) {
        self.conn.handle_timeout(now);
        match self.conn.timed_out() {
            Some(Timeout::Heartbeat) => {
                tracing::info!(peer = %self.peer, "missed heartbeats from client, closing");
            }
            Some(Timeout::Handshake) => {
                tracing::info!(peer = %self.peer, "handshake not completed in time, closing");
            }
            Some(t) => tracing::debug!(peer = %self.peer, timeout = %t, "closing"),
            None => {}
        }
        if self.lease_check.is_some_and(|at| now >= at) {
            self.lease_check = self.expire_leases(now);
        }
        // Nothing was read since the stall was measured (a read and the
        // timer are different wake-ups), so it still holds.
        if let (Some(limit), Some((bytes, since))) =
            (self.shared.partial_content_timeout, self.stall)
        {
            if now >= since + limit && self.conn.is_open() {
                tracing::info!(peer = %self.peer, bytes, "partly received message stalled, closing");
                let text = format!(
                    "{bytes} bytes of a message received and no progress for {} s",
                    limit.as_secs()
                );
                self.fail(0, hard(reply::RESOURCE_ERROR, text), 0, 0);
                self.stall = None;
                self.shared.request_trim();
            }
        }
    }

    /// Closes channels holding a lease older than the consumer timeout, as
    /// RabbitMQ's `consumer_timeout` does: the channel's leases return to
    /// their queues (redelivered) for other consumers. Returns when to look
    /// again: soon while leases are held, else a whole timeout later (a
    /// lease taken from now on cannot expire sooner); `None` without a
    /// timeout or a client.
    fn expire_leases(&mut self, now: Instant) -> Option<Instant> {
        let timeout = self.shared.consumer_timeout?;
        let expired = self.client.as_ref()?.expired_scopes(now, timeout);
        for s in expired {
            let ch = channel_of(s);
            let text = format!(
                "PRECONDITION_FAILED - delivery acknowledgement on channel {ch} timed out. Timeout value used: {} ms",
                timeout.as_millis()
            );
            self.fail(ch, Failure::Channel(reply::PRECONDITION_FAILED, text), 0, 0);
        }
        let client = self.client.as_ref()?;
        let held = self.channels.keys().any(|&ch| client.leases(scope(ch)) > 0);
        Some(now + if held { LEASE_CHECK } else { timeout })
    }

    /// Tells the client (`connection.blocked` / `connection.unblocked`) when
    /// it is blocked by a resource alarm, and when that alarm clears.
    fn signal_alarm(&mut self) {
        let set = self.flow.blocked;
        if set == self.blocked_sent || !self.conn.is_open() || !self.conn.accepts_blocked() {
            return;
        }
        if set {
            match self.flow.gate.as_ref() {
                Some(g) if g.blocked() => crate::metrics::quota_block(g.tenant()),
                _ => crate::metrics::alarm_block(Protocol::Amqp),
            }
        }
        let method = if set {
            connection::AMQPMethod::Blocked(connection::Blocked {
                reason: match self.flow.gate.as_ref() {
                    Some(g) if g.blocked() => g.reason().into(),
                    _ => self.flow.alarm().reason().into(),
                },
            })
        } else {
            connection::AMQPMethod::Unblocked(connection::Unblocked {})
        };
        self.conn.send_method(0, AMQPClass::Connection(method));
        self.blocked_sent = set;
    }

    /// Methods other than publish and ack, by class.
    fn on_method(&mut self, ch: u16, method: AMQPClass) -> Result<(), Failure> {
        let ids = (method.get_amqp_class_id(), method.get_amqp_method_id());
        match method {
            AMQPClass::Exchange(m) => self.on_exchange(ch, m, ids),
            AMQPClass::Queue(m) => self.on_queue(ch, m, ids),
            AMQPClass::Basic(m) => self.on_basic(ch, m),
            AMQPClass::Confirm(confirm::AMQPMethod::Select(s)) => {
                if let Some(c) = self.channels.get_mut(&ch) {
                    if c.tx.is_some() {
                        return Err(failure::soft(
                            reply::PRECONDITION_FAILED,
                            "cannot switch from tx to confirm mode".into(),
                        ));
                    }
                    c.confirm = true;
                }
                if !s.nowait {
                    self.reply(
                        ch,
                        AMQPClass::Confirm(confirm::AMQPMethod::SelectOk(confirm::SelectOk {})),
                    );
                }
                Ok(())
            }
            AMQPClass::Access(_) => {
                use weir_protocols::amqp::methods::access;
                self.reply(
                    ch,
                    AMQPClass::Access(access::AMQPMethod::RequestOk(access::RequestOk {})),
                );
                Ok(())
            }
            AMQPClass::Tx(m) => self.on_tx(ch, m, ids),
            other => Err(hard(
                reply::COMMAND_INVALID,
                format!(
                    "method {}.{} is not valid here",
                    other.get_amqp_class_id(),
                    other.get_amqp_method_id()
                ),
            )),
        }
    }

    /// An empty queue name means the channel's last declared queue, as in
    /// RabbitMQ.
    fn queue_name(&self, ch: u16, name: &str) -> Result<String, Failure> {
        if !name.is_empty() {
            return Ok(name.to_string());
        }
        self.channels
            .get(&ch)
            .and_then(|c| c.last_queue.clone())
            .ok_or_else(|| failure::soft(reply::NOT_FOUND, "no previously declared queue".into()))
    }
}
