//! Shovels (issue 27) against real brokers the tests start for
//! themselves (`weir_tests::external`): a RabbitMQ node of its own, a
//! Mosquitto instance and a nats-server with JetStream. A test that cannot start one says "skipped" and why.
//!
//! * RabbitMQ queue of persistent messages → Weir queue, with RabbitMQ
//!   killed and restarted, then Weir restarted, mid-way: every message arrives
//!   (duplicates are counted and printed: at-least-once allows them).
//! * Mosquitto → Weir and Weir → Mosquitto, each with a restart of
//!   Mosquitto mid-way: every message arrives.
//! * NATS JetStream → Weir and Weir → JetStream, each with a restart of
//!   nats-server mid-way: every message arrives.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions, QueueDeclareOptions,
};
use lapin::types::FieldTable;
use lapin::BasicProperties;
use serde_json::json;
use weir_tests::external::{Mosquitto, NatsClient, NatsServer, RabbitNode};
use weir_tests::http::Http;
use weir_tests::*;

/// Messages the RabbitMQ test moves (`WEIR_SHOVEL_MESSAGES`; the issue's
/// figure is 100,000, which takes RabbitMQ minutes to take in on a shared
/// CI machine: 20,000 by default).
fn messages() -> usize {
    std::env::var("WEIR_SHOVEL_MESSAGES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20_000)
}

/// How long the whole transfer may take before the test gives up.
const TRANSFER_TIMEOUT: Duration = Duration::from_secs(600);
/// How long a single delivery may keep us waiting (a shovel reconnects
/// after its delay, a broker restarts).
const GAP_TIMEOUT: Duration = Duration::from_secs(120);

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(f).await.expect("blocking task")
}

/// Publishes `n` persistent messages numbered 0..n to `queue` on `url`
/// (declared durable), confirmed.
async fn fill(url: &str, queue: &str, n: usize) {
    let conn = connect(url).await;
    let ch = confirm_channel(&conn).await;
    ch.queue_declare(
        queue.into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .expect("queue.declare");
    let mut pending = Vec::with_capacity(1000);
    for i in 0..n {
        let c = ch
            .basic_publish(
                "".into(),
                queue.into(),
                BasicPublishOptions::default(),
                format!("{i}").as_bytes(),
                BasicProperties::default().with_delivery_mode(2),
            )
            .await
            .expect("basic.publish");
        pending.push(c);
        if pending.len() == 1000 || i + 1 == n {
            for c in pending.drain(..) {
                assert!(c.await.expect("confirm").is_ack(), "publish nacked");
            }
        }
    }
    let _ = conn.close(200, "done".into()).await;
}

/// What a consumer of the destination saw.
#[derive(Default)]
struct Seen {
    ids: HashSet<usize>,
    duplicates: usize,
}

impl Seen {
    fn add(&mut self, body: &[u8]) {
        let id: usize = std::str::from_utf8(body)
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("unexpected body {body:?}"));
        if !self.ids.insert(id) {
            self.duplicates += 1;
        }
    }
}

/// Consumes `queue` on `url` until `seen` holds `until` distinct ids
/// (acknowledging), or panics after a gap of [`GAP_TIMEOUT`].
async fn consume_until(url: &str, queue: &str, seen: &mut Seen, until: usize) {
    let conn = connect(url).await;
    let ch = conn.create_channel().await.expect("channel");
    ch.basic_qos(1000, BasicQosOptions::default())
        .await
        .expect("qos");
    let mut consumer = ch
        .basic_consume(
            queue.into(),
            "check".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect("basic.consume");
    let deadline = Instant::now() + TRANSFER_TIMEOUT;
    while seen.ids.len() < until {
        assert!(Instant::now() < deadline, "transfer took too long");
        let d = match tokio::time::timeout(GAP_TIMEOUT, consumer.next()).await {
            Ok(Some(Ok(d))) => d,
            other => panic!(
                "no delivery for {GAP_TIMEOUT:?} ({} of {until} seen): {:?}",
                seen.ids.len(),
                other.map(|o| o.map(|r| r.map(|d| d.delivery_tag)))
            ),
        };
        seen.add(&d.data);
        d.acker
            .ack(BasicAckOptions::default())
            .await
            .expect("basic.ack");
    }
    let _ = conn.close(200, "done".into()).await;
}

async fn declare_durable(url: &str, queue: &str) {
    let conn = connect(url).await;
    let ch = conn.create_channel().await.expect("channel");
    ch.queue_declare(
        queue.into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .expect("queue.declare");
    let _ = conn.close(200, "done".into()).await;
}

/// The shovel's status as `GET /api/shovels` lists it.
fn status(http: &Http, name: &str) -> serde_json::Value {
    let all = http.get_json("/api/shovels");
    all.as_array()
        .and_then(|a| a.iter().find(|s| s["name"] == name).cloned())
        .unwrap_or_else(|| panic!("shovel {name} not listed: {all}"))
}

/// Waits until the shovel reports `running` (its source is subscribed).
async fn until_running(http: &Http, name: &str) {
    let deadline = Instant::now() + GAP_TIMEOUT;
    loop {
        let s = status(http, name);
        if s["state"] == "running" {
            return;
        }
        assert!(Instant::now() < deadline, "shovel never ran: {s}");
        // Nothing to await: the state is only observable through the API.
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Messages ready in `queue` on `url` (a passive declare).
async fn ready(url: &str, queue: &str) -> u32 {
    let conn = connect(url).await;
    let ch = conn.create_channel().await.expect("channel");
    let q = ch
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .expect("queue.declare passive");
    let _ = conn.close(200, "done".into()).await;
    q.message_count()
}

/// Waits until the shovel reports at least `n` messages moved.
async fn until_transferred(http: &Http, name: &str, n: u64) {
    let deadline = Instant::now() + TRANSFER_TIMEOUT;
    loop {
        let s = status(http, name);
        if s["transferred"].as_u64().unwrap_or(0) >= n {
            return;
        }
        assert!(Instant::now() < deadline, "shovel stuck: {s}");
        // Nothing to await: progress is only observable through the API.
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_queue_moves_into_weir_across_restarts_of_both() {
    let t0 = Instant::now();
    let rabbit = match blocking(RabbitNode::start).await {
        Ok(r) => r,
        Err(why) => {
            eprintln!("skipped: no RabbitMQ node: {why}");
            return;
        }
    };
    let n = messages();
    eprintln!("{:?}: RabbitMQ node up", t0.elapsed());
    fill(&rabbit.url(), "orders", n).await;
    eprintln!("{:?}: {n} persistent messages in RabbitMQ", t0.elapsed());

    let mut weir = blocking(Broker::start).await;
    declare_durable(&weir.url(), "orders").await;
    let http = Http::new(weir.http_port(), "guest", "guest");
    let r = http.put(
        "/api/parameters/shovel/%2F/from-rabbit",
        json!({"value": {
            "src-protocol": "amqp091", "src-uri": rabbit.url(), "src-queue": "orders",
            "dest-protocol": "amqp091", "dest-uri": "amqp://", "dest-queue": "orders",
            "ack-mode": "on-confirm", "src-prefetch-count": 1000, "reconnect-delay": 1
        }}),
    );
    assert_eq!(r.status, 201, "{}", r.text);
    // The definition reads back as given, as a runtime parameter.
    let p = http.get_json("/api/parameters/shovel/%2F/from-rabbit");
    assert_eq!(p["component"], "shovel");
    assert_eq!(p["value"]["src-queue"], "orders");

    // RabbitMQ killed and restarted once a tenth has moved.
    until_transferred(&http, "from-rabbit", n as u64 / 10).await;
    let (rabbit, restarted) = blocking(move || {
        let r = rabbit.kill_and_restart();
        (rabbit, r)
    })
    .await;
    restarted.expect("RabbitMQ restart");
    let left = ready(&rabbit.url(), "orders").await;
    eprintln!(
        "{:?}: RabbitMQ restarted with {left} messages left",
        t0.elapsed()
    );
    assert!(left > 0, "RabbitMQ was not restarted mid-way");

    // Weir restarted once half has moved.
    until_transferred(&http, "from-rabbit", n as u64 / 2).await;
    let s = status(&http, "from-rabbit");
    assert!(
        s["failures"].as_u64().unwrap_or(0) >= 1,
        "the RabbitMQ restart was not seen by the shovel: {s}"
    );
    weir = blocking(move || {
        weir.stop();
        weir
    })
    .await;
    // While Weir is down nothing moves: what is left at RabbitMQ now.
    let left = ready(&rabbit.url(), "orders").await;
    eprintln!(
        "{:?}: Weir stopped with {left} messages left at RabbitMQ",
        t0.elapsed()
    );
    assert!(left > 0, "Weir was not restarted mid-way");
    weir = blocking(move || {
        weir.restart();
        weir
    })
    .await;
    let http = Http::new(weir.http_port(), "guest", "guest");
    let mut seen = Seen::default();
    consume_until(&weir.url(), "orders", &mut seen, n).await;
    assert_eq!(seen.ids.len(), n);
    eprintln!(
        "{:?}: moved {n} persistent messages across a RabbitMQ and a Weir restart: {} duplicates",
        t0.elapsed(),
        seen.duplicates
    );
    // Restored from the data directory, and exported with the definitions.
    let s = status(&http, "from-rabbit");
    assert_eq!(s["src_queue"], "orders", "{s}");
    let defs = http.get_json("/api/definitions");
    assert!(
        defs["parameters"]
            .as_array()
            .is_some_and(|a| a.iter().any(|p| p["name"] == "from-rabbit")),
        "{defs}"
    );
    drop(rabbit);
}

/// MQTT: publishes `n` QoS 1 messages numbered `from..from+n` to `topic`
/// on `port`.
async fn mqtt_publish(port: u16, topic: &str, from: usize, n: usize) {
    let mut o = rumqttc::MqttOptions::new(format!("pub-{from}"), "127.0.0.1", port);
    o.set_keep_alive(Duration::from_secs(30));
    let (client, mut events) = rumqttc::AsyncClient::new(o, 64);
    let t = topic.to_string();
    let publisher = tokio::spawn(async move {
        for i in from..from + n {
            client
                .publish(t.clone(), rumqttc::QoS::AtLeastOnce, false, format!("{i}"))
                .await
                .expect("publish");
        }
        client
    });
    let mut acked = 0;
    while acked < n {
        match tokio::time::timeout(GAP_TIMEOUT, events.poll()).await {
            Ok(Ok(rumqttc::Event::Incoming(rumqttc::Packet::PubAck(_)))) => acked += 1,
            Ok(Ok(_)) => {}
            other => panic!("MQTT publisher: {other:?}"),
        }
    }
    let client = publisher.await.expect("publisher");
    let _ = client.disconnect().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mqtt_broker_to_weir_across_a_mosquitto_restart() {
    let mut mosq = match blocking(Mosquitto::start).await {
        Ok(m) => m,
        Err(why) => {
            eprintln!("skipped: no Mosquitto: {why}");
            return;
        }
    };
    let weir = blocking(Broker::start).await;
    declare_durable(&weir.url(), "readings").await;
    let http = Http::new(weir.http_port(), "guest", "guest");
    let r = http.put(
        "/api/parameters/shovel/%2F/from-mqtt",
        json!({"value": {
            "src-protocol": "mqtt", "src-uri": mosq.url(), "src-topic": "sensors/#",
            "dest-protocol": "amqp091", "dest-uri": "amqp://", "dest-queue": "readings",
            "reconnect-delay": 1
        }}),
    );
    assert_eq!(r.status, 201, "{}", r.text);
    until_running(&http, "from-mqtt").await;
    let n = 2000;
    mqtt_publish(mosq.port(), "sensors/a", 0, n / 2).await;
    let mut seen = Seen::default();
    consume_until(&weir.url(), "readings", &mut seen, n / 4).await;
    mosq = blocking(move || {
        mosq.restart().expect("mosquitto restart");
        mosq
    })
    .await;
    // Published while the shovel reconnects: its persistent session at
    // Mosquitto keeps them.
    mqtt_publish(mosq.port(), "sensors/b", n / 2, n / 2).await;
    consume_until(&weir.url(), "readings", &mut seen, n).await;
    assert_eq!(seen.ids.len(), n);
    eprintln!("MQTT → Weir: {n} messages, {} duplicates", seen.duplicates);
    // A definition Weir cannot run is refused, and changes nothing.
    let r = http.put(
        "/api/parameters/shovel/%2F/bad",
        json!({"value": {"src-uri": "amqp://", "src-queue": "q", "dest-uri": "amqp://", "ack-mode": "sometimes"}}),
    );
    assert_eq!(r.status, 400, "{}", r.text);
    assert_eq!(http.get("/api/parameters/shovel/%2F/bad").status, 404);
    // Deleted: gone from the listings.
    assert_eq!(
        http.delete("/api/parameters/shovel/%2F/from-mqtt").status,
        204
    );
    assert_eq!(http.get("/api/shovels/vhost/%2F/from-mqtt").status, 404);
    assert_eq!(http.get_json("/api/shovels"), json!([]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn weir_queue_to_mqtt_broker_across_a_mosquitto_restart() {
    let mut mosq = match blocking(Mosquitto::start).await {
        Ok(m) => m,
        Err(why) => {
            eprintln!("skipped: no Mosquitto: {why}");
            return;
        }
    };
    let weir = blocking(Broker::start).await;
    let n = 2000;
    fill(&weir.url(), "outbound", n / 2).await;
    // A persistent subscriber at Mosquitto, subscribed before anything
    // moves (QoS 1, clean session off: kept across its reconnects).
    let mut o = rumqttc::MqttOptions::new("checker", "127.0.0.1", mosq.port());
    o.set_keep_alive(Duration::from_secs(30));
    o.set_clean_session(false);
    let (sub, mut events) = rumqttc::AsyncClient::new(o, 64);
    sub.subscribe("out/#", rumqttc::QoS::AtLeastOnce)
        .await
        .expect("subscribe");
    loop {
        match tokio::time::timeout(GAP_TIMEOUT, events.poll()).await {
            Ok(Ok(rumqttc::Event::Incoming(rumqttc::Packet::SubAck(_)))) => break,
            Ok(Ok(_)) => {}
            other => panic!("subscriber: {other:?}"),
        }
    }
    let http = Http::new(weir.http_port(), "guest", "guest");
    let r = http.put(
        "/api/parameters/shovel/%2F/to-mqtt",
        json!({"value": {
            "src-protocol": "amqp091", "src-uri": "amqp://", "src-queue": "outbound",
            "dest-protocol": "mqtt", "dest-uri": mosq.url(), "dest-topic": "out/weir",
            "reconnect-delay": 1
        }}),
    );
    assert_eq!(r.status, 201, "{}", r.text);
    let mut seen = Seen::default();
    let mut restarted = false;
    let mut second_half = false;
    let deadline = Instant::now() + TRANSFER_TIMEOUT;
    while seen.ids.len() < n {
        assert!(Instant::now() < deadline, "transfer took too long");
        if !restarted && seen.ids.len() >= n / 4 {
            restarted = true;
            mosq = blocking(move || {
                mosq.restart().expect("mosquitto restart");
                mosq
            })
            .await;
        }
        if !second_half && restarted {
            second_half = true;
            // The second half, numbered after the first.
            let conn = connect(&weir.url()).await;
            let ch = confirm_channel(&conn).await;
            for i in n / 2..n {
                publish_confirmed(
                    &ch,
                    "",
                    "outbound",
                    format!("{i}").as_bytes(),
                    BasicProperties::default().with_delivery_mode(2),
                )
                .await;
            }
            let _ = conn.close(200, "done".into()).await;
        }
        match tokio::time::timeout(GAP_TIMEOUT, events.poll()).await {
            Ok(Ok(rumqttc::Event::Incoming(rumqttc::Packet::Publish(p)))) => seen.add(&p.payload),
            Ok(Ok(_)) => {}
            // The restart cut the subscriber too: its next poll reconnects.
            Ok(Err(_)) => {}
            Err(_) => panic!(
                "nothing from Mosquitto for {GAP_TIMEOUT:?} ({} of {n})",
                seen.ids.len()
            ),
        }
    }
    eprintln!("Weir → MQTT: {n} messages, {} duplicates", seen.duplicates);
    let _ = sub;
}

fn js_create(c: &mut NatsClient, subject: &str, payload: serde_json::Value) {
    let a = c
        .request(subject, payload.to_string().as_bytes())
        .unwrap_or_else(|e| panic!("{subject}: {e}"));
    let v: serde_json::Value = serde_json::from_slice(&a).expect("JSON answer");
    assert!(v.get("error").is_none(), "{subject}: {v}");
}

fn js_publish_range(port: u16, subject: &str, from: usize, n: usize) {
    let mut c = NatsClient::connect(port).expect("NATS connect");
    let msgs: Vec<(String, Vec<u8>)> = (from..from + n)
        .map(|i| (subject.to_string(), format!("{i}").into_bytes()))
        .collect();
    for chunk in msgs.chunks(500) {
        c.js_publish(chunk).expect("JetStream publish");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_jetstream_to_weir_across_a_nats_restart() {
    let mut nats = match blocking(NatsServer::start).await {
        Ok(n) => n,
        Err(why) => {
            eprintln!("skipped: no NATS server: {why}");
            return;
        }
    };
    let port = nats.port();
    let n = 2000;
    blocking(move || {
        let mut c = NatsClient::connect(port).expect("NATS connect");
        js_create(
            &mut c,
            "$JS.API.STREAM.CREATE.ORDERS",
            json!({"name": "ORDERS", "subjects": ["orders.>"], "storage": "file"}),
        );
        js_publish_range(port, "orders.new", 0, n / 2);
    })
    .await;
    let weir = blocking(Broker::start).await;
    declare_durable(&weir.url(), "from-nats").await;
    let http = Http::new(weir.http_port(), "guest", "guest");
    let r = http.put(
        "/api/parameters/shovel/%2F/from-nats",
        json!({"value": {
            "src-protocol": "nats", "src-uri": nats.url(), "src-subject": "orders.>",
            "src-stream": "ORDERS", "src-consumer": "weir",
            "dest-protocol": "amqp091", "dest-uri": "amqp://", "dest-queue": "from-nats",
            "src-prefetch-count": 200, "reconnect-delay": 1
        }}),
    );
    assert_eq!(r.status, 201, "{}", r.text);
    let mut seen = Seen::default();
    consume_until(&weir.url(), "from-nats", &mut seen, n / 4).await;
    nats = blocking(move || {
        nats.restart().expect("nats-server restart");
        nats
    })
    .await;
    blocking(move || js_publish_range(port, "orders.new", n / 2, n / 2)).await;
    consume_until(&weir.url(), "from-nats", &mut seen, n).await;
    assert_eq!(seen.ids.len(), n);
    eprintln!("NATS → Weir: {n} messages, {} duplicates", seen.duplicates);
    drop(nats);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn weir_queue_to_nats_jetstream_across_a_nats_restart() {
    let mut nats = match blocking(NatsServer::start).await {
        Ok(n) => n,
        Err(why) => {
            eprintln!("skipped: no NATS server: {why}");
            return;
        }
    };
    let port = nats.port();
    let n = 2000;
    blocking(move || {
        let mut c = NatsClient::connect(port).expect("NATS connect");
        js_create(
            &mut c,
            "$JS.API.STREAM.CREATE.OUT",
            json!({"name": "OUT", "subjects": ["out.>"], "storage": "file"}),
        );
        js_create(
            &mut c,
            "$JS.API.CONSUMER.DURABLE.CREATE.OUT.check",
            json!({"stream_name": "OUT", "config": {"durable_name": "check", "ack_policy": "none"}}),
        );
    })
    .await;
    let weir = blocking(Broker::start).await;
    fill(&weir.url(), "to-nats", n / 2).await;
    let http = Http::new(weir.http_port(), "guest", "guest");
    let r = http.put(
        "/api/parameters/shovel/%2F/to-nats",
        json!({"value": {
            "src-protocol": "amqp091", "src-uri": "amqp://", "src-queue": "to-nats",
            "dest-protocol": "nats", "dest-uri": nats.url(), "dest-subject": "out.weir",
            "dest-stream": "OUT", "src-prefetch-count": 200, "reconnect-delay": 1
        }}),
    );
    assert_eq!(r.status, 201, "{}", r.text);
    until_transferred(&http, "to-nats", n as u64 / 4).await;
    nats = blocking(move || {
        nats.restart().expect("nats-server restart");
        nats
    })
    .await;
    {
        let conn = connect(&weir.url()).await;
        let ch = confirm_channel(&conn).await;
        for i in n / 2..n {
            publish_confirmed(
                &ch,
                "",
                "to-nats",
                format!("{i}").as_bytes(),
                BasicProperties::default().with_delivery_mode(2),
            )
            .await;
        }
        let _ = conn.close(200, "done".into()).await;
    }
    let seen = blocking(move || {
        let mut c = NatsClient::connect(port).expect("NATS connect");
        let mut seen = Seen::default();
        let deadline = Instant::now() + TRANSFER_TIMEOUT;
        while seen.ids.len() < n {
            assert!(
                Instant::now() < deadline,
                "only {} of {n} reached NATS",
                seen.ids.len()
            );
            for m in c
                .pull("OUT", "check", 500, Duration::from_secs(2))
                .expect("pull")
            {
                seen.add(&m.payload);
            }
        }
        seen
    })
    .await;
    assert_eq!(seen.ids.len(), n);
    eprintln!("Weir → NATS: {n} messages, {} duplicates", seen.duplicates);
    drop(nats);
}
