//! The header-codec registry of the protocols this gateway serves: where
//! each protocol's [`HeaderCodec`] is registered under its format number,
//! and the one place that lists the numbers.
//!
//! Every message is stored with the number of its header's format, so a
//! number is given once and never again, not even after its protocol is
//! removed (stored messages keep theirs; a number without a codec reads
//! back as bytes and only fails to convert):
//!
//! | number | format | codec |
//! |---|---|---|
//! | 0 | none (reserved) | |
//! | 1 | AMQP 0-9-1 basic property block, as published | [`crate::amqp::headers::AmqpCodec`] |
//! | 2 | Weir: the engine's own encoding of `Properties` (HTTP publishes) | `weir_engine::properties::WeirCodec`, always registered |
//! | 3 | MQTT publish flags and properties, compact | [`crate::mqtt::message_format::MqttCodec`] |
//!
//! A new protocol takes the next number, declares it as a constant beside
//! its codec (as `AMQP_091` and `MQTT` are) and adds one line here; no other
//! protocol's files change, since every conversion between formats goes
//! through the registry ([`HeaderCodecs::convert`]).

use std::sync::Arc;
use weir_engine::properties::{HeaderCodec, HeaderCodecs};

/// The codecs this gateway registers besides the engine's own, in number
/// order.
fn protocol_codecs() -> [Arc<dyn HeaderCodec>; 2] {
    [
        Arc::new(crate::amqp::headers::AmqpCodec),
        Arc::new(crate::mqtt::message_format::MqttCodec),
    ]
}

/// A new registry with every protocol's codec: built once per engine by the
/// server's startup (`Engine::set_codecs`), each with its own conversion
/// cache.
pub fn registry() -> HeaderCodecs {
    protocol_codecs()
        .into_iter()
        .try_fold(HeaderCodecs::new(), HeaderCodecs::register)
        // The list above is fixed, and its numbers distinct (tested below).
        .expect("each header format number is registered once")
}

#[cfg(test)]
mod tests {
    use super::*;
    use weir_engine::properties::HeaderFormat;

    /// Stored data reads back: the numbers never change.
    #[test]
    fn format_numbers_are_fixed_and_distinct() {
        let numbers: Vec<u8> = registry().formats().map(HeaderFormat::to_u8).collect();
        assert_eq!(numbers, [2, 1, 3]);
        assert_eq!(crate::amqp::headers::AMQP_091.to_u8(), 1);
        assert_eq!(HeaderFormat::WEIR.to_u8(), 2);
        assert_eq!(crate::mqtt::message_format::MQTT.to_u8(), 3);
    }
}
