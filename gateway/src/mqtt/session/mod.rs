//! One MQTT connection's task: socket I/O around the sans-IO adapter
//! (`weir_protocols::mqtt`), and the mapping of its events onto the engine's
//! [`Client`].
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
use crate::server::{Alarms, Shared};
use crate::tenant_gate::{self, TenantGate};
use bytes::BytesMut;
use futures_util::FutureExt;
use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
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
/// Stop reading from a client while this much output is unwritten.
const OUT_HIGH_WATER: usize = 4 << 20;
/// Stop encoding deliveries while this much output is unwritten.
const DELIVERY_HIGH_WATER: usize = 1 << 20;
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
    /// The store barrier it waits for (0 = none).
    barrier: u64,
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

/// The session-state key of a QoS 2 packet id (`dir`: "in" or "out").
/// NUL separates: an MQTT client id never holds one.
fn state_key(client_id: &str, dir: &str, packet_id: u16) -> String {
    format!("mqtt\0{client_id}\0{dir}\0{packet_id}")
}

/// The prefix of every session-state key of `client_id`.
fn state_prefix(client_id: &str) -> String {
    format!("mqtt\0{client_id}\0")
}

/// Serves one accepted MQTT connection until it closes.
pub async fn serve(
    stream: TcpStream,
    peer: SocketAddr,
    shared: Arc<Shared>,
    shutdown: watch::Receiver<bool>,
) {
    let Some(_slot) = shared.mqtt.admit() else {
        tracing::debug!(%peer, "too many MQTT connections: closed");
        return;
    };
    let _ = stream.set_nodelay(true);
    let (rd, wr) = stream.into_split();
    serve_io(rd, wr, peer, shared, shutdown).await;
}

/// A byte stream the session can wait on without holding a read buffer.
pub trait ReadReady: AsyncRead + Unpin {
    /// Resolves when a read may make progress (wake-ups may be spurious).
    fn ready(&self) -> impl std::future::Future<Output = std::io::Result<()>> + Send;
}

impl ReadReady for tokio::net::tcp::OwnedReadHalf {
    fn ready(&self) -> impl std::future::Future<Output = std::io::Result<()>> + Send {
        self.readable()
    }
}

impl<T: AsyncRead> ReadReady for tokio::io::ReadHalf<T> {
    /// A split stream (the pipe behind a WebSocket, a TLS stream): nothing
    /// to wait on without reading, so its buffer is taken at once (the
    /// WebSocket's or TLS session's own buffers dwarf it anyway).
    fn ready(&self) -> impl std::future::Future<Output = std::io::Result<()>> + Send {
        std::future::ready(Ok(()))
    }
}

/// Reads what is there into `input`. Bytes already waiting go into the
/// buffer it has; a read that would wait with an empty buffer gives the
/// buffer back first and takes one of the same size once the stream is
/// readable: an idle connection (most of an IoT fleet) holds none, a busy
/// one keeps its buffer. Cancel safe, as its awaits are.
async fn read_some<R: ReadReady>(rd: &mut R, input: &mut BytesMut) -> std::io::Result<usize> {
    if input.is_empty() {
        let size = input.capacity().clamp(READ_BUF_IDLE, READ_BUF_BUSY);
        if input.capacity() > 0 {
            if let Some(r) = rd.read_buf(input).now_or_never() {
                return r;
            }
            *input = BytesMut::new();
        }
        rd.ready().await?;
        input.reserve(size);
    }
    rd.read_buf(input).await
}

/// Writes some of `out`, or with nothing to write flushes (`None`). Cancel
/// safe, as tokio's write and flush are.
async fn write_or_flush<W: AsyncWrite + Unpin>(
    wr: &mut W,
    out: &[u8],
) -> std::io::Result<Option<usize>> {
    if out.is_empty() {
        wr.flush().await.map(|()| None)
    } else {
        wr.write(out).await.map(Some)
    }
}

/// Serves one MQTT connection over any byte stream (a TCP socket, or the
/// pipe behind a WebSocket) until it closes.
pub async fn serve_io<R, W>(
    rd: R,
    wr: W,
    peer: SocketAddr,
    shared: Arc<Shared>,
    shutdown: watch::Receiver<bool>,
) where
    R: ReadReady,
    W: AsyncWrite + Unpin,
{
    serve_inner(rd, wr, peer, None, false, None, shared, shutdown).await;
}

/// [`serve_io`] for a TLS connection (the halves of a
/// `tokio::io::split` TLS stream): `cert_user` is the subject CN of the
/// client's verified certificate, the user of a certificate login
/// (`mqtt.ssl_cert_login`).
pub async fn serve_tls<R, W>(
    rd: R,
    wr: W,
    peer: SocketAddr,
    cert_user: Option<String>,
    shared: Arc<Shared>,
    shutdown: watch::Receiver<bool>,
) where
    R: ReadReady,
    W: AsyncWrite + Unpin,
{
    // A TLS writer may keep encrypted bytes it took when the socket was
    // full: they are flushed once the output is written.
    serve_inner(rd, wr, peer, cert_user, true, None, shared, shutdown).await;
}

/// [`serve_io`] and [`serve_tls`]: `flush_writes` when the writer may keep
/// bytes it took (TLS); `opened` is set once CONNACK success is written
/// (the WebSocket pump then stops bounding what it reads).
#[allow(clippy::too_many_arguments)]
pub(crate) async fn serve_inner<R, W>(
    rd: R,
    wr: W,
    peer: SocketAddr,
    cert_user: Option<String>,
    flush_writes: bool,
    opened: Option<Arc<std::sync::atomic::AtomicBool>>,
    shared: Arc<Shared>,
    shutdown: watch::Receiver<bool>,
) where
    R: ReadReady,
    W: AsyncWrite + Unpin,
{
    let alarms = shared.alarms.subscribe();
    let mut s = Session {
        engine: shared.engine.clone(),
        conn: Connection::new(shared.mqtt.server.clone(), Instant::now()),
        shared,
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
        subscriptions: Vec::new(),
        shared_subs: HashMap::new(),
        retained_out: VecDeque::new(),
        retained_yield: false,
        acks: VecDeque::new(),
        durable: Arc::new(AtomicU64::new(0)),
        barriers_sent: 0,
        barriers_done: 0,
        batch_needs_barrier: false,
        inflight: HashMap::new(),
        state_changes: Vec::new(),
        hold_until: 0,
        resume: None,
        next_tag: 0,
        alarms,
        alarm: Alarms::default(),
        gate: None,
        blocked: false,
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
    let result = s
        .run(rd, wr, flush_writes, shutdown)
        .instrument(span.clone())
        .await;
    let _in = span.enter();
    s.finish();
    match result {
        Ok(()) => tracing::debug!(%peer, "MQTT connection closed"),
        Err(e) => tracing::info!(%peer, error = %e, "MQTT connection ended"),
    }
}

pub(crate) struct Session {
    shared: Arc<Shared>,
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
    /// The highest store barrier completed, set by the store's waiters
    /// (which then wake the task through the engine client's handle): no
    /// channel per connection.
    durable: Arc<AtomicU64>,
    /// Store barriers asked for, and how many completed (in order).
    barriers_sent: u64,
    barriers_done: u64,
    /// A publish of the current batch was stored durably.
    batch_needs_barrier: bool,
    /// Our QoS 1/2 publishes the client has not completed, by packet id.
    inflight: HashMap<u16, InFlight>,
    /// Session-state changes of this batch (QoS 2 ids), appended before its
    /// settles and before its barrier.
    state_changes: Vec<(String, Option<Vec<u8>>)>,
    /// Output waits for this store barrier: it says what the session state
    /// must hold first (a QoS 2 id sent or PUBREL'd).
    hold_until: u64,
    /// After a resume with QoS 2 exchanges open: what they need (boxed:
    /// most sessions never have any, and an idle one should not carry it).
    resume: Option<Box<Resume>>,
    /// Lease tags, increasing.
    next_tag: u64,
    alarms: watch::Receiver<Alarms>,
    alarm: Alarms,
    /// The tenant's block and publish rate (boxed: an idle connection of
    /// an unlimited tenant carries none).
    gate: Option<Box<TenantGate>>,
    /// It published while an alarm was set: not read until it clears.
    blocked: bool,
    /// Why the connection ended, for the log.
    end_reason: Option<String>,
    /// Publish the will at the end (abnormal end, or DISCONNECT 0x04).
    publish_will: bool,
    /// Its tenant's and protocol's counters, from CONNACK on (boxed: an
    /// idle connection should carry one pointer).
    metrics: Option<Box<ConnMetrics>>,
    /// Traffic before CONNECT was accepted, until there are metrics.
    pre_open: crate::metrics::PreOpen,
    /// Set (and dropped) once CONNACK success is out (see `serve_inner`).
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

    async fn run<R, W>(
        &mut self,
        mut rd: R,
        mut wr: W,
        flush_writes: bool,
        mut shutdown: watch::Receiver<bool>,
    ) -> std::io::Result<()>
    where
        R: ReadReady,
        W: AsyncWrite + Unpin,
    {
        // Written since the last flush (only counted when `flush_writes`).
        let mut unflushed = false;
        // Sized by use: an idle connection (most of an IoT fleet) holds a
        // small read buffer, a busy one a large one.
        let mut input = BytesMut::new();
        let mut last_read = 0;
        let timer = tokio::time::sleep(Duration::ZERO);
        tokio::pin!(timer);
        let mut armed: Option<Instant> = None;
        let mut fired = false;
        let mut got_input = false;
        let mut eof = false;
        self.alarm = *self.alarms.borrow_and_update();
        loop {
            if self.alarms.has_changed().unwrap_or(false)
                || self.gate.as_mut().is_some_and(|g| g.refresh())
            {
                self.refresh_alarm();
            }
            // Closed through the management API: the registry wakes the
            // engine connection, so this runs.
            if let Some(reason) = self.listed.as_ref().and_then(|l| l.close_reason()) {
                self.listed = None;
                self.end_reason = Some(reason);
                self.conn.disconnect(0x98, "closed by an administrator");
            }
            // 0. Answers whose store barrier completed.
            let done = self.durable.load(Ordering::Acquire);
            if done > self.barriers_done {
                self.barriers_done = done;
                self.send_ready_acks();
            }
            // 1. Every complete packet we have (none while blocked: what
            // was read waits in the buffer with the unread socket).
            while !self.blocked {
                let Some(ev) = self.conn.poll(&mut input) else {
                    break;
                };
                if let Some(c) = self.handle_event(ev) {
                    // Boxed: the login's future is large and only needed
                    // once; the task of an idle connection should not carry it.
                    Box::pin(self.on_connect(*c)).await;
                }
                tokio::task::consume_budget().await;
            }
            self.end_batch();
            if self.opened.is_some() && self.conn.is_open() {
                if let Some(f) = self.opened.take() {
                    f.store(true, Ordering::Release);
                }
            }
            if self.gate.is_none() {
                self.gate = self
                    .client
                    .as_ref()
                    .and_then(TenantGate::for_store_share)
                    .map(Box::new);
            }
            if let Some(g) = self.gate.as_mut() {
                g.end_batch(self.client.as_mut());
            }
            // 2. Deliveries.
            if self.conn.out.len() < DELIVERY_HIGH_WATER && !self.conn.is_finished() {
                self.write_deliveries();
            }
            // 3. Timers and writes.
            if let Some(m) = self.metrics.as_mut() {
                m.flush();
            }
            let now = Instant::now();
            if std::mem::take(&mut got_input) {
                self.conn.on_read(now);
            }
            if std::mem::take(&mut fired) {
                self.conn.handle_timeout(now);
            }
            let released = self.barriers_done >= self.hold_until;
            if (self.conn.is_finished() && self.conn.out.is_empty()) || eof {
                // Bounded: a TLS writer flushes only as fast as the
                // client reads.
                let _ = tokio::time::timeout(Duration::from_secs(1), wr.flush()).await;
                return Ok(());
            }
            // 4. Wait.
            let want_read = self.conn.out.len() < OUT_HIGH_WATER
                && !self.conn.is_finished()
                && !self.blocked
                && !self.gate.as_ref().is_some_and(|g| g.paused());
            if let Some(at) = self.conn.poll_timeout() {
                if armed.is_none_or(|a| at < a) {
                    timer.as_mut().reset(tokio::time::Instant::from_std(at));
                    armed = Some(at);
                }
            }
            let want_write = !self.conn.out.is_empty() && released;
            let want_flush = unflushed && self.conn.out.is_empty();
            // Reads and writes are futures that lose nothing when another
            // branch wins (tokio's read_buf and write are cancel safe).
            if input.is_empty() && input.capacity() > READ_BUF_BUSY && last_read < READ_BUF_IDLE {
                // A burst is over: give its buffer back.
                input = BytesMut::new();
            }
            if self.conn.out.is_empty() && self.conn.out.capacity() > OUT_KEEP {
                self.conn.out = BytesMut::new();
            }
            if input.capacity() > 0 && input.capacity() - input.len() < READ_BUF_IDLE / 2 {
                let busy = input.capacity() >= READ_BUF_IDLE || !input.is_empty();
                // Before login the adapter takes only a small CONNECT: no
                // larger buffer for a client nobody knows yet.
                let busy_size = READ_BUF_BUSY.min(self.conn.packet_limit());
                input.reserve(if busy { busy_size } else { READ_BUF_IDLE });
            }
            tokio::select! {
                r = read_some(&mut rd, &mut input), if want_read => match r {
                    Ok(0) => {
                        eof = true;
                        if self.end_reason.is_none() {
                            self.end_reason = Some("client closed the socket".into());
                            self.publish_will = true;
                        }
                    }
                    Ok(n) => {
                        got_input = true;
                        last_read = n;
                        match self.metrics.as_mut() {
                            Some(m) => m.bytes_in(n),
                            None => self.pre_open.read(n),
                        }
                    }
                    Err(e) => {
                        self.publish_will = true;
                        return Err(e);
                    }
                },
                r = write_or_flush(&mut wr, &self.conn.out), if want_write || want_flush => match r {
                    Ok(Some(0)) => {
                        self.publish_will = true;
                        return Err(std::io::ErrorKind::WriteZero.into());
                    }
                    Ok(Some(n)) => {
                        bytes::Buf::advance(&mut self.conn.out, n);
                        unflushed = flush_writes;
                        match self.metrics.as_mut() {
                            Some(m) => {
                                m.bytes_out(n);
                                m.flush();
                            }
                            None => self.pre_open.wrote(n),
                        }
                    }
                    Ok(None) => unflushed = false,
                    Err(e) => {
                        self.publish_will = true;
                        return Err(e);
                    }
                },
                _ = notified(self.client.as_ref()) => {}
                () = tokio::task::yield_now(), if self.retained_yield => {}
                () = &mut timer, if armed.is_some() => {
                    armed = None;
                    fired = true;
                }
                () = kicked(self.registration.as_mut()) => {
                    // Another connection took the session over: its will
                    // is not ours to publish (MQTT 5: 0x8E).
                    // What the client sent before it went (a last PUBACK
                    // still in the socket) counts: read what is there now
                    // and act on it before the leases go back.
                    loop {
                        input.reserve(READ_BUF_IDLE);
                        match rd.read_buf(&mut input).now_or_never() {
                            Some(Ok(n)) if n > 0 => self.conn.on_read(Instant::now()),
                            _ => break,
                        }
                    }
                    while let Some(ev) = self.conn.poll(&mut input) {
                        // (Never a CONNECT: the adapter refuses a second.)
                        let _ = self.handle_event(ev);
                    }
                    self.end_batch();
                    self.end_reason = Some("session taken over".into());
                    self.publish_will = true;
                    self.conn.disconnect(0x8E, "session taken over");
                }
                r = self.alarms.changed(), if self.blocked => {
                    if r.is_ok() {
                        self.refresh_alarm();
                    }
                }
                // The tenant's block changed, or its rate pause is over.
                () = tenant_gate::wake(self.gate.as_deref_mut(), self.blocked) => {
                    self.refresh_alarm();
                }
                r = shutdown.changed() => {
                    if r.is_err() || *shutdown.borrow() {
                        self.end_reason = Some("broker shutdown".into());
                        self.conn.disconnect(0x8B, "server shutting down");
                    }
                }
            }
        }
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
                if let Some(g) = self.gate.as_mut() {
                    g.refresh();
                    g.published(p.payload.len());
                }
                self.blocked |= self.gate.as_ref().is_some_and(|g| g.blocked()) || self.alarm.any();
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
    /// barrier for the durable publishes, and the acks that can go now.
    fn end_batch(&mut self) {
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
            Some(c) => c.tenant().update_session_state(&refs).map(|_| ()),
            None => Ok(()),
        };
        if let Err(e) = r {
            tracing::warn!(peer = %self.peer, error = %e, "MQTT session state not stored");
            self.end_reason = Some("the store failed".into());
            self.conn.disconnect(0x80, "the store failed");
        }
        self.batch_needs_barrier = true;
        self.hold_until = self.barriers_sent + 1;
    }

    /// One store barrier for everything the batch appended that an answer
    /// waits for.
    fn request_barrier(&mut self) {
        if std::mem::take(&mut self.batch_needs_barrier) {
            self.barriers_sent += 1;
            let n = self.barriers_sent;
            let durable = self.durable.clone();
            let ok = self.client.as_mut().is_some_and(|c| {
                let handle = c.handle().clone();
                let waiter: weir_backend::Waiter = Box::new(move |r| {
                    if r.is_ok() {
                        durable.fetch_max(n, Ordering::AcqRel);
                        handle.wake();
                    }
                });
                c.durability_barrier(waiter).is_ok()
            });
            if !ok {
                // The store failed: nothing more is acknowledged.
                self.end_reason = Some("the store failed".into());
                self.conn.disconnect(0x80, "the store failed");
            }
        }
    }

    fn refresh_alarm(&mut self) {
        self.alarm = *self.alarms.borrow_and_update();
        if let Some(g) = self.gate.as_mut() {
            g.refresh();
        }
        self.blocked &= self.gate.as_ref().is_some_and(|g| g.blocked()) || self.alarm.any();
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
        if let Some(mut c) = self.client.take() {
            c.close();
        }
        if !self.client_id.is_empty() {
            if self.session_expiry_secs > 0 {
                self.park_resends();
            }
            if self.session_expiry_secs == 0 {
                self.delete_session_queue();
                self.clear_session_state();
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
