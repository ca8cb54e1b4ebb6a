//! Delivery semantics in process: TTL with the expiry index, dead-lettering
//! with `x-death`, delivery limits, length limits and overflow modes. Time
//! is an input: the engine runs on a [`ManualClock`] the tests move
//! ([`run_at`]) before [`Engine::run_timers`]; nothing sleeps.

use bytes::Bytes;
use serde_json::{json, Value as Json};
use std::sync::Arc;
use weir_backend::testing::MemStore;
use weir_engine::client::{GetAck, Published};
use weir_engine::exchange::{ExchangeDef, ExchangeKind, HeaderLookup};
use weir_engine::lease::Settle;
use weir_engine::message::Message;
use weir_engine::meta::DestinationKind;
use weir_engine::properties::{HeaderFormat, Properties, Table, Value};
use weir_engine::tenant::{QueueDeclare, RouteInput};
use weir_engine::{Client, Engine, DEFAULT_TENANT};
use weir_engine::{Clock, ManualClock};

fn setup() -> (Arc<Engine>, Client, Arc<ManualClock>) {
    let clock = ManualClock::new();
    let e = Engine::open(MemStore::new(), clock.clone()).expect("engine");
    let c = Client::open(&e, DEFAULT_TENANT, "guest").expect("client");
    (e, c, clock)
}

/// Moves the engine's clock to `at_ms` and runs the timed work due then;
/// returns when the timer is next due.
fn run_at(e: &Engine, clock: &ManualClock, at_ms: u64) -> Option<u64> {
    clock.set_ms(at_ms);
    e.run_timers()
}

fn declare(c: &mut Client, name: &str, args: Json) -> Result<(), String> {
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
        .map_err(|e| e.to_string())?;
    if let Some(w) = wait {
        w.blocking_recv().expect("store answered").expect("durable");
    }
    Ok(())
}

struct NoHeaders;
impl HeaderLookup for NoHeaders {
    fn header(&self, _: &str) -> Option<Json> {
        None
    }
}

/// Publishes `body` persistently to `queue` (default exchange), with an
/// optional per-message TTL, in Weir's own header format.
fn publish(c: &mut Client, queue: &str, body: &str, ttl_ms: Option<u32>) -> Published {
    let props = Properties {
        ttl_ms: ttl_ms.map(u64::from),
        ..Properties::default()
    };
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
            properties: props.to_bytes().expect("encodable"),
            body: Bytes::copy_from_slice(body.as_bytes()),
            header_format: HeaderFormat::WEIR,
            persistent: true,
            priority: 0,
            ttl_ms: ttl_ms.map(u64::from),
        })
        .expect("publish");
    c.commit();
    p
}

/// What a get of `queue` returns: (body, x-death reasons newest first,
/// x-death count of the newest).
fn get(c: &mut Client, e: &Engine, queue: &str) -> Option<(String, Vec<String>, i64)> {
    let got = c.get(queue, GetAck::Auto).expect("get")?;
    let props = e
        .codecs()
        .decode(got.message.header_format, &got.message.properties)
        .expect("decodable");
    let mut reasons = Vec::new();
    let mut count = 0;
    if let Some(Value::Array(deaths)) = props.headers.as_ref().and_then(|h| h.get("x-death")) {
        for (i, d) in deaths.iter().enumerate() {
            if let Value::Table(t) = d {
                if let Some(Value::String(r)) = t.get("reason") {
                    reasons.push(r.clone());
                }
                if let (0, Some(Value::I64(n))) = (i, t.get("count")) {
                    count = *n;
                }
            }
        }
    }
    Some((
        String::from_utf8_lossy(&got.message.body).into_owned(),
        reasons,
        count,
    ))
}

fn bodies(c: &mut Client, e: &Engine, queue: &str) -> Vec<String> {
    std::iter::from_fn(|| get(c, e, queue).map(|(b, _, _)| b)).collect()
}

fn headers_of(e: &Engine, m: &Message) -> Table {
    e.codecs()
        .decode(m.header_format, &m.properties)
        .expect("decodable")
        .headers
        .unwrap_or_default()
}

/// Takes the head of `queue` (settled at once): its body and properties.
fn take(c: &mut Client, e: &Engine, queue: &str) -> Option<(String, Properties)> {
    let got = c.get(queue, GetAck::Auto).expect("get")?;
    let props = e
        .codecs()
        .decode(got.message.header_format, &got.message.properties)
        .expect("decodable");
    Some((
        String::from_utf8_lossy(&got.message.body).into_owned(),
        props,
    ))
}

/// Publishes `body` persistently through `exchange` with `routing_key`.
fn publish_via(c: &mut Client, exchange: &str, routing_key: &str, body: &str) {
    let route = RouteInput {
        exchange,
        routing_key,
        headers: &NoHeaders,
    };
    c.publish(&route, |id| Message {
        id,
        exchange: Bytes::copy_from_slice(exchange.as_bytes()),
        routing_key: Bytes::copy_from_slice(routing_key.as_bytes()),
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

/// A durable fanout exchange `name`, bound to each of `queues`.
fn fanout(c: &mut Client, name: &str, queues: &[&str]) {
    c.declare_exchange(
        ExchangeDef {
            name: name.into(),
            kind: ExchangeKind::Fanout,
            durable: true,
            auto_delete: false,
            internal: false,
            delayed: false,
            arguments: json!({}),
        },
        false,
    )
    .expect("declare exchange");
    for q in queues {
        c.bind(name, DestinationKind::Queue, q, "", json!({}))
            .expect("bind");
    }
}

/// The `x-death` entries of `h`, each as a table.
fn deaths(h: &Table) -> Vec<Table> {
    match h.get("x-death") {
        Some(Value::Array(a)) => a
            .iter()
            .map(|d| match d {
                Value::Table(t) => t.clone(),
                other => panic!("an x-death entry is a table: {other:?}"),
            })
            .collect(),
        other => panic!("no x-death: {other:?}"),
    }
}

fn text(v: &str) -> Value {
    Value::String(v.into())
}

/// `x-first-death-*` and `x-last-death-*` of `h`: [exchange, queue, reason] each.
fn first_last(h: &Table) -> [[Option<&Value>; 3]; 2] {
    ["first", "last"]
        .map(|w| ["exchange", "queue", "reason"].map(|f| h.get(&format!("x-{w}-death-{f}"))))
}

#[test]
fn a_short_ttl_expires_on_time_behind_a_long_one_and_is_dead_lettered() {
    let (e, mut c, clock) = setup();
    declare(&mut c, "dlq", json!({})).expect("dlq");
    declare(
        &mut c,
        "q",
        json!({"x-dead-letter-exchange": "", "x-dead-letter-routing-key": "dlq"}),
    )
    .expect("q");
    publish(&mut c, "q", "long", Some(3_600_000));
    publish(&mut c, "q", "short", Some(1_000));
    let t0 = clock.now_ms();
    // Not yet due, a millisecond before its deadline.
    run_at(&e, &clock, t0 + 999);
    assert_eq!(c.queue("dlq").expect("dlq").message_count(), 0);
    // Due: the short one leaves from behind the long one, on time.
    let next = run_at(&e, &clock, t0 + 1_000);
    let (body, props) = take(&mut c, &e, "dlq").expect("dead-lettered");
    assert_eq!(body, "short");
    let h = props.headers.unwrap_or_default();
    let d = deaths(&h);
    assert_eq!(d.len(), 1);
    assert_eq!(d[0].get("reason"), Some(&text("expired")));
    assert_eq!(d[0].get("count"), Some(&Value::I64(1)));
    // Its own TTL moves into x-death (RabbitMQ's original-expiration): the
    // dead-lettered copy does not expire again.
    assert_eq!(d[0].get("original-expiration"), Some(&text("1000")));
    assert_eq!(props.ttl_ms, None, "expiration is moved into x-death");
    assert_eq!(bodies(&mut c, &e, "q"), vec!["long"]);
    assert!(
        next.is_some_and(|n| n > t0 + 3_000_000),
        "the long one is still scheduled"
    );
}

/// A queue TTL dead-letters its copy of a message on time, with `x-death`
/// ("expired", the queue, the exchange and routing key it was published
/// with, the engine's time) and `x-first-death-*` / `x-last-death-*`; the
/// copy of the same message in a queue with a long TTL stays.
#[test]
fn a_queue_ttl_dead_letters_on_time_while_a_long_lived_copy_stays() {
    let (e, mut c, clock) = setup();
    declare(&mut c, "dlq", json!({})).expect("dlq");
    fanout(&mut c, "dlx", &["dlq"]);
    for (q, ttl) in [("short", 1_000), ("long", 3_600_000)] {
        declare(
            &mut c,
            q,
            json!({"x-message-ttl": ttl, "x-dead-letter-exchange": "dlx"}),
        )
        .expect(q);
    }
    fanout(&mut c, "fan", &["short", "long"]);
    let t0 = clock.now_ms();
    publish_via(&mut c, "fan", "rk", "m");
    run_at(&e, &clock, t0 + 999);
    assert!(take(&mut c, &e, "dlq").is_none(), "not before its TTL");
    run_at(&e, &clock, t0 + 1_000);
    let (body, props) = take(&mut c, &e, "dlq").expect("dead-lettered on time");
    assert_eq!(body, "m");
    let h = props.headers.unwrap_or_default();
    let d = deaths(&h);
    assert_eq!(d.len(), 1);
    for (k, v) in [
        ("reason", text("expired")),
        ("queue", text("short")),
        ("exchange", text("fan")),
        ("routing-keys", Value::Array(vec![text("rk")])),
        ("count", Value::I64(1)),
        ("time", Value::Timestamp((t0 + 1_000) / 1000)),
    ] {
        assert_eq!(d[0].get(k), Some(&v), "x-death {k}");
    }
    let (fan, short, expired) = (text("fan"), text("short"), text("expired"));
    let death = [Some(&fan), Some(&short), Some(&expired)];
    assert_eq!(first_last(&h), [death, death]);
    assert_eq!(c.queue("long").expect("long").message_count(), 1);
    assert_eq!(c.queue("short").expect("short").message_count(), 0);
}

/// A TTL deadline is the publish time plus the TTL, across a restart too:
/// a restart before the deadline keeps the message until then (not a TTL
/// counted afresh from the restart), and one whose deadline passed while
/// the broker was down is never delivered after it comes back. Both the
/// queue's TTL and a message's own.
#[test]
fn a_ttl_deadline_is_kept_across_a_restart_not_counted_afresh() {
    let (store, clock) = (MemStore::new(), ManualClock::new());
    {
        let e = Engine::open(store.clone(), clock.clone()).expect("engine");
        let mut c = Client::open(&e, DEFAULT_TENANT, "guest").expect("client");
        declare(&mut c, "ttl", json!({"x-message-ttl": 1_500})).expect("ttl");
        declare(&mut c, "own", json!({})).expect("own");
        publish(&mut c, "ttl", "queue-ttl", None);
        publish(&mut c, "own", "own-ttl", Some(1_500));
        barrier(&mut c);
    }
    clock.advance_ms(1_000);
    let store = store.reopen();
    {
        let e = Engine::open(store.clone(), clock.clone()).expect("engine");
        let c = Client::open(&e, DEFAULT_TENANT, "guest").expect("client");
        e.run_timers();
        for q in ["ttl", "own"] {
            assert_eq!(c.queue(q).expect(q).message_count(), 1, "{q}: still alive");
        }
    }
    clock.advance_ms(501);
    let e = Engine::open(store.reopen(), clock.clone()).expect("engine");
    let mut c = Client::open(&e, DEFAULT_TENANT, "guest").expect("client");
    for q in ["ttl", "own"] {
        assert_eq!(
            bodies(&mut c, &e, q),
            Vec::<String>::new(),
            "{q}: delivered after its deadline: recovery restarted the TTL clock"
        );
        // The get dropped the expired head before the timer ran: the ready
        // count follows at once.
        assert_eq!(c.queue(q).expect(q).message_count(), 0, "{q}");
    }
}

/// Waits until everything appended so far is durable.
fn barrier(c: &mut Client) {
    let (tx, rx) = std::sync::mpsc::channel();
    c.durability_barrier(Box::new(move |r| {
        let _ = tx.send(r);
    }))
    .expect("barrier");
    rx.recv_timeout(std::time::Duration::from_secs(20))
        .expect("waiter called")
        .expect("durable");
}

#[test]
fn queue_ttl_and_message_ttl_the_lower_wins_and_expired_is_never_delivered() {
    let (e, mut c, clock) = setup();
    declare(&mut c, "q", json!({"x-message-ttl": 60_000})).expect("q");
    publish(&mut c, "q", "own-ttl-lower", Some(1_000));
    publish(&mut c, "q", "queue-ttl", None);
    let t0 = clock.now_ms();
    run_at(&e, &clock, t0 + 2_000);
    assert_eq!(c.queue("q").expect("q").message_count(), 1);
    run_at(&e, &clock, t0 + 61_000);
    assert_eq!(c.queue("q").expect("q").message_count(), 0);
    // Without a dead-letter exchange they were dropped and counted.
    assert_eq!(
        e.dead_letters
            .dropped
            .load(std::sync::atomic::Ordering::Relaxed),
        2
    );

    // Expired but the timer has not run yet: a get never returns it.
    declare(&mut c, "q0", json!({"x-message-ttl": 0})).expect("q0");
    publish(&mut c, "q0", "gone", None);
    assert!(get(&mut c, &e, "q0").is_none());
}

#[test]
fn reject_without_requeue_dead_letters_with_x_death_and_first_death() {
    let (e, mut c, _) = setup();
    declare(&mut c, "dlq", json!({})).expect("dlq");
    declare(
        &mut c,
        "work",
        json!({"x-dead-letter-exchange": "", "x-dead-letter-routing-key": "dlq"}),
    )
    .expect("work");
    publish(&mut c, "work", "bad", None);
    let got = c
        .get(
            "work",
            GetAck::Lease {
                scope: 1,
                tag: 1,
                now: c.clock().now(),
            },
        )
        .expect("get")
        .expect("one");
    assert_eq!(&got.message.body[..], b"bad");
    c.settle(1, 1, false, Settle::Drop).expect("reject");
    c.commit();
    e.run_timers();
    let got = c
        .get("dlq", GetAck::Auto)
        .expect("get")
        .expect("dead-lettered");
    let h = headers_of(&e, &got.message);
    assert_eq!(
        h.get("x-first-death-reason"),
        Some(&Value::String("rejected".into()))
    );
    assert_eq!(
        h.get("x-first-death-queue"),
        Some(&Value::String("work".into()))
    );
    let Some(Value::Array(deaths)) = h.get("x-death") else {
        panic!("no x-death")
    };
    let Value::Table(d) = &deaths[0] else {
        panic!("x-death entry is a table")
    };
    assert_eq!(
        d.get("routing-keys"),
        Some(&Value::Array(vec![Value::String("work".into())]))
    );
    assert_eq!(&got.message.routing_key[..], b"dlq");
    // Settled in the source: nothing left there, leased or ready.
    assert_eq!(c.queue("work").expect("work").depth().leased, 0);
}

#[test]
fn a_poison_message_reaches_the_dlq_after_exactly_the_delivery_limit() {
    let (e, mut c, _) = setup();
    declare(&mut c, "dlq", json!({})).expect("dlq");
    declare(
        &mut c,
        "work",
        json!({"x-delivery-limit": 3, "x-dead-letter-exchange": "", "x-dead-letter-routing-key": "dlq"}),
    )
    .expect("work");
    publish(&mut c, "work", "poison", None);
    let mut deliveries = 0;
    let mut tag = 0;
    while let Some(got) = c
        .get(
            "work",
            GetAck::Lease {
                scope: 1,
                tag: tag + 1,
                now: c.clock().now(),
            },
        )
        .expect("get")
    {
        tag += 1;
        deliveries += 1;
        assert_eq!(got.redelivered, deliveries > 1);
        // RabbitMQ 4's header: deliveries that came back before this one.
        let count = headers_of(&e, &got.message)
            .get("x-delivery-count")
            .cloned();
        let expected = (deliveries > 1).then(|| Value::I64(deliveries - 1));
        assert_eq!(count, expected, "delivery {deliveries}");
        c.settle(1, tag, false, Settle::Requeue)
            .expect("nack requeue");
        c.commit();
        assert!(deliveries <= 4, "the poison message loops");
    }
    assert_eq!(deliveries, 4, "first delivery + 3 redeliveries");
    e.run_timers();
    let (body, props) = take(&mut c, &e, "dlq").expect("dead-lettered");
    assert_eq!(body, "poison");
    let h = props.headers.unwrap_or_default();
    let d = deaths(&h);
    assert_eq!(d.len(), 1, "dead-lettered once");
    assert_eq!(d[0].get("reason"), Some(&text("delivery_limit")));
    let (x, q, r) = (text(""), text("work"), text("delivery_limit"));
    let death = [Some(&x), Some(&q), Some(&r)];
    assert_eq!(first_last(&h), [death, death]);
    assert_eq!(c.queue("work").expect("work").message_count(), 0);
    assert_eq!(c.queue("dlq").expect("dlq").message_count(), 0);
}

#[test]
fn quorum_queues_default_to_a_delivery_limit_of_20() {
    let (_e, mut c, _) = setup();
    declare(&mut c, "qq", json!({"x-queue-type": "quorum"})).expect("qq");
    publish(&mut c, "qq", "p", None);
    let mut n = 0;
    while let Some(_g) = c
        .get(
            "qq",
            GetAck::Lease {
                scope: 1,
                tag: n + 1,
                now: c.clock().now(),
            },
        )
        .expect("get")
    {
        n += 1;
        c.settle(1, n, false, Settle::Requeue).expect("requeue");
        assert!(n <= 21);
    }
    assert_eq!(n, 21);
}

#[test]
fn max_length_drop_head_dead_letters_the_oldest() {
    let (e, mut c, _) = setup();
    declare(&mut c, "dlq", json!({})).expect("dlq");
    declare(
        &mut c,
        "q",
        json!({"x-max-length": 2, "x-dead-letter-exchange": "", "x-dead-letter-routing-key": "dlq"}),
    )
    .expect("q");
    for b in ["1", "2", "3", "4"] {
        assert!(matches!(
            publish(&mut c, "q", b, None),
            Published::Routed { refused: false, .. }
        ));
    }
    e.run_timers();
    assert_eq!(bodies(&mut c, &e, "q"), vec!["3", "4"]);
    let dead: Vec<_> = std::iter::from_fn(|| get(&mut c, &e, "dlq")).collect();
    assert_eq!(
        dead.iter()
            .map(|(b, r, _)| (b.as_str(), r[0].as_str()))
            .collect::<Vec<_>>(),
        vec![("1", "maxlen"), ("2", "maxlen")]
    );
}

#[test]
fn reject_publish_refuses_and_reject_publish_dlx_also_dead_letters() {
    let (e, mut c, _) = setup();
    declare(
        &mut c,
        "q",
        json!({"x-max-length": 1, "x-overflow": "reject-publish"}),
    )
    .expect("q");
    assert!(matches!(
        publish(&mut c, "q", "a", None),
        Published::Routed { refused: false, .. }
    ));
    assert!(matches!(
        publish(&mut c, "q", "b", None),
        Published::Routed { refused: true, .. }
    ));
    assert_eq!(bodies(&mut c, &e, "q"), vec!["a"]);

    declare(&mut c, "dlq", json!({})).expect("dlq");
    declare(
        &mut c,
        "q2",
        json!({"x-max-length-bytes": 100, "x-overflow": "reject-publish-dlx",
               "x-dead-letter-exchange": "", "x-dead-letter-routing-key": "dlq"}),
    )
    .expect("q2");
    assert!(matches!(
        publish(&mut c, "q2", "a", None),
        Published::Routed { refused: false, .. }
    ));
    let big = "b".repeat(200);
    assert!(matches!(
        publish(&mut c, "q2", &big, None),
        Published::Routed { refused: true, .. }
    ));
    e.run_timers();
    let (body, props) = take(&mut c, &e, "dlq").expect("dead-lettered");
    assert_eq!(body, big);
    let h = props.headers.unwrap_or_default();
    assert_eq!(deaths(&h)[0].get("reason"), Some(&text("maxlen")));
    let (x, q, r) = (text(""), text("q2"), text("maxlen"));
    assert_eq!(
        first_last(&h)[1],
        [Some(&x), Some(&q), Some(&r)],
        "x-last-death-*"
    );
    assert_eq!(bodies(&mut c, &e, "q2"), vec!["a"]);
}

#[test]
fn an_expiry_cycle_without_rejection_is_dropped_not_looped() {
    let (e, mut c, clock) = setup();
    // a expires into b, b expires back into a.
    declare(
        &mut c,
        "a",
        json!({"x-message-ttl": 10, "x-dead-letter-exchange": "", "x-dead-letter-routing-key": "b"}),
    )
    .expect("a");
    declare(
        &mut c,
        "b",
        json!({"x-message-ttl": 10, "x-dead-letter-exchange": "", "x-dead-letter-routing-key": "a"}),
    )
    .expect("b");
    publish(&mut c, "a", "m", None);
    let t0 = clock.now_ms();
    for step in 1..=10 {
        run_at(&e, &clock, t0 + step * 1_000);
    }
    assert_eq!(c.queue("a").expect("a").message_count(), 0);
    assert_eq!(c.queue("b").expect("b").message_count(), 0);
    assert_eq!(
        e.dead_letters
            .cycles
            .load(std::sync::atomic::Ordering::Relaxed),
        1
    );
}

#[test]
fn wrong_argument_types_and_ranges_are_refused_with_406_texts() {
    let (_e, mut c, _) = setup();
    for args in [
        json!({"x-max-priority": "10"}),
        json!({"x-max-priority": 256}),
        json!({"x-message-ttl": -5}),
        json!({"x-overflow": "nope"}),
    ] {
        let err = declare(&mut c, "bad", args.clone()).expect_err("refused");
        assert!(err.contains("invalid arg"), "{args}: {err}");
    }
}

#[test]
fn an_unused_queue_with_x_expires_is_deleted_and_a_consumer_keeps_it() {
    let (e, mut c, clock) = setup();
    declare(&mut c, "idle", json!({"x-expires": 1_000})).expect("idle");
    declare(&mut c, "busy", json!({"x-expires": 1_000})).expect("busy");
    c.subscribe(
        "busy",
        weir_engine::client::SubscribeOptions {
            scope: 1,
            tag: Bytes::from_static(b"t"),
            exclusive: false,
            no_ack: false,
            ..Default::default()
        },
    )
    .expect("subscribe");
    publish(&mut c, "idle", "publishing is not a use", None);
    let t0 = clock.now_ms();
    run_at(&e, &clock, t0 + 999);
    assert!(c.queue("idle").is_ok());
    let next = run_at(&e, &clock, t0 + 1_000);
    assert!(c.queue("idle").is_err(), "idle queue deleted on time");
    assert!(c.queue("busy").is_ok(), "a queue with a consumer is in use");
    // The consumer leaves: idle from now on.
    assert!(c.unsubscribe(1, b"t"));
    assert!(next.is_some() || e.timers.next_ms().is_some());
    run_at(&e, &clock, t0 + 1_999);
    assert!(c.queue("busy").is_ok(), "idle for 999 ms only");
    run_at(&e, &clock, t0 + 2_000);
    assert!(c.queue("busy").is_err(), "deleted after its consumer left");
}

#[test]
fn policies_apply_to_existing_and_new_queues_merge_as_rabbitmq_and_survive_restart() {
    use weir_engine::policy::{ApplyTo, PolicyDef};
    let store = MemStore::new();
    let e = Engine::open(store.clone(), ManualClock::new()).expect("engine");
    let mut c = Client::open(&e, DEFAULT_TENANT, "guest").expect("client");
    declare(&mut c, "jobs.a", json!({})).expect("a");
    declare(&mut c, "other", json!({})).expect("other");
    for q in ["jobs.a", "other"] {
        for b in ["1", "2", "3"] {
            publish(&mut c, q, b, None);
        }
    }
    let def = PolicyDef {
        name: "cap".into(),
        pattern: "^jobs\\.".into(),
        apply_to: ApplyTo::Queues,
        priority: 1,
        definition: json!({"max-length": 2, "message-ttl": 60_000})
            .as_object()
            .cloned()
            .expect("object"),
    };
    e.tenant(DEFAULT_TENANT)
        .expect("tenant")
        .set_policy(def)
        .expect("policy")
        .blocking_recv()
        .expect("answered")
        .expect("durable");
    // Applied at once to the matching queue only: the oldest is dropped.
    assert_eq!(c.queue("jobs.a").expect("a").message_count(), 2);
    assert_eq!(c.queue("other").expect("other").message_count(), 3);
    // A new queue gets it; its own lower limit wins (the lower value).
    declare(&mut c, "jobs.b", json!({"x-max-length": 1})).expect("b");
    let b = c.queue("jobs.b").expect("b").args();
    assert_eq!((b.max_length, b.message_ttl), (Some(1), Some(60_000)));
    // A policy may not set max-priority.
    let bad = PolicyDef {
        name: "prio".into(),
        pattern: ".*".into(),
        apply_to: ApplyTo::All,
        priority: 0,
        definition: json!({"max-priority": 5})
            .as_object()
            .cloned()
            .expect("object"),
    };
    assert!(e
        .tenant(DEFAULT_TENANT)
        .expect("tenant")
        .set_policy(bad)
        .is_err());
    drop(c);
    drop(e);
    // After a restart the policy still applies.
    let e = Engine::open(store.reopen(), ManualClock::new()).expect("reopened");
    let c = Client::open(&e, DEFAULT_TENANT, "guest").expect("client");
    assert_eq!(c.queue("jobs.a").expect("a").args().max_length, Some(2));
    let t = e.tenant(DEFAULT_TENANT).expect("tenant");
    assert_eq!(t.policies().len(), 1);
    t.delete_policy("cap")
        .expect("deleted")
        .blocking_recv()
        .expect("answered")
        .expect("durable");
    assert_eq!(c.queue("jobs.a").expect("a").args().max_length, None);
}

/// Headers with just an ordering key.
struct Key(String);
impl HeaderLookup for Key {
    fn header(&self, name: &str) -> Option<Json> {
        (name == "x-ordering-key").then(|| Json::String(self.0.clone()))
    }
}

#[test]
fn ordering_keys_keep_per_key_order_across_random_nacks() {
    const KEYS: usize = 16;
    const PER_KEY: usize = 700; // 11,200 messages
    let (_e, mut c, _) = setup();
    declare(&mut c, "ordered", json!({"x-partitions": 4})).expect("declare");
    // Interleave keys as a real producer would.
    for i in 0..PER_KEY {
        for k in 0..KEYS {
            let key = Key(format!("k{k}"));
            let route = RouteInput {
                exchange: "",
                routing_key: "ordered",
                headers: &key,
            };
            c.publish(&route, |id| Message {
                id,
                exchange: Bytes::new(),
                routing_key: Bytes::from_static(b"ordered"),
                properties: Bytes::new(),
                body: Bytes::from(format!("{k}:{i}")),
                header_format: HeaderFormat::WEIR,
                persistent: false,
                priority: 0,
                ttl_ms: None,
            })
            .expect("publish");
        }
    }
    // Four consumers, each with room for many messages.
    for scope in 1..=4u32 {
        c.subscribe(
            "ordered",
            weir_engine::client::SubscribeOptions {
                scope,
                tag: Bytes::from(format!("c{scope}")),
                prefetch_count: 50,
                ..Default::default()
            },
        )
        .expect("subscribe");
    }
    let mut rng: u64 = 0x2545_F491_4F6C_DD1D;
    let mut next_tag = [0u64; 5];
    let mut processed = vec![Vec::new(); KEYS];
    let mut nacks = 0;
    let mut in_flight_max = 0;
    let total = KEYS * PER_KEY;
    let mut done = 0;
    while done < total {
        c.drain(&mut Vec::new());
        let mut batch = Vec::new();
        while let Some(d) = c.next_delivery() {
            let m = c.message_of(&d).expect("readable");
            let scope = d.consumer.scope();
            next_tag[scope as usize] += 1;
            let tag = next_tag[scope as usize];
            batch.push((scope, tag, String::from_utf8_lossy(&m.body).into_owned()));
            let (now, now_ms) = (c.clock().now(), c.clock().now_ms());
            c.lease(scope, tag, d, now, now_ms);
        }
        c.finish_deliveries();
        assert!(
            !batch.is_empty(),
            "stalled with {done} of {total} processed, ready {}, depth {:?}",
            c.queue("ordered").unwrap().message_count(),
            c.queue("ordered").unwrap().depth()
        );
        in_flight_max = in_flight_max.max(batch.len());
        for (scope, tag, body) in batch {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            if rng.is_multiple_of(10) {
                nacks += 1;
                c.settle(scope, tag, false, Settle::Requeue).expect("nack");
            } else {
                let (k, i) = body.split_once(':').expect("key:seq");
                processed[k.parse::<usize>().expect("key")].push(i.parse::<usize>().expect("seq"));
                c.settle(scope, tag, false, Settle::Ack).expect("ack");
                done += 1;
            }
        }
        c.commit();
    }
    assert!(nacks > 500, "the test nacked ({nacks})");
    assert!(in_flight_max > 1, "partitions ran in parallel");
    for (k, seqs) in processed.iter().enumerate() {
        assert_eq!(
            seqs,
            &(0..PER_KEY).collect::<Vec<_>>(),
            "key {k} processed out of order"
        );
    }
}

#[test]
fn a_lowered_limit_drops_heads_only_under_drop_head() {
    use weir_engine::policy::{ApplyTo, PolicyDef};
    let (e, mut c, _) = setup();
    declare(
        &mut c,
        "lim.reject",
        json!({"x-overflow": "reject-publish"}),
    )
    .expect("reject");
    declare(&mut c, "lim.drop", json!({})).expect("drop");
    for q in ["lim.reject", "lim.drop"] {
        for b in ["1", "2", "3"] {
            publish(&mut c, q, b, None);
        }
    }
    let def = PolicyDef {
        name: "cap".into(),
        pattern: "^lim\\.".into(),
        apply_to: ApplyTo::Queues,
        priority: 0,
        definition: json!({"max-length": 1})
            .as_object()
            .cloned()
            .expect("object"),
    };
    e.tenant(DEFAULT_TENANT)
        .expect("tenant")
        .set_policy(def)
        .expect("policy")
        .blocking_recv()
        .expect("answered")
        .expect("durable");
    assert_eq!(c.queue("lim.drop").expect("q").message_count(), 1);
    // reject-publish keeps what it holds and refuses more (RabbitMQ).
    assert_eq!(c.queue("lim.reject").expect("q").message_count(), 3);
    assert!(matches!(
        publish(&mut c, "lim.reject", "4", None),
        Published::Routed { refused: true, .. }
    ));
}

#[test]
fn basic_get_on_a_partitioned_queue_keeps_one_message_out_per_partition() {
    let (_e, mut c, _) = setup();
    declare(&mut c, "parts", json!({"x-partitions": 2})).expect("declare");
    for key in ["a", "b"] {
        for i in 0..2 {
            let k = Key(key.into());
            let route = RouteInput {
                exchange: "",
                routing_key: "parts",
                headers: &k,
            };
            c.publish(&route, |id| Message {
                id,
                exchange: Bytes::new(),
                routing_key: Bytes::from_static(b"parts"),
                properties: Bytes::new(),
                body: Bytes::from(format!("{key}{i}")),
                header_format: HeaderFormat::WEIR,
                persistent: false,
                priority: 0,
                ttl_ms: None,
            })
            .expect("publish");
        }
    }
    let lease = |c: &mut Client, tag| {
        c.get(
            "parts",
            GetAck::Lease {
                scope: 1,
                tag,
                now: c.clock().now(),
            },
        )
        .expect("get")
        .map(|g| String::from_utf8_lossy(&g.message.body).into_owned())
    };
    let first = lease(&mut c, 1).expect("one");
    let second = lease(&mut c, 2).expect("the other partition");
    assert_ne!(first[..1], second[..1], "one per partition");
    assert_eq!(lease(&mut c, 3), None, "both partitions have one out");
    // A nack puts the first back: it, not its successor, comes next.
    c.settle(1, 1, false, Settle::Requeue).expect("nack");
    c.commit();
    assert_eq!(lease(&mut c, 3), Some(first));
}

#[test]
fn counters_sum_the_wait_of_each_delivery_and_read_depth_without_a_lock() {
    let (e, mut c, clock) = setup();
    declare(&mut c, "q", json!({})).expect("declare");
    for i in 0..3 {
        publish(&mut c, "q", &format!("m{i}"), None);
    }
    let q = e
        .tenant(DEFAULT_TENANT)
        .and_then(|t| t.queue_named("q"))
        .expect("queue");
    let n = q.counters();
    assert_eq!((n.published, n.ready, n.leased, n.waited_ms), (3, 3, 0, 0));
    clock.advance_ms(30);
    let lease = GetAck::Lease {
        scope: 1,
        tag: 1,
        now: c.clock().now(),
    };
    let got = c.get("q", lease).expect("get").expect("a message");
    let n = q.counters();
    assert_eq!((n.delivered, n.ready, n.leased), (1, 2, 1));
    assert_eq!(n.waited_ms, 30, "waited 30 ms on the engine's clock");
    drop(got);
}
