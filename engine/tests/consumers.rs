//! Who takes the next message: single active consumer, consumer
//! priorities, and priority queues (strict priority, FIFO within a level),
//! in process over the in-memory store.

use bytes::Bytes;
use serde_json::{json, Value};
use std::sync::Arc;
use weir_backend::testing::MemStore;
use weir_backend::Store;
use weir_engine::client::{GetAck, Published, SubscribeOptions};
use weir_engine::consumer::Scope;
use weir_engine::exchange::HeaderLookup;
use weir_engine::lease::Settle;
use weir_engine::message::Message;
use weir_engine::properties::HeaderFormat;
use weir_engine::tenant::{QueueDeclare, RouteInput};
use weir_engine::ManualClock;
use weir_engine::{Client, ClientError, Engine, EngineError, DEFAULT_TENANT};

fn engine() -> Arc<Engine> {
    Engine::open(MemStore::new(), ManualClock::new()).expect("engine")
}

fn client(engine: &Arc<Engine>) -> Client {
    Client::open(engine, DEFAULT_TENANT, "guest").expect("client")
}

fn try_declare(
    c: &mut Client,
    name: &str,
    durable: bool,
    arguments: Value,
) -> Result<(), EngineError> {
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

fn declare(c: &mut Client, name: &str, arguments: Value) {
    try_declare(c, name, false, arguments).expect("declare");
}

struct NoHeaders;
impl HeaderLookup for NoHeaders {
    fn header(&self, _: &str) -> Option<Value> {
        None
    }
}

/// Publishes `body` with `priority` to `queue` through the default exchange.
fn publish_p(c: &mut Client, queue: &str, body: &str, priority: u8, persistent: bool) {
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
            properties: Bytes::new(),
            body: Bytes::copy_from_slice(body.as_bytes()),
            header_format: HeaderFormat::new(1),
            persistent,
            priority,
            ttl_ms: None,
        })
        .expect("publish");
    assert!(matches!(p, Published::Routed { .. }), "{body} not routed");
}

fn publish(c: &mut Client, queue: &str, body: &str) {
    publish_p(c, queue, body, 0, false);
}

fn opts(tag: &'static str, prefetch: u32, priority: i32) -> SubscribeOptions {
    SubscribeOptions {
        scope: 1,
        tag: Bytes::from_static(tag.as_bytes()),
        prefetch_count: prefetch,
        priority,
        ..SubscribeOptions::default()
    }
}

/// A client standing for one connection with one channel (scope 1), as a
/// protocol session drives it: deliveries written and leased under
/// increasing tags.
struct Conn {
    c: Client,
    tag: u64,
    /// Tag → body of every delivery written.
    written: Vec<(u64, String, bool)>,
}

impl Conn {
    fn new(e: &Arc<Engine>) -> Conn {
        Conn {
            c: client(e),
            tag: 0,
            written: Vec::new(),
        }
    }

    /// Writes every pending delivery; returns their bodies (a `*` suffix
    /// marks a redelivery).
    fn take(&mut self) -> Vec<String> {
        self.c.drain(&mut Vec::new());
        let mut out = Vec::new();
        while let Some(d) = self.c.next_delivery() {
            let m = self.c.message_of(&d).expect("readable");
            self.tag += 1;
            let body = String::from_utf8(m.body.to_vec()).expect("utf-8");
            let redelivered = d.entry.redelivered;
            out.push(if redelivered {
                format!("{body}*")
            } else {
                body.clone()
            });
            self.written.push((self.tag, body, redelivered));
            let scope: Scope = d.consumer.scope();
            self.c.lease(
                scope,
                self.tag,
                d,
                self.c.clock().now(),
                self.c.clock().now_ms(),
            );
        }
        self.c.finish_deliveries();
        self.c.commit();
        out
    }

    /// The tag `body` was last delivered under.
    fn tag_of(&self, body: &str) -> u64 {
        self.written
            .iter()
            .rev()
            .find(|(_, b, _)| b == body)
            .map(|(t, _, _)| *t)
            .unwrap_or_else(|| panic!("{body} was not delivered"))
    }

    fn settle(&mut self, body: &str, how: Settle) {
        let tag = self.tag_of(body);
        self.c.settle(1, tag, false, how).expect("settle");
        self.c.commit();
    }
}

/// Takes every ready message of `queue` with auto-ack gets (a `*` suffix
/// marks a redelivery).
fn get_all(c: &mut Client, queue: &str) -> Vec<String> {
    let mut out = Vec::new();
    while let Some(got) = c.get(queue, GetAck::Auto).expect("get") {
        let body = String::from_utf8(got.message.body.to_vec()).expect("utf-8");
        out.push(if got.redelivered {
            format!("{body}*")
        } else {
            body
        });
    }
    out
}

fn strs(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

// ----- single active consumer -----

#[test]
fn single_active_consumer_takes_everything_until_it_goes() {
    let e = engine();
    let mut a = Conn::new(&e);
    let mut b = Conn::new(&e);
    let mut publisher = client(&e);
    declare(&mut a.c, "sac", json!({"x-single-active-consumer": true}));
    a.c.subscribe("sac", opts("a", 0, 0)).expect("subscribe a");
    // Accepted and idle, even with a higher priority.
    b.c.subscribe("sac", opts("b", 0, 9)).expect("subscribe b");
    assert_eq!(a.c.queue("sac").expect("queue").consumer_count(), 2);
    for m in ["m0", "m1", "m2"] {
        publish(&mut publisher, "sac", m);
    }
    assert_eq!(a.take(), strs(&["m0", "m1", "m2"]));
    assert!(b.take().is_empty(), "the second consumer stays idle");

    // Cancelled: b becomes active at once; a's leases stay with a.
    assert!(a.c.unsubscribe(1, b"a"));
    publish(&mut publisher, "sac", "m3");
    assert_eq!(b.take(), strs(&["m3"]));
    assert!(a.take().is_empty());

    // a's channel closes: its leases go back to their places and on to b.
    a.c.release_scope(1);
    a.c.commit();
    assert_eq!(b.take(), strs(&["m0*", "m1*", "m2*"]));
}

#[test]
fn single_active_consumer_without_credit_holds_the_queue() {
    let e = engine();
    let mut a = Conn::new(&e);
    let mut b = Conn::new(&e);
    declare(&mut a.c, "sac", json!({"x-single-active-consumer": true}));
    a.c.subscribe("sac", opts("a", 1, 0)).expect("subscribe a");
    b.c.subscribe("sac", opts("b", 0, 0)).expect("subscribe b");
    for m in ["m0", "m1", "m2"] {
        publish(&mut a.c, "sac", m);
    }
    assert_eq!(a.take(), strs(&["m0"]));
    assert!(b.take().is_empty(), "the idle consumer does not take over");
    a.settle("m0", Settle::Ack);
    assert_eq!(a.take(), strs(&["m1"]));
    // The active connection dies: its lease and the rest go to b, in order.
    a.c.close();
    assert_eq!(b.take(), strs(&["m1*", "m2"]));
}

#[test]
fn single_active_consumer_is_the_same_in_every_partition() {
    let e = engine();
    let mut conns: Vec<Conn> = (0..3).map(|_| Conn::new(&e)).collect();
    let mut publisher = client(&e);
    declare(
        &mut publisher,
        "sacp",
        json!({"x-single-active-consumer": true, "x-partitions": 4}),
    );
    for (i, c) in conns.iter_mut().enumerate() {
        let tag: &'static str = ["c0", "c1", "c2"][i];
        c.c.subscribe("sacp", opts(tag, 0, 0)).expect("subscribe");
    }
    // Publishes spread round robin over the 4 partitions; every one of
    // them delivers to the first consumer only (one message out per
    // partition at a time: a partitioned queue keeps per-key order).
    for i in 0..12 {
        publish(&mut publisher, "sacp", &format!("m{i}"));
    }
    let first = conns[0].take();
    assert_eq!(first.len(), 4, "one per partition");
    assert!(conns[1].take().is_empty() && conns[2].take().is_empty());
    // The first one's connection goes: the second takes over everywhere,
    // its leases first.
    conns[0].c.close();
    assert_eq!(drain_acking(&mut conns[1]), 12);
    for i in 12..20 {
        publish(&mut publisher, "sacp", &format!("m{i}"));
    }
    assert_eq!(drain_acking(&mut conns[1]), 8);
    assert!(conns[2].take().is_empty());
}

/// Takes and acks until nothing more comes; returns how many.
fn drain_acking(c: &mut Conn) -> usize {
    let mut n = 0;
    loop {
        let got = c.take();
        if got.is_empty() {
            return n;
        }
        for m in got {
            n += 1;
            c.settle(m.trim_end_matches('*'), Settle::Ack);
        }
    }
}

#[test]
fn exclusive_consume_is_refused_on_a_single_active_consumer_queue() {
    let e = engine();
    let mut a = client(&e);
    declare(&mut a, "sac", json!({"x-single-active-consumer": true}));
    let exclusive = SubscribeOptions {
        exclusive: true,
        ..opts("x", 0, 0)
    };
    // Refused even with no consumer attached, as RabbitMQ does.
    match a.subscribe("sac", exclusive) {
        Err(ClientError::Engine(EngineError::AccessRefused(text))) => {
            assert!(text.contains("in exclusive use"), "{text}")
        }
        other => panic!("exclusive consume accepted: {:?}", other.map(|_| ())),
    }
    a.subscribe("sac", opts("n", 0, 0))
        .expect("a plain consumer is fine");
}

// ----- consumer priorities -----

#[test]
fn higher_priority_consumers_take_messages_while_they_have_credit() {
    let e = engine();
    let mut lo = Conn::new(&e);
    let mut hi = Conn::new(&e);
    declare(&mut lo.c, "q", json!({}));
    // Registered first, lower priority.
    lo.c.subscribe("q", opts("lo", 0, 0)).expect("subscribe lo");
    hi.c.subscribe("q", opts("hi", 2, 10))
        .expect("subscribe hi");
    for i in 0..5 {
        publish(&mut lo.c, "q", &format!("m{i}"));
    }
    assert_eq!(hi.take(), strs(&["m0", "m1"]));
    assert_eq!(lo.take(), strs(&["m2", "m3", "m4"]));
    // Credit back: the high one is first again.
    hi.settle("m0", Settle::Ack);
    hi.settle("m1", Settle::Ack);
    for i in 5..8 {
        publish(&mut lo.c, "q", &format!("m{i}"));
    }
    assert_eq!(hi.take(), strs(&["m5", "m6"]));
    assert_eq!(lo.take(), strs(&["m7"]));
}

#[test]
fn equal_priorities_share_round_robin_and_flow_off_blocks_like_no_credit() {
    let e = engine();
    let mut a = Conn::new(&e);
    let mut b = Conn::new(&e);
    let mut low = Conn::new(&e);
    declare(&mut a.c, "q", json!({}));
    low.c.subscribe("q", opts("low", 0, -5)).expect("subscribe");
    a.c.subscribe("q", opts("a", 0, 3)).expect("subscribe");
    b.c.subscribe("q", opts("b", 0, 3)).expect("subscribe");
    for i in 0..4 {
        publish(&mut low.c, "q", &format!("m{i}"));
    }
    assert_eq!(a.take(), strs(&["m0", "m2"]));
    assert_eq!(b.take(), strs(&["m1", "m3"]));
    assert!(
        low.take().is_empty(),
        "a negative priority is below the default"
    );
    // Both equals paused (channel.flow off): the lower one takes over.
    a.c.set_flow(1, false);
    b.c.set_flow(1, false);
    publish(&mut low.c, "q", "m4");
    assert_eq!(low.take(), strs(&["m4"]));
    b.c.set_flow(1, true);
    publish(&mut low.c, "q", "m5");
    assert_eq!(b.take(), strs(&["m5"]));
    assert!(low.take().is_empty() && a.take().is_empty());
}

#[test]
fn a_waiting_backlog_goes_to_the_highest_priority_consumer_first() {
    let e = engine();
    let mut lo = Conn::new(&e);
    let mut hi = Conn::new(&e);
    declare(&mut lo.c, "q", json!({}));
    for i in 0..4 {
        publish(&mut lo.c, "q", &format!("m{i}"));
    }
    // A low-priority consumer with little credit takes some; a higher one
    // arriving later takes what is left.
    lo.c.subscribe("q", opts("lo", 1, 0)).expect("subscribe lo");
    assert_eq!(lo.take(), strs(&["m0"]));
    hi.c.subscribe("q", opts("hi", 0, 1)).expect("subscribe hi");
    assert_eq!(hi.take(), strs(&["m1", "m2", "m3"]));
    // Once the high one goes, the low one gets its next message.
    lo.settle("m0", Settle::Ack);
    publish(&mut hi.c, "q", "m4");
    assert_eq!(hi.take(), strs(&["m4"]));
    assert!(hi.c.unsubscribe(1, b"hi"));
    publish(&mut hi.c, "q", "m5");
    assert_eq!(lo.take(), strs(&["m5"]));
}

// ----- priority queues -----

#[test]
fn priority_queue_is_strict_priority_and_fifo_within_a_level() {
    let e = engine();
    let mut c = client(&e);
    declare(&mut c, "pq", json!({"x-max-priority": 10}));
    let mut sent = Vec::new();
    for (i, p) in [0u8, 5, 9, 5, 0, 9, 3, 1, 9, 0].into_iter().enumerate() {
        let body = format!("p{p}-{i}");
        publish_p(&mut c, "pq", &body, p, false);
        sent.push((p, body));
    }
    // Highest first; a stable sort keeps publish order within a level.
    sent.sort_by_key(|(p, _)| std::cmp::Reverse(*p));
    let want: Vec<String> = sent.into_iter().map(|(_, b)| b).collect();
    assert_eq!(get_all(&mut c, "pq"), want);
}

#[test]
fn priority_above_the_maximum_counts_as_the_maximum() {
    let e = engine();
    let mut c = client(&e);
    declare(&mut c, "pq", json!({"x-max-priority": 5}));
    for (body, p) in [("a5", 5), ("b9", 9), ("c1", 1), ("d255", 255), ("e5", 5)] {
        publish_p(&mut c, "pq", body, p, false);
    }
    assert_eq!(
        get_all(&mut c, "pq"),
        strs(&["a5", "b9", "d255", "e5", "c1"])
    );
}

#[test]
fn without_max_priority_message_priorities_are_ignored() {
    let e = engine();
    let mut c = client(&e);
    declare(&mut c, "plain", json!({}));
    for (body, p) in [("a", 0), ("b", 9), ("c", 3)] {
        publish_p(&mut c, "plain", body, p, false);
    }
    assert_eq!(get_all(&mut c, "plain"), strs(&["a", "b", "c"]));
}

#[test]
fn requeued_messages_return_to_their_place_in_their_level() {
    let e = engine();
    let mut cons = Conn::new(&e);
    declare(&mut cons.c, "pq", json!({"x-max-priority": 9}));
    for (body, p) in [("c1", 5), ("c2", 5), ("c3", 5), ("h1", 9)] {
        publish_p(&mut cons.c, "pq", body, p, false);
    }
    cons.c.subscribe("pq", opts("t", 3, 0)).expect("subscribe");
    assert_eq!(cons.take(), strs(&["h1", "c1", "c2"]));
    // Cancelled so requeues stay in the queue; then more arrive.
    assert!(cons.c.unsubscribe(1, b"t"));
    publish_p(&mut cons.c, "pq", "h2", 9, false);
    publish_p(&mut cons.c, "pq", "c4", 5, false);
    // Requeued out of order: each goes back to its own place.
    cons.settle("c2", Settle::Requeue);
    cons.settle("h1", Settle::Requeue);
    cons.settle("c1", Settle::Requeue);
    assert_eq!(
        get_all(&mut cons.c, "pq"),
        strs(&["h1*", "h2", "c1*", "c2*", "c3", "c4"])
    );
}

#[test]
fn consumers_of_a_priority_queue_get_the_highest_first() {
    let e = engine();
    let mut cons = Conn::new(&e);
    declare(&mut cons.c, "pq", json!({"x-max-priority": 3}));
    for (body, p) in [("a0", 0), ("b3", 3), ("c1", 1), ("d3", 3)] {
        publish_p(&mut cons.c, "pq", body, p, false);
    }
    cons.c.subscribe("pq", opts("t", 1, 0)).expect("subscribe");
    let mut order = Vec::new();
    for _ in 0..4 {
        let got = cons.take();
        assert_eq!(got.len(), 1, "prefetch 1");
        cons.settle(&got[0], Settle::Ack);
        order.push(got[0].clone());
    }
    assert_eq!(order, strs(&["b3", "d3", "c1", "a0"]));
}

#[test]
fn priorities_survive_a_restart() {
    let store = MemStore::new();
    {
        let e = Engine::open(store.clone(), ManualClock::new()).expect("engine");
        let mut c = client(&e);
        try_declare(&mut c, "pq", true, json!({"x-max-priority": 4})).expect("declare");
        for (body, p) in [("a1", 1), ("b4", 4), ("c0", 0), ("d200", 200), ("e1", 1)] {
            publish_p(&mut c, "pq", body, p, true);
        }
        drop(c);
        store.close().expect("close");
    }
    let e = Engine::open(store.reopen(), ManualClock::new()).expect("engine");
    let mut c = client(&e);
    assert_eq!(
        get_all(&mut c, "pq"),
        strs(&["b4*", "d200*", "a1*", "e1*", "c0*"])
    );
}

#[test]
fn max_priority_of_the_wrong_type_or_range_is_refused() {
    let e = engine();
    let mut c = client(&e);
    for bad in [json!("10"), json!(-1), json!(256), json!(1.5)] {
        match try_declare(&mut c, "bad", false, json!({"x-max-priority": bad})) {
            Err(EngineError::PreconditionFailed(text)) => {
                assert!(text.contains("x-max-priority"), "{text}")
            }
            other => panic!("x-max-priority {bad}: {other:?}"),
        }
    }
    // 0 too, as RabbitMQ: one level.
    for good in [0, 1, 10, 255] {
        try_declare(
            &mut c,
            &format!("ok{good}"),
            false,
            json!({"x-max-priority": good}),
        )
        .expect("a valid maximum");
    }
}
