//! Tenant quotas in process (`MemStore`): the count limits refuse with
//! RabbitMQ's texts, and the queued messages/bytes of a tenant block its
//! publishers (the tenant's block signal) without touching another tenant.

use bytes::Bytes;
use std::sync::Arc;
use weir_backend::testing::MemStore;
use weir_engine::client::{GetAck, SubscribeOptions};
use weir_engine::exchange::{ExchangeDef, ExchangeKind, HeaderLookup};
use weir_engine::message::Message;
use weir_engine::permissions::{PermissionDef, UserDef};
use weir_engine::properties::HeaderFormat;
use weir_engine::tenant::{QueueDeclare, RouteInput};
use weir_engine::ManualClock;
use weir_engine::{Client, Engine, EngineError};
use weir_quota::{Limits, QuotaError};

fn engine_with(tenant: &str, limits: Limits) -> Arc<Engine> {
    let e = Engine::open(MemStore::new(), ManualClock::new()).expect("engine");
    let (t, _) = e.add_tenant(tenant).expect("tenant");
    t.set_limits(limits);
    for user in ["u", "other"] {
        let _user_written = e.put_user(UserDef {
            name: user.into(),
            // Any valid hash: these tests never log in.
            password_hash: weir_engine::auth::GUEST_PASSWORD_HASH.into(),
            tags: vec![],
            loopback_only: false,
            from_config: false,
        });
        grant(&e, user, tenant);
        grant(&e, user, weir_engine::DEFAULT_TENANT);
    }
    e
}

/// Full permissions for `user` on `tenant` (permissions are not what
/// these tests are about).
fn grant(e: &Engine, user: &str, tenant: &str) {
    // MemStore's writes are done when appended: nothing to await.
    drop(
        e.set_permissions(PermissionDef::full(user, tenant))
            .expect("permissions"),
    );
}

fn declare(c: &mut Client, name: &str) -> Result<(), EngineError> {
    c.declare_queue(QueueDeclare {
        name: name.into(),
        passive: false,
        durable: false,
        exclusive: false,
        auto_delete: false,
        arguments: serde_json::json!({}),
        connection: c.id(),
    })
    .map(|_| ())
}

struct NoHeaders;
impl HeaderLookup for NoHeaders {
    fn header(&self, _: &str) -> Option<serde_json::Value> {
        None
    }
}

fn publish(c: &mut Client, queue: &str, body: &[u8]) {
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
        body: Bytes::copy_from_slice(body),
        header_format: HeaderFormat::new(1),
        persistent: false,
        priority: 0,
        ttl_ms: None,
    })
    .expect("publish");
    c.commit();
}

#[test]
fn max_queues_refuses_a_new_queue_with_rabbitmqs_text() {
    let e = engine_with(
        "a",
        Limits {
            max_queues: Some(2),
            ..Limits::default()
        },
    );
    let mut c = Client::open(&e, "a", "u").expect("client");
    declare(&mut c, "q1").expect("first");
    declare(&mut c, "q2").expect("second");
    let err = declare(&mut c, "q3").expect_err("over the limit");
    assert!(matches!(err, EngineError::Quota(QuotaError::Queues { .. })));
    assert_eq!(
        err.to_string(),
        "PRECONDITION_FAILED - cannot declare queue 'q3': queue limit in vhost 'a' (2) is reached"
    );
    // Redeclaring an existing queue at the limit is fine.
    declare(&mut c, "q1").expect("redeclare");
    c.delete_queue("q1", false, false).expect("delete");
    declare(&mut c, "q3").expect("room again");
}

#[test]
fn max_exchanges_counts_only_declared_exchanges() {
    let e = engine_with(
        "a",
        Limits {
            max_exchanges: Some(1),
            ..Limits::default()
        },
    );
    let mut c = Client::open(&e, "a", "u").expect("client");
    let def = |name: &str| ExchangeDef {
        name: name.into(),
        kind: ExchangeKind::Direct,
        durable: false,
        auto_delete: false,
        internal: false,
        delayed: false,
        arguments: serde_json::json!({}),
    };
    c.declare_exchange(def("x1"), false)
        .expect("the amq.* exchanges do not count");
    let err = c
        .declare_exchange(def("x2"), false)
        .expect_err("over the limit");
    assert_eq!(
        err.to_string(),
        "PRECONDITION_FAILED - cannot declare exchange 'x2': exchange limit in vhost 'a' (1) is reached"
    );
}

#[test]
fn max_connections_refuses_clients_and_counts_closes() {
    let e = engine_with(
        "a",
        Limits {
            max_connections: Some(2),
            ..Limits::default()
        },
    );
    let c1 = Client::open(&e, "a", "u").expect("first");
    let _c2 = Client::open(&e, "a", "u").expect("second");
    let Err(err) = Client::open(&e, "a", "u") else {
        panic!("a third connection was accepted");
    };
    assert_eq!(
        err.to_string(),
        "NOT_ALLOWED - access to vhost 'a' refused for user 'u': connection limit (2) is reached"
    );
    // Another tenant is not counted against it.
    Client::open(&e, "/", "u").expect("default tenant");
    // A management operation (the HTTP API) is not a connection: allowed
    // at the limit, and closing it gives back nothing it did not take.
    let mut m = Client::open_management(&e, "a", "u").expect("management at the limit");
    declare(&mut m, "q").expect("a management client works");
    drop(m);
    assert!(Client::open(&e, "a", "u").is_err(), "still at the limit");
    drop(c1);
    Client::open(&e, "a", "u").expect("a closed connection gives its place back");
}

#[test]
fn max_consumers_refuses_a_subscription() {
    let e = engine_with(
        "a",
        Limits {
            max_consumers: Some(1),
            ..Limits::default()
        },
    );
    let mut c = Client::open(&e, "a", "u").expect("client");
    declare(&mut c, "q").expect("declare");
    let opts = |tag: &'static str| SubscribeOptions {
        scope: 1,
        tag: Bytes::from_static(tag.as_bytes()),
        exclusive: false,
        no_ack: false,
        prefetch_count: 0,
        prefetch_bytes: 0,
        priority: 0,
    };
    c.subscribe("q", opts("t1")).expect("first");
    let Err(err) = c.subscribe("q", opts("t2")) else {
        panic!("a second consumer was accepted");
    };
    assert_eq!(
        err.to_string(),
        "PRECONDITION_FAILED - cannot add consumer: consumer limit in vhost 'a' (1) is reached"
    );
}

#[test]
fn max_message_size() {
    let e = engine_with(
        "a",
        Limits {
            max_message_size: Some(100),
            ..Limits::default()
        },
    );
    let c = Client::open(&e, "a", "u").expect("client");
    c.check_message_size(100).expect("at the limit");
    assert_eq!(
        c.check_message_size(101).expect_err("over").to_string(),
        "PRECONDITION_FAILED - message size 101 is larger than configured max size 100"
    );
}

#[test]
fn queued_bytes_block_the_tenant_until_drained_and_not_another() {
    let e = engine_with(
        "a",
        Limits {
            max_queued_bytes: Some(1000),
            ..Limits::default()
        },
    );
    e.add_tenant("b").expect("tenant b");
    grant(&e, "u", "b");
    let mut a = Client::open(&e, "a", "u").expect("client a");
    let mut b = Client::open(&e, "b", "u").expect("client b");
    declare(&mut a, "q").expect("declare");
    declare(&mut b, "q").expect("declare");
    let quota = a.tenant_quota().clone();
    let mut blocked = quota.subscribe_blocked();
    for _ in 0..9 {
        publish(&mut a, "q", &[0; 100]);
    }
    assert!(!quota.is_blocked(), "900 of 1000 bytes");
    for _ in 0..20 {
        publish(&mut b, "q", &[0; 100]);
    }
    assert!(!quota.is_blocked(), "tenant b's bytes are its own");
    assert!(!b.tenant_quota().is_blocked());
    publish(&mut a, "q", &[0; 100]);
    assert!(quota.is_blocked(), "at its quota");
    assert!(blocked.has_changed().expect("open"));
    assert!(*blocked.borrow_and_update());
    assert_eq!(quota.queued_messages(), 10);
    assert_eq!(quota.queued_bytes(), 1000);
    // A consumer drains it: unblocked once below the resume mark (900).
    a.get("q", GetAck::Auto).expect("get").expect("a message");
    assert!(quota.is_blocked(), "hysteresis: 900 bytes is not below 900");
    a.get("q", GetAck::Auto).expect("get").expect("a message");
    assert!(!quota.is_blocked());
    assert!(blocked.has_changed().expect("open"));
    assert!(!*blocked.borrow_and_update());
}

#[test]
fn purge_and_delete_give_queued_bytes_back() {
    let e = engine_with(
        "a",
        Limits {
            max_queued_messages: Some(3),
            ..Limits::default()
        },
    );
    let mut a = Client::open(&e, "a", "u").expect("client");
    declare(&mut a, "q1").expect("declare");
    declare(&mut a, "q2").expect("declare");
    let quota = a.tenant_quota().clone();
    publish(&mut a, "q1", b"x");
    publish(&mut a, "q2", b"x");
    publish(&mut a, "q2", b"x");
    assert!(quota.is_blocked());
    a.purge_queue("q2").expect("purge");
    assert_eq!(quota.queued_messages(), 1);
    assert!(!quota.is_blocked(), "below the resume mark (2)");
    a.delete_queue("q1", false, false).expect("delete");
    assert_eq!((quota.queued_messages(), quota.queued_bytes()), (0, 0));
}

#[test]
fn a_users_limits_apply_on_top_of_its_tenants() {
    let e = engine_with("a", Limits::default());
    e.user_quotas.set(
        "u",
        Limits {
            max_connections: Some(1),
            max_message_size: Some(10),
            ..Limits::default()
        },
    );
    let c = Client::open(&e, "a", "u").expect("first");
    // Counted over tenants.
    let Err(err) = Client::open(&e, "/", "u") else {
        panic!("a second connection of the user was accepted");
    };
    assert_eq!(
        err.to_string(),
        "NOT_ALLOWED - Connection refused for user 'u'. User connection limit (1) is reached"
    );
    assert_eq!(
        e.tenant("/").expect("default tenant").quota().connections(),
        0,
        "the refused connection gave its tenant place back"
    );
    assert!(c.check_message_size(11).is_err(), "the user's size limit");
    Client::open(&e, "a", "other").expect("another user is not limited");
    drop(c);
    Client::open(&e, "/", "u").expect("its place is back");
}

/// `max-memory` counts the bytes of ready messages held in memory: a
/// queue's tail beyond the in-memory head (`HOT_ENTRIES`) is paged to the
/// store and does not count; the tenant is blocked at its quota and
/// unblocked below 90 % of it.
#[test]
fn memory_counts_only_what_is_held_in_memory() {
    use weir_engine::queue::HOT_ENTRIES;
    let e = engine_with(
        "a",
        Limits {
            max_memory: Some(30_000),
            ..Limits::default()
        },
    );
    let mut a = Client::open(&e, "a", "u").expect("client");
    declare(&mut a, "deep").expect("declare");
    declare(&mut a, "hot").expect("declare");
    let quota = a.tenant_quota().clone();
    for _ in 0..HOT_ENTRIES {
        publish(&mut a, "deep", &[0; 10]);
    }
    assert_eq!(quota.memory(), HOT_ENTRIES as u64 * 10);
    // Paged out: queued, not in memory.
    for _ in 0..10 {
        publish(&mut a, "deep", &[0; 1000]);
    }
    assert_eq!(quota.memory(), HOT_ENTRIES as u64 * 10);
    assert_eq!(quota.queued_bytes(), HOT_ENTRIES as u64 * 10 + 10_000);
    assert!(!quota.is_blocked());
    // 20,480 + 9 × 1,000 is below 30,000; the tenth reaches it.
    for _ in 0..9 {
        publish(&mut a, "hot", &[0; 1000]);
    }
    assert!(!quota.is_blocked());
    publish(&mut a, "hot", &[0; 1000]);
    assert!(quota.is_blocked(), "at its memory quota");
    assert_eq!(
        quota.block_reason("a"),
        "tenant 'a' memory quota",
        "the reason names the memory quota"
    );
    // Drained below the resume mark (27,000): unblocked.
    a.purge_queue("hot").expect("purge");
    assert!(!quota.is_blocked());
    assert_eq!(quota.memory(), HOT_ENTRIES as u64 * 10);
    a.delete_queue("deep", false, false).expect("delete");
    assert_eq!(quota.memory(), 0);
}
