//! Idempotent publish (issue 7, item 10), in process: a message carrying
//! `x-idempotency-key` (or its `message-id` in a queue with
//! `x-dedup-on-message-id`) is enqueued at most once per queue within the
//! queue's `x-dedup-window`; a duplicate is confirmed (routed, not refused)
//! and dropped. Receipts survive a restart (the in-memory store's reopen
//! and the real log store in a temp dir) and compaction of the log.

mod support;

use bytes::Bytes;
use serde_json::{json, Map, Value};
use std::sync::Arc;
use std::time::Duration;
use support::Headers;
use weir_backend::log::{LogOptions, LogStore};
use weir_backend::testing::MemStore;
use weir_backend::Store;
use weir_engine::client::{GetAck, Published};
use weir_engine::exchange::{ExchangeDef, ExchangeKind};
use weir_engine::message::Message;
use weir_engine::meta::DestinationKind;
use weir_engine::properties::{HeaderFormat, Properties};
use weir_engine::queue::dedup::key_hash;
use weir_engine::tenant::{QueueDeclare, RouteInput};
use weir_engine::ManualClock;
use weir_engine::{Client, Engine, EngineError, DEFAULT_TENANT};

fn client(e: &Arc<Engine>) -> Client {
    Client::open(e, DEFAULT_TENANT, "guest").expect("client")
}

fn declare(c: &mut Client, name: &str, durable: bool, arguments: Value) -> Result<(), EngineError> {
    let (_, wait) = c.declare_queue(QueueDeclare {
        name: name.into(),
        passive: false,
        durable,
        exclusive: false,
        auto_delete: false,
        arguments,
        connection: c.id(),
    })?;
    if let Some(w) = wait {
        w.blocking_recv().expect("store answered").expect("durable");
    }
    Ok(())
}

fn fanout(c: &mut Client, name: &str, queues: &[&str]) {
    c.declare_exchange(
        ExchangeDef {
            name: name.into(),
            kind: ExchangeKind::Fanout,
            durable: false,
            auto_delete: false,
            internal: false,
            arguments: json!({}),
            delayed: false,
        },
        false,
    )
    .expect("exchange");
    for q in queues {
        c.bind(name, DestinationKind::Queue, q, "", json!({}))
            .expect("bind");
    }
}

/// What a publish carries.
#[derive(Clone, Copy, Default)]
struct Pub<'a> {
    exchange: &'a str,
    routing_key: &'a str,
    key: Option<&'a str>,
    message_id: Option<&'a str>,
    transient: bool,
}

fn to(queue: &str) -> Pub<'_> {
    Pub {
        routing_key: queue,
        ..Pub::default()
    }
}

impl<'a> Pub<'a> {
    fn key(self, key: &'a str) -> Self {
        Pub {
            key: Some(key),
            ..self
        }
    }
    fn message_id(self, id: &'a str) -> Self {
        Pub {
            message_id: Some(id),
            ..self
        }
    }
    fn transient(self) -> Self {
        Pub {
            transient: true,
            ..self
        }
    }
}

fn publish(c: &mut Client, p: Pub<'_>) -> Published {
    let mut headers = Map::new();
    if let Some(k) = p.key {
        headers.insert("x-idempotency-key".into(), Value::from(k));
    }
    let props = Properties {
        message_id: p.message_id.map(str::to_string),
        ..Properties::default()
    }
    .to_bytes()
    .expect("properties");
    let route = RouteInput {
        exchange: p.exchange,
        routing_key: p.routing_key,
        headers: &Headers(headers),
    };
    let published = c
        .publish(&route, |id| Message {
            id,
            exchange: Bytes::copy_from_slice(p.exchange.as_bytes()),
            routing_key: Bytes::copy_from_slice(p.routing_key.as_bytes()),
            properties: props,
            body: Bytes::from_static(b"body"),
            header_format: HeaderFormat::WEIR,
            persistent: !p.transient,
            priority: 0,
            ttl_ms: None,
        })
        .expect("publish");
    c.commit();
    published
}

fn count(c: &Client, queue: &str) -> u64 {
    c.queue(queue).expect("queue").message_count()
}

/// Takes every ready message of `queue` (auto-ack), returning their count.
fn drain(c: &mut Client, queue: &str) -> usize {
    let mut n = 0;
    while c.get(queue, GetAck::Auto).expect("get").is_some() {
        n += 1;
    }
    c.commit();
    n
}

fn confirmed(p: Published) -> bool {
    matches!(p, Published::Routed { refused: false, .. })
}

#[test]
fn a_duplicate_within_the_window_is_confirmed_and_dropped() {
    let e = Engine::open(MemStore::new(), ManualClock::new()).expect("engine");
    let mut c = client(&e);
    declare(&mut c, "q", true, json!({})).expect("declare");
    let first = publish(&mut c, to("q").key("order-1"));
    assert_eq!(
        first,
        Published::Routed {
            needs_barrier: true,
            refused: false
        }
    );
    // The duplicate is confirmed after a barrier (which covers the
    // original's record), never nacked, never returned.
    let dup = publish(&mut c, to("q").key("order-1"));
    assert_eq!(
        dup,
        Published::Routed {
            needs_barrier: true,
            refused: false
        }
    );
    assert_eq!(count(&c, "q"), 1);
    assert!(confirmed(publish(&mut c, to("q").key("order-2"))));
    // Without a key nothing is deduplicated.
    publish(&mut c, to("q"));
    publish(&mut c, to("q"));
    assert_eq!(count(&c, "q"), 4);
    // Still a duplicate after the original was consumed: the receipt
    // outlives the message.
    assert_eq!(drain(&mut c, "q"), 4);
    assert!(confirmed(publish(&mut c, to("q").key("order-1"))));
    assert_eq!(count(&c, "q"), 0);
    let q = c.queue("q").expect("queue");
    assert_eq!(q.dedup().duplicates(), 2);
    assert_eq!(q.dedup().window_ms(), 120_000, "two minutes by default");
}

#[test]
fn after_the_window_the_key_is_new_again() {
    let clock = ManualClock::new();
    let e = Engine::open(MemStore::new(), clock.clone()).expect("engine");
    let mut c = client(&e);
    declare(&mut c, "q", false, json!({"x-dedup-window": 200})).expect("declare");
    publish(&mut c, to("q").key("k"));
    // The window's last millisecond still knows the key.
    clock.advance_ms(199);
    publish(&mut c, to("q").key("k"));
    assert_eq!(count(&c, "q"), 1, "duplicate within the window");
    clock.advance_ms(1);
    publish(&mut c, to("q").key("k"));
    assert_eq!(count(&c, "q"), 2, "enqueued again after the window");
    // A new window from that publish; a non-durable queue's duplicate
    // needs no barrier.
    clock.advance_ms(199);
    assert_eq!(
        publish(&mut c, to("q").key("k")),
        Published::Routed {
            needs_barrier: false,
            refused: false
        }
    );
    assert_eq!(count(&c, "q"), 2);
}

#[test]
fn message_id_is_the_key_where_the_queue_asks_for_it() {
    let e = Engine::open(MemStore::new(), ManualClock::new()).expect("engine");
    let mut c = client(&e);
    declare(
        &mut c,
        "by-id",
        true,
        json!({"x-dedup-on-message-id": true}),
    )
    .expect("declare");
    declare(&mut c, "plain", true, json!({})).expect("declare");
    fanout(&mut c, "fan", &["by-id", "plain"]);
    let via_fan = |p: Pub<'static>| Pub {
        exchange: "fan",
        routing_key: "",
        ..p
    };
    publish(&mut c, via_fan(Pub::default().message_id("m-1")));
    publish(&mut c, via_fan(Pub::default().message_id("m-1")));
    publish(&mut c, via_fan(Pub::default().message_id("m-2")));
    // No message-id: nothing to deduplicate on.
    publish(&mut c, via_fan(Pub::default()));
    publish(&mut c, via_fan(Pub::default()));
    assert_eq!(count(&c, "by-id"), 4);
    assert_eq!(count(&c, "plain"), 5, "message-id means nothing here");
    // The header is a key in every queue and, where both are present, the
    // key of the message-id queue too.
    publish(&mut c, via_fan(Pub::default().key("h").message_id("m-1")));
    publish(&mut c, via_fan(Pub::default().key("h").message_id("m-9")));
    assert_eq!(count(&c, "by-id"), 5);
    assert_eq!(count(&c, "plain"), 6);
}

#[test]
fn a_duplicate_routed_to_several_queues_is_dropped_only_where_it_was_seen() {
    let e = Engine::open(MemStore::new(), ManualClock::new()).expect("engine");
    let mut c = client(&e);
    for q in ["a", "b", "c"] {
        declare(&mut c, q, true, json!({})).expect("declare");
    }
    fanout(&mut c, "fan", &["a", "b", "c"]);
    publish(&mut c, to("a").key("k"));
    // Seen by "a" only: enqueued in "b" and "c", confirmed, not refused.
    let p = publish(
        &mut c,
        Pub {
            exchange: "fan",
            routing_key: "",
            ..Pub::default()
        }
        .key("k"),
    );
    assert!(confirmed(p));
    assert_eq!((count(&c, "a"), count(&c, "b"), count(&c, "c")), (1, 1, 1));
    // A duplicate everywhere is still routed (no basic.return for a
    // mandatory publish) and confirmed.
    let p = publish(
        &mut c,
        Pub {
            exchange: "fan",
            routing_key: "",
            ..Pub::default()
        }
        .key("k"),
    );
    assert_eq!(
        p,
        Published::Routed {
            needs_barrier: true,
            refused: false
        }
    );
    assert_eq!((count(&c, "a"), count(&c, "b"), count(&c, "c")), (1, 1, 1));
}

#[test]
fn the_receipt_bound_forgets_the_oldest_keys_first() {
    let e = Engine::open(MemStore::new(), ManualClock::new()).expect("engine");
    let mut c = client(&e);
    declare(&mut c, "q", false, json!({})).expect("declare");
    let q = c.queue("q").expect("queue");
    q.dedup().set_limit(3);
    for k in ["k0", "k1", "k2", "k3", "k4"] {
        publish(&mut c, to("q").key(k));
    }
    assert_eq!(count(&c, "q"), 5);
    assert_eq!(q.dedup().len(), 3, "bounded");
    // The newest keys are still known; the oldest were forgotten early.
    publish(&mut c, to("q").key("k4"));
    assert_eq!(count(&c, "q"), 5);
    publish(&mut c, to("q").key("k0"));
    assert_eq!(count(&c, "q"), 6, "forgotten beyond the bound");
    assert!(q.dedup().forgotten_early() >= 2);
    assert!(q.dedup().len() <= 3);
}

#[test]
fn a_refused_publish_leaves_no_receipt_not_even_after_a_restart() {
    let store = MemStore::new();
    {
        let e = Engine::open(store.clone(), ManualClock::new()).expect("engine");
        let mut c = client(&e);
        declare(
            &mut c,
            "small",
            true,
            json!({"x-max-length": 1, "x-overflow": "reject-publish"}),
        )
        .expect("declare");
        assert!(confirmed(publish(&mut c, to("small").key("a"))));
        let refused = publish(&mut c, to("small").key("b"));
        assert!(matches!(refused, Published::Routed { refused: true, .. }));
        assert_eq!(drain(&mut c, "small"), 1);
        // The publisher retries what was nacked: it is not a duplicate.
        assert!(confirmed(publish(&mut c, to("small").key("b"))));
        assert_eq!(count(&c, "small"), 1);
        // Refused again (the queue is full): still no receipt.
        let refused = publish(&mut c, to("small").key("c"));
        assert!(matches!(refused, Published::Routed { refused: true, .. }));
        drop(c);
        store.close().expect("close");
    }
    let e = Engine::open(store.reopen(), ManualClock::new()).expect("engine");
    let mut c = client(&e);
    assert_eq!(drain(&mut c, "small"), 1);
    // Taken before the restart: a duplicate. Refused: new.
    publish(&mut c, to("small").key("a"));
    publish(&mut c, to("small").key("b"));
    assert_eq!(count(&c, "small"), 0);
    assert!(confirmed(publish(&mut c, to("small").key("c"))));
    assert_eq!(count(&c, "small"), 1);
}

#[test]
fn concurrent_publishers_with_the_same_keys_enqueue_each_key_once() {
    let e = Engine::open(MemStore::new(), ManualClock::new()).expect("engine");
    let mut c = client(&e);
    declare(&mut c, "q", true, json!({"x-partitions": 4})).expect("declare");
    const KEYS: usize = 300;
    let threads: Vec<_> = (0..6)
        .map(|t| {
            let e = e.clone();
            std::thread::spawn(move || {
                let mut c = client(&e);
                for i in 0..KEYS {
                    // Each thread in its own order, so they really race.
                    let k = format!("key-{}", (i * 7 + t * 31) % KEYS);
                    assert!(confirmed(publish(&mut c, to("q").key(&k))));
                }
            })
        })
        .collect();
    for t in threads {
        t.join().expect("publisher");
    }
    assert_eq!(count(&c, "q"), KEYS as u64);
    assert_eq!(
        c.queue("q").expect("queue").dedup().duplicates(),
        (5 * KEYS) as u64
    );
}

#[test]
fn dedup_arguments_are_checked_with_406() {
    let e = Engine::open(MemStore::new(), ManualClock::new()).expect("engine");
    let mut c = client(&e);
    for (i, bad) in [
        json!({"x-dedup-window": "60000"}),
        json!({"x-dedup-window": 0}),
        json!({"x-dedup-window": -5}),
        json!({"x-dedup-window": 1.5}),
        json!({"x-dedup-window": 5_000_000_000u64}),
        json!({"x-dedup-on-message-id": "yes"}),
        json!({"x-dedup-on-message-id": 1}),
    ]
    .into_iter()
    .enumerate()
    {
        match declare(&mut c, &format!("bad{i}"), false, bad.clone()) {
            Err(EngineError::PreconditionFailed(m)) => {
                assert!(m.contains("x-dedup-"), "{bad}: {m}")
            }
            other => panic!("{bad}: {other:?}"),
        }
    }
    declare(
        &mut c,
        "good",
        false,
        json!({"x-dedup-window": 1, "x-dedup-on-message-id": false}),
    )
    .expect("valid");
}

#[test]
fn receipts_survive_a_restart_of_the_memory_store() {
    let store = MemStore::new();
    {
        let e = Engine::open(store.clone(), ManualClock::new()).expect("engine");
        let mut c = client(&e);
        declare(&mut c, "durable", true, json!({})).expect("declare");
        declare(&mut c, "temp", false, json!({})).expect("declare");
        publish(&mut c, to("durable").key("stored"));
        publish(&mut c, to("durable").key("transient").transient());
        publish(&mut c, to("temp").key("stored"));
        // Consumed before the restart: only the receipt is left.
        assert_eq!(drain(&mut c, "durable"), 2);
        drop(c);
        store.close().expect("close");
    }
    let e = Engine::open(store.reopen(), ManualClock::new()).expect("engine");
    let mut c = client(&e);
    declare(&mut c, "temp", false, json!({})).expect("redeclare");
    publish(&mut c, to("durable").key("stored"));
    assert_eq!(count(&c, "durable"), 0, "the durable receipt dropped it");
    // A transient message died with the process; so did its receipt.
    publish(&mut c, to("durable").key("transient").transient());
    assert_eq!(count(&c, "durable"), 1);
    // So did a non-durable queue with its receipts.
    publish(&mut c, to("temp").key("stored"));
    assert_eq!(count(&c, "temp"), 1);
}

/// The log store of these tests: 4 KiB segments, so reclamation and
/// compaction take part.
fn log_opts() -> LogOptions {
    LogOptions {
        segment_size: 4096,
        sync: false,
        ..LogOptions::default()
    }
}

/// A writer round of the log store after everything appended so far (it
/// reclaims after its round): a small record of its own, waited for (an
/// already expired receipt of a partition no queue has, so it pins nothing).
fn barrier(store: &LogStore) {
    let ticket = store
        .append(
            &[weir_backend::Op::Receipt {
                partition: weir_backend::PartitionId(1 << 62),
                key_hash: 0,
                expires_at_ms: 1,
            }],
            &mut Vec::new(),
        )
        .expect("append");
    let (tx, rx) = std::sync::mpsc::channel();
    store.when_durable(
        ticket,
        Box::new(move |r| {
            let _ = tx.send(r);
        }),
    );
    rx.recv_timeout(Duration::from_secs(20))
        .expect("waiter called")
        .expect("durable");
}

fn receipt_files(dir: &std::path::Path) -> usize {
    std::fs::read_dir(dir.join("receipts"))
        .map(|d| d.count())
        .unwrap_or(0)
}

#[test]
fn receipts_survive_reopen_and_compaction_of_the_log_store() {
    let dir = tempfile::tempdir().expect("tempdir");
    const N: usize = 200;
    {
        let store = LogStore::open(dir.path(), log_opts()).expect("store");
        let e = Engine::open(store.clone(), ManualClock::new()).expect("engine");
        let mut c = client(&e);
        declare(&mut c, "q", true, json!({})).expect("declare");
        for i in 0..N {
            publish(&mut c, to("q").key(&format!("k{i}")));
        }
        // Every message consumed and acked: only receipts keep the log.
        assert_eq!(drain(&mut c, "q"), N);
        barrier(&store);
        let before = store.stats().segments;
        assert!(before >= 3, "{before} segments");
        e.compact().expect("compact");
        barrier(&store);
        barrier(&store);
        assert!(
            store.stats().segments < before,
            "segments reclaimed once the receipts were copied out"
        );
        assert_eq!(receipt_files(dir.path()), 1);
        drop(c);
        drop(e);
        store.close().expect("close");
    }
    let store = LogStore::open(dir.path(), log_opts()).expect("reopen");
    let e = Engine::open(store.clone(), ManualClock::new()).expect("engine");
    let mut c = client(&e);
    let q = c.queue("q").expect("queue");
    assert_eq!(q.dedup().len(), N, "every receipt recovered");
    assert!(q.dedup().contains(key_hash(b"k7"), e.clock().now_ms()));
    for i in 0..N {
        publish(&mut c, to("q").key(&format!("k{i}")));
    }
    assert_eq!(count(&c, "q"), 0, "every republish was a duplicate");
    publish(&mut c, to("q").key("new"));
    assert_eq!(count(&c, "q"), 1);
    drop(c);
    drop(e);
    store.close().expect("close");
}

/// The engine decides, on its clock, which recovered receipts still hold:
/// a restart within the window keeps them, one after it starts afresh.
/// (That the log store reclaims the segments of expired receipts is the
/// store's own test, `receipts_near_expiry_pin_their_segment_until_they_expire`.)
#[test]
fn expired_receipts_are_gone_after_restart() {
    const WINDOW_MS: u64 = 600;
    let clock = ManualClock::new();
    let store = MemStore::new();
    {
        let e = Engine::open(store.clone(), clock.clone()).expect("engine");
        let mut c = client(&e);
        declare(&mut c, "q", true, json!({"x-dedup-window": WINDOW_MS})).expect("declare");
        for i in 0..40 {
            publish(&mut c, to("q").key(&format!("k{i}")));
        }
        assert_eq!(drain(&mut c, "q"), 40);
    }
    // Restarted within the window: every receipt holds.
    clock.advance_ms(WINDOW_MS - 1);
    let store = store.reopen();
    {
        let e = Engine::open(store.clone(), clock.clone()).expect("engine");
        let mut c = client(&e);
        assert_eq!(c.queue("q").expect("queue").dedup().len(), 40);
        publish(&mut c, to("q").key("k1"));
        assert_eq!(count(&c, "q"), 0, "still a duplicate");
    }
    // Restarted after it: none does.
    clock.advance_ms(1);
    let store = store.reopen();
    let e = Engine::open(store, clock.clone()).expect("engine");
    let mut c = client(&e);
    assert!(c.queue("q").expect("queue").dedup().is_empty());
    publish(&mut c, to("q").key("k1"));
    assert_eq!(count(&c, "q"), 1, "expired: enqueued again");
}
