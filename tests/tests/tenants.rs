//! Tenants, users and permissions against the real binary, with lapin and
//! rumqttc: a configuration file with tenants `a` and `b` and users of
//! each. A user of tenant `a` cannot open `b` (AMQP 530, MQTT CONNACK
//! 0x87 / 5), so it cannot declare, bind, publish to, consume from, purge
//! or see anything there; within a tenant the configure / write / read
//! regular expressions refuse each operation with 403 and RabbitMQ's text;
//! topic permissions restrict AMQP topic publishes and bindings and MQTT
//! subscriptions and publishes. Which operation needs which permission is
//! tested in process (engine/tests/permissions.rs); here, what a client of
//! each protocol sees.

use lapin::options::*;
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Connection};
use rumqttc::v5::mqttbytes::v5::{Packet as Packet5, SubscribeReasonCode as Sub5};
use rumqttc::v5::mqttbytes::QoS as QoS5;
use rumqttc::{Event, Packet, QoS};
use std::time::Duration;
use tokio::sync::mpsc;
use weir_tests::raw::RawClient;
use weir_tests::*;

const CONFIG: &str = r#"
[[tenants]]
name = "a"
[[tenants]]
name = "b"

# A user of tenant a, with topic permissions on a's amq.topic.
[[auth.users]]
name = "ua"
password = "pa"
permissions = [{ vhost = "a", configure = ".*", write = ".*", read = ".*" }]
topic_permissions = [
  { vhost = "a", exchange = "amq.topic", write = "^{username}\\.", read = "^{username}\\.|^public\\." },
]

# A user of tenant b.
[[auth.users]]
name = "ub"
password = "pb"
permissions = [{ vhost = "b", configure = ".*", write = ".*", read = ".*" }]

# A user of tenant a restricted to names starting with `lim.`.
[[auth.users]]
name = "lim"
password = "pl"
permissions = [{ vhost = "a", configure = "^lim\\.", write = "^lim\\.", read = "^lim\\." }]

# A configured user with no `permissions` key: every permission on `/` only.
[[auth.users]]
name = "legacy"
password = "pg"
"#;

/// The broker with [`CONFIG`], AMQP and MQTT (the directory holding the
/// file lives as long as the broker).
fn start() -> (Broker, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("weir.toml");
    std::fs::write(&path, CONFIG).expect("config file");
    let b = Broker::start_mqtt_with(&["--config", path.to_str().expect("utf-8 path")]);
    assert!(
        b.wait_for_log("MQTT listener ready", START_TIMEOUT),
        "no MQTT listener\n{}",
        b.run_logs()
    );
    (b, dir)
}

/// The reply code and text of a channel or connection close.
fn refusal<T: std::fmt::Debug>(r: Result<T, lapin::Error>) -> (u16, String) {
    match r {
        Ok(v) => panic!("expected a refusal, got Ok({v:?})"),
        Err(e) => match e.kind() {
            lapin::ErrorKind::ProtocolError(amqp) => {
                (amqp.get_id(), amqp.get_message().as_str().to_string())
            }
            _ => panic!("not an AMQP close: {e:?}"),
        },
    }
}

/// The code and text of the next asynchronous channel close (a refused
/// publish).
async fn next_close(
    events: &mut std::pin::Pin<Box<dyn futures_lite::Stream<Item = lapin::Event> + Send>>,
) -> (u16, String) {
    loop {
        match within("an error event", events.next()).await {
            Some(lapin::Event::Error(e)) => return refusal::<()>(Err(e)),
            Some(_) => continue,
            None => panic!("event stream ended"),
        }
    }
}

async fn channel(conn: &Connection) -> Channel {
    conn.create_channel().await.expect("channel.open")
}

fn no_args() -> FieldTable {
    FieldTable::default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_of_one_tenant_cannot_open_another_530() {
    let (broker, _dir) = start();
    for (user, pass, vhost) in [
        ("ua", "pa", "b"),
        ("ub", "pb", "a"),
        ("guest", "guest", "a"),
        ("legacy", "pg", "b"),
    ] {
        let mut c = RawClient::connect(broker.addr()).await;
        let close = c
            .handshake(user, pass, vhost)
            .await
            .expect_err("vhost opened without permissions");
        assert_eq!(close.code, 530, "{close:?}");
        assert_eq!(
            close.text,
            format!("NOT_ALLOWED - access to vhost '{vhost}' refused for user '{user}'")
        );
    }
    // Each opens its own (and a user with no `permissions` key, `/`).
    for (user, pass, vhost) in [
        ("ua", "pa", "a"),
        ("ub", "pb", "b"),
        ("guest", "guest", "/"),
        ("legacy", "pg", "/"),
    ] {
        let mut c = RawClient::connect(broker.addr()).await;
        c.handshake(user, pass, vhost)
            .await
            .unwrap_or_else(|e| panic!("{user} on {vhost}: {e:?}"));
    }
    assert!(
        broker
            .logs()
            .contains("get every permission on vhost '/' only"),
        "the compatibility default is logged"
    );
}

/// Tenant b's user fills a queue; tenant a's user sees nothing of it: a
/// same-named queue in a is another queue, a's publishes never reach it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_of_tenant_b_is_visible_from_tenant_a() {
    let (broker, _dir) = start();
    let b = connect(&broker.url_with("ub", "pb", "b")).await;
    let chb = confirm_channel(&b).await;
    declare_queue(&chb, "secret").await;
    publish_confirmed(&chb, "", "secret", b"b's", BasicProperties::default()).await;

    let a = connect(&broker.url_with("ua", "pa", "a")).await;
    let cha = channel(&a).await;
    let (code, _) = refusal(
        cha.queue_declare(
            "secret".into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            no_args(),
        )
        .await,
    );
    assert_eq!(code, 404, "b's queue is not visible from a");
    let cha = confirm_channel(&a).await;
    let q = declare_queue(&cha, "secret").await;
    assert_eq!(q.message_count(), 0, "a's `secret` is another queue");
    publish_confirmed(&cha, "", "secret", b"a's", BasicProperties::default()).await;
    let (code, _) = refusal(
        cha.exchange_declare(
            "b-only".into(),
            lapin::ExchangeKind::Fanout,
            ExchangeDeclareOptions {
                passive: true,
                ..Default::default()
            },
            no_args(),
        )
        .await,
    );
    assert_eq!(code, 404);
    assert_eq!(
        queue_len(&chb, "secret").await,
        1,
        "a's publish stayed in a"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn configure_write_read_patterns_refuse_each_operation_403() {
    let (broker, _dir) = start();
    // Resources the restricted user may not touch, made by ua.
    let owner = connect(&broker.url_with("ua", "pa", "a")).await;
    let ch = channel(&owner).await;
    declare_queue(&ch, "other").await;
    ch.exchange_declare(
        "lim.x".into(),
        lapin::ExchangeKind::Direct,
        ExchangeDeclareOptions::default(),
        no_args(),
    )
    .await
    .expect("lim.x");

    let conn = connect(&broker.url_with("lim", "pl", "a")).await;
    let text = |what: &str| format!("ACCESS_REFUSED - {what} in vhost 'a' refused for user 'lim'");
    let ch = channel(&conn).await;
    declare_queue(&ch, "lim.q").await;
    ch.queue_bind(
        "lim.q".into(),
        "lim.x".into(),
        "k".into(),
        QueueBindOptions::default(),
        no_args(),
    )
    .await
    .expect("bind within the patterns");

    let cases: Vec<(&str, String)> = vec![
        ("queue.declare", text("configure access to queue 'q'")),
        ("exchange.declare", text("configure access to exchange 'x'")),
        ("queue.delete", text("configure access to queue 'other'")),
        ("queue.bind (queue)", text("write access to queue 'other'")),
        (
            "queue.bind (exchange)",
            text("read access to exchange 'amq.direct'"),
        ),
        ("basic.consume", text("read access to queue 'other'")),
        ("basic.get", text("read access to queue 'other'")),
        ("queue.purge", text("read access to queue 'other'")),
    ];
    for (op, want) in cases {
        let ch = channel(&conn).await;
        let r = match op {
            "queue.declare" => ch
                .queue_declare("q".into(), QueueDeclareOptions::default(), no_args())
                .await
                .map(|_| ()),
            "exchange.declare" => {
                ch.exchange_declare(
                    "x".into(),
                    lapin::ExchangeKind::Fanout,
                    ExchangeDeclareOptions::default(),
                    no_args(),
                )
                .await
            }
            "queue.delete" => ch
                .queue_delete("other".into(), QueueDeleteOptions::default())
                .await
                .map(|_| ()),
            "queue.bind (queue)" => {
                ch.queue_bind(
                    "other".into(),
                    "lim.x".into(),
                    "k".into(),
                    QueueBindOptions::default(),
                    no_args(),
                )
                .await
            }
            "queue.bind (exchange)" => {
                ch.queue_bind(
                    "lim.q".into(),
                    "amq.direct".into(),
                    "k".into(),
                    QueueBindOptions::default(),
                    no_args(),
                )
                .await
            }
            "basic.consume" => ch
                .basic_consume(
                    "other".into(),
                    "c".into(),
                    BasicConsumeOptions::default(),
                    no_args(),
                )
                .await
                .map(|_| ()),
            "basic.get" => ch
                .basic_get("other".into(), BasicGetOptions::default())
                .await
                .map(|_| ()),
            "queue.purge" => ch
                .queue_purge("other".into(), QueuePurgeOptions::default())
                .await
                .map(|_| ()),
            _ => unreachable!(),
        };
        let (code, got) = refusal(r);
        assert_eq!((code, got.as_str()), (403, want.as_str()), "{op}");
    }

    // basic.publish: write on the exchange, refused asynchronously.
    let mut events = error_events(&conn);
    let ch = confirm_channel(&conn).await;
    publish_confirmed(&ch, "lim.x", "k", b"ok", BasicProperties::default()).await;
    let _ = ch
        .basic_publish(
            "amq.direct".into(),
            "k".into(),
            BasicPublishOptions::default(),
            b"no",
            BasicProperties::default(),
        )
        .await;
    assert_eq!(
        next_close(&mut events).await,
        (403, text("write access to exchange 'amq.direct'"))
    );
    assert_eq!(queue_len(&channel(&conn).await, "lim.q").await, 1);

    // In a transaction too: refused when the publish arrives, not at commit.
    let ch = channel(&conn).await;
    ch.tx_select().await.expect("tx.select");
    let _ = ch
        .basic_publish(
            "amq.direct".into(),
            "k".into(),
            BasicPublishOptions::default(),
            b"no",
            BasicProperties::default(),
        )
        .await;
    assert_eq!(
        next_close(&mut events).await,
        (403, text("write access to exchange 'amq.direct'"))
    );
}

/// Users and permissions come from the file at every start and are
/// durable: a user the file no longer has is gone after a restart, changed
/// permissions apply, and the others keep working.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_file_sets_users_and_permissions_at_every_start() {
    let (mut broker, dir) = start();
    connect(&broker.url_with("lim", "pl", "a")).await;
    let changed = CONFIG
        .replace(
            r#"permissions = [{ vhost = "b", configure = ".*", write = ".*", read = ".*" }]"#,
            r#"permissions = [{ vhost = "a", configure = ".*", write = ".*", read = ".*" }]"#,
        )
        .replace("name = \"lim\"", "name = \"lim2\"");
    assert_ne!(changed, CONFIG);
    std::fs::write(dir.path().join("weir.toml"), changed).expect("config file");
    broker.stop();
    broker.restart();
    let mut c = RawClient::connect(broker.addr()).await;
    let close = c
        .handshake("lim", "pl", "a")
        .await
        .expect_err("a user removed from the file logged in");
    assert_eq!(close.code, 403, "{close:?}");
    let mut c = RawClient::connect(broker.addr()).await;
    let close = c.handshake("ub", "pb", "b").await.expect_err("ub kept b");
    assert_eq!(close.code, 530, "{close:?}");
    let a = connect(&broker.url_with("ub", "pb", "a")).await;
    declare_queue(&channel(&a).await, "q").await;
    connect(&broker.url_with("lim2", "pl", "a")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn topic_permissions_restrict_amqp_topic_publishes_and_bindings() {
    let (broker, _dir) = start();
    let conn = connect(&broker.url_with("ua", "pa", "a")).await;
    let ch = confirm_channel(&conn).await;
    declare_queue(&ch, "t").await;
    for key in ["ua.#", "public.news"] {
        ch.queue_bind(
            "t".into(),
            "amq.topic".into(),
            key.into(),
            QueueBindOptions::default(),
            no_args(),
        )
        .await
        .unwrap_or_else(|e| panic!("bind {key}: {e}"));
    }
    let (code, text) = refusal(
        ch.queue_bind(
            "t".into(),
            "amq.topic".into(),
            "ub.#".into(),
            QueueBindOptions::default(),
            no_args(),
        )
        .await,
    );
    assert_eq!(code, 403);
    assert_eq!(
        text,
        "ACCESS_REFUSED - read access to topic 'ub.#' in exchange 'amq.topic' in vhost 'a' refused for user 'ua'"
    );

    let ch = confirm_channel(&conn).await;
    publish_confirmed(
        &ch,
        "amq.topic",
        "ua.temp",
        b"mine",
        BasicProperties::default(),
    )
    .await;
    // Not a topic exchange: topic permissions do not apply.
    publish_confirmed(
        &ch,
        "amq.direct",
        "ub.temp",
        b"x",
        BasicProperties::default(),
    )
    .await;
    let mut events = error_events(&conn);
    let _ = ch
        .basic_publish(
            "amq.topic".into(),
            "ub.temp".into(),
            BasicPublishOptions::default(),
            b"theirs",
            BasicProperties::default(),
        )
        .await;
    assert_eq!(
        next_close(&mut events).await,
        (
            403,
            "ACCESS_REFUSED - write access to topic 'ub.temp' in exchange 'amq.topic' in vhost 'a' refused for user 'ua'"
                .to_string()
        )
    );
    assert_eq!(queue_len(&channel(&conn).await, "t").await, 1);
}

// ---------------------------------------------------------------------------
// MQTT

type Ev<P> = Result<P, String>;

fn v5(
    port: u16,
    id: &str,
    user: &str,
    pass: &str,
) -> (
    rumqttc::v5::AsyncClient,
    mpsc::UnboundedReceiver<Ev<Packet5>>,
) {
    let mut o = rumqttc::v5::MqttOptions::new(id, "127.0.0.1", port);
    o.set_credentials(user, pass);
    o.set_keep_alive(Duration::from_secs(30));
    let (client, mut el) = rumqttc::v5::AsyncClient::new(o, 100);
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        loop {
            match el.poll().await {
                Ok(rumqttc::v5::Event::Incoming(p)) => {
                    if tx.send(Ok(p)).is_err() {
                        return;
                    }
                }
                Ok(rumqttc::v5::Event::Outgoing(_)) => {}
                Err(e) => {
                    let _ = tx.send(Err(format!("{e:?}")));
                    return;
                }
            }
        }
    });
    (client, rx)
}

fn v4(
    port: u16,
    id: &str,
    user: &str,
    pass: &str,
) -> (rumqttc::AsyncClient, mpsc::UnboundedReceiver<Ev<Packet>>) {
    let mut o = rumqttc::MqttOptions::new(id, "127.0.0.1", port);
    o.set_credentials(user, pass);
    o.set_keep_alive(Duration::from_secs(30));
    let (client, mut el) = rumqttc::AsyncClient::new(o, 100);
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        loop {
            match el.poll().await {
                Ok(Event::Incoming(p)) => {
                    if tx.send(Ok(p)).is_err() {
                        return;
                    }
                }
                Ok(Event::Outgoing(_)) => {}
                Err(e) => {
                    let _ = tx.send(Err(format!("{e:?}")));
                    return;
                }
            }
        }
    });
    (client, rx)
}

/// The next packet `pick` accepts, or the error that ended the connection.
async fn next<P: std::fmt::Debug, T>(
    rx: &mut mpsc::UnboundedReceiver<Ev<P>>,
    what: &str,
    mut pick: impl FnMut(&P) -> Option<T>,
) -> Result<T, String> {
    within(what, async {
        loop {
            match rx.recv().await {
                Some(Ok(p)) => {
                    if let Some(t) = pick(&p) {
                        return Ok(t);
                    }
                }
                Some(Err(e)) => return Err(e),
                None => return Err("event loop gone".into()),
            }
        }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mqtt_connect_to_a_tenant_without_access_is_not_authorized() {
    let (broker, _dir) = start();
    let port = broker.mqtt_port();
    let (_c, mut rx) = v5(port, "x5", "b:ua", "pa");
    let e = next(&mut rx, "CONNACK v5", |_: &Packet5| None::<()>)
        .await
        .expect_err("v5 connected to b");
    assert!(e.contains("NotAuthorized"), "{e}");
    let (_c, mut rx) = v4(port, "x4", "b:ua", "pa");
    let e = next(&mut rx, "CONNACK 3.1.1", |_: &Packet| None::<()>)
        .await
        .expect_err("3.1.1 connected to b");
    assert!(e.contains("NotAuthorized"), "{e}");
    // Its own tenant: accepted.
    let (_c, mut rx) = v5(port, "ok5", "a:ua", "pa");
    next(&mut rx, "CONNACK", |p| {
        matches!(p, Packet5::ConnAck(_)).then_some(())
    })
    .await
    .expect("a:ua connects");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mqtt_topic_permissions_restrict_subscriptions_and_publishes() {
    let (broker, _dir) = start();
    let port = broker.mqtt_port();

    // MQTT 5: SUBACK 0x87 for a refused filter (rumqttc ends its event
    // loop on a failed SUBACK, naming the reason), PUBACK 0x87 for a
    // refused publish.
    let (c, mut rx) = v5(port, "r5", "a:ua", "pa");
    c.subscribe("ub/#", QoS5::AtLeastOnce)
        .await
        .expect("subscribe");
    let e = next(&mut rx, "SUBACK", |p| {
        matches!(p, Packet5::SubAck(_)).then_some(())
    })
    .await
    .expect_err("ub/# granted");
    assert!(e.contains("SubFail { reason: NotAuthorized }"), "{e}");
    // A shared subscription alike.
    let (c, mut rx) = v5(port, "g5", "a:ua", "pa");
    c.subscribe("$share/g/ub/#", QoS5::AtLeastOnce)
        .await
        .expect("subscribe");
    let e = next(&mut rx, "SUBACK", |p| {
        matches!(p, Packet5::SubAck(_)).then_some(())
    })
    .await
    .expect_err("$share/g/ub/# granted");
    assert!(e.contains("SubFail { reason: NotAuthorized }"), "{e}");
    let (c, mut rx) = v5(port, "s5", "a:ua", "pa");
    c.subscribe_many([
        rumqttc::v5::mqttbytes::v5::Filter::new("ua/#", QoS5::AtLeastOnce),
        rumqttc::v5::mqttbytes::v5::Filter::new("public/news", QoS5::AtLeastOnce),
    ])
    .await
    .expect("subscribe");
    let codes = next(&mut rx, "SUBACK", |p| match p {
        Packet5::SubAck(s) => Some(s.return_codes.clone()),
        _ => None,
    })
    .await
    .expect("SUBACK");
    assert_eq!(codes, vec![Sub5::Success(QoS5::AtLeastOnce); 2]);
    c.publish("ua/temp", QoS5::AtLeastOnce, false, "mine")
        .await
        .expect("publish");
    let got = next(&mut rx, "own message", |p| match p {
        Packet5::Publish(m) => Some((m.topic.clone(), m.payload.clone())),
        _ => None,
    })
    .await
    .expect("delivered");
    assert_eq!(got.0.as_ref(), b"ua/temp");
    assert_eq!(got.1.as_ref(), b"mine");
    c.publish("ub/temp", QoS5::AtLeastOnce, false, "theirs")
        .await
        .expect("publish");
    let e = next(&mut rx, "PUBACK", |p| match p {
        Packet5::PubAck(a) => Some(a.reason),
        _ => None,
    })
    .await
    .expect_err("a refused publish was acknowledged");
    assert!(e.contains("PubAckFail { reason: NotAuthorized }"), "{e}");

    // MQTT 3.1.1: SUBACK failure (0x80); a refused publish closes the
    // connection (3.1.1 has no negative PUBACK), as RabbitMQ does.
    let (c, mut rx) = v4(port, "s4", "a:ua", "pa");
    c.subscribe("ub/#", QoS::AtLeastOnce)
        .await
        .expect("subscribe");
    let codes = next(&mut rx, "SUBACK", |p| match p {
        Packet::SubAck(s) => Some(s.return_codes.clone()),
        _ => None,
    })
    .await
    .expect("SUBACK");
    assert_eq!(codes, vec![rumqttc::SubscribeReasonCode::Failure]);
    c.publish("ub/temp", QoS::AtLeastOnce, false, "theirs")
        .await
        .expect("publish");
    let r = next(&mut rx, "PUBACK or close", |p| {
        matches!(p, Packet::PubAck(_)).then_some(())
    })
    .await;
    assert!(r.is_err(), "a refused 3.1.1 publish was acknowledged");
}
