//! MQTT message headers as stored (format `MQTT`, the gateway's
//! `MqttCodec`) and retained messages as stored in the metadata map.
//! Invariants: no panic on any input; a compact header that decodes
//! re-encodes to the same bytes; whatever the codec decodes survives its
//! own (lossless) encoding; a decodable header converts for an MQTT
//! subscriber and to AMQP.
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::sync::OnceLock;
use weir_engine::properties::{HeaderCodec, HeaderCodecs};
use weir_gateway::amqp::headers::AMQP_091;
use weir_gateway::mqtt::message_format::{MqttCodec, MqttHeader, MQTT};

/// The gateway's registry, built once.
fn codecs() -> &'static HeaderCodecs {
    static CODECS: OnceLock<HeaderCodecs> = OnceLock::new();
    CODECS.get_or_init(weir_gateway::header_codecs::registry)
}

fuzz_target!(|data: &[u8]| {
    if let Ok(Some(h)) = MqttHeader::decode(data) {
        assert_eq!(&h.to_bytes()[..], data, "accepted input is not canonical");
    }
    if let Ok(p) = MqttCodec.decode(data) {
        let mut again = Vec::new();
        MqttCodec
            .encode(&p, &mut again)
            .expect("decoded properties encode");
        assert_eq!(MqttCodec.decode(&again).expect("our encoding decodes"), p);
        let raw = bytes::Bytes::copy_from_slice(data);
        codecs()
            .convert(MQTT, &raw, AMQP_091)
            .expect("a decodable MQTT header converts to AMQP");
    }
    // The same bytes as a stored retained message's value.
    let _ = weir_engine::retained::decode_entry(b"r\0t\0topic", data);
});
