//! One AMQP connection's task: socket I/O around the sans-IO adapter, and the
//! mapping of its events onto the engine.
//!
//! The loop reads whatever bytes are there, handles every complete frame in
//! them, then settles the batch (one store append for its acks, one confirm
//! per channel), encodes pending deliveries straight into the write buffer and
//! writes everything with as few syscalls as the socket allows.

use super::channel::{Channel, ChannelConsumer, Lease};
use super::convert::{table_to_json, LazyHeaders};
use crate::engine::consumer::{ConnHandle, Consumer, Credit, Delivery, Notice, NO_ACK_WINDOW};
use crate::engine::exchange::{ExchangeDef, ExchangeKind};
use crate::engine::message::{now_ms, Entry, Message};
use crate::engine::meta::DestinationKind;
use crate::engine::queue::{Partition, Queue};
use crate::engine::tenant::{QueueDeclare, RouteInput};
use crate::engine::{DurableWait, Engine, EngineError, Tenant};
use crate::server::{Alarms, Shared};
use bytes::{Bytes, BytesMut};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, watch};
use weir_backend::{Location, MessageData, MessageId, Op, PartitionId, Store};
use weir_protocols::amqp::codec;
use weir_protocols::amqp::methods::{basic, confirm, connection, exchange, queue, AMQPClass};
use weir_protocols::amqp::{reply, Connection, Event, Publish};

/// Stop reading from a client while this much output is unwritten.
const OUT_HIGH_WATER: usize = 4 << 20;
/// Stop encoding deliveries while this much output is unwritten.
const DELIVERY_HIGH_WATER: usize = 1 << 20;
/// How long a peer gets to answer our connection.close.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a client gets from connecting to connection.open-ok (RabbitMQ: 10 s).
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Where a published message's copy for one partition is kept.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kept {
    /// In the store, durably (a persistent message in a durable queue).
    Stored,
    /// In the store as a page record: transient, but too deep in its queue
    /// to stay in memory.
    Paged,
    /// In memory only.
    Memory,
}

/// A store confirmation for a channel's publishes up to `tag`.
struct StoreConfirm {
    channel: u16,
    /// Which opening of the channel number the publishes belong to: a
    /// confirm for a closed channel must not reach a reopened one.
    epoch: u64,
    tag: u64,
    ok: bool,
}

/// A failure that ends the connection with a hard AMQP error.
struct Hard {
    code: u16,
    text: String,
    class_id: u16,
    method_id: u16,
}

/// Why handling a method failed.
enum Failure {
    /// Close the channel with this code.
    Channel(u16, String),
    /// Close the connection.
    Connection(Hard),
}

impl From<EngineError> for Failure {
    fn from(e: EngineError) -> Self {
        let text = e.to_string();
        match e {
            EngineError::NotFound(_) => Failure::Channel(reply::NOT_FOUND, text),
            EngineError::AccessRefused(_) => Failure::Channel(reply::ACCESS_REFUSED, text),
            EngineError::ResourceLocked(_) => Failure::Channel(reply::RESOURCE_LOCKED, text),
            EngineError::PreconditionFailed(_) => {
                Failure::Channel(reply::PRECONDITION_FAILED, text)
            }
            EngineError::CommandInvalid(_) => Failure::Connection(Hard {
                code: reply::COMMAND_INVALID,
                text,
                class_id: 0,
                method_id: 0,
            }),
            EngineError::NotImplemented(_) => Failure::Connection(Hard {
                code: reply::NOT_IMPLEMENTED,
                text,
                class_id: 0,
                method_id: 0,
            }),
            EngineError::Store(_) => Failure::Connection(Hard {
                code: reply::INTERNAL_ERROR,
                text,
                class_id: 0,
                method_id: 0,
            }),
        }
    }
}

fn hard(code: u16, text: String) -> Failure {
    Failure::Connection(Hard {
        code,
        text: format!("{} - {text}", reply::name(code)),
        class_id: 0,
        method_id: 0,
    })
}

fn soft(code: u16, text: String) -> Failure {
    Failure::Channel(code, format!("{} - {text}", reply::name(code)))
}

/// Serves one accepted AMQP connection until it closes.
pub async fn serve(
    stream: TcpStream,
    peer: SocketAddr,
    shared: Arc<Shared>,
    shutdown: watch::Receiver<bool>,
) {
    let _ = stream.set_nodelay(true);
    let id = shared.engine.next_connection_id();
    let (confirm_tx, confirm_rx) = mpsc::unbounded_channel();
    let server_cfg = shared.amqp.clone();
    let alarms = shared.alarms.subscribe();
    let mut s = Session {
        shared: shared.clone(),
        engine: shared.engine.clone(),
        store: shared.engine.store().clone(),
        conn: Connection::new(server_cfg),
        handle: ConnHandle::new(id),
        tenant: None,
        peer,
        channels: HashMap::new(),
        confirm_tx,
        route_buf: Vec::new(),
        publish_targets: Vec::new(),
        publish_durable: Vec::new(),
        settles: Vec::new(),
        to_dispatch: Vec::new(),
        deliveries: Vec::new(),
        notices: Vec::new(),
        locs: Vec::with_capacity(1),
        next_epoch: 0,
        next_consumer_tag: 0,
        alarms,
        alarm: Alarms::default(),
        blocked_sent: false,
        blocked: false,
    };
    tracing::debug!(%peer, connection = id, "AMQP connection accepted");
    let result = s.run(stream, confirm_rx, shutdown).await;
    s.release_all();
    match result {
        Ok(()) => tracing::debug!(%peer, connection = id, "AMQP connection closed"),
        Err(e) => tracing::info!(%peer, connection = id, error = %e, "AMQP connection ended"),
    }
}

struct Session {
    shared: Arc<Shared>,
    engine: Arc<Engine>,
    store: Arc<dyn Store>,
    conn: Connection,
    handle: Arc<ConnHandle>,
    tenant: Option<Arc<Tenant>>,
    peer: SocketAddr,
    channels: HashMap<u16, Channel>,
    confirm_tx: mpsc::UnboundedSender<StoreConfirm>,
    route_buf: Vec<Arc<Queue>>,
    /// Per publish: each destination's partition and where its copy is kept.
    publish_targets: Vec<(Arc<Partition>, Kept)>,
    /// Per publish: the stored partitions, then the paged ones.
    publish_durable: Vec<PartitionId>,
    /// Settles gathered in this batch, appended to the store once.
    settles: Vec<(PartitionId, MessageId, Location)>,
    /// Partitions whose consumers got credit back in this batch.
    to_dispatch: Vec<Arc<Partition>>,
    deliveries: Vec<Delivery>,
    notices: Vec<Notice>,
    locs: Vec<Location>,
    /// Counter behind [`Channel::epoch`].
    next_epoch: u64,
    /// Counter behind server-generated consumer tags.
    next_consumer_tag: u64,
    /// The broker's resource alarms.
    alarms: watch::Receiver<Alarms>,
    /// Their last seen state.
    alarm: Alarms,
    /// connection.blocked was sent and not yet followed by unblocked.
    blocked_sent: bool,
    /// It published while an alarm was set: not read until the alarm
    /// clears. (As in RabbitMQ, a connection that only consumes, acks,
    /// purges or deletes is never blocked: that is what frees resources.)
    blocked: bool,
}

impl Session {
    async fn run(
        &mut self,
        stream: TcpStream,
        mut confirm_rx: mpsc::UnboundedReceiver<StoreConfirm>,
        mut shutdown: watch::Receiver<bool>,
    ) -> std::io::Result<()> {
        let mut input = BytesMut::with_capacity(64 * 1024);
        let mut last_read = Instant::now();
        let mut last_write = Instant::now();
        let mut closing_since: Option<Instant> = None;
        let mut tick_period = Duration::from_secs(1);
        let mut tick = tokio::time::interval(tick_period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut eof = false;
        let started = Instant::now();
        // Partly received content: how much, and since when it has not grown.
        let mut partial = 0usize;
        let mut partial_since = Instant::now();
        self.alarm = *self.alarms.borrow_and_update();
        loop {
            // A publish is judged against the alarms as they are now: one
            // atomic load per loop, no waiter registered (only a blocked
            // connection waits for the alarm to clear, below).
            if self.alarms.has_changed().unwrap_or(false) {
                self.refresh_alarm();
            }
            // 1. Interpret every complete frame we have. One read can hold
            // tens of thousands of frames (binds, declares, publishes): spend
            // the task's cooperative budget per event so the runtime gets to
            // serve other connections (and accept new ones) in between.
            while let Some(ev) = self.conn.poll(&mut input) {
                self.handle_event(ev).await;
                tokio::task::consume_budget().await;
            }
            self.end_batch();
            self.signal_alarm();
            // 2. Deliveries and notices from the engine.
            if self.conn.out().len() < DELIVERY_HIGH_WATER && self.conn.is_open() {
                self.write_deliveries();
            }
            // 3. Write what we can without blocking.
            if !self.conn.out().is_empty() {
                let n = write_some(&stream, self.conn.out())?;
                if n > 0 {
                    last_write = Instant::now();
                }
            }
            if self.conn.is_closing() && closing_since.is_none() {
                closing_since = Some(Instant::now());
            }
            if self.conn.is_finished() && self.conn.out().is_empty() {
                return Ok(());
            }
            if eof {
                return Ok(());
            }
            // Heartbeats go out after hb/2 of silence and the peer is dropped
            // after 2·hb: tick often enough to send one well before that.
            let hb = u64::from(self.conn.heartbeat());
            let period = if hb > 0 && self.conn.is_open() {
                Duration::from_millis((hb * 250).clamp(250, 1000))
            } else {
                Duration::from_secs(1)
            };
            if period != tick_period {
                tick_period = period;
                tick = tokio::time::interval(period);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            }
            // 4. Wait for something to do. While a resource alarm is set, a
            // connection that publishes is not read (after the publish in
            // hand, or in the middle of one); one that only consumes is.
            if self.alarm.any() && !self.blocked && self.conn.partial_content_bytes() > 0 {
                self.blocked = true;
                self.signal_alarm();
            }
            let want_read =
                self.conn.out().len() < OUT_HIGH_WATER && !self.conn.is_finished() && !self.blocked;
            if !want_read {
                // We stopped reading, not the client: its heartbeats are
                // waiting in the socket.
                last_read = Instant::now();
            }
            let want_write = !self.conn.out().is_empty();
            tokio::select! {
                r = stream.readable(), if want_read => {
                    r?;
                    input.reserve(64 * 1024);
                    match stream.try_read_buf(&mut input) {
                        Ok(0) => {
                            eof = true;
                            // The peer went away: nothing more can be written.
                            self.conn.out().clear();
                            self.conn.abandon();
                        }
                        Ok(_) => last_read = Instant::now(),
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                        Err(e) => return Err(e),
                    }
                }
                r = stream.writable(), if want_write => { r?; }
                _ = self.handle.notified() => {}
                r = self.alarms.changed(), if self.blocked => {
                    if r.is_ok() {
                        self.refresh_alarm();
                    }
                }
                Some(c) = confirm_rx.recv() => {
                    self.on_store_confirm(c);
                    while let Ok(c) = confirm_rx.try_recv() {
                        self.on_store_confirm(c);
                    }
                }
                _ = tick.tick() => {
                    let hb = self.conn.heartbeat() as u64;
                    if hb > 0 && self.conn.is_open() {
                        if last_read.elapsed() > Duration::from_secs(hb * 2) {
                            tracing::info!(peer = %self.peer, "missed heartbeats from client, closing");
                            return Ok(());
                        }
                        if last_write.elapsed() >= Duration::from_millis(hb * 500) {
                            self.conn.send_heartbeat();
                        }
                    }
                    if closing_since.is_some_and(|t| t.elapsed() > CLOSE_TIMEOUT) {
                        return Ok(());
                    }
                    self.expire_leases();
                    // A client that stops in the middle of a message holds
                    // its buffered frames: cut it off once its content has
                    // not grown for the timeout. Time we did not read it
                    // does not count, except a message of several frames
                    // held through a resource alarm: that memory is what
                    // the alarm waits for.
                    let assembling = self.conn.partial_content_bytes();
                    let now_partial = assembling + input.len();
                    // (A publish cut off between its frames by the block is small: it
                    // waits for the alarm like the rest of the publisher.)
                    let held_through_alarm = self.blocked && assembling > self.conn.frame_max();
                    let paused = !want_read && !held_through_alarm;
                    if now_partial == 0 || now_partial != partial || paused || !self.conn.is_open() {
                        partial = now_partial;
                        partial_since = Instant::now();
                    } else if let Some(limit) = self.shared.partial_content_timeout {
                        if partial_since.elapsed() > limit {
                            tracing::info!(peer = %self.peer, bytes = partial, "partly received message stalled, closing");
                            let text = format!(
                                "{} bytes of a message received and no progress for {} s",
                                partial,
                                limit.as_secs()
                            );
                            self.fail(0, hard(reply::RESOURCE_ERROR, text), 0, 0);
                            partial = 0;
                            self.shared.request_trim();
                        }
                    }
                    if !self.conn.is_open() && !self.conn.is_closing() && started.elapsed() > HANDSHAKE_TIMEOUT {
                        tracing::info!(peer = %self.peer, "handshake not completed in time, closing");
                        return Ok(());
                    }
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

    async fn handle_event(&mut self, ev: Event) {
        match ev {
            Event::Login {
                mechanism,
                username,
                password,
            } => {
                if self
                    .shared
                    .authenticate(&username, &password, self.peer)
                    .await
                {
                    self.conn.accept_login();
                } else {
                    // Slow down guessing from this address; only this
                    // connection's task waits.
                    let delay = self.shared.logins.failed(self.peer.ip());
                    tokio::time::sleep(delay).await;
                    tracing::info!(peer = %self.peer, user = %username, %mechanism, delay_ms = delay.as_millis() as u64, "login refused");
                    self.conn.refuse_login(&format!(
                        "Login was refused using authentication mechanism {mechanism}."
                    ));
                }
            }
            Event::OpenVhost { vhost } => match self.engine.tenant(&vhost) {
                Some(t) => {
                    self.tenant = Some(t);
                    self.conn.accept_open();
                }
                None => self.conn.refuse_open(&format!("vhost {vhost} not found")),
            },
            Event::ChannelOpened(ch) => {
                self.next_epoch += 1;
                self.channels.insert(
                    ch,
                    Channel {
                        epoch: self.next_epoch,
                        ..Channel::default()
                    },
                );
            }
            Event::ChannelClosed(ch) => self.release_channel(ch),
            Event::Closed => self.release_all(),
            Event::Flow { channel, active } => {
                if let Some(c) = self.channels.get(&channel) {
                    c.flow_active.store(active, Ordering::Release);
                    if active {
                        for cc in c.consumers.values() {
                            self.to_dispatch.extend(cc.queue.partitions.iter().cloned());
                        }
                    }
                }
            }
            Event::Qos {
                channel,
                prefetch_size,
                prefetch_count,
                global,
            } => {
                if !self.conn.channel_is_usable(channel) {
                    return;
                }
                if let Some(c) = self.channels.get_mut(&channel) {
                    if global {
                        // Every consumer of the channel shares this window, so
                        // a change reaches existing consumers too; a raised
                        // limit may let their queues deliver right away.
                        if let Some(cc) = &c.channel_credit {
                            cc.max_count.store(prefetch_count as u32, Ordering::Relaxed);
                            cc.max_bytes.store(prefetch_size, Ordering::Relaxed);
                        }
                        for cc in c.consumers.values() {
                            self.to_dispatch.extend(cc.queue.partitions.iter().cloned());
                        }
                    } else {
                        c.prefetch_count = prefetch_count;
                        c.prefetch_size = prefetch_size;
                    }
                }
                self.conn.send_method(
                    channel,
                    AMQPClass::Basic(basic::AMQPMethod::QosOk(basic::QosOk {})),
                );
            }
            Event::Publish { channel, message } => {
                if !self.conn.channel_is_usable(channel) {
                    return;
                }
                // The publish in hand is taken; then no more reads until
                // the alarm clears.
                self.blocked |= self.alarm.any();
                if let Err(f) = self.on_publish(channel, message) {
                    self.fail(channel, f, 60, 40);
                }
            }
            Event::Ack {
                channel,
                delivery_tag,
                multiple,
            } => {
                if !self.conn.channel_is_usable(channel) {
                    return;
                }
                if let Err(f) = self.on_settle(channel, delivery_tag, multiple, Settle::Ack) {
                    self.fail(channel, f, 60, 80);
                }
            }
            Event::Method { channel, method } => {
                if !self.conn.channel_is_usable(channel) {
                    return;
                }
                let (class_id, method_id) =
                    (method.get_amqp_class_id(), method.get_amqp_method_id());
                if let Err(f) = self.on_method(channel, method).await {
                    self.fail(channel, f, class_id, method_id);
                }
            }
        }
    }

    fn fail(&mut self, channel: u16, f: Failure, class_id: u16, method_id: u16) {
        match f {
            Failure::Channel(code, text) => {
                tracing::debug!(peer = %self.peer, channel, code, %text, "closing channel");
                self.release_channel(channel);
                self.conn
                    .close_channel(channel, code, &text, class_id, method_id);
            }
            Failure::Connection(h) => {
                tracing::info!(peer = %self.peer, code = h.code, text = %h.text, "closing connection");
                self.release_all();
                let (c, m) = if h.class_id == 0 {
                    (class_id, method_id)
                } else {
                    (h.class_id, h.method_id)
                };
                self.conn.fail(h.code, h.text, c, m);
            }
        }
    }

    fn tenant(&self) -> Result<Arc<Tenant>, Failure> {
        self.tenant
            .clone()
            .ok_or_else(|| hard(reply::COMMAND_INVALID, "connection not open".into()))
    }

    // ----- publishing -----

    fn on_publish(&mut self, ch: u16, p: Publish) -> Result<(), Failure> {
        if p.immediate {
            return Err(hard(reply::NOT_IMPLEMENTED, "immediate=true".into()));
        }
        let tenant = self.tenant()?;
        let exchange = std::str::from_utf8(&p.exchange)
            .map_err(|_| hard(reply::SYNTAX_ERROR, "exchange name is not UTF-8".into()))?;
        let routing_key = std::str::from_utf8(&p.routing_key)
            .map_err(|_| hard(reply::SYNTAX_ERROR, "routing key is not UTF-8".into()))?;
        let mut queues = std::mem::take(&mut self.route_buf);
        queues.clear();
        let headers = LazyHeaders::new(&p.properties);
        let routed = tenant.route(
            &RouteInput {
                exchange,
                routing_key,
                headers: &headers,
            },
            &mut queues,
        );
        if let Err(e) = routed {
            self.route_buf = queues;
            return Err(e.into());
        }
        let Some(c) = self.channels.get_mut(&ch) else {
            self.route_buf = queues;
            return Ok(());
        };
        if c.confirm {
            c.publish_tag += 1;
            c.batch_publishes += 1;
        }
        if queues.is_empty() {
            if p.mandatory {
                let frame_max = self.conn.frame_max();
                let out = self.conn.out();
                codec::write_return(
                    out,
                    ch,
                    reply::NO_ROUTE,
                    "NO_ROUTE",
                    &p.exchange,
                    &p.routing_key,
                );
                codec::write_content(out, ch, &p.properties, &p.body, frame_max);
            }
            self.route_buf = queues;
            return Ok(());
        }
        let id = self.store.allocate_ids(1);
        let message = Arc::new(Message {
            id,
            exchange: p.exchange.clone(),
            routing_key: p.routing_key.clone(),
            properties: p.properties.clone(),
            body: p.body.clone(),
            header_format: crate::engine::message::HEADER_AMQP_091,
            persistent: p.persistent,
            priority: p.priority.unwrap_or(0),
        });
        let size = message.size();
        // Pick each queue's partition, and store once for all durable ones.
        // (Buffers reused across publishes: nothing allocated per message.)
        let mut targets = std::mem::take(&mut self.publish_targets);
        let mut durable_parts = std::mem::take(&mut self.publish_durable);
        targets.clear();
        durable_parts.clear();
        for q in &queues {
            let part = q.partition_for_publish();
            let kept = if message.persistent && part.durable {
                durable_parts.push(part.id);
                Kept::Stored
            } else {
                Kept::Memory
            };
            targets.push((part.clone(), kept));
        }
        // Transient copies (a transient message, or a non-durable queue) into
        // partitions already deeper than the in-memory window are paged to
        // the store too, after the durable ones in the same buffer, so memory
        // does not grow with queue depth. Skipped entirely on the hot path
        // (every target stored).
        let n_durable = durable_parts.len();
        if n_durable < targets.len() {
            for (part, kept) in &mut targets {
                if *kept == Kept::Memory
                    && part.ready_len() >= crate::engine::queue::HOT_ENTRIES as u64
                {
                    *kept = Kept::Paged;
                    durable_parts.push(part.id);
                }
            }
        }
        let data = MessageData {
            exchange,
            routing_key,
            header_format: message.header_format,
            header: &message.properties,
            body: &message.body,
            attrs: weir_backend::MessageAttrs {
                priority: message.priority,
                expires_at_ms: 0,
            },
        };
        let mut location = None;
        if n_durable > 0 {
            self.locs.clear();
            let res = self.store.append(
                &[Op::Publish {
                    id,
                    partitions: &durable_parts[..n_durable],
                    data,
                }],
                &mut self.locs,
                None,
            );
            if let Err(e) = res {
                self.route_buf = queues;
                self.publish_targets = targets;
                self.publish_durable = durable_parts;
                return self.refuse_publish(ch, e);
            }
            location = self.locs.first().copied();
            debug_assert!(
                location.is_some(),
                "store returned no location for a publish"
            );
            c.batch_needs_store = true;
        }
        let mut page_location = None;
        if durable_parts.len() > n_durable {
            self.locs.clear();
            // Never waited on: a restart drops it anyway. If the store cannot
            // take it (disk full), the message simply stays in memory.
            let res = self.store.append(
                &[Op::Page {
                    id,
                    partitions: &durable_parts[n_durable..],
                    data,
                }],
                &mut self.locs,
                None,
            );
            match res {
                Ok(()) => page_location = self.locs.first().copied(),
                Err(e) => tracing::debug!(error = %e, "not paging a transient message"),
            }
        }
        let now = now_ms();
        for (part, kept) in targets.drain(..) {
            let location = match kept {
                Kept::Stored => location,
                // None if the store could not take the page: kept in memory.
                Kept::Paged => page_location,
                Kept::Memory => None,
            };
            let refused = part.enqueue(Entry {
                seq: 0,
                id,
                location,
                size,
                redelivered: false,
                attempts: 0,
                enqueued_ms: now,
                message: Some(message.clone()),
            });
            // The queue was deleted after routing: the message is gone with it.
            if let Some(Entry {
                location: Some(l), ..
            }) = refused
            {
                self.settles.push((part.id, id, l));
            }
        }
        self.publish_durable = durable_parts;
        self.publish_targets = targets;
        self.route_buf = queues;
        Ok(())
    }

    /// The store refused a persistent publish. Out of disk space, the
    /// publisher is told with basic.nack (confirm mode) and the connection
    /// stays up; without confirms the message is dropped, as an unconfirmed
    /// publish may be. Any other store failure still closes the connection.
    fn refuse_publish(&mut self, ch: u16, e: weir_backend::StoreError) -> Result<(), Failure> {
        if !matches!(e, weir_backend::StoreError::NoSpace) {
            return Err(EngineError::Store(e).into());
        }
        let Some(c) = self.channels.get_mut(&ch) else {
            return Ok(());
        };
        if c.confirm {
            // Nacked now, on its own; the batch's multiple-ack must not cover
            // it again (a multiple-ack skips tags already settled).
            let tag = c.publish_tag;
            c.batch_publishes = c.batch_publishes.saturating_sub(1);
            if self.conn.channel_is_usable(ch) {
                codec::write_confirm(self.conn.out(), ch, tag, false, true);
            }
        }
        tracing::debug!(channel = ch, "disk full: publish refused");
        Ok(())
    }

    fn on_store_confirm(&mut self, c: StoreConfirm) {
        let Some(ch) = self.channels.get_mut(&c.channel) else {
            return;
        };
        if ch.epoch != c.epoch {
            return;
        }
        ch.store_confirms_pending = ch.store_confirms_pending.saturating_sub(1);
        if self.conn.channel_is_usable(c.channel) {
            codec::write_confirm(self.conn.out(), c.channel, c.tag, true, !c.ok);
        }
    }

    /// Closes the input batch: settles acked messages in the store with one
    /// append, confirms each channel's publishes with one `multiple` ack (after
    /// the store's fsync when any was persistent), and lets partitions whose
    /// consumers got credit back deliver again.
    fn end_batch(&mut self) {
        if !self.settles.is_empty() {
            let ops: Vec<Op> = self
                .settles
                .iter()
                .map(|(p, id, l)| Op::Settle {
                    partition: *p,
                    id: *id,
                    location: *l,
                })
                .collect();
            if let Err(e) = self.store.append(&ops, &mut Vec::new(), None) {
                tracing::error!(error = %e, "store refused settles");
            }
            self.settles.clear();
        }
        for (&id, c) in self.channels.iter_mut() {
            if c.batch_publishes == 0 {
                continue;
            }
            let tag = c.publish_tag;
            if c.batch_needs_store || c.store_confirms_pending > 0 {
                // Ordered behind every earlier append: fires once they are all durable.
                let tx = self.confirm_tx.clone();
                c.store_confirms_pending += 1;
                let epoch = c.epoch;
                let waiter: weir_backend::Waiter = Box::new(move |r| {
                    let _ = tx.send(StoreConfirm {
                        channel: id,
                        epoch,
                        tag,
                        ok: r.is_ok(),
                    });
                });
                if let Err(e) = self.store.append(&[], &mut Vec::new(), Some(waiter)) {
                    tracing::error!(error = %e, "store refused a confirm barrier");
                    c.store_confirms_pending -= 1;
                    codec::write_confirm(self.conn.out(), id, tag, true, true);
                }
            } else {
                codec::write_confirm(self.conn.out(), id, tag, true, false);
            }
            c.batch_publishes = 0;
            c.batch_needs_store = false;
        }
        for p in std::mem::take(&mut self.to_dispatch) {
            p.dispatch();
        }
    }

    /// Takes the current alarm state; a cleared alarm unblocks.
    fn refresh_alarm(&mut self) {
        self.alarm = *self.alarms.borrow_and_update();
        self.blocked &= self.alarm.any();
    }

    /// Tells the client (`connection.blocked` / `connection.unblocked`) when
    /// it is blocked by a resource alarm, and when that alarm clears.
    fn signal_alarm(&mut self) {
        let set = self.blocked;
        if set == self.blocked_sent || !self.conn.is_open() || !self.conn.accepts_blocked() {
            return;
        }
        let method = if set {
            connection::AMQPMethod::Blocked(connection::Blocked {
                reason: self.alarm.reason().into(),
            })
        } else {
            connection::AMQPMethod::Unblocked(connection::Unblocked {})
        };
        self.conn.send_method(0, AMQPClass::Connection(method));
        self.blocked_sent = set;
    }

    // ----- consuming -----

    /// Encodes deliveries into the write buffer until it reaches
    /// [`DELIVERY_HIGH_WATER`]; the rest wait (bodies not read back, not
    /// encoded) for the socket to drain. What waits is bounded by the
    /// connection's unsent window ([`ConnHandle::unsent_done`]): past it the
    /// messages stay in their queues.
    fn write_deliveries(&mut self) {
        self.handle.drain(&mut self.deliveries, &mut self.notices);
        for n in std::mem::take(&mut self.notices) {
            match n {
                Notice::ConsumerCancelled { consumer } => {
                    let (channel, tag) = (consumer.channel, consumer.tag.clone());
                    if let Some(c) = self.channels.get_mut(&channel) {
                        // Only if the tag still names this consumer: the client
                        // may have cancelled it and reused the tag since.
                        let same = c
                            .consumers
                            .get(&tag)
                            .is_some_and(|cc| Arc::ptr_eq(&cc.consumer, &consumer));
                        if same
                            && c.consumers.remove(&tag).is_some()
                            && self.conn.channel_is_usable(channel)
                        {
                            let tag = String::from_utf8_lossy(&tag).into_owned();
                            self.conn.send_method(
                                channel,
                                AMQPClass::Basic(basic::AMQPMethod::Cancel(basic::Cancel {
                                    consumer_tag: tag.as_str().into(),
                                    nowait: true,
                                })),
                            );
                        }
                    }
                }
            }
        }
        let frame_max = self.conn.frame_max();
        // One clock read per batch, not per delivery.
        let batch_time = Instant::now();
        // Taken for the loop and put back after, keeping its capacity.
        let mut deliveries = std::mem::take(&mut self.deliveries);
        let mut unsend: Vec<(Arc<Partition>, Entry)> = Vec::new();
        let mut waiting: Vec<Delivery> = Vec::new();
        let mut pending = deliveries.drain(..);
        let mut handled = 0u32;
        loop {
            if self.conn.out().len() >= DELIVERY_HIGH_WATER {
                waiting.extend(pending.by_ref());
                break;
            }
            let Some(d) = pending.next() else { break };
            handled += 1;
            let usable = self.conn.channel_is_usable(d.consumer.channel)
                && !d.consumer.cancelled.load(Ordering::Acquire)
                && self.channels.contains_key(&d.consumer.channel);
            if !usable {
                d.consumer.release(d.entry.size);
                unsend.push((d.partition, d.entry));
                continue;
            }
            let message = match &d.entry.message {
                Some(m) => m.clone(),
                None => match self.read_back(&d.partition, &d.entry) {
                    Some(m) => m,
                    None => {
                        // Unreadable (the store reported why): drop it rather
                        // than loop on it forever, and free its record.
                        d.consumer.release(d.entry.size);
                        if let Some(l) = d.partition.settled(&d.entry, false) {
                            self.settles.push((d.partition.id, d.entry.id, l));
                        }
                        continue;
                    }
                },
            };
            let Some(c) = self.channels.get_mut(&d.consumer.channel) else {
                // Checked usable above; never drop a delivery silently.
                d.consumer.release(d.entry.size);
                unsend.push((d.partition, d.entry));
                continue;
            };
            c.delivery_tag += 1;
            let tag = c.delivery_tag;
            let out = self.conn.out();
            codec::write_deliver(
                out,
                d.consumer.channel,
                &d.consumer.tag,
                tag,
                d.entry.redelivered,
                &message.exchange,
                &message.routing_key,
            );
            codec::write_content(
                out,
                d.consumer.channel,
                &message.properties,
                &message.body,
                frame_max,
            );
            if d.consumer.no_ack {
                d.consumer.release(d.entry.size);
                if let Some(l) = d.partition.settled(&d.entry, true) {
                    self.settles.push((d.partition.id, d.entry.id, l));
                }
                self.to_dispatch.push(d.partition.clone());
            } else {
                let mut entry = d.entry;
                if entry.location.is_some() {
                    // Written: a stored message's lease needs only its
                    // location (a requeue reads the body back), so a client
                    // holding many unacked messages does not hold their bodies.
                    entry.message = None;
                }
                c.leases.insert(
                    tag,
                    Lease {
                        partition: d.partition,
                        consumer: Some(d.consumer),
                        entry,
                        since: batch_time,
                    },
                );
            }
        }
        drop(pending);
        // Room on the way to us again (once per batch), then see whether a
        // queue was refused for lack of it meanwhile.
        self.handle.unsent_done(handled);
        // Not yet encoded: first in line next time, in order.
        deliveries.append(&mut waiting);
        self.deliveries = deliveries;
        if self.handle.take_starved() {
            // A queue stopped handing us messages for lack of room; there is
            // room again: let every queue we consume from deliver.
            for c in self.channels.values() {
                for cc in c.consumers.values() {
                    self.to_dispatch.extend(cc.queue.partitions.iter().cloned());
                }
            }
        }
        for (p, e) in unsend {
            let refused = p.unsend(std::iter::once(e));
            self.settle_refused(&p, refused);
        }
        dedup_partitions(&mut self.to_dispatch);
        if !self.settles.is_empty() || !self.to_dispatch.is_empty() {
            self.end_batch();
        }
    }

    fn read_back(&self, p: &Partition, e: &Entry) -> Option<Arc<Message>> {
        // Compaction may have moved the record since the entry was handed
        // out, and may move it again (and reclaim the old segment) between
        // the lookup and the read: retry while the location keeps changing.
        let mut loc = p.leased_location(e)?;
        let mut read = self.store.read(loc);
        for _ in 0..3 {
            if read.is_ok() {
                break;
            }
            match p.leased_location(e) {
                Some(now) if now != loc => {
                    loc = now;
                    read = self.store.read(loc);
                }
                _ => break,
            }
        }
        match read {
            Ok(m) => Some(Arc::new(Message {
                id: m.id,
                exchange: Bytes::from(m.exchange.into_bytes()),
                routing_key: Bytes::from(m.routing_key.into_bytes()),
                properties: m.header,
                body: m.body,
                header_format: m.header_format,
                persistent: true,
                priority: m.attrs.priority,
            })),
            Err(err) => {
                tracing::error!(error = %err, id = e.id, "cannot read a queued message back from the store");
                None
            }
        }
    }

    fn on_settle(&mut self, ch: u16, tag: u64, multiple: bool, how: Settle) -> Result<(), Failure> {
        let Some(c) = self.channels.get_mut(&ch) else {
            return Ok(());
        };
        let Some(leases) = c.take_leases(tag, multiple) else {
            return Err(soft(
                reply::PRECONDITION_FAILED,
                format!("unknown delivery tag {tag}"),
            ));
        };
        self.settle_leases(leases, how);
        Ok(())
    }

    fn settle_leases(&mut self, leases: Vec<Lease>, how: Settle) {
        // Grouped by partition so each takes its lock once per batch (a
        // `multiple` ack usually settles many leases of one queue).
        let mut drop: Vec<(Arc<Partition>, Vec<Entry>)> = Vec::new();
        let mut requeue: Vec<(Arc<Partition>, Vec<Entry>)> = Vec::new();
        for l in leases {
            if let Some(c) = &l.consumer {
                c.release(l.entry.size);
            }
            let drop_it = match how {
                Settle::Ack | Settle::Drop => true,
                Settle::Requeue => l.partition.is_deleted(),
            };
            let groups = if drop_it { &mut drop } else { &mut requeue };
            match groups
                .iter_mut()
                .find(|(p, _)| Arc::ptr_eq(p, &l.partition))
            {
                Some((_, v)) => v.push(l.entry),
                None => groups.push((l.partition, vec![l.entry])),
            }
        }
        let acked = matches!(how, Settle::Ack);
        for (p, entries) in drop {
            let settles = &mut self.settles;
            p.settled_many(&entries, acked, |id, loc| settles.push((p.id, id, loc)));
            self.to_dispatch.push(p);
        }
        for (p, entries) in requeue {
            let refused = p.requeue(entries);
            self.settle_refused(&p, refused);
        }
        dedup_partitions(&mut self.to_dispatch);
    }

    /// Closes channels holding a lease older than the consumer timeout, as
    /// RabbitMQ's `consumer_timeout` does: the channel's leases return to
    /// their queues (redelivered) for other consumers. Leases are ordered by
    /// tag, which is delivery order, so the first one is the oldest.
    fn expire_leases(&mut self) {
        let Some(timeout) = self.shared.consumer_timeout else {
            return;
        };
        let expired: Vec<u16> = self
            .channels
            .iter()
            .filter(|(_, c)| {
                c.leases
                    .first_key_value()
                    .is_some_and(|(_, l)| l.since.elapsed() > timeout)
            })
            .map(|(id, _)| *id)
            .collect();
        for ch in expired {
            let text = format!(
                "PRECONDITION_FAILED - delivery acknowledgement on channel {ch} timed out. Timeout value used: {} ms",
                timeout.as_millis()
            );
            self.fail(ch, Failure::Channel(reply::PRECONDITION_FAILED, text), 0, 0);
        }
        if !self.to_dispatch.is_empty() {
            self.end_batch();
        }
    }

    /// Settles in the store what a deleted partition refused to take back.
    fn settle_refused(&mut self, p: &Arc<Partition>, refused: Vec<Entry>) {
        for e in refused {
            // Paged entries of non-durable queues have a location too.
            if let Some(l) = e.location {
                self.settles.push((p.id, e.id, l));
            }
        }
    }

    fn release_channel(&mut self, ch: u16) {
        let Some(mut c) = self.channels.remove(&ch) else {
            return;
        };
        let tenant = self.tenant.clone();
        for (_, cc) in c.consumers.drain() {
            cc.consumer.cancelled.store(true, Ordering::Release);
            for p in &cc.queue.partitions {
                p.remove_consumer(&cc.consumer);
            }
            if let Some(t) = &tenant {
                t.consumer_gone(&cc.queue);
            }
        }
        let leases: Vec<Lease> = std::mem::take(&mut c.leases).into_values().collect();
        self.settle_leases(leases, Settle::Requeue);
    }

    fn release_all(&mut self) {
        self.handle.close();
        let chans: Vec<u16> = self.channels.keys().copied().collect();
        for ch in chans {
            self.release_channel(ch);
        }
        // Deliveries already queued for us go back too.
        self.handle.drain(&mut self.deliveries, &mut self.notices);
        self.notices.clear();
        for d in std::mem::take(&mut self.deliveries) {
            self.handle.unsent_done(1);
            d.consumer.release(d.entry.size);
            let refused = d.partition.unsend(std::iter::once(d.entry));
            self.settle_refused(&d.partition, refused);
        }
        if let Some(t) = self.tenant.take() {
            t.connection_closed(self.handle.id);
        }
        self.end_batch();
    }

    // ----- other methods -----

    async fn on_method(&mut self, ch: u16, method: AMQPClass) -> Result<(), Failure> {
        let tenant = self.tenant()?;
        let conn_id = self.handle.id;
        match method {
            AMQPClass::Exchange(m) => match m {
                exchange::AMQPMethod::Declare(d) => {
                    let kind = match ExchangeKind::parse(d.kind.as_str()) {
                        Some(k) => k,
                        None if d.passive => ExchangeKind::Direct,
                        None => {
                            return Err(hard(
                                reply::COMMAND_INVALID,
                                format!("invalid exchange type '{}'", d.kind.as_str()),
                            ))
                        }
                    };
                    let def = ExchangeDef {
                        name: d.exchange.as_str().to_string(),
                        kind,
                        durable: d.durable,
                        auto_delete: d.auto_delete,
                        internal: d.internal,
                        arguments: table_to_json(&d.arguments),
                    };
                    let wait = tenant.declare_exchange(def, d.passive)?;
                    self.reply_when_durable(
                        ch,
                        d.nowait,
                        wait,
                        AMQPClass::Exchange(exchange::AMQPMethod::DeclareOk(
                            exchange::DeclareOk {},
                        )),
                    )
                    .await?;
                }
                exchange::AMQPMethod::Delete(d) => {
                    let wait = tenant.delete_exchange(d.exchange.as_str(), d.if_unused)?;
                    self.reply_when_durable(
                        ch,
                        d.nowait,
                        wait,
                        AMQPClass::Exchange(exchange::AMQPMethod::DeleteOk(exchange::DeleteOk {})),
                    )
                    .await?;
                }
                exchange::AMQPMethod::Bind(b) => {
                    let wait = tenant.bind(
                        b.source.as_str(),
                        DestinationKind::Exchange,
                        b.destination.as_str(),
                        b.routing_key.as_str(),
                        table_to_json(&b.arguments),
                        conn_id,
                    )?;
                    self.reply_when_durable(
                        ch,
                        b.nowait,
                        wait,
                        AMQPClass::Exchange(exchange::AMQPMethod::BindOk(exchange::BindOk {})),
                    )
                    .await?;
                }
                exchange::AMQPMethod::Unbind(b) => {
                    let wait = tenant.unbind(
                        b.source.as_str(),
                        DestinationKind::Exchange,
                        b.destination.as_str(),
                        b.routing_key.as_str(),
                        table_to_json(&b.arguments),
                        conn_id,
                    )?;
                    self.reply_when_durable(
                        ch,
                        b.nowait,
                        wait,
                        AMQPClass::Exchange(exchange::AMQPMethod::UnbindOk(exchange::UnbindOk {})),
                    )
                    .await?;
                }
                other => {
                    return Err(hard(
                        reply::COMMAND_INVALID,
                        format!("unexpected method {other:?}"),
                    ))
                }
            },
            AMQPClass::Queue(m) => match m {
                queue::AMQPMethod::Declare(d) => {
                    let name = if d.passive {
                        self.queue_name(ch, d.queue.as_str())?
                    } else {
                        d.queue.as_str().to_string()
                    };
                    let req = QueueDeclare {
                        name,
                        passive: d.passive,
                        durable: d.durable,
                        exclusive: d.exclusive,
                        auto_delete: d.auto_delete,
                        arguments: table_to_json(&d.arguments),
                        connection: conn_id,
                    };
                    let (ok, wait) = tenant.declare_queue(req)?;
                    if let Some(c) = self.channels.get_mut(&ch) {
                        c.last_queue = Some(ok.name.clone());
                    }
                    self.reply_when_durable(
                        ch,
                        d.nowait,
                        wait,
                        AMQPClass::Queue(queue::AMQPMethod::DeclareOk(queue::DeclareOk {
                            queue: ok.name.as_str().into(),
                            message_count: ok.messages.min(u32::MAX as u64) as u32,
                            consumer_count: ok.consumers,
                        })),
                    )
                    .await?;
                }
                queue::AMQPMethod::Bind(b) => {
                    let wait = tenant.bind(
                        b.exchange.as_str(),
                        DestinationKind::Queue,
                        &self.queue_name(ch, b.queue.as_str())?,
                        b.routing_key.as_str(),
                        table_to_json(&b.arguments),
                        conn_id,
                    )?;
                    self.reply_when_durable(
                        ch,
                        b.nowait,
                        wait,
                        AMQPClass::Queue(queue::AMQPMethod::BindOk(queue::BindOk {})),
                    )
                    .await?;
                }
                queue::AMQPMethod::Unbind(b) => {
                    let wait = tenant.unbind(
                        b.exchange.as_str(),
                        DestinationKind::Queue,
                        &self.queue_name(ch, b.queue.as_str())?,
                        b.routing_key.as_str(),
                        table_to_json(&b.arguments),
                        conn_id,
                    )?;
                    // queue.unbind has no nowait: always answered.
                    self.reply_when_durable(
                        ch,
                        false,
                        wait,
                        AMQPClass::Queue(queue::AMQPMethod::UnbindOk(queue::UnbindOk {})),
                    )
                    .await?;
                }
                queue::AMQPMethod::Purge(p) => {
                    let n = tenant.purge_queue(&self.queue_name(ch, p.queue.as_str())?, conn_id)?;
                    if n > 0 {
                        self.shared.request_trim();
                    }
                    if !p.nowait {
                        self.conn.send_method(
                            ch,
                            AMQPClass::Queue(queue::AMQPMethod::PurgeOk(queue::PurgeOk {
                                message_count: n.min(u32::MAX as u64) as u32,
                            })),
                        );
                    }
                }
                queue::AMQPMethod::Delete(d) => {
                    let (n, wait) = tenant.delete_queue(
                        &self.queue_name(ch, d.queue.as_str())?,
                        d.if_unused,
                        d.if_empty,
                        conn_id,
                    )?;
                    if n > 0 {
                        self.shared.request_trim();
                    }
                    self.reply_when_durable(
                        ch,
                        d.nowait,
                        wait,
                        AMQPClass::Queue(queue::AMQPMethod::DeleteOk(queue::DeleteOk {
                            message_count: n.min(u32::MAX as u64) as u32,
                        })),
                    )
                    .await?;
                }
                other => {
                    return Err(hard(
                        reply::COMMAND_INVALID,
                        format!("unexpected method {other:?}"),
                    ))
                }
            },
            AMQPClass::Basic(m) => self.on_basic(ch, &tenant, m)?,
            AMQPClass::Confirm(confirm::AMQPMethod::Select(s)) => {
                if let Some(c) = self.channels.get_mut(&ch) {
                    c.confirm = true;
                }
                if !s.nowait {
                    self.conn.send_method(
                        ch,
                        AMQPClass::Confirm(confirm::AMQPMethod::SelectOk(confirm::SelectOk {})),
                    );
                }
            }
            AMQPClass::Access(_) => {
                use weir_protocols::amqp::methods::access;
                self.conn.send_method(
                    ch,
                    AMQPClass::Access(access::AMQPMethod::RequestOk(access::RequestOk {})),
                );
            }
            AMQPClass::Tx(_) => {
                return Err(hard(
                    reply::NOT_IMPLEMENTED,
                    "transactions (tx.*) are not supported; use publisher confirms".into(),
                ))
            }
            other => {
                return Err(hard(
                    reply::COMMAND_INVALID,
                    format!(
                        "method {}.{} is not valid here",
                        other.get_amqp_class_id(),
                        other.get_amqp_method_id()
                    ),
                ))
            }
        }
        Ok(())
    }

    fn on_basic(
        &mut self,
        ch: u16,
        tenant: &Arc<Tenant>,
        m: basic::AMQPMethod,
    ) -> Result<(), Failure> {
        let conn_id = self.handle.id;
        match m {
            basic::AMQPMethod::Consume(c) => {
                let q = tenant.queue(&self.queue_name(ch, c.queue.as_str())?, conn_id)?;
                if q.deleted.load(Ordering::Acquire) {
                    return Err(soft(
                        reply::NOT_FOUND,
                        format!("no queue '{}' in vhost '{}'", q.name(), tenant.name),
                    ));
                }
                let exclusive_used = q.partitions.iter().any(|p| p.has_exclusive_consumer());
                if exclusive_used || (c.exclusive && q.consumers.load(Ordering::Acquire) > 0) {
                    return Err(soft(
                        reply::ACCESS_REFUSED,
                        format!(
                            "queue '{}' in vhost '{}' in exclusive use",
                            q.name(),
                            tenant.name
                        ),
                    ));
                }
                self.next_consumer_tag += 1;
                let generated = self.next_consumer_tag;
                let Some(chan) = self.channels.get_mut(&ch) else {
                    return Ok(());
                };
                let tag: Bytes = if c.consumer_tag.as_str().is_empty() {
                    Bytes::from(format!("amq.ctag-{conn_id}-{generated}"))
                } else {
                    Bytes::copy_from_slice(c.consumer_tag.as_str().as_bytes())
                };
                if chan.consumers.contains_key(&tag) {
                    return Err(hard(
                        reply::NOT_ALLOWED,
                        format!(
                            "attempt to reuse consumer tag '{}'",
                            String::from_utf8_lossy(&tag)
                        ),
                    ));
                }
                let consumer = Arc::new(Consumer {
                    tag: tag.clone(),
                    channel: ch,
                    no_ack: c.no_ack,
                    exclusive: c.exclusive,
                    conn: self.handle.clone(),
                    credit: if c.no_ack {
                        Credit::new(NO_ACK_WINDOW, 0)
                    } else {
                        Credit::new(chan.prefetch_count as u32, chan.prefetch_size)
                    },
                    channel_credit: if c.no_ack {
                        None
                    } else {
                        chan.channel_credit.clone()
                    },
                    flow_active: chan.flow_active.clone(),
                    cancelled: Default::default(),
                });
                chan.consumers.insert(
                    tag.clone(),
                    ChannelConsumer {
                        consumer: consumer.clone(),
                        queue: q.clone(),
                    },
                );
                // Attach before answering; deliveries are only written after
                // this event, so consume-ok still precedes them.
                q.consumers.fetch_add(1, Ordering::AcqRel);
                q.had_consumer.store(true, Ordering::Release);
                let attached = q
                    .partitions
                    .iter()
                    .all(|p| p.add_consumer(consumer.clone()));
                if !attached {
                    // Deleted between lookup and attach.
                    consumer.cancelled.store(true, Ordering::Release);
                    for p in &q.partitions {
                        p.remove_consumer(&consumer);
                    }
                    q.consumers.fetch_sub(1, Ordering::AcqRel);
                    if let Some(chan) = self.channels.get_mut(&ch) {
                        chan.consumers.remove(&tag);
                    }
                    return Err(soft(
                        reply::NOT_FOUND,
                        format!("no queue '{}' in vhost '{}'", q.name(), tenant.name),
                    ));
                }
                if !c.nowait {
                    let t = String::from_utf8_lossy(&tag).into_owned();
                    self.conn.send_method(
                        ch,
                        AMQPClass::Basic(basic::AMQPMethod::ConsumeOk(basic::ConsumeOk {
                            consumer_tag: t.as_str().into(),
                        })),
                    );
                }
            }
            basic::AMQPMethod::Cancel(c) => {
                let tag = Bytes::copy_from_slice(c.consumer_tag.as_str().as_bytes());
                let removed = self
                    .channels
                    .get_mut(&ch)
                    .and_then(|chan| chan.consumers.remove(&tag));
                if let Some(cc) = removed {
                    cc.consumer.cancelled.store(true, Ordering::Release);
                    for p in &cc.queue.partitions {
                        p.remove_consumer(&cc.consumer);
                    }
                    tenant.consumer_gone(&cc.queue);
                }
                if !c.nowait {
                    self.conn.send_method(
                        ch,
                        AMQPClass::Basic(basic::AMQPMethod::CancelOk(basic::CancelOk {
                            consumer_tag: c.consumer_tag,
                        })),
                    );
                }
            }
            basic::AMQPMethod::Get(g) => {
                let q = tenant.queue(&self.queue_name(ch, g.queue.as_str())?, conn_id)?;
                let got = q
                    .partitions
                    .iter()
                    .find_map(|p| p.get().map(|(e, left)| (p.clone(), e, left)));
                match got {
                    None => self.conn.send_method(
                        ch,
                        AMQPClass::Basic(basic::AMQPMethod::GetEmpty(basic::GetEmpty {})),
                    ),
                    Some((part, entry, _)) => {
                        let left = q.message_count();
                        let message = match &entry.message {
                            Some(m) => m.clone(),
                            None => match self.read_back(&part, &entry) {
                                Some(m) => m,
                                None => {
                                    if let Some(l) = part.settled(&entry, false) {
                                        self.settles.push((part.id, entry.id, l));
                                    }
                                    return Err(hard(
                                        reply::INTERNAL_ERROR,
                                        "message unreadable from the store".into(),
                                    ));
                                }
                            },
                        };
                        let Some(chan) = self.channels.get_mut(&ch) else {
                            return Ok(());
                        };
                        chan.delivery_tag += 1;
                        let tag = chan.delivery_tag;
                        let frame_max = self.conn.frame_max();
                        let out = self.conn.out();
                        codec::write_get_ok(
                            out,
                            ch,
                            tag,
                            entry.redelivered,
                            &message.exchange,
                            &message.routing_key,
                            left.min(u32::MAX as u64) as u32,
                        );
                        codec::write_content(
                            out,
                            ch,
                            &message.properties,
                            &message.body,
                            frame_max,
                        );
                        if g.no_ack {
                            self.settle_leases(
                                vec![Lease {
                                    partition: part,
                                    consumer: None,
                                    entry,
                                    since: Instant::now(),
                                }],
                                Settle::Ack,
                            );
                        } else {
                            chan.leases.insert(
                                tag,
                                Lease {
                                    partition: part,
                                    consumer: None,
                                    entry,
                                    since: Instant::now(),
                                },
                            );
                        }
                    }
                }
            }
            basic::AMQPMethod::Reject(r) => {
                self.on_settle(
                    ch,
                    r.delivery_tag,
                    false,
                    if r.requeue {
                        Settle::Requeue
                    } else {
                        Settle::Drop
                    },
                )?;
            }
            basic::AMQPMethod::Nack(n) => {
                self.on_settle(
                    ch,
                    n.delivery_tag,
                    n.multiple,
                    if n.requeue {
                        Settle::Requeue
                    } else {
                        Settle::Drop
                    },
                )?;
            }
            basic::AMQPMethod::Ack(a) => {
                self.on_settle(ch, a.delivery_tag, a.multiple, Settle::Ack)?;
            }
            basic::AMQPMethod::Recover(r) => {
                self.recover(ch, r.requeue)?;
                self.conn.send_method(
                    ch,
                    AMQPClass::Basic(basic::AMQPMethod::RecoverOk(basic::RecoverOk {})),
                );
            }
            basic::AMQPMethod::RecoverAsync(r) => self.recover(ch, r.requeue)?,
            other => {
                return Err(hard(
                    reply::COMMAND_INVALID,
                    format!("{other:?} is not valid from a client"),
                ))
            }
        }
        Ok(())
    }

    /// Answers a definition change once it is durable. With `nowait` the
    /// client asked for no answer: the change becomes durable with the next
    /// fsync without blocking this connection.
    async fn reply_when_durable(
        &mut self,
        ch: u16,
        nowait: bool,
        wait: Option<DurableWait>,
        reply: AMQPClass,
    ) -> Result<(), Failure> {
        if nowait {
            return Ok(());
        }
        durable(wait).await?;
        self.conn.send_method(ch, reply);
        Ok(())
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
            .ok_or_else(|| soft(reply::NOT_FOUND, "no previously declared queue".into()))
    }

    fn recover(&mut self, ch: u16, requeue: bool) -> Result<(), Failure> {
        if !requeue {
            return Err(hard(reply::NOT_IMPLEMENTED, "requeue=false".into()));
        }
        if let Some(c) = self.channels.get_mut(&ch) {
            let leases: Vec<Lease> = std::mem::take(&mut c.leases).into_values().collect();
            self.settle_leases(leases, Settle::Requeue);
        }
        Ok(())
    }
}

#[derive(Clone, Copy)]
enum Settle {
    Ack,
    Requeue,
    Drop,
}

fn dedup_partitions(v: &mut Vec<Arc<Partition>>) {
    if v.len() < 2 {
        return;
    }
    let mut out: Vec<Arc<Partition>> = Vec::with_capacity(v.len());
    for p in v.drain(..) {
        if !out.iter().any(|x| Arc::ptr_eq(x, &p)) {
            out.push(p);
        }
    }
    *v = out;
}

async fn durable(wait: Option<DurableWait>) -> Result<(), Failure> {
    let Some(w) = wait else { return Ok(()) };
    match w.await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(EngineError::Store(e).into()),
        Err(_) => Err(hard(
            reply::INTERNAL_ERROR,
            "store stopped before the change was durable".into(),
        )),
    }
}

/// Writes as much of `out` as the socket takes now.
fn write_some(stream: &TcpStream, out: &mut BytesMut) -> std::io::Result<usize> {
    let mut total = 0;
    while !out.is_empty() {
        match stream.try_write(out) {
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
