//! The MQTT adapter driven in process, through its public API only: client
//! packets encoded with `mqttbytes` (or by hand where they must be wrong),
//! the server's bytes decoded with `mqttbytes`, time as plain `Instant`
//! values the test advances. No socket, no sleep.

use bytes::{Bytes, BytesMut};
use mqttbytes::{v4, v5};
use std::time::{Duration, Instant};
use weir_protocols::mqtt::{
    reason, ConnectAccept, ConnectRefusal, Connection, Event, MessageProperties, OutgoingPublish,
    QoS, SendError, ServerConfig, Timeout, Version,
};

// ---------------------------------------------------------------- helpers

fn t0() -> Instant {
    // One fixed origin per process is enough: tests only add to it.
    static T0: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    *T0.get_or_init(Instant::now)
}

fn secs(s: u64) -> Instant {
    t0() + Duration::from_secs(s)
}

/// Bytes of whatever `write` encodes.
fn enc(write: impl FnOnce(&mut BytesMut) -> Result<usize, mqttbytes::Error>) -> Vec<u8> {
    let mut b = BytesMut::new();
    write(&mut b).expect("encoding a test packet");
    b.to_vec()
}

/// A connection and its input buffer.
struct Peer {
    c: Connection,
    input: BytesMut,
}

impl Peer {
    fn new(config: ServerConfig) -> Peer {
        Peer {
            c: Connection::new(config, t0()),
            input: BytesMut::new(),
        }
    }

    /// Appends `bytes` and polls until `None`.
    fn feed(&mut self, bytes: &[u8]) -> Vec<Event> {
        self.input.extend_from_slice(bytes);
        self.poll()
    }

    fn poll(&mut self) -> Vec<Event> {
        let mut events = Vec::new();
        while let Some(ev) = self.c.poll(&mut self.input) {
            events.push(ev);
            assert!(events.len() < 10_000, "poll does not stop");
        }
        events
    }

    /// Everything the server wrote, as MQTT 5 packets (empties `out`).
    fn out5(&mut self) -> Vec<v5::Packet> {
        let mut buf = self.c.out.split();
        let mut v = Vec::new();
        while !buf.is_empty() {
            v.push(v5::read(&mut buf, usize::MAX).expect("server wrote a valid MQTT 5 packet"));
        }
        v
    }

    /// Everything the server wrote, as 3.1.1 packets (empties `out`).
    fn out4(&mut self) -> Vec<v4::Packet> {
        let mut buf = self.c.out.split();
        let mut v = Vec::new();
        while !buf.is_empty() {
            v.push(v4::read(&mut buf, usize::MAX).expect("server wrote a valid 3.1.1 packet"));
        }
        v
    }

    /// The raw bytes the server wrote (empties `out`).
    fn raw(&mut self) -> Vec<u8> {
        self.c.out.split().to_vec()
    }
}

fn connect4(id: &str, clean: bool, keep_alive: u16) -> v4::Connect {
    let mut c = v4::Connect::new(id);
    c.clean_session = clean;
    c.keep_alive = keep_alive;
    c
}

fn connect5(id: &str, props: Option<v5::ConnectProperties>) -> v5::Connect {
    let mut c = v5::Connect::new(id);
    c.keep_alive = 0;
    c.properties = props;
    c
}

fn connect_props() -> v5::ConnectProperties {
    v5::ConnectProperties {
        session_expiry_interval: None,
        receive_maximum: None,
        max_packet_size: None,
        topic_alias_max: None,
        request_response_info: None,
        request_problem_info: None,
        user_properties: Vec::new(),
        authentication_method: None,
        authentication_data: None,
    }
}

fn expect_connect(events: Vec<Event>) -> weir_protocols::mqtt::Connect {
    match <[Event; 1]>::try_from(events) {
        Ok([Event::Connect(c)]) => *c,
        Ok([other]) => panic!("expected Connect, got {other:?}"),
        Err(events) => panic!("expected one Connect, got {events:?}"),
    }
}

fn expect_closed(events: Vec<Event>) -> (u8, String) {
    match <[Event; 1]>::try_from(events) {
        Ok([Event::Closed { reason, text }]) => (reason, text),
        Ok([other]) => panic!("expected Closed, got {other:?}"),
        Err(events) => panic!("expected one Closed, got {events:?}"),
    }
}

/// An open 3.1.1 connection (CONNACK read).
fn open4_with(config: ServerConfig, connect: v4::Connect) -> Peer {
    let mut p = Peer::new(config);
    let c = expect_connect(p.feed(&enc(|b| connect.write(b))));
    assert_eq!(c.version, Version::V311);
    p.c.accept(ConnectAccept::default());
    match p.out4().as_slice() {
        [v4::Packet::ConnAck(a)] => assert_eq!(a.code, v4::ConnectReturnCode::Success),
        other => panic!("expected CONNACK, got {other:?}"),
    }
    p
}

fn open4() -> Peer {
    open4_with(ServerConfig::default(), connect4("c4", true, 0))
}

/// An open MQTT 5 connection (CONNACK returned).
fn open5_with(config: ServerConfig, connect: v5::Connect) -> (Peer, v5::ConnAck) {
    let mut p = Peer::new(config);
    let c = expect_connect(p.feed(&enc(|b| connect.write(b))));
    assert_eq!(c.version, Version::V5);
    p.c.accept(ConnectAccept::default());
    match <[v5::Packet; 1]>::try_from(p.out5()) {
        Ok([v5::Packet::ConnAck(a)]) => {
            assert_eq!(a.code, v5::ConnectReturnCode::Success);
            (p, a)
        }
        other => panic!("expected CONNACK, got {other:?}"),
    }
}

fn open5() -> Peer {
    open5_with(ServerConfig::default(), connect5("c5", None)).0
}

fn publish5(
    topic: &str,
    qos: mqttbytes::QoS,
    pkid: u16,
    props: Option<v5::PublishProperties>,
) -> Vec<u8> {
    let mut p = v5::Publish::new(topic, qos, b"hello".to_vec());
    p.pkid = pkid;
    p.properties = props;
    enc(|b| p.write(b))
}

fn publish4(topic: &str, qos: mqttbytes::QoS, pkid: u16) -> Vec<u8> {
    let mut p = v4::Publish::new(topic, qos, b"hello".to_vec());
    p.pkid = pkid;
    enc(|b| p.write(b))
}

fn pub_props() -> v5::PublishProperties {
    v5::PublishProperties {
        payload_format_indicator: None,
        message_expiry_interval: None,
        topic_alias: None,
        response_topic: None,
        correlation_data: None,
        user_properties: Vec::new(),
        subscription_identifiers: Vec::new(),
        content_type: None,
    }
}

fn alias(a: u16) -> Option<v5::PublishProperties> {
    Some(v5::PublishProperties {
        topic_alias: Some(a),
        ..pub_props()
    })
}

/// Asserts the MQTT 5 server wrote exactly a DISCONNECT with `code`, and
/// the connection ended with one `Closed` carrying it.
fn assert_disconnected5(p: &mut Peer, events: Vec<Event>, code: u8) {
    let (reason, text) = expect_closed(events);
    assert_eq!(reason, code, "Closed reason ({text})");
    match p.out5().as_slice() {
        [v5::Packet::Disconnect(d)] => assert_eq!(d.reason_code as u8, code),
        other => panic!("expected DISCONNECT {code:#x}, got {other:?}"),
    }
    assert!(p.c.is_finished());
    assert!(p.poll().is_empty(), "one Closed only");
}

/// Asserts a 3.1.1 connection closed without writing, with `Closed(code)`.
fn assert_closed4(p: &mut Peer, events: Vec<Event>, code: u8) {
    let (reason, text) = expect_closed(events);
    assert_eq!(reason, code, "Closed reason ({text})");
    assert!(p.raw().is_empty(), "3.1.1 closes without a packet");
    assert!(p.c.is_finished());
    assert!(p.poll().is_empty(), "one Closed only");
}

fn outgoing(topic: &str, qos: QoS) -> OutgoingPublish {
    OutgoingPublish {
        topic: topic.into(),
        payload: Bytes::from_static(b"payload"),
        qos,
        retain: false,
        dup: false,
        packet_id: None,
        properties: MessageProperties::default(),
        subscription_ids: Vec::new(),
    }
}

// ---------------------------------------------------------------- CONNECT

#[test]
fn connect_311_fields_and_connack() {
    let mut c = connect4("dev-1", false, 30);
    c.set_login("tenant:user", "pw");
    c.last_will = Some(v4::LastWill::new(
        "dev/1/status",
        b"gone".to_vec(),
        mqttbytes::QoS::AtLeastOnce,
        true,
    ));
    let mut p = Peer::new(ServerConfig::default());
    assert_eq!(p.c.version(), None);
    let ev = expect_connect(p.feed(&enc(|b| c.write(b))));
    assert_eq!(p.c.version(), Some(Version::V311));
    assert_eq!(ev.client_id, "dev-1");
    assert!(!ev.clean_start);
    assert_eq!(ev.keep_alive, 30);
    assert_eq!(ev.username.as_deref(), Some("tenant:user"));
    assert_eq!(ev.password.as_ref().map(|p| p.expose()), Some("pw"));
    assert_eq!(ev.session_expiry_secs, u32::MAX, "3.1.1 persistent session");
    assert_eq!(ev.receive_maximum, u16::MAX);
    let will = ev.will.expect("will");
    assert_eq!(
        (
            will.topic.as_str(),
            &will.payload[..],
            will.qos,
            will.retain
        ),
        ("dev/1/status", &b"gone"[..], QoS::AtLeastOnce, true)
    );
    // Nothing is written before the session answers.
    assert!(p.raw().is_empty());
    p.c.accept(ConnectAccept {
        session_present: true,
        ..ConnectAccept::default()
    });
    assert_eq!(p.raw(), [0x20, 2, 1, 0]);
    assert!(p.c.is_open());
    assert_eq!(p.c.keep_alive(), 30);
}

#[test]
fn connect_311_clean_session_never_reports_a_session() {
    let mut p = Peer::new(ServerConfig::default());
    let ev = expect_connect(p.feed(&enc(|b| connect4("x", true, 0).write(b))));
    assert_eq!(ev.session_expiry_secs, 0);
    p.c.accept(ConnectAccept {
        session_present: true,
        ..ConnectAccept::default()
    });
    assert_eq!(p.raw(), [0x20, 2, 0, 0], "MQTT-3.2.2-1");
}

#[test]
fn connect_5_properties_both_ways() {
    let mut props = connect_props();
    props.session_expiry_interval = Some(300);
    props.receive_maximum = Some(5);
    props.max_packet_size = Some(4096);
    props.topic_alias_max = Some(3);
    props.request_response_info = Some(1);
    props.request_problem_info = Some(0);
    props.user_properties = vec![("k".into(), "v".into())];
    let mut connect = connect5("", Some(props));
    connect.clean_session = false;
    connect.keep_alive = 120;
    let mut will = v5::LastWill::new("w/t", b"bye".to_vec(), mqttbytes::QoS::AtMostOnce, false);
    will.properties = Some(v5::WillProperties {
        delay_interval: Some(7),
        payload_format_indicator: Some(1),
        message_expiry_interval: Some(60),
        content_type: Some("text/plain".into()),
        response_topic: Some("r/t".into()),
        correlation_data: Some(Bytes::from_static(b"cd")),
        user_properties: vec![("wk".into(), "wv".into())],
    });
    connect.last_will = Some(will);
    let config = ServerConfig {
        server_keep_alive: Some(60),
        maximum_qos: QoS::AtLeastOnce,
        shared_subscriptions: false,
        retain_available: false,
        ..ServerConfig::default()
    };
    let mut p = Peer::new(config);
    let ev = expect_connect(p.feed(&enc(|b| connect.write(b))));
    assert_eq!(ev.client_id, "", "empty: the session assigns one");
    assert!(!ev.clean_start);
    assert_eq!(ev.session_expiry_secs, 300);
    assert_eq!(ev.receive_maximum, 5);
    assert_eq!(ev.maximum_packet_size, Some(4096));
    assert_eq!(ev.topic_alias_maximum, 3);
    assert!(ev.request_response_information);
    assert!(!ev.request_problem_information);
    assert_eq!(ev.user_properties, [("k".to_string(), "v".to_string())]);
    let will = ev.will.expect("will");
    assert_eq!(will.delay_secs, 7);
    assert_eq!(will.properties.payload_is_utf8, Some(true));
    assert_eq!(will.properties.message_expiry_secs, Some(60));
    assert_eq!(will.properties.content_type.as_deref(), Some("text/plain"));
    assert_eq!(will.properties.response_topic.as_deref(), Some("r/t"));
    assert_eq!(
        will.properties.correlation_data.as_deref(),
        Some(&b"cd"[..])
    );
    assert_eq!(
        will.properties.user_properties,
        [("wk".to_string(), "wv".to_string())]
    );

    p.c.accept(ConnectAccept {
        session_present: true,
        assigned_client_id: Some("auto-1".into()),
        server_keep_alive: None,
        session_expiry_secs: Some(100),
        response_information: Some("resp/".into()),
    });
    let [v5::Packet::ConnAck(a)] = <[v5::Packet; 1]>::try_from(p.out5()).expect("one CONNACK")
    else {
        panic!("not a CONNACK")
    };
    assert!(a.session_present);
    let cp = a.properties.expect("CONNACK properties");
    assert_eq!(cp.receive_max, Some(1024));
    assert_eq!(cp.max_packet_size, Some(1 << 20));
    assert_eq!(cp.topic_alias_max, Some(64));
    assert_eq!(cp.max_qos, Some(1));
    assert_eq!(cp.retain_available, Some(0));
    assert_eq!(cp.shared_subscription_available, Some(0));
    assert_eq!(cp.wildcard_subscription_available, Some(1));
    assert_eq!(cp.subscription_identifiers_available, Some(1));
    assert_eq!(cp.assigned_client_identifier.as_deref(), Some("auto-1"));
    assert_eq!(
        cp.server_keep_alive,
        Some(60),
        "the client asked for 120 > 60"
    );
    assert_eq!(cp.session_expiry_interval, Some(100));
    assert_eq!(cp.response_information.as_deref(), Some("resp/"));
    assert_eq!(p.c.keep_alive(), 60);
}

#[test]
fn connack_5_defaults_omit_what_is_implied() {
    let (p, a) = open5_with(ServerConfig::default(), connect5("x", None));
    let cp = a.properties.expect("properties");
    assert_eq!(
        cp.max_qos, None,
        "absent = QoS 2; the value 2 is not allowed"
    );
    assert_eq!(cp.retain_available, Some(1));
    assert_eq!(cp.server_keep_alive, None);
    assert_eq!(cp.response_information, None);
    assert_eq!(cp.assigned_client_identifier, None);
    assert_eq!(p.c.keep_alive(), 0);
}

#[test]
fn server_keep_alive_rules() {
    let config = ServerConfig {
        server_keep_alive: Some(30),
        ..ServerConfig::default()
    };
    for (asked, sent, in_force) in [(0, Some(30), 30), (60, Some(30), 30), (20, None, 20)] {
        let mut c = connect5("k", None);
        c.keep_alive = asked;
        let (p, a) = open5_with(config.clone(), c);
        assert_eq!(
            a.properties.expect("props").server_keep_alive,
            sent,
            "asked {asked}"
        );
        assert_eq!(p.c.keep_alive(), in_force);
    }
    // The session's value wins.
    let mut p = Peer::new(config.clone());
    expect_connect(p.feed(&enc(|b| connect5("k", None).write(b))));
    p.c.accept(ConnectAccept {
        server_keep_alive: Some(5),
        ..ConnectAccept::default()
    });
    assert_eq!(p.c.keep_alive(), 5);
    // 3.1.1 cannot be told: the client's value stays.
    let p = open4_with(config, connect4("k", true, 100));
    assert_eq!(p.c.keep_alive(), 100);
}

#[test]
fn response_information_only_when_requested() {
    let mut p = Peer::new(ServerConfig::default());
    expect_connect(p.feed(&enc(|b| connect5("x", None).write(b))));
    p.c.accept(ConnectAccept {
        response_information: Some("resp/".into()),
        ..ConnectAccept::default()
    });
    let [v5::Packet::ConnAck(a)] = <[v5::Packet; 1]>::try_from(p.out5()).expect("CONNACK") else {
        panic!()
    };
    assert_eq!(a.properties.expect("props").response_information, None);
}

#[test]
fn unsupported_protocol_levels_get_return_code_1() {
    // 3.1 ("MQIsdp", level 3): the 3.1.1 CONNACK layout, return code 1.
    let mut body = vec![0, 6];
    body.extend_from_slice(b"MQIsdp");
    body.extend_from_slice(&[3, 2, 0, 10, 0, 1, b'x']);
    let mut pkt = vec![0x10, body.len() as u8];
    pkt.extend_from_slice(&body);
    let mut p = Peer::new(ServerConfig::default());
    let (code, _) = expect_closed(p.feed(&pkt));
    assert_eq!(code, reason::UNSUPPORTED_PROTOCOL_VERSION);
    assert_eq!(p.raw(), [0x20, 2, 0, 1]);
    assert!(p.c.is_finished());
    assert_eq!(p.c.version(), None);

    // "MQTT" level 6.
    let mut pkt = enc(|b| connect4("x", true, 0).write(b));
    pkt[8] = 6;
    let mut p = Peer::new(ServerConfig::default());
    let (code, _) = expect_closed(p.feed(&pkt));
    assert_eq!(code, reason::UNSUPPORTED_PROTOCOL_VERSION);
    assert_eq!(p.raw(), [0x20, 2, 0, 1]);

    // Not MQTT at all: closed without an answer.
    let mut pkt = enc(|b| connect4("x", true, 0).write(b));
    pkt[4] = b'X';
    let mut p = Peer::new(ServerConfig::default());
    let (code, _) = expect_closed(p.feed(&pkt));
    assert_eq!(code, reason::PROTOCOL_ERROR);
    assert!(p.raw().is_empty());
}

#[test]
fn first_packet_must_be_connect() {
    let mut p = Peer::new(ServerConfig::default());
    let events = p.feed(&[0xC0, 0x00]);
    assert_closed4(&mut p, events, reason::PROTOCOL_ERROR);
    // Input after the end is dropped.
    p.input.extend_from_slice(&[0xC0, 0x00]);
    assert!(p.poll().is_empty());
    assert!(p.input.is_empty());
}

#[test]
fn first_packet_type_is_checked_on_its_first_byte() {
    let mut p = Peer::new(ServerConfig::default());
    let events = p.feed(&[0x30]);
    assert_closed4(&mut p, events, reason::PROTOCOL_ERROR);
}

#[test]
fn second_connect_is_a_protocol_error() {
    let mut p = open5();
    let events = p.feed(&enc(|b| connect5("again", None).write(b)));
    assert_disconnected5(&mut p, events, reason::PROTOCOL_ERROR);

    let mut p = open4();
    let events = p.feed(&enc(|b| connect4("again", true, 0).write(b)));
    assert_closed4(&mut p, events, reason::PROTOCOL_ERROR);
}

#[test]
fn connect_timeout() {
    let mut p = Peer::new(ServerConfig::default());
    assert_eq!(p.c.poll_timeout(), Some(secs(10)));
    // A partial CONNECT does not stop the clock.
    let pkt = enc(|b| connect4("x", true, 0).write(b));
    assert!(p.feed(&pkt[..5]).is_empty());
    p.c.on_read(secs(5));
    p.c.handle_timeout(secs(9));
    assert!(p.poll().is_empty());
    p.c.handle_timeout(secs(10));
    assert_eq!(p.c.timed_out(), Some(Timeout::Connect));
    let events = p.poll();
    assert_closed4(&mut p, events, reason::UNSPECIFIED_ERROR);
    assert_eq!(p.c.poll_timeout(), None);
}

#[test]
fn no_timer_while_the_session_decides() {
    let mut p = Peer::new(ServerConfig::default());
    expect_connect(p.feed(&enc(|b| connect4("x", true, 5).write(b))));
    assert_eq!(p.c.poll_timeout(), None);
    p.c.handle_timeout(secs(3600));
    assert!(p.poll().is_empty());
    assert!(!p.c.is_finished());
}

#[test]
fn empty_client_id() {
    // 3.1.1 with clean session 0: return code 2.
    let mut p = Peer::new(ServerConfig::default());
    let (code, _) = expect_closed(p.feed(&enc(|b| connect4("", false, 0).write(b))));
    assert_eq!(code, reason::CLIENT_ID_NOT_VALID);
    assert_eq!(p.raw(), [0x20, 2, 0, 2]);
    // 3.1.1 with clean session 1, and 5 either way: the session assigns.
    let mut p = Peer::new(ServerConfig::default());
    assert_eq!(
        expect_connect(p.feed(&enc(|b| connect4("", true, 0).write(b)))).client_id,
        ""
    );
    let mut c = connect5("", None);
    c.clean_session = false;
    let mut p = Peer::new(ServerConfig::default());
    assert_eq!(expect_connect(p.feed(&enc(|b| c.write(b)))).client_id, "");
}

#[test]
fn invalid_will_topic() {
    let mut c = connect5("x", None);
    c.last_will = Some(v5::LastWill::new(
        "a/+",
        b"x".to_vec(),
        mqttbytes::QoS::AtMostOnce,
        false,
    ));
    let mut p = Peer::new(ServerConfig::default());
    let (code, _) = expect_closed(p.feed(&enc(|b| c.write(b))));
    assert_eq!(code, reason::TOPIC_NAME_INVALID);
    match p.out5().as_slice() {
        [v5::Packet::ConnAck(a)] => assert_eq!(a.code, v5::ConnectReturnCode::TopicNameInvalid),
        other => panic!("{other:?}"),
    }

    let mut c = connect4("x", true, 0);
    c.last_will = Some(v4::LastWill::new(
        "a/#",
        b"x".to_vec(),
        mqttbytes::QoS::AtMostOnce,
        false,
    ));
    let mut p = Peer::new(ServerConfig::default());
    let events = p.feed(&enc(|b| c.write(b)));
    assert_closed4(&mut p, events, reason::TOPIC_NAME_INVALID);
}

/// A CONNECT with the given flags, a client id "x", and `tail` after it.
fn raw_connect(level: u8, flags: u8, tail: &[u8]) -> Vec<u8> {
    let mut body = vec![0, 4, b'M', b'Q', b'T', b'T', level, flags, 0, 0];
    if level == 5 {
        body.push(0); // no properties
    }
    body.extend_from_slice(&[0, 1, b'x']);
    body.extend_from_slice(tail);
    let mut pkt = vec![0x10, body.len() as u8];
    pkt.extend_from_slice(&body);
    pkt
}

#[test]
fn password_without_user_name() {
    // 3.1.1 MQTT-3.1.2-22: a protocol violation.
    let mut p = Peer::new(ServerConfig::default());
    let events = p.feed(&raw_connect(4, 0x42, &[0, 2, b'p', b'w']));
    assert_closed4(&mut p, events, reason::PROTOCOL_ERROR);
    // MQTT 5 allows it.
    let mut p = Peer::new(ServerConfig::default());
    let ev = expect_connect(p.feed(&raw_connect(5, 0x42, &[0, 2, b'p', b'w'])));
    assert_eq!(ev.username, None);
    assert_eq!(ev.password.as_ref().map(|p| p.expose()), Some("pw"));
}

#[test]
fn empty_user_name_is_still_a_user_name() {
    let mut p = Peer::new(ServerConfig::default());
    let ev = expect_connect(p.feed(&raw_connect(4, 0xC2, &[0, 0, 0, 0])));
    assert_eq!(ev.username.as_deref(), Some(""));
    assert_eq!(ev.password.as_ref().map(|p| p.expose()), Some(""));
}

#[test]
fn binary_password_is_refused() {
    let mut p = Peer::new(ServerConfig::default());
    let (code, _) = expect_closed(p.feed(&raw_connect(5, 0xC2, &[0, 1, b'u', 0, 2, 0xFF, 0xFE])));
    assert_eq!(code, reason::BAD_USER_NAME_OR_PASSWORD);
    match p.out5().as_slice() {
        [v5::Packet::ConnAck(a)] => assert_eq!(a.code, v5::ConnectReturnCode::BadUserNamePassword),
        other => panic!("{other:?}"),
    }
}

#[test]
fn reserved_connect_flag() {
    let mut p = Peer::new(ServerConfig::default());
    let (code, _) = expect_closed(p.feed(&raw_connect(5, 0x03, &[])));
    assert_eq!(code, reason::MALFORMED_PACKET);
    match p.out5().as_slice() {
        [v5::Packet::ConnAck(a)] => assert_eq!(a.code, v5::ConnectReturnCode::MalformedPacket),
        other => panic!("{other:?}"),
    }
    let mut p = Peer::new(ServerConfig::default());
    let events = p.feed(&raw_connect(4, 0x03, &[]));
    assert_closed4(&mut p, events, reason::MALFORMED_PACKET);
    // Will QoS without a will.
    let mut p = Peer::new(ServerConfig::default());
    let events = p.feed(&raw_connect(4, 0x0A, &[]));
    assert_closed4(&mut p, events, reason::MALFORMED_PACKET);
    // Bytes after the payload.
    let mut p = Peer::new(ServerConfig::default());
    let events = p.feed(&raw_connect(4, 0x02, &[1]));
    assert_closed4(&mut p, events, reason::MALFORMED_PACKET);
}

#[test]
fn connect_property_errors() {
    let mut props = connect_props();
    props.receive_maximum = Some(0);
    let mut p = Peer::new(ServerConfig::default());
    let (code, _) = expect_closed(p.feed(&enc(|b| connect5("x", Some(props)).write(b))));
    assert_eq!(code, reason::PROTOCOL_ERROR);
    match p.out5().as_slice() {
        [v5::Packet::ConnAck(a)] => {
            assert_eq!(a.code, v5::ConnectReturnCode::ProtocolError);
            assert!(a
                .properties
                .as_ref()
                .and_then(|p| p.reason_string.as_ref())
                .is_some());
        }
        other => panic!("{other:?}"),
    }
    let mut props = connect_props();
    props.authentication_method = Some("SCRAM-SHA-1".into());
    let mut p = Peer::new(ServerConfig::default());
    let (code, _) = expect_closed(p.feed(&enc(|b| connect5("x", Some(props)).write(b))));
    assert_eq!(code, reason::BAD_AUTHENTICATION_METHOD);
    // A repeated property.
    let mut p = Peer::new(ServerConfig::default());
    let mut body = vec![0, 4, b'M', b'Q', b'T', b'T', 5, 2, 0, 0];
    body.extend_from_slice(&[10, 17, 0, 0, 0, 1, 17, 0, 0, 0, 2]);
    body.extend_from_slice(&[0, 1, b'x']);
    let mut pkt = vec![0x10, body.len() as u8];
    pkt.extend_from_slice(&body);
    let (code, _) = expect_closed(p.feed(&pkt));
    assert_eq!(code, reason::PROTOCOL_ERROR);
}

#[test]
fn refuse_311_return_codes() {
    for (refusal, code) in [
        (ConnectRefusal::ClientIdNotValid, 2),
        (ConnectRefusal::BadUserNameOrPassword, 4),
        (ConnectRefusal::NotAuthorized, 5),
        (ConnectRefusal::ServerUnavailable, 3),
        (ConnectRefusal::ServerBusy, 3),
        (ConnectRefusal::QuotaExceeded, 3),
        (ConnectRefusal::BadAuthenticationMethod, 4),
    ] {
        let mut p = Peer::new(ServerConfig::default());
        expect_connect(p.feed(&enc(|b| connect4("x", true, 0).write(b))));
        p.c.refuse(refusal, "no");
        assert_eq!(p.raw(), [0x20, 2, 0, code], "{refusal:?}");
        assert!(p.c.is_finished());
        assert!(
            p.poll().is_empty(),
            "refusing is the session's doing: no Closed"
        );
    }
}

#[test]
fn refuse_5_with_reason_string() {
    let mut p = Peer::new(ServerConfig::default());
    expect_connect(p.feed(&enc(|b| connect5("x", None).write(b))));
    p.c.refuse(ConnectRefusal::NotAuthorized, "tenant t: access refused");
    match p.out5().as_slice() {
        [v5::Packet::ConnAck(a)] => {
            assert_eq!(a.code, v5::ConnectReturnCode::NotAuthorized);
            assert_eq!(
                a.properties
                    .as_ref()
                    .and_then(|p| p.reason_string.as_deref()),
                Some("tenant t: access refused")
            );
        }
        other => panic!("{other:?}"),
    }
    assert!(p.c.is_finished());
    assert!(p.poll().is_empty());
}

#[test]
fn packets_behind_connect_wait_for_the_answer() {
    let mut bytes = enc(|b| connect4("x", true, 0).write(b));
    bytes.extend(publish4("a/b", mqttbytes::QoS::AtMostOnce, 0));
    bytes.extend_from_slice(&[0xC0, 0]);
    let mut p = Peer::new(ServerConfig::default());
    expect_connect(p.feed(&bytes));
    assert!(p.poll().is_empty(), "nothing is read until accept");
    p.c.accept(ConnectAccept::default());
    let events = p.poll();
    assert!(
        matches!(events.as_slice(), [Event::Publish(_)]),
        "{events:?}"
    );
    assert_eq!(p.raw(), [0x20, 2, 0, 0, 0xD0, 0]);
}

#[test]
fn byte_by_byte_input() {
    let mut bytes = enc(|b| connect5("x", None).write(b));
    let mut p = Peer::new(ServerConfig::default());
    let last = bytes.pop().unwrap_or_default();
    for b in bytes {
        assert!(p.feed(&[b]).is_empty());
    }
    expect_connect(p.feed(&[last]));
}

// ---------------------------------------------------------------- keep-alive

#[test]
fn keep_alive_5_disconnects_with_0x8d() {
    let mut c = connect5("k", None);
    c.keep_alive = 10;
    let (mut p, _) = open5_with(ServerConfig::default(), c);
    assert_eq!(p.c.poll_timeout(), Some(secs(15)));
    p.c.on_read(secs(10));
    assert_eq!(p.c.poll_timeout(), Some(secs(25)));
    p.c.handle_timeout(secs(24));
    assert!(p.poll().is_empty());
    p.c.handle_timeout(secs(25));
    assert_eq!(p.c.timed_out(), Some(Timeout::KeepAlive));
    let events = p.poll();
    assert_disconnected5(&mut p, events, reason::KEEP_ALIVE_TIMEOUT);
}

#[test]
fn keep_alive_311_closes_silently() {
    let mut p = open4_with(ServerConfig::default(), connect4("k", true, 2));
    assert_eq!(p.c.poll_timeout(), Some(secs(3)));
    p.c.handle_timeout(secs(3));
    let events = p.poll();
    assert_closed4(&mut p, events, reason::KEEP_ALIVE_TIMEOUT);
}

#[test]
fn no_keep_alive_no_timer() {
    let p = open4();
    assert_eq!(p.c.poll_timeout(), None);
}

#[test]
fn pingreq_is_answered_inside() {
    let mut p = open5();
    assert!(p.feed(&[0xC0, 0]).is_empty());
    assert!(matches!(p.out5().as_slice(), [v5::Packet::PingResp]));
    let mut p = open4();
    assert!(p.feed(&[0xC0, 0]).is_empty());
    assert!(matches!(p.out4().as_slice(), [v4::Packet::PingResp]));
    // A PINGREQ with a body is malformed.
    let events = p.feed(&[0xC0, 1, 0]);
    assert_closed4(&mut p, events, reason::MALFORMED_PACKET);
}

// ---------------------------------------------------------------- PUBLISH in

fn one_publish(events: Vec<Event>) -> weir_protocols::mqtt::Publish {
    match <[Event; 1]>::try_from(events) {
        Ok([Event::Publish(p)]) => p,
        other => panic!("expected one Publish, got {other:?}"),
    }
}

#[test]
fn publish_in_all_qos_311() {
    let mut p = open4();
    let m = one_publish(p.feed(&publish4("a/b", mqttbytes::QoS::AtMostOnce, 0)));
    assert_eq!(
        (m.topic.as_str(), &m.payload[..], m.qos, m.packet_id),
        ("a/b", &b"hello"[..], QoS::AtMostOnce, None)
    );
    let m = one_publish(p.feed(&publish4("a/b", mqttbytes::QoS::AtLeastOnce, 3)));
    assert_eq!((m.qos, m.packet_id), (QoS::AtLeastOnce, Some(3)));
    p.c.puback(3, 0x10); // no reason codes in 3.1.1
    assert!(matches!(p.out4().as_slice(), [v4::Packet::PubAck(a)] if a.pkid == 3));
    let m = one_publish(p.feed(&publish4("a/b", mqttbytes::QoS::ExactlyOnce, 4)));
    assert_eq!((m.qos, m.packet_id), (QoS::ExactlyOnce, Some(4)));
    p.c.pubrec(4, 0);
    assert!(matches!(p.out4().as_slice(), [v4::Packet::PubRec(a)] if a.pkid == 4));
    let events = p.feed(&enc(|b| v4::PubRel::new(4).write(b)));
    assert!(matches!(
        events.as_slice(),
        [Event::PubRel { packet_id: 4 }]
    ));
    p.c.pubcomp(4);
    assert!(matches!(p.out4().as_slice(), [v4::Packet::PubComp(a)] if a.pkid == 4));
    assert_eq!(p.c.incoming_in_flight(), 0);
}

#[test]
fn publish_in_5_properties_and_flags() {
    let mut p = open5();
    let props = v5::PublishProperties {
        payload_format_indicator: Some(1),
        message_expiry_interval: Some(30),
        response_topic: Some("reply/1".into()),
        correlation_data: Some(Bytes::from_static(b"c-1")),
        user_properties: vec![("a".into(), "1".into()), ("a".into(), "2".into())],
        content_type: Some("application/json".into()),
        ..pub_props()
    };
    let mut pkt = v5::Publish::new("t/1", mqttbytes::QoS::AtLeastOnce, b"{}".to_vec());
    pkt.pkid = 9;
    pkt.retain = true;
    pkt.dup = true;
    pkt.properties = Some(props);
    let m = one_publish(p.feed(&enc(|b| pkt.write(b))));
    assert_eq!(&m.payload[..], b"{}");
    assert!(m.retain && m.dup);
    assert_eq!(m.properties.payload_is_utf8, Some(true));
    assert_eq!(m.properties.message_expiry_secs, Some(30));
    assert_eq!(m.properties.response_topic.as_deref(), Some("reply/1"));
    assert_eq!(m.properties.correlation_data.as_deref(), Some(&b"c-1"[..]));
    assert_eq!(m.properties.user_properties.len(), 2);
    assert_eq!(
        m.properties.content_type.as_deref(),
        Some("application/json")
    );
    p.c.puback(9, reason::NO_MATCHING_SUBSCRIBERS);
    match p.out5().as_slice() {
        [v5::Packet::PubAck(a)] => {
            assert_eq!(
                (a.pkid, a.reason),
                (9, v5::PubAckReason::NoMatchingSubscribers)
            )
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn invalid_topic_names() {
    for topic in ["a/+", "#", ""] {
        let mut p = open5();
        let events = p.feed(&publish5(topic, mqttbytes::QoS::AtMostOnce, 0, None));
        let code = if topic.is_empty() {
            reason::PROTOCOL_ERROR // empty without an alias
        } else {
            reason::TOPIC_NAME_INVALID
        };
        assert_disconnected5(&mut p, events, code);

        let mut p = open4();
        let events = p.feed(&publish4(topic, mqttbytes::QoS::AtMostOnce, 0));
        assert_closed4(&mut p, events, reason::TOPIC_NAME_INVALID);
    }
    // Too many levels.
    let config = ServerConfig {
        max_topic_levels: 2,
        ..ServerConfig::default()
    };
    let (mut p, _) = open5_with(config, connect5("x", None));
    let events = p.feed(&publish5("a/b/c", mqttbytes::QoS::AtMostOnce, 0, None));
    assert_disconnected5(&mut p, events, reason::TOPIC_NAME_INVALID);
}

#[test]
fn ill_formed_utf8_is_malformed() {
    // Topic "a\xFF": not UTF-8. And "a\0": U+0000.
    for topic in [&[b'a', 0xFF][..], &[b'a', 0][..]] {
        let mut body = vec![0, 2];
        body.extend_from_slice(topic);
        body.push(0); // properties
        let mut pkt = vec![0x30, body.len() as u8];
        pkt.extend_from_slice(&body);
        let mut p = open5();
        let events = p.feed(&pkt);
        assert_disconnected5(&mut p, events, reason::MALFORMED_PACKET);
    }
}

#[test]
fn topic_aliases_in() {
    let mut p = open5();
    let m = one_publish(p.feed(&publish5(
        "long/topic",
        mqttbytes::QoS::AtMostOnce,
        0,
        alias(1),
    )));
    assert_eq!(m.topic, "long/topic");
    let m = one_publish(p.feed(&publish5("", mqttbytes::QoS::AtMostOnce, 0, alias(1))));
    assert_eq!(m.topic, "long/topic");
    // Remapped.
    one_publish(p.feed(&publish5("other", mqttbytes::QoS::AtMostOnce, 0, alias(1))));
    let m = one_publish(p.feed(&publish5("", mqttbytes::QoS::AtMostOnce, 0, alias(1))));
    assert_eq!(m.topic, "other");
    // Unknown alias with an empty topic.
    let events = p.feed(&publish5("", mqttbytes::QoS::AtMostOnce, 0, alias(2)));
    assert_disconnected5(&mut p, events, reason::PROTOCOL_ERROR);
    // Above the maximum (64 by default), and 0.
    for a in [65, 0] {
        let mut p = open5();
        let events = p.feed(&publish5("t", mqttbytes::QoS::AtMostOnce, 0, alias(a)));
        assert_disconnected5(&mut p, events, reason::TOPIC_ALIAS_INVALID);
    }
}

#[test]
fn qos_and_retain_limits() {
    let config = ServerConfig {
        maximum_qos: QoS::AtLeastOnce,
        retain_available: false,
        ..ServerConfig::default()
    };
    let (mut p, _) = open5_with(config.clone(), connect5("x", None));
    let events = p.feed(&publish5("t", mqttbytes::QoS::ExactlyOnce, 1, None));
    assert_disconnected5(&mut p, events, reason::QOS_NOT_SUPPORTED);

    let (mut p, _) = open5_with(config.clone(), connect5("x", None));
    let mut pkt = v5::Publish::new("t", mqttbytes::QoS::AtMostOnce, b"x".to_vec());
    pkt.retain = true;
    let events = p.feed(&enc(|b| pkt.write(b)));
    assert_disconnected5(&mut p, events, reason::RETAIN_NOT_SUPPORTED);

    let mut p = open4_with(config, connect4("x", true, 0));
    let events = p.feed(&publish4("t", mqttbytes::QoS::ExactlyOnce, 1));
    assert_closed4(&mut p, events, reason::QOS_NOT_SUPPORTED);
}

#[test]
fn receive_maximum_in() {
    let config = ServerConfig {
        receive_maximum: 2,
        ..ServerConfig::default()
    };
    let (mut p, a) = open5_with(config.clone(), connect5("x", None));
    assert_eq!(a.properties.expect("props").receive_max, Some(2));
    one_publish(p.feed(&publish5("t", mqttbytes::QoS::AtLeastOnce, 1, None)));
    one_publish(p.feed(&publish5("t", mqttbytes::QoS::ExactlyOnce, 2, None)));
    // QoS 0 does not count.
    one_publish(p.feed(&publish5("t", mqttbytes::QoS::AtMostOnce, 0, None)));
    p.c.puback(1, 0);
    p.out5();
    one_publish(p.feed(&publish5("t", mqttbytes::QoS::AtLeastOnce, 3, None)));
    let events = p.feed(&publish5("t", mqttbytes::QoS::AtLeastOnce, 4, None));
    assert_disconnected5(&mut p, events, reason::RECEIVE_MAXIMUM_EXCEEDED);

    // A QoS 2 publish counts until PUBCOMP.
    let (mut p, _) = open5_with(config.clone(), connect5("x", None));
    one_publish(p.feed(&publish5("t", mqttbytes::QoS::ExactlyOnce, 1, None)));
    p.c.pubrec(1, 0);
    one_publish(p.feed(&publish5("t", mqttbytes::QoS::ExactlyOnce, 2, None)));
    let events = p.feed(&publish5("t", mqttbytes::QoS::ExactlyOnce, 3, None));
    assert_eq!(expect_closed(events).0, reason::RECEIVE_MAXIMUM_EXCEEDED);

    // 3.1.1 has no receive maximum on the wire: counted, not enforced.
    let mut p = open4_with(config, connect4("x", true, 0));
    for id in 1..=3 {
        one_publish(p.feed(&publish4("t", mqttbytes::QoS::AtLeastOnce, id)));
    }
    assert_eq!(p.c.incoming_in_flight(), 3);
}

#[test]
fn qos2_duplicates_are_not_delivered_twice() {
    let mut p = open5();
    one_publish(p.feed(&publish5("t", mqttbytes::QoS::ExactlyOnce, 7, None)));
    // Resent before the session answered: no second event.
    assert!(p
        .feed(&publish5("t", mqttbytes::QoS::ExactlyOnce, 7, None))
        .is_empty());
    assert!(p.raw().is_empty());
    p.c.pubrec(7, 0);
    assert!(matches!(p.out5().as_slice(), [v5::Packet::PubRec(r)] if r.pkid == 7));
    // Resent after PUBREC: PUBREC again, no event.
    let mut dup = v5::Publish::new("t", mqttbytes::QoS::ExactlyOnce, b"x".to_vec());
    dup.pkid = 7;
    dup.dup = true;
    assert!(p.feed(&enc(|b| dup.write(b))).is_empty());
    assert!(
        matches!(p.out5().as_slice(), [v5::Packet::PubRec(r)] if r.pkid == 7 && r.reason == v5::PubRecReason::Success)
    );
    // PUBREL → event; a repeated PUBREL waits for the same pubcomp.
    let events = p.feed(&enc(|b| v5::PubRel::new(7).write(b)));
    assert!(matches!(
        events.as_slice(),
        [Event::PubRel { packet_id: 7 }]
    ));
    assert!(p.feed(&enc(|b| v5::PubRel::new(7).write(b))).is_empty());
    p.c.pubcomp(7);
    assert!(matches!(p.out5().as_slice(), [v5::Packet::PubComp(c)] if c.pkid == 7));
    // The id is free again: a new message.
    one_publish(p.feed(&publish5("t", mqttbytes::QoS::ExactlyOnce, 7, None)));
}

#[test]
fn qos1_resend_before_the_answer_is_not_repeated() {
    let mut p = open4();
    one_publish(p.feed(&publish4("t", mqttbytes::QoS::AtLeastOnce, 5)));
    assert!(p
        .feed(&publish4("t", mqttbytes::QoS::AtLeastOnce, 5))
        .is_empty());
    p.c.puback(5, 0);
    one_publish(p.feed(&publish4("t", mqttbytes::QoS::AtLeastOnce, 5)));
}

#[test]
fn pubrec_failure_ends_the_exchange() {
    let mut p = open5();
    one_publish(p.feed(&publish5("t", mqttbytes::QoS::ExactlyOnce, 1, None)));
    p.c.pubrec(1, reason::QUOTA_EXCEEDED);
    assert!(
        matches!(p.out5().as_slice(), [v5::Packet::PubRec(r)] if r.reason == v5::PubRecReason::QuotaExceeded)
    );
    assert_eq!(p.c.incoming_in_flight(), 0);
    // A PUBREL now is for an unknown id.
    assert!(p.feed(&enc(|b| v5::PubRel::new(1).write(b))).is_empty());
    assert!(
        matches!(p.out5().as_slice(), [v5::Packet::PubComp(c)] if c.reason == v5::PubCompReason::PacketIdentifierNotFound)
    );
}

#[test]
fn pubrel_for_unknown_id() {
    let mut p = open5();
    assert!(p.feed(&enc(|b| v5::PubRel::new(42).write(b))).is_empty());
    match p.out5().as_slice() {
        [v5::Packet::PubComp(c)] => {
            assert_eq!(
                (c.pkid, c.reason),
                (42, v5::PubCompReason::PacketIdentifierNotFound)
            )
        }
        other => panic!("{other:?}"),
    }
    let mut p = open4();
    assert!(p.feed(&enc(|b| v4::PubRel::new(42).write(b))).is_empty());
    assert!(matches!(p.out4().as_slice(), [v4::Packet::PubComp(c)] if c.pkid == 42));
}

#[test]
fn expect_pubrel_after_resume() {
    let mut p = open5();
    p.c.expect_pubrel(11);
    // The client resends the PUBLISH it had PUBREC'd: no new delivery.
    assert!(p
        .feed(&publish5("t", mqttbytes::QoS::ExactlyOnce, 11, None))
        .is_empty());
    assert!(matches!(p.out5().as_slice(), [v5::Packet::PubRec(r)] if r.pkid == 11));
    let events = p.feed(&enc(|b| v5::PubRel::new(11).write(b)));
    assert!(matches!(
        events.as_slice(),
        [Event::PubRel { packet_id: 11 }]
    ));
}

#[test]
fn packet_too_large_in() {
    let config = ServerConfig {
        maximum_packet_size: 64,
        ..ServerConfig::default()
    };
    let big = v5::Publish::new("t", mqttbytes::QoS::AtMostOnce, vec![0u8; 100]);
    let bytes = enc(|b| big.write(b));
    let (mut p, _) = open5_with(config.clone(), connect5("x", None));
    // Refused on the fixed header, before the body is buffered.
    let events = p.feed(&bytes[..3]);
    assert_disconnected5(&mut p, events, reason::PACKET_TOO_LARGE);

    let mut p = open4_with(config.clone(), connect4("x", true, 0));
    let big4 = v4::Publish::new("t", mqttbytes::QoS::AtMostOnce, vec![0u8; 100]);
    let events = p.feed(&enc(|b| big4.write(b)));
    assert_closed4(&mut p, events, reason::PACKET_TOO_LARGE);

    // An MQTT 5 CONNECT too large still gets a CONNACK.
    let mut c = connect5("x", None);
    c.set_login("u", &"p".repeat(100));
    let mut p = Peer::new(config);
    let (code, _) = expect_closed(p.feed(&enc(|b| c.write(b))));
    assert_eq!(code, reason::PACKET_TOO_LARGE);
    assert!(
        matches!(p.out5().as_slice(), [v5::Packet::ConnAck(a)] if a.code == v5::ConnectReturnCode::PacketTooLarge)
    );
}

#[test]
fn malformed_packets() {
    let cases: &[(&str, Vec<u8>, u8)] = &[
        (
            "PUBLISH QoS 3",
            vec![0x36, 5, 0, 1, b't', 0, 1],
            reason::MALFORMED_PACKET,
        ),
        (
            "PUBLISH QoS 0 with DUP",
            vec![0x38, 4, 0, 1, b't', 0],
            reason::MALFORMED_PACKET,
        ),
        (
            "SUBSCRIBE flags 0",
            vec![0x80, 6, 0, 1, 0, 0, 1, b'a'],
            reason::MALFORMED_PACKET,
        ),
        (
            "remaining length of 5 bytes",
            vec![0x30, 0xFF, 0xFF, 0xFF, 0xFF, 0x01],
            reason::MALFORMED_PACKET,
        ),
        ("reserved type 0", vec![0x00, 0], reason::MALFORMED_PACKET),
        (
            "PUBACK too short",
            vec![0x40, 1, 0],
            reason::MALFORMED_PACKET,
        ),
        (
            "QoS 1 PUBLISH with id 0",
            vec![0x32, 6, 0, 1, b't', 0, 0, 0],
            reason::PROTOCOL_ERROR,
        ),
        (
            "property past its block",
            vec![0x30, 7, 0, 1, b't', 2, 2, 0, 0],
            reason::MALFORMED_PACKET,
        ),
        (
            "repeated property",
            vec![0x30, 8, 0, 1, b't', 4, 1, 0, 1, 0],
            reason::PROTOCOL_ERROR,
        ),
        (
            "subscription id from a client",
            vec![0x30, 6, 0, 1, b't', 2, 11, 1],
            reason::PROTOCOL_ERROR,
        ),
        ("AUTH", vec![0xF0, 0], reason::PROTOCOL_ERROR),
        (
            "CONNACK from a client",
            vec![0x20, 3, 0, 0, 0],
            reason::PROTOCOL_ERROR,
        ),
    ];
    for (what, bytes, code) in cases {
        let mut p = open5();
        let events = p.feed(bytes);
        let (reason, text) = expect_closed(events);
        assert_eq!(reason, *code, "{what}: {text}");
        assert!(
            matches!(p.out5().as_slice(), [v5::Packet::Disconnect(d)] if d.reason_code as u8 == *code),
            "{what}"
        );
    }
    // 3.1.1: closed without a packet.
    for bytes in [
        vec![0x36u8, 5, 0, 1, b't', 0, 1],
        vec![0x40, 3, 0, 1, 0],
        vec![0xE0, 1, 0],
        vec![0xF0, 0],
    ] {
        let mut p = open4();
        let events = p.feed(&bytes);
        assert_eq!(
            expect_closed(events).0,
            reason::MALFORMED_PACKET,
            "{bytes:?}"
        );
        assert!(p.raw().is_empty());
    }
}

// ---------------------------------------------------------------- PUBLISH out

fn open5_client(props: v5::ConnectProperties) -> Peer {
    open5_with(ServerConfig::default(), connect5("x", Some(props))).0
}

#[test]
fn publish_out_ids_and_quota() {
    let mut props = connect_props();
    props.receive_maximum = Some(2);
    let mut p = open5_client(props);
    assert!(p.c.can_send());
    assert_eq!(p.c.publish(outgoing("a", QoS::AtMostOnce)), Ok(None));
    assert_eq!(p.c.publish(outgoing("a", QoS::AtLeastOnce)), Ok(Some(1)));
    assert_eq!(p.c.publish(outgoing("a", QoS::ExactlyOnce)), Ok(Some(2)));
    assert!(!p.c.can_send());
    assert_eq!(
        p.c.publish(outgoing("a", QoS::AtLeastOnce)),
        Err(SendError::NoQuota)
    );
    // QoS 0 needs no quota.
    assert_eq!(p.c.publish(outgoing("a", QoS::AtMostOnce)), Ok(None));
    let sent = p.out5();
    assert_eq!(sent.len(), 4);
    assert!(
        matches!(&sent[1], v5::Packet::Publish(x) if x.pkid == 1 && x.qos == mqttbytes::QoS::AtLeastOnce)
    );

    let events = p.feed(&enc(|b| v5::PubAck::new(1).write(b)));
    assert!(matches!(
        events.as_slice(),
        [Event::PubAck {
            packet_id: 1,
            reason: 0
        }]
    ));
    assert!(p.c.can_send());
    // An ack for an id not in flight is ignored.
    assert!(p.feed(&enc(|b| v5::PubAck::new(1).write(b))).is_empty());

    // QoS 2: PUBREC → PUBREL written and PubRec; PUBCOMP → PubComp.
    let events = p.feed(&enc(|b| v5::PubRec::new(2).write(b)));
    assert!(matches!(
        events.as_slice(),
        [Event::PubRec {
            packet_id: 2,
            reason: 0
        }]
    ));
    assert!(matches!(p.out5().as_slice(), [v5::Packet::PubRel(r)] if r.pkid == 2));
    assert!(!p.c.can_send() || p.c.outgoing_in_flight() == 1);
    let events = p.feed(&enc(|b| v5::PubComp::new(2).write(b)));
    assert!(matches!(
        events.as_slice(),
        [Event::PubComp { packet_id: 2 }]
    ));
    assert_eq!(p.c.outgoing_in_flight(), 0);
    // Ids go on from where they were.
    assert_eq!(p.c.publish(outgoing("a", QoS::AtLeastOnce)), Ok(Some(3)));
}

#[test]
fn publish_out_skips_ids_in_flight() {
    let mut p = open4();
    let mut resend = outgoing("a", QoS::AtLeastOnce);
    resend.dup = true;
    resend.packet_id = Some(1);
    assert_eq!(p.c.publish(resend.clone()), Ok(Some(1)));
    assert_eq!(p.c.publish(outgoing("a", QoS::AtLeastOnce)), Ok(Some(2)));
    // Resending an id in flight takes no more quota and keeps the id.
    assert_eq!(p.c.publish(resend), Ok(Some(1)));
    assert_eq!(p.c.outgoing_in_flight(), 2);
    let sent = p.out4();
    assert!(matches!(&sent[0], v4::Packet::Publish(x) if x.dup && x.pkid == 1));
}

#[test]
fn publish_out_qos0_never_dup() {
    let mut p = open4();
    let mut m = outgoing("a", QoS::AtMostOnce);
    m.dup = true;
    m.packet_id = Some(3);
    assert_eq!(p.c.publish(m), Ok(None));
    assert_eq!(p.raw()[0], 0x30, "no DUP, no packet id on QoS 0");
}

#[test]
fn publish_out_pubrec_failure_frees_the_id() {
    let mut p = open5();
    assert_eq!(p.c.publish(outgoing("a", QoS::ExactlyOnce)), Ok(Some(1)));
    p.out5();
    let rec = v5::PubRec {
        pkid: 1,
        reason: v5::PubRecReason::NotAuthorized,
        properties: None,
    };
    let events = p.feed(&enc(|b| rec.write(b)));
    assert!(matches!(
        events.as_slice(),
        [Event::PubRec {
            packet_id: 1,
            reason: 0x87
        }]
    ));
    assert!(p.raw().is_empty(), "no PUBREL after a failure");
    assert_eq!(p.c.outgoing_in_flight(), 0);
}

#[test]
fn pubrel_resend_after_reconnect() {
    let mut p = open4();
    p.c.pubrel(9);
    assert!(matches!(p.out4().as_slice(), [v4::Packet::PubRel(r)] if r.pkid == 9));
    let events = p.feed(&enc(|b| v4::PubComp::new(9).write(b)));
    assert!(matches!(
        events.as_slice(),
        [Event::PubComp { packet_id: 9 }]
    ));
}

#[test]
fn publish_out_too_large_for_the_client() {
    let mut props = connect_props();
    props.max_packet_size = Some(64);
    let mut p = open5_client(props);
    let mut big = outgoing("a", QoS::AtLeastOnce);
    big.payload = Bytes::from(vec![0u8; 100]);
    assert_eq!(p.c.publish(big), Err(SendError::TooLarge));
    assert!(p.raw().is_empty());
    assert_eq!(p.c.outgoing_in_flight(), 0);
    // No id was used up.
    assert_eq!(p.c.publish(outgoing("a", QoS::AtLeastOnce)), Ok(Some(1)));
}

#[test]
fn publish_out_before_connack() {
    let mut p = Peer::new(ServerConfig::default());
    assert_eq!(
        p.c.publish(outgoing("a", QoS::AtMostOnce)),
        Err(SendError::NotConnected)
    );
    expect_connect(p.feed(&enc(|b| connect4("x", true, 0).write(b))));
    assert!(!p.c.can_send());
    assert_eq!(
        p.c.publish(outgoing("a", QoS::AtMostOnce)),
        Err(SendError::NotConnected)
    );
}

#[test]
fn topic_aliases_out() {
    let mut props = connect_props();
    props.topic_alias_max = Some(1);
    let mut p = open5_client(props);
    for topic in ["a/b", "a/b", "c"] {
        p.c.publish(outgoing(topic, QoS::AtMostOnce)).expect("sent");
    }
    let sent: Vec<(String, Option<u16>)> = p
        .out5()
        .into_iter()
        .map(|x| match x {
            v5::Packet::Publish(x) => (x.topic, x.properties.and_then(|p| p.topic_alias)),
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(
        sent,
        [
            ("a/b".into(), Some(1)),
            (String::new(), Some(1)),
            ("c".into(), None)
        ]
    );
    // The server's own maximum bounds them too.
    let mut props = connect_props();
    props.topic_alias_max = Some(1000);
    let config = ServerConfig {
        topic_alias_maximum: 1,
        ..ServerConfig::default()
    };
    let (mut p, _) = open5_with(config, connect5("x", Some(props)));
    for topic in ["a", "b"] {
        p.c.publish(outgoing(topic, QoS::AtMostOnce)).expect("sent");
    }
    let aliases: Vec<Option<u16>> = p
        .out5()
        .into_iter()
        .map(|x| match x {
            v5::Packet::Publish(x) => x.properties.and_then(|p| p.topic_alias),
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(aliases, [Some(1), None]);
    // Without the client's consent: never.
    let mut p = open5();
    p.c.publish(outgoing("a/b", QoS::AtMostOnce)).expect("sent");
    p.c.publish(outgoing("a/b", QoS::AtMostOnce)).expect("sent");
    for x in p.out5() {
        assert!(matches!(x, v5::Packet::Publish(x) if x.topic == "a/b" && x.properties.is_none()));
    }
}

#[test]
fn publish_out_properties() {
    let mut msg = outgoing("t", QoS::AtMostOnce);
    msg.retain = true;
    msg.properties = MessageProperties {
        payload_is_utf8: Some(true),
        message_expiry_secs: Some(17),
        content_type: Some("text/plain".into()),
        response_topic: Some("r".into()),
        correlation_data: Some(Bytes::from_static(b"id")),
        user_properties: vec![("k".into(), "v".into())],
    };
    msg.subscription_ids = vec![1, 300, 0, u32::MAX];
    let mut p = open5();
    p.c.publish(msg.clone()).expect("sent");
    match p.out5().as_slice() {
        [v5::Packet::Publish(x)] => {
            assert!(x.retain);
            let pp = x.properties.as_ref().expect("properties");
            assert_eq!(pp.payload_format_indicator, Some(1));
            assert_eq!(pp.message_expiry_interval, Some(17));
            assert_eq!(pp.content_type.as_deref(), Some("text/plain"));
            assert_eq!(pp.response_topic.as_deref(), Some("r"));
            assert_eq!(pp.correlation_data.as_deref(), Some(&b"id"[..]));
            assert_eq!(pp.user_properties, [("k".to_string(), "v".to_string())]);
            assert_eq!(
                pp.subscription_identifiers,
                [1, 300],
                "0 and > 268,435,455 left out"
            );
        }
        other => panic!("{other:?}"),
    }
    // 3.1.1 drops them.
    let mut p = open4();
    p.c.publish(msg).expect("sent");
    match p.out4().as_slice() {
        [v4::Packet::Publish(x)] => {
            assert_eq!((x.topic.as_str(), &x.payload[..]), ("t", &b"payload"[..]))
        }
        other => panic!("{other:?}"),
    }
}

// ---------------------------------------------------------------- SUBSCRIBE

fn sub_filter(path: &str, qos: mqttbytes::QoS) -> v5::SubscribeFilter {
    v5::SubscribeFilter::new(path.into(), qos)
}

#[test]
fn subscribe_5() {
    let mut no_local = sub_filter("a/+", mqttbytes::QoS::AtLeastOnce);
    no_local.nolocal = true;
    no_local.preserve_retain = true;
    no_local.retain_forward_rule = v5::RetainForwardRule::Never;
    let sub = v5::Subscribe {
        pkid: 12,
        filters: vec![
            no_local,
            sub_filter("$share/g/x/#", mqttbytes::QoS::ExactlyOnce),
            sub_filter("a/#/b", mqttbytes::QoS::AtMostOnce),
        ],
        properties: Some(v5::SubscribeProperties {
            id: Some(5),
            user_properties: vec![("u".into(), "p".into())],
        }),
    };
    let mut p = open5();
    let events = p.feed(&enc(|b| sub.write(b)));
    let [Event::Subscribe {
        packet_id,
        filters,
        subscription_id,
        user_properties,
    }] = <[Event; 1]>::try_from(events).expect("one event")
    else {
        panic!("not a Subscribe")
    };
    assert_eq!((packet_id, subscription_id), (12, Some(5)));
    assert_eq!(user_properties, [("u".to_string(), "p".to_string())]);
    assert_eq!(filters[0].filter, "a/+");
    assert!(filters[0].no_local && filters[0].retain_as_published);
    assert_eq!(
        (
            filters[0].retain_handling,
            filters[0].qos,
            filters[0].invalid
        ),
        (2, QoS::AtLeastOnce, None)
    );
    let shared = filters[1].shared.as_ref().expect("shared");
    assert_eq!(
        (shared.group.as_str(), shared.filter.as_str()),
        ("g", "x/#")
    );
    assert_eq!(filters[1].filter, "$share/g/x/#");
    assert_eq!(filters[2].invalid, Some(reason::TOPIC_FILTER_INVALID));
    p.c.suback(12, &[1, 2, reason::TOPIC_FILTER_INVALID]);
    match p.out5().as_slice() {
        [v5::Packet::SubAck(a)] => {
            assert_eq!(a.pkid, 12);
            assert_eq!(
                a.return_codes,
                [
                    v5::SubscribeReasonCode::QoS1,
                    v5::SubscribeReasonCode::QoS2,
                    v5::SubscribeReasonCode::TopicFilterInvalid
                ]
            );
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn subscribe_errors_5() {
    // Shared subscriptions off: 0x9E for that filter only.
    let config = ServerConfig {
        shared_subscriptions: false,
        ..ServerConfig::default()
    };
    let (mut p, _) = open5_with(config, connect5("x", None));
    let sub = v5::Subscribe::new("$share/g/t", mqttbytes::QoS::AtMostOnce);
    let mut sub = sub;
    sub.pkid = 1;
    let events = p.feed(&enc(|b| sub.write(b)));
    assert!(
        matches!(events.as_slice(), [Event::Subscribe { filters, .. }] if filters[0].invalid == Some(reason::SHARED_SUBSCRIPTIONS_NOT_SUPPORTED))
    );

    // No-local on a shared subscription: protocol error.
    let mut f = sub_filter("$share/g/t", mqttbytes::QoS::AtMostOnce);
    f.nolocal = true;
    let mut sub = v5::Subscribe::new_many([f]);
    sub.pkid = 1;
    let mut p = open5();
    let events = p.feed(&enc(|b| sub.write(b)));
    assert_disconnected5(&mut p, events, reason::PROTOCOL_ERROR);

    // Subscription identifier 0.
    let mut sub = v5::Subscribe::new("t", mqttbytes::QoS::AtMostOnce);
    sub.pkid = 1;
    sub.properties = Some(v5::SubscribeProperties {
        id: Some(0),
        user_properties: Vec::new(),
    });
    let mut p = open5();
    let events = p.feed(&enc(|b| sub.write(b)));
    assert_disconnected5(&mut p, events, reason::PROTOCOL_ERROR);

    // No filter at all.
    let mut p = open5();
    let events = p.feed(&[0x82, 3, 0, 1, 0]);
    assert_disconnected5(&mut p, events, reason::PROTOCOL_ERROR);

    // Reserved option bits, retain handling 3.
    for options in [0x40u8, 0x30] {
        let mut p = open5();
        let events = p.feed(&[0x82, 7, 0, 1, 0, 0, 1, b't', options]);
        assert_disconnected5(&mut p, events, reason::MALFORMED_PACKET);
    }
}

#[test]
fn subscribe_311() {
    let mut sub = v4::Subscribe::new("a/+", mqttbytes::QoS::ExactlyOnce);
    sub.add("bad/#/x".into(), mqttbytes::QoS::AtMostOnce);
    sub.pkid = 3;
    let mut p = open4();
    let events = p.feed(&enc(|b| sub.write(b)));
    let [Event::Subscribe {
        packet_id,
        filters,
        subscription_id,
        ..
    }] = <[Event; 1]>::try_from(events).expect("one event")
    else {
        panic!("not a Subscribe")
    };
    assert_eq!((packet_id, subscription_id), (3, None));
    assert_eq!(
        (filters[0].qos, filters[0].invalid),
        (QoS::ExactlyOnce, None)
    );
    assert_eq!(filters[1].invalid, Some(reason::TOPIC_FILTER_INVALID));
    p.c.suback(3, &[2, reason::TOPIC_FILTER_INVALID]);
    assert_eq!(p.raw(), [0x90, 4, 0, 3, 2, 0x80], "3.1.1 failures are 0x80");
    // Options bits above QoS are reserved in 3.1.1.
    let events = p.feed(&[0x82, 6, 0, 1, 0, 1, b't', 0x04]);
    assert_closed4(&mut p, events, reason::MALFORMED_PACKET);
}

#[test]
fn unsubscribe_both_versions() {
    let mut unsub = v5::Unsubscribe::new("a/+");
    unsub.filters.push("b".into());
    unsub.pkid = 4;
    let mut p = open5();
    let events = p.feed(&enc(|b| unsub.write(b)));
    assert!(
        matches!(events.as_slice(), [Event::Unsubscribe { packet_id: 4, filters }] if filters == &["a/+", "b"])
    );
    p.c.unsuback(4, &[0, reason::NO_SUBSCRIPTION_EXISTED]);
    match p.out5().as_slice() {
        [v5::Packet::UnsubAck(a)] => assert_eq!(
            a.reasons,
            [
                v5::UnsubAckReason::Success,
                v5::UnsubAckReason::NoSubscriptionExisted
            ]
        ),
        other => panic!("{other:?}"),
    }

    let mut unsub = v4::Unsubscribe::new("a/+");
    unsub.pkid = 5;
    let mut p = open4();
    let events = p.feed(&enc(|b| unsub.write(b)));
    assert!(
        matches!(events.as_slice(), [Event::Unsubscribe { packet_id: 5, filters }] if filters == &["a/+"])
    );
    p.c.unsuback(5, &[0x11]);
    assert_eq!(p.raw(), [0xB0, 2, 0, 5]);
    // Without a filter: protocol error.
    let events = p.feed(&[0xA2, 2, 0, 6]);
    assert_closed4(&mut p, events, reason::PROTOCOL_ERROR);
}

// ---------------------------------------------------------------- DISCONNECT

#[test]
fn disconnect_from_the_client() {
    let mut p = open4();
    let events = p.feed(&[0xE0, 0]);
    assert!(matches!(
        events.as_slice(),
        [Event::Disconnect {
            publish_will: false,
            session_expiry_secs: None
        }]
    ));
    assert!(p.c.is_finished());
    assert!(p.raw().is_empty());

    // MQTT 5, remaining length 0: normal disconnection.
    let mut p = open5();
    let events = p.feed(&[0xE0, 0]);
    assert!(matches!(
        events.as_slice(),
        [Event::Disconnect {
            publish_will: false,
            ..
        }]
    ));
    // Reason code only (no property length): 0x04 publishes the will.
    let mut p = open5();
    let events = p.feed(&[0xE0, 1, 0x04]);
    assert!(matches!(
        events.as_slice(),
        [Event::Disconnect {
            publish_will: true,
            ..
        }]
    ));
    assert!(p.poll().is_empty());
}

#[test]
fn disconnect_session_expiry() {
    let with_expiry = |s: u32| v5::Disconnect {
        reason_code: v5::DisconnectReasonCode::NormalDisconnection,
        properties: Some(v5::DisconnectProperties {
            session_expiry_interval: Some(s),
            reason_string: None,
            user_properties: Vec::new(),
            server_reference: None,
        }),
    };
    // 0 in CONNECT: raising it is a protocol error.
    let mut p = open5();
    let events = p.feed(&enc(|b| with_expiry(60).write(b)));
    assert_disconnected5(&mut p, events, reason::PROTOCOL_ERROR);
    // Non-zero in CONNECT: any new value.
    let mut props = connect_props();
    props.session_expiry_interval = Some(10);
    let mut p = open5_client(props);
    let events = p.feed(&enc(|b| with_expiry(60).write(b)));
    assert!(matches!(
        events.as_slice(),
        [Event::Disconnect {
            publish_will: false,
            session_expiry_secs: Some(60)
        }]
    ));
}

#[test]
fn disconnect_from_the_server() {
    let mut p = open5();
    p.c.disconnect(
        reason::SESSION_TAKEN_OVER,
        "another connection took the session",
    );
    match p.out5().as_slice() {
        [v5::Packet::Disconnect(d)] => {
            assert_eq!(d.reason_code, v5::DisconnectReasonCode::SessionTakenOver);
            assert_eq!(
                d.properties
                    .as_ref()
                    .and_then(|p| p.reason_string.as_deref()),
                Some("another connection took the session")
            );
        }
        other => panic!("{other:?}"),
    }
    assert!(p.c.is_finished());
    assert!(p.poll().is_empty(), "no Closed for a session-initiated end");
    // The reason string is left out when it would break the client's
    // maximum packet size.
    let mut props = connect_props();
    props.max_packet_size = Some(8);
    let mut p = open5_client(props);
    p.c.disconnect(
        reason::SERVER_SHUTTING_DOWN,
        "the server is shutting down now",
    );
    match p.out5().as_slice() {
        [v5::Packet::Disconnect(d)] => {
            assert_eq!(d.reason_code, v5::DisconnectReasonCode::ServerShuttingDown);
            assert!(d
                .properties
                .as_ref()
                .and_then(|p| p.reason_string.as_ref())
                .is_none());
        }
        other => panic!("{other:?}"),
    }
    // 3.1.1: nothing to say.
    let mut p = open4();
    p.c.disconnect(reason::SESSION_TAKEN_OVER, "x");
    assert!(p.raw().is_empty());
    assert!(p.c.is_finished());
    // While the CONNECT waits: a refusal.
    let mut p = Peer::new(ServerConfig::default());
    expect_connect(p.feed(&enc(|b| connect4("x", true, 0).write(b))));
    p.c.disconnect(reason::SERVER_SHUTTING_DOWN, "x");
    assert_eq!(p.raw(), [0x20, 2, 0, 3]);
}

#[test]
fn answers_after_the_end_write_nothing() {
    let mut p = open5();
    one_publish(p.feed(&publish5("t", mqttbytes::QoS::AtLeastOnce, 1, None)));
    p.c.disconnect(reason::SERVER_SHUTTING_DOWN, "");
    p.raw();
    p.c.puback(1, 0);
    p.c.suback(2, &[0]);
    assert!(p.raw().is_empty());
    assert_eq!(
        p.c.publish(outgoing("t", QoS::AtMostOnce)),
        Err(SendError::NotConnected)
    );
}

// ---------------------------------------------------------------- memory

/// Issue 8 budgets 4 KB of broker memory per idle connection; the
/// adapter's share is its struct (nothing is allocated until used).
#[test]
fn idle_connection_is_small() {
    let size = std::mem::size_of::<Connection>();
    eprintln!("Connection: {size} bytes");
    assert!(size <= 512, "{size} bytes");
    let p = Connection::new(ServerConfig::default(), t0());
    assert_eq!(p.out.capacity(), 0, "out is allocated on first write");
}

// ------------------------------------------- before login, properties (issue 20)

/// `n` empty user properties.
fn user_props(n: usize) -> Vec<(String, String)> {
    vec![(String::new(), String::new()); n]
}

/// The MQTT 5 CONNACK code the server wrote, the connection finished.
fn refused5(p: &mut Peer, events: Vec<Event>) -> v5::ConnectReturnCode {
    let (reason, text) = expect_closed(events);
    assert_eq!(reason, reason::PACKET_TOO_LARGE, "{text}");
    assert!(p.c.is_finished());
    match p.out5().as_slice() {
        [v5::Packet::ConnAck(a)] => a.code,
        other => panic!("expected CONNACK, got {other:?}"),
    }
}

#[test]
fn a_connect_larger_than_the_login_bound_is_refused_at_its_fixed_header() {
    let config = ServerConfig {
        maximum_packet_size: 16 << 20,
        maximum_connect_size: 4096,
        ..ServerConfig::default()
    };
    // The first bytes of an MQTT 5 CONNECT announcing 1 MiB: refused with
    // CONNACK 0x95 before its body is buffered (the packet size would do).
    let mut big = connect5("x", None);
    big.set_login("u", &"p".repeat(1 << 20));
    let bytes = enc(|b| big.write(b));
    let mut p = Peer::new(config.clone());
    assert_eq!(p.c.packet_limit(), 4096, "before login: the CONNECT bound");
    let events = p.feed(&bytes[..16]);
    assert_eq!(
        refused5(&mut p, events),
        v5::ConnectReturnCode::PacketTooLarge
    );
    assert!(p.input.is_empty(), "nothing of it kept");

    // 3.1.1: closed without an answer.
    let mut big4 = connect4("x", true, 0);
    big4.set_login("u", &"p".repeat(5000));
    let mut p = Peer::new(config.clone());
    let events = p.feed(&enc(|b| big4.write(b))[..8]);
    assert_closed4(&mut p, events, reason::PACKET_TOO_LARGE);

    // A CONNECT within the bound is read; once open, packets up to the
    // packet size are.
    let mut ok = connect5("x", None);
    ok.set_login("u", &"p".repeat(4000));
    let (mut p, _) = open5_with(config, ok);
    assert_eq!(p.c.packet_limit(), 16 << 20);
    let publish = v5::Publish::new("t", mqttbytes::QoS::AtMostOnce, vec![7u8; 100_000]);
    let ev = one_publish(p.feed(&enc(|b| publish.write(b))));
    assert_eq!(ev.payload.len(), 100_000);
}

#[test]
fn the_connect_bound_is_at_most_the_packet_size() {
    let config = ServerConfig {
        maximum_packet_size: 1000,
        maximum_connect_size: 8192,
        ..ServerConfig::default()
    };
    assert_eq!(Connection::new(config, t0()).packet_limit(), 1000);
}

#[test]
fn user_properties_are_bounded_in_count_and_bytes() {
    use weir_protocols::mqtt::{MAX_USER_PROPERTIES, MAX_USER_PROPERTY_BYTES};
    let config = || ServerConfig {
        maximum_connect_size: 1 << 20,
        ..ServerConfig::default()
    };
    // CONNECT: as many as allowed pass, one more is CONNACK 0x95.
    let with_props = |n| {
        connect5(
            "x",
            Some(v5::ConnectProperties {
                user_properties: user_props(n),
                ..connect_props()
            }),
        )
    };
    let mut p = Peer::new(config());
    let c = expect_connect(p.feed(&enc(|b| with_props(MAX_USER_PROPERTIES).write(b))));
    assert_eq!(c.user_properties.len(), MAX_USER_PROPERTIES);
    let mut p = Peer::new(config());
    let events = p.feed(&enc(|b| with_props(MAX_USER_PROPERTIES + 1).write(b)));
    assert_eq!(
        refused5(&mut p, events),
        v5::ConnectReturnCode::PacketTooLarge
    );

    // A will with many empty user properties (3.3 million of them cost
    // ~150 MB before this bound): CONNACK 0x95.
    let mut c = connect5("x", None);
    let mut will = v5::LastWill::new("w", "bye", mqttbytes::QoS::AtMostOnce, false);
    will.properties = Some(v5::WillProperties {
        delay_interval: None,
        payload_format_indicator: None,
        message_expiry_interval: None,
        content_type: None,
        response_topic: None,
        correlation_data: None,
        user_properties: user_props(100_000),
    });
    c.last_will = Some(will);
    let mut p = Peer::new(config());
    let events = p.feed(&enc(|b| c.write(b)));
    assert_eq!(
        refused5(&mut p, events),
        v5::ConnectReturnCode::PacketTooLarge
    );

    // PUBLISH: by count, and by bytes (few properties, long values).
    let mut p = open5();
    let props = v5::PublishProperties {
        user_properties: user_props(MAX_USER_PROPERTIES + 1),
        ..pub_props()
    };
    let events = p.feed(&publish5("t", mqttbytes::QoS::AtMostOnce, 0, Some(props)));
    assert_disconnected5(&mut p, events, reason::PACKET_TOO_LARGE);
    let mut p = open5();
    let long = "v".repeat(MAX_USER_PROPERTY_BYTES / 2);
    let props = v5::PublishProperties {
        user_properties: vec![("a".into(), long.clone()), ("b".into(), long)],
        ..pub_props()
    };
    let events = p.feed(&publish5("t", mqttbytes::QoS::AtMostOnce, 0, Some(props)));
    assert_disconnected5(&mut p, events, reason::PACKET_TOO_LARGE);

    // SUBSCRIBE.
    let mut p = open5();
    let mut s = v5::Subscribe::new("t/#", mqttbytes::QoS::AtLeastOnce);
    s.pkid = 1;
    s.properties = Some(v5::SubscribeProperties {
        id: None,
        user_properties: user_props(MAX_USER_PROPERTIES + 1),
    });
    let events = p.feed(&enc(|b| s.write(b)));
    assert_disconnected5(&mut p, events, reason::PACKET_TOO_LARGE);
}
