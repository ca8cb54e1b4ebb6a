//! CONNECT (decoding, version detection, validation), CONNACK (accept and
//! refuse), and DISCONNECT in both directions.
//!
//! CONNECT is decoded here rather than by `mqttbytes` (see `wire`): the
//! password is binary, the user name and password flags must be seen as
//! sent, and an unsupported protocol level must still get a CONNACK.

use super::connection::{truncate, ClientLimits, Connection, Phase};
use super::event::*;
use super::reason;
use super::topic::{validate_topic, TopicError};
use super::wire::{self, prop, Fault, Header, Reader, Value};
use crate::Secret;
use bytes::{BufMut, Bytes};
use mqttbytes::{v4, v5};

/// Longest reason string sent (MQTT allows 64 KiB; these are one-liners).
const MAX_REASON_STRING: usize = 256;

/// MQTT 5 CONNECT properties, as far as they matter here.
#[derive(Default)]
struct ConnectProps {
    session_expiry: u32,
    receive_maximum: Option<u16>,
    maximum_packet_size: Option<u32>,
    topic_alias_maximum: u16,
    request_response_information: bool,
    request_problem_information: bool,
    user_properties: Vec<(String, String)>,
    auth_method: bool,
    auth_data: bool,
}

impl Connection {
    /// The first packet. Errors before the protocol level is known close
    /// without an answer; after it, MQTT 5 answers with a CONNACK.
    pub(super) fn on_connect(&mut self, h: Header, packet: Bytes) -> Result<Option<Event>, Fault> {
        let body = packet.get(h.header_len..).unwrap_or_default();
        let mut r = Reader::new(body);
        let name = r.binary()?;
        let level = r.u8()?;
        match (name, level) {
            (b"MQTT", 4) => self.version = Some(Version::V311),
            (b"MQTT", 5) => self.version = Some(Version::V5),
            (b"MQTT", _) | (b"MQIsdp", _) => {
                // 3.1.1 3.1.2.2: return code 1, in the 3.1.1 layout, which
                // 3.1 clients read too (a client of another level may not
                // read an MQTT 5 CONNACK).
                let _ = v4::ConnAck::new(v4::ConnectReturnCode::RefusedProtocolVersion, false)
                    .write(&mut self.out);
                self.end(Fault::new(
                    reason::UNSUPPORTED_PROTOCOL_VERSION,
                    format!("unsupported protocol level {level}"),
                ));
                return Ok(None);
            }
            // 3.1.2.1: an unknown protocol name may be closed without CONNACK.
            _ => return Err(Fault::protocol("not an MQTT protocol name")),
        }
        let v5 = self.v5();
        let flags = r.u8()?;
        if flags & 0x01 != 0 {
            return Err(Fault::malformed("CONNECT reserved flag set"));
        }
        let clean_start = flags & 0x02 != 0;
        let will_flag = flags & 0x04 != 0;
        let will_qos = (flags >> 3) & 0x03;
        let will_retain = flags & 0x20 != 0;
        let has_password = flags & 0x40 != 0;
        let has_username = flags & 0x80 != 0;
        if !will_flag && (will_qos != 0 || will_retain) {
            return Err(Fault::malformed("will QoS or retain without a will"));
        }
        let will_qos = qos_from(will_qos).ok_or_else(|| Fault::malformed("will QoS 3"))?;
        if !v5 && has_password && !has_username {
            // 3.1.1 MQTT-3.1.2-22.
            return Err(Fault::protocol("password without user name"));
        }
        let keep_alive = r.u16()?;

        let mut props = ConnectProps {
            request_problem_information: true,
            ..ConnectProps::default()
        };
        if v5 {
            wire::props(&mut r, prop::CONNECT, "CONNECT", |id, v| {
                match (id, v) {
                    (prop::SESSION_EXPIRY, v) => props.session_expiry = v.int(),
                    (prop::RECEIVE_MAXIMUM, Value::Two(0)) => {
                        return Err(Fault::protocol("receive maximum 0"))
                    }
                    (prop::RECEIVE_MAXIMUM, Value::Two(n)) => props.receive_maximum = Some(n),
                    (prop::MAXIMUM_PACKET_SIZE, Value::Four(0)) => {
                        return Err(Fault::protocol("maximum packet size 0"))
                    }
                    (prop::MAXIMUM_PACKET_SIZE, Value::Four(n)) => {
                        props.maximum_packet_size = Some(n)
                    }
                    (prop::TOPIC_ALIAS_MAXIMUM, Value::Two(n)) => props.topic_alias_maximum = n,
                    (prop::REQUEST_RESPONSE_INFO, v) => {
                        props.request_response_information = v.int() == 1
                    }
                    (prop::REQUEST_PROBLEM_INFO, v) => {
                        props.request_problem_information = v.int() == 1
                    }
                    (prop::USER_PROPERTY, Value::Pair(k, v)) => {
                        props.user_properties.push((k.to_string(), v.to_string()))
                    }
                    (prop::AUTH_METHOD, _) => props.auth_method = true,
                    (prop::AUTH_DATA, _) => props.auth_data = true,
                    _ => {}
                }
                Ok(())
            })?;
        }
        // Limits that shape every later answer, known as early as possible.
        self.client = ClientLimits {
            receive_maximum: props.receive_maximum.unwrap_or(u16::MAX),
            maximum_packet_size: props.maximum_packet_size,
            topic_alias_maximum: props.topic_alias_maximum,
            keep_alive,
            clean_start,
            session_expiry_zero: props.session_expiry == 0,
            request_response_information: props.request_response_information,
        };
        let client_id = r.string()?.to_string();

        let will = if will_flag {
            let mut delay_secs = 0;
            let mut properties = MessageProperties::default();
            if v5 {
                wire::props(&mut r, prop::WILL, "will", |id, v| {
                    if id == prop::WILL_DELAY {
                        delay_secs = v.int();
                        return Ok(());
                    }
                    message_property(&mut properties, id, v)
                })?;
            }
            let topic = r.string()?.to_string();
            let payload = Bytes::copy_from_slice(r.binary()?);
            Some(Will {
                topic,
                payload,
                qos: will_qos,
                retain: will_retain,
                delay_secs,
                properties,
            })
        } else {
            None
        };
        let username = if has_username {
            Some(r.string()?.to_string())
        } else {
            None
        };
        let password = if has_password {
            Some(r.binary()?)
        } else {
            None
        };
        if !r.is_empty() {
            return Err(Fault::malformed("bytes after the CONNECT payload"));
        }

        // Well formed. Now what the server refuses.
        if props.auth_data && !props.auth_method {
            return Err(Fault::protocol("authentication data without a method"));
        }
        if props.auth_method {
            // Enhanced authentication (AUTH exchanges) is not supported.
            return Err(Fault::new(
                reason::BAD_AUTHENTICATION_METHOD,
                "enhanced authentication is not supported",
            ));
        }
        if client_id.is_empty() && !clean_start && !v5 {
            // 3.1.1 MQTT-3.1.3-8: return code 2.
            let _ =
                v4::ConnAck::new(v4::ConnectReturnCode::BadClientId, false).write(&mut self.out);
            self.end(Fault::new(
                reason::CLIENT_ID_NOT_VALID,
                "empty client identifier with clean session 0",
            ));
            return Ok(None);
        }
        if let Some(w) = &will {
            match validate_topic(&w.topic, self.config.max_topic_levels) {
                Ok(()) => {}
                Err(TopicError::Null) => {
                    return Err(Fault::malformed("will topic contains U+0000"))
                }
                Err(e) => {
                    return Err(Fault::new(
                        reason::TOPIC_NAME_INVALID,
                        format!("will topic: {e}"),
                    ))
                }
            }
            if w.qos > self.config.maximum_qos {
                return Err(Fault::new(
                    reason::QOS_NOT_SUPPORTED,
                    "will QoS not supported",
                ));
            }
            if w.retain && !self.config.retain_available {
                return Err(Fault::new(
                    reason::RETAIN_NOT_SUPPORTED,
                    "will retain not supported",
                ));
            }
        }
        let password = match password {
            None => None,
            Some(p) => match std::str::from_utf8(p) {
                Ok(s) => Some(Secret::new(s.to_string())),
                Err(_) => {
                    // Weir passwords are text: a binary one cannot match, and
                    // a lossy conversion could make two passwords equal.
                    return Err(Fault::new(
                        reason::BAD_USER_NAME_OR_PASSWORD,
                        "password is not UTF-8",
                    ));
                }
            },
        };

        self.phase = Phase::Connecting;
        let version = self.version.unwrap_or(Version::V311);
        Ok(Some(Event::Connect(Box::new(Connect {
            version,
            client_id,
            clean_start,
            keep_alive,
            username,
            password,
            will,
            session_expiry_secs: if v5 {
                props.session_expiry
            } else if clean_start {
                0
            } else {
                u32::MAX
            },
            receive_maximum: self.client.receive_maximum,
            maximum_packet_size: props.maximum_packet_size,
            topic_alias_maximum: props.topic_alias_maximum,
            request_response_information: props.request_response_information,
            request_problem_information: props.request_problem_information,
            user_properties: props.user_properties,
        }))))
    }

    /// CONNACK success.
    ///
    /// The keep-alive in force becomes `accept.server_keep_alive`, else
    /// [`super::ServerConfig::server_keep_alive`] when the client asked for
    /// none or a longer one (MQTT 5 only: 3.1.1 cannot be told), else the
    /// client's. `session_present` is sent as 0 after a clean start
    /// whatever the session says (MQTT-3.2.2-2). Ignored unless the
    /// connection waits for this answer.
    pub fn accept(&mut self, accept: ConnectAccept) {
        if self.phase != Phase::Connecting {
            return;
        }
        let session_present = accept.session_present && !self.client.clean_start;
        self.phase = Phase::Open;
        if !self.v5() {
            self.keep_alive = self.client.keep_alive;
            let _ = v4::ConnAck::new(v4::ConnectReturnCode::Success, session_present)
                .write(&mut self.out);
            return;
        }
        let client_ka = self.client.keep_alive;
        let server_ka = match (accept.server_keep_alive, self.config.server_keep_alive) {
            (Some(k), _) => Some(k),
            (None, Some(s)) if client_ka == 0 || client_ka > s => Some(s),
            _ => None,
        };
        self.keep_alive = server_ka.unwrap_or(client_ka);
        let c = &self.config;
        let mut p = v5::ConnAckProperties::new();
        p.session_expiry_interval = accept.session_expiry_secs;
        p.receive_max = Some(c.receive_maximum.max(1));
        p.max_packet_size = Some(c.maximum_packet_size);
        p.topic_alias_max = (c.topic_alias_maximum > 0).then_some(c.topic_alias_maximum);
        // Absent means 2; the value 2 itself is a protocol error (3.2.2.3.4).
        p.max_qos = (c.maximum_qos < QoS::ExactlyOnce).then_some(c.maximum_qos as u8);
        p.retain_available = Some(u8::from(c.retain_available));
        p.wildcard_subscription_available = Some(1);
        p.subscription_identifiers_available = Some(1);
        p.shared_subscription_available = Some(u8::from(c.shared_subscriptions));
        p.assigned_client_identifier = accept.assigned_client_id.map(cap_string);
        p.server_keep_alive = server_ka;
        p.response_information = accept
            .response_information
            .filter(|_| self.client.request_response_information)
            .map(cap_string);
        let _ = v5::ConnAck {
            session_present,
            code: v5::ConnectReturnCode::Success,
            properties: Some(p),
        }
        .write(&mut self.out);
    }

    /// CONNACK failure (with `text` as the MQTT 5 reason string); the
    /// connection then finishes. Ignored unless the connection waits for
    /// an answer to CONNECT.
    pub fn refuse(&mut self, refusal: ConnectRefusal, text: &str) {
        if self.phase != Phase::Connecting {
            return;
        }
        let (code, v4_code) = match refusal {
            ConnectRefusal::ClientIdNotValid => (
                reason::CLIENT_ID_NOT_VALID,
                v4::ConnectReturnCode::BadClientId,
            ),
            ConnectRefusal::BadUserNameOrPassword => (
                reason::BAD_USER_NAME_OR_PASSWORD,
                v4::ConnectReturnCode::BadUserNamePassword,
            ),
            ConnectRefusal::NotAuthorized => {
                (reason::NOT_AUTHORIZED, v4::ConnectReturnCode::NotAuthorized)
            }
            ConnectRefusal::ServerUnavailable => (
                reason::SERVER_UNAVAILABLE,
                v4::ConnectReturnCode::ServiceUnavailable,
            ),
            ConnectRefusal::ServerBusy => (
                reason::SERVER_BUSY,
                v4::ConnectReturnCode::ServiceUnavailable,
            ),
            ConnectRefusal::QuotaExceeded => (
                reason::QUOTA_EXCEEDED,
                v4::ConnectReturnCode::ServiceUnavailable,
            ),
            ConnectRefusal::BadAuthenticationMethod => (
                reason::BAD_AUTHENTICATION_METHOD,
                v4::ConnectReturnCode::BadUserNamePassword,
            ),
        };
        if self.v5() {
            self.write_connack_refusal(code, text);
        } else {
            let _ = v4::ConnAck::new(v4_code, false).write(&mut self.out);
        }
        self.finish();
    }

    /// Ends the connection from the server side: MQTT 5 sends DISCONNECT
    /// with `reason` and `text` (0x8E session taken over, 0x8B server
    /// shutting down, 0x97 quota exceeded, …); 3.1.1 just closes.
    ///
    /// While the CONNECT waits for its answer this is a refusal instead
    /// (MQTT 5 CONNACK with `reason` where CONNACK allows it, else 0x80;
    /// 3.1.1 return code 3, server unavailable). No event follows.
    pub fn disconnect(&mut self, reason: u8, text: &str) {
        match self.phase {
            Phase::Open if self.v5() => self.write_disconnect(reason, text),
            Phase::Connecting if self.v5() => self.write_connack_refusal(reason, text),
            Phase::Connecting => {
                let _ = v4::ConnAck::new(v4::ConnectReturnCode::ServiceUnavailable, false)
                    .write(&mut self.out);
            }
            _ => {}
        }
        self.finish();
    }

    /// DISCONNECT from the client.
    pub(super) fn on_disconnect(&mut self, body: &[u8]) -> Result<Option<Event>, Fault> {
        if !self.v5() {
            if !body.is_empty() {
                return Err(Fault::malformed("3.1.1 DISCONNECT with a body"));
            }
            self.finish();
            return Ok(Some(Event::Disconnect {
                publish_will: false,
                session_expiry_secs: None,
            }));
        }
        let mut r = Reader::new(body);
        // 3.14.2.1: no reason code means 0x00; no property length means none.
        let code = if r.is_empty() {
            reason::SUCCESS
        } else {
            r.u8()?
        };
        let mut session_expiry = None;
        if !r.is_empty() {
            wire::props(&mut r, prop::DISCONNECT, "DISCONNECT", |id, v| {
                if id == prop::SESSION_EXPIRY {
                    session_expiry = Some(v.int());
                }
                Ok(())
            })?;
        }
        if !r.is_empty() {
            return Err(Fault::malformed("bytes after the DISCONNECT properties"));
        }
        if self.client.session_expiry_zero && session_expiry.is_some_and(|s| s != 0) {
            // MQTT-3.14.2-2.
            return Err(Fault::protocol(
                "session expiry set in DISCONNECT after 0 in CONNECT",
            ));
        }
        self.finish();
        Ok(Some(Event::Disconnect {
            // 3.1.2.5: only a normal disconnection (0x00) discards the will.
            publish_will: code != reason::SUCCESS,
            session_expiry_secs: session_expiry,
        }))
    }

    /// An MQTT 5 DISCONNECT with `code` and, when it fits the client's
    /// maximum packet size, `text` as the reason string (3.14.2.2.3; always
    /// allowed on DISCONNECT, whatever request problem information says).
    ///
    /// Encoded here: mqttbytes writes a DISCONNECT whose remaining length
    /// is 2 (reason code and an empty property block) as `E0 00`, losing
    /// the reason code.
    pub(super) fn write_disconnect(&mut self, code: u8, text: &str) {
        let text = truncate(text, MAX_REASON_STRING);
        let with_text = 1 + 1 + 3 + text.len();
        let text = if !text.is_empty() && self.fits(with_text) {
            text
        } else {
            ""
        };
        let props_len = if text.is_empty() { 0 } else { 3 + text.len() };
        let remaining = 1 + wire::varint_len(props_len) + props_len;
        self.out.put_u8(0xE0);
        wire::put_varint(&mut self.out, remaining);
        self.out.put_u8(code);
        wire::put_varint(&mut self.out, props_len);
        if !text.is_empty() {
            self.out.put_u8(prop::REASON_STRING);
            // At most MAX_REASON_STRING bytes: the length fits.
            self.out.put_u16(text.len() as u16);
            self.out.put_slice(text.as_bytes());
        }
    }

    /// An MQTT 5 CONNACK with failure `code` (0x80 where CONNACK has no
    /// such code) and `text` as its reason string.
    pub(super) fn write_connack_refusal(&mut self, code: u8, text: &str) {
        let text = truncate(text, MAX_REASON_STRING);
        let mut p = v5::ConnAckProperties::new();
        if !text.is_empty() && self.fits(2 + 1 + 3 + text.len()) {
            p.reason_string = Some(text.to_string());
        }
        let _ = v5::ConnAck {
            session_present: false,
            code: connack_code(code),
            properties: Some(p),
        }
        .write(&mut self.out);
    }

    /// Whether a packet with this remaining length fits the client's
    /// maximum packet size.
    pub(super) fn fits(&self, remaining: usize) -> bool {
        let total = 1 + wire::varint_len(remaining) + remaining;
        self.client
            .maximum_packet_size
            .is_none_or(|max| total <= max as usize)
    }
}

/// Adds one MQTT 5 message property (PUBLISH or will) to `p`.
pub(super) fn message_property(
    p: &mut MessageProperties,
    id: u8,
    v: Value<'_>,
) -> Result<(), Fault> {
    match (id, v) {
        (prop::PAYLOAD_FORMAT, v) => p.payload_is_utf8 = Some(v.int() == 1),
        (prop::MESSAGE_EXPIRY, v) => p.message_expiry_secs = Some(v.int()),
        (prop::CONTENT_TYPE, Value::Str(s)) => p.content_type = Some(s.to_string()),
        (prop::RESPONSE_TOPIC, Value::Str(s)) => {
            // MQTT-3.3.2-14: a topic name, no wildcards.
            if s.is_empty() || s.contains(['+', '#']) {
                return Err(Fault::protocol("response topic is not a topic name"));
            }
            p.response_topic = Some(s.to_string());
        }
        (prop::CORRELATION_DATA, Value::Bin(b)) => {
            p.correlation_data = Some(Bytes::copy_from_slice(b))
        }
        (prop::USER_PROPERTY, Value::Pair(k, v)) => {
            p.user_properties.push((k.to_string(), v.to_string()))
        }
        _ => {}
    }
    Ok(())
}

pub(super) fn qos_from(v: u8) -> Option<QoS> {
    match v {
        0 => Some(QoS::AtMostOnce),
        1 => Some(QoS::AtLeastOnce),
        2 => Some(QoS::ExactlyOnce),
        _ => None,
    }
}

/// Strings from the session, cut to what a two-byte length can hold.
fn cap_string(s: String) -> String {
    if s.len() <= usize::from(u16::MAX) {
        return s;
    }
    truncate(&s, usize::from(u16::MAX)).to_string()
}

fn connack_code(code: u8) -> v5::ConnectReturnCode {
    use v5::ConnectReturnCode as C;
    match code {
        0x81 => C::MalformedPacket,
        0x82 => C::ProtocolError,
        0x83 => C::ImplementationSpecificError,
        0x84 => C::UnsupportedProtocolVersion,
        0x85 => C::ClientIdentifierNotValid,
        0x86 => C::BadUserNamePassword,
        0x87 => C::NotAuthorized,
        0x88 => C::ServerUnavailable,
        0x89 => C::ServerBusy,
        0x8A => C::Banned,
        0x8C => C::BadAuthenticationMethod,
        0x90 => C::TopicNameInvalid,
        0x95 => C::PacketTooLarge,
        0x97 => C::QuotaExceeded,
        0x99 => C::PayloadFormatInvalid,
        0x9A => C::RetainNotSupported,
        0x9B => C::QoSNotSupported,
        0x9C => C::UseAnotherServer,
        0x9D => C::ServerMoved,
        0x9F => C::ConnectionRateExceeded,
        _ => C::UnspecifiedError,
    }
}
