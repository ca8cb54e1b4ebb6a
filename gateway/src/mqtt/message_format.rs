//! MQTT ⇄ the engine: topics and routing keys, and MQTT's header format.
//!
//! # Topics
//!
//! MQTT publishes route through the tenant's `amq.topic` exchange, so MQTT
//! and AMQP clients meet there:
//!
//! | MQTT | AMQP 0-9-1 | |
//! |---|---|---|
//! | topic `sensors/7/temp` | routing key `sensors.7.temp` | [`topic_to_routing_key`] |
//! | topic `spBv1.0/g/n` | routing key `spBv1/0.g.n` | a `.` inside a level becomes `/` |
//! | filter `sensors/+/temp` | binding key `sensors.*.temp` | [`filter_to_binding_key`] |
//! | filter `sensors/#` | binding key `sensors.#` | |
//! | routing key `a.b/c` | topic `a/b.c` | [`routing_key_to_topic`]: the inverse |
//!
//! `/` and `.` swap, so the mapping is its own inverse and every topic
//! survives MQTT → AMQP → MQTT. *Difference from RabbitMQ:* its MQTT plugin
//! only turns `/` into `.` (and `.` back into `/`), so a `.` inside an MQTT
//! topic level becomes a level separator there and comes back as `/`
//! (RabbitMQ documents dotted MQTT topics as unsupported and special-cases
//! Sparkplug's `spBv1.0`). For topics without dots the two agree.
//!
//! Limits of the mapping: an MQTT filter level that is literally `*`
//! (allowed in MQTT) becomes AMQP's one-word wildcard; AMQP's `#` also
//! matches topics starting with `$`, which MQTT wildcards must not, so the
//! session checks deliveries with MQTT's own matching; an AMQP routing key
//! that is no valid MQTT topic name (empty, or containing `+`, `#` or NUL)
//! cannot be delivered to MQTT ([`ConvertError::InvalidTopic`]).
//!
//! # The MQTT header format ([`MQTT`], [`MqttCodec`])
//!
//! Registered by the gateway's composition root (`header_codecs.rs`) under
//! number 3; messages of other formats reach MQTT subscribers through the
//! registry (their codec decodes them to [`Properties`]), never through a
//! match on their format here.
//!
//! An MQTT publish is stored with its QoS, retain and DUP flags and its MQTT 5
//! properties in a compact encoding ([`MqttHeader`]): one flag byte, then
//! only what is present, so a 3.1.1 publish's header is one byte. An MQTT
//! subscriber reads it back without building [`Properties`] (the MQTT →
//! MQTT path); other protocols see it as [`Properties`]
//! ([`MqttHeader::to_properties`]):
//!
//! | MQTT | [`Properties`] (and AMQP 0-9-1 through its codec) |
//! |---|---|
//! | QoS 0 / QoS ≥ 1 | delivery mode transient / persistent |
//! | QoS | header `x-mqtt-publish-qos` (signed byte), as RabbitMQ's plugin up to 3.12 |
//! | DUP | header `x-mqtt-dup` (boolean), as RabbitMQ's plugin up to 3.12 |
//! | content type | content type |
//! | message expiry interval (s) | `ttl_ms` (AMQP `expiration`, ms) and `expires_at_ms` (deadline fixed at publish) |
//! | correlation data | correlation id (bytes; the AMQP codec moves one that is not UTF-8, or longer than 255, to header `x-correlation-id`) |
//! | response topic | reply-to, as a routing key ([`topic_to_routing_key`]) |
//! | user properties | headers, strings, in order, repeats kept |
//! | payload format indicator | `payload_utf8`, and header `x-mqtt-payload-format-indicator` (signed byte 0/1) for AMQP |
//! | retain flag | not shown to other protocols (RabbitMQ neither) |
//!
//! (RabbitMQ 3.13 stopped setting `x-mqtt-publish-qos` and `x-mqtt-dup` and
//! carries the response topic in a header `x-reply-to-topic`; Weir keeps
//! 3.12's headers and uses reply-to, and reads `x-reply-to-topic` too.)
//!
//! When the engine rewrites an MQTT message's header (dead-lettering adds
//! `x-death`, a redelivery `x-delivery-count`) it encodes [`Properties`]
//! through [`MqttCodec`], which keeps them whole: the flag byte, then the
//! engine's own encoding ([`Properties::encode`]). Such a rewritten copy
//! keeps its QoS (from `x-mqtt-publish-qos`) but not the retain flag or the
//! publisher's client id, which [`Properties`] has no place for.
//!
//! # Delivering to an MQTT subscriber ([`outbound`], [`outbound_retained`])
//!
//! Any message (MQTT, AMQP, the engine's format) becomes a topic, a payload,
//! [`MessageProperties`], its own QoS and retain flag:
//!
//! * QoS: an MQTT message's own; otherwise `x-mqtt-publish-qos` if the
//!   header is there (0–2), else persistent → 1, transient → 0 (the session
//!   sends the lower of this and the subscription's);
//! * retain: an MQTT message's flag as published (for retain-as-published);
//!   false for other protocols;
//! * message expiry: what is left of the message's own expiry at `now`
//!   (MQTT-3.3.2-6), rounded up to whole seconds; its deadline is its own
//!   (MQTT: fixed at publish; AMQP `expiration`: from enqueue), or the
//!   queue entry's when earlier (a queue TTL, or the deadline stored across
//!   a restart). A message without its own expiry gets none. Expired:
//!   [`Outbound::expired`], with an interval of 0 that must not be sent;
//! * AMQP properties: content type (or header `x-content-type`), reply-to
//!   (or header `x-reply-to` / `x-reply-to-topic`) → response topic through
//!   [`routing_key_to_topic`] (dropped if that is no valid topic name),
//!   correlation id (or header `x-correlation-id`) → correlation data;
//!   `payload_utf8` (or header `x-mqtt-payload-format-indicator`) → payload
//!   format indicator;
//! * headers → user properties, in order, as RabbitMQ converts them: strings
//!   as they are, integers and timestamps in decimal, floats, booleans as
//!   `true`/`false`, void as an empty string, decimals exactly; byte arrays,
//!   arrays and tables are dropped, and so is anything with a NUL or longer
//!   than 65,535 bytes (MQTT's string rules). The `x-mqtt-*` headers above
//!   are read, not passed on;
//! * other AMQP properties (message id, priority, timestamp, type, user id,
//!   app id, content encoding) have no MQTT form and are dropped, as
//!   RabbitMQ does.

use crate::engine::message::{Entry, Message};
use crate::engine::properties::{
    DeliveryMode, HeaderCodec, HeaderCodecs, HeaderFormat, MessageHeader, Properties,
    PropertiesError, Reader, Table, Value,
};
use crate::engine::retained::RetainedMessage;
use bytes::Bytes;
use weir_protocols::mqtt::{MessageProperties, Publish, QoS};

/// The header format of MQTT publishes ([`MqttHeader`]'s compact encoding).
/// Stored with every MQTT message; never another format's number.
pub const MQTT: HeaderFormat = HeaderFormat::new(3);

/// The header showing an MQTT message's QoS to other protocols.
pub const QOS_HEADER: &str = "x-mqtt-publish-qos";
/// The header showing an MQTT message's DUP flag to other protocols.
pub const DUP_HEADER: &str = "x-mqtt-dup";
/// The header showing an MQTT 5 payload format indicator to other protocols.
pub const PAYLOAD_FORMAT_HEADER: &str = "x-mqtt-payload-format-indicator";

/// The longest MQTT string or binary field.
const MQTT_MAX_STRING: usize = u16::MAX as usize;

/// `/` ⇄ `.`; every other character is kept.
fn swap_separators(s: &str) -> String {
    s.chars()
        .map(|c| match c {
            '/' => '.',
            '.' => '/',
            c => c,
        })
        .collect()
}

/// MQTT topic name → AMQP routing key: `/` → `.`, and a `.` inside a level
/// → `/` (see the module doc).
pub fn topic_to_routing_key(topic: &str) -> String {
    swap_separators(topic)
}

/// AMQP routing key → MQTT topic name: the inverse of
/// [`topic_to_routing_key`] (`.` → `/`, `/` → `.`).
pub fn routing_key_to_topic(key: &str) -> String {
    swap_separators(key)
}

/// MQTT topic filter → AMQP binding key: levels joined by `.`, `+` → `*`,
/// `#` → `#`, a `.` inside a level → `/`. A shared subscription's
/// `$share/group/` prefix is the caller's to strip first.
pub fn filter_to_binding_key(filter: &str) -> String {
    let mut out = String::with_capacity(filter.len());
    for (i, level) in filter.split('/').enumerate() {
        if i > 0 {
            out.push('.');
        }
        match level {
            "+" => out.push('*'),
            l => out.extend(l.chars().map(|c| if c == '.' { '/' } else { c })),
        }
    }
    out
}

/// Whether `t` may be sent as an MQTT topic name: not empty, no wildcard,
/// no NUL, at most 65,535 bytes.
fn is_valid_topic_name(t: &str) -> bool {
    !t.is_empty() && t.len() <= MQTT_MAX_STRING && !t.contains(['+', '#', '\0'])
}

/// Whether `s` may be sent as an MQTT UTF-8 string (no NUL, at most
/// 65,535 bytes).
fn is_valid_string(s: &str) -> bool {
    s.len() <= MQTT_MAX_STRING && !s.contains('\0')
}

// The flag byte of the MQTT header format.
const QOS_BITS: u8 = 0b11;
const F_RETAIN: u8 = 1 << 2;
const F_DUP: u8 = 1 << 3;
/// A property mask byte and the properties follow.
const F_PROPS: u8 = 1 << 4;
/// The publisher's client id follows (before the properties).
const F_PUBLISHER: u8 = 1 << 5;
/// The engine's [`Properties`] encoding follows (a rewritten header).
const F_NEUTRAL: u8 = 1 << 6;
const F_RESERVED: u8 = 1 << 7;

// The property mask, in encoding order.
const P_PAYLOAD_FORMAT: u8 = 1 << 0;
const P_EXPIRY: u8 = 1 << 1;
const P_CONTENT_TYPE: u8 = 1 << 2;
const P_RESPONSE_TOPIC: u8 = 1 << 3;
const P_CORRELATION: u8 = 1 << 4;
const P_USER: u8 = 1 << 5;
const P_KNOWN: u8 = (1 << 6) - 1;

fn qos_of(bits: u8) -> Result<QoS, PropertiesError> {
    match bits & QOS_BITS {
        0 => Ok(QoS::AtMostOnce),
        1 => Ok(QoS::AtLeastOnce),
        2 => Ok(QoS::ExactlyOnce),
        _ => Err(PropertiesError::Invalid("MQTT QoS")),
    }
}

/// An MQTT publish as stored ([`MQTT`]'s compact form).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MqttHeader {
    /// The QoS it was published with.
    pub qos: QoS,
    /// Its retain flag.
    pub retain: bool,
    /// Its DUP flag (the publisher resent it).
    pub dup: bool,
    /// The publishing client's id, when the session records it (for
    /// no-local subscriptions; see [`inbound`]).
    pub publisher: Option<String>,
    /// The expiry deadline, ms since the epoch, fixed at publish. Some
    /// whenever `properties.message_expiry_secs` is (the encoding keeps them
    /// together; `u64::MAX` if it was not given).
    pub expires_at_ms: Option<u64>,
    /// The MQTT 5 properties as published (empty for 3.1.1).
    pub properties: MessageProperties,
}

/// A header of [`MQTT`], parsed.
enum Parsed {
    /// A publish as the session stored it.
    Compact(MqttHeader),
    /// A header the engine rewrote: flags, then [`Properties`].
    Neutral {
        qos: QoS,
        retain: bool,
        properties: Properties,
    },
}

/// The MQTT field encodings over the engine's bounds-checked cursor.
trait MqttRead<'a> {
    fn u16_len(&mut self) -> Result<&'a [u8], PropertiesError>;
    fn string(&mut self) -> Result<String, PropertiesError>;
}

impl<'a> MqttRead<'a> for Reader<'a> {
    fn u16_len(&mut self) -> Result<&'a [u8], PropertiesError> {
        let n = u16::from_be_bytes(self.array()?) as usize;
        self.take(n)
    }
    fn string(&mut self) -> Result<String, PropertiesError> {
        std::str::from_utf8(self.u16_len()?)
            .map(str::to_owned)
            .map_err(|_| PropertiesError::InvalidUtf8)
    }
}

fn put_u16_len(out: &mut Vec<u8>, b: &[u8]) {
    out.extend_from_slice(&(b.len() as u16).to_be_bytes());
    out.extend_from_slice(b);
}

fn fits(b: &[u8]) -> bool {
    b.len() <= MQTT_MAX_STRING
}

impl MqttHeader {
    /// The header of a publish from the client. `publisher`: its client id,
    /// when a no-local subscription may need it (a session without one can
    /// pass None and save the bytes); `now_ms` fixes the expiry deadline.
    pub fn from_publish(p: &Publish, publisher: Option<&str>, now_ms: u64) -> MqttHeader {
        MqttHeader {
            qos: p.qos,
            retain: p.retain,
            dup: p.dup,
            publisher: publisher.map(str::to_owned),
            expires_at_ms: p
                .properties
                .message_expiry_secs
                .map(|s| now_ms.saturating_add(u64::from(s) * 1000)),
            properties: p.properties.clone(),
        }
    }

    /// Appends the compact encoding. Fields MQTT could not have carried (a
    /// string or binary over 65,535 bytes) are left out.
    pub fn encode(&self, out: &mut Vec<u8>) {
        let p = &self.properties;
        let publisher = self.publisher.as_deref().filter(|s| fits(s.as_bytes()));
        let content_type = p.content_type.as_deref().filter(|s| fits(s.as_bytes()));
        let response_topic = p.response_topic.as_deref().filter(|s| fits(s.as_bytes()));
        let correlation = p.correlation_data.as_deref().filter(|b| fits(b));
        let user: Vec<&(String, String)> = p
            .user_properties
            .iter()
            .filter(|(k, v)| fits(k.as_bytes()) && fits(v.as_bytes()))
            .collect();
        let mut mask = 0u8;
        for (present, bit) in [
            (p.payload_is_utf8.is_some(), P_PAYLOAD_FORMAT),
            (p.message_expiry_secs.is_some(), P_EXPIRY),
            (content_type.is_some(), P_CONTENT_TYPE),
            (response_topic.is_some(), P_RESPONSE_TOPIC),
            (correlation.is_some(), P_CORRELATION),
            (!user.is_empty(), P_USER),
        ] {
            if present {
                mask |= bit;
            }
        }
        let mut flags = self.qos as u8;
        if self.retain {
            flags |= F_RETAIN;
        }
        if self.dup {
            flags |= F_DUP;
        }
        if publisher.is_some() {
            flags |= F_PUBLISHER;
        }
        if mask != 0 {
            flags |= F_PROPS;
        }
        out.push(flags);
        if let Some(c) = publisher {
            put_u16_len(out, c.as_bytes());
        }
        if mask == 0 {
            return;
        }
        out.push(mask);
        if let Some(u) = p.payload_is_utf8 {
            out.push(u as u8);
        }
        if let Some(s) = p.message_expiry_secs {
            out.extend_from_slice(&s.to_be_bytes());
            out.extend_from_slice(&self.expires_at_ms.unwrap_or(u64::MAX).to_be_bytes());
        }
        if let Some(c) = content_type {
            put_u16_len(out, c.as_bytes());
        }
        if let Some(t) = response_topic {
            put_u16_len(out, t.as_bytes());
        }
        if let Some(c) = correlation {
            put_u16_len(out, c);
        }
        if !user.is_empty() {
            out.extend_from_slice(&(user.len() as u32).to_be_bytes());
            for (k, v) in user {
                put_u16_len(out, k.as_bytes());
                put_u16_len(out, v.as_bytes());
            }
        }
    }

    /// [`MqttHeader::encode`] into a new buffer.
    pub fn to_bytes(&self) -> Bytes {
        let mut out = Vec::with_capacity(1);
        self.encode(&mut out);
        Bytes::from(out)
    }

    /// As a [`MessageHeader`] of [`MQTT`].
    pub fn to_header(&self) -> MessageHeader {
        MessageHeader::new(MQTT, self.to_bytes())
    }

    /// Decodes [`MqttHeader::encode`]'s output; None for a header the
    /// engine rewrote (decode those with [`MqttCodec`]). Bounds-checked and
    /// strict: only the canonical encoding decodes.
    pub fn decode(raw: &[u8]) -> Result<Option<MqttHeader>, PropertiesError> {
        Ok(match parse(raw)? {
            Parsed::Compact(h) => Some(h),
            Parsed::Neutral { .. } => None,
        })
    }

    /// The header as [`Properties`] (see the module doc's table).
    pub fn to_properties(&self) -> Properties {
        let p = &self.properties;
        let mut headers = Table::new();
        for (k, v) in &p.user_properties {
            headers.push(k.clone(), Value::String(v.clone()));
        }
        // After the user properties: a lookup takes the last entry, so a
        // user property cannot pass for these.
        headers.push(QOS_HEADER, Value::I8(self.qos as i8));
        headers.push(DUP_HEADER, Value::Bool(self.dup));
        if let Some(u) = p.payload_is_utf8 {
            headers.push(PAYLOAD_FORMAT_HEADER, Value::I8(u as i8));
        }
        let ttl_ms = p.message_expiry_secs.map(|s| u64::from(s) * 1000);
        Properties {
            content_type: p.content_type.clone(),
            headers: Some(headers),
            delivery_mode: Some(if self.qos == QoS::AtMostOnce {
                DeliveryMode::Transient
            } else {
                DeliveryMode::Persistent
            }),
            correlation_id: p.correlation_data.as_ref().map(|c| c.to_vec()),
            reply_to: p.response_topic.as_deref().map(topic_to_routing_key),
            ttl_ms,
            expires_at_ms: ttl_ms.and(self.expires_at_ms),
            payload_utf8: p.payload_is_utf8,
            ..Properties::default()
        }
    }
}

fn parse(raw: &[u8]) -> Result<Parsed, PropertiesError> {
    let mut r = Reader::new(raw);
    let flags = r.u8().map_err(|_| PropertiesError::Empty)?;
    let qos = qos_of(flags)?;
    if flags & F_RESERVED != 0 {
        return Err(PropertiesError::Invalid("MQTT header flags"));
    }
    if flags & F_NEUTRAL != 0 {
        if flags & (F_PROPS | F_PUBLISHER | F_DUP) != 0 {
            return Err(PropertiesError::Invalid("MQTT header flags"));
        }
        return Ok(Parsed::Neutral {
            qos,
            retain: flags & F_RETAIN != 0,
            properties: Properties::decode(r.take(r.remaining())?)?,
        });
    }
    let mut h = MqttHeader {
        qos,
        retain: flags & F_RETAIN != 0,
        dup: flags & F_DUP != 0,
        publisher: None,
        expires_at_ms: None,
        properties: MessageProperties::default(),
    };
    if flags & F_PUBLISHER != 0 {
        h.publisher = Some(r.string()?);
    }
    if flags & F_PROPS != 0 {
        let mask = r.u8()?;
        if mask == 0 || mask & !P_KNOWN != 0 {
            return Err(PropertiesError::Invalid("MQTT property mask"));
        }
        let p = &mut h.properties;
        if mask & P_PAYLOAD_FORMAT != 0 {
            p.payload_is_utf8 = Some(match r.u8()? {
                0 => false,
                1 => true,
                _ => return Err(PropertiesError::Invalid("payload format indicator")),
            });
        }
        if mask & P_EXPIRY != 0 {
            p.message_expiry_secs = Some(u32::from_be_bytes(r.array()?));
            h.expires_at_ms = Some(u64::from_be_bytes(r.array()?));
        }
        if mask & P_CONTENT_TYPE != 0 {
            p.content_type = Some(r.string()?);
        }
        if mask & P_RESPONSE_TOPIC != 0 {
            p.response_topic = Some(r.string()?);
        }
        if mask & P_CORRELATION != 0 {
            p.correlation_data = Some(Bytes::copy_from_slice(r.u16_len()?));
        }
        if mask & P_USER != 0 {
            let n = u32::from_be_bytes(r.array()?) as usize;
            // Each pair takes at least its two lengths: nothing larger than
            // the input is allocated.
            if n == 0 {
                return Err(PropertiesError::Invalid("MQTT user property count"));
            }
            if n.saturating_mul(4) > r.remaining() {
                return Err(PropertiesError::Truncated);
            }
            let mut user = Vec::with_capacity(n);
            for _ in 0..n {
                let k = r.string()?;
                let v = r.string()?;
                user.push((k, v));
            }
            p.user_properties = user;
        }
    }
    if !r.is_empty() {
        return Err(PropertiesError::TrailingBytes(r.remaining()));
    }
    Ok(Parsed::Compact(h))
}

/// An integer header value (any integer type, or decimal digits in a
/// string, as RabbitMQ-era AMQP clients set `x-mqtt-publish-qos`).
fn int_of(v: &Value) -> Option<i64> {
    Some(match v {
        Value::I8(i) => i64::from(*i),
        Value::U8(i) => i64::from(*i),
        Value::I16(i) => i64::from(*i),
        Value::U16(i) => i64::from(*i),
        Value::I32(i) => i64::from(*i),
        Value::U32(i) => i64::from(*i),
        Value::I64(i) => *i,
        Value::U64(i) => i64::try_from(*i).ok()?,
        Value::Bool(b) => i64::from(*b),
        Value::String(s) => s.trim().parse().ok()?,
        _ => return None,
    })
}

fn qos_header(v: &Value) -> Option<QoS> {
    match int_of(v)? {
        0 => Some(QoS::AtMostOnce),
        1 => Some(QoS::AtLeastOnce),
        2 => Some(QoS::ExactlyOnce),
        _ => None,
    }
}

/// The QoS a neutral [`Properties`] stands for: `x-mqtt-publish-qos` if
/// valid, else persistent → 1, transient → 0.
fn qos_of_properties(p: &Properties) -> QoS {
    p.headers
        .as_ref()
        .and_then(|h| h.get(QOS_HEADER))
        .and_then(qos_header)
        .unwrap_or(if p.is_persistent() {
            QoS::AtLeastOnce
        } else {
            QoS::AtMostOnce
        })
}

/// The [`HeaderCodec`] of [`MQTT`].
#[derive(Clone, Copy, Debug, Default)]
pub struct MqttCodec;

impl HeaderCodec for MqttCodec {
    fn format(&self) -> HeaderFormat {
        MQTT
    }

    fn decode(&self, raw: &[u8]) -> Result<Properties, PropertiesError> {
        Ok(match parse(raw)? {
            Parsed::Compact(h) => h.to_properties(),
            Parsed::Neutral { properties, .. } => properties,
        })
    }

    /// Lossless: the flag byte (QoS from `x-mqtt-publish-qos` or the
    /// delivery mode, DUP dropped: the copy is a new message) and then
    /// `properties` in the engine's own encoding.
    fn encode(&self, properties: &Properties, out: &mut Vec<u8>) -> Result<(), PropertiesError> {
        let start = out.len();
        out.push(F_NEUTRAL | qos_of_properties(properties) as u8);
        properties.encode(out).inspect_err(|_| out.truncate(start))
    }
}

/// What a session needs to publish an MQTT message into the engine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Inbound {
    /// The routing key on `amq.topic` ([`topic_to_routing_key`]).
    pub routing_key: String,
    /// The header to store ([`MQTT`]).
    pub header: MessageHeader,
    /// Persistent (QoS ≥ 1): `Message::persistent`.
    pub persistent: bool,
    /// The message's own TTL in ms (message expiry interval × 1000):
    /// `Message::ttl_ms`, counted per queue from enqueue (at publish).
    pub ttl_ms: Option<u64>,
    /// The expiry deadline fixed at publish: for [`crate::engine::Tenant::retain`].
    pub expires_at_ms: Option<u64>,
}

/// Everything the engine needs of a client's publish. `publisher`: the
/// client id to record for no-local subscriptions (see
/// [`MqttHeader::from_publish`]).
pub fn inbound(p: &Publish, publisher: Option<&str>, now_ms: u64) -> Inbound {
    let h = MqttHeader::from_publish(p, publisher, now_ms);
    Inbound {
        routing_key: topic_to_routing_key(&p.topic),
        header: h.to_header(),
        persistent: p.qos != QoS::AtMostOnce,
        ttl_ms: p
            .properties
            .message_expiry_secs
            .map(|s| u64::from(s) * 1000),
        expires_at_ms: h.expires_at_ms,
    }
}

/// A message as an MQTT subscriber receives it (see the module doc).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Outbound {
    /// Its topic.
    pub topic: String,
    /// Its payload.
    pub payload: Bytes,
    /// Its own QoS (the session sends at most the subscription's).
    pub qos: QoS,
    /// Its retain flag as published (MQTT messages only): what
    /// retain-as-published forwards; the session sets 1 itself for retained
    /// messages sent at subscribe.
    pub retain: bool,
    /// MQTT 5 properties, the expiry interval counted down.
    pub properties: MessageProperties,
    /// The publishing client's id, if it was recorded (no-local).
    pub publisher: Option<String>,
    /// It expired before `now`: not to be sent (its expiry interval is 0).
    pub expired: bool,
}

/// Why a message cannot be delivered to an MQTT subscriber.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ConvertError {
    /// Its routing key maps to no valid MQTT topic name (empty, or with a
    /// wildcard or NUL): drop the delivery.
    #[error("routing key '{0}' is not a valid MQTT topic name")]
    InvalidTopic(String),
}

/// A delivered message (of any header format) for an MQTT subscriber:
/// `entry` is the delivery's queue entry (its enqueue time and deadline).
pub fn outbound(
    m: &Message,
    entry: &Entry,
    codecs: &HeaderCodecs,
    now_ms: u64,
) -> Result<Outbound, ConvertError> {
    let key = String::from_utf8_lossy(&m.routing_key);
    let topic = routing_key_to_topic(&key);
    if !is_valid_topic_name(&topic) {
        return Err(ConvertError::InvalidTopic(key.into_owned()));
    }
    let entry_deadline = (entry.expires_at_ms != 0).then_some(entry.expires_at_ms);
    Ok(convert(
        topic,
        m.header_format,
        &m.properties,
        m.body.clone(),
        m.persistent,
        entry.enqueued_ms,
        entry_deadline,
        codecs,
        now_ms,
    ))
}

/// A retained message for an MQTT subscriber (sent at subscribe: the
/// session sets the retain flag).
pub fn outbound_retained(
    r: &RetainedMessage,
    codecs: &HeaderCodecs,
    now_ms: u64,
) -> Result<Outbound, ConvertError> {
    if !is_valid_topic_name(&r.topic) {
        return Err(ConvertError::InvalidTopic(r.topic.clone()));
    }
    Ok(convert(
        r.topic.clone(),
        r.header.format,
        &r.header.raw,
        r.body.clone(),
        true,
        now_ms,
        r.expires_at_ms,
        codecs,
        now_ms,
    ))
}

#[allow(clippy::too_many_arguments)]
fn convert(
    topic: String,
    format: HeaderFormat,
    raw: &Bytes,
    payload: Bytes,
    persistent: bool,
    enqueued_ms: u64,
    entry_deadline: Option<u64>,
    codecs: &HeaderCodecs,
    now_ms: u64,
) -> Outbound {
    let parsed = if format == MQTT {
        parse(raw)
    } else {
        codecs
            .decode(format, raw)
            .map(|properties| Parsed::Neutral {
                qos: qos_of_properties(&properties),
                retain: false,
                properties,
            })
    };
    let parsed = parsed.unwrap_or_else(|e| {
        // Delivered without its properties rather than not at all.
        tracing::debug!(error = %e, ?format, "delivering to MQTT a message whose header cannot be decoded");
        Parsed::Neutral {
            qos: if persistent {
                QoS::AtLeastOnce
            } else {
                QoS::AtMostOnce
            },
            retain: false,
            properties: Properties::default(),
        }
    });
    let (qos, retain, mut properties, publisher, own_deadline) = match parsed {
        // The MQTT → MQTT path: no Properties built.
        Parsed::Compact(h) => {
            let deadline = h.properties.message_expiry_secs.and(h.expires_at_ms);
            (h.qos, h.retain, h.properties, h.publisher, deadline)
        }
        Parsed::Neutral {
            qos,
            retain,
            properties,
        } => {
            let deadline = properties.deadline_ms(enqueued_ms);
            (qos, retain, to_mqtt_properties(properties), None, deadline)
        }
    };
    // Only a message with its own expiry gets one, counted down to the
    // earlier of its own deadline and its queue entry's.
    let deadline = own_deadline.map(|d| entry_deadline.map_or(d, |e| d.min(e)));
    let expired = deadline.is_some_and(|d| d < now_ms);
    properties.message_expiry_secs = deadline.map(|d| {
        if expired {
            0
        } else {
            let secs = d.saturating_sub(now_ms).div_ceil(1000).max(1);
            u32::try_from(secs).unwrap_or(u32::MAX)
        }
    });
    Outbound {
        topic,
        payload,
        qos,
        retain,
        properties,
        publisher,
        expired,
    }
}

/// Removes every `name` entry of `headers`, returning the last one.
fn take(headers: &mut Table, name: &str) -> Option<Value> {
    let mut last = None;
    headers.0.retain_mut(|(k, v)| {
        if k == name {
            last = Some(std::mem::replace(v, Value::Void));
            false
        } else {
            true
        }
    });
    last
}

fn take_string(headers: &mut Table, name: &str) -> Option<String> {
    match take(headers, name)? {
        Value::String(s) => Some(s),
        Value::Bytes(b) => String::from_utf8(b).ok(),
        _ => None,
    }
}

/// An exact decimal: `value × 10^-scale`.
fn decimal_string(scale: u8, value: u32) -> String {
    let digits = value.to_string();
    let scale = usize::from(scale);
    if scale == 0 {
        return digits;
    }
    let padded = format!("{digits:0>width$}", width = scale + 1);
    let (int, frac) = padded.split_at(padded.len() - scale);
    format!("{int}.{frac}")
}

/// A header value as an MQTT user property value, as RabbitMQ converts
/// AMQP 0-9-1 headers; None for what has no string form.
fn user_property_value(v: &Value) -> Option<String> {
    Some(match v {
        Value::String(s) => s.clone(),
        Value::Void => String::new(),
        Value::Bool(b) => b.to_string(),
        Value::I8(i) => i.to_string(),
        Value::U8(i) => i.to_string(),
        Value::I16(i) => i.to_string(),
        Value::U16(i) => i.to_string(),
        Value::I32(i) => i.to_string(),
        Value::U32(i) => i.to_string(),
        Value::I64(i) => i.to_string(),
        Value::U64(i) | Value::Timestamp(i) => i.to_string(),
        Value::F32(f) => f.to_string(),
        Value::F64(f) => f.to_string(),
        Value::Decimal { scale, value } => decimal_string(*scale, *value),
        // Raw bytes are not UTF-8 text; nested values have no flat form.
        Value::Bytes(_) | Value::Array(_) | Value::Table(_) => return None,
    })
}

/// Any message's [`Properties`] as MQTT 5 properties (the expiry interval
/// is the caller's).
fn to_mqtt_properties(p: Properties) -> MessageProperties {
    let mut headers = p.headers.unwrap_or_default();
    take(&mut headers, QOS_HEADER);
    take(&mut headers, DUP_HEADER);
    let format = take(&mut headers, PAYLOAD_FORMAT_HEADER);
    let content_type = p
        .content_type
        .or_else(|| take_string(&mut headers, "x-content-type"))
        .filter(|s| is_valid_string(s));
    let correlation_data = p
        .correlation_id
        .or_else(|| match take(&mut headers, "x-correlation-id")? {
            Value::String(s) => Some(s.into_bytes()),
            Value::Bytes(b) => Some(b),
            _ => None,
        })
        .filter(|b| b.len() <= MQTT_MAX_STRING)
        .map(Bytes::from);
    let response_topic = p
        .reply_to
        .or_else(|| take_string(&mut headers, "x-reply-to"))
        .or_else(|| take_string(&mut headers, "x-reply-to-topic"))
        .map(|k| routing_key_to_topic(&k))
        .filter(|t| is_valid_topic_name(t));
    let payload_is_utf8 = p
        .payload_utf8
        .or_else(|| format.as_ref().and_then(int_of).map(|i| i == 1));
    let user_properties = headers
        .0
        .into_iter()
        .filter(|(k, _)| is_valid_string(k))
        .filter_map(|(k, v)| {
            let v = user_property_value(&v).filter(|v| is_valid_string(v))?;
            Some((k, v))
        })
        .collect();
    MessageProperties {
        payload_is_utf8,
        message_expiry_secs: None,
        content_type,
        response_topic,
        correlation_data,
        user_properties,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::amqp::headers::{amqp_to_properties, properties_to_amqp, AMQP_091};
    use crate::engine::exchange::topic_matches as amqp_matches;
    use crate::engine::retained::topic_matches as mqtt_matches;

    /// The gateway's registry, as the composition root builds it.
    fn codecs() -> HeaderCodecs {
        crate::header_codecs::registry()
    }

    /// xorshift64*: deterministic, seedable, no dependency.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }
        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }
        fn chance(&mut self, one_in: u64) -> bool {
            self.below(one_in) == 0
        }
        fn from(&mut self, alphabet: &[&str], max_len: u64) -> String {
            (0..self.below(max_len + 1))
                .map(|_| alphabet[self.below(alphabet.len() as u64) as usize])
                .collect()
        }
        fn text(&mut self) -> String {
            self.from(&["a", "é", "✓", " ", "z", "/", "."], 8)
        }
    }

    #[test]
    fn topics_map_as_documented() {
        for (topic, key) in [
            ("sensors/7/temp", "sensors.7.temp"),
            ("a", "a"),
            ("/a", ".a"),
            ("a/", "a."),
            ("a//b", "a..b"),
            ("spBv1.0/group/NBIRTH/node", "spBv1/0.group.NBIRTH.node"),
            ("v1.2", "v1/2"),
            ("$SYS/broker", "$SYS.broker"),
            ("a*b/é", "a*b.é"),
        ] {
            assert_eq!(topic_to_routing_key(topic), key, "{topic}");
            assert_eq!(routing_key_to_topic(key), topic, "{key}");
        }
        for (filter, key) in [
            ("sensors/+/temp", "sensors.*.temp"),
            ("sensors/#", "sensors.#"),
            ("#", "#"),
            ("+", "*"),
            ("+/+", "*.*"),
            ("/+", ".*"),
            ("spBv1.0/+/#", "spBv1/0.*.#"),
            ("a/b", "a.b"),
        ] {
            assert_eq!(filter_to_binding_key(filter), key, "{filter}");
        }
    }

    #[test]
    fn the_topic_mapping_is_reversible() {
        let mut r = Rng(7);
        for _ in 0..5_000 {
            let t = r.from(&["a", "b", "/", ".", "$", "é", "*"], 12);
            assert_eq!(routing_key_to_topic(&topic_to_routing_key(&t)), t);
        }
    }

    /// Through the mapping, AMQP topic matching agrees with MQTT's on every
    /// topic not starting with `$` (which MQTT wildcards exclude).
    #[test]
    fn amqp_routing_agrees_with_mqtt_matching() {
        let mut r = Rng(11);
        let levels = ["a", "b", "", "a.b", "c.d"];
        let mut checked = 0;
        for _ in 0..20_000 {
            let n = 1 + r.below(4);
            let topic: Vec<&str> = (0..n)
                .map(|_| levels[r.below(levels.len() as u64) as usize])
                .collect();
            let topic = topic.join("/");
            let m = 1 + r.below(4);
            let mut filter: Vec<&str> = (0..m)
                .map(|_| match r.below(4) {
                    0 => "+",
                    _ => levels[r.below(levels.len() as u64) as usize],
                })
                .collect();
            if r.chance(3) {
                filter.push("#");
            }
            let filter = filter.join("/");
            let key = topic_to_routing_key(&topic);
            let binding = filter_to_binding_key(&filter);
            let words: Vec<&str> = key.split('.').collect();
            let pattern: Vec<&str> = binding.split('.').collect();
            assert_eq!(
                amqp_matches(&pattern, &words),
                mqtt_matches(&filter, &topic),
                "filter {filter} topic {topic} (binding {binding}, key {key})"
            );
            checked += usize::from(mqtt_matches(&filter, &topic));
        }
        assert!(checked > 1_000, "enough matching pairs: {checked}");
        // `$` topics: AMQP's `#` and `*` match them, MQTT's wildcards not.
        assert!(amqp_matches(&["#"], &["$SYS", "x"]));
        assert!(!mqtt_matches("#", "$SYS/x"));
    }

    fn full_publish() -> Publish {
        Publish {
            topic: "home/kitchen.1/temp".into(),
            payload: Bytes::from_static(b"21.5"),
            qos: QoS::ExactlyOnce,
            retain: true,
            dup: true,
            packet_id: Some(7),
            properties: MessageProperties {
                payload_is_utf8: Some(true),
                message_expiry_secs: Some(60),
                content_type: Some("text/plain; charset=utf-8".into()),
                response_topic: Some("replies/client.7".into()),
                correlation_data: Some(Bytes::from_static(&[0xff, 0, 1, 2])),
                user_properties: vec![
                    ("unit".into(), "°C".into()),
                    ("k".into(), "first".into()),
                    ("k".into(), "second".into()),
                    ("empty".into(), String::new()),
                ],
            },
        }
    }

    const T0: u64 = 1_700_000_000_000;

    fn message(format: HeaderFormat, raw: Bytes, routing_key: &str, persistent: bool) -> Message {
        Message {
            id: 1,
            exchange: Bytes::from_static(b"amq.topic"),
            routing_key: Bytes::from(routing_key.to_owned()),
            properties: raw,
            body: Bytes::from_static(b"21.5"),
            header_format: format,
            persistent,
            priority: 0,
            ttl_ms: None,
        }
    }

    fn entry(enqueued_ms: u64, expires_at_ms: u64) -> Entry {
        Entry {
            seq: 0,
            id: 1,
            location: None,
            size: 4,
            redelivered: false,
            attempts: 0,
            priority: 0,
            enqueued_ms,
            expires_at_ms,
            message: None,
        }
    }

    #[test]
    fn compact_headers_round_trip_and_a_311_publish_is_one_byte() {
        let p = full_publish();
        let h = MqttHeader::from_publish(&p, Some("client-1"), T0);
        assert_eq!(h.expires_at_ms, Some(T0 + 60_000));
        let b = h.to_bytes();
        assert_eq!(MqttHeader::decode(&b).unwrap(), Some(h.clone()));
        let plain = Publish {
            properties: MessageProperties::default(),
            qos: QoS::AtLeastOnce,
            retain: false,
            dup: false,
            ..p
        };
        let b = MqttHeader::from_publish(&plain, None, T0).to_bytes();
        assert_eq!(&b[..], &[1]);
        let back = MqttHeader::decode(&b).unwrap().unwrap();
        assert_eq!(back.qos, QoS::AtLeastOnce);
        assert_eq!(back.properties, MessageProperties::default());
    }

    /// Garbage, truncations and bit flips of valid headers: never a panic;
    /// whatever decodes compactly re-encodes to the same bytes.
    #[test]
    fn garbage_never_panics_and_accepted_headers_are_canonical() {
        let mut r = Rng(42);
        let check = |b: &[u8]| {
            let _ = MqttCodec.decode(b);
            if let Ok(Some(h)) = MqttHeader::decode(b) {
                assert_eq!(&h.to_bytes()[..], b);
            }
        };
        for _ in 0..20_000 {
            let n = r.below(48) as usize;
            let g: Vec<u8> = (0..n).map(|_| r.next() as u8).collect();
            check(&g);
        }
        let valid = MqttHeader::from_publish(&full_publish(), Some("c"), T0).to_bytes();
        for cut in 0..valid.len() {
            assert!(MqttHeader::decode(&valid[..cut]).is_err(), "cut at {cut}");
        }
        for _ in 0..5_000 {
            let mut b = valid.to_vec();
            let i = r.below(b.len() as u64) as usize;
            b[i] ^= 1 << r.below(8);
            check(&b);
        }
        // A user-property count far beyond the input allocates nothing.
        let mut b = vec![F_PROPS, P_USER];
        b.extend_from_slice(&u32::MAX.to_be_bytes());
        assert_eq!(MqttHeader::decode(&b), Err(PropertiesError::Truncated));
        assert!(MqttHeader::decode(&[]).is_err());
        assert!(MqttHeader::decode(&[3]).is_err(), "QoS 3");
        assert!(MqttHeader::decode(&[F_PROPS, 0]).is_err(), "empty mask");
        assert!(MqttHeader::decode(&[0, 0]).is_err(), "trailing byte");
    }

    #[test]
    fn mqtt_headers_show_to_amqp_as_documented() {
        let p = full_publish();
        let inb = inbound(&p, Some("client-1"), T0);
        assert_eq!(inb.routing_key, "home.kitchen/1.temp");
        assert!(inb.persistent);
        assert_eq!(inb.ttl_ms, Some(60_000));
        assert_eq!(inb.expires_at_ms, Some(T0 + 60_000));
        let props = inb.header.properties(&codecs()).unwrap();
        assert_eq!(props.delivery_mode, Some(DeliveryMode::Persistent));
        assert_eq!(props.reply_to.as_deref(), Some("replies.client/7"));
        assert_eq!(props.ttl_ms, Some(60_000));
        assert_eq!(props.expires_at_ms, Some(T0 + 60_000));
        assert_eq!(props.payload_utf8, Some(true));
        assert_eq!(props.correlation_id, Some(vec![0xff, 0, 1, 2]));
        let amqp = inb.header.encode_as(AMQP_091, &codecs()).unwrap();
        let a = amqp_to_properties(&amqp).unwrap();
        assert_eq!(a.delivery_mode, Some(DeliveryMode::Persistent));
        assert_eq!(a.ttl_ms, Some(60_000), "expiration 60000");
        assert_eq!(a.content_type.as_deref(), Some("text/plain; charset=utf-8"));
        assert_eq!(a.reply_to.as_deref(), Some("replies.client/7"));
        assert_eq!(a.correlation_id, None, "not UTF-8: a header instead");
        let h = a.headers.unwrap();
        let names: Vec<&str> = h.iter().map(|(k, _)| k).collect();
        assert_eq!(
            names,
            [
                "unit",
                "k",
                "k",
                "empty",
                QOS_HEADER,
                DUP_HEADER,
                PAYLOAD_FORMAT_HEADER,
                "x-correlation-id"
            ]
        );
        assert_eq!(h.get("k"), Some(&Value::String("second".into())));
        assert_eq!(h.get(QOS_HEADER), Some(&Value::I8(2)));
        assert_eq!(h.get(DUP_HEADER), Some(&Value::Bool(true)));
        assert_eq!(h.get(PAYLOAD_FORMAT_HEADER), Some(&Value::I8(1)));
        assert_eq!(
            h.get("x-correlation-id"),
            Some(&Value::Bytes(vec![0xff, 0, 1, 2]))
        );
        // QoS 0: transient.
        let q0 = Publish {
            qos: QoS::AtMostOnce,
            ..full_publish()
        };
        let q0 = inbound(&q0, None, T0).header.properties(&codecs()).unwrap();
        assert_eq!(q0.delivery_mode, Some(DeliveryMode::Transient));
    }

    /// The expected delivery of `full_publish` at `now`, retain and DUP aside.
    fn expected(now: u64) -> MessageProperties {
        MessageProperties {
            message_expiry_secs: Some(((T0 + 60_000 - now).div_ceil(1000)) as u32),
            ..full_publish().properties
        }
    }

    #[test]
    fn mqtt_to_mqtt_keeps_everything() {
        let p = full_publish();
        let inb = inbound(&p, Some("client-1"), T0);
        let m = message(MQTT, inb.header.raw.clone(), &inb.routing_key, true);
        let out = outbound(&m, &entry(T0, T0 + 60_000), &codecs(), T0).unwrap();
        assert_eq!(
            out,
            Outbound {
                topic: p.topic.clone(),
                payload: p.payload.clone(),
                qos: QoS::ExactlyOnce,
                retain: true,
                properties: expected(T0),
                publisher: Some("client-1".into()),
                expired: false,
            }
        );
        // Counted down while it waits, rounded up.
        let later = outbound(&m, &entry(T0, T0 + 60_000), &codecs(), T0 + 10_500).unwrap();
        assert_eq!(later.properties.message_expiry_secs, Some(50));
        // At its deadline still 1 s; after it, expired.
        let at = outbound(&m, &entry(T0, 0), &codecs(), T0 + 60_000).unwrap();
        assert_eq!(at.properties.message_expiry_secs, Some(1));
        assert!(!at.expired);
        let after = outbound(&m, &entry(T0, 0), &codecs(), T0 + 60_001).unwrap();
        assert!(after.expired);
        assert_eq!(after.properties.message_expiry_secs, Some(0));
        // A queue TTL shorter than its own expiry counts too.
        let q = outbound(&m, &entry(T0, T0 + 5_000), &codecs(), T0).unwrap();
        assert_eq!(q.properties.message_expiry_secs, Some(5));
        // No expiry of its own: none forwarded, whatever the queue's TTL.
        let plain = Publish {
            properties: MessageProperties::default(),
            ..full_publish()
        };
        let inb = inbound(&plain, None, T0);
        let m = message(MQTT, inb.header.raw, &inb.routing_key, true);
        let out = outbound(&m, &entry(T0, T0 + 5_000), &codecs(), T0).unwrap();
        assert_eq!(out.properties, MessageProperties::default());
        assert_eq!(out.publisher, None);
    }

    #[test]
    fn mqtt_to_amqp_to_mqtt_round_trips_every_property() {
        let p = full_publish();
        let inb = inbound(&p, Some("client-1"), T0);
        let amqp = inb.header.encode_as(AMQP_091, &codecs()).unwrap();
        // An AMQP message with those properties (say, republished by an
        // AMQP client), enqueued at publish.
        let m = message(AMQP_091, amqp, &inb.routing_key, true);
        for now in [T0, T0 + 1, T0 + 30_000, T0 + 59_999] {
            let out = outbound(&m, &entry(T0, 0), &codecs(), now).unwrap();
            assert_eq!(out.topic, p.topic);
            assert_eq!(out.qos, QoS::ExactlyOnce, "through x-mqtt-publish-qos");
            assert_eq!(out.properties, expected(now), "at {now}");
            assert!(!out.retain && out.publisher.is_none());
        }
        // Through the engine's own format too (and the rewritten form).
        let weir = inb.header.encode_as(HeaderFormat::WEIR, &codecs()).unwrap();
        let m = message(HeaderFormat::WEIR, weir, &inb.routing_key, true);
        let out = outbound(&m, &entry(T0, 0), &codecs(), T0).unwrap();
        assert_eq!((out.qos, out.properties), (QoS::ExactlyOnce, expected(T0)));
        let props = inb.header.properties(&codecs()).unwrap();
        let mut neutral = Vec::new();
        MqttCodec.encode(&props, &mut neutral).unwrap();
        assert_eq!(MqttCodec.decode(&neutral).unwrap(), props, "lossless");
        assert_eq!(MqttHeader::decode(&neutral).unwrap(), None);
        let m = message(MQTT, Bytes::from(neutral), &inb.routing_key, true);
        let out = outbound(&m, &entry(T0, 0), &codecs(), T0).unwrap();
        assert_eq!((out.qos, out.properties), (QoS::ExactlyOnce, expected(T0)));
        // Random MQTT properties survive MQTT → AMQP → MQTT.
        let mut r = Rng(3);
        for _ in 0..2_000 {
            let mp = MessageProperties {
                payload_is_utf8: r.chance(2).then(|| r.chance(2)),
                message_expiry_secs: r.chance(2).then(|| r.below(100_000) as u32 + 1),
                content_type: r.chance(2).then(|| r.text()),
                response_topic: r
                    .chance(2)
                    .then(|| format!("r{}", r.text()))
                    .filter(|t| is_valid_topic_name(t)),
                correlation_data: r.chance(2).then(|| {
                    Bytes::from(
                        (0..r.below(300))
                            .map(|_| r.next() as u8)
                            .collect::<Vec<u8>>(),
                    )
                }),
                user_properties: (0..r.below(4))
                    .map(|_| (format!("k{}", r.text()), r.text()))
                    .collect(),
            };
            let qos = [QoS::AtMostOnce, QoS::AtLeastOnce, QoS::ExactlyOnce][r.below(3) as usize];
            let p = Publish {
                qos,
                properties: mp.clone(),
                ..full_publish()
            };
            let inb = inbound(&p, None, T0);
            let amqp = inb.header.encode_as(AMQP_091, &codecs()).unwrap();
            let m = message(AMQP_091, amqp, &inb.routing_key, qos != QoS::AtMostOnce);
            let out = outbound(&m, &entry(T0, 0), &codecs(), T0).unwrap();
            assert_eq!(out.qos, qos);
            assert_eq!(out.properties, mp);
        }
    }

    fn amqp_block(p: &Properties) -> Bytes {
        let mut out = Vec::new();
        properties_to_amqp(p, &mut out).unwrap();
        Bytes::from(out)
    }

    #[test]
    fn amqp_messages_reach_mqtt_as_documented() {
        let mut headers = Table::new();
        headers.push("s", Value::String("text".into()));
        headers.push("i", Value::I32(-5));
        headers.push("l", Value::I64(1 << 40));
        headers.push("b", Value::Bool(true));
        headers.push("v", Value::Void);
        headers.push("f", Value::F64(1.5));
        headers.push(
            "d",
            Value::Decimal {
                scale: 3,
                value: 42,
            },
        );
        headers.push("t", Value::Timestamp(1_700_000_000));
        headers.push("x", Value::Bytes(vec![1, 2]));
        headers.push("a", Value::Array(vec![Value::I8(1)]));
        headers.push("nested", Value::Table(Table::new()));
        headers.push("nul", Value::String("a\0b".into()));
        let p = Properties {
            content_type: Some("application/json".into()),
            content_encoding: Some("gzip".into()),
            headers: Some(headers),
            delivery_mode: Some(DeliveryMode::Persistent),
            priority: Some(5),
            correlation_id: Some(b"req-1".to_vec()),
            reply_to: Some("amq.gen-Xy".into()),
            ttl_ms: Some(5_000),
            message_id: Some("m-1".into()),
            timestamp: Some(1),
            kind: Some("k".into()),
            user_id: Some("guest".into()),
            app_id: Some("app".into()),
            ..Properties::default()
        };
        let m = message(AMQP_091, amqp_block(&p), "sensors.7.temp", true);
        let out = outbound(&m, &entry(T0, T0 + 5_000), &codecs(), T0 + 2_000).unwrap();
        assert_eq!(out.topic, "sensors/7/temp");
        assert_eq!(out.qos, QoS::AtLeastOnce, "persistent");
        assert!(!out.retain);
        let s = |a: &str, b: &str| (a.to_owned(), b.to_owned());
        assert_eq!(
            out.properties,
            MessageProperties {
                payload_is_utf8: None,
                message_expiry_secs: Some(3),
                content_type: Some("application/json".into()),
                response_topic: Some("amq/gen-Xy".into()),
                correlation_data: Some(Bytes::from_static(b"req-1")),
                user_properties: vec![
                    s("s", "text"),
                    s("i", "-5"),
                    s("l", "1099511627776"),
                    s("b", "true"),
                    s("v", ""),
                    s("f", "1.5"),
                    s("d", "0.042"),
                    s("t", "1700000000"),
                ],
            }
        );
        // Transient: QoS 0, unless the sender asked through the header.
        let mut t = Properties {
            delivery_mode: Some(DeliveryMode::Transient),
            ..Properties::default()
        };
        let m = message(AMQP_091, amqp_block(&t), "a", false);
        assert_eq!(
            outbound(&m, &entry(T0, 0), &codecs(), T0).unwrap().qos,
            QoS::AtMostOnce
        );
        let mut h = Table::new();
        h.push(QOS_HEADER, Value::I32(1));
        t.headers = Some(h);
        let m = message(AMQP_091, amqp_block(&t), "a", false);
        let out = outbound(&m, &entry(T0, 0), &codecs(), T0).unwrap();
        assert_eq!(out.qos, QoS::AtLeastOnce);
        assert!(out.properties.user_properties.is_empty());
        assert_eq!(out.properties.message_expiry_secs, None);
        // RabbitMQ 3.13's response-topic header, and overflow headers.
        let mut h = Table::new();
        h.push("x-reply-to-topic", Value::String("replies.a/b".into()));
        h.push("x-content-type", Value::String("c".into()));
        let t = Properties {
            headers: Some(h),
            ..Properties::default()
        };
        let m = message(AMQP_091, amqp_block(&t), "a", false);
        let out = outbound(&m, &entry(T0, 0), &codecs(), T0).unwrap();
        assert_eq!(
            out.properties.response_topic.as_deref(),
            Some("replies/a.b")
        );
        assert_eq!(out.properties.content_type.as_deref(), Some("c"));
        assert!(out.properties.user_properties.is_empty());
        // A reply-to that is no topic name is dropped.
        let t = Properties {
            reply_to: Some("a.#".into()),
            ..Properties::default()
        };
        let m = message(AMQP_091, amqp_block(&t), "a", false);
        let out = outbound(&m, &entry(T0, 0), &codecs(), T0).unwrap();
        assert_eq!(out.properties.response_topic, None);
    }

    #[test]
    fn routing_keys_that_are_no_topic_names_are_refused() {
        for key in ["", "a.#", "a.+", "a\0b"] {
            let m = message(AMQP_091, amqp_block(&Properties::default()), key, true);
            assert_eq!(
                outbound(&m, &entry(T0, 0), &codecs(), T0),
                Err(ConvertError::InvalidTopic(key.into()))
            );
        }
        // An undecodable header is delivered without properties.
        let m = message(AMQP_091, Bytes::from_static(&[0xff]), "a", true);
        let out = outbound(&m, &entry(T0, 0), &codecs(), T0).unwrap();
        assert_eq!(out.qos, QoS::AtLeastOnce);
        assert_eq!(out.properties, MessageProperties::default());
    }

    #[test]
    fn retained_messages_are_sent_with_their_remaining_expiry() {
        let p = full_publish();
        let inb = inbound(&p, Some("c"), T0);
        let r = RetainedMessage {
            topic: p.topic.clone(),
            header: inb.header,
            body: p.payload.clone(),
            expires_at_ms: inb.expires_at_ms,
        };
        let out = outbound_retained(&r, &codecs(), T0 + 20_000).unwrap();
        assert_eq!(out.topic, p.topic);
        assert_eq!(out.qos, QoS::ExactlyOnce);
        assert!(out.retain);
        assert_eq!(out.properties, expected(T0 + 20_000));
    }

    #[test]
    fn decimals_are_written_exactly() {
        assert_eq!(decimal_string(0, 42), "42");
        assert_eq!(decimal_string(2, 150), "1.50");
        assert_eq!(decimal_string(3, 42), "0.042");
        assert_eq!(decimal_string(1, 0), "0.0");
    }
}
