//! Store contract v2 as the engine uses it (issue 21): several engines over
//! one store (two handles of one `MemStore` or one log store, as two
//! gateways over a shared store would be), definitions reaching every
//! engine through the change feed, conditional declares, partitions owned
//! per engine, and what survives a crash of the in-memory store.

use bytes::Bytes;
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Duration;
use weir_backend::log::{LogOptions, LogStore};
use weir_backend::testing::MemStore;
use weir_backend::{MessageAttrs, MessageData, Op, PartitionId, Store, StoreError};
use weir_engine::client::{GetAck, Published};
use weir_engine::exchange::{ExchangeDef, ExchangeKind, HeaderLookup};
use weir_engine::message::Message;
use weir_engine::meta::DestinationKind;
use weir_engine::properties::{HeaderFormat, Properties};
use weir_engine::tenant::{QueueDeclare, RouteInput};
use weir_engine::ManualClock;
use weir_engine::{Client, Engine, EngineError, DEFAULT_TENANT};

struct NoHeaders;

impl HeaderLookup for NoHeaders {
    fn header(&self, _: &str) -> Option<Value> {
        None
    }
}

fn client(e: &Arc<Engine>) -> Client {
    Client::open(e, DEFAULT_TENANT, "guest").expect("client")
}

fn declare(e: &Arc<Engine>, name: &str, arguments: Value) -> Result<(), EngineError> {
    let t = e.tenant(DEFAULT_TENANT).expect("tenant");
    let (_, wait) = t.declare_queue(QueueDeclare {
        name: name.into(),
        passive: false,
        durable: true,
        exclusive: false,
        auto_delete: false,
        arguments,
        connection: 1,
    })?;
    if let Some(w) = wait {
        w.blocking_recv().expect("store answered").expect("durable");
    }
    Ok(())
}

fn durable_exchange(e: &Arc<Engine>, name: &str) {
    let t = e.tenant(DEFAULT_TENANT).expect("tenant");
    let wait = t
        .declare_exchange(
            ExchangeDef {
                name: name.into(),
                kind: ExchangeKind::Direct,
                durable: true,
                auto_delete: false,
                internal: false,
                arguments: json!({}),
                delayed: false,
            },
            false,
        )
        .expect("exchange");
    if let Some(w) = wait {
        w.blocking_recv().expect("store answered").expect("durable");
    }
}

fn bind(e: &Arc<Engine>, queue: &str, exchange: &str, key: &str) {
    let t = e.tenant(DEFAULT_TENANT).expect("tenant");
    if let Some(w) = t
        .bind(exchange, DestinationKind::Queue, queue, key, json!({}), 1)
        .expect("bind")
    {
        w.blocking_recv().expect("store answered").expect("durable");
    }
}

/// The queues a publish to `exchange` with `key` reaches, by name.
fn routes(e: &Arc<Engine>, exchange: &str, key: &str) -> Vec<String> {
    let t = e.tenant(DEFAULT_TENANT).expect("tenant");
    let mut out = Vec::new();
    let _ = t
        .route(
            &RouteInput {
                exchange,
                routing_key: key,
                headers: &NoHeaders,
            },
            &mut out,
        )
        .expect("route");
    out.iter().map(|q| q.name().to_string()).collect()
}

fn publish(c: &mut Client, queue: &str, body: &'static [u8]) -> Published {
    let props = Properties::default().to_bytes().expect("properties");
    let route = RouteInput {
        exchange: "",
        routing_key: queue,
        headers: &NoHeaders,
    };
    let p = c
        .publish(&route, |id| Message {
            id,
            exchange: Bytes::new(),
            routing_key: Bytes::copy_from_slice(queue.as_bytes()),
            properties: props,
            body: Bytes::from_static(body),
            header_format: HeaderFormat::WEIR,
            persistent: true,
            priority: 0,
            ttl_ms: None,
        })
        .expect("publish");
    c.commit();
    p
}

/// Waits for a client's durability barrier.
fn confirm(c: &mut Client, release: impl FnOnce()) {
    let (tx, rx) = std::sync::mpsc::channel();
    c.durability_barrier(Box::new(move |r| {
        let _ = tx.send(r);
    }))
    .expect("barrier");
    release();
    rx.recv_timeout(Duration::from_secs(20))
        .expect("waiter called")
        .expect("durable");
}

fn bodies(c: &mut Client, queue: &str) -> Vec<Bytes> {
    let mut out = Vec::new();
    while let Some(d) = c.get(queue, GetAck::Auto).expect("get") {
        out.push(d.message.body.clone());
    }
    c.commit();
    out
}

/// Declares, binds and deletes through `a`; checks that `b` follows.
fn definitions_follow(a: &Arc<Engine>, b: &Arc<Engine>) {
    durable_exchange(a, "orders");
    declare(a, "invoices", json!({"x-max-length": 10})).expect("declare");
    bind(a, "invoices", "orders", "new");
    // `b` applies what the feed brought on its timer task's next run (the
    // feed's wake pokes it).
    assert!(
        b.tenant(DEFAULT_TENANT)
            .expect("t")
            .exchange("orders")
            .is_err(),
        "applied before the feed ran"
    );
    b.run_timers();
    let t = b.tenant(DEFAULT_TENANT).expect("tenant");
    assert!(t.exchange("orders").is_ok(), "the exchange reached b");
    let q = t.queue_named("invoices").expect("the queue reached b");
    assert_eq!(q.def.arguments, json!({"x-max-length": 10}));
    assert_eq!(routes(b, "orders", "new"), vec!["invoices".to_string()]);
    // A redeclare through b is checked against a's definition.
    match declare(b, "invoices", json!({"x-max-length": 20})) {
        Err(EngineError::PreconditionFailed(text)) => {
            assert!(text.contains("x-max-length"), "{text}")
        }
        other => panic!("an inequivalent redeclare on b: {other:?}"),
    }
    // Deletes follow too.
    let ta = a.tenant(DEFAULT_TENANT).expect("tenant");
    if let Some(w) = ta
        .unbind(
            "orders",
            DestinationKind::Queue,
            "invoices",
            "new",
            json!({}),
            1,
        )
        .expect("unbind")
    {
        w.blocking_recv().expect("answered").expect("durable");
    }
    b.apply_definition_changes();
    assert!(
        routes(b, "orders", "new").is_empty(),
        "the unbind reached b"
    );
    let (_, w) = ta
        .delete_queue("invoices", false, false, 1)
        .expect("delete");
    if let Some(w) = w {
        w.blocking_recv().expect("answered").expect("durable");
    }
    let w = ta.delete_exchange("orders", false).expect("delete");
    if let Some(w) = w {
        w.blocking_recv().expect("answered").expect("durable");
    }
    b.apply_definition_changes();
    let t = b.tenant(DEFAULT_TENANT).expect("tenant");
    assert!(
        t.queue_named("invoices").is_none(),
        "the queue delete reached b"
    );
    assert!(
        t.exchange("orders").is_err(),
        "the exchange delete reached b"
    );
    // And a's own changes, echoed by the feed, changed nothing on a.
    a.apply_definition_changes();
    assert!(a
        .tenant(DEFAULT_TENANT)
        .expect("t")
        .queue_named("invoices")
        .is_none());
}

#[test]
fn definitions_made_through_one_engine_reach_another_on_one_mem_store() {
    let store = MemStore::new();
    let a = Engine::open(store.clone(), ManualClock::new()).expect("engine a");
    let b = Engine::open(store.handle(), ManualClock::new()).expect("engine b");
    definitions_follow(&a, &b);
    // The other way round as well.
    declare(&b, "from-b", json!({})).expect("declare");
    a.apply_definition_changes();
    assert!(a
        .tenant(DEFAULT_TENANT)
        .expect("t")
        .queue_named("from-b")
        .is_some());
}

#[test]
fn definitions_made_through_one_engine_reach_another_on_one_log_store() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = LogStore::open(
        dir.path(),
        LogOptions {
            sync: false,
            ..LogOptions::default()
        },
    )
    .expect("store");
    let a = Engine::open(store.clone(), ManualClock::new()).expect("engine a");
    let b = Engine::open(store.handle(), ManualClock::new()).expect("engine b");
    definitions_follow(&a, &b);
    drop((a, b));
    store.close().expect("close");
}

#[test]
fn of_two_engines_declaring_one_queue_differently_the_first_wins() {
    let store = MemStore::new();
    let a = Engine::open(store.clone(), ManualClock::new()).expect("engine a");
    let b = Engine::open(store.handle(), ManualClock::new()).expect("engine b");
    declare(&a, "jobs", json!({"x-max-length": 10})).expect("a declares");
    // b has not applied the feed yet: its conditional put loses, it takes
    // a's definition and answers as for a redeclare (inequivalent here).
    match declare(&b, "jobs", json!({"x-max-length": 20})) {
        Err(EngineError::PreconditionFailed(text)) => {
            assert!(text.contains("x-max-length"), "{text}")
        }
        other => panic!("the losing declare: {other:?}"),
    }
    let q = b
        .tenant(DEFAULT_TENANT)
        .expect("t")
        .queue_named("jobs")
        .expect("b has a's queue");
    assert_eq!(q.def.arguments, json!({"x-max-length": 10}));
    // The same definition is a plain redeclare.
    declare(&b, "jobs", json!({"x-max-length": 10})).expect("an equivalent redeclare");
    let stored = store.recovered_meta().expect("meta").meta;
    let value = stored
        .get(&weir_engine::meta::queue_key(DEFAULT_TENANT, "jobs"))
        .expect("stored");
    assert!(String::from_utf8_lossy(value).contains("\"x-max-length\":10"));
}

/// A message published to `p` through `store`, outside any engine.
fn raw_publish(store: &dyn Store, p: PartitionId) -> Result<(), StoreError> {
    let id = store.allocate_ids(1);
    store
        .append(
            &[Op::Publish {
                id,
                partitions: &[p],
                data: MessageData {
                    exchange: "",
                    routing_key: "x",
                    header_format: HeaderFormat::WEIR.to_u8(),
                    header: b"",
                    body: b"raw",
                    attrs: MessageAttrs::default(),
                },
            }],
            &mut Vec::new(),
        )
        .map(|_| ())
}

#[test]
fn engine_open_settles_orphans_only_of_partitions_nobody_holds() {
    // Two partitions with messages and no queue in the definitions: one
    // of a queue deleted before a crash, one of another gateway's queue
    // declared after this engine read the definitions.
    let (deleted, theirs) = (PartitionId(900), PartitionId(901));
    let before = MemStore::new();
    raw_publish(&*before, deleted).expect("publish");
    raw_publish(&*before, theirs).expect("publish");
    let store = before.reopen();
    let other = store.handle();
    other
        .acquire(theirs)
        .expect("the other gateway holds its queue");
    let _e = Engine::open(store.clone(), ManualClock::new()).expect("engine");
    assert_eq!(
        other.recover_partition(theirs).expect("recover").len(),
        1,
        "the engine emptied a partition another handle holds"
    );
    store.acquire(deleted).expect("acquire");
    assert!(
        store
            .recover_partition(deleted)
            .expect("recover")
            .is_empty(),
        "the orphan nobody holds was settled"
    );
}

#[test]
fn engine_open_takes_its_queues_over_and_fences_the_previous_holder() {
    let before = MemStore::new();
    let e = Engine::open(before.clone(), ManualClock::new()).expect("engine");
    declare(&e, "work", json!({})).expect("declare");
    let p = e
        .tenant(DEFAULT_TENANT)
        .expect("t")
        .queue_named("work")
        .expect("queue")
        .partitions[0]
        .id;
    drop(e);
    let store = before.reopen();
    // A handle that held the partition before this engine started (a
    // gateway that is going away).
    let old = store.handle();
    old.acquire(p).expect("acquire");
    raw_publish(&*old, p).expect("the holder appends");
    let e = Engine::open(store.clone(), ManualClock::new()).expect("engine");
    assert!(
        matches!(raw_publish(&*old, p), Err(StoreError::Fenced(q)) if q == p),
        "the previous holder still appends after the engine took the queue over"
    );
    let mut c = client(&e);
    assert_eq!(bodies(&mut c, "work"), vec![Bytes::from_static(b"raw")]);
}

#[test]
fn a_crash_keeps_what_was_confirmed_and_loses_what_was_not() {
    let store = MemStore::new();
    let e = Engine::open(store.clone(), ManualClock::new()).expect("engine");
    declare(&e, "q", json!({})).expect("declare");
    let mut c = client(&e);
    store.hold_durability(true);
    publish(&mut c, "q", b"one");
    publish(&mut c, "q", b"two");
    confirm(&mut c, || store.release());
    // Consumed and acked, the ack not yet durable; then a publish nobody
    // confirmed.
    let d = c.get("q", GetAck::Auto).expect("get").expect("a message");
    assert_eq!(&d.message.body[..], b"one");
    c.commit();
    publish(&mut c, "q", b"three");
    assert!(
        store.pending_appends() >= 2,
        "the ack and the last publish wait"
    );
    drop(c);
    drop(e);
    let e = Engine::open(store.crash(), ManualClock::new()).expect("engine after the crash");
    let mut c = client(&e);
    assert_eq!(
        bodies(&mut c, "q"),
        vec![Bytes::from_static(b"one"), Bytes::from_static(b"two")],
        "confirmed messages survive (the lost ack brings 'one' back); the unconfirmed one is gone"
    );
}

#[test]
fn a_barrier_waits_for_its_own_partitions_not_for_others() {
    // Two clients publishing to two queues: one client's confirmation is
    // not held up by the other's pending append (per-partition tickets).
    let store = MemStore::new();
    let e = Engine::open(store.clone(), ManualClock::new()).expect("engine");
    declare(&e, "a", json!({})).expect("declare");
    declare(&e, "b", json!({})).expect("declare");
    let (mut ca, mut cb) = (client(&e), client(&e));
    store.hold_durability(true);
    publish(&mut ca, "a", b"a1");
    let a_ticket = *store.pending_tickets().last().expect("a's publish waits");
    publish(&mut cb, "b", b"b1");
    assert_eq!(store.pending_tickets().len(), 2);
    let (tx, rx) = std::sync::mpsc::channel();
    ca.durability_barrier(Box::new(move |r| {
        let _ = tx.send(r);
    }))
    .expect("barrier");
    assert!(rx.try_recv().is_err(), "confirmed before durable");
    // Only a's publish is made durable: a's confirmation completes while
    // b's publish is still pending.
    store.release_ticket(a_ticket);
    rx.recv_timeout(Duration::from_secs(5))
        .expect("a confirmed without b's append")
        .expect("durable");
    assert_eq!(store.pending_tickets().len(), 1, "b's publish still waits");
    let (tx, rx) = std::sync::mpsc::channel();
    cb.durability_barrier(Box::new(move |r| {
        let _ = tx.send(r);
    }))
    .expect("barrier");
    assert!(rx.try_recv().is_err(), "b confirmed before durable");
    store.release();
    rx.recv_timeout(Duration::from_secs(5))
        .expect("b confirmed")
        .expect("durable");
}

#[test]
fn cold_deliveries_are_read_ahead_without_blocking_the_session() {
    // Messages recovered at startup are cold (bodies in the store). With a
    // store whose reads answer later, drain starts their reads and the
    // session is not handed a delivery before its message is there; the
    // connection is woken and the next drain hands them all out, read.
    let before = MemStore::new();
    let e = Engine::open(before.clone(), ManualClock::new()).expect("engine");
    declare(&e, "q", json!({})).expect("declare");
    let mut c = client(&e);
    for body in [&b"one"[..], b"two", b"three"] {
        publish(&mut c, "q", body);
    }
    drop(c);
    drop(e);
    let store = before.reopen();
    store.defer_reads(true);
    let e = Engine::open(store.clone(), ManualClock::new()).expect("engine");
    let mut c = client(&e);
    c.subscribe(
        "q",
        weir_engine::client::SubscribeOptions {
            scope: 1,
            tag: Bytes::from_static(b"t"),
            exclusive: false,
            no_ack: true,
            prefetch_count: 0,
            prefetch_bytes: 0,
            priority: 0,
        },
    )
    .expect("subscribe");
    c.commit();
    c.drain(&mut Vec::new());
    assert_eq!(
        c.pending_deliveries(),
        3,
        "the queue handed out its messages"
    );
    assert!(
        c.next_delivery().is_none(),
        "a delivery was handed out before its read completed"
    );
    c.finish_deliveries();
    // The read completed (the connection was woken): the next drain hands
    // them out with their messages.
    c.drain(&mut Vec::new());
    let mut got = Vec::new();
    let mut tag = 0;
    while let Some(d) = c.next_delivery() {
        let m = c.message_of(&d).expect("read ahead");
        got.push(m.body.clone());
        tag += 1;
        let (now, now_ms) = (c.clock().now(), c.clock().now_ms());
        c.lease(1, tag, d, now, now_ms);
    }
    c.finish_deliveries();
    c.commit();
    assert_eq!(
        got,
        vec![
            Bytes::from_static(b"one"),
            Bytes::from_static(b"two"),
            Bytes::from_static(b"three")
        ]
    );
}
