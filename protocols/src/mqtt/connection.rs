//! The state machine of one MQTT connection: its phases, packet dispatch,
//! and how a connection ends.
//!
//! The other concerns are in sibling files, each an `impl Connection`
//! block: `handshake` (CONNECT, CONNACK, DISCONNECT both ways), `inbound`
//! (PUBLISH from the client and its acknowledgements), `outbound` (PUBLISH
//! to the client and its acknowledgements), `subscribe` (SUBSCRIBE and
//! UNSUBSCRIBE), `timers` (CONNECT timeout and keep-alive), `wire`
//! (framing and the checks `mqttbytes` does not make).

use super::config::ServerConfig;
use super::event::*;
use super::inbound::Inbound;
use super::outbound::Outbound;
use super::reason;
use super::timers::Timers;
use super::wire::{self, kind, Fault, Header};
use bytes::{Bytes, BytesMut};
use std::time::Instant;

/// Where the connection is in its life, in order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Phase {
    /// Nothing but a CONNECT is accepted.
    AwaitingConnect,
    /// [`Event::Connect`] was returned: the session's `accept` or `refuse`
    /// comes next; further input waits in the buffer until then.
    Connecting,
    /// CONNACK success sent.
    Open,
    /// Nothing more is read; `out` holds the last bytes to write.
    Finished,
}

/// What the client declared in CONNECT about itself.
#[derive(Clone, Copy, Debug)]
pub(super) struct ClientLimits {
    /// QoS 1/2 publishes it accepts in flight.
    pub receive_maximum: u16,
    /// Largest packet it accepts.
    pub maximum_packet_size: Option<u32>,
    /// Topic aliases it accepts from us.
    pub topic_alias_maximum: u16,
    /// Keep-alive it asked for, seconds.
    pub keep_alive: u16,
    /// Its CONNECT asked for a clean start (session present must be 0).
    pub clean_start: bool,
    /// Its CONNECT had session expiry 0: a DISCONNECT must not raise it.
    pub session_expiry_zero: bool,
    /// It asked for response information (MQTT 5).
    pub request_response_information: bool,
}

impl Default for ClientLimits {
    fn default() -> Self {
        ClientLimits {
            receive_maximum: u16::MAX,
            maximum_packet_size: None,
            topic_alias_maximum: 0,
            keep_alive: 0,
            clean_start: true,
            session_expiry_zero: true,
            request_response_information: false,
        }
    }
}

/// One MQTT connection, server side.
///
/// # Driving it
///
/// Time comes in as `Instant` arguments; nothing here reads a clock or a
/// socket. A session loops:
///
/// 1. **Read**: append the bytes read to an input buffer and call
///    [`Connection::on_read`]`(now)`.
/// 2. **Input**: call [`Connection::poll`] until it returns `None`, acting on
///    each [`Event`]. Answers ([`Connection::accept`], [`Connection::puback`],
///    …) encode into [`Connection::out`] at once. After
///    [`Connection::accept`], poll again even if nothing new was read: input
///    that arrived behind the CONNECT waits until the CONNECT is answered.
/// 3. **Timers**: sleep until [`Connection::poll_timeout`] (a deadline in the
///    past means "now"), then call [`Connection::handle_timeout`]`(now)` and
///    poll: a timeout that ends the connection is reported as
///    [`Event::Closed`] by the next poll.
/// 4. **Write**: write [`Connection::out`] to the socket (all of it, before
///    hanging up). Hang up once [`Connection::is_finished`] and `out` is
///    empty. A finished connection still returns its one [`Event::Closed`]
///    from `poll`, so poll before hanging up.
///
/// # How a connection ends
///
/// * The client sends DISCONNECT: [`Event::Disconnect`], nothing written.
/// * The adapter ends it (malformed packet, protocol error, limit, keep-alive
///   or CONNECT timeout, an unsupported protocol version): exactly one
///   [`Event::Closed`] with an MQTT 5 reason code (for 3.1.1 too, where only
///   a CONNACK return code or nothing is written). MQTT 5 writes a DISCONNECT
///   with that reason (or a CONNACK, while the CONNECT is read) first.
/// * The session ends it ([`Connection::refuse`], [`Connection::disconnect`]):
///   no event.
/// * The socket closes: the session's business (no event from here).
pub struct Connection {
    /// Bytes to write to the socket.
    pub out: BytesMut,
    pub(super) config: ServerConfig,
    pub(super) phase: Phase,
    pub(super) version: Option<Version>,
    pub(super) client: ClientLimits,
    /// The keep-alive in force (seconds, 0 = none), set by `accept`.
    pub(super) keep_alive: u16,
    pub(super) inbound: Inbound,
    pub(super) outbound: Outbound,
    pub(super) timers: Timers,
    /// [`Event::Closed`] waiting for the next poll (reason, text): kept
    /// this small rather than as an `Event`, which is ~200 bytes.
    pub(super) pending: Option<(u8, String)>,
}

impl Connection {
    /// A connection accepted at `now`, waiting for CONNECT.
    pub fn new(config: ServerConfig, now: Instant) -> Connection {
        Connection {
            // Allocated on first write: an idle connection costs little.
            out: BytesMut::new(),
            config,
            phase: Phase::AwaitingConnect,
            version: None,
            client: ClientLimits::default(),
            keep_alive: 0,
            inbound: Inbound::default(),
            outbound: Outbound::default(),
            timers: Timers::new(now),
            pending: None,
        }
    }

    /// The protocol level, once CONNECT was read.
    pub fn version(&self) -> Option<Version> {
        self.version
    }

    /// The keep-alive in force after [`Self::accept`], seconds (0: none):
    /// the server keep-alive when one applied, else the client's.
    pub fn keep_alive(&self) -> u16 {
        self.keep_alive
    }

    /// The largest packet accepted now, fixed header included: before the
    /// CONNECT is read [`ServerConfig::maximum_connect_size`] (what an
    /// unauthenticated client can make the server hold), then
    /// [`ServerConfig::maximum_packet_size`]. A larger packet is refused at
    /// its fixed header; a session need not buffer more than this (plus
    /// what follows it in one read).
    pub fn packet_limit(&self) -> usize {
        let max = self.config.maximum_packet_size;
        match self.phase {
            Phase::AwaitingConnect => self.config.maximum_connect_size.min(max) as usize,
            _ => max as usize,
        }
    }

    /// Whether CONNACK success was sent and the connection is not over.
    pub fn is_open(&self) -> bool {
        self.phase == Phase::Open
    }

    /// The next event from `input` (complete packets are cut off it), or
    /// `None` when more bytes are needed or the connection is finished.
    /// PINGREQ, PUBREL bookkeeping, malformed packets and protocol errors
    /// are handled inside (a fatal one yields [`Event::Closed`] once).
    ///
    /// Payloads are slices of `input`'s buffer (no copy).
    pub fn poll(&mut self, input: &mut BytesMut) -> Option<Event> {
        loop {
            if let Some((reason, text)) = self.pending.take() {
                return Some(Event::Closed { reason, text });
            }
            match self.phase {
                Phase::Finished => {
                    input.clear();
                    return None;
                }
                Phase::Connecting => return None,
                Phase::AwaitingConnect | Phase::Open => {}
            }
            if self.phase == Phase::AwaitingConnect
                && input.first().is_some_and(|b| b >> 4 != kind::CONNECT)
            {
                // Known from the first byte: no need to wait for the rest.
                input.clear();
                self.fail(Fault::protocol("the first packet must be CONNECT"));
                continue;
            }
            let header = match wire::fixed_header(input) {
                Ok(Some(h)) => h,
                Ok(None) => return None,
                Err(f) => {
                    input.clear();
                    self.fail(f);
                    continue;
                }
            };
            let max = self.packet_limit();
            if header.total() > max {
                let what = if self.phase == Phase::AwaitingConnect {
                    self.peek_version(input, &header);
                    "CONNECT"
                } else {
                    "packet"
                };
                input.clear();
                self.fail(Fault::new(
                    reason::PACKET_TOO_LARGE,
                    format!("{what} of {} bytes, the maximum is {max}", header.total()),
                ));
                continue;
            }
            if input.len() < header.total() {
                return None;
            }
            let packet = input.split_to(header.total()).freeze();
            match wire::check_flags(&header).and_then(|()| self.on_packet(header, packet)) {
                Ok(Some(ev)) => return Some(ev),
                Ok(None) => {}
                Err(f) => {
                    // Nothing after a fatal packet is interpreted.
                    input.clear();
                    self.fail(f);
                }
            }
        }
    }

    /// One complete packet, flags checked.
    fn on_packet(&mut self, h: Header, packet: Bytes) -> Result<Option<Event>, Fault> {
        if self.phase == Phase::AwaitingConnect {
            // poll checked the type.
            return self.on_connect(h, packet);
        }
        let v5 = self.version == Some(Version::V5);
        let body = packet.get(h.header_len..).unwrap_or_default();
        match h.kind() {
            kind::PUBLISH => self.on_publish(h, packet),
            kind::PUBACK => {
                let ack = wire::ack(body, v5, "PUBACK")?;
                Ok(self.on_puback(ack))
            }
            kind::PUBREC => {
                let ack = wire::ack(body, v5, "PUBREC")?;
                Ok(self.on_pubrec(ack))
            }
            kind::PUBREL => {
                let ack = wire::ack(body, v5, "PUBREL")?;
                self.on_pubrel(ack)
            }
            kind::PUBCOMP => {
                let ack = wire::ack(body, v5, "PUBCOMP")?;
                Ok(self.on_pubcomp(ack))
            }
            kind::SUBSCRIBE => self.on_subscribe(h, packet),
            kind::UNSUBSCRIBE => self.on_unsubscribe(h, packet),
            kind::PINGREQ => {
                if h.remaining != 0 {
                    return Err(Fault::malformed("PINGREQ with a body"));
                }
                let _ = mqttbytes::v4::PingResp.write(&mut self.out);
                Ok(None)
            }
            kind::DISCONNECT => self.on_disconnect(body),
            kind::CONNECT => Err(Fault::protocol("second CONNECT")),
            kind::AUTH if v5 => Err(Fault::protocol(
                "AUTH without an authentication method in CONNECT",
            )),
            kind::CONNACK | kind::SUBACK | kind::UNSUBACK | kind::PINGRESP => Err(Fault::protocol(
                format!("packet type {} is sent by servers only", h.kind()),
            )),
            other => Err(Fault::malformed(format!("reserved packet type {other}"))),
        }
    }

    /// A CONNECT too large to buffer: if its first bytes say MQTT 5, the
    /// refusal can still be a CONNACK 0x95.
    fn peek_version(&mut self, input: &[u8], h: &Header) {
        let level = h.header_len + 6;
        if input.get(h.header_len..level) == Some(&[0, 4, b'M', b'Q', b'T', b'T'][..])
            && input.get(level) == Some(&5)
            && h.kind() == kind::CONNECT
        {
            self.version = Some(Version::V5);
        }
    }

    /// Ends the connection for `f`, telling the client as the version
    /// allows: MQTT 5 writes DISCONNECT (or CONNACK while reading the
    /// CONNECT); 3.1.1 writes nothing. Then [`Event::Closed`] is pending.
    pub(super) fn fail(&mut self, f: Fault) {
        if self.phase == Phase::Finished {
            return;
        }
        if self.version == Some(Version::V5) {
            match self.phase {
                Phase::Open => self.write_disconnect(f.code, &f.text),
                Phase::AwaitingConnect => self.write_connack_refusal(f.code, &f.text),
                Phase::Connecting | Phase::Finished => {}
            }
        }
        self.end(f);
    }

    /// Ends the connection with [`Event::Closed`] and writes nothing more.
    pub(super) fn end(&mut self, f: Fault) {
        if self.phase == Phase::Finished {
            return;
        }
        self.phase = Phase::Finished;
        self.pending = Some((f.code, f.text.into_owned()));
    }

    /// Ends the connection at the session's request: no event.
    pub(super) fn finish(&mut self) {
        self.phase = Phase::Finished;
    }

    /// Nothing more will be read; hang up once `out` is written (and
    /// `poll` returned `None`).
    pub fn is_finished(&self) -> bool {
        self.phase == Phase::Finished
    }

    /// Whether the MQTT 5 encoding applies.
    pub(super) fn v5(&self) -> bool {
        self.version == Some(Version::V5)
    }
}

/// `text` cut to at most `max` bytes on a character boundary (reason
/// strings are for people; they need not be long).
pub(super) fn truncate(text: &str, max: usize) -> &str {
    if text.len() <= max {
        return text;
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}
