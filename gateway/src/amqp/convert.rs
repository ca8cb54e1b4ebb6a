//! Conversions between AMQP field tables and the engine's JSON arguments.

use crate::engine::exchange::HeaderLookup;
use serde_json::{Map, Number, Value};
use std::cell::OnceCell;
use weir_protocols::amqp::connection::parse_properties;
use weir_protocols::amqp::types::{AMQPValue, FieldTable};

/// A field table as a JSON object (types collapse to JSON's).
pub fn table_to_json(t: &FieldTable) -> Value {
    let mut m = Map::new();
    for (k, v) in t.inner() {
        m.insert(k.as_str().to_string(), value_to_json(v));
    }
    Value::Object(m)
}

fn value_to_json(v: &AMQPValue) -> Value {
    match v {
        AMQPValue::Boolean(b) => Value::Bool(*b),
        AMQPValue::ShortShortInt(i) => Value::from(*i),
        AMQPValue::ShortShortUInt(i) => Value::from(*i),
        AMQPValue::ShortInt(i) => Value::from(*i),
        AMQPValue::ShortUInt(i) => Value::from(*i),
        AMQPValue::LongInt(i) => Value::from(*i),
        AMQPValue::LongUInt(i) => Value::from(*i),
        AMQPValue::LongLongInt(i) => Value::from(*i),
        AMQPValue::Timestamp(i) => Value::from(*i),
        AMQPValue::Float(f) => Number::from_f64(*f as f64)
            .map(Value::Number)
            .unwrap_or(Value::Null),
        AMQPValue::Double(f) => Number::from_f64(*f)
            .map(Value::Number)
            .unwrap_or(Value::Null),
        AMQPValue::DecimalValue(d) => Number::from_f64(d.value as f64 / 10f64.powi(d.scale as i32))
            .map(Value::Number)
            .unwrap_or(Value::Null),
        AMQPValue::ShortString(s) => Value::String(s.as_str().to_string()),
        AMQPValue::LongString(s) => {
            Value::String(String::from_utf8_lossy(s.as_bytes()).into_owned())
        }
        AMQPValue::ByteArray(b) => {
            Value::String(String::from_utf8_lossy(b.as_slice()).into_owned())
        }
        AMQPValue::FieldArray(a) => Value::Array(a.as_slice().iter().map(value_to_json).collect()),
        AMQPValue::FieldTable(t) => table_to_json(t),
        AMQPValue::Void => Value::Null,
    }
}

/// Message headers, decoded from the raw property block only if a headers
/// exchange asks (most routes never look).
pub struct LazyHeaders<'a> {
    raw: &'a [u8],
    parsed: OnceCell<Option<Map<String, Value>>>,
}

impl<'a> LazyHeaders<'a> {
    /// Headers of the property block `raw`.
    pub fn new(raw: &'a [u8]) -> Self {
        LazyHeaders {
            raw,
            parsed: OnceCell::new(),
        }
    }
}

impl HeaderLookup for LazyHeaders<'_> {
    fn header(&self, name: &str) -> Option<Value> {
        self.parsed
            .get_or_init(|| {
                let props = parse_properties(self.raw)?;
                match table_to_json(props.headers().as_ref()?) {
                    Value::Object(m) => Some(m),
                    _ => None,
                }
            })
            .as_ref()?
            .get(name)
            .cloned()
    }
}
