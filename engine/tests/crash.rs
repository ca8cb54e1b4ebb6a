//! Crash semantics in process: the engine over `MemStore::crash()` (a
//! power cut: only what completed tickets covered survives) on a
//! `ManualClock`. What a client was told is durable survives a crash as it
//! survives a clean restart (`MemStore::reopen`): delivery attempt counts,
//! TTL deadlines, delayed messages and delayed retries, idempotency
//! receipts, MQTT QoS 2 packet ids. What was not yet durable is lost, and
//! each test shows what that means (an attempt not counted, a receipt gone
//! so the publisher's retry gets in once). The black-box kill -9 tests
//! (`tests/tests/delivery_semantics.rs`, `idempotency.rs`, `mqtt.rs`) show
//! the same through the real process and the log store.

use bytes::Bytes;
use serde_json::{json, Value as Json};
use std::sync::Arc;
use std::time::Duration;
use weir_backend::testing::MemStore;
use weir_engine::client::GetAck;
use weir_engine::exchange::HeaderLookup;
use weir_engine::lease::Settle;
use weir_engine::message::Message;
use weir_engine::properties::{HeaderFormat, Properties, Value};
use weir_engine::tenant::{QueueDeclare, RouteInput};
use weir_engine::{Client, Engine, ManualClock, DEFAULT_TENANT};

/// How the broker goes down: a clean restart or a crash.
#[derive(Debug, Clone, Copy)]
enum Down {
    Restart,
    Crash,
}

impl Down {
    /// The store the next engine opens.
    fn store_after(self, store: &MemStore) -> Arc<MemStore> {
        match self {
            Down::Restart => store.reopen(),
            Down::Crash => store.crash(),
        }
    }
}

const BOTH: [Down; 2] = [Down::Restart, Down::Crash];

fn open(store: &Arc<MemStore>, clock: &Arc<ManualClock>) -> (Arc<Engine>, Client) {
    let e = Engine::open(store.clone(), clock.clone()).expect("engine");
    let c = Client::open(&e, DEFAULT_TENANT, "guest").expect("client");
    (e, c)
}

fn declare(c: &mut Client, name: &str, args: Json) {
    let (_, wait) = c
        .declare_queue(QueueDeclare {
            name: name.into(),
            passive: false,
            durable: true,
            exclusive: false,
            auto_delete: false,
            arguments: args,
            connection: c.id(),
        })
        .expect("declare");
    if let Some(w) = wait {
        w.blocking_recv().expect("store answered").expect("durable");
    }
}

/// Headers of a publish: an optional `x-delay` and idempotency key.
#[derive(Default)]
struct Headers {
    delay: Option<u64>,
    key: Option<&'static str>,
}

impl HeaderLookup for Headers {
    fn header(&self, name: &str) -> Option<Json> {
        match name {
            "x-delay" => self.delay.map(Json::from),
            "x-idempotency-key" => self.key.map(Json::from),
            _ => None,
        }
    }
}

/// Publishes `body` persistently to `queue` with `headers` and an optional
/// own TTL.
fn publish_with(c: &mut Client, queue: &str, body: &str, headers: Headers, ttl_ms: Option<u64>) {
    let route = RouteInput {
        exchange: "",
        routing_key: queue,
        headers: &headers,
    };
    let mut props = Properties {
        ttl_ms,
        ..Properties::default()
    };
    if let Some(k) = headers.key {
        let mut h = weir_engine::properties::Table::new();
        h.push("x-idempotency-key", Value::String(k.into()));
        props.headers = Some(h);
    }
    c.publish(&route, |id| Message {
        id,
        exchange: Bytes::new(),
        routing_key: Bytes::copy_from_slice(queue.as_bytes()),
        properties: props.to_bytes().expect("encodable"),
        body: Bytes::copy_from_slice(body.as_bytes()),
        header_format: HeaderFormat::WEIR,
        persistent: true,
        priority: 0,
        ttl_ms,
    })
    .expect("publish");
    c.commit();
}

fn publish(c: &mut Client, queue: &str, body: &str) {
    publish_with(c, queue, body, Headers::default(), None);
}

/// Waits for the client's durability barrier: everything it did so far is
/// durable (what a publisher's confirm or an ack's answer waits for).
fn confirm(c: &mut Client) {
    let (tx, rx) = std::sync::mpsc::channel();
    c.durability_barrier(Box::new(move |r| {
        let _ = tx.send(r);
    }))
    .expect("barrier");
    rx.recv_timeout(Duration::from_secs(20))
        .expect("waiter called")
        .expect("durable");
}

fn bodies(c: &mut Client, queue: &str) -> Vec<String> {
    std::iter::from_fn(|| {
        c.get(queue, GetAck::Auto)
            .expect("get")
            .map(|g| String::from_utf8_lossy(&g.message.body).into_owned())
    })
    .collect()
}

/// Takes the head of `queue` as a lease under `tag` (scope 1): its body
/// and `x-delivery-count`, if it has one.
fn lease(e: &Engine, c: &mut Client, queue: &str, tag: u64) -> Option<(String, Option<Value>)> {
    let now = c.clock().now();
    let got = c
        .get(queue, GetAck::Lease { scope: 1, tag, now })
        .expect("get")?;
    let count = e
        .codecs()
        .decode(got.message.header_format, &got.message.properties)
        .expect("decodable")
        .headers
        .and_then(|h| h.get("x-delivery-count").cloned());
    Some((
        String::from_utf8_lossy(&got.message.body).into_owned(),
        count,
    ))
}

/// Leases the head of `queue` and nacks it back (requeue).
fn deliver_and_nack(e: &Engine, c: &mut Client, queue: &str, tag: u64) -> Option<Value> {
    let (_, count) = lease(e, c, queue, tag).expect("a delivery");
    c.settle(1, tag, false, Settle::Requeue).expect("nack");
    c.commit();
    count
}

#[test]
fn delivery_attempts_survive_a_crash_as_far_as_they_were_durable() {
    for down in BOTH {
        let (store, clock) = (MemStore::new(), ManualClock::new());
        {
            let (e, mut c) = open(&store, &clock);
            declare(&mut c, "dlq", json!({}));
            declare(
                &mut c,
                "work",
                json!({"x-delivery-limit": 3, "x-dead-letter-exchange": "",
                       "x-dead-letter-routing-key": "dlq"}),
            );
            publish(&mut c, "work", "poison");
            for tag in 1..=2 {
                deliver_and_nack(&e, &mut c, "work", tag);
            }
            confirm(&mut c);
            // A third delivery, nacked; its record is not durable yet
            // when the broker goes down.
            store.hold_durability(true);
            deliver_and_nack(&e, &mut c, "work", 3);
            assert!(store.pending_appends() > 0, "the third attempt waits");
        }
        let (e, mut c) = open(&down.store_after(&store), &clock);
        // A restart keeps all three attempts; a crash the two that were
        // durable. Either way the count goes on from there, never afresh.
        let before = match down {
            Down::Restart => 3,
            Down::Crash => 2,
        };
        let mut tag = 10;
        for n in before..=3 {
            tag += 1;
            let count = deliver_and_nack(&e, &mut c, "work", tag);
            assert_eq!(count, Some(Value::I64(n)), "{down:?}: delivery {}", n + 1);
        }
        assert!(
            lease(&e, &mut c, "work", 99).is_none(),
            "{down:?}: limit reached"
        );
        e.run_timers();
        assert_eq!(bodies(&mut c, "dlq"), vec!["poison"], "{down:?}");
    }
}

#[test]
fn ttl_deadlines_survive_a_crash_not_counted_afresh() {
    for down in BOTH {
        let (store, clock) = (MemStore::new(), ManualClock::new());
        {
            let (_e, mut c) = open(&store, &clock);
            declare(&mut c, "dlq", json!({}));
            let dlx = json!({"x-dead-letter-exchange": "", "x-dead-letter-routing-key": "dlq"});
            let mut ttl = dlx.clone();
            ttl["x-message-ttl"] = json!(1_500);
            declare(&mut c, "ttl", ttl);
            declare(&mut c, "own", dlx);
            publish(&mut c, "ttl", "queue-ttl");
            publish_with(&mut c, "own", "own-ttl", Headers::default(), Some(1_500));
            confirm(&mut c);
        }
        clock.advance_ms(1_000);
        let store = down.store_after(&store);
        {
            let (e, c) = open(&store, &clock);
            clock.advance_ms(499);
            e.run_timers();
            for q in ["ttl", "own"] {
                assert_eq!(
                    c.queue(q).expect(q).message_count(),
                    1,
                    "{down:?} {q}: alive a millisecond before its deadline"
                );
            }
            clock.advance_ms(1);
            e.run_timers();
            for q in ["ttl", "own"] {
                assert_eq!(c.queue(q).expect(q).message_count(), 0, "{down:?} {q}");
            }
        }
        // The expiries were dead-lettered before the next stop: kept.
        let (_e, mut c) = open(&down.store_after(&store), &clock);
        let mut dead = bodies(&mut c, "dlq");
        dead.sort();
        assert_eq!(dead, vec!["own-ttl", "queue-ttl"], "{down:?}");
    }
}

#[test]
fn delayed_messages_and_retries_survive_a_crash() {
    for down in BOTH {
        let (store, clock) = (MemStore::new(), ManualClock::new());
        {
            let (e, mut c) = open(&store, &clock);
            declare(&mut c, "later", json!({"x-delayed": true}));
            declare(
                &mut c,
                "retry",
                json!({"x-delayed-retry-type": "all", "x-delayed-retry-min": 60_000}),
            );
            let delay = Headers {
                delay: Some(60_000),
                ..Headers::default()
            };
            publish_with(&mut c, "later", "delayed", delay, None);
            publish(&mut c, "retry", "retried");
            deliver_and_nack(&e, &mut c, "retry", 1);
            confirm(&mut c);
        }
        // Down for 30 s: both still wait for what is left of their minute.
        clock.advance_ms(30_000);
        let (e, mut c) = open(&down.store_after(&store), &clock);
        e.run_timers();
        assert!(bodies(&mut c, "later").is_empty(), "{down:?}");
        assert!(lease(&e, &mut c, "retry", 2).is_none(), "{down:?}");
        clock.advance_ms(29_999);
        e.run_timers();
        assert!(bodies(&mut c, "later").is_empty(), "{down:?}: not early");
        assert!(
            lease(&e, &mut c, "retry", 2).is_none(),
            "{down:?}: not early"
        );
        clock.advance_ms(1);
        e.run_timers();
        assert_eq!(bodies(&mut c, "later"), vec!["delayed"], "{down:?}");
        let (body, _) = lease(&e, &mut c, "retry", 2).expect("the retry is due");
        assert_eq!(body, "retried", "{down:?}");
    }
}

#[test]
fn idempotency_receipts_survive_a_crash_and_a_lost_one_lets_the_retry_in_once() {
    for down in BOTH {
        let (store, clock) = (MemStore::new(), ManualClock::new());
        let keyed = |key| Headers {
            key: Some(key),
            ..Headers::default()
        };
        {
            let (_e, mut c) = open(&store, &clock);
            declare(&mut c, "q", json!({}));
            for k in ["k1", "k2", "k3"] {
                publish_with(&mut c, "q", k, keyed(k), None);
            }
            confirm(&mut c);
            // Published, never confirmed: down before it was durable.
            store.hold_durability(true);
            publish_with(&mut c, "q", "k4", keyed("k4"), None);
        }
        let (_e, mut c) = open(&down.store_after(&store), &clock);
        // A restart keeps the last publish and its receipt; a crash loses
        // both (its publisher was never told it was durable).
        let kept = match down {
            Down::Restart => 4,
            Down::Crash => 3,
        };
        let q = c.queue("q").expect("q");
        assert_eq!(
            (q.message_count(), q.dedup().len() as u64),
            (kept, kept),
            "{down:?}"
        );
        // The publisher retries everything it was not sure of (here: all).
        for k in ["k1", "k2", "k3", "k4"] {
            publish_with(&mut c, "q", k, keyed(k), None);
        }
        let mut got = bodies(&mut c, "q");
        got.sort();
        assert_eq!(got, vec!["k1", "k2", "k3", "k4"], "{down:?}: each once");
    }
}

#[test]
fn mqtt_qos2_packet_ids_survive_a_crash_as_far_as_they_were_durable() {
    // The MQTT session's keys (`gateway/src/mqtt/session`): an inbound
    // QoS 2 id awaiting PUBREL, an outbound one awaiting PUBCOMP.
    let (inbound, outbound, late) = (
        "mqtt\0dev\0in\u{0}7",
        "mqtt\0dev\0out\u{0}9",
        "mqtt\0dev\0in\u{0}8",
    );
    for down in BOTH {
        let (store, clock) = (MemStore::new(), ManualClock::new());
        {
            let (e, _c) = open(&store, &clock);
            let t = e.tenant(DEFAULT_TENANT).expect("tenant");
            let wait = t
                .update_session_state(&[(inbound, Some(&[][..])), (outbound, Some(&b"R"[..]))])
                .expect("update");
            wait.blocking_recv().expect("answered").expect("durable");
            // A PUBLISH received after that, its id not yet durable: its
            // PUBREC was never sent, so the client sends it again.
            store.hold_durability(true);
            let _unanswered = t
                .update_session_state(&[(late, Some(&[][..]))])
                .expect("update");
        }
        let (e, _c) = open(&down.store_after(&store), &clock);
        let t = e.tenant(DEFAULT_TENANT).expect("tenant");
        let mut want = vec![
            (inbound.to_string(), Vec::new()),
            (outbound.to_string(), b"R".to_vec()),
        ];
        if let Down::Restart = down {
            want.push((late.to_string(), Vec::new()));
        }
        want.sort();
        assert_eq!(t.session_state("mqtt\0dev\0"), want, "{down:?}");
    }
}
