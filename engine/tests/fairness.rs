//! Fair shares of the store's writer between tenants (issue 9), through
//! the engine on the real log store: a tenant whose appends would fill the
//! writer's rounds ahead of another tenant's is told so
//! (`Client::take_store_pressure`; its session then waits for a barrier
//! before reading more), the quiet tenant never is, and a tenant alone
//! never is (the single-tenant hot path is untouched). The store's own
//! accounting is tested in `backend/src/log/tests.rs`.

use bytes::Bytes;
use std::sync::Arc;
use std::time::Duration;
use weir_backend::log::{LogOptions, LogStore};
use weir_engine::exchange::HeaderLookup;
use weir_engine::message::Message;
use weir_engine::permissions::{PermissionDef, UserDef};
use weir_engine::properties::HeaderFormat;
use weir_engine::tenant::{QueueDeclare, RouteInput};
use weir_engine::ManualClock;
use weir_engine::{Client, Engine};

struct NoHeaders;

impl HeaderLookup for NoHeaders {
    fn header(&self, _: &str) -> Option<serde_json::Value> {
        None
    }
}

fn engine(dir: &std::path::Path) -> Arc<Engine> {
    let store = LogStore::open(dir, LogOptions::default()).expect("store");
    let e = Engine::open(store, ManualClock::new()).expect("engine");
    let _user_written = e.put_user(UserDef {
        name: "u".into(),
        password_hash: weir_engine::auth::GUEST_PASSWORD_HASH.into(),
        tags: vec![],
        loopback_only: false,
        from_config: false,
    });
    for t in ["hot", "quiet"] {
        e.add_tenant(t).expect("tenant");
        drop(
            e.set_permissions(PermissionDef::full("u", t))
                .expect("permissions"),
        );
    }
    e
}

fn client(e: &Arc<Engine>, tenant: &str) -> Client {
    let mut c = Client::open(e, tenant, "u").expect("client");
    c.declare_queue(QueueDeclare {
        name: "q".into(),
        passive: false,
        durable: true,
        exclusive: false,
        auto_delete: false,
        arguments: serde_json::json!({}),
        connection: c.id(),
    })
    .expect("declare");
    c
}

/// One persistent publish of `size` bytes (stored: a durable queue); what
/// the store said about the tenant's share since the last call.
fn publish(c: &mut Client, size: usize) -> bool {
    let route = RouteInput {
        exchange: "",
        routing_key: "q",
        headers: &NoHeaders,
    };
    c.publish(&route, |id| Message {
        id,
        exchange: Bytes::new(),
        routing_key: Bytes::from_static(b"q"),
        properties: Bytes::new(),
        body: Bytes::from(vec![0u8; size]),
        header_format: HeaderFormat::new(1),
        persistent: true,
        priority: 0,
        ttl_ms: None,
    })
    .expect("publish");
    c.commit();
    c.take_store_pressure()
}

fn barrier(c: &mut Client) {
    let (tx, rx) = std::sync::mpsc::channel();
    c.durability_barrier(Box::new(move |r| {
        let _ = tx.send(r);
    }))
    .expect("barrier");
    rx.recv_timeout(Duration::from_secs(20))
        .expect("waiter called")
        .expect("durable");
}

const BODY: usize = 16 << 10;

#[test]
fn a_flooding_tenant_is_held_to_its_store_share_and_a_quiet_one_is_not() {
    let dir = tempfile::tempdir().expect("tempdir");
    let e = engine(dir.path());
    let mut hot = client(&e, "hot");
    let mut quiet = client(&e, "quiet");

    // Alone, a tenant is never held back, however much it has waiting
    // (unwaited publishes do not wake the writer below 1 MiB).
    for _ in 0..32 {
        assert!(!publish(&mut hot, BODY), "a tenant alone was held back");
    }
    barrier(&mut hot);

    // With a second tenant writing, the flood is told to wait once it
    // holds more than its share; the quiet tenant never is.
    assert!(!publish(&mut quiet, 100));
    let flagged = (0..64).position(|_| publish(&mut hot, BODY));
    assert!(flagged.is_some(), "the flooding tenant was never held back");
    assert!(!publish(&mut quiet, 100), "the quiet tenant was held back");

    // Its session waits for its appends to be durable: then it may go on.
    barrier(&mut hot);
    assert!(!publish(&mut hot, BODY));
}
