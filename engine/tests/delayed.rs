//! Delayed delivery (`x-delay` on `x-delayed` queues and through
//! `x-delayed-message` exchanges) and delayed retries
//! (`x-delayed-retry-type`/`-min`/`-max`), in process. Time is an input:
//! the engine runs on a [`ManualClock`] the tests advance before calling
//! [`Engine::run_timers`] (no sleeping); the store is the in-memory one,
//! reopened to show what a restart keeps.

use bytes::Bytes;
use serde_json::{json, Value as Json};
use std::sync::Arc;
use weir_backend::testing::MemStore;
use weir_engine::client::GetAck;
use weir_engine::exchange::{ExchangeDef, ExchangeKind, HeaderLookup};
use weir_engine::lease::Settle;
use weir_engine::message::Message;
use weir_engine::meta::DestinationKind;
use weir_engine::properties::{HeaderFormat, Properties};
use weir_engine::tenant::{QueueDeclare, RouteInput};
use weir_engine::ManualClock;
use weir_engine::{Client, Engine, DEFAULT_TENANT};

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

/// Headers with an optional `x-delay`.
struct Delay(Option<u64>);
impl HeaderLookup for Delay {
    fn header(&self, name: &str) -> Option<Json> {
        (name == "x-delay")
            .then(|| self.0.map(Json::from))
            .flatten()
    }
}

/// Publishes `body` persistently through `exchange` with routing key `key`.
fn publish(c: &mut Client, exchange: &str, key: &str, body: &str, delay: Option<u64>) {
    let route = RouteInput {
        exchange,
        routing_key: key,
        headers: &Delay(delay),
    };
    c.publish(&route, |id| Message {
        id,
        exchange: Bytes::copy_from_slice(exchange.as_bytes()),
        routing_key: Bytes::copy_from_slice(key.as_bytes()),
        properties: Properties::default().to_bytes().expect("encodable"),
        body: Bytes::copy_from_slice(body.as_bytes()),
        header_format: HeaderFormat::WEIR,
        persistent: true,
        priority: 0,
        ttl_ms: None,
    })
    .expect("publish");
    c.commit();
}

fn bodies(c: &mut Client, queue: &str) -> Vec<String> {
    std::iter::from_fn(|| {
        c.get(queue, GetAck::Auto)
            .expect("get")
            .map(|g| String::from_utf8_lossy(&g.message.body).into_owned())
    })
    .collect()
}

/// Takes the head of `queue` as a lease (tag `tag` of scope 1).
fn lease(c: &mut Client, queue: &str, tag: u64) -> Option<String> {
    c.get(
        queue,
        GetAck::Lease {
            scope: 1,
            tag,
            now: c.clock().now(),
        },
    )
    .expect("get")
    .map(|g| String::from_utf8_lossy(&g.message.body).into_owned())
}

#[test]
fn delayed_messages_wait_and_enter_their_queue_in_due_order() {
    let (store, clock) = (MemStore::new(), ManualClock::new());
    let (e, mut c) = open(&store, &clock);
    declare(&mut c, "later", json!({"x-delayed": true}));
    declare(&mut c, "plain", json!({}));
    publish(&mut c, "", "later", "in-5s", Some(5_000));
    publish(&mut c, "", "later", "in-1s", Some(1_000));
    publish(&mut c, "", "later", "now", None);
    // A queue not declared x-delayed ignores the header.
    publish(&mut c, "", "plain", "ignored-delay", Some(5_000));
    assert_eq!(bodies(&mut c, "plain"), vec!["ignored-delay"]);
    assert_eq!(bodies(&mut c, "later"), vec!["now"]);
    let q = c.queue("later").expect("queue");
    assert_eq!(q.message_count(), 0, "delayed messages are not ready");
    assert_eq!(q.partitions[0].delayed_len(), 2);
    // Not before their time, and at their millisecond.
    clock.advance_ms(999);
    e.run_timers();
    assert!(bodies(&mut c, "later").is_empty());
    clock.advance_ms(1);
    e.run_timers();
    assert_eq!(bodies(&mut c, "later"), vec!["in-1s"]);
    // Both due at once: they enter in due-time order, not publish order.
    publish(&mut c, "", "later", "in-3s", Some(3_000));
    publish(&mut c, "", "later", "in-2s", Some(2_000));
    clock.advance_ms(4_000);
    e.run_timers();
    assert_eq!(bodies(&mut c, "later"), vec!["in-2s", "in-3s", "in-5s"]);
}

#[test]
fn a_delayed_message_exchange_routes_as_its_delayed_type() {
    let (store, clock) = (MemStore::new(), ManualClock::new());
    let (e, mut c) = open(&store, &clock);
    let args = json!({"x-delayed-type": "direct"});
    let (kind, delayed) = ExchangeKind::parse_declared("x-delayed-message", &args)
        .expect("known type")
        .expect("valid x-delayed-type");
    assert_eq!((kind, delayed), (ExchangeKind::Direct, true));
    // The plugin's 406 text for a missing or unknown x-delayed-type.
    for bad in [json!({}), json!({"x-delayed-type": "bogus"})] {
        let err = ExchangeKind::parse_declared("x-delayed-message", &bad)
            .expect("known type")
            .expect_err("refused");
        assert!(err.contains("'x-delayed-type' must be an existing exchange type"));
    }
    let def = ExchangeDef {
        name: "delays".into(),
        kind,
        durable: true,
        auto_delete: false,
        internal: false,
        delayed,
        arguments: args,
    };
    c.declare_exchange(def.clone(), false)
        .expect("declare exchange");
    // The same name as a plain direct exchange is a different type.
    let plain = ExchangeDef {
        delayed: false,
        ..def
    };
    let err = c.declare_exchange(plain, false).expect_err("inequivalent");
    assert!(err.to_string().contains("x-delayed-message"), "{err}");
    declare(&mut c, "q", json!({}));
    c.bind("delays", DestinationKind::Queue, "q", "k", json!({}))
        .expect("bind");
    publish(&mut c, "delays", "k", "held", Some(2_000));
    publish(&mut c, "delays", "other-key", "unrouted", Some(1));
    publish(&mut c, "delays", "k", "at-once", None);
    assert_eq!(bodies(&mut c, "q"), vec!["at-once"]);
    clock.advance_ms(2_000);
    e.run_timers();
    assert_eq!(bodies(&mut c, "q"), vec!["held"]);
}

#[test]
fn delayed_retries_back_off_exponentially_and_count_attempts() {
    let (store, clock) = (MemStore::new(), ManualClock::new());
    let (e, mut c) = open(&store, &clock);
    declare(
        &mut c,
        "retry",
        json!({"x-delayed-retry-type": "all", "x-delayed-retry-min": 1_000,
               "x-delayed-retry-max": 4_000}),
    );
    publish(&mut c, "", "retry", "flaky", None);
    // Delays 1 s, 2 s, 4 s, 4 s: doubling from min, capped at max.
    for (tag, delay) in [(1, 1_000u64), (2, 2_000), (3, 4_000), (4, 4_000)] {
        assert_eq!(lease(&mut c, "retry", tag).as_deref(), Some("flaky"));
        c.settle(1, tag, false, Settle::Requeue).expect("nack");
        c.commit();
        assert!(lease(&mut c, "retry", 100).is_none(), "not back at once");
        clock.advance_ms(delay - 1);
        e.run_timers();
        assert!(lease(&mut c, "retry", 100).is_none(), "not back early");
        clock.advance_ms(1);
        e.run_timers();
    }
    assert_eq!(lease(&mut c, "retry", 5).as_deref(), Some("flaky"));
}

#[test]
fn retry_type_failed_delays_nacks_but_not_returns_of_a_closed_channel() {
    let (store, clock) = (MemStore::new(), ManualClock::new());
    let (_e, mut c) = open(&store, &clock);
    declare(
        &mut c,
        "failed",
        json!({"x-delayed-retry-type": "failed", "x-delayed-retry-min": 60_000}),
    );
    publish(&mut c, "", "failed", "m", None);
    assert!(lease(&mut c, "failed", 1).is_some());
    // The channel closes: a return, not a failure, so it is back at once.
    c.release_scope(1);
    c.commit();
    assert!(lease(&mut c, "failed", 1).is_some(), "returned at once");
    c.settle(1, 1, false, Settle::Requeue).expect("nack");
    c.commit();
    assert!(lease(&mut c, "failed", 2).is_none(), "a failure waits");
    assert_eq!(c.queue("failed").expect("q").partitions[0].delayed_len(), 1);
}

#[test]
fn delayed_messages_retries_and_attempts_survive_a_restart() {
    let (store, clock) = (MemStore::new(), ManualClock::new());
    {
        let (_e, mut c) = open(&store, &clock);
        declare(&mut c, "later", json!({"x-delayed": true}));
        declare(
            &mut c,
            "retry",
            json!({"x-delayed-retry-type": "all", "x-delayed-retry-min": 60_000,
                   "x-delivery-limit": 5}),
        );
        publish(&mut c, "", "later", "delayed", Some(60_000));
        publish(&mut c, "", "retry", "retried", None);
        assert!(lease(&mut c, "retry", 1).is_some());
        c.settle(1, 1, false, Settle::Requeue).expect("nack");
        c.commit();
    }
    // Restarted 30 s later: both still wait, for what is left of their time.
    clock.advance_ms(30_000);
    let (e, mut c) = open(&store.reopen(), &clock);
    e.run_timers();
    assert!(bodies(&mut c, "later").is_empty());
    assert!(lease(&mut c, "retry", 1).is_none());
    clock.advance_ms(29_999);
    e.run_timers();
    assert!(bodies(&mut c, "later").is_empty(), "not early");
    clock.advance_ms(1);
    e.run_timers();
    assert_eq!(bodies(&mut c, "later"), vec!["delayed"]);
    let got = c
        .get(
            "retry",
            GetAck::Lease {
                scope: 1,
                tag: 1,
                now: c.clock().now(),
            },
        )
        .expect("get")
        .expect("the retry is due");
    assert!(got.redelivered);
    // Its attempt count came through the restart: this is delivery 2.
    let headers = e
        .codecs()
        .decode(got.message.header_format, &got.message.properties)
        .expect("decodable")
        .headers
        .unwrap_or_default();
    assert_eq!(
        headers.get("x-delivery-count"),
        Some(&weir_engine::properties::Value::I64(1))
    );
}
