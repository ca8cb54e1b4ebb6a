//! `Client::set_queue_expires` (issue 25: an MQTT 5 session expiry changed
//! at DISCONNECT), in process with a manual clock: the new `x-expires`
//! acts at once, survives a policy change and a restart (the stored
//! definition is rewritten), and needs configure on the queue.

use serde_json::json;
use std::sync::Arc;
use weir_backend::testing::MemStore;
use weir_engine::permissions::{PermissionDef, UserDef};
use weir_engine::policy::{ApplyTo, PolicyDef};
use weir_engine::tenant::QueueDeclare;
use weir_engine::{Client, Clock, DurableWait, Engine, EngineError, ManualClock, DEFAULT_TENANT};

fn durable(w: DurableWait) {
    w.blocking_recv().expect("store answered").expect("durable");
}

fn declare(c: &mut Client, name: &str, expires_ms: u64) {
    let connection = c.id();
    let (_, wait) = c
        .declare_queue(QueueDeclare {
            name: name.into(),
            passive: false,
            durable: true,
            exclusive: false,
            auto_delete: false,
            arguments: json!({ "x-expires": expires_ms, "x-max-length": 10 }),
            connection,
        })
        .expect("declare");
    if let Some(w) = wait {
        durable(w);
    }
}

fn run_at(e: &Engine, clock: &ManualClock, at_ms: u64) {
    clock.set_ms(at_ms);
    e.run_timers();
}

#[test]
fn a_changed_x_expires_acts_at_once_and_survives_policies_and_restarts() {
    let store = MemStore::new();
    let clock = ManualClock::new();
    let e = Engine::open(store.clone(), clock.clone()).expect("engine");
    let mut c = Client::open(&e, DEFAULT_TENANT, "guest").expect("client");
    declare(&mut c, "raised", 1_000);
    declare(&mut c, "lowered", 300_000);
    if let Some(w) = c.set_queue_expires("raised", Some(300_000)).expect("raise") {
        durable(w);
    }
    if let Some(w) = c.set_queue_expires("lowered", Some(1_000)).expect("lower") {
        durable(w);
    }
    let t = e.tenant(DEFAULT_TENANT).expect("tenant");
    let raised = c.queue("raised").expect("raised");
    assert_eq!(
        t.declared_arguments(&raised),
        json!({ "x-expires": 300_000, "x-max-length": 10 }),
        "the other arguments are kept"
    );
    // A policy change recomputes the arguments from the changed ones.
    let policy = PolicyDef {
        name: "ttl".into(),
        pattern: ".*".into(),
        apply_to: ApplyTo::Queues,
        priority: 0,
        definition: json!({"message-ttl": 60_000})
            .as_object()
            .cloned()
            .expect("object"),
    };
    durable(t.set_policy(policy).expect("policy"));
    assert_eq!(raised.args().expires, Some(300_000));
    // A redeclare with the new value is equivalent.
    declare(&mut c, "raised", 300_000);

    let t0 = clock.now_ms();
    run_at(&e, &clock, t0 + 2_500);
    assert!(c.queue("raised").is_ok(), "raised to 300 s: kept");
    assert!(c.queue("lowered").is_err(), "lowered to 1 s: deleted");

    // A restart reads the rewritten definition.
    c.close();
    drop(raised);
    drop(t);
    drop(e);
    let e = Engine::open(store.reopen(), clock.clone()).expect("reopen");
    let c = Client::open(&e, DEFAULT_TENANT, "guest").expect("client");
    let q = c.queue("raised").expect("raised after the restart");
    assert_eq!(q.args().expires, Some(300_000));
}

#[test]
fn changing_x_expires_needs_configure_and_the_queue() {
    let e = Engine::open(MemStore::new(), ManualClock::new()).expect("engine");
    let hash = weir_engine::auth::hash_password(b"x").expect("hash");
    durable(
        e.put_user(UserDef {
            name: "reader".into(),
            password_hash: hash,
            tags: vec![],
            loopback_only: false,
            from_config: false,
        })
        .expect("user"),
    );
    durable(
        e.set_permissions(PermissionDef {
            user: "reader".into(),
            vhost: DEFAULT_TENANT.into(),
            configure: "^$".into(),
            write: ".*".into(),
            read: ".*".into(),
            from_config: false,
        })
        .expect("permissions"),
    );
    let mut owner = Client::open(&e, DEFAULT_TENANT, "guest").expect("guest");
    declare(&mut owner, "q", 1_000);
    let mut reader = Client::open(&e, DEFAULT_TENANT, "reader").expect("reader");
    assert!(matches!(
        reader.set_queue_expires("q", Some(5_000)),
        Err(EngineError::AccessRefused(_))
    ));
    assert!(matches!(
        owner.set_queue_expires("missing", Some(5_000)),
        Err(EngineError::NotFound(_))
    ));
    let q = owner.queue("q").expect("q");
    assert_eq!(q.args().expires, Some(1_000), "unchanged");
    let _: Arc<_> = q;
}
