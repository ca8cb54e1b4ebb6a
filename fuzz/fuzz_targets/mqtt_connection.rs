//! Arbitrary bytes fed to an MQTT `Connection` in chunks of varying size and
//! driven with `poll` until it wants more input or is finished, answering
//! every event the way a session would (accept, acks, suback, and an
//! outgoing publish after each event, which walks packet ids, quota and
//! topic aliases). The first byte picks options: a canned CONNECT prefix
//! (none, 3.1.1, or MQTT 5 with a receive maximum, topic aliases and a
//! maximum packet size) so the fuzzer starts inside an open connection, the
//! chunk size, and a keep-alive timeout at the end. Invariants: no panic,
//! bounded work per input, one `Closed` at most, nothing after the end, and
//! every packet the server writes parses with mqttbytes.
#![no_main]

use bytes::{Bytes, BytesMut};
use libfuzzer_sys::fuzz_target;
use mqttbytes::{v4, v5};
use std::sync::OnceLock;
use std::time::{Duration, Instant};
use weir_protocols::mqtt::{
    ConnectAccept, ConnectRefusal, Connection, Event, MessageProperties, OutgoingPublish, QoS,
    ServerConfig, Version,
};

fn connect4() -> Vec<u8> {
    let mut c = v4::Connect::new("fuzz-4");
    c.keep_alive = 5;
    c.clean_session = false;
    let mut b = BytesMut::new();
    c.write(&mut b).expect("encoding CONNECT");
    b.to_vec()
}

fn connect5() -> Vec<u8> {
    let mut c = v5::Connect::new("fuzz-5");
    c.keep_alive = 5;
    c.properties = Some(v5::ConnectProperties {
        session_expiry_interval: Some(60),
        receive_maximum: Some(4),
        max_packet_size: Some(512),
        topic_alias_max: Some(2),
        request_response_info: Some(1),
        request_problem_info: None,
        user_properties: Vec::new(),
        authentication_method: None,
        authentication_data: None,
    });
    let mut b = BytesMut::new();
    c.write(&mut b).expect("encoding CONNECT");
    b.to_vec()
}

/// Every packet the server wrote parses.
fn check_out(c: &mut Connection) {
    let mut out = c.out.split();
    let v5 = c.version() == Some(Version::V5);
    while !out.is_empty() {
        let parsed = if v5 {
            v5::read(&mut out, usize::MAX).map(|_| ())
        } else {
            v4::read(&mut out, usize::MAX).map(|_| ())
        };
        if let Err(e) = parsed {
            panic!("server wrote an unparsable packet: {e:?}");
        }
    }
}

fn outgoing(n: usize) -> OutgoingPublish {
    let topic = ["a/b", "c", "a/b/c/d"][n % 3];
    let qos = [QoS::AtMostOnce, QoS::AtLeastOnce, QoS::ExactlyOnce][n % 3];
    OutgoingPublish {
        topic: topic.to_string(),
        payload: Bytes::from(vec![b'x'; (n * 37) % 700]),
        qos,
        retain: n % 2 == 0,
        dup: false,
        packet_id: None,
        properties: MessageProperties {
            message_expiry_secs: Some(10),
            user_properties: vec![("k".into(), "v".into())],
            ..MessageProperties::default()
        },
        subscription_ids: vec![1, 7],
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&opts, body)) = data.split_first() else {
        return;
    };
    static C4: OnceLock<Vec<u8>> = OnceLock::new();
    static C5: OnceLock<Vec<u8>> = OnceLock::new();
    let mut stream = match opts & 3 {
        1 => C4.get_or_init(connect4).clone(),
        2 | 3 => C5.get_or_init(connect5).clone(),
        _ => Vec::new(),
    };
    stream.extend_from_slice(body);
    let chunk = 1usize << (((opts >> 2) & 7) * 2); // 1 B .. 16 KiB
    let config = ServerConfig {
        maximum_packet_size: 4096,
        receive_maximum: 8,
        topic_alias_maximum: 4,
        max_topic_levels: 8,
        ..ServerConfig::default()
    };
    let t0 = Instant::now();
    let mut c = Connection::new(config, t0);
    let mut input = BytesMut::new();
    // Each event consumes at least a 2-byte packet, plus one Closed.
    let mut budget = stream.len() + 64;
    let mut closed = 0;
    let mut n = 0usize;
    let handle = |c: &mut Connection, ev: Event, closed: &mut i32, n: &mut usize| {
        *n += 1;
        match ev {
            Event::Connect(connect) => {
                if connect.client_id.starts_with('r') {
                    c.refuse(ConnectRefusal::NotAuthorized, "refused by the fuzzer");
                } else {
                    c.accept(ConnectAccept {
                        assigned_client_id: connect.client_id.is_empty().then(|| "assigned".into()),
                        response_information: Some("resp/".into()),
                        ..ConnectAccept::default()
                    });
                }
            }
            Event::Publish(p) => match (p.qos, p.packet_id) {
                (QoS::AtLeastOnce, Some(id)) => c.puback(id, 0),
                (QoS::ExactlyOnce, Some(id)) => c.pubrec(id, if id % 5 == 0 { 0x97 } else { 0 }),
                _ => {}
            },
            Event::PubRel { packet_id } => c.pubcomp(packet_id),
            Event::Subscribe {
                packet_id, filters, ..
            } => {
                let codes: Vec<u8> = filters
                    .iter()
                    .map(|f| f.invalid.unwrap_or(f.qos as u8))
                    .collect();
                c.suback(packet_id, &codes);
            }
            Event::Unsubscribe { packet_id, filters } => {
                c.unsuback(packet_id, &vec![0x11; filters.len()]);
            }
            Event::Closed { .. } => *closed += 1,
            Event::PubAck { .. }
            | Event::PubRec { .. }
            | Event::PubComp { .. }
            | Event::Disconnect { .. } => {}
        }
        if c.can_send() || *n % 4 == 0 {
            let _ = c.publish(outgoing(*n));
        }
    };
    for piece in stream.chunks(chunk) {
        input.extend_from_slice(piece);
        c.on_read(t0);
        while let Some(ev) = c.poll(&mut input) {
            budget = budget
                .checked_sub(1)
                .expect("poll returns events without consuming input");
            handle(&mut c, ev, &mut closed, &mut n);
            check_out(&mut c);
        }
        check_out(&mut c);
        if c.is_finished() {
            break;
        }
    }
    if opts & 0x20 != 0 {
        c.handle_timeout(t0 + Duration::from_secs(3600));
        while let Some(ev) = c.poll(&mut input) {
            budget = budget.checked_sub(1).expect("events without input");
            handle(&mut c, ev, &mut closed, &mut n);
        }
        check_out(&mut c);
    }
    assert!(closed <= 1, "{closed} Closed events");
    if c.is_finished() {
        assert!(c.poll(&mut input).is_none(), "an event after the end");
        assert!(c.out.is_empty() || c.version().is_some());
    }
});
