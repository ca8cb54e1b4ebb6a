//! TEMPORARY (lead's stub, replaced by the support helper's module at merge).

use crate::engine::message::Message;
use crate::engine::properties::{HeaderCodecs, HeaderFormat, Properties, Table, Value};
use bytes::Bytes;
use weir_protocols::mqtt::{MessageProperties, Publish, QoS};

/// MQTT topic → AMQP routing key.
pub fn topic_to_routing_key(topic: &str) -> String {
    topic.chars().map(|c| match c { '/' => '.', '.' => '/', c => c }).collect()
}

/// AMQP routing key → MQTT topic.
pub fn routing_key_to_topic(key: &str) -> String {
    key.chars().map(|c| match c { '.' => '/', '/' => '.', c => c }).collect()
}

/// MQTT filter → AMQP binding key.
pub fn filter_to_binding_key(filter: &str) -> String {
    filter
        .split('/')
        .map(|l| match l { "+" => "*".to_string(), l => l.replace('.', "/") })
        .collect::<Vec<_>>()
        .join(".")
}

/// Header bytes and format of an inbound publish.
pub fn inbound_header(p: &Publish, client_id: &str, now_ms: u64) -> (Bytes, HeaderFormat) {
    let mut props = Properties::default();
    let mp = &p.properties;
    props.content_type = mp.content_type.clone();
    props.correlation_id = mp.correlation_data.as_ref().map(|b| b.to_vec());
    props.reply_to = mp.response_topic.as_deref().map(topic_to_routing_key);
    props.payload_utf8 = mp.payload_is_utf8;
    if let Some(s) = mp.message_expiry_secs {
        props.expires_at_ms = Some(now_ms.saturating_add(u64::from(s) * 1000));
    }
    props.delivery_mode = Some(if p.qos > QoS::AtMostOnce {
        crate::engine::properties::DeliveryMode::Persistent
    } else {
        crate::engine::properties::DeliveryMode::Transient
    });
    let mut t = Table::new();
    for (k, v) in &mp.user_properties {
        t.push(k.clone(), Value::String(v.clone()));
    }
    t.push("x-mqtt-publish-qos", Value::U8(p.qos as u8));
    t.push("x-mqtt-client-id", Value::String(client_id.to_string()));
    props.headers = Some(t);
    let mut out = Vec::new();
    let _ = props.encode(&mut out);
    (out.into(), HeaderFormat::Weir)
}

/// A message as an MQTT subscriber sees it.
pub struct Outbound {
    pub topic: String,
    pub qos: QoS,
    pub properties: MessageProperties,
    pub publisher: Option<String>,
}

/// Converts any message for an MQTT subscriber.
pub fn outbound(m: &Message, codecs: &HeaderCodecs, enqueued_ms: u64, now_ms: u64) -> Outbound {
    let props = codecs.decode(m.header_format, &m.properties).unwrap_or_default();
    let mut mp = MessageProperties {
        payload_is_utf8: props.payload_utf8,
        content_type: props.content_type.clone(),
        response_topic: props.reply_to.as_deref().map(routing_key_to_topic),
        correlation_data: props.correlation_id.clone().map(Bytes::from),
        ..Default::default()
    };
    let mut qos = if m.persistent { QoS::AtLeastOnce } else { QoS::AtMostOnce };
    let mut publisher = None;
    if let Some(h) = &props.headers {
        for (k, v) in h.iter() {
            match (k, v) {
                ("x-mqtt-publish-qos", Value::U8(q)) => {
                    qos = match q { 0 => QoS::AtMostOnce, 1 => QoS::AtLeastOnce, _ => QoS::ExactlyOnce }
                }
                ("x-mqtt-client-id", Value::String(s)) => publisher = Some(s.clone()),
                (k, Value::String(s)) => mp.user_properties.push((k.to_string(), s.clone())),
                _ => {}
            }
        }
    }
    let ttl = props.ttl_ms.or(m.ttl_ms);
    let deadline = match (ttl.map(|t| enqueued_ms.saturating_add(t)), props.expires_at_ms) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    };
    if let Some(d) = deadline {
        mp.message_expiry_secs = Some((d.saturating_sub(now_ms).div_ceil(1000)).min(u64::from(u32::MAX)) as u32);
    }
    Outbound {
        topic: routing_key_to_topic(&String::from_utf8_lossy(&m.routing_key)),
        qos,
        properties: mp,
        publisher,
    }
}
