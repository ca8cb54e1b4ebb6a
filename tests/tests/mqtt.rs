//! MQTT 3.1.1 and 5 against the real `weir` binary (issue 8): rumqttc v4
//! and v5 round trips, a persistent session across `kill -9` with QoS 1 and
//! QoS 2 messages in flight, MQTT ⇄ AMQP through `amq.topic`, and Debian's
//! `mosquitto_pub` / `mosquitto_sub`.
//!
//! The tests' logic can be checked against another broker: with `WEIR_TEST_MQTT_BROKER=host:port`
//! (Debian's Mosquitto from `scripts/start-mosquitto.sh`:
//! `127.0.0.1:1884`) the pure-MQTT tests use that broker instead of
//! starting weir, and the tests that need weir itself (restart, AMQP) say so
//! and return:
//!
//! ```text
//! bash scripts/start-mosquitto.sh
//! WEIR_TEST_MQTT_BROKER=127.0.0.1:1884 cargo nextest run -p weir-tests --test mqtt --run-ignored all
//! ```
//!
//! The restart test's logic can be checked the same way with
//! `WEIR_TEST_MQTT_RESTART_MOSQUITTO=1`: it then runs its own Mosquitto
//! and restarts it with SIGTERM (Mosquitto saves its state only on exit,
//! so a `kill -9` would lose it: that mode checks the test, not
//! durability).
//!
//! Depth (every packet, reason code and option) is in `conformance/mqtt`,
//! which compares paho-mqtt transcripts with Mosquitto's; these tests cover
//! what needs the process (restarts) or another protocol.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

use lapin::options::{BasicConsumeOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::BasicProperties;
use rumqttc::v5::mqttbytes::v5::{
    ConnectProperties, Packet as Packet5, Publish as Publish5, PublishProperties,
};
use rumqttc::v5::mqttbytes::QoS as QoS5;
use rumqttc::{Event, Packet, QoS};
use tokio::sync::mpsc;
use weir_tests::*;

/// Where the pure-MQTT tests connect: an external broker, or a weir started
/// here (kept alive by the value).
enum Target {
    Weir(Broker),
    External(String, u16),
}

impl Target {
    fn start() -> Target {
        match std::env::var("WEIR_TEST_MQTT_BROKER") {
            Ok(addr) => {
                let (host, port) = addr
                    .rsplit_once(':')
                    .unwrap_or_else(|| panic!("WEIR_TEST_MQTT_BROKER={addr}: want host:port"));
                Target::External(host.to_string(), port.parse().expect("port"))
            }
            Err(_) => Target::Weir(start_weir()),
        }
    }

    fn addr(&self) -> (String, u16) {
        match self {
            Target::Weir(b) => ("127.0.0.1".into(), b.mqtt_port()),
            Target::External(h, p) => (h.clone(), *p),
        }
    }
}

/// A weir with an MQTT listener on a free port, ready to accept.
fn start_weir() -> Broker {
    let b = Broker::start_mqtt_with(&[]);
    assert!(
        b.wait_for_log("MQTT listener ready", START_TIMEOUT),
        "weir did not log `MQTT listener ready`\n{}",
        b.run_logs()
    );
    b
}

/// Tests that need weir itself (restart, AMQP) skip an external broker.
fn external_broker() -> bool {
    if std::env::var_os("WEIR_TEST_MQTT_BROKER").is_some() {
        eprintln!("WEIR_TEST_MQTT_BROKER is set: this test needs weir itself, skipped");
        return true;
    }
    false
}

/// A client id / topic level unique to this test run (the external broker
/// keeps sessions and retained messages between runs).
fn unique(tag: &str) -> String {
    format!("{tag}-{:08x}", rand::random::<u32>())
}

// ---------------------------------------------------------------------------
// rumqttc plumbing: the event loop runs in a task and forwards what it sees.

/// What the v3.1.1 event loop saw: a packet, or the error that ended it.
type Ev4 = Result<Packet, String>;
type Ev5 = Result<Packet5, String>;

fn v4_client(
    id: &str,
    (host, port): &(String, u16),
    setup: impl FnOnce(&mut rumqttc::MqttOptions),
) -> (rumqttc::AsyncClient, mpsc::UnboundedReceiver<Ev4>) {
    let mut o = rumqttc::MqttOptions::new(id, host.clone(), *port);
    o.set_credentials("guest", "guest");
    o.set_keep_alive(Duration::from_secs(30));
    setup(&mut o);
    let (client, mut eventloop) = rumqttc::AsyncClient::new(o, 100);
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        loop {
            match eventloop.poll().await {
                Ok(Event::Incoming(p)) => {
                    if tx.send(Ok(p)).is_err() {
                        return;
                    }
                }
                Ok(Event::Outgoing(_)) => {}
                Err(e) => {
                    // No automatic reconnect: the test decides.
                    let _ = tx.send(Err(e.to_string()));
                    return;
                }
            }
        }
    });
    (client, rx)
}

fn v5_client(
    id: &str,
    (host, port): &(String, u16),
    setup: impl FnOnce(&mut rumqttc::v5::MqttOptions),
) -> (rumqttc::v5::AsyncClient, mpsc::UnboundedReceiver<Ev5>) {
    let mut o = rumqttc::v5::MqttOptions::new(id, host.clone(), *port);
    o.set_credentials("guest", "guest");
    o.set_keep_alive(Duration::from_secs(30));
    setup(&mut o);
    let (client, mut eventloop) = rumqttc::v5::AsyncClient::new(o, 100);
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        loop {
            match eventloop.poll().await {
                Ok(rumqttc::v5::Event::Incoming(p)) => {
                    if tx.send(Ok(p)).is_err() {
                        return;
                    }
                }
                Ok(rumqttc::v5::Event::Outgoing(_)) => {}
                Err(e) => {
                    let _ = tx.send(Err(e.to_string()));
                    return;
                }
            }
        }
    });
    (client, rx)
}

/// The next event matching `pick`, skipping others; panics on a closed
/// connection or after [`OP_TIMEOUT`].
async fn next_matching<P: std::fmt::Debug, T>(
    rx: &mut mpsc::UnboundedReceiver<Result<P, String>>,
    what: &str,
    mut pick: impl FnMut(&P) -> Option<T>,
) -> T {
    within(what, async {
        loop {
            match rx.recv().await {
                Some(Ok(p)) => {
                    if let Some(t) = pick(&p) {
                        return t;
                    }
                }
                Some(Err(e)) => panic!("connection ended while waiting for {what}: {e}"),
                None => panic!("event loop gone while waiting for {what}"),
            }
        }
    })
    .await
}

fn props5(f: impl FnOnce(&mut PublishProperties)) -> PublishProperties {
    let mut p = PublishProperties::default();
    f(&mut p);
    p
}

// ---------------------------------------------------------------------------
// round trips

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]

async fn qos1_round_trip_v4() {
    let target = Target::start();
    let addr = target.addr();
    let topic = format!("rt/{}/v4", unique("t"));

    let (sub, mut sub_rx) = v4_client(&unique("sub"), &addr, |_| {});
    let ack = next_matching(&mut sub_rx, "CONNACK", |p| match p {
        Packet::ConnAck(a) => Some(a.clone()),
        _ => None,
    })
    .await;
    assert_eq!(ack.code, rumqttc::ConnectReturnCode::Success);
    assert!(!ack.session_present, "clean session has no stored state");
    sub.subscribe(&topic, QoS::AtLeastOnce).await.unwrap();
    let granted = next_matching(&mut sub_rx, "SUBACK", |p| match p {
        Packet::SubAck(s) => Some(s.return_codes.clone()),
        _ => None,
    })
    .await;
    assert_eq!(
        granted,
        vec![rumqttc::SubscribeReasonCode::Success(QoS::AtLeastOnce)]
    );

    let (publ, mut pub_rx) = v4_client(&unique("pub"), &addr, |_| {});
    for i in 0..10 {
        publ.publish(&topic, QoS::AtLeastOnce, false, format!("m{i}"))
            .await
            .unwrap();
    }
    let mut acked = 0;
    while acked < 10 {
        next_matching(&mut pub_rx, "PUBACK", |p| {
            matches!(p, Packet::PubAck(_)).then_some(())
        })
        .await;
        acked += 1;
    }
    // One publisher, one topic, one QoS: delivered in order.
    let mut got = Vec::new();
    while got.len() < 10 {
        let p = next_matching(&mut sub_rx, "PUBLISH", |p| match p {
            Packet::Publish(p) => Some(p.clone()),
            _ => None,
        })
        .await;
        assert_eq!(p.topic, topic);
        assert_eq!(p.qos, QoS::AtLeastOnce);
        assert!(!p.retain);
        got.push(String::from_utf8_lossy(&p.payload).into_owned());
    }
    let want: Vec<String> = (0..10).map(|i| format!("m{i}")).collect();
    assert_eq!(got, want);
    sub.disconnect().await.unwrap();
    publ.disconnect().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]

async fn qos1_round_trip_v5() {
    let target = Target::start();
    let addr = target.addr();
    let topic = format!("rt/{}/v5", unique("t"));

    let (sub, mut sub_rx) = v5_client(&unique("sub"), &addr, |_| {});
    let ack = next_matching(&mut sub_rx, "CONNACK", |p| match p {
        Packet5::ConnAck(a) => Some(a.clone()),
        _ => None,
    })
    .await;
    assert_eq!(
        ack.code,
        rumqttc::v5::mqttbytes::v5::ConnectReturnCode::Success
    );
    sub.subscribe(&topic, QoS5::AtLeastOnce).await.unwrap();
    next_matching(&mut sub_rx, "SUBACK", |p| {
        matches!(p, Packet5::SubAck(_)).then_some(())
    })
    .await;

    let (publ, mut pub_rx) = v5_client(&unique("pub"), &addr, |_| {});
    let props = props5(|p| {
        p.user_properties = vec![("k".into(), "v".into()), ("k".into(), "w".into())];
        p.content_type = Some("text/plain".into());
        p.message_expiry_interval = Some(600);
    });
    for i in 0..10 {
        publ.publish_with_properties(
            &topic,
            QoS5::AtLeastOnce,
            false,
            format!("m{i}"),
            props.clone(),
        )
        .await
        .unwrap();
    }
    let mut acked = 0;
    while acked < 10 {
        let reason = next_matching(&mut pub_rx, "PUBACK", |p| match p {
            Packet5::PubAck(a) => Some(a.reason),
            _ => None,
        })
        .await;
        assert_eq!(reason, rumqttc::v5::mqttbytes::v5::PubAckReason::Success);
        acked += 1;
    }
    let mut got = Vec::new();
    while got.len() < 10 {
        let p = next_matching(&mut sub_rx, "PUBLISH", |p| match p {
            Packet5::Publish(p) => Some(p.clone()),
            _ => None,
        })
        .await;
        assert_eq!(p.topic, topic.as_bytes());
        assert_eq!(p.qos, QoS5::AtLeastOnce);
        let pp = p.properties.clone().unwrap_or_default();
        assert_eq!(
            pp.user_properties,
            vec![("k".to_string(), "v".to_string()), ("k".into(), "w".into())],
            "user properties keep order and repeated keys"
        );
        assert_eq!(pp.content_type.as_deref(), Some("text/plain"));
        let e = pp.message_expiry_interval.expect("expiry forwarded");
        assert!(
            (590..=600).contains(&e),
            "expiry counted down from 600, got {e}"
        );
        got.push(String::from_utf8_lossy(&p.payload).into_owned());
    }
    let want: Vec<String> = (0..10).map(|i| format!("m{i}")).collect();
    assert_eq!(got, want);
    sub.disconnect().await.unwrap();
    publ.disconnect().await.unwrap();
}

// ---------------------------------------------------------------------------
// kill -9 in the middle of a persistent session

/// A hand-driven MQTT 5 session on rumqttc's packet codec. rumqttc's own
/// event loop forgets the QoS 2 packet ids it sent PUBREC for when it
/// reconnects (`MqttState::clean`), so a server that correctly resumes
/// with PUBREL gets "unsolicited pubrel" and a dropped connection; this
/// client answers every PUBREL with PUBCOMP (MQTT 5 4.3.3) and acknowledges
/// exactly when the test says.
struct RawSession5 {
    stream: tokio::net::TcpStream,
    buf: bytes::BytesMut,
}

impl RawSession5 {
    /// Sends CONNECT (clean start, no session expiry) as `user` and returns
    /// the session and the CONNACK's reason code, without asserting it.
    async fn try_connect(
        (host, port): &(String, u16),
        client_id: &str,
        user: &str,
    ) -> (RawSession5, rumqttc::v5::mqttbytes::v5::ConnectReturnCode) {
        use rumqttc::v5::mqttbytes::v5::{Connect, Login};
        let stream = within(
            "TCP connect",
            tokio::net::TcpStream::connect((host.as_str(), *port)),
        )
        .await
        .expect("TCP connect");
        let mut s = RawSession5 {
            stream,
            buf: bytes::BytesMut::new(),
        };
        let connect = Connect {
            keep_alive: 60,
            client_id: client_id.into(),
            clean_start: true,
            properties: None,
        };
        s.send(Packet5::Connect(
            connect,
            None,
            Some(Login::new(user, "guest")),
        ))
        .await;
        match s.read().await {
            Packet5::ConnAck(a) => (s, a.code),
            p => panic!("expected CONNACK, got {p:?}"),
        }
    }

    /// Connects with Clean Start 0, a session expiry and a receive maximum;
    /// returns the session and CONNACK's session_present.
    async fn connect(
        (host, port): &(String, u16),
        client_id: &str,
        receive_maximum: u16,
    ) -> (RawSession5, bool) {
        use rumqttc::v5::mqttbytes::v5::{Connect, Login};
        let stream = within(
            "TCP connect",
            tokio::net::TcpStream::connect((host.as_str(), *port)),
        )
        .await
        .expect("TCP connect");
        let mut s = RawSession5 {
            stream,
            buf: bytes::BytesMut::new(),
        };
        let mut props = ConnectProperties::new();
        props.session_expiry_interval = Some(3600);
        props.receive_maximum = Some(receive_maximum);
        let connect = Connect {
            keep_alive: 60,
            client_id: client_id.into(),
            clean_start: false,
            properties: Some(props),
        };
        s.send(Packet5::Connect(
            connect,
            None,
            Some(Login::new("guest", "guest")),
        ))
        .await;
        match s.read().await {
            Packet5::ConnAck(a) => {
                assert_eq!(
                    a.code,
                    rumqttc::v5::mqttbytes::v5::ConnectReturnCode::Success
                );
                (s, a.session_present)
            }
            p => panic!("expected CONNACK, got {p:?}"),
        }
    }

    async fn send(&mut self, p: Packet5) {
        use tokio::io::AsyncWriteExt;
        let mut out = bytes::BytesMut::new();
        p.write(&mut out).expect("encoding a packet");
        within("write", self.stream.write_all(&out))
            .await
            .expect("write to broker");
    }

    async fn read(&mut self) -> Packet5 {
        use tokio::io::AsyncReadExt;
        loop {
            match Packet5::read(&mut self.buf, None) {
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

    async fn subscribe(&mut self, filter: &str, qos: QoS5, pkid: u16) {
        use rumqttc::v5::mqttbytes::v5::{Filter, Subscribe};
        let mut sub = Subscribe::new(Filter::new(filter, qos), None);
        sub.pkid = pkid;
        self.send(Packet5::Subscribe(sub)).await;
        loop {
            if let Packet5::SubAck(a) = self.read().await {
                assert_eq!(a.pkid, pkid);
                return;
            }
        }
    }

    /// The next PUBLISH; PUBRELs met on the way get their PUBCOMP.
    async fn next_publish(&mut self) -> Publish5 {
        loop {
            match self.read().await {
                Packet5::Publish(p) => return p,
                Packet5::PubRel(r) => {
                    self.send(Packet5::PubComp(rumqttc::v5::mqttbytes::v5::PubComp::new(
                        r.pkid, None,
                    )))
                    .await
                }
                Packet5::PingResp(_) => {}
                p => panic!("unexpected packet {p:?}"),
            }
        }
    }

    /// PUBACK (QoS 1) or PUBREC (QoS 2).
    async fn ack(&mut self, p: &Publish5) {
        use rumqttc::v5::mqttbytes::v5::{PubAck, PubRec};
        match p.qos {
            QoS5::AtLeastOnce => self.send(Packet5::PubAck(PubAck::new(p.pkid, None))).await,
            QoS5::ExactlyOnce => self.send(Packet5::PubRec(PubRec::new(p.pkid, None))).await,
            QoS5::AtMostOnce => {}
        }
    }
}

/// A Mosquitto of the test's own (config and data in a temporary
/// directory), for checking the restart test's logic.
struct PrivateMosquitto {
    dir: tempfile::TempDir,
    port: u16,
    child: Option<std::process::Child>,
}

impl PrivateMosquitto {
    fn start() -> PrivateMosquitto {
        let dir = tempfile::tempdir().expect("tempdir");
        let port = free_port();
        let mut conf = format!(
            "listener {port} 127.0.0.1\nallow_anonymous true\npersistence true\npersistence_location {}/\nmax_inflight_messages 0\n",
            dir.path().display()
        );
        // max_inflight_messages 0: see the restart test.
        // As root Mosquitto would switch to the `mosquitto` user, who cannot
        // write our temporary directory.
        // SAFETY: getuid(2) has no preconditions.
        if unsafe { libc::getuid() } == 0 {
            conf.push_str("user root\n");
        }
        std::fs::write(dir.path().join("m.conf"), conf).expect("writing m.conf");
        let mut m = PrivateMosquitto {
            dir,
            port,
            child: None,
        };
        m.spawn();
        m
    }

    fn spawn(&mut self) {
        let child = Command::new("mosquitto")
            .arg("-c")
            .arg(self.dir.path().join("m.conf"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("mosquitto (scripts/install-deps.sh)");
        self.child = Some(child);
        let deadline = std::time::Instant::now() + START_TIMEOUT;
        // Nothing to await but the port: poll it.
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(
                std::time::Instant::now() < deadline,
                "mosquitto did not listen on {}",
                self.port
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGTERM (Mosquitto writes its database), wait, start again.
    fn restart(&mut self) {
        if let Some(mut c) = self.child.take() {
            // SAFETY: kill(2) on our own child's pid.
            unsafe {
                libc::kill(c.id() as libc::pid_t, libc::SIGTERM);
            }
            c.wait().expect("mosquitto exit");
        }
        self.spawn();
    }
}

impl Drop for PrivateMosquitto {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The broker of the restart test: weir (crashed with `kill -9`) or, to
/// check the test itself, a private Mosquitto (stopped with SIGTERM).
enum Restartable {
    Weir(Broker),
    Mosquitto(PrivateMosquitto),
}

impl Restartable {
    fn port(&self) -> u16 {
        match self {
            Restartable::Weir(b) => b.mqtt_port(),
            Restartable::Mosquitto(m) => m.port,
        }
    }

    fn crash_and_restart(&mut self) {
        match self {
            Restartable::Weir(b) => {
                b.kill9();
                b.restart();
                assert!(b.wait_for_log("MQTT listener ready", START_TIMEOUT));
            }
            Restartable::Mosquitto(m) => m.restart(),
        }
    }
}

/// What the subscriber saw of one message: (payload, dup flag).
fn seen(p: &Publish5) -> (String, bool) {
    (String::from_utf8_lossy(&p.payload).into_owned(), p.dup)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]

async fn persistent_session_survives_kill9_with_qos1_and_qos2_in_flight() {
    let mut broker = if std::env::var_os("WEIR_TEST_MQTT_RESTART_MOSQUITTO").is_some() {
        Restartable::Mosquitto(PrivateMosquitto::start())
    } else if external_broker() {
        return;
    } else {
        Restartable::Weir(start_weir())
    };
    const N: usize = 40;
    let addr = ("127.0.0.1".to_string(), broker.port());
    // Mosquitto 2.0.11 does not keep to the Receive Maximum after a restart
    // and then stalls the session's queue (its own max_inflight_messages
    // too: the private instance runs with 0, no limit).
    let receive_maximum = match broker {
        Restartable::Weir(_) => 10,
        Restartable::Mosquitto(_) => 65535,
    };
    let sub_id = unique("k9sub");

    // 1. A persistent session (expiry 1 h; at most 10 unacknowledged
    //    deliveries on weir, so at the kill some messages are in flight and
    //    the rest still queued) subscribes to a QoS 1 and a QoS 2 topic.
    let (mut sub, present) = RawSession5::connect(&addr, &sub_id, receive_maximum).await;
    assert!(!present, "a new session");
    sub.subscribe("k9/q1", QoS5::AtLeastOnce, 1).await;
    sub.subscribe("k9/q2", QoS5::ExactlyOnce, 2).await;

    // 2. A publisher gets PUBACK / PUBCOMP for N messages on each topic:
    //    from then on the broker owns them.
    let (publ, mut pub_rx) = v4_client(&unique("k9pub"), &addr, |_| {});
    for i in 0..N {
        publ.publish("k9/q1", QoS::AtLeastOnce, false, format!("q1-{i:02}"))
            .await
            .unwrap();
        publ.publish("k9/q2", QoS::ExactlyOnce, false, format!("q2-{i:02}"))
            .await
            .unwrap();
    }
    let (mut pubacks, mut pubcomps) = (0, 0);
    while pubacks < N || pubcomps < N {
        match next_matching(&mut pub_rx, "PUBACK/PUBCOMP", |p| match p {
            Packet::PubAck(_) => Some(1),
            Packet::PubComp(_) => Some(2),
            _ => None,
        })
        .await
        {
            1 => pubacks += 1,
            _ => pubcomps += 1,
        }
    }
    publ.disconnect().await.ok();

    // 3. The subscriber takes deliveries: it acknowledges the first 8 it
    //    sees (PUBACK, or PUBREC for QoS 2, whose PUBREL then gets PUBCOMP)
    //    and leaves the next ones unacknowledged.
    // Every PUBLISH the subscriber got: (payload, DUP, acknowledged by it).
    let mut log: Vec<(String, bool, bool)> = Vec::new();
    while log.len() < 15 {
        let p = sub.next_publish().await;
        let (payload, dup) = seen(&p);
        let ack = log.len() < 8;
        if ack {
            sub.ack(&p).await;
        }
        log.push((payload, dup, ack));
    }
    let before = log.len();

    // 4. kill -9 with QoS 1 and QoS 2 deliveries unacknowledged (and maybe
    //    PUBRELs not yet completed) and the rest queued; restart on the same
    //    data directory and port.
    broker.crash_and_restart();
    drop(sub);

    // 5. The session is still there and delivers everything; the
    //    subscriber now acknowledges all it gets.
    let (mut sub, present) = RawSession5::connect(&addr, &sub_id, receive_maximum).await;
    assert!(present, "the persistent session survived kill -9");
    let everything: BTreeSet<String> = (0..N)
        .flat_map(|i| [format!("q1-{i:02}"), format!("q2-{i:02}")])
        .collect();
    while log
        .iter()
        .map(|(p, _, _)| p.clone())
        .collect::<BTreeSet<_>>()
        != everything
    {
        let p = sub.next_publish().await;
        sub.ack(&p).await;
        let (payload, dup) = seen(&p);
        log.push((payload, dup, true));
    }
    // A fence: a message published now arrives after anything the broker
    // still meant to (re)send.
    let (publ2, mut pub2_rx) = v4_client(&unique("k9pub2"), &addr, |_| {});
    publ2
        .publish("k9/q1", QoS::AtLeastOnce, false, "fence")
        .await
        .unwrap();
    next_matching(&mut pub2_rx, "PUBACK of the fence", |p| {
        matches!(p, Packet::PubAck(_)).then_some(())
    })
    .await;
    loop {
        let p = sub.next_publish().await;
        sub.ack(&p).await;
        if &p.payload[..] == b"fence" {
            break;
        }
        let (payload, dup) = seen(&p);
        log.push((payload, dup, true));
    }

    // None lost (the loops above). QoS 2 never twice: a QoS 2 message is
    // delivered when the subscriber accepts it with PUBREC; after that the
    // broker may only resume with PUBREL, never send the PUBLISH again (not
    // even across the kill). A PUBLISH the subscriber left unacknowledged
    // may come again, and then MUST carry DUP (MQTT 3.3.1-1). (DUP on a
    // first attempt is allowed: it only says "might be a re-delivery".)
    let mut accepted: BTreeMap<&str, usize> = BTreeMap::new();
    let mut seen_before: BTreeSet<&str> = BTreeSet::new();
    for (payload, dup, acked) in &log {
        if payload.starts_with("q2-") && *acked {
            *accepted.entry(payload.as_str()).or_default() += 1;
        }
        if !seen_before.insert(payload.as_str()) {
            assert!(*dup, "{payload} sent again without DUP");
        }
    }
    for i in 0..N {
        let payload = format!("q2-{i:02}");
        let n = accepted.get(payload.as_str()).copied().unwrap_or(0);
        assert_eq!(n, 1, "{payload} delivered (accepted with PUBREC) {n} times");
    }
    eprintln!(
        "kill -9: {before} deliveries before (8 acknowledged), {} after ({} with DUP)",
        log.len() - before,
        log[before..].iter().filter(|(_, d, _)| *d).count()
    );
    sub.send(Packet5::Disconnect(
        rumqttc::v5::mqttbytes::v5::Disconnect::new(
            rumqttc::v5::mqttbytes::v5::DisconnectReasonCode::NormalDisconnection,
        ),
    ))
    .await;
}

// ---------------------------------------------------------------------------
// one broker: MQTT <-> AMQP through amq.topic

/// Persistent sessions resume with exactly their own subscriptions and
/// their options: weir reads them from the session queue's own bindings
/// (issue 21: a reconnect storm of N sessions costs O(N), where walking
/// every binding of `amq.topic` cost O(N²)). Twenty sessions subscribe with
/// a subscription identifier each, leave, come back together, and each one
/// gets its own topic's message, marked with its own identifier, and no
/// other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resumed_sessions_get_exactly_their_own_subscriptions_back() {
    use rumqttc::v5::mqttbytes::v5::{Filter, Subscribe, SubscribeProperties};
    let target = Target::start();
    let addr = target.addr();
    const N: usize = 20;
    let base = unique("resume");
    let id = |i: usize| format!("{base}-{i}");
    let topic = |i: usize| format!("{base}/t{i}");
    for i in 0..N {
        let (mut s, present) = RawSession5::connect(&addr, &id(i), 10).await;
        assert!(!present, "a new session");
        let mut sub = Subscribe::new(Filter::new(topic(i), QoS5::AtLeastOnce), None);
        sub.pkid = 1;
        sub.properties = Some(SubscribeProperties {
            id: Some(100 + i),
            user_properties: Vec::new(),
        });
        s.send(Packet5::Subscribe(sub)).await;
        assert!(matches!(s.read().await, Packet5::SubAck(_)));
        s.send(Packet5::Disconnect(
            rumqttc::v5::mqttbytes::v5::Disconnect::new(
                rumqttc::v5::mqttbytes::v5::DisconnectReasonCode::NormalDisconnection,
            ),
        ))
        .await;
    }
    let mut back = Vec::new();
    for i in 0..N {
        let (s, present) = RawSession5::connect(&addr, &id(i), 10).await;
        assert!(present, "session {i} was kept");
        back.push(s);
    }
    let (publ, mut rx) = v4_client(&unique("resume-pub"), &addr, |_| {});
    for i in 0..N {
        publ.publish(topic(i), QoS::AtLeastOnce, false, format!("m{i}"))
            .await
            .expect("publish");
        next_matching(&mut rx, "PUBACK", |p| {
            matches!(p, Packet::PubAck(_)).then_some(())
        })
        .await;
    }
    for (i, s) in back.iter_mut().enumerate() {
        let p = s.next_publish().await;
        assert_eq!(p.topic.as_ref(), topic(i).as_bytes(), "session {i}");
        assert_eq!(&p.payload[..], format!("m{i}").as_bytes());
        let ids = p
            .properties
            .as_ref()
            .map(|x| x.subscription_identifiers.clone());
        assert_eq!(ids, Some(vec![100 + i]), "session {i}'s identifier");
        s.ack(&p).await;
    }
    publ.disconnect().await.expect("disconnect");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]

async fn mqtt_publish_reaches_amqp_consumer_on_amq_topic() {
    if external_broker() {
        return;
    }
    let broker = start_weir();
    let addr = ("127.0.0.1".to_string(), broker.mqtt_port());
    let conn = connect(&broker.url()).await;
    let ch = conn.create_channel().await.unwrap();
    let q = ch
        .queue_declare(
            "".into(),
            QueueDeclareOptions {
                exclusive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    ch.queue_bind(
        q.name().clone(),
        "amq.topic".into(),
        "sensors.*.temp".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    let mut consumer = ch
        .basic_consume(
            q.name().clone(),
            "mqtt-in".into(),
            BasicConsumeOptions {
                no_ack: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();

    let (publ, mut pub_rx) = v5_client(&unique("sensor"), &addr, |_| {});
    // QoS 1 with an expiry and MQTT 5 properties.
    let props = props5(|p| {
        p.message_expiry_interval = Some(60);
        p.content_type = Some("application/json".into());
        p.user_properties = vec![("site".into(), "north".into())];
    });
    publ.publish_with_properties("sensors/7/temp", QoS5::AtLeastOnce, false, "21.5", props)
        .await
        .unwrap();
    next_matching(&mut pub_rx, "PUBACK", |p| {
        matches!(p, Packet5::PubAck(_)).then_some(())
    })
    .await;
    // QoS 0, and a retained QoS 1 message.
    publ.publish("sensors/8/temp", QoS5::AtMostOnce, false, "19.0")
        .await
        .unwrap();
    publ.publish("sensors/9/temp", QoS5::AtLeastOnce, true, "17.25")
        .await
        .unwrap();
    // Not bound: a different level count.
    publ.publish("sensors/7/humidity", QoS5::AtLeastOnce, false, "40")
        .await
        .unwrap();

    // The mapping (docs/semantics.md; as RabbitMQ's MQTT plugin): '/' -> '.',
    // QoS 1 persistent (delivery mode 2), QoS 0 transient, expiry -> AMQP
    // `expiration` in milliseconds, user properties -> headers.
    let d = next_delivery(&mut consumer).await;
    assert_eq!(d.exchange.as_str(), "amq.topic");
    assert_eq!(d.routing_key.as_str(), "sensors.7.temp");
    assert_eq!(d.data, b"21.5");
    assert_eq!(
        d.properties.delivery_mode(),
        &Some(2),
        "QoS 1 is persistent"
    );
    assert_eq!(
        d.properties.expiration().as_ref().map(|s| s.as_str()),
        Some("60000"),
        "message expiry 60 s -> expiration 60000 ms"
    );
    assert_eq!(
        d.properties.content_type().as_ref().map(|s| s.as_str()),
        Some("application/json")
    );
    let headers = d.properties.headers().clone().unwrap_or_default();
    assert_eq!(
        headers.inner().get("site"),
        Some(&AMQPValue::LongString("north".into())),
        "user property -> header: {headers:?}"
    );

    let d = next_delivery(&mut consumer).await;
    assert_eq!(d.routing_key.as_str(), "sensors.8.temp");
    assert_ne!(d.properties.delivery_mode(), &Some(2), "QoS 0 is transient");

    let d = next_delivery(&mut consumer).await;
    assert_eq!(d.routing_key.as_str(), "sensors.9.temp");
    assert_eq!(d.data, b"17.25");
    // The retained copy stays on the MQTT side: a later MQTT subscriber
    // gets it with RETAIN=1.
    let (sub, mut sub_rx) = v5_client(&unique("late"), &addr, |_| {});
    sub.subscribe("sensors/9/temp", QoS5::AtLeastOnce)
        .await
        .unwrap();
    let p = next_matching(&mut sub_rx, "retained PUBLISH", |p| match p {
        Packet5::Publish(p) => Some(p.clone()),
        _ => None,
    })
    .await;
    assert!(p.retain);
    assert_eq!(&p.payload[..], b"17.25");
    // Clear it (an empty retained publish).
    publ.publish("sensors/9/temp", QoS5::AtLeastOnce, true, "")
        .await
        .unwrap();
    let d = next_delivery(&mut consumer).await;
    assert_eq!(d.routing_key.as_str(), "sensors.9.temp");
    assert!(d.data.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]

async fn amqp_publish_reaches_mqtt_subscribers() {
    if external_broker() {
        return;
    }
    let broker = start_weir();
    let addr = ("127.0.0.1".to_string(), broker.mqtt_port());
    let (sub5, mut rx5) = v5_client(&unique("sub5"), &addr, |_| {});
    sub5.subscribe("sensors/+/temp", QoS5::AtLeastOnce)
        .await
        .unwrap();
    next_matching(&mut rx5, "SUBACK", |p| {
        matches!(p, Packet5::SubAck(_)).then_some(())
    })
    .await;
    let (sub4, mut rx4) = v4_client(&unique("sub4"), &addr, |_| {});
    sub4.subscribe("sensors/#", QoS::ExactlyOnce).await.unwrap();
    next_matching(&mut rx4, "SUBACK", |p| {
        matches!(p, Packet::SubAck(_)).then_some(())
    })
    .await;

    let conn = connect(&broker.url()).await;
    let ch = confirm_channel(&conn).await;
    let mut headers = FieldTable::default();
    headers.insert("site".into(), AMQPValue::LongString("south".into()));
    let props = BasicProperties::default()
        .with_delivery_mode(2)
        .with_expiration("30000".into())
        .with_content_type("application/json".into())
        .with_headers(headers);
    publish_confirmed(&ch, "amq.topic", "sensors.9.temp", b"{\"t\":3}", props).await;

    // MQTT 5: topic mapped back, persistent -> QoS 1 (capped by the
    // subscription), expiration -> message expiry (counted down),
    // headers -> user properties.
    let p = next_matching(&mut rx5, "PUBLISH from AMQP", |p| match p {
        Packet5::Publish(p) => Some(p.clone()),
        _ => None,
    })
    .await;
    assert_eq!(p.topic, &b"sensors/9/temp"[..]);
    assert_eq!(&p.payload[..], b"{\"t\":3}");
    assert_eq!(p.qos, QoS5::AtLeastOnce);
    assert!(!p.retain);
    let pp = p.properties.clone().unwrap_or_default();
    let e = pp.message_expiry_interval.expect("expiration -> expiry");
    assert!((1..=30).contains(&e), "expiry {e} not within 30 s");
    assert_eq!(pp.content_type.as_deref(), Some("application/json"));
    assert!(
        pp.user_properties
            .contains(&("site".to_string(), "south".to_string())),
        "header -> user property: {:?}",
        pp.user_properties
    );
    // MQTT 3.1.1 subscriber at QoS 2 on '#': a persistent AMQP message is
    // delivered at QoS 1 (RabbitMQ's mapping), never above what was published.
    let p = next_matching(&mut rx4, "PUBLISH from AMQP (3.1.1)", |p| match p {
        Packet::Publish(p) => Some(p.clone()),
        _ => None,
    })
    .await;
    assert_eq!(p.topic, "sensors/9/temp");
    assert_eq!(p.qos, QoS::AtLeastOnce);
}

// ---------------------------------------------------------------------------
// Debian's command-line clients

/// Runs mosquitto_pub with the common connection arguments.
fn mosquitto_pub((host, port): &(String, u16), args: &[&str]) {
    let out = Command::new("mosquitto_pub")
        .args([
            "-h",
            host,
            "-p",
            &port.to_string(),
            "-u",
            "guest",
            "-P",
            "guest",
        ])
        .args(args)
        .output()
        .expect("mosquitto_pub (package mosquitto-clients: scripts/install-deps.sh)");
    assert!(
        out.status.success(),
        "mosquitto_pub {args:?}: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Starts mosquitto_sub for `count` messages, printing each as `format`;
/// its lines arrive on the returned channel as they are printed.
fn mosquitto_sub(
    (host, port): &(String, u16),
    args: &[&str],
    count: usize,
    format: &str,
) -> (std::process::Child, std::sync::mpsc::Receiver<String>) {
    let mut child = Command::new("mosquitto_sub")
        .args([
            "-h",
            host,
            "-p",
            &port.to_string(),
            "-u",
            "guest",
            "-P",
            "guest",
        ])
        .args(["-C", &count.to_string(), "-W", "20", "-F", format])
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("mosquitto_sub (package mosquitto-clients: scripts/install-deps.sh)");
    let stdout = child.stdout.take().expect("piped stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    (child, rx)
}

fn next_line(rx: &std::sync::mpsc::Receiver<String>, what: &str) -> String {
    rx.recv_timeout(OP_TIMEOUT)
        .unwrap_or_else(|e| panic!("mosquitto_sub printed no {what}: {e}"))
}

#[test]

fn mosquitto_cli_clients_v311_and_v5() {
    let target = Target::start();
    let addr = target.addr();
    for version in ["mqttv311", "mqttv5"] {
        let topic = format!("cli/{}/{version}", unique("t"));
        // A retained message first: the subscriber's first line is then
        // proof that its subscription is in place, so the live publish
        // after it cannot race it.
        mosquitto_pub(
            &addr,
            &[
                "-V", version, "-t", &topic, "-m", "retained", "-q", "1", "-r",
            ],
        );
        let format = if version == "mqttv5" {
            "%t|%p|%q|%r|%P|%E"
        } else {
            "%t|%p|%q|%r"
        };
        let (mut child, rx) =
            mosquitto_sub(&addr, &["-V", version, "-t", &topic, "-q", "2"], 2, format);
        let first = next_line(&rx, "retained message");
        assert!(
            first.starts_with(&format!("{topic}|retained|1|1")),
            "{version}: retained message as `{first}`"
        );
        let mut live = vec!["-V", version, "-t", &topic, "-m", "live", "-q", "2"];
        if version == "mqttv5" {
            live.extend(["-D", "publish", "user-property", "k", "v"]);
            live.extend(["-D", "publish", "message-expiry-interval", "120"]);
        }
        mosquitto_pub(&addr, &live);
        let second = next_line(&rx, "live message");
        if version == "mqttv5" {
            let fields: Vec<&str> = second.split('|').collect();
            assert_eq!(
                &fields[..5],
                &[topic.as_str(), "live", "2", "0", "k:v"],
                "{version}: live message as `{second}`"
            );
            let e: u32 = fields[5]
                .parse()
                .unwrap_or_else(|_| panic!("expiry in `{second}`"));
            assert!((110..=120).contains(&e), "expiry {e}");
        } else {
            assert_eq!(second, format!("{topic}|live|2|0"), "{version}");
        }
        let status = child.wait().expect("mosquitto_sub exit");
        assert!(status.success(), "mosquitto_sub -C 2 ended with {status}");
        // Clear the retained message.
        mosquitto_pub(&addr, &["-V", version, "-t", &topic, "-n", "-r", "-q", "1"]);
    }
}

// ---------------------------------------------------------------------------
// limits and tenants

/// A weir whose `[mqtt]` limits are small, from a configuration file.
fn start_weir_with_mqtt_limits(limits: &str) -> (Broker, tempfile::TempDir) {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("weir.toml");
    std::fs::write(&file, format!("[mqtt]\n{limits}\n")).unwrap();
    let b = Broker::start_mqtt_with(&["--config", file.to_str().unwrap()]);
    assert!(b.wait_for_log("MQTT listener ready", START_TIMEOUT));
    (b, tmp)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_answer_with_their_reason_codes() {
    use rumqttc::v5::mqttbytes::v5::{ConnectReturnCode, Disconnect, Publish};
    let (broker, _tmp) = start_weir_with_mqtt_limits(
        "max_connections = 2\nmax_topic_levels = 3\nmax_queued_messages = 5",
    );
    let addr = ("127.0.0.1".to_string(), broker.mqtt_port());

    // max_connections: the third connection is refused, 0x97.
    let (mut a, code) = RawSession5::try_connect(&addr, "lim-a", "guest").await;
    assert_eq!(code, ConnectReturnCode::Success);
    let (_b, code) = RawSession5::try_connect(&addr, "lim-b", "guest").await;
    assert_eq!(code, ConnectReturnCode::Success);
    let (_c, code) = RawSession5::try_connect(&addr, "lim-c", "guest").await;
    assert_eq!(
        code,
        ConnectReturnCode::QuotaExceeded,
        "a third connection over max_connections = 2"
    );

    // max_topic_levels: a 4-level topic name ends the connection, 0x90.
    a.send(Packet5::Publish(Publish::new(
        "a/b/c/d",
        QoS5::AtMostOnce,
        "x",
        None,
    )))
    .await;
    match a.read().await {
        Packet5::Disconnect(Disconnect { reason_code, .. }) => assert_eq!(
            reason_code,
            rumqttc::v5::mqttbytes::v5::DisconnectReasonCode::TopicNameInvalid
        ),
        p => panic!("expected DISCONNECT 0x90, got {p:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_offline_session_keeps_only_its_newest_messages_up_to_the_limit() {
    let (broker, _tmp) = start_weir_with_mqtt_limits("max_queued_messages = 5");
    let addr = ("127.0.0.1".to_string(), broker.mqtt_port());
    let id = unique("lim-q");
    // A persistent session subscribes, then goes away.
    let (mut sub, present) = RawSession5::connect(&addr, &id, 100).await;
    assert!(!present);
    sub.subscribe("lim/q", QoS5::AtLeastOnce, 1).await;
    drop(sub);
    // 8 messages while it is away: the oldest 3 are dropped.
    let (publ, mut pub_rx) = v4_client(&unique("lim-pub"), &addr, |_| {});
    for i in 0..8 {
        publ.publish("lim/q", QoS::AtLeastOnce, false, format!("m{i}"))
            .await
            .unwrap();
        next_matching(&mut pub_rx, "PUBACK", |p| {
            matches!(p, Packet::PubAck(_)).then_some(())
        })
        .await;
    }
    let (mut sub, present) = RawSession5::connect(&addr, &id, 100).await;
    assert!(present);
    let mut got = Vec::new();
    for _ in 0..5 {
        let p = sub.next_publish().await;
        sub.ack(&p).await;
        got.push(String::from_utf8_lossy(&p.payload).into_owned());
    }
    assert_eq!(got, ["m3", "m4", "m5", "m6", "m7"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_username_names_the_tenant() {
    use rumqttc::v5::mqttbytes::v5::ConnectReturnCode;
    let broker = start_weir();
    let addr = ("127.0.0.1".to_string(), broker.mqtt_port());
    // `tenant:user`, as RabbitMQ's `vhost:user`: the default tenant by name…
    let (_s, code) = RawSession5::try_connect(&addr, &unique("t"), "/:guest").await;
    assert_eq!(code, ConnectReturnCode::Success);
    // …and a tenant that does not exist: not authorized (0x87).
    let (_s, code) = RawSession5::try_connect(&addr, &unique("t"), "nosuch:guest").await;
    assert_eq!(code, ConnectReturnCode::NotAuthorized);
    // A wrong password looks like an unknown user: 0x86 both.
    let (_s, code) = RawSession5::try_connect(&addr, &unique("t"), "nobody").await;
    assert_eq!(code, ConnectReturnCode::BadUserNamePassword);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connack_carries_server_keep_alive_and_response_information() {
    use rumqttc::v5::mqttbytes::v5::{Connect, ConnectReturnCode, Login};
    let (broker, _tmp) = start_weir_with_mqtt_limits("server_keep_alive = 20");
    let addr = ("127.0.0.1".to_string(), broker.mqtt_port());
    let stream = tokio::net::TcpStream::connect(("127.0.0.1", addr.1))
        .await
        .expect("TCP connect");
    let mut s = RawSession5 {
        stream,
        buf: bytes::BytesMut::new(),
    };
    let mut props = ConnectProperties::new();
    props.request_response_info = Some(1);
    let id = unique("rri");
    // Keep-alive 0 (none): the server imposes its own.
    s.send(Packet5::Connect(
        Connect {
            keep_alive: 0,
            client_id: id.clone(),
            clean_start: true,
            properties: Some(props),
        },
        None,
        Some(Login::new("guest", "guest")),
    ))
    .await;
    match s.read().await {
        Packet5::ConnAck(a) => {
            assert_eq!(a.code, ConnectReturnCode::Success);
            let p = a.properties.expect("CONNACK properties");
            assert_eq!(p.server_keep_alive, Some(20));
            assert_eq!(p.response_information, Some(format!("responses/{id}")));
        }
        p => panic!("expected CONNACK, got {p:?}"),
    }
}
