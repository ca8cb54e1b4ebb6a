//! The model: a message's properties and headers in the engine's own terms,
//! whatever protocol published it.

use serde_json::Number;

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
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
