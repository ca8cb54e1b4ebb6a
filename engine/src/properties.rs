//! The protocol-neutral message model: a message's headers and properties as
//! the engine sees them, whatever protocol published it.
//!
//! # Two representations, one tag
//!
//! A stored or queued message keeps its header as **raw bytes plus a
//! [`HeaderFormat`] tag**:
//!
//! * [`HeaderFormat::Amqp091`]: AMQP 0-9-1's basic property block (flags and
//!   values) exactly as the publisher sent it. This is the fast path: an AMQP
//!   message delivered to an AMQP consumer is written to the socket as the
//!   same bytes, never decoded or re-encoded.
//! * [`HeaderFormat::Weir`]: [`Properties`] in this module's own compact
//!   binary encoding ([`Properties::encode`]/[`Properties::decode`]), used by
//!   every protocol that has no property block worth keeping (the native
//!   protocol, HTTP).
//! * [`HeaderFormat::Mqtt`]: an MQTT publish's QoS, retain flag and MQTT 5
//!   properties, compactly (a 3.1.1 publish's header is one byte); its
//!   codec is the MQTT adapter's.
//!
//! The engine never sees a wire format, so it cannot decode an AMQP block
//! itself: adapters register a [`HeaderCodec`] for their format in a
//! [`HeaderCodecs`] (the gateway's AMQP codec lives in
//! `gateway/src/amqp/convert.rs`), and the engine converts through it.
//!
//! # How it is meant to be used
//!
//! * **Publish**: the adapter hands the engine its raw header and format
//!   (AMQP: the property block slice it already owns; MQTT: the
//!   [`Properties`] it built, encoded once with [`Properties::encode`]).
//!   Nothing is decoded on publish unless a headers exchange asks
//!   ([`LazyLookup`] decodes once per publish, only the headers table, and
//!   only when a headers binding looks).
//! * **Store**: the record keeps the format byte ([`HeaderFormat::to_u8`])
//!   and the raw bytes. The store never interprets either.
//! * **Deliver**: the consumer's adapter asks for its own format.
//!   Same format: the raw bytes pass through ([`MessageHeader::encode_as`]
//!   returns the same `Bytes`, no copy). Another format: decode once to
//!   [`Properties`], encode once to the target; a [`ConversionCache`] keyed
//!   by (message id, target format) makes a message fanned out to many
//!   consumers of another protocol convert once, lazily, at its first
//!   delivery, not once per consumer.
//!
//! # Memory
//!
//! A queued message must not grow: `Message` should keep the format as one
//! flat `u8`-sized field next to `persistent` and `priority` (it fits in
//! their padding, so `size_of::<Message>()` is unchanged) and the raw bytes
//! in the `Bytes` it has today; a [`MessageHeader`] is built on demand (one
//! reference-count increment). The cache is bounded (a fixed number of
//! slots), never one entry per queued message.
//!
//! # Expiry
//!
//! AMQP's `expiration` is a relative TTL in milliseconds that RabbitMQ counts
//! per queue, from when the message entered it, and passes on unchanged to
//! consumers. MQTT 5's message expiry interval is a relative TTL in seconds
//! counted from publish, and a server must forward the interval *minus the
//! time the message waited*. So [`Properties`] keeps both: `ttl_ms` (relative,
//! as published) and `expires_at_ms` (an absolute deadline in ms since the
//! epoch, fixed when the message was accepted, by adapters whose protocol
//! counts from publish). [`Properties::deadline_ms`] combines them with the
//! entry's enqueue time.

use bytes::Bytes;
use parking_lot::Mutex;
use serde_json::Number;
use std::cell::OnceCell;
use std::sync::Arc;
use weir_backend::MessageId;

use crate::exchange::HeaderLookup;

/// Version byte leading every [`Properties::encode`] output.
pub const FORMAT_VERSION: u8 = 1;

/// Deepest nesting of tables and arrays accepted (the headers table itself is
/// level 1). The same limit as the AMQP adapter's, so any AMQP header it
/// accepted can be stored in this format.
pub const MAX_DEPTH: usize = 32;

/// How a message's raw header bytes are encoded. Stored as one byte in the
/// store's records ([`HeaderFormat::to_u8`]); values are never reused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum HeaderFormat {
    /// AMQP 0-9-1's basic property block (flags, then values), as published.
    Amqp091 = 1,
    /// [`Properties`] in this module's encoding ([`Properties::encode`]).
    Weir = 2,
    /// An MQTT publish's QoS, retain flag and MQTT 5 properties, in the
    /// MQTT adapter's compact encoding (its codec lives in the gateway,
    /// `gateway/src/mqtt/convert.rs`).
    Mqtt = 3,
}

impl HeaderFormat {
    /// The byte stored for this format.
    pub fn to_u8(self) -> u8 {
        self as u8
    }

    /// The format stored as `b`, if known.
    pub fn from_u8(b: u8) -> Result<Self, PropertiesError> {
        match b {
            1 => Ok(HeaderFormat::Amqp091),
            2 => Ok(HeaderFormat::Weir),
            3 => Ok(HeaderFormat::Mqtt),
            other => Err(PropertiesError::UnknownFormat(other)),
        }
    }
}

impl TryFrom<u8> for HeaderFormat {
    type Error = PropertiesError;
    fn try_from(b: u8) -> Result<Self, PropertiesError> {
        HeaderFormat::from_u8(b)
    }
}

impl From<HeaderFormat> for u8 {
    fn from(f: HeaderFormat) -> u8 {
        f.to_u8()
    }
}

/// Why header bytes could not be decoded or converted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PropertiesError {
    /// No bytes at all (not even the version).
    #[error("empty properties encoding")]
    Empty,
    /// A version this build does not know (written by a newer one).
    #[error("unknown properties encoding version {0}")]
    UnknownVersion(u8),
    /// A header-format byte this build does not know.
    #[error("unknown header format {0}")]
    UnknownFormat(u8),
    /// No codec registered for a format the conversion needs.
    #[error("no codec for header format {0:?}")]
    NoCodec(HeaderFormat),
    /// Ran off the end of the input.
    #[error("properties truncated")]
    Truncated,
    /// A length or integer that is overlong, overflows, or is not canonical.
    #[error("malformed variable-length integer")]
    BadVarint,
    /// A string that is not UTF-8.
    #[error("invalid UTF-8 in a string")]
    InvalidUtf8,
    /// A value type this build does not know.
    #[error("unknown value tag {0}")]
    UnknownTag(u8),
    /// A field whose value is out of range (names the field).
    #[error("invalid {0}")]
    Invalid(&'static str),
    /// Tables or arrays nested deeper than [`MAX_DEPTH`].
    #[error("tables or arrays nested deeper than {MAX_DEPTH}")]
    TooDeep,
    /// Bytes left after the last field.
    #[error("{0} trailing bytes after properties")]
    TrailingBytes(usize),
}

/// Whether a message survives a restart (when routed to a durable queue).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DeliveryMode {
    /// Kept in memory only (AMQP delivery-mode 1).
    Transient,
    /// Written to the store (AMQP delivery-mode 2).
    Persistent,
}

/// A typed value of a header (user property). Covers every AMQP 0-9-1
/// field-table type (RabbitMQ's set) and MQTT 5's string user properties.
#[derive(Clone, Debug)]
pub enum Value {
    /// No value (AMQP `V`).
    Void,
    /// A boolean.
    Bool(bool),
    /// Signed 8-bit integer.
    I8(i8),
    /// Unsigned 8-bit integer.
    U8(u8),
    /// Signed 16-bit integer.
    I16(i16),
    /// Unsigned 16-bit integer.
    U16(u16),
    /// Signed 32-bit integer.
    I32(i32),
    /// Unsigned 32-bit integer.
    U32(u32),
    /// Signed 64-bit integer.
    I64(i64),
    /// Unsigned 64-bit integer.
    U64(u64),
    /// IEEE 754 single precision (compared by bits: NaNs round-trip exactly).
    F32(f32),
    /// IEEE 754 double precision (compared by bits).
    F64(f64),
    /// `value × 10^-scale` (AMQP's decimal: an octet scale and a 32-bit value).
    Decimal {
        /// Number of decimal digits after the point.
        scale: u8,
        /// The unscaled value.
        value: u32,
    },
    /// A UTF-8 string.
    String(String),
    /// Arbitrary bytes.
    Bytes(Vec<u8>),
    /// Seconds since the Unix epoch (AMQP's timestamp).
    Timestamp(u64),
    /// An ordered list of values.
    Array(Vec<Value>),
    /// A nested table.
    Table(Table),
}

impl PartialEq for Value {
    fn eq(&self, other: &Value) -> bool {
        use Value::*;
        match (self, other) {
            (Void, Void) => true,
            (Bool(a), Bool(b)) => a == b,
            (I8(a), I8(b)) => a == b,
            (U8(a), U8(b)) => a == b,
            (I16(a), I16(b)) => a == b,
            (U16(a), U16(b)) => a == b,
            (I32(a), I32(b)) => a == b,
            (U32(a), U32(b)) => a == b,
            (I64(a), I64(b)) => a == b,
            (U64(a), U64(b)) => a == b,
            // Bits, not IEEE equality: "the same value came back".
            (F32(a), F32(b)) => a.to_bits() == b.to_bits(),
            (F64(a), F64(b)) => a.to_bits() == b.to_bits(),
            (
                Decimal { scale: s, value: v },
                Decimal {
                    scale: s2,
                    value: v2,
                },
            ) => s == s2 && v == v2,
            (String(a), String(b)) => a == b,
            (Bytes(a), Bytes(b)) => a == b,
            (Timestamp(a), Timestamp(b)) => a == b,
            (Array(a), Array(b)) => a == b,
            (Table(a), Table(b)) => a == b,
            _ => false,
        }
    }
}

impl Value {
    /// The value as JSON, the way headers-exchange bindings compare it
    /// (the same collapse as the AMQP adapter's `table_to_json`: integers
    /// and timestamps are numbers, floats and decimals `f64` numbers (null if
    /// not finite), bytes a lossy UTF-8 string, void null).
    pub fn to_json(&self) -> serde_json::Value {
        use serde_json::Value as J;
        match self {
            Value::Void => J::Null,
            Value::Bool(b) => J::Bool(*b),
            Value::I8(i) => J::from(*i),
            Value::U8(i) => J::from(*i),
            Value::I16(i) => J::from(*i),
            Value::U16(i) => J::from(*i),
            Value::I32(i) => J::from(*i),
            Value::U32(i) => J::from(*i),
            Value::I64(i) => J::from(*i),
            Value::U64(i) | Value::Timestamp(i) => J::from(*i),
            Value::F32(f) => Number::from_f64(*f as f64).map_or(J::Null, J::Number),
            Value::F64(f) => Number::from_f64(*f).map_or(J::Null, J::Number),
            Value::Decimal { scale, value } => {
                Number::from_f64(*value as f64 / 10f64.powi(*scale as i32))
                    .map_or(J::Null, J::Number)
            }
            Value::String(s) => J::String(s.clone()),
            Value::Bytes(b) => J::String(String::from_utf8_lossy(b).into_owned()),
            Value::Array(a) => J::Array(a.iter().map(Value::to_json).collect()),
            Value::Table(t) => t.to_json(),
        }
    }
}

/// An ordered table of named values. Keys may repeat (MQTT 5 user
/// properties are ordered, repeatable pairs; an AMQP table on the wire can
/// repeat a key too): order and repeats are kept. Lookups by name take the
/// **last** entry with that name, as a map built from the entries would.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Table(pub Vec<(String, Value)>);

impl Table {
    /// An empty table.
    pub fn new() -> Self {
        Table(Vec::new())
    }

    /// Appends an entry (an existing entry with the same name stays).
    pub fn push(&mut self, name: impl Into<String>, value: Value) {
        self.0.push((name.into(), value));
    }

    /// The last value named `name`.
    pub fn get(&self, name: &str) -> Option<&Value> {
        self.0.iter().rev().find(|(k, _)| k == name).map(|(_, v)| v)
    }

    /// The entries, in order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &Value)> {
        self.0.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// Number of entries (repeats included).
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether there are no entries.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The table as a JSON object (a repeated name keeps its last value).
    pub fn to_json(&self) -> serde_json::Value {
        let mut m = serde_json::Map::new();
        for (k, v) in &self.0 {
            m.insert(k.clone(), v.to_json());
        }
        serde_json::Value::Object(m)
    }
}

/// A message's headers and properties, in the engine's own terms. Every
/// field is optional: absent and present-but-empty are different things to
/// AMQP (and kept apart for exact round trips).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Properties {
    /// MIME content type (AMQP `content-type`, MQTT 5 Content Type).
    pub content_type: Option<String>,
    /// MIME content encoding (AMQP `content-encoding`).
    pub content_encoding: Option<String>,
    /// User properties (AMQP `headers`, MQTT 5 User Properties).
    pub headers: Option<Table>,
    /// Persistent or not (AMQP `delivery-mode`; MQTT has no equivalent: its
    /// adapter decides, e.g. persistent for QoS ≥ 1).
    pub delivery_mode: Option<DeliveryMode>,
    /// Priority (AMQP `priority`, 0–255 on the wire, 0–9 meaningful).
    pub priority: Option<u8>,
    /// Correlation id, as bytes (AMQP `correlation-id`, a short string;
    /// MQTT 5 Correlation Data, binary up to 64 KiB).
    pub correlation_id: Option<Vec<u8>>,
    /// Where to reply (AMQP `reply-to`; MQTT 5 Response Topic, which the MQTT
    /// adapter maps to and from its topic syntax).
    pub reply_to: Option<String>,
    /// Relative time to live in ms as published (AMQP `expiration`, MQTT 5
    /// Message Expiry Interval × 1000). See the module doc on expiry.
    pub ttl_ms: Option<u64>,
    /// Absolute deadline, ms since the Unix epoch, fixed when the message was
    /// accepted by a protocol whose TTL counts from publish (MQTT 5). None for
    /// AMQP messages: AMQP counts per queue, from enqueue.
    pub expires_at_ms: Option<u64>,
    /// Application message id (AMQP `message-id`).
    pub message_id: Option<String>,
    /// Seconds since the Unix epoch (AMQP `timestamp`).
    pub timestamp: Option<u64>,
    /// Message type name (AMQP `type`).
    pub kind: Option<String>,
    /// Authenticated publisher (AMQP `user-id`).
    pub user_id: Option<String>,
    /// Publishing application (AMQP `app-id`).
    pub app_id: Option<String>,
    /// AMQP's deprecated `cluster-id`, kept only so an AMQP block survives a
    /// round trip through this model unchanged.
    pub cluster_id: Option<String>,
    /// MQTT 5 Payload Format Indicator: `Some(true)` = UTF-8 text,
    /// `Some(false)` = unspecified bytes (sent explicitly), None = absent.
    pub payload_utf8: Option<bool>,
}

// Presence bits of the encoding, in field order.
const F_CONTENT_TYPE: u16 = 1 << 0;
const F_CONTENT_ENCODING: u16 = 1 << 1;
const F_HEADERS: u16 = 1 << 2;
const F_DELIVERY_MODE: u16 = 1 << 3;
const F_PRIORITY: u16 = 1 << 4;
const F_CORRELATION_ID: u16 = 1 << 5;
const F_REPLY_TO: u16 = 1 << 6;
const F_TTL: u16 = 1 << 7;
const F_EXPIRES_AT: u16 = 1 << 8;
const F_MESSAGE_ID: u16 = 1 << 9;
const F_TIMESTAMP: u16 = 1 << 10;
const F_KIND: u16 = 1 << 11;
const F_USER_ID: u16 = 1 << 12;
const F_APP_ID: u16 = 1 << 13;
const F_CLUSTER_ID: u16 = 1 << 14;
const F_PAYLOAD_UTF8: u16 = 1 << 15;

// Value tags of the encoding. Never renumbered; new types get new tags.
const T_VOID: u8 = 0;
const T_BOOL: u8 = 1;
const T_I8: u8 = 2;
const T_U8: u8 = 3;
const T_I16: u8 = 4;
const T_U16: u8 = 5;
const T_I32: u8 = 6;
const T_U32: u8 = 7;
const T_I64: u8 = 8;
const T_U64: u8 = 9;
const T_F32: u8 = 10;
const T_F64: u8 = 11;
const T_DECIMAL: u8 = 12;
const T_STRING: u8 = 13;
const T_BYTES: u8 = 14;
const T_TIMESTAMP: u8 = 15;
const T_ARRAY: u8 = 16;
const T_TABLE: u8 = 17;

impl Properties {
    /// Persistent (delivery mode 2 in AMQP terms).
    pub fn is_persistent(&self) -> bool {
        self.delivery_mode == Some(DeliveryMode::Persistent)
    }

    /// When the message expires (ms since the epoch) for an entry that
    /// entered its queue at `enqueued_ms`: the earlier of the absolute
    /// deadline and `enqueued_ms + ttl_ms`; None if it never expires.
    pub fn deadline_ms(&self, enqueued_ms: u64) -> Option<u64> {
        let relative = self.ttl_ms.map(|t| enqueued_ms.saturating_add(t));
        match (relative, self.expires_at_ms) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Time to live left at `now_ms` for an entry enqueued at `enqueued_ms`
    /// (what MQTT 5 forwards as the expiry interval); Some(0) once expired.
    pub fn remaining_ttl_ms(&self, enqueued_ms: u64, now_ms: u64) -> Option<u64> {
        self.deadline_ms(enqueued_ms)
            .map(|d| d.saturating_sub(now_ms))
    }

    /// Appends this in the store's encoding: a version byte
    /// ([`FORMAT_VERSION`]), a 16-bit little-endian presence mask, then each
    /// present field in order (strings and byte strings length-prefixed with
    /// a LEB128 varint; tables and arrays count-prefixed; values tagged).
    /// Fails only for tables nested deeper than [`MAX_DEPTH`], leaving `out`
    /// as it was.
    pub fn encode(&self, out: &mut Vec<u8>) -> Result<(), PropertiesError> {
        let start = out.len();
        let r = self.encode_inner(out);
        if r.is_err() {
            out.truncate(start);
        }
        r
    }

    /// [`Properties::encode`] into a new buffer.
    pub fn to_bytes(&self) -> Result<Bytes, PropertiesError> {
        let mut out = Vec::with_capacity(32);
        self.encode(&mut out)?;
        Ok(Bytes::from(out))
    }

    fn encode_inner(&self, out: &mut Vec<u8>) -> Result<(), PropertiesError> {
        out.push(FORMAT_VERSION);
        let mut flags = 0u16;
        let mut set = |present: bool, bit: u16| {
            if present {
                flags |= bit;
            }
        };
        set(self.content_type.is_some(), F_CONTENT_TYPE);
        set(self.content_encoding.is_some(), F_CONTENT_ENCODING);
        set(self.headers.is_some(), F_HEADERS);
        set(self.delivery_mode.is_some(), F_DELIVERY_MODE);
        set(self.priority.is_some(), F_PRIORITY);
        set(self.correlation_id.is_some(), F_CORRELATION_ID);
        set(self.reply_to.is_some(), F_REPLY_TO);
        set(self.ttl_ms.is_some(), F_TTL);
        set(self.expires_at_ms.is_some(), F_EXPIRES_AT);
        set(self.message_id.is_some(), F_MESSAGE_ID);
        set(self.timestamp.is_some(), F_TIMESTAMP);
        set(self.kind.is_some(), F_KIND);
        set(self.user_id.is_some(), F_USER_ID);
        set(self.app_id.is_some(), F_APP_ID);
        set(self.cluster_id.is_some(), F_CLUSTER_ID);
        set(self.payload_utf8.is_some(), F_PAYLOAD_UTF8);
        out.extend_from_slice(&flags.to_le_bytes());
        let put_str = |out: &mut Vec<u8>, s: &Option<String>| {
            if let Some(s) = s {
                put_bytes(out, s.as_bytes());
            }
        };
        put_str(out, &self.content_type);
        put_str(out, &self.content_encoding);
        if let Some(t) = &self.headers {
            put_table(out, t, 1)?;
        }
        if let Some(m) = self.delivery_mode {
            out.push(match m {
                DeliveryMode::Transient => 1,
                DeliveryMode::Persistent => 2,
            });
        }
        if let Some(p) = self.priority {
            out.push(p);
        }
        if let Some(c) = &self.correlation_id {
            put_bytes(out, c);
        }
        put_str(out, &self.reply_to);
        if let Some(t) = self.ttl_ms {
            put_varint(out, t);
        }
        if let Some(t) = self.expires_at_ms {
            put_varint(out, t);
        }
        put_str(out, &self.message_id);
        if let Some(t) = self.timestamp {
            put_varint(out, t);
        }
        put_str(out, &self.kind);
        put_str(out, &self.user_id);
        put_str(out, &self.app_id);
        put_str(out, &self.cluster_id);
        if let Some(u) = self.payload_utf8 {
            out.push(u as u8);
        }
        Ok(())
    }

    /// Decodes [`Properties::encode`]'s output. Bounds-checked and strict:
    /// every length is checked against the input before anything is
    /// allocated, nesting is limited to [`MAX_DEPTH`], and only the one
    /// canonical encoding of each value is accepted (so decoding then
    /// encoding gives back the input byte for byte).
    pub fn decode(b: &[u8]) -> Result<Properties, PropertiesError> {
        let (&version, rest) = b.split_first().ok_or(PropertiesError::Empty)?;
        if version != FORMAT_VERSION {
            return Err(PropertiesError::UnknownVersion(version));
        }
        let mut r = Reader { b: rest };
        let f = r.take(2)?;
        let flags = u16::from_le_bytes([f[0], f[1]]);
        let has = |bit: u16| flags & bit != 0;
        let mut p = Properties::default();
        if has(F_CONTENT_TYPE) {
            p.content_type = Some(r.string()?);
        }
        if has(F_CONTENT_ENCODING) {
            p.content_encoding = Some(r.string()?);
        }
        if has(F_HEADERS) {
            p.headers = Some(r.table(1)?);
        }
        if has(F_DELIVERY_MODE) {
            p.delivery_mode = Some(match r.u8()? {
                1 => DeliveryMode::Transient,
                2 => DeliveryMode::Persistent,
                _ => return Err(PropertiesError::Invalid("delivery mode")),
            });
        }
        if has(F_PRIORITY) {
            p.priority = Some(r.u8()?);
        }
        if has(F_CORRELATION_ID) {
            p.correlation_id = Some(r.bytes()?.to_vec());
        }
        if has(F_REPLY_TO) {
            p.reply_to = Some(r.string()?);
        }
        if has(F_TTL) {
            p.ttl_ms = Some(r.varint()?);
        }
        if has(F_EXPIRES_AT) {
            p.expires_at_ms = Some(r.varint()?);
        }
        if has(F_MESSAGE_ID) {
            p.message_id = Some(r.string()?);
        }
        if has(F_TIMESTAMP) {
            p.timestamp = Some(r.varint()?);
        }
        if has(F_KIND) {
            p.kind = Some(r.string()?);
        }
        if has(F_USER_ID) {
            p.user_id = Some(r.string()?);
        }
        if has(F_APP_ID) {
            p.app_id = Some(r.string()?);
        }
        if has(F_CLUSTER_ID) {
            p.cluster_id = Some(r.string()?);
        }
        if has(F_PAYLOAD_UTF8) {
            p.payload_utf8 = Some(match r.u8()? {
                0 => false,
                1 => true,
                _ => return Err(PropertiesError::Invalid("payload format indicator")),
            });
        }
        if !r.b.is_empty() {
            return Err(PropertiesError::TrailingBytes(r.b.len()));
        }
        Ok(p)
    }
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    put_varint(out, b.len() as u64);
    out.extend_from_slice(b);
}

fn put_table(out: &mut Vec<u8>, t: &Table, depth: usize) -> Result<(), PropertiesError> {
    if depth > MAX_DEPTH {
        return Err(PropertiesError::TooDeep);
    }
    put_varint(out, t.0.len() as u64);
    for (k, v) in &t.0 {
        put_bytes(out, k.as_bytes());
        put_value(out, v, depth)?;
    }
    Ok(())
}

/// `depth`: the nesting level of the container holding `v`.
fn put_value(out: &mut Vec<u8>, v: &Value, depth: usize) -> Result<(), PropertiesError> {
    match v {
        Value::Void => out.push(T_VOID),
        Value::Bool(b) => out.extend_from_slice(&[T_BOOL, *b as u8]),
        Value::I8(i) => out.extend_from_slice(&[T_I8, *i as u8]),
        Value::U8(i) => out.extend_from_slice(&[T_U8, *i]),
        Value::I16(i) => {
            out.push(T_I16);
            out.extend_from_slice(&i.to_le_bytes());
        }
        Value::U16(i) => {
            out.push(T_U16);
            out.extend_from_slice(&i.to_le_bytes());
        }
        Value::I32(i) => {
            out.push(T_I32);
            out.extend_from_slice(&i.to_le_bytes());
        }
        Value::U32(i) => {
            out.push(T_U32);
            out.extend_from_slice(&i.to_le_bytes());
        }
        Value::I64(i) => {
            out.push(T_I64);
            out.extend_from_slice(&i.to_le_bytes());
        }
        Value::U64(i) => {
            out.push(T_U64);
            out.extend_from_slice(&i.to_le_bytes());
        }
        Value::F32(f) => {
            out.push(T_F32);
            out.extend_from_slice(&f.to_bits().to_le_bytes());
        }
        Value::F64(f) => {
            out.push(T_F64);
            out.extend_from_slice(&f.to_bits().to_le_bytes());
        }
        Value::Decimal { scale, value } => {
            out.extend_from_slice(&[T_DECIMAL, *scale]);
            out.extend_from_slice(&value.to_le_bytes());
        }
        Value::String(s) => {
            out.push(T_STRING);
            put_bytes(out, s.as_bytes());
        }
        Value::Bytes(b) => {
            out.push(T_BYTES);
            put_bytes(out, b);
        }
        Value::Timestamp(t) => {
            out.push(T_TIMESTAMP);
            out.extend_from_slice(&t.to_le_bytes());
        }
        Value::Array(a) => {
            if depth + 1 > MAX_DEPTH {
                return Err(PropertiesError::TooDeep);
            }
            out.push(T_ARRAY);
            put_varint(out, a.len() as u64);
            for v in a {
                put_value(out, v, depth + 1)?;
            }
        }
        Value::Table(t) => {
            out.push(T_TABLE);
            put_table(out, t, depth + 1)?;
        }
    }
    Ok(())
}

/// A bounds-checked cursor over bytes: every read that runs past the end is
/// [`PropertiesError::Truncated`]. The store encoding here and the
/// adapters' header codecs read with it.
pub struct Reader<'a> {
    b: &'a [u8],
}

impl<'a> Reader<'a> {
    /// A cursor at the start of `b`.
    pub fn new(b: &'a [u8]) -> Self {
        Reader { b }
    }

    /// Whether every byte was read.
    pub fn is_empty(&self) -> bool {
        self.b.is_empty()
    }

    /// Bytes not read yet.
    pub fn remaining(&self) -> usize {
        self.b.len()
    }

    /// The next `n` bytes.
    pub fn take(&mut self, n: usize) -> Result<&'a [u8], PropertiesError> {
        if self.b.len() < n {
            return Err(PropertiesError::Truncated);
        }
        let (h, t) = self.b.split_at(n);
        self.b = t;
        Ok(h)
    }

    /// The next `N` bytes as an array.
    pub fn array<const N: usize>(&mut self) -> Result<[u8; N], PropertiesError> {
        let s = self.take(N)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    /// The next byte.
    pub fn u8(&mut self) -> Result<u8, PropertiesError> {
        Ok(self.take(1)?[0])
    }

    /// LEB128, at most 10 bytes, canonical (no trailing zero groups).
    fn varint(&mut self) -> Result<u64, PropertiesError> {
        let mut v = 0u64;
        for i in 0..10 {
            let byte = self.u8()?;
            let group = (byte & 0x7f) as u64;
            if i == 9 && group > 1 {
                return Err(PropertiesError::BadVarint);
            }
            v |= group << (7 * i);
            if byte & 0x80 == 0 {
                if i > 0 && byte == 0 {
                    return Err(PropertiesError::BadVarint);
                }
                return Ok(v);
            }
        }
        Err(PropertiesError::BadVarint)
    }

    /// A count or length, checked against what is left: each counted item
    /// takes at least `min_item` bytes, so nothing larger than the input
    /// itself is ever allocated.
    fn count(&mut self, min_item: usize) -> Result<usize, PropertiesError> {
        let n = self.varint()?;
        let n = usize::try_from(n).map_err(|_| PropertiesError::Truncated)?;
        if n.saturating_mul(min_item) > self.b.len() {
            return Err(PropertiesError::Truncated);
        }
        Ok(n)
    }

    fn bytes(&mut self) -> Result<&'a [u8], PropertiesError> {
        let n = self.count(1)?;
        self.take(n)
    }

    fn string(&mut self) -> Result<String, PropertiesError> {
        let b = self.bytes()?;
        std::str::from_utf8(b)
            .map(str::to_owned)
            .map_err(|_| PropertiesError::InvalidUtf8)
    }

    fn table(&mut self, depth: usize) -> Result<Table, PropertiesError> {
        if depth > MAX_DEPTH {
            return Err(PropertiesError::TooDeep);
        }
        // An entry is at least a key length byte and a tag.
        let n = self.count(2)?;
        let mut t = Vec::with_capacity(n);
        for _ in 0..n {
            let k = self.string()?;
            let v = self.value(depth)?;
            t.push((k, v));
        }
        Ok(Table(t))
    }

    fn value(&mut self, depth: usize) -> Result<Value, PropertiesError> {
        Ok(match self.u8()? {
            T_VOID => Value::Void,
            T_BOOL => match self.u8()? {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                _ => return Err(PropertiesError::Invalid("boolean")),
            },
            T_I8 => Value::I8(self.u8()? as i8),
            T_U8 => Value::U8(self.u8()?),
            T_I16 => Value::I16(i16::from_le_bytes(self.array()?)),
            T_U16 => Value::U16(u16::from_le_bytes(self.array()?)),
            T_I32 => Value::I32(i32::from_le_bytes(self.array()?)),
            T_U32 => Value::U32(u32::from_le_bytes(self.array()?)),
            T_I64 => Value::I64(i64::from_le_bytes(self.array()?)),
            T_U64 => Value::U64(u64::from_le_bytes(self.array()?)),
            T_F32 => Value::F32(f32::from_bits(u32::from_le_bytes(self.array()?))),
            T_F64 => Value::F64(f64::from_bits(u64::from_le_bytes(self.array()?))),
            T_DECIMAL => {
                let scale = self.u8()?;
                Value::Decimal {
                    scale,
                    value: u32::from_le_bytes(self.array()?),
                }
            }
            T_STRING => Value::String(self.string()?),
            T_BYTES => Value::Bytes(self.bytes()?.to_vec()),
            T_TIMESTAMP => Value::Timestamp(u64::from_le_bytes(self.array()?)),
            T_ARRAY => {
                if depth + 1 > MAX_DEPTH {
                    return Err(PropertiesError::TooDeep);
                }
                let n = self.count(1)?;
                let mut a = Vec::with_capacity(n);
                for _ in 0..n {
                    a.push(self.value(depth + 1)?);
                }
                Value::Array(a)
            }
            T_TABLE => Value::Table(self.table(depth + 1)?),
            other => return Err(PropertiesError::UnknownTag(other)),
        })
    }
}

impl HeaderLookup for Properties {
    fn header(&self, name: &str) -> Option<serde_json::Value> {
        self.headers.as_ref()?.get(name).map(Value::to_json)
    }
}

/// Decodes and encodes one format's raw header bytes. Implemented by the
/// adapter that owns the format (the engine knows only [`HeaderFormat::Weir`]).
pub trait HeaderCodec: Send + Sync {
    /// The format this codec reads and writes.
    fn format(&self) -> HeaderFormat;

    /// Raw bytes → [`Properties`].
    fn decode(&self, raw: &[u8]) -> Result<Properties, PropertiesError>;

    /// Only the headers table (for headers-exchange routing); codecs that can
    /// skip the other fields override this.
    fn headers(&self, raw: &[u8]) -> Result<Option<Table>, PropertiesError> {
        Ok(self.decode(raw)?.headers)
    }

    /// [`Properties`] → raw bytes, appended to `out`.
    fn encode(&self, properties: &Properties, out: &mut Vec<u8>) -> Result<(), PropertiesError>;
}

/// The codec of [`HeaderFormat::Weir`]: [`Properties::encode`]/[`Properties::decode`].
#[derive(Clone, Copy, Debug, Default)]
pub struct WeirCodec;

impl HeaderCodec for WeirCodec {
    fn format(&self) -> HeaderFormat {
        HeaderFormat::Weir
    }
    fn decode(&self, raw: &[u8]) -> Result<Properties, PropertiesError> {
        Properties::decode(raw)
    }
    fn encode(&self, properties: &Properties, out: &mut Vec<u8>) -> Result<(), PropertiesError> {
        properties.encode(out)
    }
}

/// The codecs available to convert between header formats: the engine's own
/// ([`WeirCodec`]) plus whatever the adapters register.
#[derive(Clone)]
pub struct HeaderCodecs {
    codecs: Vec<Arc<dyn HeaderCodec>>,
}

impl Default for HeaderCodecs {
    fn default() -> Self {
        HeaderCodecs::new()
    }
}

impl std::fmt::Debug for HeaderCodecs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.codecs.iter().map(|c| c.format()))
            .finish()
    }
}

impl HeaderCodecs {
    /// Only [`WeirCodec`].
    pub fn new() -> Self {
        HeaderCodecs {
            codecs: vec![Arc::new(WeirCodec)],
        }
    }

    /// Adds `codec`, replacing any codec registered for its format.
    pub fn with(mut self, codec: Arc<dyn HeaderCodec>) -> Self {
        self.codecs.retain(|c| c.format() != codec.format());
        self.codecs.push(codec);
        self
    }

    /// The codec for `format`.
    pub fn get(&self, format: HeaderFormat) -> Result<&dyn HeaderCodec, PropertiesError> {
        self.codecs
            .iter()
            .find(|c| c.format() == format)
            .map(|c| c.as_ref())
            .ok_or(PropertiesError::NoCodec(format))
    }

    /// Decodes `raw` of `format`.
    pub fn decode(&self, format: HeaderFormat, raw: &[u8]) -> Result<Properties, PropertiesError> {
        self.get(format)?.decode(raw)
    }

    /// `raw` of `format` as `target`: the same bytes (no copy) when the
    /// formats match, else decoded and re-encoded once.
    pub fn convert(
        &self,
        format: HeaderFormat,
        raw: &Bytes,
        target: HeaderFormat,
    ) -> Result<Bytes, PropertiesError> {
        if format == target {
            return Ok(raw.clone());
        }
        let target = self.get(target)?;
        let p = self.decode(format, raw)?;
        let mut out = Vec::with_capacity(raw.len() + 16);
        target.encode(&p, &mut out)?;
        Ok(Bytes::from(out))
    }
}

/// A message's raw header and its format: what the store keeps and what a
/// delivery carries. See the module doc for how `Message` holds it without
/// growing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MessageHeader {
    /// How `raw` is encoded.
    pub format: HeaderFormat,
    /// The encoded header.
    pub raw: Bytes,
}

impl MessageHeader {
    /// A header of `format`.
    pub fn new(format: HeaderFormat, raw: Bytes) -> Self {
        MessageHeader { format, raw }
    }

    /// `properties` in the engine's own format.
    pub fn from_properties(properties: &Properties) -> Result<Self, PropertiesError> {
        Ok(MessageHeader {
            format: HeaderFormat::Weir,
            raw: properties.to_bytes()?,
        })
    }

    /// The decoded properties (through the codec of this header's format).
    pub fn properties(&self, codecs: &HeaderCodecs) -> Result<Properties, PropertiesError> {
        codecs.decode(self.format, &self.raw)
    }

    /// The raw header as `target` expects it: the same bytes when the
    /// formats match (the AMQP → AMQP fast path), else converted.
    pub fn encode_as(
        &self,
        target: HeaderFormat,
        codecs: &HeaderCodecs,
    ) -> Result<Bytes, PropertiesError> {
        codecs.convert(self.format, &self.raw, target)
    }

    /// A header lookup for headers exchanges, decoding only if asked.
    pub fn lookup<'a>(&'a self, codecs: &'a HeaderCodecs) -> LazyLookup<'a> {
        LazyLookup::new(self.format, &self.raw, codecs)
    }
}

/// Headers of a raw header of any format, decoded (headers table only) the
/// first time a headers exchange asks, at most once; most routes never look.
/// An undecodable header has no headers.
pub struct LazyLookup<'a> {
    format: HeaderFormat,
    raw: &'a [u8],
    codecs: &'a HeaderCodecs,
    parsed: OnceCell<Option<Table>>,
}

impl<'a> LazyLookup<'a> {
    /// The headers of `raw`, encoded as `format`.
    pub fn new(format: HeaderFormat, raw: &'a [u8], codecs: &'a HeaderCodecs) -> Self {
        LazyLookup {
            format,
            raw,
            codecs,
            parsed: OnceCell::new(),
        }
    }
}

impl HeaderLookup for LazyLookup<'_> {
    fn header(&self, name: &str) -> Option<serde_json::Value> {
        self.parsed
            .get_or_init(|| {
                self.codecs
                    .get(self.format)
                    .and_then(|c| c.headers(self.raw))
                    .ok()
                    .flatten()
            })
            .as_ref()?
            .get(name)
            .map(Value::to_json)
    }
}

/// Converted headers of recently delivered messages, so a message fanned out
/// to many consumers of another protocol is converted once, not once per
/// consumer. Direct-mapped by (message id, target format): a fixed number of
/// slots, each one lock; a collision just converts again. Message ids are
/// never reused by a store, so a hit is always the same message.
pub struct ConversionCache {
    slots: Box<[Slot]>,
}

/// One cached conversion: message id, target format, converted bytes.
type Slot = Mutex<Option<(MessageId, HeaderFormat, Bytes)>>;

impl ConversionCache {
    /// A cache of `slots` entries (at least 1).
    pub fn new(slots: usize) -> Self {
        ConversionCache {
            slots: (0..slots.max(1)).map(|_| Mutex::new(None)).collect(),
        }
    }

    /// The header of message `id` (`raw` in `format`) as `target` expects it.
    /// Same format: `raw` itself, the cache is not touched.
    pub fn convert(
        &self,
        id: MessageId,
        format: HeaderFormat,
        raw: &Bytes,
        target: HeaderFormat,
        codecs: &HeaderCodecs,
    ) -> Result<Bytes, PropertiesError> {
        if format == target {
            return Ok(raw.clone());
        }
        // Consecutive ids spread over consecutive slots; the target format
        // offsets the slot so two targets of one message do not evict each other.
        let slot = &self.slots[(id as usize).wrapping_add(target as usize) % self.slots.len()];
        if let Some((i, t, b)) = &*slot.lock() {
            if *i == id && *t == target {
                return Ok(b.clone());
            }
        }
        // Converted outside the lock: a racing delivery converts too, harmlessly.
        let b = codecs.convert(format, raw, target)?;
        *slot.lock() = Some((id, target, b.clone()));
        Ok(b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        fn string(&mut self) -> String {
            let n = self.below(12);
            (0..n)
                .map(|_| match self.below(4) {
                    0 => 'é',
                    1 => '✓',
                    _ => (b'a' + self.below(26) as u8) as char,
                })
                .collect()
        }
        fn bytes(&mut self) -> Vec<u8> {
            let n = self.below(12);
            (0..n).map(|_| self.next() as u8).collect()
        }
        fn opt_string(&mut self) -> Option<String> {
            self.chance(2).then(|| self.string())
        }
    }

    fn random_value(r: &mut Rng, depth: usize) -> Value {
        let kinds = if depth >= 4 { 16 } else { 18 };
        match r.below(kinds) {
            0 => Value::Void,
            1 => Value::Bool(r.chance(2)),
            2 => Value::I8(r.next() as i8),
            3 => Value::U8(r.next() as u8),
            4 => Value::I16(r.next() as i16),
            5 => Value::U16(r.next() as u16),
            6 => Value::I32(r.next() as i32),
            7 => Value::U32(r.next() as u32),
            8 => Value::I64(r.next() as i64),
            9 => Value::U64(r.next()),
            // Any bit pattern, NaNs and infinities included.
            10 => Value::F32(f32::from_bits(r.next() as u32)),
            11 => Value::F64(f64::from_bits(r.next())),
            12 => Value::Decimal {
                scale: r.next() as u8,
                value: r.next() as u32,
            },
            13 => Value::String(r.string()),
            14 => Value::Bytes(r.bytes()),
            15 => Value::Timestamp(r.next()),
            16 => Value::Array(
                (0..r.below(4))
                    .map(|_| random_value(r, depth + 1))
                    .collect(),
            ),
            _ => Value::Table(random_table(r, depth + 1)),
        }
    }

    fn random_table(r: &mut Rng, depth: usize) -> Table {
        let mut t = Table::new();
        for _ in 0..r.below(5) {
            // Few distinct keys, so repeats happen.
            let k = if r.chance(3) {
                "dup".into()
            } else {
                r.string()
            };
            t.push(k, random_value(r, depth));
        }
        t
    }

    fn random_properties(r: &mut Rng) -> Properties {
        let num = |r: &mut Rng| {
            r.chance(2).then(|| match r.below(3) {
                0 => r.below(200),
                1 => u64::MAX,
                _ => r.next(),
            })
        };
        Properties {
            content_type: r.opt_string(),
            content_encoding: r.opt_string(),
            headers: r.chance(2).then(|| random_table(r, 1)),
            delivery_mode: r.chance(2).then(|| {
                if r.chance(2) {
                    DeliveryMode::Persistent
                } else {
                    DeliveryMode::Transient
                }
            }),
            priority: r.chance(2).then(|| r.next() as u8),
            correlation_id: r.chance(2).then(|| r.bytes()),
            reply_to: r.opt_string(),
            ttl_ms: num(r),
            expires_at_ms: num(r),
            message_id: r.opt_string(),
            timestamp: num(r),
            kind: r.opt_string(),
            user_id: r.opt_string(),
            app_id: r.opt_string(),
            cluster_id: r.opt_string(),
            payload_utf8: r.chance(2).then(|| r.chance(2)),
        }
    }

    #[test]
    fn randomized_round_trip() {
        let mut r = Rng(0x9e37_79b9_7f4a_7c15);
        for _ in 0..5_000 {
            let p = random_properties(&mut r);
            let b = p.to_bytes().expect("within depth");
            let back = Properties::decode(&b).expect("decodes");
            assert_eq!(back, p);
            // Canonical: re-encoding gives the same bytes.
            assert_eq!(back.to_bytes().unwrap(), b);
        }
    }

    #[test]
    fn empty_properties_are_three_bytes() {
        let b = Properties::default().to_bytes().unwrap();
        assert_eq!(&b[..], &[FORMAT_VERSION, 0, 0]);
        assert_eq!(Properties::decode(&b).unwrap(), Properties::default());
    }

    /// Garbage, truncations and single-byte corruptions of valid encodings:
    /// never a panic; whatever decodes re-encodes to the same bytes.
    #[test]
    fn garbage_never_panics_and_accepted_input_is_canonical() {
        let mut r = Rng(42);
        let check = |b: &[u8]| {
            if let Ok(p) = Properties::decode(b) {
                assert_eq!(&p.to_bytes().unwrap()[..], b);
            }
        };
        for _ in 0..20_000 {
            let n = r.below(64) as usize;
            let mut g: Vec<u8> = (0..n).map(|_| r.next() as u8).collect();
            if let Some(first) = g.first_mut() {
                // Mostly the right version, so the fields get exercised.
                if !r.chance(8) {
                    *first = FORMAT_VERSION;
                }
            }
            check(&g);
        }
        for _ in 0..500 {
            let valid = random_properties(&mut r).to_bytes().unwrap();
            for cut in 0..valid.len() {
                assert!(Properties::decode(&valid[..cut]).is_err());
            }
            for _ in 0..20 {
                let mut b = valid.to_vec();
                let i = r.below(b.len() as u64) as usize;
                b[i] ^= 1 << r.below(8);
                check(&b);
            }
        }
    }

    #[test]
    fn hostile_lengths_and_nesting_are_refused_without_allocating() {
        // Headers present, table count = u64::MAX-ish.
        let mut b = vec![FORMAT_VERSION];
        b.extend_from_slice(&F_HEADERS.to_le_bytes());
        put_varint(&mut b, u64::MAX);
        assert_eq!(Properties::decode(&b), Err(PropertiesError::Truncated));
        // A string claiming 4 GiB.
        let mut b = vec![FORMAT_VERSION];
        b.extend_from_slice(&F_CONTENT_TYPE.to_le_bytes());
        put_varint(&mut b, 1 << 32);
        assert_eq!(Properties::decode(&b), Err(PropertiesError::Truncated));
        // Overlong and overflowing varints.
        let mut b = vec![FORMAT_VERSION];
        b.extend_from_slice(&F_TTL.to_le_bytes());
        b.extend_from_slice(&[0x80, 0x00]);
        assert_eq!(Properties::decode(&b), Err(PropertiesError::BadVarint));
        let mut b = vec![FORMAT_VERSION];
        b.extend_from_slice(&F_TTL.to_le_bytes());
        b.extend_from_slice(&[0xff; 10]);
        assert_eq!(Properties::decode(&b), Err(PropertiesError::BadVarint));
        // 10,000 nested arrays: refused at MAX_DEPTH, no stack overflow.
        let mut b = vec![FORMAT_VERSION];
        b.extend_from_slice(&F_HEADERS.to_le_bytes());
        b.extend_from_slice(&[1, 1, b'k']);
        for _ in 0..10_000 {
            b.extend_from_slice(&[T_ARRAY, 1]);
        }
        b.push(T_VOID);
        assert_eq!(Properties::decode(&b), Err(PropertiesError::TooDeep));
        // Unknown version, tag, trailing bytes.
        assert_eq!(
            Properties::decode(&[9, 0, 0]),
            Err(PropertiesError::UnknownVersion(9))
        );
        assert_eq!(Properties::decode(&[]), Err(PropertiesError::Empty));
        assert_eq!(
            Properties::decode(&[FORMAT_VERSION, 0, 0, 7]),
            Err(PropertiesError::TrailingBytes(1))
        );
        let mut b = vec![FORMAT_VERSION];
        b.extend_from_slice(&F_HEADERS.to_le_bytes());
        b.extend_from_slice(&[1, 1, b'k', 99]);
        assert_eq!(Properties::decode(&b), Err(PropertiesError::UnknownTag(99)));
    }

    fn nested(levels: usize) -> Value {
        let mut v = Value::Void;
        for _ in 0..levels {
            v = Value::Array(vec![v]);
        }
        v
    }

    #[test]
    fn depth_limit_is_the_same_on_both_sides() {
        // Headers table is level 1; MAX_DEPTH - 1 arrays inside reach the limit.
        let at_limit = Properties {
            headers: Some(Table(vec![("k".into(), nested(MAX_DEPTH - 1))])),
            ..Default::default()
        };
        let b = at_limit.to_bytes().expect("at the limit encodes");
        assert_eq!(Properties::decode(&b).unwrap(), at_limit);
        let over = Properties {
            headers: Some(Table(vec![("k".into(), nested(MAX_DEPTH))])),
            ..Default::default()
        };
        let mut out = vec![0xaa];
        assert_eq!(over.encode(&mut out), Err(PropertiesError::TooDeep));
        assert_eq!(
            out,
            vec![0xaa],
            "a failed encode leaves the buffer as it was"
        );
    }

    #[test]
    fn header_format_bytes_are_fixed() {
        assert_eq!(HeaderFormat::Amqp091.to_u8(), 1);
        assert_eq!(HeaderFormat::Weir.to_u8(), 2);
        assert_eq!(HeaderFormat::Mqtt.to_u8(), 3);
        for b in 0..=255u8 {
            match HeaderFormat::try_from(b) {
                Ok(f) => assert_eq!(f.to_u8(), b),
                Err(e) => assert_eq!(e, PropertiesError::UnknownFormat(b)),
            }
        }
        assert_eq!(std::mem::size_of::<HeaderFormat>(), 1);
    }

    #[test]
    fn expiry_combines_ttl_and_deadline() {
        let mut p = Properties::default();
        assert_eq!(p.deadline_ms(1_000), None);
        p.ttl_ms = Some(500);
        assert_eq!(p.deadline_ms(1_000), Some(1_500));
        assert_eq!(p.remaining_ttl_ms(1_000, 1_200), Some(300));
        assert_eq!(p.remaining_ttl_ms(1_000, 9_000), Some(0));
        p.expires_at_ms = Some(1_100);
        assert_eq!(p.deadline_ms(1_000), Some(1_100));
        p.ttl_ms = None;
        assert_eq!(p.deadline_ms(5), Some(1_100));
        p.ttl_ms = Some(u64::MAX);
        assert_eq!(p.deadline_ms(5), Some(1_100));
    }

    #[test]
    fn header_lookup_takes_the_last_repeat_and_collapses_to_json() {
        let mut t = Table::new();
        t.push("a", Value::String("first".into()));
        t.push("n", Value::U8(7));
        t.push("a", Value::String("second".into()));
        t.push("f", Value::F64(f64::NAN));
        t.push(
            "d",
            Value::Decimal {
                scale: 2,
                value: 150,
            },
        );
        t.push("x", Value::Bytes(b"hi".to_vec()));
        let p = Properties {
            headers: Some(t),
            ..Default::default()
        };
        assert_eq!(p.header("a"), Some(serde_json::json!("second")));
        assert_eq!(p.header("n"), Some(serde_json::json!(7)));
        assert_eq!(p.header("f"), Some(serde_json::Value::Null));
        assert_eq!(p.header("d"), Some(serde_json::json!(1.5)));
        assert_eq!(p.header("x"), Some(serde_json::json!("hi")));
        assert_eq!(p.header("missing"), None);
        // Through the lazy lookup of a stored header too.
        let codecs = HeaderCodecs::new();
        let h = MessageHeader::from_properties(&p).unwrap();
        assert_eq!(
            h.lookup(&codecs).header("a"),
            Some(serde_json::json!("second"))
        );
        let garbage = MessageHeader::new(HeaderFormat::Weir, Bytes::from_static(&[1, 4]));
        assert_eq!(garbage.lookup(&codecs).header("a"), None);
    }

    /// A stand-in foreign codec: "raw" is the Weir encoding behind one byte.
    struct Prefixed;
    impl HeaderCodec for Prefixed {
        fn format(&self) -> HeaderFormat {
            HeaderFormat::Amqp091
        }
        fn decode(&self, raw: &[u8]) -> Result<Properties, PropertiesError> {
            Properties::decode(raw.get(1..).ok_or(PropertiesError::Truncated)?)
        }
        fn encode(&self, p: &Properties, out: &mut Vec<u8>) -> Result<(), PropertiesError> {
            out.push(0xee);
            p.encode(out)
        }
    }

    #[test]
    fn same_format_passes_through_and_others_convert_once() {
        let p = Properties {
            message_id: Some("m1".into()),
            ..Default::default()
        };
        let weir = MessageHeader::from_properties(&p).unwrap();
        // Without a codec for the target: a typed error.
        assert_eq!(
            weir.encode_as(HeaderFormat::Amqp091, &HeaderCodecs::new()),
            Err(PropertiesError::NoCodec(HeaderFormat::Amqp091))
        );
        let codecs = HeaderCodecs::new().with(Arc::new(Prefixed));
        let same = weir.encode_as(HeaderFormat::Weir, &codecs).unwrap();
        assert_eq!(same.as_ptr(), weir.raw.as_ptr(), "same format: no copy");
        let foreign = weir.encode_as(HeaderFormat::Amqp091, &codecs).unwrap();
        assert_eq!(foreign[0], 0xee);
        let back = MessageHeader::new(HeaderFormat::Amqp091, foreign);
        assert_eq!(back.properties(&codecs).unwrap(), p);

        let cache = ConversionCache::new(8);
        let a = cache
            .convert(
                7,
                HeaderFormat::Weir,
                &weir.raw,
                HeaderFormat::Amqp091,
                &codecs,
            )
            .unwrap();
        let b = cache
            .convert(
                7,
                HeaderFormat::Weir,
                &weir.raw,
                HeaderFormat::Amqp091,
                &codecs,
            )
            .unwrap();
        assert_eq!(
            a.as_ptr(),
            b.as_ptr(),
            "second delivery reuses the conversion"
        );
        let c = cache
            .convert(
                7,
                HeaderFormat::Weir,
                &weir.raw,
                HeaderFormat::Weir,
                &codecs,
            )
            .unwrap();
        assert_eq!(c.as_ptr(), weir.raw.as_ptr());
    }
}
