//! The server side of one AMQP 0-9-1 connection, without I/O.
//!
//! [`Connection::poll`] cuts frames off the input one at a time and turns them
//! into [`Event`]s: the handshake, channel lifecycle, content assembly and
//! protocol errors are handled here; everything that needs the engine is
//! handed out as an event. Replies go into [`Connection::out`], which the
//! caller writes to the socket. Frames are taken one at a time so that an
//! answer to one event (say, a channel closed for an error) takes effect before
//! the next frame is interpreted.

use super::codec::{self, FrameError, RawFrame, Reader};
use super::depth;
use super::reply;
use super::sasl;
use amq_protocol::frame::parsing::parse_content_header;
use amq_protocol::protocol::{basic, channel, connection, AMQPClass};
use amq_protocol::types::{AMQPValue, FieldTable};
use bytes::{Bytes, BytesMut};
use std::collections::{HashMap, VecDeque};

/// Limits and identity the server advertises.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// Largest frame accepted and offered in connection.tune.
    pub frame_max: u32,
    /// Highest channel number offered.
    pub channel_max: u16,
    /// Heartbeat interval offered, in seconds (0 disables).
    pub heartbeat: u16,
    /// Largest message body accepted (RabbitMQ's `max_message_size`).
    pub max_message_size: u64,
    /// Most bytes that incomplete messages (publish seen, body not yet
    /// complete) on all channels of one connection may hold together
    /// ([`Connection::partial_content_bytes`]); `None` means
    /// [`Self::max_message_size`]. One incomplete message is always allowed
    /// up to `max_message_size`, so this bounds how far many channels can
    /// multiply it. A frame that would pass the limit while other channels
    /// hold content closes its channel with 406 PRECONDITION_FAILED.
    pub max_partial_content: Option<u64>,
    /// Product version string.
    pub version: String,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            frame_max: 131_072,
            channel_max: 2047,
            heartbeat: 60,
            max_message_size: 128 * 1024 * 1024,
            max_partial_content: None,
            version: env!("CARGO_PKG_VERSION").to_string(),
        }
    }
}

/// A message assembled from basic.publish, its content header and body frames.
#[derive(Clone, Debug)]
pub struct Publish {
    /// Target exchange name.
    pub exchange: Bytes,
    /// Routing key.
    pub routing_key: Bytes,
    /// Return it if unroutable.
    pub mandatory: bool,
    /// Deprecated `immediate` flag (refused, as RabbitMQ does).
    pub immediate: bool,
    /// The raw property block (flags and values), kept verbatim for delivery.
    pub properties: Bytes,
    /// delivery-mode 2.
    pub persistent: bool,
    /// The `priority` property.
    pub priority: Option<u8>,
    /// The body.
    pub body: Bytes,
}

/// Decodes a raw property block. Its `headers` table is depth-checked first,
/// so a block from anywhere (the wire, the store) is safe to decode.
pub fn parse_properties(raw: &[u8]) -> Option<basic::AMQPProperties> {
    depth::check_properties(raw).ok()?;
    basic::parse_properties(raw).ok().map(|(_, p)| p)
}

/// What the engine has to act on.
#[derive(Debug)]
pub enum Event {
    /// The client chose a mechanism and sent credentials. Answer with
    /// [`Connection::accept_login`] or [`Connection::refuse_login`].
    Login {
        /// PLAIN or AMQPLAIN.
        mechanism: String,
        /// User name.
        username: String,
        /// Password.
        password: String,
    },
    /// connection.open: answer with [`Connection::accept_open`] or close.
    OpenVhost {
        /// The virtual host (tenant) asked for.
        vhost: String,
    },
    /// A channel was opened (open-ok already queued).
    ChannelOpened(u16),
    /// A channel is gone: the client closed it (close-ok already queued), or
    /// this connection closed it for a content error (message too large,
    /// partial-content cap; channel.close already queued). Release its state.
    ChannelClosed(u16),
    /// A channel-level method for the engine.
    Method {
        /// Channel.
        channel: u16,
        /// The method.
        method: AMQPClass,
    },
    /// basic.qos, with the prefetch-size `amq-protocol` does not keep.
    Qos {
        /// Channel.
        channel: u16,
        /// Byte limit (0 = none).
        prefetch_size: u32,
        /// Message limit (0 = none).
        prefetch_count: u16,
        /// Channel-wide rather than per consumer.
        global: bool,
    },
    /// A complete message.
    Publish {
        /// Channel.
        channel: u16,
        /// The message.
        message: Publish,
    },
    /// basic.ack from a consumer.
    Ack {
        /// Channel.
        channel: u16,
        /// Tag.
        delivery_tag: u64,
        /// Up to and including the tag.
        multiple: bool,
    },
    /// channel.flow from the client (flow-ok already queued).
    Flow {
        /// Channel.
        channel: u16,
        /// Deliveries allowed.
        active: bool,
    },
    /// The client closed the connection (close-ok queued). Flush and hang up.
    Closed,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    AwaitingHeader,
    AwaitingStartOk,
    Authenticating,
    AwaitingTuneOk,
    AwaitingOpen,
    Opening,
    Open,
    /// We sent connection.close; only close-ok (or close) matters now.
    Closing,
    /// Done: flush `out` and hang up.
    Finished,
}

/// A channel's message in progress. Fields that are slices of the read
/// buffer are copied out ([`Content::detach`]) before the buffer is refilled,
/// so an incomplete message never pins more than its own bytes.
enum Content {
    Idle,
    AwaitingHeader {
        publish: PendingPublish,
        /// Slices copied out of the read buffer already.
        owned: bool,
    },
    AwaitingBody {
        publish: PendingPublish,
        header: Header,
        /// Body bytes still to come.
        remaining: u64,
        /// Announced body size.
        total: u64,
        /// Body received so far, in its own allocation (capacity at most
        /// twice its length, and never more than `total`).
        body: BytesMut,
        owned: bool,
    },
}

impl Content {
    /// Bytes held for this incomplete message (names, properties, body).
    fn cost(&self) -> usize {
        match self {
            Content::Idle => 0,
            Content::AwaitingHeader { publish, .. } => publish.cost(),
            Content::AwaitingBody {
                publish,
                header,
                body,
                ..
            } => publish.cost() + header.properties.len() + body.len(),
        }
    }

    /// Copies the slices that still point into the read buffer.
    fn detach(&mut self) {
        match self {
            Content::Idle => {}
            Content::AwaitingHeader { publish, owned } => {
                if !*owned {
                    publish.detach();
                    *owned = true;
                }
            }
            Content::AwaitingBody {
                publish,
                header,
                owned,
                ..
            } => {
                if !*owned {
                    publish.detach();
                    header.properties = Bytes::copy_from_slice(&header.properties);
                    *owned = true;
                }
            }
        }
    }
}

struct PendingPublish {
    exchange: Bytes,
    routing_key: Bytes,
    mandatory: bool,
    immediate: bool,
}

impl PendingPublish {
    fn cost(&self) -> usize {
        self.exchange.len() + self.routing_key.len()
    }
    fn detach(&mut self) {
        self.exchange = Bytes::copy_from_slice(&self.exchange);
        self.routing_key = Bytes::copy_from_slice(&self.routing_key);
    }
}

/// Appends `part` to a body being assembled, growing the buffer at most to
/// `total` and at most to twice what it holds, so the memory an incomplete
/// body holds stays proportional to the bytes actually received.
fn append_body(body: &mut BytesMut, part: &[u8], total: u64) {
    let need = body.len() + part.len();
    if body.capacity() < need {
        let total = usize::try_from(total).unwrap_or(usize::MAX);
        let target = body
            .capacity()
            .saturating_mul(2)
            .max(need)
            .min(total)
            .max(need);
        let mut grown = BytesMut::with_capacity(target);
        grown.extend_from_slice(body);
        *body = grown;
    }
    body.extend_from_slice(part);
}

struct Header {
    properties: Bytes,
    persistent: bool,
    priority: Option<u8>,
}

struct ChannelState {
    closing: bool,
    content: Content,
}

/// One AMQP connection's protocol state.
pub struct Connection {
    config: ServerConfig,
    phase: Phase,
    frame_max: usize,
    channel_max: u16,
    heartbeat: u16,
    channels: HashMap<u16, ChannelState>,
    pending: VecDeque<Event>,
    out: BytesMut,
    /// Set when the connection was closed for an error, for logs.
    close_reason: Option<(u16, String)>,
    /// Sum of [`Content::cost`] over all channels.
    partial_bytes: usize,
    /// Channels whose content is not [`Content::Idle`].
    incomplete: usize,
    /// The effective [`ServerConfig::max_partial_content`].
    partial_limit: usize,
    /// The client advertised the `connection.blocked` capability in start-ok.
    accepts_blocked: bool,
}

impl Connection {
    /// A connection that has not yet seen the protocol header.
    pub fn new(config: ServerConfig) -> Self {
        let frame_max = config.frame_max as usize;
        let channel_max = config.channel_max;
        let partial_limit = config
            .max_partial_content
            .unwrap_or(config.max_message_size);
        Connection {
            partial_bytes: 0,
            incomplete: 0,
            partial_limit: usize::try_from(partial_limit).unwrap_or(usize::MAX),
            config,
            phase: Phase::AwaitingHeader,
            frame_max,
            channel_max,
            heartbeat: 0,
            channels: HashMap::new(),
            pending: VecDeque::new(),
            out: BytesMut::with_capacity(16 * 1024),
            close_reason: None,
            accepts_blocked: false,
        }
    }

    /// Bytes waiting to be written to the client.
    pub fn out(&mut self) -> &mut BytesMut {
        &mut self.out
    }

    /// The negotiated frame-max.
    pub fn frame_max(&self) -> usize {
        self.frame_max
    }

    /// The negotiated heartbeat interval in seconds (0 = off).
    pub fn heartbeat(&self) -> u16 {
        self.heartbeat
    }

    /// True when nothing more will be read: flush [`Self::out`] and close.
    pub fn is_finished(&self) -> bool {
        self.phase == Phase::Finished
    }

    /// True once connection.close was sent or received.
    pub fn is_closing(&self) -> bool {
        matches!(self.phase, Phase::Closing | Phase::Finished)
    }

    /// True after connection.open-ok: channels may be used.
    pub fn is_open(&self) -> bool {
        self.phase == Phase::Open
    }

    /// The code and text of the close this side initiated, if any.
    pub fn close_reason(&self) -> Option<&(u16, String)> {
        self.close_reason.as_ref()
    }

    /// Bytes currently held for incomplete messages on all channels: a
    /// publish whose content has not fully arrived (exchange and routing key,
    /// properties, and the body received so far). Memory held is at most
    /// about twice this. Zero when no message is in progress; a value that
    /// stays non-zero and unchanged means a client stalled mid-message.
    pub fn partial_content_bytes(&self) -> usize {
        self.partial_bytes
    }

    /// Whether the client advertised the `connection.blocked` capability
    /// (so it understands connection.blocked / connection.unblocked).
    pub fn accepts_blocked(&self) -> bool {
        self.accepts_blocked
    }

    /// Replaces a channel's content, keeping the partial-content totals.
    fn set_content(&mut self, ch: u16, content: Content) -> Content {
        let Some(state) = self.channels.get_mut(&ch) else {
            return Content::Idle;
        };
        let old = std::mem::replace(&mut state.content, content);
        let new = &state.content;
        self.partial_bytes = self.partial_bytes + new.cost() - old.cost();
        self.incomplete = self.incomplete + usize::from(!matches!(new, Content::Idle))
            - usize::from(!matches!(old, Content::Idle));
        old
    }

    fn remove_channel(&mut self, ch: u16) {
        self.set_content(ch, Content::Idle);
        self.channels.remove(&ch);
    }

    fn clear_channels(&mut self) {
        self.channels.clear();
        self.partial_bytes = 0;
        self.incomplete = 0;
    }

    /// Recomputes the partial-content totals (for debug assertions).
    fn totals_hold(&self) -> bool {
        let bytes: usize = self.channels.values().map(|c| c.content.cost()).sum();
        let n = self
            .channels
            .values()
            .filter(|c| !matches!(c.content, Content::Idle))
            .count();
        bytes == self.partial_bytes && n == self.incomplete
    }

    /// Whether `channel` is open and not being closed by the server.
    pub fn channel_is_usable(&self, channel: u16) -> bool {
        self.phase == Phase::Open && self.channels.get(&channel).is_some_and(|c| !c.closing)
    }

    /// Interprets input until one event is ready or more bytes are needed.
    /// Consumed bytes are removed from `input`.
    pub fn poll(&mut self, input: &mut BytesMut) -> Option<Event> {
        loop {
            if let Some(ev) = self.pending.pop_front() {
                return Some(ev);
            }
            match self.phase {
                Phase::Finished => {
                    input.clear();
                    return None;
                }
                Phase::AwaitingHeader => {
                    if input.len() < 8 {
                        // A wrong header can be recognized before 8 bytes arrive.
                        if !codec::PROTOCOL_HEADER.starts_with(&input[..]) {
                            self.refuse_header();
                        }
                        return None;
                    }
                    if &input[..8] != codec::PROTOCOL_HEADER {
                        self.refuse_header();
                        return None;
                    }
                    let _ = input.split_to(8);
                    self.send_start();
                    self.phase = Phase::AwaitingStartOk;
                    continue;
                }
                // Waiting for the engine's answer: don't interpret further frames yet.
                Phase::Authenticating | Phase::Opening => return None,
                _ => {}
            }
            debug_assert!(self.totals_hold(), "partial-content totals drifted");
            match codec::cut_frame(input, self.frame_max) {
                Ok(None) => {
                    // The caller refills `input` next: incomplete messages
                    // must not keep the old buffer alive.
                    if self.incomplete > 0 {
                        for state in self.channels.values_mut() {
                            state.content.detach();
                        }
                    }
                    return None;
                }
                Ok(Some(frame)) => self.handle_frame(frame),
                Err(FrameError::TooLarge { size, max }) => {
                    input.clear();
                    self.fail(
                        reply::FRAME_ERROR,
                        format!("FRAME_ERROR - frame size {size} exceeds frame_max {max}"),
                        0,
                        0,
                    );
                }
                Err(FrameError::BadFrameEnd) => {
                    input.clear();
                    self.fail(
                        reply::FRAME_ERROR,
                        "FRAME_ERROR - missing frame end octet".into(),
                        0,
                        0,
                    );
                }
            }
        }
    }

    fn refuse_header(&mut self) {
        // Spec 4.2.2: answer a bad header with the header we speak, then close.
        self.out.extend_from_slice(codec::PROTOCOL_HEADER);
        self.phase = Phase::Finished;
    }

    fn send_start(&mut self) {
        let mut caps = FieldTable::default();
        for cap in [
            "publisher_confirms",
            "exchange_exchange_bindings",
            "basic.nack",
            "consumer_cancel_notify",
            "connection.blocked",
            "authentication_failure_close",
            "per_consumer_qos",
        ] {
            caps.insert(cap.into(), AMQPValue::Boolean(true));
        }
        let mut props = FieldTable::default();
        props.insert("product".into(), AMQPValue::LongString("Weir".into()));
        props.insert(
            "version".into(),
            AMQPValue::LongString(self.config.version.as_str().into()),
        );
        props.insert("platform".into(), AMQPValue::LongString("Rust".into()));
        props.insert("capabilities".into(), AMQPValue::FieldTable(caps));
        self.send_method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::Start(connection::Start {
                version_major: 0,
                version_minor: 9,
                server_properties: props,
                mechanisms: "PLAIN AMQPLAIN".into(),
                locales: "en_US".into(),
            })),
        );
    }

    /// Queues a method frame.
    pub fn send_method(&mut self, channel: u16, method: AMQPClass) {
        codec::write_method(&mut self.out, channel, method);
    }

    /// Credentials accepted: continue with connection.tune.
    pub fn accept_login(&mut self) {
        debug_assert_eq!(self.phase, Phase::Authenticating);
        self.send_method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::Tune(connection::Tune {
                channel_max: self.config.channel_max,
                frame_max: self.config.frame_max,
                heartbeat: self.config.heartbeat,
            })),
        );
        self.phase = Phase::AwaitingTuneOk;
    }

    /// Credentials refused: close with 403 ACCESS_REFUSED, as RabbitMQ does
    /// for clients with the `authentication_failure_close` capability.
    pub fn refuse_login(&mut self, text: &str) {
        self.fail(
            reply::ACCESS_REFUSED,
            format!("ACCESS_REFUSED - {text}"),
            10,
            11,
        );
    }

    /// The virtual host exists and may be used.
    pub fn accept_open(&mut self) {
        debug_assert_eq!(self.phase, Phase::Opening);
        self.send_method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::OpenOk(connection::OpenOk {})),
        );
        self.phase = Phase::Open;
    }

    /// Refuses connection.open (530 NOT_ALLOWED).
    pub fn refuse_open(&mut self, text: &str) {
        self.fail(reply::NOT_ALLOWED, format!("NOT_ALLOWED - {text}"), 10, 40);
    }

    /// Server-initiated connection close with a hard error.
    pub fn fail(&mut self, code: u16, text: String, class_id: u16, method_id: u16) {
        if self.is_closing() {
            return;
        }
        let reply_text = truncate(&text);
        self.send_method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::Close(connection::Close {
                reply_code: code,
                reply_text: reply_text.as_str().into(),
                class_id,
                method_id,
            })),
        );
        self.close_reason = Some((code, text));
        self.phase = Phase::Closing;
        self.clear_channels();
    }

    /// Server-initiated channel close with a soft error. The caller releases
    /// the channel's engine state now; frames for it are discarded until the
    /// client's close-ok.
    pub fn close_channel(
        &mut self,
        channel: u16,
        code: u16,
        text: &str,
        class_id: u16,
        method_id: u16,
    ) {
        let Some(state) = self.channels.get_mut(&channel) else {
            return;
        };
        if state.closing {
            return;
        }
        state.closing = true;
        self.set_content(channel, Content::Idle);
        let reply_text = truncate(text);
        self.send_method(
            channel,
            AMQPClass::Channel(channel::AMQPMethod::Close(channel::Close {
                reply_code: code,
                reply_text: reply_text.as_str().into(),
                class_id,
                method_id,
            })),
        );
    }

    /// Gracefully closes the connection (server shutdown): 320 CONNECTION_FORCED.
    pub fn shutdown(&mut self, text: &str) {
        self.fail(
            reply::CONNECTION_FORCED,
            format!("CONNECTION_FORCED - {text}"),
            0,
            0,
        );
    }

    /// Gives up on a peer that never answered our close.
    pub fn abandon(&mut self) {
        self.phase = Phase::Finished;
    }

    /// Writes a heartbeat frame.
    pub fn send_heartbeat(&mut self) {
        codec::write_heartbeat(&mut self.out);
    }

    fn handle_frame(&mut self, frame: RawFrame) {
        match frame.kind {
            codec::FRAME_HEARTBEAT => {
                if frame.channel != 0 {
                    self.fail(
                        reply::FRAME_ERROR,
                        "FRAME_ERROR - heartbeat on a non-zero channel".into(),
                        0,
                        0,
                    );
                }
            }
            codec::FRAME_METHOD => self.handle_method_frame(frame.channel, frame.payload),
            codec::FRAME_HEADER | codec::FRAME_BODY => self.handle_content_frame(frame),
            other => self.fail(
                reply::FRAME_ERROR,
                format!("FRAME_ERROR - unknown frame type {other}"),
                0,
                0,
            ),
        }
    }

    fn handle_method_frame(&mut self, ch: u16, payload: Bytes) {
        let mut r = Reader::new(payload.clone());
        let (Some(class_id), Some(method_id)) = (r.u16(), r.u16()) else {
            return self.fail(
                reply::FRAME_ERROR,
                "FRAME_ERROR - method frame too short".into(),
                0,
                0,
            );
        };
        if self.phase == Phase::Closing {
            // Only the handshake of closing matters now (spec 4.2.5.3 / 2.2.4).
            if class_id == 10 && (method_id == 51 || method_id == 50) {
                if method_id == 50 {
                    self.send_method(
                        0,
                        AMQPClass::Connection(connection::AMQPMethod::CloseOk(
                            connection::CloseOk {},
                        )),
                    );
                }
                self.phase = Phase::Finished;
            }
            return;
        }
        if ch != 0 {
            if let Some(state) = self.channels.get(&ch) {
                if state.closing {
                    // Discard everything but the closing handshake on this channel.
                    if class_id == 20 && method_id == 41 {
                        self.remove_channel(ch);
                    } else if class_id == 20 && method_id == 40 {
                        self.remove_channel(ch);
                        self.send_method(
                            ch,
                            AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {})),
                        );
                    }
                    return;
                }
                if !matches!(state.content, Content::Idle) {
                    return self.fail(
                        reply::UNEXPECTED_FRAME,
                        format!("UNEXPECTED_FRAME - expected content frame on channel {ch}, got a method"),
                        class_id,
                        method_id,
                    );
                }
            }
        }
        // Hot path: publish and ack, parsed without allocation.
        if class_id == codec::BASIC_CLASS && self.phase == Phase::Open && ch != 0 {
            match method_id {
                codec::BASIC_PUBLISH => return self.on_publish(ch, r),
                codec::BASIC_ACK => {
                    if !self.require_channel(ch, class_id, method_id) {
                        return;
                    }
                    let (Some(tag), Some(bits)) = (r.u64(), r.u8()) else {
                        return self.syntax_error(class_id, method_id);
                    };
                    self.pending.push_back(Event::Ack {
                        channel: ch,
                        delivery_tag: tag,
                        multiple: bits & 1 != 0,
                    });
                    return;
                }
                codec::BASIC_QOS => {
                    if !self.require_channel(ch, class_id, method_id) {
                        return;
                    }
                    let (Some(size), Some(count), Some(bits)) = (r.u32(), r.u16(), r.u8()) else {
                        return self.syntax_error(class_id, method_id);
                    };
                    self.pending.push_back(Event::Qos {
                        channel: ch,
                        prefetch_size: size,
                        prefetch_count: count,
                        global: bits & 1 != 0,
                    });
                    return;
                }
                _ => {}
            }
        }
        if depth::check_method(class_id, method_id, &payload[4..]).is_err() {
            return self.fail(
                reply::SYNTAX_ERROR,
                format!("SYNTAX_ERROR - malformed or too deeply nested field table in method {class_id}.{method_id}"),
                class_id,
                method_id,
            );
        }
        let method = match amq_protocol::protocol::parse_class(&payload[..]) {
            Ok((&[], m)) => m,
            _ => return self.syntax_error(class_id, method_id),
        };
        if ch == 0 {
            self.on_connection_method(method, class_id, method_id);
        } else {
            self.on_channel_method(ch, method, class_id, method_id);
        }
    }

    fn syntax_error(&mut self, class_id: u16, method_id: u16) {
        self.fail(
            reply::SYNTAX_ERROR,
            format!("SYNTAX_ERROR - could not decode method {class_id}.{method_id}"),
            class_id,
            method_id,
        );
    }

    fn on_connection_method(&mut self, method: AMQPClass, class_id: u16, method_id: u16) {
        use connection::AMQPMethod as M;
        let AMQPClass::Connection(m) = method else {
            return self.fail(
                reply::COMMAND_INVALID,
                format!(
                    "COMMAND_INVALID - method {class_id}.{method_id} is not allowed on channel 0"
                ),
                class_id,
                method_id,
            );
        };
        match (self.phase, m) {
            (Phase::AwaitingStartOk, M::StartOk(start_ok)) => {
                self.accepts_blocked = matches!(
                    start_ok.client_properties.inner().get("capabilities"),
                    Some(AMQPValue::FieldTable(caps))
                        if matches!(caps.inner().get("connection.blocked"), Some(AMQPValue::Boolean(true)))
                );
                let mechanism = start_ok.mechanism.as_str().to_string();
                let sasl::Credentials { username, password } =
                    match sasl::decode(&mechanism, start_ok.response.as_bytes()) {
                        Ok(c) => c,
                        Err(e) => {
                            return self.fail(
                                reply::ACCESS_REFUSED,
                                format!(
                                "ACCESS_REFUSED - login with mechanism {mechanism} refused: {e}"
                            ),
                                10,
                                11,
                            )
                        }
                    };
                self.phase = Phase::Authenticating;
                self.pending.push_back(Event::Login {
                    mechanism,
                    username,
                    password,
                });
            }
            (Phase::AwaitingTuneOk, M::TuneOk(tune)) => {
                let frame_max = if tune.frame_max == 0 {
                    self.config.frame_max
                } else {
                    tune.frame_max
                };
                if frame_max < 4096 || frame_max > self.config.frame_max {
                    return self.fail(
                        reply::NOT_ALLOWED,
                        format!(
                            "NOT_ALLOWED - frame_max {frame_max} outside 4096..={}",
                            self.config.frame_max
                        ),
                        10,
                        31,
                    );
                }
                let channel_max = if tune.channel_max == 0 {
                    self.config.channel_max
                } else {
                    tune.channel_max
                };
                self.frame_max = frame_max as usize;
                self.channel_max = channel_max.min(self.config.channel_max);
                self.heartbeat = tune.heartbeat;
                self.phase = Phase::AwaitingOpen;
            }
            (Phase::AwaitingOpen, M::Open(open)) => {
                self.phase = Phase::Opening;
                self.pending.push_back(Event::OpenVhost {
                    vhost: open.virtual_host.as_str().to_string(),
                });
            }
            (Phase::Open, M::Close(_)) => {
                self.send_method(
                    0,
                    AMQPClass::Connection(connection::AMQPMethod::CloseOk(connection::CloseOk {})),
                );
                self.clear_channels();
                self.phase = Phase::Finished;
                self.pending.push_back(Event::Closed);
            }
            (Phase::Open, M::Blocked(_) | M::Unblocked(_)) => {}
            (Phase::Open, M::UpdateSecret(_)) => {
                self.send_method(
                    0,
                    AMQPClass::Connection(connection::AMQPMethod::UpdateSecretOk(
                        connection::UpdateSecretOk {},
                    )),
                );
            }
            (_, M::Close(_)) => {
                // Closing during the handshake.
                self.send_method(
                    0,
                    AMQPClass::Connection(connection::AMQPMethod::CloseOk(connection::CloseOk {})),
                );
                self.phase = Phase::Finished;
                self.pending.push_back(Event::Closed);
            }
            (phase, _) => self.fail(
                reply::COMMAND_INVALID,
                format!("COMMAND_INVALID - unexpected method {class_id}.{method_id} in {phase:?}"),
                class_id,
                method_id,
            ),
        }
    }

    /// Checks that `ch` is an open channel; closes the connection (504) if not.
    fn require_channel(&mut self, ch: u16, class_id: u16, method_id: u16) -> bool {
        if self.phase != Phase::Open {
            self.fail(
                reply::COMMAND_INVALID,
                "COMMAND_INVALID - connection not open".into(),
                class_id,
                method_id,
            );
            return false;
        }
        if !self.channels.contains_key(&ch) {
            self.fail(
                reply::CHANNEL_ERROR,
                format!("CHANNEL_ERROR - expected 'channel.open' on channel {ch}"),
                class_id,
                method_id,
            );
            return false;
        }
        true
    }

    fn on_channel_method(&mut self, ch: u16, method: AMQPClass, class_id: u16, method_id: u16) {
        if let AMQPClass::Channel(channel::AMQPMethod::Open(_)) = method {
            if self.phase != Phase::Open {
                return self.fail(
                    reply::COMMAND_INVALID,
                    "COMMAND_INVALID - connection not open".into(),
                    20,
                    10,
                );
            }
            if ch > self.channel_max {
                return self.fail(
                    reply::CHANNEL_ERROR,
                    format!(
                        "CHANNEL_ERROR - channel {ch} exceeds channel_max {}",
                        self.channel_max
                    ),
                    20,
                    10,
                );
            }
            if self.channels.contains_key(&ch) {
                return self.fail(
                    reply::CHANNEL_ERROR,
                    format!("CHANNEL_ERROR - second 'channel.open' seen on channel {ch}"),
                    20,
                    10,
                );
            }
            self.channels.insert(
                ch,
                ChannelState {
                    closing: false,
                    content: Content::Idle,
                },
            );
            self.send_method(
                ch,
                AMQPClass::Channel(channel::AMQPMethod::OpenOk(channel::OpenOk {})),
            );
            self.pending.push_back(Event::ChannelOpened(ch));
            return;
        }
        if !self.require_channel(ch, class_id, method_id) {
            return;
        }
        match method {
            AMQPClass::Channel(channel::AMQPMethod::Close(_)) => {
                self.remove_channel(ch);
                self.send_method(
                    ch,
                    AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {})),
                );
                self.pending.push_back(Event::ChannelClosed(ch));
            }
            AMQPClass::Channel(channel::AMQPMethod::CloseOk(_)) => {
                // A close-ok we did not ask for: ignore, as RabbitMQ does.
            }
            AMQPClass::Channel(channel::AMQPMethod::Flow(flow)) => {
                self.send_method(
                    ch,
                    AMQPClass::Channel(channel::AMQPMethod::FlowOk(channel::FlowOk {
                        active: flow.active,
                    })),
                );
                self.pending.push_back(Event::Flow {
                    channel: ch,
                    active: flow.active,
                });
            }
            AMQPClass::Channel(channel::AMQPMethod::FlowOk(_)) => {}
            AMQPClass::Connection(_) => self.fail(
                reply::COMMAND_INVALID,
                format!(
                    "COMMAND_INVALID - connection method {class_id}.{method_id} on channel {ch}"
                ),
                class_id,
                method_id,
            ),
            method => self.pending.push_back(Event::Method {
                channel: ch,
                method,
            }),
        }
    }

    fn on_publish(&mut self, ch: u16, mut r: Reader) {
        if !self.require_channel(ch, codec::BASIC_CLASS, codec::BASIC_PUBLISH) {
            return;
        }
        let parsed = (|| {
            let _ticket = r.u16()?;
            let exchange = r.short_str()?;
            let routing_key = r.short_str()?;
            let bits = r.u8()?;
            r.is_empty().then_some((exchange, routing_key, bits))
        })();
        let Some((exchange, routing_key, bits)) = parsed else {
            return self.syntax_error(codec::BASIC_CLASS, codec::BASIC_PUBLISH);
        };
        self.set_content(
            ch,
            Content::AwaitingHeader {
                publish: PendingPublish {
                    exchange,
                    routing_key,
                    mandatory: bits & 1 != 0,
                    immediate: bits & 2 != 0,
                },
                owned: false,
            },
        );
    }

    /// Whether a channel may hold `cost` bytes of incomplete content while
    /// the other channels hold [`Self::partial_bytes`] (its own content is
    /// taken out first). Closes the channel with 406 when not.
    fn admit_partial(&mut self, ch: u16, cost: usize) -> bool {
        let others = self.partial_bytes;
        // One message in progress is bounded by max_message_size alone.
        if others == 0 || others.saturating_add(cost) <= self.partial_limit {
            return true;
        }
        let text = format!(
            "PRECONDITION_FAILED - incomplete messages on this connection would hold {} bytes, over the limit of {}",
            others.saturating_add(cost),
            self.partial_limit
        );
        self.close_channel_for_content(ch, &text);
        false
    }

    /// Closes a channel with 406 for its content and tells the engine, which
    /// did not ask for the close, to release the channel's state.
    fn close_channel_for_content(&mut self, ch: u16, text: &str) {
        if self.channel_is_usable(ch) {
            self.close_channel(ch, reply::PRECONDITION_FAILED, text, 60, 40);
            self.pending.push_back(Event::ChannelClosed(ch));
        }
    }

    fn handle_content_frame(&mut self, frame: RawFrame) {
        let ch = frame.channel;
        if self.phase == Phase::Closing {
            return;
        }
        let Some(state) = self.channels.get_mut(&ch) else {
            return self.fail(
                reply::CHANNEL_ERROR,
                format!("CHANNEL_ERROR - content frame on unopened channel {ch}"),
                0,
                0,
            );
        };
        if state.closing {
            return;
        }
        // Taken out (totals adjusted here, as set_content would, without a
        // second map lookup on the hot path); put back below while still
        // incomplete.
        let content = std::mem::replace(&mut state.content, Content::Idle);
        self.partial_bytes -= content.cost();
        self.incomplete -= usize::from(!matches!(content, Content::Idle));
        match (frame.kind, content) {
            (codec::FRAME_HEADER, Content::AwaitingHeader { publish, .. }) => {
                if frame.payload.len() < 14
                    || depth::check_properties(&frame.payload[12..]).is_err()
                {
                    return self.fail(
                        reply::FRAME_ERROR,
                        "FRAME_ERROR - malformed content header or too deeply nested headers"
                            .into(),
                        60,
                        40,
                    );
                }
                let header = match parse_content_header(&frame.payload[..]) {
                    Ok((&[], h)) => h,
                    _ => {
                        return self.fail(
                            reply::FRAME_ERROR,
                            "FRAME_ERROR - malformed content header".into(),
                            60,
                            40,
                        )
                    }
                };
                if header.class_id != codec::BASIC_CLASS {
                    return self.fail(
                        reply::FRAME_ERROR,
                        format!("FRAME_ERROR - content header for class {}", header.class_id),
                        60,
                        40,
                    );
                }
                if header.body_size > self.config.max_message_size {
                    let text = format!(
                        "PRECONDITION_FAILED - message size {} is larger than configured max size {}",
                        header.body_size, self.config.max_message_size
                    );
                    // The body frames still to come are discarded as the channel closes.
                    self.close_channel_for_content(ch, &text);
                    return;
                }
                let props = &header.properties;
                let h = Header {
                    properties: frame.payload.slice(12..),
                    persistent: *props.delivery_mode() == Some(2),
                    priority: *props.priority(),
                };
                if header.body_size == 0 {
                    self.finish_publish(ch, publish, h, Bytes::new(), true);
                    return;
                }
                if !self.admit_partial(ch, publish.cost() + h.properties.len()) {
                    return;
                }
                self.set_content(
                    ch,
                    Content::AwaitingBody {
                        publish,
                        header: h,
                        remaining: header.body_size,
                        total: header.body_size,
                        body: BytesMut::new(),
                        owned: false,
                    },
                );
            }
            (
                codec::FRAME_BODY,
                Content::AwaitingBody {
                    publish,
                    header,
                    remaining,
                    total,
                    mut body,
                    owned,
                },
            ) => {
                let len = frame.payload.len() as u64;
                if len > remaining {
                    return self.fail(
                        reply::FRAME_ERROR,
                        format!("FRAME_ERROR - body frame of {len} bytes exceeds the {remaining} announced"),
                        60,
                        40,
                    );
                }
                let remaining = remaining - len;
                if remaining == 0 {
                    // A body in one frame is a slice of the read buffer
                    // (copied with the message's other fields below); a
                    // split one was copied as it arrived.
                    let (body, body_owned) = if body.is_empty() {
                        (frame.payload, false)
                    } else {
                        append_body(&mut body, &frame.payload, total);
                        (body.freeze(), true)
                    };
                    self.finish_publish(ch, publish, header, body, body_owned);
                    return;
                }
                let cost =
                    publish.cost() + header.properties.len() + body.len() + frame.payload.len();
                if !self.admit_partial(ch, cost) {
                    return;
                }
                append_body(&mut body, &frame.payload, total);
                self.set_content(
                    ch,
                    Content::AwaitingBody {
                        publish,
                        header,
                        remaining,
                        total,
                        body,
                        owned,
                    },
                );
            }
            (kind, _) => self.fail(
                reply::UNEXPECTED_FRAME,
                format!(
                    "UNEXPECTED_FRAME - unexpected content frame of type {kind} on channel {ch}"
                ),
                0,
                0,
            ),
        }
    }

    fn finish_publish(
        &mut self,
        ch: u16,
        p: PendingPublish,
        h: Header,
        body: Bytes,
        body_owned: bool,
    ) {
        let (exchange, routing_key, properties, body) =
            own_message(p.exchange, p.routing_key, h.properties, body, body_owned);
        self.pending.push_back(Event::Publish {
            channel: ch,
            message: Publish {
                exchange,
                routing_key,
                mandatory: p.mandatory,
                immediate: p.immediate,
                properties,
                persistent: h.persistent,
                priority: h.priority,
                body,
            },
        });
    }
}

/// Gives a message buffers of its own. Its fields are slices of the socket
/// read buffer, which a queued message would otherwise keep alive whole (a
/// 1-byte message kept a 128 KB+ buffer alive): the exchange, routing key,
/// properties and, unless it was assembled from several frames into a buffer
/// of its exact size already, the body are copied into one exact-size
/// allocation. One allocation and a small copy per message: about 2–3% of
/// broker CPU at saturation (docs/BENCHMARKS.md).
fn own_message(
    exchange: Bytes,
    routing_key: Bytes,
    properties: Bytes,
    body: Bytes,
    body_owned: bool,
) -> (Bytes, Bytes, Bytes, Bytes) {
    let head = exchange.len() + routing_key.len() + properties.len();
    let total = head + if body_owned { 0 } else { body.len() };
    if total == 0 {
        return (exchange, routing_key, properties, body);
    }
    let mut all = BytesMut::with_capacity(total);
    for part in [&exchange, &routing_key, &properties] {
        all.extend_from_slice(part);
    }
    if !body_owned {
        all.extend_from_slice(&body);
    }
    let mut all = all.freeze();
    let exchange = all.split_to(exchange.len());
    let routing_key = all.split_to(routing_key.len());
    let properties = all.split_to(properties.len());
    let body = if body_owned { body } else { all };
    (exchange, routing_key, properties, body)
}

fn truncate(text: &str) -> String {
    if text.len() <= 255 {
        return text.to_string();
    }
    let mut end = 255;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text[..end].to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use amq_protocol::frame::{gen_frame, parse_frame, AMQPFrame};

    fn frame(f: AMQPFrame) -> Vec<u8> {
        cookie_factory::gen(gen_frame(&f), Vec::new())
            .expect("gen")
            .0
    }

    fn method(ch: u16, m: AMQPClass) -> Vec<u8> {
        frame(AMQPFrame::Method(ch, m))
    }

    /// Parses every frame the server wrote.
    fn written(c: &mut Connection) -> Vec<AMQPFrame> {
        let mut out = Vec::new();
        let buf = c.out().split().freeze();
        let mut rest = &buf[..];
        while !rest.is_empty() {
            let (r, f) = parse_frame(rest).expect("server wrote a valid frame");
            out.push(f);
            rest = r;
        }
        out
    }

    fn open_connection() -> Connection {
        open_connection_with(ServerConfig::default())
    }

    fn open_connection_with(config: ServerConfig) -> Connection {
        let mut c = Connection::new(config);
        let mut input = BytesMut::from(&codec::PROTOCOL_HEADER[..]);
        assert!(c.poll(&mut input).is_none());
        let start_ok = connection::StartOk {
            client_properties: FieldTable::default(),
            mechanism: "PLAIN".into(),
            response: "\0guest\0guest".into(),
            locale: "en_US".into(),
        };
        input.extend_from_slice(&method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::StartOk(start_ok)),
        ));
        match c.poll(&mut input) {
            Some(Event::Login {
                username, password, ..
            }) => assert_eq!((username.as_str(), password.as_str()), ("guest", "guest")),
            other => panic!("expected login, got {other:?}"),
        }
        c.accept_login();
        let tune_ok = connection::TuneOk {
            channel_max: 10,
            frame_max: 8192,
            heartbeat: 0,
        };
        input.extend_from_slice(&method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::TuneOk(tune_ok)),
        ));
        let open = connection::Open {
            virtual_host: "/".into(),
        };
        input.extend_from_slice(&method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::Open(open)),
        ));
        match c.poll(&mut input) {
            Some(Event::OpenVhost { vhost }) => assert_eq!(vhost, "/"),
            other => panic!("expected open, got {other:?}"),
        }
        c.accept_open();
        assert_eq!(c.frame_max(), 8192);
        written(&mut c);
        c
    }

    fn close_code(frames: &[AMQPFrame]) -> Option<u16> {
        frames.iter().find_map(|f| match f {
            AMQPFrame::Method(0, AMQPClass::Connection(connection::AMQPMethod::Close(c))) => {
                Some(c.reply_code)
            }
            _ => None,
        })
    }

    #[test]
    fn wrong_protocol_header_gets_ours_back() {
        let mut c = Connection::new(ServerConfig::default());
        let mut input = BytesMut::from(&b"HTTP/1.1"[..]);
        assert!(c.poll(&mut input).is_none());
        assert_eq!(&c.out()[..], codec::PROTOCOL_HEADER);
        assert!(c.is_finished());
    }

    #[test]
    fn publish_is_assembled_from_split_body_frames() {
        let mut c = open_connection();
        let mut input = BytesMut::new();
        input.extend_from_slice(&method(
            1,
            AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
        ));
        assert!(matches!(c.poll(&mut input), Some(Event::ChannelOpened(1))));
        let publish = basic::Publish {
            exchange: "x".into(),
            routing_key: "k".into(),
            mandatory: true,
            immediate: false,
        };
        input.extend_from_slice(&method(
            1,
            AMQPClass::Basic(basic::AMQPMethod::Publish(publish)),
        ));
        let props = basic::AMQPProperties::default().with_delivery_mode(2);
        input.extend_from_slice(&frame(AMQPFrame::Header(
            1,
            amq_protocol::frame::AMQPContentHeader {
                class_id: 60,
                body_size: 6,
                properties: props,
            },
        )));
        input.extend_from_slice(&frame(AMQPFrame::Body(1, b"abc".to_vec())));
        assert!(
            c.poll(&mut input).is_none(),
            "incomplete until the last body frame"
        );
        input.extend_from_slice(&frame(AMQPFrame::Body(1, b"def".to_vec())));
        match c.poll(&mut input) {
            Some(Event::Publish {
                channel: 1,
                message,
            }) => {
                assert_eq!(&message.body[..], b"abcdef");
                assert_eq!(&message.exchange[..], b"x");
                assert!(message.mandatory && message.persistent);
            }
            other => panic!("expected publish, got {other:?}"),
        }
    }

    #[test]
    fn protocol_errors_close_the_connection_with_their_codes() {
        // Method on a channel that was never opened: 504.
        let mut c = open_connection();
        let mut input = BytesMut::from(
            &method(
                3,
                AMQPClass::Basic(basic::AMQPMethod::Get(basic::Get {
                    queue: "q".into(),
                    no_ack: false,
                })),
            )[..],
        );
        assert!(c.poll(&mut input).is_none());
        assert_eq!(close_code(&written(&mut c)), Some(reply::CHANNEL_ERROR));

        // A frame over frame_max: 501.
        let mut c = open_connection();
        let mut input = BytesMut::from(&frame(AMQPFrame::Body(1, vec![0; 9000]))[..]);
        assert!(c.poll(&mut input).is_none());
        assert_eq!(close_code(&written(&mut c)), Some(reply::FRAME_ERROR));

        // A body frame with no publish before it: 505.
        let mut c = open_connection();
        let mut input = BytesMut::from(
            &method(
                1,
                AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
            )[..],
        );
        assert!(matches!(c.poll(&mut input), Some(Event::ChannelOpened(1))));
        input.extend_from_slice(&frame(AMQPFrame::Body(1, b"x".to_vec())));
        assert!(c.poll(&mut input).is_none());
        assert_eq!(close_code(&written(&mut c)), Some(reply::UNEXPECTED_FRAME));
        assert!(c.is_closing());
    }

    #[test]
    fn frames_on_a_closing_channel_are_discarded() {
        let mut c = open_connection();
        let mut input = BytesMut::from(
            &method(
                1,
                AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
            )[..],
        );
        assert!(matches!(c.poll(&mut input), Some(Event::ChannelOpened(1))));
        c.close_channel(1, reply::NOT_FOUND, "NOT_FOUND - no queue", 60, 70);
        input.extend_from_slice(&method(
            1,
            AMQPClass::Basic(basic::AMQPMethod::Get(basic::Get {
                queue: "q".into(),
                no_ack: false,
            })),
        ));
        assert!(c.poll(&mut input).is_none(), "discarded while closing");
        input.extend_from_slice(&method(
            1,
            AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {})),
        ));
        assert!(c.poll(&mut input).is_none());
        // The channel number is free again.
        input.extend_from_slice(&method(
            1,
            AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
        ));
        assert!(matches!(c.poll(&mut input), Some(Event::ChannelOpened(1))));
        assert!(!c.is_closing());
    }

    /// A raw frame: type, channel, payload.
    fn raw_frame(kind: u8, ch: u16, payload: &[u8]) -> Vec<u8> {
        let mut v = vec![kind];
        v.extend_from_slice(&ch.to_be_bytes());
        v.extend_from_slice(&(payload.len() as u32).to_be_bytes());
        v.extend_from_slice(payload);
        v.push(codec::FRAME_END);
        v
    }

    /// A raw method frame from class and method ids and hand-built arguments.
    fn raw_method(ch: u16, class_id: u16, method_id: u16, args: &[u8]) -> Vec<u8> {
        let mut p = class_id.to_be_bytes().to_vec();
        p.extend_from_slice(&method_id.to_be_bytes());
        p.extend_from_slice(args);
        raw_frame(codec::FRAME_METHOD, ch, &p)
    }

    fn short(s: &[u8]) -> Vec<u8> {
        let mut v = vec![s.len() as u8];
        v.extend_from_slice(s);
        v
    }

    fn long(s: &[u8]) -> Vec<u8> {
        let mut v = (s.len() as u32).to_be_bytes().to_vec();
        v.extend_from_slice(s);
        v
    }

    /// A field table (length prefix included) holding one entry nested
    /// `levels` deep in arrays (`b'A'`) or tables (`b'F'`).
    fn deep_table(kind: u8, levels: usize) -> Vec<u8> {
        long(&crate::amqp::sasl::tests::deep_entry(kind, levels))
    }

    /// A connection right after the protocol header (connection.start read).
    fn after_header() -> (Connection, BytesMut) {
        let mut c = Connection::new(ServerConfig::default());
        let mut input = BytesMut::from(&codec::PROTOCOL_HEADER[..]);
        assert!(c.poll(&mut input).is_none());
        written(&mut c);
        (c, input)
    }

    fn start_ok(mechanism: &[u8], response: &[u8]) -> Vec<u8> {
        let mut args = long(&[]);
        args.extend_from_slice(&short(mechanism));
        args.extend_from_slice(&long(response));
        args.extend_from_slice(&short(b"en_US"));
        raw_method(0, 10, 11, &args)
    }

    fn amqplain_login(extra: &[u8]) -> Vec<u8> {
        let mut r = short(b"LOGIN");
        r.push(b'S');
        r.extend_from_slice(&long(b"guest"));
        r.extend_from_slice(&short(b"PASSWORD"));
        r.push(b'S');
        r.extend_from_slice(&long(b"guest"));
        r.extend_from_slice(extra);
        r
    }

    #[test]
    fn deep_amqplain_response_closes_the_connection_instead_of_overflowing_the_stack() {
        // Issue 5, finding 0: the exact shapes that aborted the broker.
        for (kind, levels) in [(b'A', 2_100), (b'F', 1_400)] {
            let (mut c, mut input) = after_header();
            let entry = crate::amqp::sasl::tests::deep_entry(kind, levels);
            input.extend_from_slice(&start_ok(b"AMQPLAIN", &amqplain_login(&entry)));
            assert!(c.poll(&mut input).is_none(), "no login event");
            assert!(c.is_closing());
            let code = close_code(&written(&mut c));
            assert!(
                matches!(code, Some(reply::SYNTAX_ERROR | reply::ACCESS_REFUSED)),
                "{code:?}"
            );
        }
        // A well-formed AMQPLAIN login still works.
        let (mut c, mut input) = after_header();
        input.extend_from_slice(&start_ok(b"AMQPLAIN", &amqplain_login(&[])));
        assert!(matches!(
            c.poll(&mut input),
            Some(Event::Login { ref username, .. }) if username == "guest"
        ));
    }

    #[test]
    fn plain_responses_of_odd_sizes_are_refused_with_a_close() {
        for resp in [
            Vec::new(),
            b"\0".to_vec(),
            b"\0\0\0\0".to_vec(),
            vec![0xff; 70_000],
            {
                let mut v = b"\0u\0".to_vec();
                v.resize(100_000, b'p');
                v
            },
        ] {
            let (mut c, mut input) = after_header();
            input.extend_from_slice(&start_ok(b"PLAIN", &resp));
            assert!(c.poll(&mut input).is_none(), "{} bytes", resp.len());
            assert_eq!(close_code(&written(&mut c)), Some(reply::ACCESS_REFUSED));
        }
        // A response longer than the frame it claims to be in: malformed method.
        let (mut c, mut input) = after_header();
        let mut args = long(&[]);
        args.extend_from_slice(&short(b"PLAIN"));
        args.extend_from_slice(&u32::MAX.to_be_bytes());
        args.extend_from_slice(b"\0u\0p");
        input.extend_from_slice(&raw_method(0, 10, 11, &args));
        assert!(c.poll(&mut input).is_none());
        assert_eq!(close_code(&written(&mut c)), Some(reply::SYNTAX_ERROR));
    }

    #[test]
    fn deep_tables_in_every_table_carrying_method_close_without_a_crash() {
        // Before tune, frames of up to 128 KiB are read; after, 8 KiB here.
        let deep = || deep_table(b'A', 5_000);
        let deep_small = || deep_table(b'A', 1_500);
        // connection.start sent by a client, before login: amq-protocol
        // parses its server-properties table too.
        let (mut c, mut input) = after_header();
        let mut args = vec![0, 9];
        args.extend_from_slice(&deep());
        args.extend_from_slice(&long(b"PLAIN"));
        args.extend_from_slice(&long(b"en_US"));
        input.extend_from_slice(&raw_method(0, 10, 10, &args));
        assert!(c.poll(&mut input).is_none());
        assert_eq!(close_code(&written(&mut c)), Some(reply::SYNTAX_ERROR));
        // connection.start-ok's client-properties.
        let (mut c, mut input) = after_header();
        let mut args = deep();
        args.extend_from_slice(&short(b"PLAIN"));
        args.extend_from_slice(&long(b"\0guest\0guest"));
        args.extend_from_slice(&short(b"en_US"));
        input.extend_from_slice(&raw_method(0, 10, 11, &args));
        assert!(c.poll(&mut input).is_none());
        assert_eq!(close_code(&written(&mut c)), Some(reply::SYNTAX_ERROR));

        let s = |x: &[u8]| short(x);
        let cases: Vec<(u16, u16, Vec<u8>)> = vec![
            (
                40,
                10,
                [&[0, 0][..], &s(b"x"), &s(b"direct"), &[0]].concat(),
            ),
            (
                40,
                30,
                [&[0, 0][..], &s(b"d"), &s(b"s"), &s(b"k"), &[0]].concat(),
            ),
            (
                40,
                40,
                [&[0, 0][..], &s(b"d"), &s(b"s"), &s(b"k"), &[0]].concat(),
            ),
            (50, 10, [&[0, 0][..], &s(b"q"), &[0]].concat()),
            (
                50,
                20,
                [&[0, 0][..], &s(b"q"), &s(b"x"), &s(b"k"), &[0]].concat(),
            ),
            (50, 50, [&[0, 0][..], &s(b"q"), &s(b"x"), &s(b"k")].concat()),
            (60, 20, [&[0, 0][..], &s(b"q"), &s(b"t"), &[0]].concat()),
        ];
        for (class_id, method_id, mut args) in cases {
            let mut c = open_connection();
            let mut input = BytesMut::from(
                &method(
                    1,
                    AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
                )[..],
            );
            assert!(matches!(c.poll(&mut input), Some(Event::ChannelOpened(1))));
            args.extend_from_slice(&deep_small());
            input.extend_from_slice(&raw_method(1, class_id, method_id, &args));
            assert!(c.poll(&mut input).is_none(), "{class_id}.{method_id}");
            assert_eq!(
                close_code(&written(&mut c)),
                Some(reply::SYNTAX_ERROR),
                "{class_id}.{method_id}"
            );
        }
        // A content header's headers table.
        let mut c = open_connection();
        let mut input = BytesMut::from(
            &method(
                1,
                AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
            )[..],
        );
        assert!(matches!(c.poll(&mut input), Some(Event::ChannelOpened(1))));
        input.extend_from_slice(&raw_method(
            1,
            60,
            40,
            &[&[0, 0][..], &s(b""), &s(b"q"), &[0]].concat(),
        ));
        let mut header = vec![0, 60, 0, 0];
        header.extend_from_slice(&1u64.to_be_bytes());
        header.extend_from_slice(&(1u16 << 13).to_be_bytes());
        header.extend_from_slice(&deep_small());
        input.extend_from_slice(&raw_frame(codec::FRAME_HEADER, 1, &header));
        assert!(c.poll(&mut input).is_none());
        assert_eq!(close_code(&written(&mut c)), Some(reply::FRAME_ERROR));
        // And a stored property block handed to parse_properties.
        let mut props = (1u16 << 13).to_be_bytes().to_vec();
        props.extend_from_slice(&deep());
        assert!(parse_properties(&props).is_none());
    }

    #[test]
    fn huge_declared_frame_sizes_are_refused_before_buffering() {
        for size in [u32::MAX, 131_065, 1 << 31] {
            let (mut c, mut input) = after_header();
            input.extend_from_slice(&[1, 0, 0]);
            input.extend_from_slice(&size.to_be_bytes());
            assert!(c.poll(&mut input).is_none());
            assert_eq!(close_code(&written(&mut c)), Some(reply::FRAME_ERROR));
            assert!(input.capacity() < 1 << 20, "reserved {}", input.capacity());
        }
    }

    /// publish + content header announcing `size` on `ch`, then `sent` body bytes.
    fn partial_publish(ch: u16, size: u64, sent: usize, frame_max: usize) -> Vec<u8> {
        let mut v = method(
            ch,
            AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish {
                exchange: "".into(),
                routing_key: "q".into(),
                mandatory: false,
                immediate: false,
            })),
        );
        v.extend_from_slice(&frame(AMQPFrame::Header(
            ch,
            amq_protocol::frame::AMQPContentHeader {
                class_id: 60,
                body_size: size,
                properties: basic::AMQPProperties::default(),
            },
        )));
        let body = vec![b'x'; sent];
        for piece in body.chunks(frame_max - codec::FRAME_OVERHEAD) {
            v.extend_from_slice(&frame(AMQPFrame::Body(ch, piece.to_vec())));
        }
        v
    }

    fn channel_close_code(frames: &[AMQPFrame], ch: u16) -> Option<u16> {
        frames.iter().find_map(|f| match f {
            AMQPFrame::Method(c, AMQPClass::Channel(channel::AMQPMethod::Close(cl)))
                if *c == ch =>
            {
                Some(cl.reply_code)
            }
            _ => None,
        })
    }

    #[test]
    fn partial_content_is_capped_per_connection_across_channels() {
        let mut c = open_connection_with(ServerConfig {
            max_message_size: 100_000,
            ..ServerConfig::default()
        });
        let mut input = BytesMut::new();
        for ch in 1..=4 {
            input.extend_from_slice(&method(
                ch,
                AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
            ));
            assert!(matches!(c.poll(&mut input), Some(Event::ChannelOpened(n)) if n == ch));
        }
        written(&mut c);
        assert_eq!(c.partial_content_bytes(), 0);
        // One incomplete message may use all of max_message_size.
        input.extend_from_slice(&partial_publish(1, 100_000, 99_000, 8192));
        assert!(c.poll(&mut input).is_none());
        let one = c.partial_content_bytes();
        assert!((99_000..99_100).contains(&one), "{one}");
        assert!(written(&mut c).is_empty());
        // A second one on another channel would pass the cap: refused with 406.
        input.extend_from_slice(&partial_publish(2, 100_000, 20_000, 8192));
        assert!(
            matches!(c.poll(&mut input), Some(Event::ChannelClosed(2))),
            "the engine is told to release channel 2"
        );
        assert!(c.poll(&mut input).is_none());
        assert_eq!(
            channel_close_code(&written(&mut c), 2),
            Some(reply::PRECONDITION_FAILED)
        );
        assert_eq!(c.partial_content_bytes(), one, "channel 2 holds nothing");
        assert!(!c.is_closing(), "the connection and channel 1 go on");
        // Channel 1 completes: nothing is held any more.
        input.extend_from_slice(&frame(AMQPFrame::Body(1, vec![b'x'; 1_000])));
        match c.poll(&mut input) {
            Some(Event::Publish {
                channel: 1,
                message,
            }) => assert_eq!(message.body.len(), 100_000),
            other => panic!("expected publish, got {other:?}"),
        }
        assert!(c.poll(&mut input).is_none());
        assert_eq!(c.partial_content_bytes(), 0);
        // Small messages in progress on several channels fit together.
        for ch in [3, 4] {
            input.extend_from_slice(&partial_publish(ch, 40_000, 30_000, 8192));
        }
        assert!(c.poll(&mut input).is_none());
        assert!(written(&mut c).is_empty());
        assert!(c.partial_content_bytes() >= 60_000);
        // Closing the connection releases them.
        c.fail(reply::CONNECTION_FORCED, "test".into(), 0, 0);
        assert_eq!(c.partial_content_bytes(), 0);
    }

    #[test]
    fn an_incomplete_message_does_not_pin_the_read_buffer() {
        let mut c = open_connection();
        let mut input = BytesMut::from(
            &method(
                1,
                AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
            )[..],
        );
        assert!(matches!(c.poll(&mut input), Some(Event::ChannelOpened(1))));
        input.extend_from_slice(&partial_publish(1, 10, 0, 8192));
        let range = input.as_ptr() as usize..input.as_ptr() as usize + input.capacity();
        assert!(c.poll(&mut input).is_none());
        let state = c.channels.get(&1).expect("channel 1");
        let Content::AwaitingBody {
            publish, header, ..
        } = &state.content
        else {
            panic!("expected a body to be awaited");
        };
        for b in [&publish.routing_key, &header.properties] {
            assert!(
                !range.contains(&(b.as_ptr() as usize)),
                "still a slice of the input"
            );
        }
    }

    #[test]
    fn messages_are_copied_out_of_the_read_buffer() {
        let mut c = open_connection_with(ServerConfig::default());
        let mut input = BytesMut::from(
            &method(
                1,
                AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
            )[..],
        );
        assert!(matches!(c.poll(&mut input), Some(Event::ChannelOpened(1))));
        input.extend_from_slice(&partial_publish(1, 3, 3, 8192));
        let range = input.as_ptr() as usize..input.as_ptr() as usize + input.capacity();
        let Some(Event::Publish { message, .. }) = c.poll(&mut input) else {
            panic!("expected publish");
        };
        assert_eq!(&message.body[..], b"xxx");
        assert_eq!(&message.routing_key[..], b"q");
        for b in [&message.routing_key, &message.properties, &message.body] {
            assert!(!range.contains(&(b.as_ptr() as usize)));
        }
    }

    /// Throughput of small publishes fed in 64 KiB reads (each message copied
    /// out of the read buffer); run with
    /// `cargo test -p weir-protocols --release -- --ignored --nocapture measure`.
    #[test]
    #[ignore]
    fn measure_small_publish_throughput() {
        let n = 1_000_000;
        let mut one = Vec::new();
        one.extend_from_slice(&partial_publish(1, 100, 100, 8192));
        let mut stream = Vec::with_capacity(one.len() * n);
        for _ in 0..n {
            stream.extend_from_slice(&one);
        }
        {
            let mut c = open_connection_with(ServerConfig::default());
            let mut input = BytesMut::from(
                &method(
                    1,
                    AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
                )[..],
            );
            assert!(matches!(c.poll(&mut input), Some(Event::ChannelOpened(1))));
            let started = std::time::Instant::now();
            let mut got = 0;
            for read in stream.chunks(64 * 1024) {
                input.reserve(64 * 1024);
                input.extend_from_slice(read);
                while let Some(ev) = c.poll(&mut input) {
                    if let Event::Publish { message, .. } = ev {
                        got += message.body.len() / 100;
                    }
                }
            }
            assert_eq!(got, n);
            let secs = started.elapsed().as_secs_f64();
            println!(
                "{n} publishes of 100 B in {secs:.3} s = {:.0} k msg/s",
                n as f64 / secs / 1000.0
            );
        }
    }
}
