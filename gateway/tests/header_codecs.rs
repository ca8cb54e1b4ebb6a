//! The header-codec registry end to end, in process over the real engine and
//! `MemStore`: a protocol neither adapter has heard of registers its codec
//! under a new number, and what it publishes reaches AMQP and MQTT consumers
//! with its properties, through the adapters' own delivery conversions
//! (`amqp::headers::amqp_properties`, `mqtt::message_format::outbound`),
//! with no edit in either adapter; a number without a codec is kept as bytes
//! and delivered without properties, never a panic.

use bytes::Bytes;
use serde_json::json;
use std::sync::Arc;
use weir_backend::testing::MemStore;
use weir_engine::client::GetAck;
use weir_engine::message::{Entry, Message};
use weir_engine::properties::{
    HeaderCodec, HeaderCodecs, HeaderFormat, NoHeaders, Properties, PropertiesError, Table, Value,
};
use weir_engine::tenant::{QueueDeclare, RouteInput};
use weir_engine::{Client, Engine, DEFAULT_TENANT};
use weir_gateway::amqp::headers::{amqp_properties, amqp_to_properties, AMQP_091};
use weir_gateway::header_codecs::registry;
use weir_gateway::mqtt::message_format::outbound;
use weir_protocols::amqp::connection::parse_properties;
use weir_protocols::mqtt::QoS;

/// A stand-in for the next protocol's header format: `name: value` lines.
const LINES: HeaderFormat = HeaderFormat::new(200);

/// Its codec: `content-type` and `correlation-id` are properties, every
/// other line a string header.
struct LinesCodec;

impl HeaderCodec for LinesCodec {
    fn format(&self) -> HeaderFormat {
        LINES
    }

    fn decode(&self, raw: &[u8]) -> Result<Properties, PropertiesError> {
        let text = std::str::from_utf8(raw).map_err(|_| PropertiesError::InvalidUtf8)?;
        let mut p = Properties::default();
        let mut headers = Table::new();
        for line in text.lines() {
            let (name, value) = line
                .split_once(": ")
                .ok_or(PropertiesError::Invalid("line"))?;
            match name {
                "content-type" => p.content_type = Some(value.into()),
                "correlation-id" => p.correlation_id = Some(value.as_bytes().to_vec()),
                _ => headers.push(name, Value::String(value.into())),
            }
        }
        p.headers = (!headers.is_empty()).then_some(headers);
        Ok(p)
    }

    fn encode(&self, p: &Properties, out: &mut Vec<u8>) -> Result<(), PropertiesError> {
        let mut line = |name: &str, value: &[u8]| {
            out.extend_from_slice(name.as_bytes());
            out.extend_from_slice(b": ");
            out.extend_from_slice(value);
            out.push(b'\n');
        };
        if let Some(t) = &p.content_type {
            line("content-type", t.as_bytes());
        }
        if let Some(c) = &p.correlation_id {
            line("correlation-id", c);
        }
        for (name, value) in p.headers.iter().flat_map(Table::iter) {
            if let Value::String(s) = value {
                line(name, s.as_bytes());
            }
        }
        Ok(())
    }
}

/// An engine over `MemStore` with `codecs` installed, as the server's
/// startup installs the composition root's, and a client with queue `q`.
fn engine_with(codecs: HeaderCodecs) -> (Arc<Engine>, Client) {
    let engine =
        Engine::open(MemStore::new(), weir_engine::ManualClock::new()).expect("engine opens");
    engine.set_codecs(Arc::new(codecs));
    let mut client = Client::open(&engine, DEFAULT_TENANT, "guest").expect("client opens");
    let (_, wait) = client
        .declare_queue(QueueDeclare {
            name: "q".into(),
            passive: false,
            durable: true,
            exclusive: false,
            auto_delete: false,
            arguments: json!({}),
            connection: client.id(),
        })
        .expect("queue declared");
    if let Some(w) = wait {
        w.blocking_recv()
            .expect("store answered")
            .expect("declare durable");
    }
    (engine, client)
}

/// Publishes a persistent message with header `raw` of `format` to `q` and
/// gets it back, as a consumer's delivery would carry it.
fn round_trip(client: &mut Client, format: HeaderFormat, raw: &'static [u8]) -> Arc<Message> {
    let route = RouteInput {
        exchange: "",
        routing_key: "q",
        headers: &NoHeaders,
    };
    client
        .publish(&route, |id| Message {
            id,
            exchange: Bytes::new(),
            routing_key: Bytes::from_static(b"q"),
            properties: Bytes::from_static(raw),
            body: Bytes::from_static(b"payload"),
            header_format: format,
            persistent: true,
            priority: 0,
            ttl_ms: None,
        })
        .expect("published");
    client.commit();
    client
        .get("q", GetAck::Auto)
        .expect("get")
        .expect("a message")
        .message
}

/// The queue entry an MQTT delivery of `m` would carry.
fn entry_of(m: &Message) -> Entry {
    Entry {
        seq: 0,
        id: m.id,
        location: None,
        size: m.size(),
        redelivered: false,
        attempts: 1,
        priority: 0,
        enqueued_ms: 1_000,
        expires_at_ms: 0,
        message: None,
    }
}

#[test]
fn a_new_protocols_messages_reach_amqp_and_mqtt_through_the_registry() {
    let codecs = registry()
        .register(Arc::new(LinesCodec))
        .expect("200 is a new number");
    let (engine, mut client) = engine_with(codecs);
    let m = round_trip(
        &mut client,
        LINES,
        b"content-type: text/plain\ncorrelation-id: c-1\nx-colour: blue\n",
    );
    assert_eq!(m.header_format, LINES, "stored under its own number");
    let codecs = engine.codecs();

    // AMQP: the block a consumer's client library parses.
    let block = amqp_properties(&m, &codecs);
    let parsed = parse_properties(&block).expect("a valid AMQP property block");
    assert_eq!(
        parsed.content_type().as_ref().map(|s| s.as_str()),
        Some("text/plain")
    );
    assert_eq!(
        parsed.correlation_id().as_ref().map(|s| s.as_str()),
        Some("c-1")
    );
    let ours = amqp_to_properties(&block).expect("decodes");
    assert_eq!(
        ours.headers.as_ref().and_then(|h| h.get("x-colour")),
        Some(&Value::String("blue".into()))
    );

    // MQTT: what a subscriber is sent.
    let out = outbound(&m, &entry_of(&m), &codecs, 2_000).expect("a valid topic");
    assert_eq!(out.payload, Bytes::from_static(b"payload"));
    assert_eq!(out.properties.content_type.as_deref(), Some("text/plain"));
    assert_eq!(
        out.properties.correlation_data.as_deref(),
        Some(&b"c-1"[..])
    );
    assert!(out
        .properties
        .user_properties
        .contains(&("x-colour".into(), "blue".into())));

    // And back: an AMQP publisher's header, as the new protocol's consumer
    // would be sent it, through the same registry.
    let amqp = round_trip(&mut client, AMQP_091, b"\x80\x00\x0aimage/jpeg");
    let lines = codecs
        .convert(amqp.header_format, &amqp.properties, LINES)
        .expect("converts");
    assert_eq!(&lines[..], b"content-type: image/jpeg\n");
}

#[test]
fn a_format_without_a_codec_is_kept_and_delivered_without_properties() {
    let unknown = HeaderFormat::new(250);
    let (engine, mut client) = engine_with(registry());
    let m = round_trip(&mut client, unknown, b"opaque");
    assert_eq!(
        (m.header_format, &m.properties[..]),
        (unknown, &b"opaque"[..]),
        "kept as it came"
    );
    let codecs = engine.codecs();
    let err = codecs
        .convert(unknown, &m.properties, AMQP_091)
        .expect_err("no codec");
    assert_eq!(err, PropertiesError::NoCodec(unknown));
    assert_eq!(err.to_string(), "no codec registered for header format 250");

    // AMQP: an empty block, the body intact.
    assert_eq!(&amqp_properties(&m, &codecs)[..], &[0, 0]);
    // MQTT: no properties; the QoS a persistent message stands for.
    let out = outbound(&m, &entry_of(&m), &codecs, 2_000).expect("a valid topic");
    assert_eq!(out.payload, Bytes::from_static(b"payload"));
    assert_eq!(out.properties, Default::default());
    assert_eq!(out.qos, QoS::AtLeastOnce);

    // A stored 0 is no format at all.
    assert_eq!(
        HeaderFormat::from_u8(0),
        Err(PropertiesError::UnknownFormat(0))
    );
}
