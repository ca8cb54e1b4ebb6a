//! Issue 20, items 6 and 7 (first half), against the real binary: MQTT
//! subscriptions cost what they deliver, and tenants own their retained
//! budgets.
//!
//! * A filter repeated in one SUBSCRIBE counts once: 60 × `r/#` over 20,000
//!   retained messages sends each once, and the broker's memory does not
//!   grow with the copies.
//! * Retained messages go through the subscriber's window: with receive
//!   maximum 10 and no acks, 10 are in flight and no more, and the rest are
//!   not held as queued packets (memory).
//! * Thousands of wildcard filters over 20,000 retained messages are looked
//!   up in an index, in steps: a fresh MQTT and AMQP client meanwhile are
//!   served at once.
//! * A session's subscriptions are bounded (`mqtt.max_subscriptions`, 0x97).
//! * A tenant at its retained-byte budget leaves other tenants theirs.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use rumqttc::v5::mqttbytes::v5::{
    ConnectProperties, ConnectReturnCode, Filter, Login, Packet, PubAck, PubAckReason, Publish,
    Subscribe, SubscribeReasonCode,
};
use rumqttc::v5::mqttbytes::QoS;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use weir_tests::hardening::broker_rss;
use weir_tests::*;

/// Retained messages the tests set up.
const RETAINED: usize = 20_000;

/// A hand-driven MQTT 5 connection on rumqttc's packet codec: the tests
/// decide exactly what is sent and acknowledged.
struct Mqtt5 {
    stream: TcpStream,
    buf: BytesMut,
}

impl Mqtt5 {
    /// Connects (clean start) as `user` with `receive_maximum`; returns the
    /// connection and the CONNACK's code.
    async fn try_connect(
        port: u16,
        client_id: &str,
        user: &str,
        receive_maximum: Option<u16>,
    ) -> (Mqtt5, ConnectReturnCode) {
        let stream = within("TCP connect", TcpStream::connect(("127.0.0.1", port)))
            .await
            .expect("TCP connect");
        let mut c = Mqtt5 {
            stream,
            buf: BytesMut::new(),
        };
        let mut props = ConnectProperties::new();
        props.receive_maximum = receive_maximum;
        let connect = rumqttc::v5::mqttbytes::v5::Connect {
            keep_alive: 60,
            client_id: client_id.into(),
            clean_start: true,
            properties: Some(props),
        };
        c.send(Packet::Connect(
            connect,
            None,
            Some(Login::new(user, "guest")),
        ))
        .await;
        match c.read().await {
            Packet::ConnAck(a) => (c, a.code),
            p => panic!("expected CONNACK, got {p:?}"),
        }
    }

    async fn connect(port: u16, client_id: &str, receive_maximum: Option<u16>) -> Mqtt5 {
        let (c, code) = Self::try_connect(port, client_id, "guest", receive_maximum).await;
        assert_eq!(code, ConnectReturnCode::Success, "CONNACK of {client_id}");
        c
    }

    async fn send(&mut self, p: Packet) {
        let mut out = BytesMut::new();
        p.write(&mut out).expect("encoding a packet");
        self.send_raw(&out).await;
    }

    async fn send_raw(&mut self, bytes: &[u8]) {
        within("write", self.stream.write_all(bytes))
            .await
            .expect("write to broker");
    }

    async fn read(&mut self) -> Packet {
        loop {
            match Packet::read(&mut self.buf, None) {
                Ok(p) => return p,
                Err(rumqttc::v5::mqttbytes::Error::InsufficientBytes(_)) => {}
                Err(e) => panic!("undecodable packet from the broker: {e}"),
            }
            let n = within("read", self.stream.read_buf(&mut self.buf))
                .await
                .expect("read from broker");
            assert!(n > 0, "the broker closed the connection");
        }
    }

    /// Sends SUBSCRIBE `pkid` with `filters` (retain handling 0).
    async fn send_subscribe(&mut self, pkid: u16, filters: &[String], qos: QoS) {
        let mut s = Subscribe::new_many(filters.iter().map(|f| Filter::new(f.as_str(), qos)), None);
        s.pkid = pkid;
        self.send(Packet::Subscribe(s)).await;
    }

    /// A QoS 1 publish and its PUBACK's reason.
    async fn publish_qos1(
        &mut self,
        pkid: u16,
        topic: &str,
        payload: Vec<u8>,
        retain: bool,
    ) -> PubAckReason {
        let mut p = Publish::new(topic, QoS::AtLeastOnce, payload, None);
        p.pkid = pkid;
        p.retain = retain;
        self.send(Packet::Publish(p)).await;
        loop {
            match self.read().await {
                Packet::PubAck(a) if a.pkid == pkid => return a.reason,
                Packet::PubAck(_) | Packet::PingResp(_) => {}
                p => panic!("unexpected packet while publishing: {p:?}"),
            }
        }
    }
}

/// A PUBACK reason that accepts the publish (retained too when asked).
fn accepted(r: PubAckReason) -> bool {
    matches!(
        r,
        PubAckReason::Success | PubAckReason::NoMatchingSubscribers
    )
}

/// A broker with MQTT; `config` (TOML, may be empty) as its file.
fn start(config: &str) -> (Broker, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("weir.toml");
    std::fs::write(&path, config).expect("config file");
    let b = Broker::start_mqtt_with(&["--config", path.to_str().expect("utf-8 path")]);
    assert!(
        b.wait_for_log("MQTT listener ready", START_TIMEOUT),
        "no MQTT listener\n{}",
        b.run_logs()
    );
    (b, dir)
}

/// Retains `count` 100-byte messages at `qos` on `r/0` … `r/<count-1>`,
/// in pipelined batches of 1,000 (within the broker's receive maximum), each
/// batch's PUBACKs awaited (QoS 1); then `m`, whose PUBACK says every one
/// before it was handled.
async fn retain_many(port: u16, count: usize, qos: QoS) {
    let mut c = Mqtt5::connect(port, "filler", None).await;
    for start in (0..count).step_by(1000) {
        let end = (start + 1000).min(count);
        let mut out = BytesMut::new();
        for i in start..end {
            let mut p = Publish::new(format!("r/{i}"), qos, vec![b'x'; 100], None);
            p.retain = true;
            if qos != QoS::AtMostOnce {
                p.pkid = (i - start + 1) as u16;
            }
            Packet::Publish(p).write(&mut out).expect("encode");
        }
        c.send_raw(&out).await;
        let mut acked = 0;
        while qos != QoS::AtMostOnce && acked < end - start {
            match c.read().await {
                Packet::PubAck(a) => {
                    assert!(accepted(a.reason), "{:?}", a.reason);
                    acked += 1;
                }
                p => panic!("unexpected packet while retaining: {p:?}"),
            }
        }
    }
    let reason = c.publish_qos1(1, "m", b"marker".to_vec(), true).await;
    assert!(accepted(reason), "{reason:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_filter_repeated_in_one_subscribe_sends_each_retained_message_once() {
    let (broker, _dir) = start("");
    let port = broker.mqtt_port();
    retain_many(port, RETAINED, QoS::AtMostOnce).await;
    let mut sub = Mqtt5::connect(port, "dup", None).await;
    let before = broker_rss(&broker);
    sub.send_subscribe(1, &vec!["r/#".to_string(); 60], QoS::AtMostOnce)
        .await;
    // Then one more subscription, whose retained message comes after
    // those of the first: the end of the first's.
    sub.send_subscribe(2, &["m".to_string()], QoS::AtMostOnce)
        .await;
    let mut seen: HashSet<String> = HashSet::new();
    let mut peak = before;
    loop {
        match sub.read().await {
            Packet::SubAck(a) if a.pkid == 1 => {
                assert_eq!(a.return_codes.len(), 60);
                assert!(a
                    .return_codes
                    .iter()
                    .all(|c| *c == SubscribeReasonCode::Success(QoS::AtMostOnce)));
            }
            Packet::SubAck(_) => {}
            Packet::Publish(p) => {
                assert!(p.retain, "sent as retained");
                let topic = String::from_utf8(p.topic.to_vec()).expect("utf-8 topic");
                if topic == "m" {
                    break;
                }
                assert!(
                    seen.insert(topic.clone()),
                    "{topic} received twice (after {} distinct)",
                    seen.len()
                );
                if seen.len().is_multiple_of(2000) {
                    peak = peak.max(broker_rss(&broker));
                }
            }
            p => panic!("unexpected packet {p:?}"),
        }
    }
    assert_eq!(seen.len(), RETAINED, "every retained message once");
    let grew = peak.max(broker_rss(&broker)).saturating_sub(before);
    assert!(
        grew < 48 << 20,
        "the broker grew by {} MB for one subscription's retained messages",
        grew >> 20
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retained_messages_wait_for_the_subscribers_window() {
    let (broker, _dir) = start("");
    let port = broker.mqtt_port();
    // QoS 1: sent at QoS 1 (the lower of the message's and the subscription's).
    retain_many(port, RETAINED, QoS::AtLeastOnce).await;
    let mut sub = Mqtt5::connect(port, "slow", Some(10)).await;
    let before = broker_rss(&broker);
    // 60 copies: 1.2 M retained publishes owed, were they all queued.
    sub.send_subscribe(1, &vec!["r/#".to_string(); 60], QoS::AtLeastOnce)
        .await;
    let mut held = Vec::new();
    while held.len() < 10 {
        match sub.read().await {
            Packet::SubAck(_) => {}
            Packet::Publish(p) => {
                assert_eq!(p.qos, QoS::AtLeastOnce);
                held.push(p.pkid);
            }
            p => panic!("unexpected packet {p:?}"),
        }
    }
    let grew = broker_rss(&broker).saturating_sub(before);
    assert!(
        grew < 32 << 20,
        "the broker grew by {} MB holding retained publishes the client has no room for",
        grew >> 20
    );
    // Nothing beyond the window: the ping's answer comes with no publish
    // before it.
    sub.send(Packet::PingReq(rumqttc::v5::mqttbytes::v5::PingReq))
        .await;
    match sub.read().await {
        Packet::PingResp(_) => {}
        p => panic!("an 11th packet in flight with receive maximum 10: {p:?}"),
    }
    // Acks open the window again.
    for pkid in held.drain(..) {
        sub.send(Packet::PubAck(PubAck::new(pkid, None))).await;
    }
    while held.len() < 10 {
        if let Packet::Publish(p) = sub.read().await {
            held.push(p.pkid);
        }
    }
}

/// How long a fresh MQTT client takes to be connected, and a fresh AMQP
/// client to open a channel.
async fn fresh_clients(broker: &Broker, n: u32) -> (Duration, Duration) {
    let t = Instant::now();
    let _c = Mqtt5::connect(broker.mqtt_port(), &format!("probe-{n}"), None).await;
    let mqtt = t.elapsed();
    let t = Instant::now();
    let conn = connect(&broker.url()).await;
    let _ch = conn.create_channel().await.expect("channel.open");
    let amqp = t.elapsed();
    let _ = conn.close(200, "bye".into()).await;
    (mqtt, amqp)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fresh_clients_are_served_while_thousands_of_wildcard_filters_are_looked_up() {
    let (broker, _dir) = start("");
    let port = broker.mqtt_port();
    retain_many(port, RETAINED, QoS::AtMostOnce).await;
    // Two sessions, 1,000 wildcard filters each: `+/<i>/#` matches `r/<i>`
    // (a scan of every topic without an index).
    let mut attackers = Vec::new();
    for a in 0..2 {
        let mut c = Mqtt5::connect(port, &format!("wild-{a}"), None).await;
        let filters: Vec<String> = (0..1000).map(|i| format!("+/{}/#", a * 1000 + i)).collect();
        c.send_subscribe(1, &filters, QoS::AtMostOnce).await;
        attackers.push(c);
    }
    let mut worst = (Duration::ZERO, Duration::ZERO);
    for n in 0..3 {
        let (m, a) = fresh_clients(&broker, n).await;
        worst = (worst.0.max(m), worst.1.max(a));
    }
    // The issue asks for 1 s; a debug build on a shared machine gets 2.
    assert!(
        worst.0 < Duration::from_secs(2) && worst.1 < Duration::from_secs(2),
        "fresh clients waited {worst:?} (MQTT, AMQP) behind the wildcard filters"
    );
    // Each filter's one retained message, once.
    for (a, c) in attackers.iter_mut().enumerate() {
        let mut seen = HashSet::new();
        let mut subacked = false;
        while seen.len() < 1000 || !subacked {
            match c.read().await {
                Packet::SubAck(s) => {
                    assert_eq!(s.return_codes.len(), 1000);
                    subacked = true;
                }
                Packet::Publish(p) => {
                    let topic = String::from_utf8(p.topic.to_vec()).expect("utf-8");
                    let i: usize = topic["r/".len()..].parse().expect("r/<i>");
                    assert!((a * 1000..a * 1000 + 1000).contains(&i), "{topic}");
                    assert!(seen.insert(i), "{topic} twice");
                }
                p => panic!("unexpected packet {p:?}"),
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sessions_subscriptions_are_bounded() {
    // The default bound: 1,000.
    let (broker, _dir) = start("");
    let mut c = Mqtt5::connect(broker.mqtt_port(), "many", None).await;
    let filters: Vec<String> = (0..1001).map(|i| format!("f/{i}/+")).collect();
    c.send_subscribe(1, &filters, QoS::AtMostOnce).await;
    let codes = match c.read().await {
        Packet::SubAck(a) => a.return_codes,
        p => panic!("expected SUBACK, got {p:?}"),
    };
    assert!(codes[..1000]
        .iter()
        .all(|c| *c == SubscribeReasonCode::Success(QoS::AtMostOnce)));
    assert_eq!(codes[1000], SubscribeReasonCode::QuotaExceeded);
    // A filter it has is replaced, not added; an unsubscribe makes room.
    c.send_subscribe(2, &["f/0/+".to_string()], QoS::AtLeastOnce)
        .await;
    match c.read().await {
        Packet::SubAck(a) => assert_eq!(
            a.return_codes,
            [SubscribeReasonCode::Success(QoS::AtLeastOnce)]
        ),
        p => panic!("expected SUBACK, got {p:?}"),
    }
    let mut u = rumqttc::v5::mqttbytes::v5::Unsubscribe::new("f/1/+", None);
    u.pkid = 3;
    c.send(Packet::Unsubscribe(u)).await;
    assert!(matches!(c.read().await, Packet::UnsubAck(_)));
    c.send_subscribe(4, &["f/new".to_string()], QoS::AtMostOnce)
        .await;
    match c.read().await {
        Packet::SubAck(a) => assert_eq!(
            a.return_codes,
            [SubscribeReasonCode::Success(QoS::AtMostOnce)]
        ),
        p => panic!("expected SUBACK, got {p:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_at_its_retained_budget_leaves_other_tenants_theirs() {
    // Default limits: 64 MiB of retained messages in all.
    let (broker, _dir) = start(
        r#"
[[tenants]]
name = "a"
[[tenants]]
name = "b"
[[auth.users]]
name = "u"
password = "guest"
permissions = [
  { vhost = "a", configure = ".*", write = ".*", read = ".*" },
  { vhost = "b", configure = ".*", write = ".*", read = ".*" },
]
"#,
    );
    let port = broker.mqtt_port();
    let (mut a, code) = Mqtt5::try_connect(port, "a1", "a:u", None).await;
    assert_eq!(code, ConnectReturnCode::Success);
    let (mut b, code) = Mqtt5::try_connect(port, "b1", "b:u", None).await;
    assert_eq!(code, ConnectReturnCode::Success);
    // Tenant a retains 600 KB messages until refused (0x97).
    let mut refused_at = None;
    for i in 0..130u16 {
        let r = a
            .publish_qos1(i + 1, &format!("big/{i}"), vec![7; 600_000], true)
            .await;
        if r == PubAckReason::QuotaExceeded {
            refused_at = Some(i);
            break;
        }
        assert!(accepted(r), "publish {i}: {r:?}");
    }
    let refused_at = refused_at.expect("tenant a's retained messages are bounded");
    // Tenant b has its own budget.
    for i in 0..3u16 {
        let r = b
            .publish_qos1(i + 1, &format!("big/{i}"), vec![7; 600_000], true)
            .await;
        assert!(
            accepted(r),
            "tenant b's retained publish {i}: {r:?} (tenant a was refused after {refused_at})"
        );
    }
    // And a is still at its own.
    let r = a
        .publish_qos1(999, "big/more", vec![7; 600_000], true)
        .await;
    assert_eq!(r, PubAckReason::QuotaExceeded);
}
