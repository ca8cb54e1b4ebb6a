//! Delivery semantics through lapin against the real binary: what of TTL,
//! dead-lettering (x-death as AMQP tables), delivery limits, length limits,
//! delayed delivery and ordering keys survives `kill -9` + restart.
//!
//! Agreement with RabbitMQ is checked by the conformance scenarios
//! (conformance/weirconf/scenarios/deadletter.py); the engine's own rules,
//! on a manual clock and without sleeping, in process by
//! engine/tests/delivery.rs and delayed.rs (TTL on time behind a longer
//! one, x-death and x-first/last-death, the delivery limit, reject-publish-dlx,
//! TTL deadlines across a restart). Here: what needs the binary.

use lapin::message::Delivery;
use lapin::options::*;
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, ExchangeKind};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};
use weir_tests::*;

// --- helpers ----------------------------------------------------------------

fn table(entries: &[(&str, AMQPValue)]) -> FieldTable {
    let mut t = FieldTable::default();
    for (k, v) in entries {
        t.insert((*k).into(), v.clone());
    }
    t
}

fn s(v: &str) -> AMQPValue {
    AMQPValue::LongString(v.into())
}

fn n(v: i64) -> AMQPValue {
    AMQPValue::LongLongInt(v)
}

async fn declare(ch: &Channel, name: &str, durable: bool, args: FieldTable) {
    ch.queue_declare(
        name.into(),
        QueueDeclareOptions {
            durable,
            ..Default::default()
        },
        args,
    )
    .await
    .unwrap_or_else(|e| panic!("declaring {name}: {e}"));
}

/// A fanout dead-letter exchange `dlx` with queue `dlq` bound to it.
async fn declare_dlx(ch: &Channel, durable: bool) {
    ch.exchange_declare(
        "dlx".into(),
        ExchangeKind::Fanout,
        ExchangeDeclareOptions {
            durable,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .expect("exchange.declare dlx");
    declare(ch, "dlq", durable, FieldTable::default()).await;
    ch.queue_bind(
        "dlq".into(),
        "dlx".into(),
        "".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .expect("queue.bind dlq");
}

async fn get(ch: &Channel, queue: &str) -> Option<Delivery> {
    ch.basic_get(queue.into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap_or_else(|e| panic!("basic.get {queue}: {e}"))
        .map(|m| m.delivery)
}

/// Every ready message of `queue` (basic.get, no-ack, until get-empty).
async fn drain(ch: &Channel, queue: &str) -> Vec<String> {
    let mut out = Vec::new();
    while let Some(d) = get(ch, queue).await {
        out.push(body(&d));
    }
    out
}

fn body(d: &Delivery) -> String {
    String::from_utf8_lossy(&d.data).into_owned()
}

fn text(v: &AMQPValue) -> Option<String> {
    match v {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.as_str().to_string()),
        _ => None,
    }
}

fn int(v: &AMQPValue) -> Option<i64> {
    match v {
        AMQPValue::LongLongInt(n) => Some(*n),
        AMQPValue::LongInt(n) => Some(i64::from(*n)),
        AMQPValue::LongUInt(n) => Some(i64::from(*n)),
        _ => None,
    }
}

fn header<'a>(d: &'a Delivery, name: &str) -> Option<&'a AMQPValue> {
    d.properties
        .headers()
        .as_ref()
        .and_then(|h| h.inner().get(name))
}

fn header_text(d: &Delivery, name: &str) -> Option<String> {
    header(d, name).and_then(text)
}

/// One x-death entry, reduced to what is asserted (time: present, a
/// timestamp).
#[derive(Debug, PartialEq, Eq)]
struct Death {
    count: i64,
    reason: String,
    queue: String,
    exchange: String,
    routing_keys: Vec<String>,
    original_expiration: Option<String>,
}

fn x_death(d: &Delivery) -> Vec<Death> {
    let Some(AMQPValue::FieldArray(a)) = header(d, "x-death") else {
        panic!("no x-death array on {:?}", d.properties.headers());
    };
    a.as_slice()
        .iter()
        .map(|e| {
            let AMQPValue::FieldTable(t) = e else {
                panic!("x-death entry is not a table: {e:?}")
            };
            let t: &BTreeMap<_, _> = t.inner();
            let get = |k: &str| {
                t.get(k)
                    .unwrap_or_else(|| panic!("x-death lacks {k}: {t:?}"))
            };
            assert!(
                matches!(get("time"), AMQPValue::Timestamp(_)),
                "x-death time is a timestamp"
            );
            Death {
                count: int(get("count")).expect("count is an integer"),
                reason: text(get("reason")).expect("reason"),
                queue: text(get("queue")).expect("queue"),
                exchange: text(get("exchange")).expect("exchange"),
                routing_keys: match get("routing-keys") {
                    AMQPValue::FieldArray(a) => a.as_slice().iter().filter_map(text).collect(),
                    other => panic!("routing-keys is not an array: {other:?}"),
                },
                original_expiration: t.get("original-expiration").and_then(text),
            }
        })
        .collect()
}

fn death(reason: &str, queue: &str, exchange: &str, rk: &str) -> Death {
    Death {
        count: 1,
        reason: reason.into(),
        queue: queue.into(),
        exchange: exchange.into(),
        routing_keys: vec![rk.into()],
        original_expiration: None,
    }
}

/// The first-death and last-death headers as (exchange, queue, reason).
fn first_last(d: &Delivery) -> [(Option<String>, Option<String>, Option<String>); 2] {
    let f = |p: &str| {
        (
            header_text(d, &format!("x-{p}-death-exchange")),
            header_text(d, &format!("x-{p}-death-queue")),
            header_text(d, &format!("x-{p}-death-reason")),
        )
    };
    [f("first"), f("last")]
}

fn some3(x: &str, q: &str, r: &str) -> (Option<String>, Option<String>, Option<String>) {
    (Some(x.into()), Some(q.into()), Some(r.into()))
}

// --- TTL ---------------------------------------------------------------------

// --- delivery limit ----------------------------------------------------------

/// Nacks (with requeue) every delivery of `q` until a message reaches
/// `dlq`; returns the redelivered flag of each delivery and the dead
/// message. Panics if more than `max` deliveries happen (a loop).
async fn nack_until_dead(ch: &Channel, q: &str, max: usize) -> (Vec<bool>, Delivery) {
    ch.basic_qos(1, BasicQosOptions::default()).await.unwrap();
    let mut src = consume(ch, q, "poison").await;
    let mut dead = consume(ch, "dlq", "dead").await;
    let mut flags = Vec::new();
    loop {
        tokio::select! {
            d = next_delivery(&mut src) => {
                flags.push(d.redelivered);
                assert!(flags.len() <= max, "delivered {} times: the limit did not stop it", flags.len());
                d.nack(BasicNackOptions { requeue: true, ..Default::default() }).await.unwrap();
            }
            d = next_delivery(&mut dead) => {
                d.ack(BasicAckOptions::default()).await.unwrap();
                ch.basic_cancel("poison".into(), BasicCancelOptions::default()).await.unwrap();
                ch.basic_cancel("dead".into(), BasicCancelOptions::default()).await.unwrap();
                return (flags, d);
            }
        }
    }
}

/// Issue 7 item 2: the attempt count is durable. Two nacked deliveries,
/// kill -9, restart: two more deliveries reach the limit of 3.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delivery_attempts_survive_kill9() {
    let dir = tempfile::tempdir().unwrap();
    let mut broker = Broker::start_in(dir.path());
    {
        let conn = connect(&broker.url()).await;
        let ch = confirm_channel(&conn).await;
        declare_dlx(&ch, true).await;
        declare(
            &ch,
            "work",
            true,
            table(&[
                ("x-delivery-limit", n(3)),
                ("x-dead-letter-exchange", s("dlx")),
            ]),
        )
        .await;
        publish_confirmed(&ch, "", "work", b"poison", persistent()).await;
        // Two deliveries by basic.get, each nacked with requeue: no
        // consumer that could take a third before the crash.
        let gch = conn.create_channel().await.unwrap();
        for _ in 0..2 {
            let m = gch
                .basic_get("work".into(), BasicGetOptions { no_ack: false })
                .await
                .unwrap()
                .expect("the poison message is ready");
            m.delivery
                .nack(BasicNackOptions {
                    requeue: true,
                    ..Default::default()
                })
                .await
                .unwrap();
        }
        assert_eq!(queue_len(&ch, "work").await, 1);
        // A confirmed publish after the nacks: the log is sequential, so
        // its confirm means the attempt records before it are on disk.
        declare(&ch, "marker", true, FieldTable::default()).await;
        publish_confirmed(&ch, "", "marker", b"m", persistent()).await;
    }
    broker.kill9();
    broker.restart();
    let conn = connect(&broker.url()).await;
    let ch = conn.create_channel().await.unwrap();
    let (flags, d) = nack_until_dead(&ch, "work", 10).await;
    assert_eq!(body(&d), "poison");
    assert_eq!(
        flags,
        vec![true, true],
        "deliveries after the restart (2 before, limit 3), redelivered"
    );
    // The death headers as an AMQP client reads them (the rules are
    // engine/tests/delivery.rs's; here their AMQP tables).
    assert_eq!(
        x_death(&d),
        vec![death("delivery_limit", "work", "", "work")]
    );
    assert_eq!(
        first_last(&d),
        [
            some3("", "work", "delivery_limit"),
            some3("", "work", "delivery_limit")
        ]
    );
    conn.close(200, "bye".into()).await.unwrap();
}

// --- kill -9 in the middle of dead-letter moves -------------------------------

/// Persistent messages in a durable queue with a DLX; half of them are
/// rejected without requeue (each a move to the DLQ), and the broker is
/// killed right after, while moves may be in flight. After the restart
/// every confirmed message is in exactly one of the two queues.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letter_moves_are_atomic_across_kill9() {
    const N: usize = 200;
    let dir = tempfile::tempdir().unwrap();
    let mut broker = Broker::start_in(dir.path());
    let mut rejected = Vec::new();
    {
        let conn = connect(&broker.url()).await;
        let ch = confirm_channel(&conn).await;
        declare_dlx(&ch, true).await;
        declare(
            &ch,
            "src",
            true,
            table(&[
                ("x-message-ttl", n(3_600_000)),
                ("x-dead-letter-exchange", s("dlx")),
            ]),
        )
        .await;
        for i in 0..N {
            publish_confirmed(&ch, "", "src", format!("m{i:03}").as_bytes(), persistent()).await;
        }
        let cch = conn.create_channel().await.unwrap();
        cch.basic_qos(N as u16, BasicQosOptions::default())
            .await
            .unwrap();
        let mut c = consume(&cch, "src", "c").await;
        for i in 0..N {
            let d = next_delivery(&mut c).await;
            if i % 2 == 0 {
                rejected.push(body(&d));
                d.reject(BasicRejectOptions { requeue: false })
                    .await
                    .unwrap();
            }
            // The others stay unacked: the crash returns them.
        }
        // A round trip on the rejecting channel: every reject is in the
        // broker before the kill (the moves themselves may not be done).
        cch.basic_qos(N as u16, BasicQosOptions::default())
            .await
            .unwrap();
        broker.kill9();
    }
    broker.restart();
    let conn = connect(&broker.url()).await;
    let ch = conn.create_channel().await.unwrap();
    let in_src = drain(&ch, "src").await;
    let in_dlq = drain(&ch, "dlq").await;
    let mut all: Vec<String> = in_src.iter().chain(&in_dlq).cloned().collect();
    all.sort();
    let want: Vec<String> = (0..N).map(|i| format!("m{i:03}")).collect();
    assert_eq!(
        all,
        want,
        "every confirmed message exactly once (src {} + dlq {})",
        in_src.len(),
        in_dlq.len()
    );
    // Only rejected messages may be in the DLQ.
    for b in &in_dlq {
        assert!(
            rejected.contains(b),
            "{b} was never rejected but is in the DLQ"
        );
    }
    conn.close(200, "bye".into()).await.unwrap();
}

/// A queue TTL still applies to messages recovered after kill -9.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_ttl_still_expires_after_kill9() {
    let dir = tempfile::tempdir().unwrap();
    let mut broker = Broker::start_in(dir.path());
    {
        let conn = connect(&broker.url()).await;
        let ch = confirm_channel(&conn).await;
        declare_dlx(&ch, true).await;
        declare(
            &ch,
            "ttl",
            true,
            table(&[
                ("x-message-ttl", n(1_000)),
                ("x-dead-letter-exchange", s("dlx")),
            ]),
        )
        .await;
        publish_confirmed(&ch, "", "ttl", b"t", persistent()).await;
        broker.kill9();
    }
    broker.restart();
    let conn = connect(&broker.url()).await;
    let ch = conn.create_channel().await.unwrap();
    let mut dead = consume(&ch, "dlq", "dead").await;
    let d = next_delivery(&mut dead).await;
    assert_eq!(body(&d), "t");
    assert_eq!(x_death(&d), vec![death("expired", "ttl", "", "ttl")]);
    d.ack(BasicAckOptions::default()).await.unwrap();
    assert_eq!(queue_len(&ch, "ttl").await, 0);
    conn.close(200, "bye".into()).await.unwrap();
}

// --- length limits -----------------------------------------------------------

/// x-max-length with reject-publish nacks the publish beyond the limit
/// (confirms), before and after a restart (the argument is durable).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_length_reject_publish_nacks_also_after_restart() {
    let dir = tempfile::tempdir().unwrap();
    let mut broker = Broker::start_in(dir.path());
    async fn publish(ch: &Channel, b: &str) -> bool {
        let c = ch
            .basic_publish(
                "".into(),
                "bounded".into(),
                BasicPublishOptions::default(),
                b.as_bytes(),
                persistent(),
            )
            .await
            .expect("basic.publish");
        within("confirm", c).await.expect("confirm").is_ack()
    }
    {
        let conn = connect(&broker.url()).await;
        let ch = confirm_channel(&conn).await;
        declare(
            &ch,
            "bounded",
            true,
            table(&[("x-max-length", n(2)), ("x-overflow", s("reject-publish"))]),
        )
        .await;
        let acks = [
            publish(&ch, "a").await,
            publish(&ch, "b").await,
            publish(&ch, "c").await,
        ];
        assert_eq!(acks, [true, true, false], "the third is nacked");
        broker.kill9();
    }
    broker.restart();
    let conn = connect(&broker.url()).await;
    let ch = confirm_channel(&conn).await;
    assert!(!publish(&ch, "d").await, "still full after the restart");
    assert_eq!(drain(&ch, "bounded").await, vec!["a", "b"]);
    assert!(publish(&ch, "e").await, "room again");
    conn.close(200, "bye".into()).await.unwrap();
}

// --- delayed delivery and delayed retries across kill -9 ----------------------

/// Issue 7 items 3 and 8: a message held by an `x-delayed-message`
/// exchange and a message waiting for its delayed retry both survive
/// kill -9: after the restart neither arrives before its time, both arrive
/// after it, once, with the retry's attempt counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delayed_messages_and_delayed_retries_survive_kill9() {
    const DELAY_MS: u64 = 1_500;
    let dir = tempfile::tempdir().unwrap();
    let mut broker = Broker::start_in(dir.path());
    let published;
    {
        let conn = connect(&broker.url()).await;
        let ch = confirm_channel(&conn).await;
        ch.exchange_declare(
            "delays".into(),
            ExchangeKind::Custom("x-delayed-message".into()),
            ExchangeDeclareOptions {
                durable: true,
                ..Default::default()
            },
            table(&[("x-delayed-type", s("direct"))]),
        )
        .await
        .expect("exchange.declare x-delayed-message");
        declare(&ch, "held", true, FieldTable::default()).await;
        ch.queue_bind(
            "held".into(),
            "delays".into(),
            "k".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect("queue.bind");
        declare(
            &ch,
            "retry",
            true,
            table(&[
                ("x-delayed-retry-type", s("failed")),
                ("x-delayed-retry-min", n(DELAY_MS as i64)),
            ]),
        )
        .await;
        published = Instant::now();
        let delayed = persistent().with_headers(table(&[("x-delay", n(DELAY_MS as i64))]));
        publish_confirmed(&ch, "delays", "k", b"delayed", delayed).await;
        publish_confirmed(&ch, "", "retry", b"retried", persistent()).await;
        let m = ch
            .basic_get("retry".into(), BasicGetOptions { no_ack: false })
            .await
            .unwrap()
            .expect("ready");
        m.delivery
            .nack(BasicNackOptions {
                requeue: true,
                ..Default::default()
            })
            .await
            .unwrap();
        assert_eq!(queue_len(&ch, "held").await, 0, "held by its delay");
        assert_eq!(queue_len(&ch, "retry").await, 0, "waiting for its retry");
        // A confirmed publish after the nack: its confirm means the retry
        // record before it in the log is on disk.
        declare(&ch, "marker", true, FieldTable::default()).await;
        publish_confirmed(&ch, "", "marker", b"m", persistent()).await;
    }
    broker.kill9();
    broker.restart();
    let conn = connect(&broker.url()).await;
    let ch = conn.create_channel().await.unwrap();
    let mut held = consume(&ch, "held", "h").await;
    let mut retry = consume(&ch, "retry", "r").await;
    let d = next_delivery(&mut held).await;
    assert_eq!(body(&d), "delayed");
    let r = next_delivery(&mut retry).await;
    assert_eq!(body(&r), "retried");
    assert!(r.redelivered);
    assert!(
        published.elapsed() >= Duration::from_millis(DELAY_MS),
        "delivered before its delay"
    );
    let count = r
        .properties
        .headers()
        .as_ref()
        .and_then(|h| h.inner().get("x-delivery-count").and_then(int));
    assert_eq!(count, None, "a classic queue without a limit adds no count");
    d.ack(BasicAckOptions::default()).await.unwrap();
    r.ack(BasicAckOptions::default()).await.unwrap();
    conn.close(200, "bye".into()).await.unwrap();
}

// --- ordering keys ---------------------------------------------------------

/// Issue 7 item 9 through lapin: 16 ordering keys over 4 partitions, 4
/// consumers (one connection each) that nack 10% at random: every key's
/// messages are processed (acked) in publish order, 10,240 messages.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ordering_keys_keep_per_key_order_with_four_consumers_and_random_nacks() {
    use rand::{Rng, SeedableRng};
    use std::sync::{Arc, Mutex};
    const KEYS: usize = 16;
    const PER_KEY: usize = 640;
    let broker = Broker::start();
    let conn = connect(&broker.url()).await;
    let ch = confirm_channel(&conn).await;
    declare(&ch, "ordered", true, table(&[("x-partitions", n(4))])).await;
    for i in 0..PER_KEY {
        for k in 0..KEYS {
            let props = BasicProperties::default()
                .with_headers(table(&[("x-ordering-key", s(&format!("key-{k}")))]));
            ch.basic_publish(
                "".into(),
                "ordered".into(),
                BasicPublishOptions::default(),
                format!("{k}:{i}").as_bytes(),
                props,
            )
            .await
            .expect("publish");
        }
    }
    assert!(ch.wait_for_confirms().await.expect("confirms").is_empty());
    let processed = Arc::new(Mutex::new(vec![Vec::new(); KEYS]));
    let (done_tx, mut done_rx) = tokio::sync::mpsc::unbounded_channel::<()>();
    let mut conns = Vec::new();
    for c in 0..4u64 {
        let conn = connect(&broker.url()).await;
        let cch = conn.create_channel().await.unwrap();
        cch.basic_qos(20, BasicQosOptions::default()).await.unwrap();
        let mut src = consume(&cch, "ordered", &format!("c{c}")).await;
        let processed = processed.clone();
        let done_tx = done_tx.clone();
        tokio::spawn(async move {
            let mut rng = rand::rngs::StdRng::seed_from_u64(c);
            while let Some(Ok(d)) = futures_lite::StreamExt::next(&mut src).await {
                if rng.gen_range(0..10) == 0 {
                    let _ = d
                        .nack(BasicNackOptions {
                            requeue: true,
                            ..Default::default()
                        })
                        .await;
                    continue;
                }
                let b = body(&d);
                let (k, i) = b.split_once(':').expect("key:seq");
                processed.lock().unwrap()[k.parse::<usize>().unwrap()]
                    .push(i.parse::<usize>().unwrap());
                let _ = d.ack(BasicAckOptions::default()).await;
                let _ = done_tx.send(());
            }
        });
        conns.push(conn);
    }
    for _ in 0..KEYS * PER_KEY {
        within("all messages processed", done_rx.recv())
            .await
            .expect("consumers alive");
    }
    let processed = processed.lock().unwrap();
    for (k, seqs) in processed.iter().enumerate() {
        assert_eq!(seqs.len(), PER_KEY, "key {k}: each message once");
        assert!(
            seqs.windows(2).all(|w| w[0] < w[1]),
            "key {k} out of order: {:?}",
            &seqs[..seqs.len().min(40)]
        );
    }
}
