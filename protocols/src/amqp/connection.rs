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

/// Decodes a raw property block.
pub fn parse_properties(raw: &[u8]) -> Option<basic::AMQPProperties> {
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
    /// The client closed a channel (close-ok already queued): release its state.
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

enum Content {
    Idle,
    AwaitingHeader(PendingPublish),
    AwaitingBody {
        publish: PendingPublish,
        header: Header,
        remaining: u64,
        parts: Vec<Bytes>,
    },
}

struct PendingPublish {
    exchange: Bytes,
    routing_key: Bytes,
    mandatory: bool,
    immediate: bool,
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
}

impl Connection {
    /// A connection that has not yet seen the protocol header.
    pub fn new(config: ServerConfig) -> Self {
        let frame_max = config.frame_max as usize;
        let channel_max = config.channel_max;
        Connection {
            config,
            phase: Phase::AwaitingHeader,
            frame_max,
            channel_max,
            heartbeat: 0,
            channels: HashMap::new(),
            pending: VecDeque::new(),
            out: BytesMut::with_capacity(16 * 1024),
            close_reason: None,
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
            match codec::cut_frame(input, self.frame_max) {
                Ok(None) => return None,
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
        self.channels.clear();
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
        state.content = Content::Idle;
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
                        self.channels.remove(&ch);
                    } else if class_id == 20 && method_id == 40 {
                        self.channels.remove(&ch);
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
                let mechanism = start_ok.mechanism.as_str().to_string();
                let Some((username, password)) =
                    decode_credentials(&mechanism, start_ok.response.as_bytes())
                else {
                    return self.fail(
                        reply::ACCESS_REFUSED,
                        format!("ACCESS_REFUSED - unsupported mechanism or malformed response for {mechanism}"),
                        10,
                        11,
                    );
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
                self.channels.clear();
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
                self.channels.remove(&ch);
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
        if let Some(state) = self.channels.get_mut(&ch) {
            state.content = Content::AwaitingHeader(PendingPublish {
                exchange,
                routing_key,
                mandatory: bits & 1 != 0,
                immediate: bits & 2 != 0,
            });
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
        let content = std::mem::replace(&mut state.content, Content::Idle);
        match (frame.kind, content) {
            (codec::FRAME_HEADER, Content::AwaitingHeader(publish)) => {
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
                    self.close_channel(ch, reply::PRECONDITION_FAILED, &text, 60, 40);
                    return;
                }
                let props = &header.properties;
                let h = Header {
                    properties: frame.payload.slice(12..),
                    persistent: *props.delivery_mode() == Some(2),
                    priority: *props.priority(),
                };
                if header.body_size == 0 {
                    self.finish_publish(ch, publish, h, Bytes::new());
                } else if let Some(state) = self.channels.get_mut(&ch) {
                    state.content = Content::AwaitingBody {
                        publish,
                        header: h,
                        remaining: header.body_size,
                        parts: Vec::new(),
                    };
                }
            }
            (
                codec::FRAME_BODY,
                Content::AwaitingBody {
                    publish,
                    header,
                    remaining,
                    mut parts,
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
                parts.push(frame.payload);
                let remaining = remaining - len;
                if remaining == 0 {
                    let body = if parts.len() == 1 {
                        parts.pop().unwrap_or_default()
                    } else {
                        let mut b = BytesMut::with_capacity(parts.iter().map(Bytes::len).sum());
                        for p in &parts {
                            b.extend_from_slice(p);
                        }
                        b.freeze()
                    };
                    self.finish_publish(ch, publish, header, body);
                } else if let Some(state) = self.channels.get_mut(&ch) {
                    state.content = Content::AwaitingBody {
                        publish,
                        header,
                        remaining,
                        parts,
                    };
                }
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

    fn finish_publish(&mut self, ch: u16, p: PendingPublish, h: Header, body: Bytes) {
        self.pending.push_back(Event::Publish {
            channel: ch,
            message: Publish {
                exchange: p.exchange,
                routing_key: p.routing_key,
                mandatory: p.mandatory,
                immediate: p.immediate,
                properties: h.properties,
                persistent: h.persistent,
                priority: h.priority,
                body,
            },
        });
    }
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

/// Decodes PLAIN (`\0user\0pass`) and AMQPLAIN (a field table without its
/// length prefix) responses.
fn decode_credentials(mechanism: &str, response: &[u8]) -> Option<(String, String)> {
    match mechanism {
        "PLAIN" => {
            let mut parts = response.split(|b| *b == 0);
            let _authzid = parts.next()?;
            let user = parts.next()?;
            let pass = parts.next()?;
            if parts.next().is_some() {
                return None;
            }
            Some((
                String::from_utf8(user.to_vec()).ok()?,
                String::from_utf8(pass.to_vec()).ok()?,
            ))
        }
        "AMQPLAIN" => {
            let mut framed = Vec::with_capacity(response.len() + 4);
            framed.extend_from_slice(&(response.len() as u32).to_be_bytes());
            framed.extend_from_slice(response);
            let (_, table) = amq_protocol::types::parsing::parse_field_table(&framed[..]).ok()?;
            let get = |k: &str| -> Option<String> {
                match table.inner().get(k)? {
                    AMQPValue::LongString(s) => String::from_utf8(s.as_bytes().to_vec()).ok(),
                    AMQPValue::ShortString(s) => Some(s.as_str().to_string()),
                    _ => None,
                }
            };
            Some((get("LOGIN")?, get("PASSWORD")?))
        }
        _ => None,
    }
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
        let mut c = Connection::new(ServerConfig::default());
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
}
