//! One AMQP connection's task: socket I/O around the sans-IO adapter, and the
//! mapping of its events onto the engine's [`Client`].
//!
//! The loop reads whatever bytes are there, handles every complete frame in
//! them, then closes the batch (one store append for its settles, one
//! confirm per channel), encodes pending deliveries straight into the write
//! buffer and writes everything with as few syscalls as the socket allows.
//! Nothing in event handling waits: replies that must wait for the store
//! (declare-ok and friends) are queued ([`replies`]) and sent when durable,
//! while deliveries, heartbeats and shutdown go on.
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
use self::deliver::StoreConfirm;
use self::failure::{hard, Failure};
use self::replies::Replies;
use crate::amqp::headers::table_to_json;
use crate::engine::consumer::Scope;
use crate::engine::{Client, Engine};
use crate::metrics::{ConnMetrics, Protocol};
use crate::server::{Alarms, Shared};
use crate::tenant_gate::{self, TenantGate};
use bytes::BytesMut;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, watch};
use tracing::Instrument as _;
use weir_engine::login::LoginRefused;
use weir_protocols::amqp::methods::{confirm, connection, AMQPClass};
use weir_protocols::amqp::{reply, Connection, Event, Timeout};

/// Stop reading from a client while this much output is unwritten.
const OUT_HIGH_WATER: usize = 4 << 20;
/// Stop encoding deliveries while this much output is unwritten.
const DELIVERY_HIGH_WATER: usize = 1 << 20;
/// How long a finished connection may take to flush what a TLS stream
/// still buffers.
const FINAL_FLUSH: Duration = Duration::from_secs(1);
/// How long a connection whose close handshake is done keeps reading (and
/// dropping) what the client still sends, waiting for it to close the
/// socket (see [`linger`]).
const CLOSE_LINGER: Duration = Duration::from_secs(2);
/// How often expired leases are looked for while the client holds any (the
/// engine keeps no expiry deadline; the consumer timeout counts in seconds).
const LEASE_CHECK: Duration = Duration::from_secs(1);

/// Serves one accepted AMQP connection until it closes.
pub async fn serve(
    stream: TcpStream,
    peer: SocketAddr,
    shared: Arc<Shared>,
    shutdown: watch::Receiver<bool>,
) {
    let _ = stream.set_nodelay(true);
    // The socket's own readiness and non-blocking calls, as before: the
    // plain-TCP path is unchanged by the generic session.
    serve_on(&stream, &stream, peer, None, shared, shutdown).await;
}

/// Serves one AMQP connection over TLS (handshake done) until it closes.
/// A verified client certificate (`identity`) makes SASL EXTERNAL
/// available, logging in as the certificate's subject CN.
pub async fn serve_tls(
    stream: crate::tls::TlsStream,
    peer: SocketAddr,
    identity: crate::tls::PeerIdentity,
    shared: Arc<Shared>,
    shutdown: watch::Receiver<bool>,
) {
    let (rd, wr) = tokio::io::split(stream);
    let mut wr = PollWriter::new(wr);
    serve_on(rd, &mut wr, peer, Some(identity), shared, shutdown).await;
}

/// Serves one connection over a reader and a writer (see [`ReadSide`],
/// [`WriteSide`]); `tls` is the client's TLS identity on a TLS listener.
async fn serve_on<R: ReadSide, W: WriteSide>(
    rd: R,
    wr: W,
    peer: SocketAddr,
    tls: Option<crate::tls::PeerIdentity>,
    shared: Arc<Shared>,
    shutdown: watch::Receiver<bool>,
) {
    let (confirm_tx, confirm_rx) = mpsc::unbounded_channel();
    let server_cfg = shared.amqp.clone();
    // EXTERNAL is offered only to a client whose certificate verified.
    let tls_session = tls.is_some();
    let cert_user = tls
        .filter(|t| t.verified)
        .map(|t| t.common_name.unwrap_or_default());
    let mut conn = Connection::new_at(server_cfg, Instant::now());
    if cert_user.is_some() {
        conn.offer_external();
    }
    let alarms = shared.alarms.subscribe();
    let mut s = Session {
        shared: shared.clone(),
        engine: shared.engine.clone(),
        conn,
        client: None,
        user: String::new(),
        user_tags: Vec::new(),
        cert_user,
        peer,
        channels: HashMap::new(),
        confirm_tx,
        replies: Replies::default(),
        notices: Vec::new(),
        held: Vec::new(),
        deliveries_wait_room: false,
        next_epoch: 0,
        next_consumer_tag: 0,
        login_refusal: None,
        alarms,
        alarm: Alarms::default(),
        gate: None,
        blocked_sent: false,
        blocked: false,
        tx_bytes: 0,
        peer_closed: false,
        metrics: None,
        pre_open: Default::default(),
        registration: None,
        tls: tls_session,
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
    let result = s
        .run(rd, wr, confirm_rx, shutdown)
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

struct Session {
    shared: Arc<Shared>,
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
    confirm_tx: mpsc::UnboundedSender<StoreConfirm>,
    /// Method replies waiting for the store, and those queued behind them.
    replies: Replies,
    notices: Vec<crate::engine::consumer::Notice>,
    /// Deliveries of consumers whose consume-ok is still queued (reused).
    held: Vec<crate::engine::consumer::Delivery>,
    /// The last [`Session::write_deliveries`] stopped at
    /// [`DELIVERY_HIGH_WATER`] with deliveries (or replies) left: once the
    /// buffer drains below it, the loop must come back for them by itself.
    /// They were already taken from the outbox (no wake-up is pending for
    /// them), they hold their consumer's credit (the queue pushes nothing
    /// more), and a no-ack consumer sends nothing that would wake us.
    deliveries_wait_room: bool,
    /// Counter behind [`Channel::epoch`].
    next_epoch: u64,
    /// Counter behind server-generated consumer tags.
    next_consumer_tag: u64,
    /// A refused login waiting out its delay: no input is interpreted
    /// meanwhile.
    login_refusal: Option<LoginRefusal>,
    /// The broker's resource alarms.
    alarms: watch::Receiver<Alarms>,
    /// Their last seen state.
    alarm: Alarms,
    /// The tenant's block and publish rate (from connection.open on).
    gate: Option<TenantGate>,
    /// connection.blocked was sent and not yet followed by unblocked.
    blocked_sent: bool,
    /// It published while an alarm was set: not read until the alarm
    /// clears. (As in RabbitMQ, a connection that only consumes, acks,
    /// purges or deletes is never blocked: that is what frees resources.)
    blocked: bool,
    /// Bytes held by the uncommitted transactions of every channel
    /// (bounded by [`tx::MAX_TX_BYTES`]).
    tx_bytes: usize,
    /// The client sent connection.close (and got close-ok): what it still
    /// sends is read and dropped until it hangs up (see [`linger`]).
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

impl Session {
    async fn run<R: ReadSide, W: WriteSide>(
        &mut self,
        mut rd: R,
        mut wr: W,
        mut confirm_rx: mpsc::UnboundedReceiver<StoreConfirm>,
        mut shutdown: watch::Receiver<bool>,
    ) -> std::io::Result<()> {
        let mut input = BytesMut::with_capacity(64 * 1024);
        // One timer for every deadline: the adapter's (heartbeat, handshake,
        // close), the partial-content stall and the lease check. It is
        // re-armed only when an earlier deadline is wanted: deadlines move
        // later with every read and write, and firing early is harmless
        // (each check looks at the time again), so the hot loop does not
        // touch the timer wheel per batch.
        let timer = tokio::time::sleep(Duration::ZERO);
        tokio::pin!(timer);
        let mut armed: Option<Instant> = None;
        // The timer fired: its checks run at the next clock read.
        let mut fired = false;
        // Bytes were read: reported to the adapter at the next clock read.
        let mut got_input = false;
        let mut eof = false;
        // Partly received content: how much, and since when it has not
        // grown (only while it counts, see below).
        let mut stall: Option<(usize, Instant)> = None;
        // When to look for leases past the consumer timeout.
        let mut lease_check: Option<Instant> = None;
        self.alarm = *self.alarms.borrow_and_update();
        loop {
            // A publish is judged against the alarms as they are now: one
            // atomic load per loop, no waiter registered (only a blocked
            // connection waits for the alarm to clear, below).
            if self.alarms.has_changed().unwrap_or(false)
                || self.gate.as_mut().is_some_and(|g| g.refresh())
            {
                self.refresh_alarm();
            }
            // Closed through the management API (320, its reason): the
            // registry wakes the engine connection, so this runs.
            if let Some(reason) = self.registration.as_ref().and_then(|r| r.close_reason()) {
                self.registration = None;
                self.release_all();
                self.conn.shutdown(&reason);
            }
            // 1. Interpret every complete frame we have. One read can hold
            // tens of thousands of frames (binds, declares, publishes): spend
            // the task's cooperative budget per event so the runtime gets to
            // serve other connections (and accept new ones) in between.
            // Nothing while blocked: what was read waits in the buffer with
            // the unread socket.
            while self.login_refusal.is_none() && !self.blocked {
                let Some(ev) = self.conn.poll(&mut input) else {
                    break;
                };
                self.handle_event(ev).await;
                tokio::task::consume_budget().await;
            }
            self.end_batch();
            if self.gate.is_none() {
                self.gate = self.client.as_ref().and_then(TenantGate::for_store_share);
            }
            if let Some(g) = self.gate.as_mut() {
                g.end_batch(self.client.as_mut());
            }
            self.signal_alarm();
            // 2. Deliveries and notices from the engine.
            if self.conn.out().len() < DELIVERY_HIGH_WATER && self.conn.is_open() {
                self.write_deliveries();
            }
            // 3. Timers, then write what we can without blocking. One clock
            // read per loop serves every timer.
            let now = Instant::now();
            if std::mem::take(&mut got_input) {
                self.conn.on_read(now);
            }
            if std::mem::take(&mut fired) {
                self.on_timer(now, &mut stall, &mut lease_check);
            }
            if !self.conn.out().is_empty() {
                let n = wr.write_some(self.conn.out())?;
                if n > 0 {
                    self.conn.on_write(now);
                    match self.metrics.as_mut() {
                        Some(m) => m.bytes_out(n),
                        None => self.pre_open.wrote(n),
                    }
                }
            }
            if let Some(m) = self.metrics.as_mut() {
                m.flush();
            }
            if self.conn.is_finished() && self.conn.out().is_empty() {
                if wr.has_unflushed() {
                    // A TLS record (the close-ok) still buffered: one
                    // bounded last flush.
                    let _ = tokio::time::timeout(FINAL_FLUSH, wr.writable()).await;
                }
                if self.peer_closed && !eof {
                    linger(&mut rd, &mut input).await;
                }
                return Ok(());
            }
            if eof {
                return Ok(());
            }
            // 4. Wait for something to do. While a resource alarm is set, a
            // connection that publishes is not read (after the publish in
            // hand, or in the middle of one); one that only consumes is.
            if self.alarmed() && !self.blocked && self.conn.partial_content_bytes() > 0 {
                self.blocked = true;
                self.signal_alarm();
            }
            let want_read = self.conn.out().len() < OUT_HIGH_WATER
                && !self.replies.is_full()
                && !self.conn.is_finished()
                && !self.blocked
                && !self.gate.as_ref().is_some_and(|g| g.paused())
                && self.login_refusal.is_none();
            if want_read {
                self.conn.resume_reads(now);
            } else {
                // We stopped reading, not the client: its heartbeats are
                // waiting in the socket.
                self.conn.pause_reads(now);
            }
            // A client that stops in the middle of a message holds its
            // buffered frames: it is cut off once its content has not grown
            // for the timeout. Time we did not read it does not count,
            // except a message of several frames held through a resource
            // alarm: that memory is what the alarm waits for. (A publish cut
            // off between its frames by the block is small: it waits for the
            // alarm like the rest of the publisher.)
            let stall_at = match self.shared.partial_content_timeout {
                Some(limit) => {
                    let assembling = self.conn.partial_content_bytes();
                    let partial = assembling + input.len();
                    let held_through_alarm = self.blocked && assembling > self.conn.frame_max();
                    let paused = !want_read && !held_through_alarm;
                    if partial == 0 || paused || !self.conn.is_open() {
                        stall = None;
                    } else if stall.is_none_or(|(bytes, _)| bytes != partial) {
                        stall = Some((partial, now));
                    }
                    stall.map(|(_, since)| since + limit)
                }
                None => None,
            };
            if lease_check.is_none() && self.client.is_some() {
                // No lease is older than the client.
                lease_check = self.shared.consumer_timeout.map(|t| now + t);
            }
            let deadline = [self.conn.poll_timeout(), stall_at, lease_check]
                .into_iter()
                .flatten()
                .min();
            if let Some(at) = deadline {
                if armed.is_none_or(|a| at < a) {
                    timer.as_mut().reset(tokio::time::Instant::from_std(at));
                    armed = Some(at);
                }
            }
            let want_write = !self.conn.out().is_empty() || wr.has_unflushed();
            // Deliveries left behind by the high-water mark, and the write
            // above took the buffer below it (a fast reader can take all of
            // it at once): encode more now, nothing else would wake us.
            let room_for_deliveries = self.deliveries_wait_room
                && self.conn.out().len() < DELIVERY_HIGH_WATER
                && self.conn.is_open();
            let refusal_at = self.login_refusal.as_ref().map(|r| r.at);
            tokio::select! {
                r = rd.read_some(&mut input), if want_read => {
                    match r {
                        Ok(0) => {
                            eof = true;
                            // The peer went away: nothing more can be written.
                            self.conn.out().clear();
                            self.conn.abandon();
                        }
                        Ok(n) => {
                            got_input = true;
                            match self.metrics.as_mut() {
                                Some(m) => m.bytes_in(n),
                                None => self.pre_open.read(n),
                            }
                        }
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                        Err(e) => return Err(e),
                    }
                }
                r = wr.writable(), if want_write => { r?; }
                _ = notified(self.client.as_ref()) => {}
                // Ready at once while the task's cooperative budget lasts
                // (then it yields, as a ready socket would make it): a
                // reader that takes everything cannot keep this worker.
                // Among ready branches `select!` picks at random, so reads
                // still get their turn.
                () = tokio::task::consume_budget(), if room_for_deliveries => {}
                () = self.replies.durable(), if self.replies.is_waiting() => {
                    self.send_ready_replies();
                }
                _ = sleep_until(refusal_at), if refusal_at.is_some() => {
                    if let Some(r) = self.login_refusal.take() {
                        self.conn.refuse_login(&r.text);
                    }
                }
                r = self.alarms.changed(), if self.blocked => {
                    if r.is_ok() {
                        self.refresh_alarm();
                    }
                }
                // The tenant's block changed, or its rate pause is over.
                () = tenant_gate::wake(self.gate.as_mut(), self.blocked) => {
                    self.refresh_alarm();
                }
                Some(c) = confirm_rx.recv() => {
                    self.on_store_confirm(c);
                    while let Ok(c) = confirm_rx.try_recv() {
                        self.on_store_confirm(c);
                    }
                }
                () = &mut timer, if armed.is_some() => {
                    armed = None;
                    fired = true;
                }
                r = shutdown.changed() => {
                    if r.is_err() || *shutdown.borrow() {
                        self.release_all();
                        self.conn.shutdown("broker shutdown");
                    }
                }
            }
        }
    }

    /// Maps one adapter event onto the engine. Nothing here waits for the
    /// store: durable replies go through [`Replies`].
    async fn handle_event(&mut self, ev: Event) {
        match ev {
            Event::Login {
                mechanism,
                username,
                password,
            } => {
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
                            LoginRefused::Failed { .. } => format!(
                                "Login was refused using authentication mechanism {mechanism}."
                            ),
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
                    self.gate = TenantGate::for_client(&client, rule.as_deref());
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
                    return;
                }
                // The publish in hand is taken; then no more reads until
                // the alarm (or the tenant's block) clears. The tenant's
                // block is looked at per publish (one atomic load), so a
                // batch does not run far past the quota.
                if let Some(g) = self.gate.as_mut() {
                    g.refresh();
                    g.published(message.body.len());
                }
                self.blocked |= self.alarmed();
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
                    return;
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
                    return;
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

    /// Closes the batch: the engine client's settles and dispatches, then
    /// each channel's confirms.
    fn end_batch(&mut self) {
        if let Some(c) = self.client.as_mut() {
            c.commit();
        }
        self.send_confirms();
    }

    /// The loop's timer fired (possibly early: every check looks at `now`).
    /// `stall` is the partly received content and since when it has not
    /// grown, as of the last loop; `lease_check` when to look for expired
    /// leases.
    fn on_timer(
        &mut self,
        now: Instant,
        stall: &mut Option<(usize, Instant)>,
        lease_check: &mut Option<Instant>,
    ) {
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
        if lease_check.is_some_and(|at| now >= at) {
            *lease_check = self.expire_leases(now);
        }
        // Nothing was read since the stall was measured (a read and the
        // timer are different wake-ups), so it still holds.
        if let (Some(limit), Some((bytes, since))) = (self.shared.partial_content_timeout, *stall) {
            if now >= since + limit && self.conn.is_open() {
                tracing::info!(peer = %self.peer, bytes, "partly received message stalled, closing");
                let text = format!(
                    "{bytes} bytes of a message received and no progress for {} s",
                    limit.as_secs()
                );
                self.fail(0, hard(reply::RESOURCE_ERROR, text), 0, 0);
                *stall = None;
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

    /// Takes the current alarm state; a cleared alarm unblocks.
    fn refresh_alarm(&mut self) {
        self.alarm = *self.alarms.borrow_and_update();
        if let Some(g) = self.gate.as_mut() {
            g.refresh();
        }
        self.blocked &= self.alarmed();
    }

    /// Whether publishers of this connection are to be blocked: the
    /// tenant's queued quota (checked first: it blocks only its tenant) or
    /// a global alarm.
    fn alarmed(&self) -> bool {
        self.gate.as_ref().is_some_and(|g| g.blocked()) || self.alarm.any()
    }

    /// Tells the client (`connection.blocked` / `connection.unblocked`) when
    /// it is blocked by a resource alarm, and when that alarm clears.
    fn signal_alarm(&mut self) {
        let set = self.blocked;
        if set == self.blocked_sent || !self.conn.is_open() || !self.conn.accepts_blocked() {
            return;
        }
        if set {
            match self.gate.as_ref() {
                Some(g) if g.blocked() => crate::metrics::quota_block(g.tenant()),
                _ => crate::metrics::alarm_block(Protocol::Amqp),
            }
        }
        let method = if set {
            connection::AMQPMethod::Blocked(connection::Blocked {
                reason: match self.gate.as_ref() {
                    Some(g) if g.blocked() => g.reason().into(),
                    _ => self.alarm.reason().into(),
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

/// The reading side of a connection, as the session loop waits on it.
trait ReadSide: Send {
    /// Waits until the stream is readable and reads what is there into
    /// `input` (0 = end of stream; `WouldBlock` = a spurious wake-up).
    /// Cancel safe: nothing is lost when it is dropped while waiting.
    fn read_some(
        &mut self,
        input: &mut BytesMut,
    ) -> impl std::future::Future<Output = std::io::Result<usize>> + Send;
}

/// After the client's connection.close and our close-ok, reads and drops
/// what the client still sends until it closes the socket, for at most [`CLOSE_LINGER`]. Closing a
/// socket that holds unread input makes the kernel reset the connection,
/// and the reset can overtake the close-ok: a client that wrote frames
/// behind its connection.close (amqplib flushes its channels' frames after
/// it) then sees ECONNRESET instead of the close-ok. RabbitMQ likewise
/// reads until the client closes.
async fn linger<R: ReadSide>(rd: &mut R, input: &mut BytesMut) {
    let drain = async {
        loop {
            input.clear();
            match rd.read_some(input).await {
                Ok(0) => return,
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(_) => return,
            }
        }
    };
    let _ = tokio::time::timeout(CLOSE_LINGER, drain).await;
}

/// The writing side of a connection: non-blocking writes, and a wait for
/// room.
trait WriteSide: Send {
    /// Writes as much of `out` as the stream takes now, without waiting.
    fn write_some(&mut self, out: &mut BytesMut) -> std::io::Result<usize>;
    /// Bytes taken by [`Self::write_some`] that still wait inside the
    /// stream (a TLS record buffer) for the socket.
    fn has_unflushed(&self) -> bool;
    /// Resolves when a write may make progress (and, for a buffering
    /// stream, once what it holds went out).
    fn writable(&mut self) -> impl std::future::Future<Output = std::io::Result<()>> + Send;
}

impl ReadSide for &TcpStream {
    async fn read_some(&mut self, input: &mut BytesMut) -> std::io::Result<usize> {
        self.readable().await?;
        input.reserve(64 * 1024);
        self.try_read_buf(input)
    }
}

impl WriteSide for &TcpStream {
    fn write_some(&mut self, out: &mut BytesMut) -> std::io::Result<usize> {
        let mut total = 0;
        while !out.is_empty() {
            match self.try_write(out) {
                Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
                Ok(n) => {
                    bytes::Buf::advance(out, n);
                    total += n;
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) => return Err(e),
            }
        }
        Ok(total)
    }

    fn has_unflushed(&self) -> bool {
        false
    }

    fn writable(&mut self) -> impl std::future::Future<Output = std::io::Result<()>> + Send {
        TcpStream::writable(self)
    }
}

impl<T: tokio::io::AsyncRead + Send> ReadSide for tokio::io::ReadHalf<T> {
    async fn read_some(&mut self, input: &mut BytesMut) -> std::io::Result<usize> {
        use tokio::io::AsyncReadExt;
        input.reserve(64 * 1024);
        // AsyncRead's read_buf is cancel safe.
        self.read_buf(input).await
    }
}

/// A poll-based writer (a TLS stream's write half) driven the way the
/// session drives a socket: writes are attempted without waiting (polled
/// with a no-op waker), and [`WriteSide::writable`] waits by flushing with
/// the task's own waker, which registers it with the socket underneath.
struct PollWriter<W> {
    inner: W,
    /// A write or flush returned Pending: bytes may sit in the stream's
    /// buffer.
    unflushed: bool,
}

impl<W> PollWriter<W> {
    fn new(inner: W) -> Self {
        PollWriter {
            inner,
            unflushed: false,
        }
    }
}

impl<W: tokio::io::AsyncWrite + Unpin + Send> WriteSide for &mut PollWriter<W> {
    fn write_some(&mut self, out: &mut BytesMut) -> std::io::Result<usize> {
        use std::pin::Pin;
        use std::task::{Context, Poll};
        let mut cx = Context::from_waker(std::task::Waker::noop());
        let mut total = 0;
        while !out.is_empty() {
            match Pin::new(&mut self.inner).poll_write(&mut cx, out) {
                Poll::Ready(Ok(0)) => return Err(std::io::ErrorKind::WriteZero.into()),
                Poll::Ready(Ok(n)) => {
                    bytes::Buf::advance(out, n);
                    total += n;
                }
                Poll::Ready(Err(e)) => return Err(e),
                Poll::Pending => break,
            }
        }
        // Push what the stream buffered towards the socket now; what it
        // cannot take waits for `writable`.
        self.unflushed = match Pin::new(&mut self.inner).poll_flush(&mut cx) {
            Poll::Ready(r) => {
                r?;
                false
            }
            Poll::Pending => true,
        };
        Ok(total)
    }

    fn has_unflushed(&self) -> bool {
        self.unflushed
    }

    async fn writable(&mut self) -> std::io::Result<()> {
        use tokio::io::AsyncWriteExt;
        // Flush is cancel safe: what it did not write stays buffered.
        self.inner.flush().await?;
        self.unflushed = false;
        Ok(())
    }
}
