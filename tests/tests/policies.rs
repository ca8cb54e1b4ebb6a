//! Policies (`[[policies]]` in the configuration file) and ordering keys
//! through lapin against the real binary, across `kill -9` and restarts.
//!
//! How a policy merges with a queue's own arguments is checked against
//! RabbitMQ by the conformance scenarios (conformance/weirconf/scenarios/
//! policies.py) and in process by the engine's unit tests
//! (engine/src/policy.rs). Here: what needs the binary and its
//! configuration file: a policy applies to the queues it matches, is
//! durable (it survives `kill -9`, and a start without it in the file), the
//! messages under it keep its TTL and dead-lettering across a crash, a
//! policy changed in the file applies to existing queues at the next start,
//! and a policy RabbitMQ would refuse stops the start. Ordering keys keep
//! their partition, hence per-key order, across `kill -9`.

use lapin::message::Delivery;
use lapin::options::*;
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, ExchangeKind};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use weir_tests::*;

// --- helpers ----------------------------------------------------------------

/// Writes a configuration file holding `policies` (TOML `[[policies]]`
/// entries) into `dir` and returns its path.
fn write_config(dir: &Path, policies: &str) -> PathBuf {
    let path = dir.join("weir.toml");
    std::fs::write(&path, policies).expect("writing the configuration file");
    path
}

/// A broker on `data` started with `--config config` (kept for restarts).
fn start_with_config(data: &Path, config: &Path) -> Broker {
    Broker::start_in_with(
        data,
        &["--config", config.to_str().expect("a UTF-8 temp path")],
    )
}

async fn declare(ch: &Channel, name: &str, args: FieldTable) {
    ch.queue_declare(
        name.into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        args,
    )
    .await
    .unwrap_or_else(|e| panic!("declaring {name}: {e}"));
}

/// A durable fanout exchange with a durable queue bound to it.
async fn declare_dlx(ch: &Channel, exchange: &str, queue: &str) {
    ch.exchange_declare(
        exchange.into(),
        ExchangeKind::Fanout,
        ExchangeDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .expect("exchange.declare");
    declare(ch, queue, FieldTable::default()).await;
    ch.queue_bind(
        queue.into(),
        exchange.into(),
        "".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .expect("queue.bind");
}

async fn get(ch: &Channel, queue: &str) -> Option<Delivery> {
    ch.basic_get(queue.into(), BasicGetOptions { no_ack: false })
        .await
        .unwrap_or_else(|e| panic!("basic.get {queue}: {e}"))
        .map(|m| m.delivery)
}

/// Every ready message of `queue` (basic.get until get-empty, acked).
async fn drain(ch: &Channel, queue: &str) -> Vec<String> {
    let mut out = Vec::new();
    while let Some(d) = get(ch, queue).await {
        out.push(body(&d));
        d.ack(BasicAckOptions::default()).await.expect("basic.ack");
    }
    out
}

fn body(d: &Delivery) -> String {
    String::from_utf8_lossy(&d.data).into_owned()
}

fn header_text(d: &Delivery, name: &str) -> Option<String> {
    match d
        .properties
        .headers()
        .as_ref()
        .and_then(|h| h.inner().get(name))
    {
        Some(AMQPValue::LongString(s)) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        Some(AMQPValue::ShortString(s)) => Some(s.as_str().to_string()),
        _ => None,
    }
}

/// (first death queue, first death reason) of a dead-lettered message.
fn first_death(d: &Delivery) -> (Option<String>, Option<String>) {
    (
        header_text(d, "x-first-death-queue"),
        header_text(d, "x-first-death-reason"),
    )
}

fn died(queue: &str, reason: &str) -> (Option<String>, Option<String>) {
    (Some(queue.into()), Some(reason.into()))
}

/// Waits for `n` messages on `queue` (consumer, acked), in arrival order.
async fn await_n(ch: &Channel, queue: &str, n: usize) -> Vec<Delivery> {
    let mut c = consume(ch, queue, "await").await;
    let mut out = Vec::new();
    while out.len() < n {
        let d = next_delivery(&mut c).await;
        d.ack(BasicAckOptions::default()).await.expect("basic.ack");
        out.push(d);
    }
    ch.basic_cancel("await".into(), BasicCancelOptions::default())
        .await
        .expect("basic.cancel");
    out
}

// --- policies -----------------------------------------------------------------

const TTL_AND_DLX: &str = r#"
[[policies]]
name = "jobs"
pattern = '^jobs\.'
apply-to = "queues"
definition = { message-ttl = 3000, dead-letter-exchange = "dlx" }
"#;

/// A policy from the configuration file applies to a queue declared
/// without arguments (its rejected messages go to the policy's dead-letter
/// exchange; a queue the pattern does not match keeps its rejected ones
/// nowhere); a persistent message under it, confirmed and then `kill -9`,
/// still expires by the policy's TTL after the restart and is
/// dead-lettered by it. The policy itself is durable: a start without it in
/// the file still applies it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_from_the_config_applies_and_survives_kill9() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    let config = write_config(tmp.path(), TTL_AND_DLX);
    let mut broker = start_with_config(&data, &config);
    {
        let conn = connect(&broker.url()).await;
        let ch = confirm_channel(&conn).await;
        declare_dlx(&ch, "dlx", "dlq").await;
        declare(&ch, "jobs.a", FieldTable::default()).await;
        declare(&ch, "other", FieldTable::default()).await;
        // The policy's dead-letter exchange, for a rejection.
        for q in ["jobs.a", "other"] {
            publish_confirmed(&ch, "", q, format!("rejected-{q}").as_bytes(), persistent()).await;
            let d = get(&ch, q).await.expect("the message just published");
            d.reject(BasicRejectOptions { requeue: false })
                .await
                .expect("basic.reject");
        }
        let dead = await_n(&ch, "dlq", 1).await;
        assert_eq!(body(&dead[0]), "rejected-jobs.a");
        assert_eq!(first_death(&dead[0]), died("jobs.a", "rejected"));
        // The TTL's message: confirmed (durable), then the crash.
        publish_confirmed(&ch, "", "jobs.a", b"expires", persistent()).await;
        publish_confirmed(&ch, "", "other", b"stays", persistent()).await;
        broker.kill9();
    }
    broker.restart();
    {
        let conn = connect(&broker.url()).await;
        let ch = conn.create_channel().await.unwrap();
        let dead = await_n(&ch, "dlq", 1).await;
        assert_eq!(body(&dead[0]), "expires");
        assert_eq!(first_death(&dead[0]), died("jobs.a", "expired"));
        assert_eq!(queue_len(&ch, "jobs.a").await, 0);
        assert_eq!(drain(&ch, "other").await, vec!["stays"]);
        assert_eq!(
            drain(&ch, "dlq").await,
            Vec::<String>::new(),
            "the unmatched queue's rejection went nowhere"
        );
        conn.close(200, "bye".into()).await.unwrap();
    }
    // Without the policy in the file: it was stored, and still applies.
    broker.stop();
    drop(broker);
    let broker = Broker::start_in(&data);
    let conn = connect(&broker.url()).await;
    let ch = confirm_channel(&conn).await;
    publish_confirmed(&ch, "", "jobs.a", b"after", persistent()).await;
    let dead = await_n(&ch, "dlq", 1).await;
    assert_eq!(body(&dead[0]), "after");
    assert_eq!(first_death(&dead[0]), died("jobs.a", "expired"));
    conn.close(200, "bye".into()).await.unwrap();
}

/// A policy changed in the configuration file applies to existing queues
/// at the next start: a lower max-length drops the excess heads at once,
/// to the new dead-letter exchange (reason maxlen), and the new limit holds
/// for later publishes. A queue's own lower x-max-length still wins.
///
/// The broker is stopped cleanly between the two: what is under test is
/// the changed policy, and the messages dropped under the first one are
/// awaited (dead-lettered) and flushed by the stop, so they cannot come
/// back. (After a `kill -9` a drop whose settle was not yet on disk may
/// return, as any settle may: at-least-once.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_changed_in_the_config_applies_to_existing_queues_at_restart() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    let config = write_config(
        tmp.path(),
        r#"
[[policies]]
name = "limit"
pattern = '^jobs\.'
definition = { max-length = 5, dead-letter-exchange = "dlx" }
"#,
    );
    let mut broker = start_with_config(&data, &config);
    {
        let conn = connect(&broker.url()).await;
        let ch = confirm_channel(&conn).await;
        declare_dlx(&ch, "dlx", "dlq").await;
        declare_dlx(&ch, "dlx2", "dlq2").await;
        declare(&ch, "jobs.b", FieldTable::default()).await;
        let mut own = FieldTable::default();
        own.insert("x-max-length".into(), AMQPValue::LongLongInt(1));
        declare(&ch, "jobs.own", own).await;
        for i in 1..=6 {
            publish_confirmed(&ch, "", "jobs.b", format!("m{i}").as_bytes(), persistent()).await;
            publish_confirmed(
                &ch,
                "",
                "jobs.own",
                format!("o{i}").as_bytes(),
                persistent(),
            )
            .await;
        }
        // Dropped under the first policy: m1 (max-length 5), o1..o5 (its
        // own max-length 1), all to the policy's dlx.
        let mut dropped: Vec<String> = await_n(&ch, "dlq", 6).await.iter().map(body).collect();
        dropped.sort();
        assert_eq!(dropped, vec!["m1", "o1", "o2", "o3", "o4", "o5"]);
        assert_eq!(queue_len(&ch, "jobs.b").await, 5);
        assert_eq!(queue_len(&ch, "jobs.own").await, 1);
        conn.close(200, "bye".into()).await.unwrap();
    }
    broker.stop();
    // The same policy: a lower limit and another dead-letter exchange.
    write_config(
        tmp.path(),
        r#"
[[policies]]
name = "limit"
pattern = '^jobs\.'
definition = { max-length = 2, dead-letter-exchange = "dlx2" }
"#,
    );
    broker.restart();
    let conn = connect(&broker.url()).await;
    let ch = confirm_channel(&conn).await;
    let dead = await_n(&ch, "dlq2", 3).await;
    let mut dead_bodies: Vec<String> = dead.iter().map(body).collect();
    dead_bodies.sort();
    assert_eq!(dead_bodies, vec!["m2", "m3", "m4"]);
    for d in &dead {
        assert_eq!(first_death(d), died("jobs.b", "maxlen"));
    }
    publish_confirmed(&ch, "", "jobs.b", b"m7", persistent()).await;
    let dead = await_n(&ch, "dlq2", 1).await;
    assert_eq!(body(&dead[0]), "m5");
    assert_eq!(drain(&ch, "jobs.b").await, vec!["m6", "m7"]);
    assert_eq!(
        drain(&ch, "jobs.own").await,
        vec!["o6"],
        "its own lower limit"
    );
    assert_eq!(
        drain(&ch, "dlq").await,
        Vec::<String>::new(),
        "the old exchange"
    );
    conn.close(200, "bye".into()).await.unwrap();
}

/// Policies RabbitMQ refuses stop the start with a message naming the
/// policy: `max-priority` (a queue's shape, never a policy's), a key no
/// policy may set, a value of the wrong type, a pattern that is not a
/// regular expression.
#[test]
fn invalid_policies_refuse_to_start() {
    for (definition, pattern, needle) in [
        ("{ max-priority = 10 }", "'.*'", "max-priority"),
        (
            "{ single-active-consumer = true }",
            "'.*'",
            "single-active-consumer",
        ),
        ("{ message-ttl = \"soon\" }", "'.*'", "message-ttl"),
        ("{ max-length = 1 }", "'('", "pattern"),
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let config = write_config(
            tmp.path(),
            &format!(
                "[[policies]]\nname = \"bad\"\npattern = {pattern}\ndefinition = {definition}\n"
            ),
        );
        let (status, output) = run_weir_to_exit(|cmd| {
            cmd.arg("--config")
                .arg(&config)
                .arg("--data-dir")
                .arg(tmp.path().join("data"))
                .arg("--amqp-listen")
                .arg(format!("127.0.0.1:{}", free_port()));
        });
        assert!(
            !status.success(),
            "weir started with the policy {definition} / {pattern}\n{output}"
        );
        assert!(
            output.contains("policy 'bad'") && output.contains(needle),
            "the error does not name the policy and {needle}:\n{output}"
        );
        assert!(!output.contains("AMQP listener ready"), "{output}");
    }
}

// --- ordering keys ------------------------------------------------------------

/// Ordering keys across `kill -9`: a key picks its partition by a stable
/// hash, so messages of one key published before the crash (recovered)
/// and after it sit in one partition, and two consumers that nack some
/// deliveries still acknowledge every key's messages in publish order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ordering_keys_keep_per_key_order_across_kill9() {
    const KEYS: usize = 8;
    const PER_KEY: usize = 20;
    let tmp = tempfile::tempdir().unwrap();
    let mut broker = Broker::start_in(tmp.path());
    let props = |k: usize| {
        let mut h = FieldTable::default();
        h.insert(
            "x-ordering-key".into(),
            AMQPValue::LongString(format!("key-{k}").into()),
        );
        BasicProperties::default()
            .with_delivery_mode(2)
            .with_headers(h)
    };
    async fn publish_round(
        ch: &Channel,
        range: std::ops::Range<usize>,
        props: impl Fn(usize) -> BasicProperties,
    ) {
        for i in range {
            for k in 0..KEYS {
                publish_confirmed(ch, "", "ordered", format!("{k}:{i}").as_bytes(), props(k)).await;
            }
        }
    }
    {
        let conn = connect(&broker.url()).await;
        let ch = confirm_channel(&conn).await;
        let mut args = FieldTable::default();
        args.insert("x-partitions".into(), AMQPValue::LongLongInt(4));
        declare(&ch, "ordered", args).await;
        publish_round(&ch, 0..PER_KEY / 2, props).await;
        broker.kill9();
    }
    broker.restart();
    let conn = connect(&broker.url()).await;
    let ch = confirm_channel(&conn).await;
    publish_round(&ch, PER_KEY / 2..PER_KEY, props).await;
    // Two consumers, each nacking (with requeue) every fifth delivery.
    let mut consumers = Vec::new();
    for tag in ["c1", "c2"] {
        let cch = conn.create_channel().await.unwrap();
        cch.basic_qos(4, BasicQosOptions::default()).await.unwrap();
        consumers.push(consume(&cch, "ordered", tag).await);
    }
    let [mut c1, mut c2]: [lapin::Consumer; 2] = consumers.try_into().expect("two consumers");
    let mut acked: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
    let mut deliveries = 0usize;
    let mut redelivered = 0usize;
    let total = KEYS * PER_KEY;
    while acked.values().map(Vec::len).sum::<usize>() < total {
        // Whichever consumer has a delivery first (each bounded).
        let d = futures_lite::future::race(next_delivery(&mut c1), next_delivery(&mut c2)).await;
        deliveries += 1;
        redelivered += usize::from(d.redelivered);
        if deliveries.is_multiple_of(5) {
            d.nack(BasicNackOptions {
                requeue: true,
                ..Default::default()
            })
            .await
            .expect("basic.nack");
            continue;
        }
        let text = body(&d);
        let (k, i) = text.split_once(':').expect("k:i");
        acked
            .entry(k.parse().unwrap())
            .or_default()
            .push(i.parse().unwrap());
        d.ack(BasicAckOptions::default()).await.expect("basic.ack");
    }
    assert!(redelivered > 0, "the nacks were redelivered");
    for (k, seen) in &acked {
        assert_eq!(
            seen,
            &(0..PER_KEY).collect::<Vec<_>>(),
            "key {k}: acknowledged out of publish order"
        );
    }
    assert_eq!(acked.len(), KEYS);
    conn.close(200, "bye".into()).await.unwrap();
}
