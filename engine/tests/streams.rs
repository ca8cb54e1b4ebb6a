//! Stream queues in process (`x-queue-type: stream`): offsets, every
//! `x-stream-offset` form, credit-only acks, retention by truncation and
//! its refusal, and a restart. The engine runs on a [`ManualClock`] over
//! the in-memory store; a restart is `MemStore::reopen` (or `crash`).

use bytes::Bytes;
use serde_json::{json, Value as Json};
use std::sync::Arc;
use weir_backend::testing::MemStore;
use weir_backend::Store;
use weir_engine::client::{GetAck, SubscribeOptions};
use weir_engine::exchange::HeaderLookup;
use weir_engine::lease::Settle;
use weir_engine::message::Message;
use weir_engine::properties::{HeaderFormat, Properties, Value};
use weir_engine::stream::OffsetSpec;
use weir_engine::tenant::{QueueDeclare, RouteInput};
use weir_engine::{Client, ClientError, Engine, EngineError, DEFAULT_TENANT};
use weir_engine::{Clock, ManualClock};

const SCOPE: u32 = 1;

fn open(store: &Arc<MemStore>, clock: &Arc<ManualClock>) -> (Arc<Engine>, Client) {
    let e = Engine::open(store.clone(), clock.clone()).expect("engine");
    let c = Client::open(&e, DEFAULT_TENANT, "guest").expect("client");
    (e, c)
}

fn declare(c: &mut Client, name: &str, args: Json) -> Result<(), ClientError> {
    let (_, wait) = c.declare_queue(QueueDeclare {
        name: name.into(),
        passive: false,
        durable: true,
        exclusive: false,
        auto_delete: false,
        arguments: args,
        connection: c.id(),
    })?;
    if let Some(w) = wait {
        w.blocking_recv().expect("store answered").expect("durable");
    }
    Ok(())
}

fn stream(c: &mut Client, name: &str, mut args: Json) {
    args["x-queue-type"] = json!("stream");
    declare(c, name, args).expect("declare stream");
}

struct NoHeaders;
impl HeaderLookup for NoHeaders {
    fn header(&self, _: &str) -> Option<Json> {
        None
    }
}

/// Publishes `body` (transient: a stream keeps it anyway) to `queue`.
fn publish(c: &mut Client, queue: &str, body: &str) {
    let route = RouteInput {
        exchange: "",
        routing_key: queue,
        headers: &NoHeaders,
    };
    c.publish(&route, |id| Message {
        id,
        exchange: Bytes::new(),
        routing_key: Bytes::copy_from_slice(queue.as_bytes()),
        properties: Properties::default().to_bytes().expect("encodable"),
        body: Bytes::copy_from_slice(body.as_bytes()),
        header_format: HeaderFormat::WEIR,
        persistent: false,
        priority: 0,
        ttl_ms: None,
    })
    .expect("publish");
    c.commit();
}

fn opts(tag: &str, prefetch: u32) -> SubscribeOptions {
    SubscribeOptions {
        scope: SCOPE,
        tag: Bytes::copy_from_slice(tag.as_bytes()),
        prefetch_count: prefetch,
        ..SubscribeOptions::default()
    }
}

/// A consumer's view: what it got, and its next delivery tag.
struct Reader {
    tag: u64,
}

impl Reader {
    /// Writes every delivery the client has now, as a session would;
    /// returns (offset header, body) of each, checking the header against
    /// the entry's offset.
    fn take(&mut self, e: &Engine, c: &mut Client) -> Vec<(i64, String)> {
        c.drain(&mut Vec::new());
        let mut out = Vec::new();
        while let Some(d) = c.next_delivery() {
            let m = c.message_of(&d).expect("readable");
            let props = e
                .codecs()
                .decode(m.header_format, &m.properties)
                .expect("decodable");
            let offset = props
                .headers
                .as_ref()
                .and_then(|h| h.0.iter().find(|(k, _)| k == "x-stream-offset"))
                .map(|(_, v)| match v {
                    Value::I64(n) => *n,
                    other => panic!("x-stream-offset is a long, not {other:?}"),
                })
                .expect("every stream delivery carries x-stream-offset");
            assert_eq!(offset as u64, d.entry.seq);
            out.push((offset, String::from_utf8_lossy(&m.body).into_owned()));
            self.tag += 1;
            let now_ms = c.clock().now_ms();
            let now = c.clock().now();
            c.lease(SCOPE, self.tag, d, now, now_ms);
        }
        c.finish_deliveries();
        c.commit();
        out
    }
}

fn offsets(got: &[(i64, String)]) -> Vec<i64> {
    got.iter().map(|(o, _)| *o).collect()
}

#[test]
fn every_offset_form_starts_where_rabbitmq_starts() {
    let (store, clock) = (MemStore::new(), ManualClock::new());
    let t0 = clock.now_ms();
    let (e, mut c) = open(&store, &clock);
    stream(&mut c, "s", json!({}));
    for i in 0..5 {
        publish(&mut c, "s", &format!("early-{i}"));
    }
    clock.advance_ms(1_000_000);
    for i in 5..10 {
        publish(&mut c, "s", &format!("late-{i}"));
    }
    clock.advance_ms(500);
    let cases: Vec<(OffsetSpec, Vec<i64>)> = vec![
        (OffsetSpec::First, (0..10).collect()),
        (OffsetSpec::Last, vec![9]),
        (OffsetSpec::Next, vec![]),
        (OffsetSpec::Offset(7), vec![7, 8, 9]),
        (OffsetSpec::Offset(50), vec![]),
        (OffsetSpec::Timestamp(t0 + 500_000), (5..10).collect()),
        (OffsetSpec::Timestamp(t0 - 500_000), (0..10).collect()),
        (OffsetSpec::Ago(10_000), (5..10).collect()),
        (OffsetSpec::Ago(3_600_000), (0..10).collect()),
    ];
    for (i, (spec, want)) in cases.into_iter().enumerate() {
        let tag = format!("c{i}");
        c.subscribe_at("s", opts(&tag, 100), Some(spec))
            .expect("subscribe");
        let mut r = Reader {
            tag: 1000 * (i as u64 + 1),
        };
        // Tags increase within a scope across consumers.
        let got = r.take(&e, &mut c);
        assert_eq!(offsets(&got), want, "{spec:?}");
        c.unsubscribe(SCOPE, tag.as_bytes());
    }
    // `next` (and a consumer without x-stream-offset) sees what comes.
    c.subscribe("s", opts("n", 100)).expect("subscribe");
    let mut r = Reader { tag: 100_000 };
    assert!(r.take(&e, &mut c).is_empty());
    publish(&mut c, "s", "new");
    assert_eq!(r.take(&e, &mut c), vec![(10, "new".to_string())]);
}

#[test]
fn acks_only_return_credit_and_events_stay() {
    let (store, clock) = (MemStore::new(), ManualClock::new());
    let (e, mut c) = open(&store, &clock);
    stream(&mut c, "s", json!({}));
    for i in 0..10 {
        publish(&mut c, "s", &format!("m{i}"));
    }
    c.subscribe_at("s", opts("a", 3), Some(OffsetSpec::First))
        .expect("subscribe");
    let mut r = Reader { tag: 0 };
    assert_eq!(offsets(&r.take(&e, &mut c)), vec![0, 1, 2]);
    assert!(r.take(&e, &mut c).is_empty(), "prefetch 3 holds the rest");
    c.settle(SCOPE, 2, true, Settle::Ack).expect("ack");
    c.commit();
    assert_eq!(offsets(&r.take(&e, &mut c)), vec![3, 4]);
    // A nack with requeue does not bring anything back: it is credit too.
    c.settle(SCOPE, 3, false, Settle::Requeue).expect("nack");
    c.commit();
    assert_eq!(offsets(&r.take(&e, &mut c)), vec![5]);
    // Every event is still stored: a second consumer reads them all.
    c.subscribe_at("s", opts("b", 100), Some(OffsetSpec::First))
        .expect("subscribe");
    let got = r.take(&e, &mut c);
    assert_eq!(offsets(&got), (0..10).collect::<Vec<_>>());
    let pid = c.queue("s").expect("queue").partitions[0].id;
    assert_eq!(store.recover_partition(pid).expect("recover").len(), 10);
}

#[test]
fn rabbitmq_refusals_auto_ack_no_prefetch_get_and_arguments() {
    let (store, clock) = (MemStore::new(), ManualClock::new());
    let (_e, mut c) = open(&store, &clock);
    stream(
        &mut c,
        "s",
        json!({"x-max-age": "7D", "x-max-length-bytes": 1_000_000, "x-stream-max-segment-size-bytes": 500_000}),
    );
    let mut no_ack = opts("x", 10);
    no_ack.no_ack = true;
    match c.subscribe("s", no_ack) {
        Err(ClientError::Engine(EngineError::NotImplemented(t))) => {
            assert!(t.contains("automatic acknowledgement"), "{t}")
        }
        other => panic!("auto-ack refused with 540, got {:?}", other.map(|_| ())),
    }
    match c.subscribe("s", opts("y", 0)) {
        Err(ClientError::Engine(EngineError::PreconditionFailed(t))) => assert_eq!(
            t,
            "consumer prefetch count is not set for 'queue 's' in vhost '/''"
        ),
        other => panic!("no prefetch refused with 406, got {:?}", other.map(|_| ())),
    }
    assert!(matches!(
        c.get("s", GetAck::Auto),
        Err(ClientError::Engine(EngineError::NotImplemented(_)))
    ));
    for (args, arg) in [
        (
            json!({"x-queue-type": "stream", "x-max-length": 5}),
            "x-max-length",
        ),
        (
            json!({"x-queue-type": "stream", "x-message-ttl": 5}),
            "x-message-ttl",
        ),
    ] {
        let err = declare(&mut c, "bad", args).expect_err("refused");
        assert!(err.to_string().contains(arg), "{err}");
    }
    let err = declare(
        &mut c,
        "bad",
        json!({"x-queue-type": "stream", "x-max-age": "7 days"}),
    )
    .expect_err("refused");
    assert!(err.to_string().contains("x-max-age"), "{err}");
}

#[test]
fn retention_by_size_truncates_whole_chunks_and_refuses_lost_offsets() {
    let (store, clock) = (MemStore::new(), ManualClock::new());
    let (e, mut c) = open(&store, &clock);
    // 100-byte events, 2,000 bytes kept: chunks of 500 bytes (5 events).
    stream(&mut c, "s", json!({"x-max-length-bytes": 2_000}));
    let body = "x".repeat(100);
    for _ in 0..100 {
        publish(&mut c, "s", &body);
    }
    let q = c.queue("s").expect("queue");
    let st = q.partitions[0].stream.as_ref().expect("a stream").stats();
    assert_eq!(st.head, 100);
    assert!(
        st.first > 0 && st.first % 5 == 0,
        "whole chunks dropped: {st:?}"
    );
    assert!(st.bytes <= 2_000 + 500, "{st:?}");
    // The store dropped them too (Op::Truncate), nothing was copied.
    let kept = store
        .recover_partition(q.partitions[0].id)
        .expect("recover");
    assert_eq!(kept.len() as u64, 100 - st.first);
    // An offset before the first kept is refused, never skipped.
    match c.subscribe_at("s", opts("old", 10), Some(OffsetSpec::Offset(3))) {
        Err(ClientError::Engine(EngineError::PreconditionFailed(t))) => {
            assert!(t.starts_with("offset out of range"), "{t}");
            assert!(
                t.contains(&format!("oldest available offset is {}", st.first)),
                "{t}"
            );
            assert!(
                t.contains(&format!("{} events were lost to retention", st.first - 3)),
                "{t}"
            );
        }
        other => panic!("refused, got {:?}", other.map(|_| ())),
    }
    // `first` starts at what is kept.
    c.subscribe_at("s", opts("f", 1000), Some(OffsetSpec::First))
        .expect("subscribe");
    let got = Reader { tag: 0 }.take(&e, &mut c);
    assert_eq!(offsets(&got), (st.first as i64..100).collect::<Vec<_>>());
}

#[test]
fn retention_by_age_and_a_reader_overtaken_is_cancelled_not_moved() {
    let (store, clock) = (MemStore::new(), ManualClock::new());
    let (e, mut c) = open(&store, &clock);
    // 40 s kept: chunks span at most 10 s.
    stream(&mut c, "s", json!({"x-max-age": "40s"}));
    // A slow reader at offset 0 with prefetch 1.
    publish(&mut c, "s", "old-0");
    c.subscribe_at("s", opts("slow", 1), Some(OffsetSpec::First))
        .expect("subscribe");
    let mut r = Reader { tag: 0 };
    assert_eq!(offsets(&r.take(&e, &mut c)), vec![0]);
    for i in 1..300 {
        clock.advance_ms(1_000);
        publish(&mut c, "s", &format!("old-{i}"));
    }
    clock.advance_ms(400_000);
    publish(&mut c, "s", "new");
    let st = c.queue("s").expect("q").partitions[0]
        .stream
        .as_ref()
        .expect("stream")
        .stats();
    assert!(st.first >= 290, "events older than 40 s dropped: {st:?}");
    // The reader goes on with what it had read ahead, in order, then finds
    // its next offset gone: it is cancelled and told, never moved on.
    let mut seen = vec![0];
    let mut notices = Vec::new();
    loop {
        c.settle(SCOPE, r.tag, false, Settle::Ack).expect("ack");
        c.commit();
        c.drain(&mut notices);
        if !notices.is_empty() {
            break;
        }
        let got = r.take(&e, &mut c);
        assert_eq!(got.len(), 1, "one at a time (prefetch 1)");
        seen.push(got[0].0);
    }
    assert_eq!(seen, (0..seen.len() as i64).collect::<Vec<_>>(), "no gap");
    assert!((seen.len() as u64) < st.first, "it was overtaken");
    assert_eq!(notices.len(), 1, "basic.cancel sent");
    assert!(c.next_delivery().is_none(), "nothing skipped to");
    assert!(!c.has_subscription(SCOPE, b"slow"));
    // Its next consume from there is refused, with the count lost.
    let next = seen.len() as u64;
    let err = c
        .subscribe_at("s", opts("again", 10), Some(OffsetSpec::Offset(next)))
        .map(|_| ())
        .expect_err("refused");
    assert!(
        err.to_string().contains(&format!(
            "{} events were lost to retention",
            st.first - next
        )),
        "{err}"
    );
    // A time older than retention is refused too.
    let err = c
        .subscribe_at("s", opts("t", 10), Some(OffsetSpec::Ago(3_600_000)))
        .map(|_| ())
        .expect_err("refused");
    assert!(err.to_string().contains("offset out of range"), "{err}");
}

#[test]
fn offsets_and_retention_survive_a_restart_and_a_crash() {
    let (store, clock) = (MemStore::new(), ManualClock::new());
    let mut first = {
        let (_e, mut c) = open(&store, &clock);
        stream(&mut c, "s", json!({"x-max-length-bytes": 2_000}));
        let body = "y".repeat(100);
        for _ in 0..60 {
            publish(&mut c, "s", &body);
        }
        c.queue("s").expect("q").partitions[0]
            .stream
            .as_ref()
            .expect("stream")
            .stats()
            .first
    };
    assert!(first > 0);
    let mut store = store.reopen();
    for (round, head) in [(0, 60), (1, 61)] {
        let (e, mut c) = open(&store, &clock);
        let st = c.queue("s").expect("q").partitions[0]
            .stream
            .as_ref()
            .expect("stream")
            .stats();
        assert_eq!(
            (st.first, st.head),
            (first, head),
            "offsets kept (round {round})"
        );
        // Read back from the store (the hot tail is gone with the process).
        c.subscribe_at("s", opts("r", 1000), Some(OffsetSpec::Offset(first + 2)))
            .expect("subscribe");
        let got = Reader { tag: 0 }.take(&e, &mut c);
        assert_eq!(
            offsets(&got),
            ((first + 2) as i64..head as i64).collect::<Vec<_>>()
        );
        if round == 0 {
            publish(&mut c, "s", "after");
            let got = Reader { tag: 1000 }.take(&e, &mut c);
            assert_eq!(got, vec![(60, "after".to_string())]);
            // That append may have dropped another chunk.
            first = c.queue("s").expect("q").partitions[0]
                .stream
                .as_ref()
                .expect("stream")
                .stats()
                .first;
            drop(c);
            drop(e);
            store = store.crash();
        }
    }
}
