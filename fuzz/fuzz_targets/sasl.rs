//! SASL responses of connection.start-ok: the first byte picks PLAIN,
//! AMQPLAIN or another mechanism, the rest is the response.
#![no_main]

use libfuzzer_sys::fuzz_target;
use weir_protocols::amqp::sasl::{decode, MAX_RESPONSE};

fuzz_target!(|data: &[u8]| {
    let Some((&m, response)) = data.split_first() else {
        return;
    };
    let mechanism = match m % 3 {
        0 => "PLAIN",
        1 => "AMQPLAIN",
        _ => "EXTERNAL",
    };
    if let Ok(c) = decode(mechanism, response) {
        assert!(response.len() <= MAX_RESPONSE);
        if mechanism == "PLAIN" {
            assert!(!c.username.contains('\0') && !c.password.contains('\0'));
        }
        assert_ne!(mechanism, "EXTERNAL");
    }
});
