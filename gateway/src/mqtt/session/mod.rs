//! One MQTT connection's task: socket I/O around the sans-IO adapter
//! (`weir_protocols::mqtt`), and the mapping of its events onto the engine's
//! [`Client`].
//!
//! The socket loop is the session driver's ([`crate::session`]); this
//! module is its MQTT adapter.
//!
//! An MQTT session is a queue in the engine, as in RabbitMQ's MQTT plugin:
//! `mqtt-subscription-<client id>qos1`, bound to the tenant's `amq.topic`
//! with one binding per subscription (the filter mapped to a binding key,
//! the subscription's options in the binding's arguments, so a resumed
//! session finds them again). A persistent session's queue is durable and
//! expires with the session (`x-expires`); a clean session's is exclusive to
//! the connection. Publishes route through `amq.topic`, so AMQP consumers
//! and MQTT subscribers meet. The session keeps only protocol state: packet
//! ids, which lease each in-flight id holds, the acks waiting for the store.
//!
//! * `connect`: login, tenant, takeover, the session queue, will messages.
//! * `inbound`: PUBLISH from the client, PUBACK/PUBREC in order once durable.
//! * `subscriptions`: SUBSCRIBE / UNSUBSCRIBE, retained messages at subscribe.
//! * `outbound`: deliveries to the client and their acks.

mod connect;
mod inbound;
mod outbound;
mod subscriptions;

use super::registry::Registration;
use crate::engine::consumer::Scope;
use crate::engine::{Client, Engine};
use crate::metrics::ConnMetrics;
use crate::server::Services;
use crate::session::durable::{Durability, Status, Ticket};
use crate::session::io::{Buffers, PollWriter, ReadSide, WriteSide};
use crate::session::{Adapter, Flow, Woken, DELIVERY_HIGH_WATER};
use bytes::BytesMut;
use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;
use tokio::net::TcpStream;
use tokio::sync::watch;
use tracing::Instrument as _;
use weir_protocols::mqtt::{Connection, Event, QoS, Will};

/// Read buffer of a connection that has been quiet.
const READ_BUF_IDLE: usize = 512;
/// Read buffer of a connection that filled its small one.
const READ_BUF_BUSY: usize = 16 * 1024;
/// Output buffer kept when empty; a larger one (after a burst) is freed.
const OUT_KEEP: usize = 64 * 1024;
/// The engine scope of the session's subscriptions (MQTT has no channels).
const SCOPE: Scope = 1;

/// One subscription of the session, as the client made it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Subscription {
    pub filter: String,
    pub qos: QoS,
    pub no_local: bool,
    pub retain_as_published: bool,
    pub subscription_id: Option<u32>,
}

/// Which answer a pending ack is.
#[derive(Clone, Debug, PartialEq, Eq)]
enum AckKind {
    /// PUBACK.
    Ack,
    /// PUBREC.
    Received,
    /// PUBCOMP.
    Complete,
    /// SUBACK with its codes.
    Subscribed(Vec<u8>),
    /// UNSUBACK with its codes.
    Unsubscribed(Vec<u8>),
}

/// An answer to the client waiting for the store, in arrival order.
struct PendingAck {
    packet_id: u16,
    kind: AckKind,
    reason: u8,
    /// What it waits for (its own record's, or the answer's before it).
    ticket: Ticket,
}

/// One of our QoS 1/2 publishes the client has not completed.
#[derive(Clone, Copy, Debug)]
struct InFlight {
    /// Its lease (None once settled: QoS 2 after PUBREC, or a retained
    /// message, which has none).
    tag: Option<u64>,
    /// The message (None for a retained message).
    message: Option<u64>,
    /// QoS 2: the id and the message are recorded in the session state.
    stored: bool,
}

/// A resumed session's QoS 1 and 2 messages sent before under an id.
#[derive(Default)]
struct Resume {
    /// QoS 1, by the session's previous connection (in this process): sent
    /// again with the same id (DUP) if that id is free (MQTT-4.4.0-1).
    send1: HashMap<u64, u16>,
    /// Sent before under these ids: sent again with the same id (DUP).
    send: HashMap<u64, u16>,
    /// Received by the client (PUBREC) before, their settle perhaps not
    /// stored: settled, not sent again.
    skip: std::collections::HashSet<u64>,
}

/// The session-state key of a QoS 2 packet id (`dir`: "in" or "out"),
/// relative to the session: the engine client keeps each session's state
/// apart. NUL separates.
fn state_key(dir: &str, packet_id: u16) -> String {
    format!("{dir}\0{packet_id}")
}

/// Serves one accepted MQTT connection until it closes (admitted by the
/// listener: [`super::MqttShared::admit`]).
pub async fn serve(
    stream: TcpStream,
    peer: SocketAddr,
    services: Arc<Services>,
    shutdown: watch::Receiver<bool>,
) {
    let _ = stream.set_nodelay(true);
    serve_on(&stream, &stream, peer, None, None, services, shutdown).await;
}

/// Serves one MQTT connection over TLS (handshake done): a verified client
/// certificate's subject CN is the user of a certificate login
/// (`mqtt.ssl_cert_login`).
pub async fn serve_tls(
    stream: crate::tls::TlsStream,
    peer: SocketAddr,
    identity: crate::tls::PeerIdentity,
    services: Arc<Services>,
    shutdown: watch::Receiver<bool>,
) {
    let cert_user = identity.verified.then_some(identity.common_name).flatten();
    let (rd, wr) = tokio::io::split(stream);
    let wr = PollWriter::new(wr);
    serve_on(rd, wr, peer, cert_user, None, services, shutdown).await;
}

/// Serves one MQTT connection over any reader and writer (a TCP socket, a
/// TLS stream's halves, the pipe behind a WebSocket) until it closes.
/// `cert_user` is the subject CN of the client's verified certificate;
/// `opened` is set once CONNACK success is written (the WebSocket pump then
/// stops bounding what it reads).
pub(crate) async fn serve_on<R: ReadSide, W: WriteSide>(
    rd: R,
    wr: W,
    peer: SocketAddr,
    cert_user: Option<String>,
    opened: Option<Arc<std::sync::atomic::AtomicBool>>,
    services: Arc<Services>,
    shutdown: watch::Receiver<bool>,
) {
    let mut s = Session {
        engine: services.engine.clone(),
        conn: Connection::new(services.mqtt.server.clone(), Instant::now()),
        flow: Flow::new(services.alarms.subscribe()),
        shared: services,
        client: None,
        peer,
        cert_user,
        tenant: String::new(),
        client_id: String::new(),
        conn_id: 0,
        queue_open: false,
        receive_maximum: 0,
        registration: None,
        listed: None,
        will: None,
        session_expiry_secs: 0,
        expiry_changed: false,
        subscriptions: Vec::new(),
        shared_subs: HashMap::new(),
        retained_out: VecDeque::new(),
        retained_yield: false,
        acks: VecDeque::new(),
        durability: Durability::default(),
        inflight: HashMap::new(),
        state_changes: Vec::new(),
        hold: Ticket::NONE,
        resume: None,
        next_tag: 0,
        end_reason: None,
        publish_will: false,
        metrics: None,
        pre_open: Default::default(),
        opened,
    };
    // One span per connection; `client_id`, `user` and `vhost` are filled
    // in at CONNECT. At debug level, unlike AMQP's: an enabled span keeps
    // its formatted fields and registry slot (~650 bytes) for the life of
    // the connection, and an idle device connection must stay within
    // 4 KB. MQTT's info and warn events name the peer and client id
    // themselves; `WEIR_LOG=info,weir_gateway::mqtt=debug` turns it on.
    let span = tracing::debug_span!(
        "mqtt",
        %peer,
        client_id = tracing::field::Empty,
        user = tracing::field::Empty,
        vhost = tracing::field::Empty
    );
    tracing::debug!(parent: &span, "MQTT connection accepted");
    let result = crate::session::run(&mut s, rd, wr, shutdown)
        .instrument(span.clone())
        .await;
    let _in = span.enter();
    if result.is_err() {
        s.publish_will = true;
    }
    s.finish();
    match result {
        Ok(()) => tracing::debug!(%peer, "MQTT connection closed"),
        Err(e) => tracing::info!(%peer, error = %e, "MQTT connection ended"),
    }
}

pub(crate) struct Session {
    /// The broker's services (engine, login throttle, MQTT registry).
    shared: Arc<Services>,
    engine: Arc<Engine>,
    conn: Connection,
    client: Option<Client>,
    peer: SocketAddr,
    /// Over TLS with a verified client certificate: its subject CN.
    cert_user: Option<String>,
    /// The tenant logged into (the user is the engine client's principal).
    tenant: String,
    client_id: String,
    /// The engine client's connection id.
    conn_id: u64,
    /// The session queue exists and is consumed.
    queue_open: bool,
    /// The client's receive maximum (its consumer's prefetch).
    receive_maximum: u32,
    /// Held while connected: takeover notice and our finish signal.
    registration: Option<Registration>,
    /// In the registry of live connections (management API), from CONNECT
    /// accepted on.
    listed: Option<crate::connections::Registration>,
    /// Published if the connection ends without a clean DISCONNECT (boxed:
    /// large, and most connections have none).
    will: Option<Box<Will>>,
    session_expiry_secs: u32,
    /// The client's DISCONNECT set a new session expiry (MQTT 5): the
    /// session queue's `x-expires` follows at the end.
    expiry_changed: bool,
    /// The client's subscriptions on the session queue.
    subscriptions: Vec<Subscription>,
    /// Shared subscriptions: consumer tag → (queue, subscription).
    shared_subs: HashMap<Vec<u8>, (String, Subscription)>,
    /// Retained messages owed to new subscriptions, a cursor each.
    retained_out: VecDeque<subscriptions::RetainedSend>,
    /// Retained lookups stopped for their step budget: come back after
    /// giving the thread to others.
    retained_yield: bool,
    /// Answers to the client's QoS 1/2 publishes, in arrival order.
    acks: VecDeque<PendingAck>,
    /// Tickets of the answers and output waiting for the store.
    durability: Durability,
    /// Our QoS 1/2 publishes the client has not completed, by packet id.
    inflight: HashMap<u16, InFlight>,
    /// Session-state changes of this batch (QoS 2 ids), appended before its
    /// settles and before its barrier.
    state_changes: Vec<(String, Option<Vec<u8>>)>,
    /// Output waits for this ticket: it says what the session state must
    /// hold first (a QoS 2 id sent or PUBREL'd), or the session queue's
    /// record before CONNACK.
    hold: Ticket,
    /// After a resume with QoS 2 exchanges open: what they need (boxed:
    /// most sessions never have any, and an idle one should not carry it).
    resume: Option<Box<Resume>>,
    /// Lease tags, increasing.
    next_tag: u64,
    /// The broker's alarms and the tenant's gate.
    flow: Flow,
    /// Why the connection ended, for the log.
    end_reason: Option<String>,
    /// Publish the will at the end (abnormal end, or DISCONNECT 0x04).
    publish_will: bool,
    /// Its tenant's and protocol's counters, from CONNACK on (boxed: an
    /// idle connection should carry one pointer).
    metrics: Option<Box<ConnMetrics>>,
    /// Traffic before CONNECT was accepted, until there are metrics.
    pre_open: crate::metrics::PreOpen,
    /// Set (and dropped) once CONNACK success is out (see `serve_on`).
    opened: Option<Arc<std::sync::atomic::AtomicBool>>,
}

/// Resolves when `client`'s outbox is notified; never without a client.
async fn notified(client: Option<&Client>) {
    match client {
        Some(c) => c.handle().notified().await,
        None => std::future::pending().await,
    }
}

/// Resolves when a takeover is announced; never without a registration.
async fn kicked(reg: Option<&mut Registration>) {
    match reg {
        Some(r) => r.kicked().await,
        None => std::future::pending().await,
    }
}

impl Session {
    /// Leaves the ids of the QoS 1 messages the client has not acknowledged
    /// (and of those not yet sent again) for the session's next connection.
    fn park_resends(&mut self) {
        let mut ids: HashMap<u64, u16> = self.resume.take().map(|r| r.send1).unwrap_or_default();
        ids.extend(
            self.inflight
                .iter()
                .filter(|(_, f)| !f.stored && f.tag.is_some())
                .filter_map(|(&pid, f)| f.message.map(|m| (m, pid))),
        );
        if !ids.is_empty() {
            self.shared
                .mqtt
                .registry
                .park_resends(&self.tenant, &self.client_id, ids);
        }
    }

    /// The session queue's name (once connected): derived, not kept, as
    /// it is needed only by rare operations.
    fn queue(&self) -> String {
        connect::session_queue(&self.client_id)
    }

    /// Acts on one event; a CONNECT is returned for the caller to await
    /// (the only event that waits: this stays synchronous, so the task's
    /// future holds no copy of an event).
    #[must_use]
    fn handle_event(&mut self, ev: Event) -> Option<Box<weir_protocols::mqtt::Connect>> {
        match ev {
            Event::Connect(c) => return Some(c),
            Event::Publish(p) => {
                // The tenant's block first (looked at per publish, one
                // atomic load): it stops only its tenant.
                self.flow.published(p.payload.len());
                self.on_publish(p);
            }
            Event::PubAck { packet_id, .. } => self.on_puback(packet_id),
            Event::PubRec { packet_id, reason } => self.on_pubrec(packet_id, reason),
            Event::PubComp { packet_id } => self.on_pubcomp(packet_id),
            Event::PubRel { packet_id } => self.on_pubrel(packet_id),
            Event::Subscribe {
                packet_id,
                filters,
                subscription_id,
                ..
            } => self.on_subscribe(packet_id, filters, subscription_id),
            Event::Unsubscribe { packet_id, filters } => self.on_unsubscribe(packet_id, filters),
            Event::Disconnect {
                publish_will,
                session_expiry_secs,
            } => {
                self.publish_will = publish_will;
                if let Some(s) = session_expiry_secs {
                    // Capped as CONNECT's was (`mqtt.max_session_expiry`).
                    let max = self.shared.mqtt.max_session_expiry_secs;
                    let s = if max > 0 { s.min(max) } else { s };
                    self.expiry_changed = s != self.session_expiry_secs;
                    self.session_expiry_secs = s;
                }
                self.end_reason = Some("client disconnected".into());
            }
            Event::Closed { reason, text } => {
                tracing::info!(peer = %self.peer, client_id = %self.client_id, reason, %text, "MQTT connection closed for an error");
                self.end_reason = Some(text);
                self.publish_will = true;
            }
        }
        None
    }

    /// Ends the batch: the client's settles and dispatches, one store
    /// barrier for the answers that wait for the store, and the acks that
    /// can go now.
    fn close_batch(&mut self) {
        // Session state first: a QoS 2 id's PUBREC state must be in the log
        // before the settle it allows.
        self.flush_state();
        if let Some(c) = self.client.as_mut() {
            c.commit();
        }
        self.request_barrier();
        self.send_ready_acks();
    }

    /// Appends the batch's session-state changes; output then waits for
    /// the barrier that makes them durable.
    fn flush_state(&mut self) {
        if self.state_changes.is_empty() {
            return;
        }
        let changes = std::mem::take(&mut self.state_changes);
        let refs: Vec<(&str, Option<&[u8]>)> = changes
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_deref()))
            .collect();
        let r = match self.client.as_ref() {
            Some(c) => c.update_session_state(&refs).map(|_| ()),
            None => Ok(()),
        };
        if let Err(e) = r {
            tracing::warn!(peer = %self.peer, error = %e, "MQTT session state not stored");
            self.end_reason = Some("the store failed".into());
            self.conn.disconnect(0x80, "the store failed");
        }
        self.hold = self.durability.ticket();
    }

    /// One store barrier for everything the batch appended that an answer
    /// waits for.
    fn request_barrier(&mut self) {
        if let Err(e) = self.durability.end_batch(self.client.as_mut()) {
            tracing::warn!(peer = %self.peer, error = %e, "MQTT store barrier refused");
            self.store_failed();
        }
    }

    /// The store could not make what an answer (or held output) waits for
    /// durable: nothing more is acknowledged or sent, and the connection
    /// closes (the client sends its unacknowledged publishes again).
    fn store_failed(&mut self) {
        self.acks.clear();
        if !self.durability.is_durable(self.hold) {
            self.conn.out.clear();
            self.hold = Ticket::NONE;
        }
        if self.end_reason.is_none() {
            self.end_reason = Some("the store failed".into());
        }
        self.conn.disconnect(0x80, "the store failed");
    }

    /// Releases everything: leases back to the queue, the session queue's
    /// fate, the will, the registration.
    fn finish(&mut self) {
        // A will is published as its client would have: by its user.
        let will_user = self
            .client
            .as_ref()
            .filter(|_| self.publish_will && self.will.is_some())
            .map(|c| c.principal().to_owned());
        // An ended session's queue and state go through its client, before
        // it closes.
        let ended = !self.client_id.is_empty() && self.session_expiry_secs == 0;
        if ended {
            self.delete_session_queue();
            self.clear_session_state();
        } else if self.expiry_changed {
            self.set_session_queue_expiry();
        }
        if let Some(mut c) = self.client.take() {
            c.close();
        }
        if !self.client_id.is_empty() {
            if self.session_expiry_secs > 0 {
                self.park_resends();
            }
            if let (Some(w), Some(user)) = (self.will.take(), will_user) {
                self.schedule_will(*w, user);
            }
            self.shared
                .mqtt
                .registry
                .release(&self.tenant, &self.client_id, self.engine_conn_id());
        }
        // A connection taking the session over waits for this.
        drop(self.registration.take());
        if let Some(reason) = &self.end_reason {
            tracing::debug!(peer = %self.peer, client_id = %self.client_id, %reason, "MQTT session ended");
        }
    }
}

/// What woke the session besides its socket.
pub(crate) enum Wake {
    /// The engine's outbox (deliveries, answers made durable), the flow,
    /// or a retained lookup's turn.
    Turn,
    /// Another connection took the session over.
    Kicked,
}

impl Adapter for Session {
    type Event = Event;
    type Await = Box<weir_protocols::mqtt::Connect>;
    type Wake = Wake;
    const BUFFERS: Buffers = Buffers::Elastic {
        idle: READ_BUF_IDLE,
        busy: READ_BUF_BUSY,
        keep_out: OUT_KEEP,
    };

    fn out(&mut self) -> &mut BytesMut {
        &mut self.conn.out
    }

    fn flow(&mut self) -> &mut Flow {
        &mut self.flow
    }

    fn is_finished(&self) -> bool {
        self.conn.is_finished()
    }

    fn begin_turn(&mut self) {
        // Closed through the management API: the registry wakes the
        // engine connection, so this runs.
        if let Some(reason) = self.listed.as_ref().and_then(|l| l.close_reason()) {
            self.listed = None;
            self.end_reason = Some(reason);
            self.conn.disconnect(0x98, "closed by an administrator");
        }
        // Answers whose tickets completed.
        self.send_ready_acks();
        if self.durability.status(self.hold) == Status::Failed {
            self.store_failed();
        }
    }

    fn poll_event(&mut self, input: &mut BytesMut) -> Option<Event> {
        self.conn.poll(input)
    }

    fn handle_event(&mut self, ev: Event) -> Option<Self::Await> {
        self.handle_event(ev)
    }

    fn complete(&mut self, c: Self::Await) -> impl Future<Output = ()> + Send {
        self.on_connect(*c)
    }

    fn end_batch(&mut self) {
        self.close_batch();
        if self.opened.is_some() && self.conn.is_open() {
            if let Some(f) = self.opened.take() {
                f.store(true, Ordering::Release);
            }
        }
        self.flow.end_batch(self.client.as_mut());
    }

    fn deliver(&mut self) -> bool {
        if self.conn.is_finished() {
            return false;
        }
        self.write_deliveries();
        // Stopped at the high-water mark with deliveries or retained
        // messages in hand: nothing else wakes us for them.
        self.conn.out.len() >= DELIVERY_HIGH_WATER
            && (!self.retained_out.is_empty()
                || self
                    .client
                    .as_ref()
                    .is_some_and(|c| c.pending_deliveries() > 0))
    }

    fn on_clock(&mut self, now: Instant, read: bool, fired: bool) {
        if read {
            self.conn.on_read(now);
        }
        if fired {
            self.conn.handle_timeout(now);
            // A keep-alive timeout finishes the connection inside the
            // adapter, and its `Event::Closed` (which publishes the will)
            // waits for a poll; the driver polls no more once the
            // connection is finished, so take it here.
            while let Some(ev) = self.conn.poll(&mut BytesMut::new()) {
                let _ = self.handle_event(ev);
            }
        }
    }

    fn output_held(&self) -> bool {
        !self.durability.is_durable(self.hold)
    }

    fn on_read(&mut self, n: usize) {
        match self.metrics.as_mut() {
            Some(m) => m.bytes_in(n),
            None => self.pre_open.read(n),
        }
    }

    fn wrote(&mut self, n: usize, _now: Instant) {
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
        if self.end_reason.is_none() {
            self.end_reason = Some("client closed the socket".into());
            self.publish_will = true;
        }
    }

    fn wants_input(&mut self) -> bool {
        true
    }

    fn deadline(&mut self, _now: Instant, _reading: bool, _buffered: usize) -> Option<Instant> {
        self.conn.poll_timeout()
    }

    fn input_limit(&self) -> usize {
        // Before login the adapter takes only a small CONNECT: no larger
        // buffer for a client nobody knows yet.
        self.conn.packet_limit()
    }

    fn wait(&mut self) -> (&mut BytesMut, impl Future<Output = Wake> + Send + '_) {
        let client = self.client.as_ref();
        let flow = &mut self.flow;
        let registration = self.registration.as_mut();
        let retained_yield = self.retained_yield;
        let wake = async move {
            tokio::select! {
                biased;
                // Deliveries, notices, and answers made durable.
                _ = notified(client) => Wake::Turn,
                () = kicked(registration) => Wake::Kicked,
                () = flow.changed() => Wake::Turn,
                () = tokio::task::yield_now(), if retained_yield => Wake::Turn,
            }
        };
        (&mut self.conn.out, wake)
    }

    fn woken(&mut self, w: Wake) -> Woken {
        match w {
            Wake::Turn => Woken::Turn,
            // Another connection took the session over: its will is not
            // ours to publish (MQTT 5: 0x8E). What the client sent before
            // it went (a last PUBACK still in the socket) counts: read
            // what is there now and act on it before the leases go back.
            Wake::Kicked => Woken::LastInput,
        }
    }

    fn last_input(&mut self, input: &mut BytesMut) {
        while let Some(ev) = self.conn.poll(input) {
            // (Never a CONNECT: the adapter refuses a second.)
            let _ = self.handle_event(ev);
        }
        self.close_batch();
        self.end_reason = Some("session taken over".into());
        self.publish_will = true;
        self.conn.disconnect(0x8E, "session taken over");
    }

    fn on_shutdown(&mut self) {
        self.end_reason = Some("broker shutdown".into());
        self.conn.disconnect(0x8B, "server shutting down");
    }
}
