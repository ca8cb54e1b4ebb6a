//! Message headers: the store's encoding of the engine's neutral
//! `Properties`, and AMQP property blocks through the gateway's converter.
//! Invariants: no panic on any input; whatever the store decoder accepts
//! re-encodes to the same bytes (it accepts only canonical encodings);
//! whatever the AMQP converter decodes encodes back to a block that
//! `amq-protocol` reads, is stable under a second pass, and fits the store's
//! encoding unchanged.
#![no_main]

use libfuzzer_sys::fuzz_target;
use weir_engine::properties::Properties;
use weir_gateway::amqp::headers::{amqp_headers, amqp_to_properties, properties_to_amqp};
use weir_protocols::amqp::connection::parse_properties;

fuzz_target!(|data: &[u8]| {
    if let Ok(p) = Properties::decode(data) {
        let again = p.to_bytes().expect("decoded properties encode");
        assert_eq!(&again[..], data, "accepted input is not canonical");
    }

    let _ = amqp_headers(data);
    if let Ok(p) = amqp_to_properties(data) {
        let mut amqp = Vec::new();
        properties_to_amqp(&p, &mut amqp).expect("decoded properties encode as AMQP");
        assert!(
            parse_properties(&amqp).is_some(),
            "amq-protocol refuses our encoding"
        );
        let q = amqp_to_properties(&amqp).expect("our AMQP encoding decodes");
        let mut again = Vec::new();
        properties_to_amqp(&q, &mut again).expect("encodes again");
        assert_eq!(again, amqp, "normalisation is not one pass");
        let stored = p.to_bytes().expect("AMQP properties fit the store encoding");
        assert_eq!(Properties::decode(&stored).as_ref(), Ok(&p));
    }
});
