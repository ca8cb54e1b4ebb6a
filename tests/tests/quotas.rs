//! Tenant quotas (issue 9) against the real binary: a tenant at its
//! queued-bytes or memory quota is blocked (`connection.blocked`) while
//! another tenant keeps publishing, and unblocked when drained (paged-out
//! messages do not count towards memory); the count limits refuse with
//! RabbitMQ's codes; an MQTT client over a limit gets 0x97;
//! `[[quota.connections]]` rules pace and limit the channels of the AMQP
//! connections and MQTT clients they name; a publisher over its tenant's
//! rate is paused (its precision is a time:
//! the limiter is unit-tested in `quota/src/rate.rs` on a fake clock, and
//! the rate held is measured by the noisy-neighbour benchmark).

use futures_lite::StreamExt;
use lapin::options::{BasicConsumeOptions, BasicPublishOptions};
use lapin::types::FieldTable;
use lapin::BasicProperties;
use std::pin::Pin;
use weir_tests::*;

/// A broker (AMQP and MQTT) whose configuration file is `toml`.
fn start(toml: &str) -> (Broker, tempfile::TempDir) {
    let tmp = tempfile::tempdir().expect("tempdir");
    let file = tmp.path().join("weir.toml");
    // guest may use every tenant of the file (permissions are not what
    // these tests are about; a configured user's list replaces the default).
    let mut vhosts = vec!["/".to_string()];
    let mut lines = toml.lines();
    while let Some(l) = lines.next() {
        if l.trim() == "[[tenants]]" {
            if let Some(n) = lines.next().and_then(|n| n.split('"').nth(1)) {
                vhosts.push(n.to_string());
            }
        }
    }
    let perms: Vec<String> = vhosts
        .iter()
        .map(|v| {
            format!("{{ vhost = \"{v}\", configure = \".*\", write = \".*\", read = \".*\" }}")
        })
        .collect();
    let toml = format!(
        "{toml}\n[[auth.users]]\nname = \"guest\"\npassword = \"guest\"\npermissions = [{}]\n",
        perms.join(", ")
    );
    std::fs::write(&file, toml).expect("config file");
    let b = Broker::start_mqtt_with(&["--config", file.to_str().expect("utf-8 path")]);
    (b, tmp)
}

type Events = Pin<Box<dyn futures_lite::Stream<Item = lapin::Event> + Send>>;

/// The next blocked/unblocked event: `Some(reason)` for blocked.
async fn next_block_event(events: &mut Events) -> Option<String> {
    loop {
        match within("connection.blocked/unblocked", events.next()).await {
            Some(lapin::Event::ConnectionBlocked(reason)) => return Some(reason),
            Some(lapin::Event::ConnectionUnblocked) => return None,
            Some(lapin::Event::Error(e)) => panic!("connection error: {e:?}"),
            Some(_) => continue,
            None => panic!("event stream ended"),
        }
    }
}

/// Publishes without waiting for the confirm; returns the confirm's future.
async fn publish(ch: &lapin::Channel, key: &str, body: &[u8]) -> lapin::PublisherConfirm {
    within(
        "basic.publish",
        ch.basic_publish(
            "".into(),
            key.into(),
            BasicPublishOptions::default(),
            body,
            BasicProperties::default(),
        ),
    )
    .await
    .expect("basic.publish")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_at_its_queued_bytes_quota_is_blocked_while_another_keeps_publishing() {
    let (broker, _tmp) =
        start("[[tenants]]\nname = \"a\"\nmax-queued-bytes = 10000\n\n[[tenants]]\nname = \"b\"\n");
    let conn_a = connect(&broker.url_with("guest", "guest", "a")).await;
    let mut events: Events = Box::pin(conn_a.events_listener());
    let ch_a = confirm_channel(&conn_a).await;
    declare_queue(&ch_a, "flood").await;
    let body = vec![b'x'; 1000];
    // Ten messages reach the quota exactly; each is confirmed.
    for _ in 0..10 {
        publish_confirmed(&ch_a, "", "flood", &body, BasicProperties::default()).await;
    }
    // The next publish is taken (and confirmed), then the connection is
    // blocked, naming the tenant's quota.
    let in_hand = publish(&ch_a, "flood", &body).await;
    let reason = next_block_event(&mut events)
        .await
        .expect("blocked, not unblocked");
    assert!(
        reason.contains("tenant 'a'") && reason.contains("quota"),
        "reason: {reason}"
    );
    assert!(within("confirm in hand", in_hand)
        .await
        .expect("confirm")
        .is_ack());
    // Not read any more: this one is not confirmed while blocked. (lapin
    // holds it back itself once blocked; the broker would not read it.)
    let held = {
        let (ch, body) = (ch_a.clone(), body.clone());
        tokio::spawn(async move {
            ch.basic_publish(
                "".into(),
                "flood".into(),
                BasicPublishOptions::default(),
                &body,
                BasicProperties::default(),
            )
            .await?
            .await
        })
    };

    // Tenant b publishes on, its confirms coming.
    let conn_b = connect(&broker.url_with("guest", "guest", "b")).await;
    let ch_b = confirm_channel(&conn_b).await;
    declare_queue(&ch_b, "steady").await;
    for _ in 0..50 {
        publish_confirmed(&ch_b, "", "steady", &body, BasicProperties::default()).await;
    }
    assert!(
        !held.is_finished(),
        "tenant a's publish was confirmed while blocked"
    );
    // The broker holds what it took before the block, nothing more.
    let conn_a2 = connect(&broker.url_with("guest", "guest", "a")).await;
    let ch_a2 = conn_a2.create_channel().await.expect("channel");
    assert_eq!(queue_len(&ch_a2, "flood").await, 11);

    // A consumer drains tenant a's queue: its publisher is unblocked and
    // the held publish is taken and confirmed.
    let mut consumer = ch_a2
        .basic_consume(
            "flood".into(),
            "drain".into(),
            BasicConsumeOptions {
                no_ack: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .expect("basic.consume");
    for _ in 0..11 {
        next_delivery(&mut consumer).await;
    }
    assert_eq!(next_block_event(&mut events).await, None, "unblocked");
    let confirm = within("held confirm", held)
        .await
        .expect("publish task")
        .expect("confirm");
    assert!(confirm.is_ack());
    next_delivery(&mut consumer).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn count_limits_refuse_with_rabbitmqs_codes() {
    let (broker, _tmp) = start(
        "[[tenants]]\nname = \"a\"\nmax-connections = 2\nmax-queues = 1\n\
         max-message-size = 100\n\n[[tenants]]\nname = \"c\"\nmax-channels-per-connection = 1\n",
    );
    let url = broker.url_with("guest", "guest", "a");
    let c1 = connect(&url).await;
    let _c2 = connect(&url).await;
    // max-connections: 530 NOT_ALLOWED at connection.open.
    let refused = within(
        "third connection",
        lapin::Connection::connect(&url, lapin::ConnectionProperties::default()),
    )
    .await;
    assert_code(refused.map(|_| ()), 530);

    // max-queues: 406 with RabbitMQ's text.
    let ch = confirm_channel(&c1).await;
    declare_queue(&ch, "q1").await;
    let err = ch
        .queue_declare("q2".into(), Default::default(), FieldTable::default())
        .await
        .expect_err("over max-queues");
    assert_eq!(reply_code(&err), Some(406), "{err:?}");
    assert!(
        err.to_string()
            .contains("cannot declare queue 'q2': queue limit in vhost 'a' (1) is reached"),
        "{err}"
    );

    // max-message-size: 406 with RabbitMQ's text.
    let mut events: Events = Box::pin(c1.events_listener());
    let ch = confirm_channel(&c1).await;
    publish_confirmed(&ch, "", "q1", &[0; 100], BasicProperties::default()).await;
    let confirm = publish(&ch, "q1", &[0; 101]).await;
    let _ = within("refused publish", confirm).await;
    assert_eq!(next_error_code(&mut events).await, 406);

    // max-channels-per-connection: a second channel closes the connection, 530.
    let c3 = connect(&broker.url_with("guest", "guest", "c")).await;
    let mut events: Events = Box::pin(c3.events_listener());
    let _first = c3.create_channel().await.expect("first channel");
    let _ = c3.create_channel().await;
    assert_eq!(next_error_code(&mut events).await, 530);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_mqtt_client_over_the_tenants_connection_limit_gets_quota_exceeded() {
    use rumqttc::v5::mqttbytes::v5::{ConnectReturnCode, Packet};
    use rumqttc::v5::{AsyncClient, ConnectionError, Event, MqttOptions};
    let (broker, _tmp) = start("[[tenants]]\nname = \"a\"\nmax-connections = 1\n");
    let connack = |id: &str| {
        let mut o = MqttOptions::new(id, "127.0.0.1", broker.mqtt_port());
        o.set_credentials("a:guest", "guest");
        let (client, mut el) = AsyncClient::new(o, 10);
        async move {
            let r = loop {
                match within("CONNACK", el.poll()).await {
                    Ok(Event::Incoming(Packet::ConnAck(a))) => break Ok(a.code),
                    Ok(_) => continue,
                    Err(ConnectionError::ConnectionRefused(code)) => break Err(code),
                    Err(e) => panic!("MQTT connect: {e:?}"),
                }
            };
            (client, el, r)
        }
    };
    let (_c1, _el1, first) = connack("quota-1").await;
    assert_eq!(first, Ok(ConnectReturnCode::Success));
    let (_c2, _el2, second) = connack("quota-2").await;
    assert_eq!(second, Err(ConnectReturnCode::QuotaExceeded));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_mqtt_publisher_of_a_tenant_at_its_quota_is_not_read_until_drained() {
    use lapin::options::QueueBindOptions;
    use rumqttc::{AsyncClient, Event, MqttOptions, Packet, QoS};
    let (broker, _tmp) = start("[[tenants]]\nname = \"a\"\nmax-queued-messages = 5\n");
    // An AMQP queue of tenant a holds what the MQTT publisher sends.
    let amqp = connect(&broker.url_with("guest", "guest", "a")).await;
    let ch = amqp.create_channel().await.expect("channel");
    declare_queue(&ch, "held").await;
    ch.queue_bind(
        "held".into(),
        "amq.topic".into(),
        "q.#".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .expect("queue.bind");

    let mut o = MqttOptions::new("quota-pub", "127.0.0.1", broker.mqtt_port());
    o.set_credentials("a:guest", "guest");
    let (client, mut el) = AsyncClient::new(o, 20);
    let (acks_tx, mut acks) = tokio::sync::watch::channel(0usize);
    tokio::spawn(async move {
        let mut n = 0;
        while let Ok(ev) = el.poll().await {
            if let Event::Incoming(Packet::PubAck(_)) = ev {
                n += 1;
                acks_tx.send_replace(n);
            }
        }
    });
    for i in 0..10 {
        client
            .publish("q/x", QoS::AtLeastOnce, false, format!("m{i}"))
            .await
            .expect("publish");
    }
    // Five reach the quota; the sixth is the publish in hand; then the
    // publisher is not read.
    within("6 PUBACKs", acks.wait_for(|n| *n >= 6))
        .await
        .expect("ack counter");
    assert_eq!(queue_len(&ch, "held").await, 6);
    // Another tenant's traffic goes on meanwhile; tenant a's queue holds 6.
    assert_broker_healthy(&broker.url()).await;
    assert_eq!(queue_len(&ch, "held").await, 6);
    assert_eq!(*acks.borrow(), 6, "a blocked MQTT publisher was read");

    // Drained by a consumer: the publisher is read again, all ten arrive.
    let mut consumer = ch
        .basic_consume(
            "held".into(),
            "drain".into(),
            BasicConsumeOptions {
                no_ack: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .expect("basic.consume");
    for _ in 0..10 {
        next_delivery(&mut consumer).await;
    }
    within("10 PUBACKs", acks.wait_for(|n| *n >= 10))
        .await
        .expect("ack counter");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_users_connection_limit_refuses_with_530() {
    let (broker, _tmp) = start("[[quota.users]]\nname = \"guest\"\nmax-connections = 1\n");
    let _first = connect(&broker.url()).await;
    let refused = within(
        "second connection",
        lapin::Connection::connect(&broker.url(), lapin::ConnectionProperties::default()),
    )
    .await;
    let err = refused
        .map(|_| ())
        .expect_err("over the user's max-connections");
    assert_eq!(reply_code(&err), Some(530), "{err:?}");
    assert!(
        err.to_string()
            .contains("Connection refused for user 'guest'. User connection limit (1) is reached"),
        "{err}"
    );
}

/// A publisher over its tenant's `publish-rate` is paused (its socket not
/// read) while another tenant's publisher goes on. Observed through the
/// broker's state, not a duration: with a rate of 1 msg/s, twenty
/// messages sent at once owe the limiter about 19 s, far longer than the
/// other tenant needs for its fifty confirms.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publisher_over_its_tenants_rate_is_paused_while_another_publishes() {
    let (broker, _tmp) =
        start("[[tenants]]\nname = \"a\"\npublish-rate = 1\n\n[[tenants]]\nname = \"b\"\n");
    let conn_a = connect(&broker.url_with("guest", "guest", "a")).await;
    let ch_a = confirm_channel(&conn_a).await;
    declare_queue(&ch_a, "paced").await;
    let mut confirms = Vec::new();
    for _ in 0..20 {
        confirms.push(publish(&ch_a, "paced", b"x").await);
    }
    let last = publish(&ch_a, "paced", b"last").await;
    let last = tokio::spawn(last);

    let conn_b = connect(&broker.url_with("guest", "guest", "b")).await;
    let ch_b = confirm_channel(&conn_b).await;
    declare_queue(&ch_b, "steady").await;
    for _ in 0..50 {
        publish_confirmed(&ch_b, "", "steady", b"y", BasicProperties::default()).await;
    }
    let conn_a2 = connect(&broker.url_with("guest", "guest", "a")).await;
    let ch_a2 = conn_a2.create_channel().await.expect("channel");
    let taken = queue_len(&ch_a2, "paced").await;
    assert!(
        taken < 21,
        "the rate-limited publisher was read through: {taken}"
    );
    assert!(!last.is_finished(), "its last publish was confirmed");
}

/// `max-memory` (100,000 bytes here) counts the bytes a tenant's queues
/// hold in memory, not what is paged out to the store: a queue deeper than
/// the engine keeps in memory (`HOT_ENTRIES`, 2,048 per partition) holds
/// its tail by position only. Past the memory quota the tenant is blocked, naming that quota,
/// while another tenant publishes on; drained, it is unblocked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_at_its_memory_quota_is_blocked_while_paged_out_bytes_do_not_count() {
    let (broker, _tmp) =
        start("[[tenants]]\nname = \"a\"\nmax-memory = 100000\n\n[[tenants]]\nname = \"b\"\n");
    let conn_a = connect(&broker.url_with("guest", "guest", "a")).await;
    let mut events: Events = Box::pin(conn_a.events_listener());
    let ch_a = confirm_channel(&conn_a).await;
    declare_queue(&ch_a, "deep").await;
    // 2,048 small messages fill the queue's in-memory head (20 kB); the
    // next 200 kB go to the store, beyond the 100 kB quota in queued bytes
    // but not in memory. Every confirm comes: never blocked (a blocked
    // connection is not read, so its later publishes would not be).
    let mut confirms = Vec::new();
    for _ in 0..2048 {
        confirms.push(publish(&ch_a, "deep", &[b's'; 10]).await);
    }
    let big = vec![b'x'; 1000];
    for _ in 0..200 {
        confirms.push(publish(&ch_a, "deep", &big).await);
    }
    for c in confirms {
        assert!(within("confirm", c).await.expect("confirm").is_ack());
    }

    // 20,480 bytes in memory and 80 messages of 1,000 reach the quota; the
    // next publish is taken, then the connection is blocked, naming the
    // tenant's memory quota.
    declare_queue(&ch_a, "hot").await;
    for _ in 0..80 {
        publish_confirmed(&ch_a, "", "hot", &big, BasicProperties::default()).await;
    }
    let in_hand = publish(&ch_a, "hot", &big).await;
    let reason = next_block_event(&mut events)
        .await
        .expect("blocked, not unblocked");
    assert_eq!(reason, "tenant 'a' memory quota");
    assert!(within("confirm in hand", in_hand)
        .await
        .expect("confirm")
        .is_ack());

    // Tenant b publishes on.
    let conn_b = connect(&broker.url_with("guest", "guest", "b")).await;
    let ch_b = confirm_channel(&conn_b).await;
    declare_queue(&ch_b, "steady").await;
    for _ in 0..50 {
        publish_confirmed(&ch_b, "", "steady", &big, BasicProperties::default()).await;
    }

    // Draining the in-memory queue unblocks tenant a.
    let conn_a2 = connect(&broker.url_with("guest", "guest", "a")).await;
    let ch_a2 = conn_a2.create_channel().await.expect("channel");
    assert_eq!(queue_len(&ch_a2, "hot").await, 81);
    let mut consumer = ch_a2
        .basic_consume(
            "hot".into(),
            "drain".into(),
            BasicConsumeOptions {
                no_ack: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .expect("basic.consume");
    for _ in 0..81 {
        next_delivery(&mut consumer).await;
    }
    assert_eq!(next_block_event(&mut events).await, None, "unblocked");
    publish_confirmed(&ch_a, "", "hot", &big, BasicProperties::default()).await;
}

/// A connection of tenant `tenant` named `name` (AMQP `connection_name`).
async fn connect_named(broker: &Broker, tenant: &str, name: &str) -> lapin::Connection {
    within(
        "connect",
        lapin::Connection::connect(
            &broker.url_with("guest", "guest", tenant),
            lapin::ConnectionProperties::default().with_connection_name(name.into()),
        ),
    )
    .await
    .expect("connect")
}

/// `[[quota.connections]]`: a rule matched by the AMQP `connection_name`
/// paces that connection alone (its tenant has no rate: an unnamed
/// connection of the same user and tenant publishes on) and replaces the
/// tenant's channel limit, lower or higher, for the connections it covers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_overrides_pace_and_limit_channels_of_the_connections_they_match() {
    let (broker, _tmp) = start(
        "[[tenants]]\nname = \"a\"\nmax-channels-per-connection = 2\n\n\
         [[quota.connections]]\nname = \"sensor-.*\"\npublish-rate = 1\nmax-channels-per-connection = 1\n\n\
         [[quota.connections]]\nuser = \"guest\"\nname = \"pool\"\nmax-channels-per-connection = 3\n",
    );
    // The paced connection: twenty messages at once owe its limiter ~19 s.
    let sensor = connect_named(&broker, "a", "sensor-7").await;
    let ch = confirm_channel(&sensor).await;
    declare_queue(&ch, "paced").await;
    let mut confirms = Vec::new();
    for _ in 0..20 {
        confirms.push(publish(&ch, "paced", b"x").await);
    }
    let last = tokio::spawn(publish(&ch, "paced", b"last").await);
    // Another connection of the same user and tenant is not paced.
    let other = connect(&broker.url_with("guest", "guest", "a")).await;
    let och = confirm_channel(&other).await;
    declare_queue(&och, "free").await;
    for _ in 0..50 {
        publish_confirmed(&och, "", "free", b"y", BasicProperties::default()).await;
    }
    let taken = queue_len(&och, "paced").await;
    assert!(taken < 21, "the paced connection was read through: {taken}");
    assert!(!last.is_finished(), "its last publish was confirmed");

    // Channels: the unnamed connection has the tenant's 2 (one open).
    let _second = other.create_channel().await.expect("second channel");
    // The pool gets 3, above the tenant's limit; a 4th closes it with 530.
    let pool = connect_named(&broker, "a", "pool").await;
    let mut pool_events: Events = Box::pin(pool.events_listener());
    let mut chans = Vec::new();
    for _ in 0..3 {
        chans.push(pool.create_channel().await.expect("pool channel"));
    }
    let _ = pool.create_channel().await;
    assert_eq!(next_error_code(&mut pool_events).await, 530);
    // The sensor rule allows one channel, below the tenant's 2 (another
    // sensor: the paced one's socket is not read for a while).
    let quiet = connect_named(&broker, "a", "sensor-8").await;
    let mut quiet_events: Events = Box::pin(quiet.events_listener());
    let _one = quiet.create_channel().await.expect("first channel");
    let _ = quiet.create_channel().await;
    assert_eq!(next_error_code(&mut quiet_events).await, 530);
}

/// An MQTT client id matched by a `[[quota.connections]]` rule is paced by
/// its own limiter: at 1 msg/s, twenty QoS 1 publishes sent at once owe it
/// about 19 s, so a 21st is not read while a client with another id of the
/// same user and tenant publishes its fifty.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_mqtt_client_id_matched_by_a_connection_rule_is_paced_alone() {
    use lapin::options::QueueBindOptions;
    use rumqttc::{AsyncClient, Event, MqttOptions, Packet, QoS};
    let (broker, _tmp) = start(
        "[[tenants]]\nname = \"a\"\n\n\
         [[quota.connections]]\nname = \"meter-.*\"\npublish-rate = 1\n",
    );
    let amqp = connect(&broker.url_with("guest", "guest", "a")).await;
    let ch = amqp.create_channel().await.expect("channel");
    for (q, key) in [("paced", "m.#"), ("free", "f.#")] {
        declare_queue(&ch, q).await;
        ch.queue_bind(
            q.into(),
            "amq.topic".into(),
            key.into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect("queue.bind");
    }
    // A client and a counter of its PUBACKs.
    let mqtt = |id: &str| {
        let mut o = MqttOptions::new(id, "127.0.0.1", broker.mqtt_port());
        o.set_credentials("a:guest", "guest");
        let (client, mut el) = AsyncClient::new(o, 100);
        let (acks_tx, acks) = tokio::sync::watch::channel(0usize);
        tokio::spawn(async move {
            let mut n = 0;
            while let Ok(ev) = el.poll().await {
                if let Event::Incoming(Packet::PubAck(_)) = ev {
                    n += 1;
                    acks_tx.send_replace(n);
                }
            }
        });
        (client, acks)
    };
    let (meter, mut meter_acks) = mqtt("meter-1");
    for i in 0..20 {
        meter
            .publish("m/x", QoS::AtLeastOnce, false, format!("m{i}"))
            .await
            .expect("publish");
    }
    // Read (at least a first batch): its debt is owed from now on.
    within("a PUBACK", meter_acks.wait_for(|n| *n >= 1))
        .await
        .expect("ack counter");
    meter
        .publish("m/x", QoS::AtLeastOnce, false, "last")
        .await
        .expect("publish");
    let (other, mut other_acks) = mqtt("gateway-1");
    for i in 0..50 {
        other
            .publish("f/x", QoS::AtLeastOnce, false, format!("f{i}"))
            .await
            .expect("publish");
    }
    within("50 PUBACKs", other_acks.wait_for(|n| *n >= 50))
        .await
        .expect("ack counter");
    assert_eq!(queue_len(&ch, "free").await, 50);
    let taken = queue_len(&ch, "paced").await;
    assert!(taken < 21, "the paced client was read through: {taken}");
    assert!(
        *meter_acks.borrow() < 21,
        "all the paced client's publishes were acknowledged"
    );
}
