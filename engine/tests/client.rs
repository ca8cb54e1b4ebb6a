//! The engine's per-client interface, in process: the in-memory store
//! (`MemStore`, which runs the same contract suite as the log store), no
//! sockets, time given as an input.

use bytes::Bytes;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};
use weir_backend::testing::MemStore;
use weir_backend::Store;
use weir_engine::client::{GetAck, Published, SubscribeOptions};
use weir_engine::consumer::{Delivery, Notice, Scope};
use weir_engine::exchange::HeaderLookup;
use weir_engine::lease::Settle;
use weir_engine::message::Message;
use weir_engine::properties::HeaderFormat;
use weir_engine::tenant::{QueueDeclare, RouteInput};
use weir_engine::ManualClock;
use weir_engine::{Client, ClientError, Engine, DEFAULT_TENANT};

/// The store every test runs on: in memory, durable at once unless held.
fn store() -> Arc<dyn Store> {
    MemStore::new()
}

fn engine() -> Arc<Engine> {
    Engine::open(store(), ManualClock::new()).expect("engine")
}

fn client(engine: &Arc<Engine>) -> Client {
    Client::open(engine, DEFAULT_TENANT, "guest").expect("client")
}

fn declare(c: &mut Client, name: &str, durable: bool) {
    let (_, wait) = c
        .declare_queue(QueueDeclare {
            name: name.into(),
            passive: false,
            durable,
            exclusive: false,
            auto_delete: false,
            arguments: serde_json::json!({}),
            connection: c.id(),
        })
        .expect("declare");
    if let Some(w) = wait {
        w.blocking_recv().expect("store answered").expect("durable");
    }
}

struct NoHeaders;
impl HeaderLookup for NoHeaders {
    fn header(&self, _: &str) -> Option<serde_json::Value> {
        None
    }
}

/// Publishes `body` to `queue` through the default exchange.
fn publish(c: &mut Client, queue: &str, body: &str, persistent: bool) -> Published {
    let route = RouteInput {
        exchange: "",
        routing_key: queue,
        headers: &NoHeaders,
    };
    c.publish(&route, |id| Message {
        id,
        exchange: Bytes::new(),
        routing_key: Bytes::copy_from_slice(queue.as_bytes()),
        properties: Bytes::new(),
        body: Bytes::copy_from_slice(body.as_bytes()),
        header_format: HeaderFormat::new(1),
        persistent,
        priority: 0,
        ttl_ms: None,
    })
    .expect("publish")
}

fn opts(scope: Scope, tag: &'static str, prefetch: u32) -> SubscribeOptions {
    SubscribeOptions {
        scope,
        tag: Bytes::from_static(tag.as_bytes()),
        exclusive: false,
        no_ack: false,
        prefetch_count: prefetch,
        prefetch_bytes: 0,
        priority: 0,
    }
}

/// Writes every pending delivery as a protocol session would: leases it
/// under the scope's next tag. Returns (tag, body, redelivered).
fn write_all(c: &mut Client, next_tag: &mut u64, now: Instant) -> Vec<(u64, Bytes, bool)> {
    c.drain(&mut Vec::new());
    let mut out = Vec::new();
    while let Some(d) = c.next_delivery() {
        let m = c.message_of(&d).expect("readable");
        *next_tag += 1;
        out.push((*next_tag, m.body.clone(), d.entry.redelivered));
        let scope = d.consumer.scope();
        let now_ms = c.clock().now_ms();
        c.lease(scope, *next_tag, d, now, now_ms);
    }
    c.finish_deliveries();
    c.commit();
    out
}

fn bodies(v: &[(u64, Bytes, bool)]) -> Vec<&[u8]> {
    v.iter().map(|(_, b, _)| &b[..]).collect()
}

/// Takes every message left in `queue` with auto-ack gets: (body, redelivered).
fn take_all(c: &mut Client, queue: &str) -> Vec<(String, bool)> {
    let mut out = Vec::new();
    while let Some(got) = c.get(queue, GetAck::Auto).expect("get") {
        let body = String::from_utf8(got.message.body.to_vec()).expect("utf-8 body");
        out.push((body, got.redelivered));
    }
    out
}

/// `(body, redelivered)` pairs, for comparing with [`take_all`].
fn marked(v: &[(&str, bool)]) -> Vec<(String, bool)> {
    v.iter().map(|(b, r)| ((*b).to_owned(), *r)).collect()
}

#[test]
fn publish_routes_to_a_consumer_and_ack_settles() {
    let e = engine();
    let mut c = client(&e);
    declare(&mut c, "q", false);
    assert_eq!(
        publish(&mut c, "nowhere", "x", false),
        Published::Unroutable
    );
    c.subscribe("q", opts(1, "t", 0)).expect("subscribe");
    assert_eq!(
        publish(&mut c, "q", "hello", false),
        Published::Routed {
            needs_barrier: false,
            refused: false
        }
    );
    let mut tag = 0;
    let got = write_all(&mut c, &mut tag, e.clock().now());
    assert_eq!(bodies(&got), vec![b"hello"]);
    assert_eq!(c.leases(1), 1);
    c.settle(1, 1, false, Settle::Ack).expect("ack");
    c.commit();
    assert_eq!(c.leases(1), 0);
    let q = c.queue("q").expect("queue");
    assert_eq!(q.depth().leased, 0);
    assert_eq!(q.message_count(), 0);
}

#[test]
fn credit_bounds_deliveries_and_ack_gives_it_back() {
    let e = engine();
    let mut c = client(&e);
    declare(&mut c, "q", false);
    c.subscribe("q", opts(1, "t", 2)).expect("subscribe");
    for b in ["a", "b", "c", "d", "e"] {
        publish(&mut c, "q", b, false);
    }
    let mut tag = 0;
    let now = e.clock().now();
    assert_eq!(bodies(&write_all(&mut c, &mut tag, now)), vec![b"a", b"b"]);
    assert!(
        write_all(&mut c, &mut tag, now).is_empty(),
        "no credit left"
    );
    // One ack frees one delivery's credit; the commit lets the queue deliver.
    c.settle(1, 1, false, Settle::Ack).expect("ack");
    c.commit();
    assert_eq!(bodies(&write_all(&mut c, &mut tag, now)), vec![b"c"]);
    // A multiple ack up to the last tag frees both.
    c.settle(1, tag, true, Settle::Ack).expect("ack");
    c.commit();
    assert_eq!(bodies(&write_all(&mut c, &mut tag, now)), vec![b"d", b"e"]);
}

#[test]
fn requeue_restores_position_and_marks_redelivered() {
    let e = engine();
    let mut c = client(&e);
    declare(&mut c, "q", false);
    c.subscribe("q", opts(1, "t", 1)).expect("subscribe");
    for b in ["a", "b", "c"] {
        publish(&mut c, "q", b, false);
    }
    let mut tag = 0;
    let now = e.clock().now();
    let first = write_all(&mut c, &mut tag, now);
    assert_eq!(first, vec![(1, Bytes::from_static(b"a"), false)]);
    c.settle(1, 1, false, Settle::Requeue).expect("requeue");
    c.commit();
    let again = write_all(&mut c, &mut tag, now);
    assert_eq!(
        again,
        vec![(2, Bytes::from_static(b"a"), true)],
        "back at the head, redelivered"
    );
    // Drop (reject without requeue) removes it: the next is b.
    c.settle(1, 2, false, Settle::Drop).expect("drop");
    c.commit();
    assert_eq!(bodies(&write_all(&mut c, &mut tag, now)), vec![b"b"]);
}

#[test]
fn release_scope_cancels_its_consumers_and_requeues_its_leases() {
    let e = engine();
    let mut a = client(&e);
    let mut b = client(&e);
    declare(&mut a, "q", false);
    a.subscribe("q", opts(1, "t", 0)).expect("subscribe");
    publish(&mut a, "q", "m", false);
    let mut tag = 0;
    assert_eq!(write_all(&mut a, &mut tag, e.clock().now()).len(), 1);
    a.release_scope(1);
    a.commit();
    assert_eq!(a.leases(1), 0);
    assert!(!a.has_subscription(1, b"t"));
    assert_eq!(a.queue("q").expect("queue").consumer_count(), 0);
    // Another client gets it, marked redelivered; `a` gets nothing more.
    b.subscribe("q", opts(1, "t", 0)).expect("subscribe");
    let mut tag_b = 0;
    let got = write_all(&mut b, &mut tag_b, e.clock().now());
    assert_eq!(got, vec![(1, Bytes::from_static(b"m"), true)]);
    assert!(write_all(&mut a, &mut tag, e.clock().now()).is_empty());
}

#[test]
fn close_requeues_leases_and_undelivered_messages() {
    let e = engine();
    let mut a = client(&e);
    declare(&mut a, "q", false);
    a.subscribe("q", opts(1, "t", 0)).expect("subscribe");
    publish(&mut a, "q", "leased-1", false);
    publish(&mut a, "q", "leased-2", false);
    let mut tag = 0;
    write_all(&mut a, &mut tag, e.clock().now());
    // Pushed to the outbox, never drained.
    publish(&mut a, "q", "unsent", false);
    a.close();
    let q = e
        .tenant(DEFAULT_TENANT)
        .expect("tenant")
        .queue("q", 0)
        .expect("queue");
    assert_eq!(q.message_count(), 3);
    assert_eq!(q.consumer_count(), 0);
    // In their places; only what was written is marked redelivered.
    let mut b = client(&e);
    assert_eq!(
        take_all(&mut b, "q"),
        marked(&[("leased-1", true), ("leased-2", true), ("unsent", false)])
    );
}

#[test]
fn cancelling_keeps_leases_and_releasing_the_scope_requeues_them_in_order() {
    let e = engine();
    let mut c = client(&e);
    declare(&mut c, "q", false);
    c.subscribe("q", opts(1, "t", 0)).expect("subscribe");
    for b in ["m0", "m1", "m2", "m3", "m4"] {
        publish(&mut c, "q", b, false);
    }
    let mut tag = 0;
    assert_eq!(write_all(&mut c, &mut tag, e.clock().now()).len(), 5);
    c.settle(1, 2, false, Settle::Ack).expect("ack m1");
    // A cancel (basic.cancel) stops deliveries but keeps the leases.
    assert!(c.unsubscribe(1, b"t"));
    c.commit();
    assert_eq!(c.leases(1), 4);
    assert_eq!(c.queue("q").expect("queue").message_count(), 0);
    // Closing the scope (channel.close) returns them, in their places.
    c.release_scope(1);
    c.commit();
    assert_eq!(
        take_all(&mut c, "q"),
        marked(&[("m0", true), ("m2", true), ("m3", true), ("m4", true)])
    );
}

#[test]
fn requeue_returns_each_message_to_its_original_place() {
    let e = engine();
    let mut c = client(&e);
    declare(&mut c, "q", false);
    for b in ["m1", "m2", "m3", "m4"] {
        publish(&mut c, "q", b, false);
    }
    let now = e.clock().now();
    let mut tag = 0;
    let mut get = |c: &mut Client| {
        tag += 1;
        let got = c
            .get("q", GetAck::Lease { scope: 1, tag, now })
            .expect("get")
            .expect("a message");
        let body = String::from_utf8(got.message.body.to_vec()).expect("utf-8");
        (body, got.redelivered)
    };
    assert_eq!(get(&mut c), ("m1".into(), false));
    assert_eq!(get(&mut c), ("m2".into(), false));
    // Requeued first to last: each goes back to its place, not to the front.
    c.settle(1, 1, false, Settle::Requeue).expect("requeue m1");
    c.settle(1, 2, false, Settle::Requeue).expect("requeue m2");
    assert_eq!(get(&mut c), ("m1".into(), true));
    assert_eq!(get(&mut c), ("m2".into(), true));
    assert_eq!(get(&mut c), ("m3".into(), false));
    // A multiple requeue of all three outstanding keeps their order too.
    c.settle(1, 5, true, Settle::Requeue)
        .expect("requeue up to 5");
    assert_eq!(c.leases(1), 0);
    assert_eq!(
        take_all(&mut c, "q"),
        marked(&[("m1", true), ("m2", true), ("m3", true), ("m4", false)])
    );
}

#[test]
fn unknown_delivery_tag_is_an_error() {
    let e = engine();
    let mut c = client(&e);
    declare(&mut c, "q", false);
    assert!(matches!(
        c.settle(1, 7, false, Settle::Ack),
        Err(ClientError::UnknownTag(7))
    ));
    c.subscribe("q", opts(1, "t", 0)).expect("subscribe");
    publish(&mut c, "q", "m", false);
    let mut tag = 0;
    write_all(&mut c, &mut tag, e.clock().now());
    assert!(matches!(
        c.settle(1, 2, true, Settle::Ack),
        Err(ClientError::UnknownTag(2))
    ));
    c.settle(1, 1, false, Settle::Ack).expect("ack");
    assert!(
        matches!(
            c.settle(1, 1, false, Settle::Ack),
            Err(ClientError::UnknownTag(1))
        ),
        "a tag settles once"
    );
    // multiple with tag 0 means "all": never unknown.
    c.settle(1, 0, true, Settle::Ack)
        .expect("ack all of nothing");
}

#[test]
fn a_consumer_tag_is_unique_in_its_scope() {
    let e = engine();
    let mut c = client(&e);
    declare(&mut c, "q", false);
    c.subscribe("q", opts(1, "t", 0)).expect("subscribe");
    assert!(matches!(
        c.subscribe("q", opts(1, "t", 0)),
        Err(ClientError::TagInUse(_))
    ));
    c.subscribe("q", opts(2, "t", 0)).expect("another scope");
    assert!(c.unsubscribe(1, b"t"));
    assert!(!c.unsubscribe(1, b"t"));
    c.subscribe("q", opts(1, "t", 0)).expect("free again");
}

#[test]
fn get_takes_the_head_with_or_without_a_lease() {
    let e = engine();
    let mut c = client(&e);
    declare(&mut c, "q", false);
    for b in ["a", "b"] {
        publish(&mut c, "q", b, false);
    }
    let got = c.get("q", GetAck::Auto).expect("get").expect("a message");
    assert_eq!(&got.message.body[..], b"a");
    assert_eq!(got.remaining, 1);
    let now = e.clock().now();
    let got = c
        .get(
            "q",
            GetAck::Lease {
                scope: 3,
                tag: 1,
                now,
            },
        )
        .expect("get")
        .expect("a message");
    assert_eq!(&got.message.body[..], b"b");
    assert_eq!(got.remaining, 0);
    assert_eq!(c.leases(3), 1);
    assert!(c.get("q", GetAck::Auto).expect("get").is_none());
    // Requeued, it is there again, redelivered.
    c.settle(3, 1, false, Settle::Requeue).expect("requeue");
    let got = c.get("q", GetAck::Auto).expect("get").expect("back");
    assert_eq!(&got.message.body[..], b"b");
    assert!(got.redelivered);
    assert!(matches!(
        c.get("missing", GetAck::Auto),
        Err(ClientError::Engine(weir_engine::EngineError::NotFound(_)))
    ));
}

#[test]
fn leases_expire_by_the_time_given() {
    let e = engine();
    let mut c = client(&e);
    declare(&mut c, "q", false);
    c.subscribe("q", opts(1, "t", 0)).expect("subscribe");
    c.subscribe("q", opts(2, "u", 0)).expect("subscribe");
    publish(&mut c, "q", "a", false);
    publish(&mut c, "q", "b", false);
    let t0 = e.clock().now();
    let mut tag = 0;
    // Round robin: one lease per scope, both written at t0.
    assert_eq!(write_all(&mut c, &mut tag, t0).len(), 2);
    let timeout = Duration::from_secs(10);
    assert!(c
        .expired_scopes(t0 + Duration::from_secs(5), timeout)
        .is_empty());
    let mut expired = c.expired_scopes(t0 + Duration::from_secs(11), timeout);
    expired.sort();
    assert_eq!(expired, vec![1, 2]);
    // Settled leases do not expire.
    c.settle(1, 0, true, Settle::Ack).expect("ack");
    assert_eq!(
        c.expired_scopes(t0 + Duration::from_secs(11), timeout),
        vec![2]
    );
}

#[test]
fn expiry_counts_from_the_oldest_unsettled_lease() {
    let e = engine();
    let mut c = client(&e);
    declare(&mut c, "q", false);
    c.subscribe("q", opts(1, "t", 0)).expect("subscribe");
    let t0 = e.clock().now();
    let timeout = Duration::from_secs(10);
    let mut tag = 0;
    // A consumer that acks each delivery promptly, for longer than the
    // timeout in all: its scope never expires.
    for i in 0..4u64 {
        let at = t0 + Duration::from_secs(4 * i);
        publish(&mut c, "q", "m", false);
        assert_eq!(write_all(&mut c, &mut tag, at).len(), 1);
        assert!(c
            .expired_scopes(at + Duration::from_secs(3), timeout)
            .is_empty());
        c.settle(1, tag, false, Settle::Ack).expect("ack");
        c.commit();
    }
    let late = t0 + Duration::from_secs(16);
    publish(&mut c, "q", "slow", false);
    assert_eq!(write_all(&mut c, &mut tag, late).len(), 1);
    // 20 s after the first delivery, but its oldest lease is 4 s old.
    assert!(c
        .expired_scopes(t0 + Duration::from_secs(20), timeout)
        .is_empty());
    assert_eq!(
        c.expired_scopes(late + Duration::from_secs(11), timeout),
        vec![1]
    );
}

#[test]
fn requeue_all_redelivers_every_lease_in_order() {
    let e = engine();
    let mut c = client(&e);
    declare(&mut c, "q", false);
    c.subscribe("q", opts(1, "t", 0)).expect("subscribe");
    for b in ["a", "b", "c"] {
        publish(&mut c, "q", b, false);
    }
    let mut tag = 0;
    let now = e.clock().now();
    let first = write_all(&mut c, &mut tag, now);
    assert_eq!(bodies(&first), vec![b"a", b"b", b"c"]);
    assert!(first.iter().all(|(_, _, r)| !r));
    // basic.recover(requeue): tag 0 with multiple settles every lease.
    c.settle(1, 0, true, Settle::Requeue).expect("requeue all");
    c.commit();
    let again = write_all(&mut c, &mut tag, now);
    assert_eq!(bodies(&again), vec![b"a", b"b", b"c"]);
    assert!(again.iter().all(|(_, _, r)| *r), "marked redelivered");
    // Acked for good: closing the scope returns nothing.
    c.settle(1, tag, true, Settle::Ack).expect("ack all");
    c.release_scope(1);
    c.commit();
    assert_eq!(c.queue("q").expect("queue").message_count(), 0);
}

#[test]
fn prefetch_bytes_bounds_deliveries_but_never_the_first() {
    let e = engine();
    let mut c = client(&e);
    declare(&mut c, "q", false);
    let mut o = opts(1, "t", 0);
    o.prefetch_bytes = 1000;
    c.subscribe("q", o).expect("subscribe");
    let body = |i: usize| format!("{i}{}", "x".repeat(599));
    for i in 0..5 {
        publish(&mut c, "q", &body(i), false);
    }
    let mut tag = 0;
    let now = e.clock().now();
    // A second 600-byte message would make 1200 bytes unacked.
    let got = write_all(&mut c, &mut tag, now);
    assert_eq!(bodies(&got), vec![body(0).as_bytes()]);
    assert_eq!(c.queue("q").expect("queue").message_count(), 4);
    c.settle(1, tag, false, Settle::Ack).expect("ack");
    c.commit();
    let got = write_all(&mut c, &mut tag, now);
    assert_eq!(bodies(&got), vec![body(1).as_bytes()]);

    // A message alone over the limit still goes out, one at a time.
    declare(&mut c, "big", false);
    let mut o = opts(2, "u", 0);
    o.prefetch_bytes = 100;
    c.subscribe("big", o).expect("subscribe");
    let big = |i: usize| format!("{i}{}", "y".repeat(1999));
    for i in 0..2 {
        publish(&mut c, "big", &big(i), false);
    }
    let got = write_all(&mut c, &mut tag, now);
    assert_eq!(bodies(&got), vec![big(0).as_bytes()]);
    c.settle(2, tag, false, Settle::Ack).expect("ack");
    c.commit();
    let got = write_all(&mut c, &mut tag, now);
    assert_eq!(bodies(&got), vec![big(1).as_bytes()]);
}

#[test]
fn the_scope_window_is_shared_by_its_consumers_and_can_be_raised() {
    let e = engine();
    let mut c = client(&e);
    for q in ["ga", "gb"] {
        declare(&mut c, q, false);
        for b in ["0", "1", "2"] {
            publish(&mut c, q, b, false);
        }
    }
    let ready = |c: &Client| {
        c.queue("ga").expect("ga").message_count() + c.queue("gb").expect("gb").message_count()
    };
    // basic.qos(global): two unacked in all, whichever consumer has them.
    c.set_scope_window(1, 2, 0);
    c.subscribe("ga", opts(1, "a", 0)).expect("subscribe");
    c.subscribe("gb", opts(1, "b", 0)).expect("subscribe");
    let mut tag = 0;
    let now = e.clock().now();
    assert_eq!(write_all(&mut c, &mut tag, now).len(), 2);
    assert_eq!(ready(&c), 4);
    // Raised, it lets two more out without an ack.
    c.set_scope_window(1, 4, 0);
    c.commit();
    assert_eq!(write_all(&mut c, &mut tag, now).len(), 2);
    assert_eq!(ready(&c), 2);
    assert!(write_all(&mut c, &mut tag, now).is_empty());
    // Acking everything lets the rest flow.
    c.settle(1, tag, true, Settle::Ack).expect("ack all");
    c.commit();
    assert_eq!(write_all(&mut c, &mut tag, now).len(), 2);
    assert_eq!(ready(&c), 0);
}

#[test]
fn flow_off_holds_deliveries_in_the_queue_until_flow_on() {
    let e = engine();
    let mut c = client(&e);
    declare(&mut c, "q", false);
    c.subscribe("q", opts(1, "t", 0)).expect("subscribe");
    c.set_flow(1, false);
    for b in ["a", "b", "c"] {
        publish(&mut c, "q", b, false);
    }
    let mut tag = 0;
    let now = e.clock().now();
    assert!(write_all(&mut c, &mut tag, now).is_empty());
    assert_eq!(c.queue("q").expect("queue").message_count(), 3);
    c.set_flow(1, true);
    c.commit();
    let got = write_all(&mut c, &mut tag, now);
    assert_eq!(bodies(&got), vec![b"a", b"b", b"c"]);
    assert_eq!(c.queue("q").expect("queue").message_count(), 0);
}

#[test]
fn purge_counts_ready_messages_and_delete_counts_what_it_drops() {
    let e = engine();
    let mut c = client(&e);
    declare(&mut c, "q", false);
    for b in ["leased", "1", "2", "3", "4", "5", "6", "7"] {
        publish(&mut c, "q", b, false);
    }
    let now = e.clock().now();
    c.get(
        "q",
        GetAck::Lease {
            scope: 1,
            tag: 1,
            now,
        },
    )
    .expect("get")
    .expect("a message");
    // Purge drops the ready messages only; the lease stays.
    assert_eq!(c.purge_queue("q").expect("purge"), 7);
    assert_eq!(c.queue("q").expect("queue").message_count(), 0);
    assert_eq!(c.leases(1), 1);
    c.settle(1, 1, false, Settle::Ack).expect("ack");
    c.commit();
    for b in ["a", "b", "c"] {
        publish(&mut c, "q", b, false);
    }
    let (count, _) = c.delete_queue("q", false, false).expect("delete");
    assert_eq!(count, 3);
    assert!(matches!(
        c.queue("q"),
        Err(weir_engine::EngineError::NotFound(_))
    ));
}

#[test]
fn no_ack_deliveries_are_settled_when_written() {
    let e = engine();
    let mut c = client(&e);
    declare(&mut c, "q", false);
    let mut o = opts(1, "t", 0);
    o.no_ack = true;
    c.subscribe("q", o).expect("subscribe");
    publish(&mut c, "q", "a", false);
    let mut tag = 0;
    assert_eq!(write_all(&mut c, &mut tag, e.clock().now()).len(), 1);
    assert_eq!(c.leases(1), 0);
    assert_eq!(c.queue("q").expect("queue").depth().leased, 0);
}

#[test]
fn deleting_a_queue_notifies_its_consumers_once() {
    let e = engine();
    let mut c = client(&e);
    declare(&mut c, "q", false);
    let consumer = c.subscribe("q", opts(1, "t", 0)).expect("subscribe");
    c.delete_queue("q", false, false).expect("delete");
    let mut notices = Vec::new();
    c.drain(&mut notices);
    assert_eq!(notices.len(), 1);
    let Notice::ConsumerCancelled { consumer: n } = &notices[0];
    assert!(Arc::ptr_eq(n, &consumer));
    assert!(consumer.is_cancelled());
    assert!(!c.has_subscription(1, b"t"));
}

#[test]
fn unsent_deliveries_go_back_unmarked() {
    let e = engine();
    let mut c = client(&e);
    declare(&mut c, "q", false);
    c.subscribe("q", opts(1, "t", 1)).expect("subscribe");
    publish(&mut c, "q", "a", false);
    c.drain(&mut Vec::new());
    let d: Delivery = c.next_delivery().expect("delivery");
    // The session could not write it (say its channel is closing).
    c.unsend(d);
    c.finish_deliveries();
    c.commit();
    let mut tag = 0;
    let got = write_all(&mut c, &mut tag, e.clock().now());
    assert_eq!(got, vec![(1, Bytes::from_static(b"a"), false)]);
}

#[test]
fn acks_of_persistent_messages_reach_the_store() {
    let store = MemStore::new();
    {
        let e = Engine::open(store.clone(), ManualClock::new()).expect("engine");
        let mut c = client(&e);
        declare(&mut c, "q", true);
        c.subscribe("q", opts(1, "t", 0)).expect("subscribe");
        for b in ["acked", "kept"] {
            assert_eq!(
                publish(&mut c, "q", b, true),
                Published::Routed {
                    needs_barrier: true,
                    refused: false
                }
            );
        }
        let mut tag = 0;
        assert_eq!(write_all(&mut c, &mut tag, e.clock().now()).len(), 2);
        c.settle(1, 1, false, Settle::Ack).expect("ack");
        c.commit();
        drop(c);
        store.close().expect("close");
    }
    // A restart: the same data, recovered per partition.
    let e = Engine::open(store.reopen(), ManualClock::new()).expect("engine");
    let mut c = client(&e);
    // The acked one is gone; the unacked one came back, marked redelivered.
    assert_eq!(c.queue("q").expect("queue").message_count(), 1);
    let got = c.get("q", GetAck::Auto).expect("get").expect("message");
    assert_eq!(&got.message.body[..], b"kept");
    assert!(got.redelivered);
}

/// Two clients racing for an exclusive subscription to the same fresh
/// queue: exactly one wins, every time. (Checking for an exclusive
/// consumer and attaching under separate locks lets both win.)
#[test]
fn exactly_one_exclusive_subscriber_wins_a_race() {
    const ROUNDS: usize = 4000;
    let e = engine();
    let mut setup = client(&e);
    let names: Vec<String> = (0..ROUNDS).map(|i| format!("race-{i}")).collect();
    for n in &names {
        declare(&mut setup, n, false);
    }
    let names = Arc::new(names);
    let barrier = Arc::new(Barrier::new(2));
    let threads: Vec<_> = (0..2)
        .map(|_| {
            let (e, names, barrier) = (e.clone(), names.clone(), barrier.clone());
            std::thread::spawn(move || {
                let mut c = client(&e);
                let mut won = Vec::with_capacity(ROUNDS);
                for n in names.iter() {
                    let mut o = opts(1, "x", 0);
                    o.exclusive = true;
                    o.tag = Bytes::from(n.clone());
                    barrier.wait();
                    won.push(match c.subscribe(n, o) {
                        Ok(_) => true,
                        Err(ClientError::Engine(weir_engine::EngineError::AccessRefused(_))) => {
                            false
                        }
                        Err(other) => panic!("unexpected {other}"),
                    });
                }
                // Both done before either closes (closing detaches).
                barrier.wait();
                won
            })
        })
        .collect();
    let won: Vec<Vec<bool>> = threads
        .into_iter()
        .map(|t| t.join().expect("thread"))
        .collect();
    for i in 0..ROUNDS {
        assert!(
            won[0][i] ^ won[1][i],
            "round {i}: exactly one exclusive subscriber must win ({} and {})",
            won[0][i],
            won[1][i]
        );
        let q = setup.queue(&names[i]).expect("queue");
        assert_eq!(q.consumer_count(), 0, "both clients closed");
    }
}
