//! The sealed client (issue 21), in process (`MemStore`): what sessions and
//! the management API used to reach around the permission-checked client
//! through its tenant now has its own checked call. Retained messages are
//! checked as the publish and the subscription they belong to; session state
//! is the session's own; a queue's bindings need read on it and cost its own
//! bindings, not the exchange's; the management API's operations on other
//! connections' queues and dead letters are for management clients only.

use bytes::Bytes;
use serde_json::json;
use std::sync::Arc;
use std::time::{Duration, Instant};
use weir_backend::testing::MemStore;
use weir_engine::auth::hash_password;
use weir_engine::client::{DeadLetterMove, GetAck, Published};
use weir_engine::exchange::HeaderLookup;
use weir_engine::lease::Settle;
use weir_engine::message::Message;
use weir_engine::meta::DestinationKind;
use weir_engine::permissions::{PermissionDef, TopicPermissionDef, UserDef};
use weir_engine::properties::{HeaderFormat, MessageHeader, Properties};
use weir_engine::retained::{RetainError, RetainedCursor};
use weir_engine::tenant::{QueueDeclare, RouteInput};
use weir_engine::{Client, Clock, DurableWait, Engine, EngineError, ManualClock};

fn durable(w: DurableWait) {
    w.blocking_recv().expect("store answered").expect("durable");
}

/// An engine with tenant `a` and `users` with permissions there (name,
/// configure, write, read).
/// The engine runs on a manual clock, returned beside it.
fn engine(users: &[(&str, &str, &str, &str)]) -> (Arc<Engine>, Arc<ManualClock>) {
    let clock = ManualClock::new();
    let e = Engine::open(MemStore::new(), clock.clone()).expect("engine");
    if let (_, Some(w)) = e.add_tenant("a").expect("tenant") {
        durable(w);
    }
    // One hash for every user (argon2 is slow in a debug build).
    static HASH: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    let hash = HASH.get_or_init(|| hash_password(b"x").expect("hash"));
    for (name, c, w, r) in users {
        durable(
            e.put_user(UserDef {
                name: (*name).into(),
                password_hash: hash.clone(),
                tags: vec![],
                loopback_only: false,
                from_config: false,
            })
            .expect("user"),
        );
        durable(
            e.set_permissions(PermissionDef {
                user: (*name).into(),
                vhost: "a".into(),
                configure: (*c).into(),
                write: (*w).into(),
                read: (*r).into(),
                from_config: false,
            })
            .expect("permissions"),
        );
    }
    (e, clock)
}

fn refused<T: std::fmt::Debug>(r: Result<T, EngineError>) -> String {
    match r {
        Err(EngineError::AccessRefused(t)) => t,
        other => panic!("expected ACCESS_REFUSED, got {other:?}"),
    }
}

fn declare(c: &mut Client, name: &str, exclusive: bool, arguments: serde_json::Value) {
    let connection = c.id();
    let (_, wait) = c
        .declare_queue(QueueDeclare {
            name: name.into(),
            passive: false,
            durable: !exclusive,
            exclusive,
            auto_delete: false,
            arguments,
            connection,
        })
        .expect("declare");
    if let Some(w) = wait {
        durable(w);
    }
}

fn bind(c: &mut Client, queue: &str, key: &str) {
    c.bind(
        "amq.topic",
        DestinationKind::Queue,
        queue,
        key,
        json!({ "k": key }),
    )
    .expect("bind");
}

struct NoHeaders;
impl HeaderLookup for NoHeaders {
    fn header(&self, _: &str) -> Option<serde_json::Value> {
        None
    }
}

fn publish(c: &mut Client, queue: &str, body: &str, ttl_ms: Option<u64>) -> Published {
    let props = Properties {
        ttl_ms,
        ..Properties::default()
    };
    let route = RouteInput {
        exchange: "",
        routing_key: queue,
        headers: &NoHeaders,
    };
    c.publish(&route, |id| Message {
        id,
        exchange: Bytes::new(),
        routing_key: Bytes::copy_from_slice(queue.as_bytes()),
        properties: props.to_bytes().expect("encodable"),
        body: Bytes::copy_from_slice(body.as_bytes()),
        header_format: HeaderFormat::WEIR,
        persistent: false,
        priority: 0,
        ttl_ms,
    })
    .expect("publish")
}

fn header() -> MessageHeader {
    MessageHeader::new(HeaderFormat::new(3), Bytes::from_static(&[1]))
}

#[test]
fn retained_messages_are_checked_as_their_publish_and_their_subscription() {
    let (e, clock) = engine(&[("u", ".*", ".*", ".*"), ("ro", ".*", "^$", ".*")]);
    durable(
        e.set_topic_permissions(TopicPermissionDef {
            user: "u".into(),
            vhost: "a".into(),
            exchange: "amq.topic".into(),
            write: "^{username}\\.".into(),
            read: "^{client_id}\\.|^public\\.".into(),
            from_config: false,
        })
        .expect("topic permissions"),
    );
    let now = clock.now_ms();
    let mut u = Client::open(&e, "a", "u").expect("u");
    u.set_client_id("dev1");
    // Write: the topic's routing key against the topic write pattern.
    u.retain("u/t", header(), Bytes::from_static(b"1"), None, now)
        .expect("own topic");
    let r = u.retain("v/t", header(), Bytes::from_static(b"2"), None, now);
    match r {
        Err(RetainError::Engine(EngineError::AccessRefused(t))) => assert_eq!(
            t,
            "write access to topic 'v.t' in exchange 'amq.topic' in vhost 'a' refused for user 'u'"
        ),
        other => panic!("expected a refusal, got {other:?}"),
    }
    // Without write on amq.topic at all.
    let mut ro = Client::open(&e, "a", "ro").expect("ro");
    assert!(matches!(
        ro.retain("x", header(), Bytes::from_static(b"3"), None, now),
        Err(RetainError::Engine(EngineError::AccessRefused(_)))
    ));
    // Nothing refused was kept.
    let t = e.tenant("a").expect("tenant");
    let kept: Vec<String> = t
        .retained("#", now)
        .iter()
        .map(|m| m.topic.clone())
        .collect();
    assert_eq!(kept, vec!["u/t".to_string()]);
    // Read: as the subscription to the filter would be.
    assert!(t
        .retain("dev1/x", header(), Bytes::from_static(b"4"), None, now)
        .is_ok());
    let got = u.retained("dev1/#", now).expect("own client id");
    assert_eq!(got.len(), 1);
    assert_eq!(
        refused(u.retained("u/#", now)),
        "read access to topic 'u.#' in exchange 'amq.topic' in vhost 'a' refused for user 'u'"
    );
    let mut cursor = RetainedCursor::new("#");
    let mut out = Vec::new();
    assert!(refused(u.retained_next(&mut cursor, 10, now, &mut out)).contains("topic '#'"));
    assert!(out.is_empty());
    let mut cursor = RetainedCursor::new("public/+");
    u.retained_next(&mut cursor, 10, now, &mut out)
        .expect("public");
    // A revoked permission stops a lookup at its next step.
    durable(e.clear_permissions("u", "a").expect("clear").expect("some"));
    let mut cursor = RetainedCursor::new("dev1/#");
    assert!(u.retained_next(&mut cursor, 10, now, &mut out).is_err());
}

#[test]
fn session_state_is_the_sessions_own() {
    let (e, _) = engine(&[("u", ".*", ".*", ".*")]);
    let mut one = Client::open(&e, "a", "u").expect("one");
    let mut two = Client::open(&e, "a", "u").expect("two");
    // No session named yet: nothing to reach.
    assert!(one.session_state().is_err());
    assert!(one
        .update_session_state(&[("in\x001", Some(b"".as_slice()))])
        .is_err());
    one.set_client_id("c1");
    two.set_client_id("c2");
    durable(
        one.update_session_state(&[
            ("in\x001", Some(b"x".as_slice())),
            ("out\x002", Some(b"y".as_slice())),
        ])
        .expect("one"),
    );
    durable(
        two.update_session_state(&[("in\x001", Some(b"z".as_slice()))])
            .expect("two"),
    );
    assert_eq!(
        one.session_state().expect("one"),
        vec![
            ("in\x001".to_string(), b"x".to_vec()),
            ("out\x002".to_string(), b"y".to_vec())
        ]
    );
    assert_eq!(
        two.session_state().expect("two"),
        vec![("in\x001".to_string(), b"z".to_vec())]
    );
    // Kept under the session's key prefix, as before the sealed client
    // (state recorded by an older broker is found again).
    let t = e.tenant("a").expect("tenant");
    assert_eq!(t.session_state("mqtt\0c1\0").len(), 2);
    // Clearing one session leaves the other.
    durable(one.clear_session_state().expect("clear").expect("had some"));
    assert!(one.clear_session_state().expect("clear").is_none());
    assert!(one.session_state().expect("one").is_empty());
    assert_eq!(two.session_state().expect("two").len(), 1);
}

#[test]
fn a_queues_bindings_need_read_on_it_and_are_its_own() {
    let (e, _) = engine(&[("u", ".*", ".*", ".*"), ("w", ".*", ".*", "^$")]);
    let mut u = Client::open(&e, "a", "u").expect("u");
    declare(&mut u, "q1", false, json!({}));
    declare(&mut u, "q2", false, json!({}));
    bind(&mut u, "q1", "a.*");
    bind(&mut u, "q1", "b.#");
    bind(&mut u, "q2", "c");
    u.bind("amq.direct", DestinationKind::Queue, "q1", "d", json!({}))
        .expect("direct");
    let mut got: Vec<(String, String)> = u
        .queue_bindings("q1")
        .expect("bindings")
        .into_iter()
        .map(|b| {
            assert_eq!(b.destination, "q1");
            (b.source, b.key)
        })
        .collect();
    got.sort();
    assert_eq!(
        got,
        vec![
            ("amq.direct".into(), "d".into()),
            ("amq.topic".into(), "a.*".into()),
            ("amq.topic".into(), "b.#".into()),
        ]
    );
    let args: Vec<serde_json::Value> = u
        .queue_bindings("q2")
        .expect("q2")
        .into_iter()
        .map(|b| b.arguments)
        .collect();
    assert_eq!(args, vec![json!({"k": "c"})]);
    let mut w = Client::open(&e, "a", "w").expect("w");
    assert_eq!(
        refused(w.queue_bindings("q1")),
        "read access to queue 'q1' in vhost 'a' refused for user 'w'"
    );
    // Another connection's exclusive queue is locked.
    declare(&mut u, "mine", true, json!({}));
    let mut other = Client::open(&e, "a", "u").expect("other");
    assert!(matches!(
        other.queue_bindings("mine"),
        Err(EngineError::ResourceLocked(_))
    ));
    assert!(matches!(
        u.queue_bindings("missing"),
        Err(EngineError::NotFound(_))
    ));
}

/// The lookup a resuming MQTT session makes costs the queue's own
/// bindings: with 50,000 other bindings on the same exchange it is no
/// slower than with none (walking the exchange would make each lookup
/// 50,000 binding copies).
#[test]
fn a_queues_bindings_cost_its_own_not_the_exchanges() {
    let (e, _) = engine(&[("u", ".*", ".*", ".*")]);
    let mut u = Client::open(&e, "a", "u").expect("u");
    declare(&mut u, "mine", false, json!({}));
    bind(&mut u, "mine", "mine.#");
    const LOOKUPS: u32 = 2_000;
    let time = |u: &mut Client| {
        (0..5)
            .map(|_| {
                let t = Instant::now();
                for _ in 0..LOOKUPS {
                    assert_eq!(u.queue_bindings("mine").expect("mine").len(), 1);
                }
                t.elapsed()
            })
            .min()
            .expect("five runs")
    };
    let alone = time(&mut u);
    for i in 0..500 {
        let q = format!("other{i}");
        declare(&mut u, &q, false, json!({}));
        for k in 0..100 {
            bind(&mut u, &q, &format!("{i}.{k}.#"));
        }
    }
    let crowded = time(&mut u);
    assert!(
        crowded <= alone * 20 + Duration::from_millis(50),
        "{LOOKUPS} lookups: {alone:?} alone, {crowded:?} beside 50,000 other bindings"
    );
}

#[test]
fn admin_calls_are_for_management_clients_and_keep_the_permission_rules() {
    let (e, _) = engine(&[
        ("admin", ".*", ".*", ".*"),
        ("noconf", "^$", ".*", ".*"),
        ("noread", ".*", ".*", "^$"),
    ]);
    let mut owner = Client::open(&e, "a", "admin").expect("owner");
    declare(&mut owner, "ex", true, json!({}));
    publish(&mut owner, "ex", "m", None);
    // A connection's client may not, even with every permission.
    let mut conn = Client::open(&e, "a", "admin").expect("a connection");
    assert!(refused(conn.admin_purge_queue("ex")).contains("management operation"));
    assert!(refused(conn.admin_delete_queue("ex", false, false)).contains("management"));
    // The protocol calls stay locked on another connection's queue.
    let mut m = Client::open_management(&e, "a", "admin").expect("management");
    assert!(matches!(
        m.purge_queue("ex"),
        Err(EngineError::ResourceLocked(_))
    ));
    // Permissions as queue.purge (read) and queue.delete (configure).
    let mut nr = Client::open_management(&e, "a", "noread").expect("noread");
    assert_eq!(
        refused(nr.admin_purge_queue("ex")),
        "read access to queue 'ex' in vhost 'a' refused for user 'noread'"
    );
    let mut nc = Client::open_management(&e, "a", "noconf").expect("noconf");
    assert_eq!(
        refused(nc.admin_delete_queue("ex", false, false)),
        "configure access to queue 'ex' in vhost 'a' refused for user 'noconf'"
    );
    assert_eq!(m.admin_purge_queue("ex").expect("purge"), 1);
    m.admin_delete_queue("ex", false, false).expect("delete");
    assert!(!m.queue_exists("ex"));
    // A plain queue alike, with the delete's conditions.
    declare(&mut owner, "plain", false, json!({}));
    publish(&mut owner, "plain", "m", None);
    assert!(matches!(
        m.admin_delete_queue("plain", false, true),
        Err(EngineError::PreconditionFailed(_))
    ));
    assert_eq!(
        m.admin_delete_queue("plain", false, false)
            .expect("delete")
            .0,
        1
    );
}

#[test]
fn dead_letters_move_back_to_the_queue_they_died_in() {
    let (e, clock) = engine(&[("admin", ".*", ".*", ".*"), ("nowrite", ".*", "^$", ".*")]);
    let mut c = Client::open(&e, "a", "admin").expect("client");
    declare(&mut c, "dlq", false, json!({}));
    declare(
        &mut c,
        "src",
        false,
        json!({"x-dead-letter-exchange": "", "x-dead-letter-routing-key": "dlq"}),
    );
    publish(&mut c, "src", "died", Some(1));
    clock.advance_ms(1_000);
    e.run_timers();
    publish(&mut c, "dlq", "never died", None);
    assert_eq!(c.queue("dlq").expect("dlq").message_count(), 2);
    let now = Instant::now();
    let take = |m: &mut Client, tag| {
        m.get("dlq", GetAck::Lease { scope: 1, tag, now })
            .expect("get")
            .expect("a message")
            .message
    };
    // A connection's client may not.
    let mut conn = Client::open(&e, "a", "admin").expect("connection");
    let first = take(&mut conn, 1);
    assert!(refused(conn.requeue_dead_letter("dlq", &first)).contains("management"));
    drop(conn);
    // Nor a user who may not publish through the default exchange.
    let mut nw = Client::open_management(&e, "a", "nowrite").expect("nowrite");
    let first = take(&mut nw, 1);
    assert!(refused(nw.requeue_dead_letter("dlq", &first)).contains("amq.default"));
    drop(nw);

    let mut m = Client::open_management(&e, "a", "admin").expect("management");
    let mut died = None;
    for tag in 1..=2 {
        let msg = take(&mut m, tag);
        match m.requeue_dead_letter("dlq", &msg).expect("requeue") {
            DeadLetterMove::Moved { .. } => {
                assert_eq!(&msg.body[..], b"died");
                m.settle(1, tag, false, Settle::Ack).expect("ack");
                died = Some(msg);
            }
            DeadLetterMove::Kept => {
                assert_eq!(&msg.body[..], b"never died");
                m.settle(1, tag, false, Settle::Requeue).expect("requeue");
            }
        }
    }
    m.commit();
    let died = died.expect("one moved");
    assert_eq!(m.queue("src").expect("src").message_count(), 1);
    assert_eq!(m.queue("dlq").expect("dlq").message_count(), 1);
    // One whose queue is gone stays; so does one taken from the queue it
    // names.
    m.delete_queue("src", false, false).expect("delete src");
    assert_eq!(
        m.requeue_dead_letter("dlq", &died).expect("requeue"),
        DeadLetterMove::Kept,
        "its queue is gone"
    );
    declare(&mut m, "src", false, json!({}));
    assert_eq!(
        m.requeue_dead_letter("src", &died).expect("requeue"),
        DeadLetterMove::Kept,
        "taken from the queue it names"
    );
    assert_eq!(m.queue("src").expect("src").message_count(), 0);
}

#[test]
fn check_route_answers_as_a_publish_would_without_publishing() {
    let (e, _) = engine(&[("u", ".*", "^amq\\.topic$", ".*")]);
    let mut u = Client::open(&e, "a", "u").expect("u");
    let route = |x: &'static str| RouteInput {
        exchange: x,
        routing_key: "k",
        headers: &NoHeaders,
    };
    u.check_route(&route("amq.topic")).expect("allowed");
    assert!(refused(u.check_route(&route("amq.direct"))).contains("exchange 'amq.direct'"));
    durable(
        e.set_permissions(PermissionDef::full("u", "a"))
            .expect("full"),
    );
    assert!(matches!(
        u.check_route(&route("missing")),
        Err(EngineError::NotFound(_))
    ));
    assert!(!u.exchange_exists("missing"));
    assert!(u.exchange_exists("amq.topic"));
}
