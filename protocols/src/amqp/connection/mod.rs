//! The server side of one AMQP 0-9-1 connection, without I/O.
//!
//! [`Connection::poll`] cuts frames off the input one at a time and turns them
//! into [`Event`]s: the handshake, channel lifecycle, content assembly and
//! protocol errors are handled here; everything that needs the engine is
//! handed out as an event. Replies go into [`Connection::out`], which the
//! caller writes to the socket. Frames are taken one at a time so that an
//! answer to one event (say, a channel closed for an error) takes effect before
//! the next frame is interpreted.
//!
//! # Driving it
//!
//! The connection never reads a clock or a socket: time comes in as
//! `Instant` arguments, quinn-proto style. A session loops:
//!
//! 1. **Read**: append the bytes read to the input buffer and call
//!    [`Connection::on_read`]`(now)`. While the session chooses not to read
//!    (output backed up, publisher blocked by an alarm), it says so with
//!    [`Connection::pause_reads`] / [`Connection::resume_reads`]: time not
//!    read is not peer silence.
//! 2. **Input**: call [`Connection::poll`] until it returns `None`, and act
//!    on each [`Event`] (answers such as [`Connection::accept_login`] or
//!    [`Connection::close_channel`] take effect before the next frame).
//! 3. **Timers**: sleep until [`Connection::poll_timeout`] (a deadline in the
//!    past means "now"); when it passes, call [`Connection::handle_timeout`]`(now)`,
//!    which queues a heartbeat or ends the connection
//!    ([`Connection::timed_out`] says why, for the log).
//! 4. **Write**: write [`Connection::out`] to the socket and call
//!    [`Connection::on_write`]`(now)` when bytes went out. Hang up once
//!    [`Connection::is_finished`] and `out` is empty.
//!
//! # Layout
//!
//! * `config`: [`ServerConfig`], the limits and identity the server offers.
//! * `event`: [`Event`] and [`Publish`], what the session acts on.
//! * `handshake`: protocol header, start/start-ok (login), tune, open, and
//!   the other connection-class methods (close, update-secret).
//! * `channels`: channel open/close/flow, and discarding frames for a
//!   channel the server is closing.
//! * `content`: basic.publish + content header + body assembly, the
//!   partial-content cap, copying a message out of the read buffer.
//! * `timers`: heartbeat, handshake and close timeouts.
//! * `client_properties`: the bounded copy of start-ok's client properties
//!   kept for the management API.
//! * this file: the state, frame dispatch and connection-level errors.

mod channels;
pub mod client_properties;
mod config;
mod content;
mod event;
mod handshake;
#[cfg(test)]
mod tests;
mod timers;

pub use config::ServerConfig;
pub use content::parse_properties;
pub use event::{Event, Publish};
pub use timers::{Timeout, CLOSE_TIMEOUT, HANDSHAKE_TIMEOUT};

use super::codec::{self, FrameError, RawFrame, Reader};
use super::depth;
use super::reply;
use amq_protocol::protocol::{channel, connection, AMQPClass};
use bytes::{Bytes, BytesMut};
use channels::ChannelState;
use content::Content;
use std::collections::{HashMap, VecDeque};
use std::time::Instant;
use timers::Timers;

/// Where the connection is in its life, in order.
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

/// One AMQP connection's protocol state.
pub struct Connection {
    config: ServerConfig,
    phase: Phase,
    frame_max: usize,
    channel_max: u16,
    /// Channels that may be open at once (a tenant's quota), if limited.
    open_channels_max: Option<u32>,
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
    /// The client's `connection_name` property from start-ok, if text.
    connection_name: Option<String>,
    /// Start-ok's client properties, bounded ([`client_properties`]),
    /// until the session takes them.
    client_properties: Option<amq_protocol::types::FieldTable>,
    /// SASL EXTERNAL is offered ([`Self::offer_external`]).
    external: bool,
    /// Heartbeat, handshake and close deadlines.
    timers: Timers,
}

impl Connection {
    /// A connection that has not yet seen the protocol header, accepted now
    /// (reads the clock once, for the handshake timeout; [`Self::new_at`]
    /// takes the time as an argument instead).
    pub fn new(config: ServerConfig) -> Self {
        Self::new_at(config, Instant::now())
    }

    /// A connection accepted at `now` that has not yet seen the protocol
    /// header. The handshake must complete within [`HANDSHAKE_TIMEOUT`] of
    /// `now`.
    pub fn new_at(config: ServerConfig, now: Instant) -> Self {
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
            open_channels_max: None,
            heartbeat: 0,
            channels: HashMap::new(),
            pending: VecDeque::new(),
            out: BytesMut::with_capacity(16 * 1024),
            close_reason: None,
            accepts_blocked: false,
            connection_name: None,
            client_properties: None,
            external: false,
            timers: Timers::new(now),
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

    /// Limits the channels open at once (a tenant's or user's
    /// `max-channels-per-connection`, known at connection.open): one more
    /// `channel.open` is refused with 530, as RabbitMQ refuses a channel
    /// over its channel_max, without channel.open-ok.
    pub fn limit_open_channels(&mut self, max: Option<u32>) {
        self.open_channels_max = max;
    }

    /// Whether the client advertised the `connection.blocked` capability
    /// (so it understands connection.blocked / connection.unblocked).
    pub fn accepts_blocked(&self) -> bool {
        self.accepts_blocked
    }

    /// The `connection_name` client property of start-ok (what operators
    /// name connections by, e.g. in `[[quota.connections]]`), once known.
    pub fn client_connection_name(&self) -> Option<&str> {
        self.connection_name.as_deref()
    }

    /// The client properties of start-ok (what the management API shows),
    /// bounded: strings over [`client_properties::MAX_STRING`] bytes and
    /// tables nested deeper than [`client_properties::MAX_DEPTH`] are left
    /// out, as are entries past [`client_properties::MAX_ENTRIES`] or
    /// [`client_properties::MAX_BYTES`]. Taken once (the session keeps
    /// them); empty before start-ok and after.
    pub fn take_client_properties(&mut self) -> amq_protocol::types::FieldTable {
        self.client_properties.take().unwrap_or_default()
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

    /// Queues a method frame.
    pub fn send_method(&mut self, channel: u16, method: AMQPClass) {
        codec::write_method(&mut self.out, channel, method);
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

    pub(super) fn handle_frame(&mut self, frame: RawFrame) {
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

    pub(super) fn handle_method_frame(&mut self, ch: u16, payload: Bytes) {
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

    pub(super) fn syntax_error(&mut self, class_id: u16, method_id: u16) {
        self.fail(
            reply::SYNTAX_ERROR,
            format!("SYNTAX_ERROR - could not decode method {class_id}.{method_id}"),
            class_id,
            method_id,
        );
    }
}

/// Cuts a reply text to the 255 bytes a short string holds.
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
