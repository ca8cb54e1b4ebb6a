//! Definitions import and the size limits of definitions, in process
//! (issue 20, items 7 and 9): an import is checked whole before anything
//! changes and committed as one metadata batch (one store version), so a
//! restart finds all of it or none; names, arguments, binding keys,
//! policies and tags over their bounds are `PreconditionFailed` (AMQP 406,
//! HTTP 400) from every engine call that creates them.

mod support;

use serde_json::{json, Value};
use std::sync::Arc;
use support::*;
use weir_backend::testing::MemStore;
use weir_backend::Store;
use weir_engine::definitions::{Import, ImportedQueue};
use weir_engine::exchange::{ExchangeDef, ExchangeKind};
use weir_engine::meta::{BindingDef, DestinationKind};
use weir_engine::policy::{ApplyTo, PolicyDef};
use weir_engine::ManualClock;
use weir_engine::{Engine, EngineError, DEFAULT_TENANT};

fn doc(n: usize) -> Import {
    let v = || DEFAULT_TENANT.to_string();
    Import {
        tenants: vec!["other".into()],
        exchanges: vec![(
            v(),
            ExchangeDef {
                durable: true,
                ..xdef("imp-x", ExchangeKind::Direct)
            },
        )],
        queues: (0..n)
            .map(|i| {
                (
                    v(),
                    ImportedQueue {
                        name: format!("imp-{i}"),
                        durable: true,
                        auto_delete: false,
                        arguments: json!({}),
                    },
                )
            })
            .chain([(
                "other".to_string(),
                ImportedQueue {
                    name: "in-other".into(),
                    durable: true,
                    auto_delete: false,
                    arguments: json!({"x-max-length": 5}),
                },
            )])
            .collect(),
        bindings: (0..n)
            .map(|i| {
                (
                    v(),
                    BindingDef {
                        source: "imp-x".into(),
                        destination_kind: DestinationKind::Queue,
                        destination: format!("imp-{i}"),
                        key: format!("k{i}"),
                        arguments: json!({}),
                    },
                )
            })
            .collect(),
        policies: vec![(
            v(),
            PolicyDef {
                name: "limit".into(),
                pattern: "^imp-".into(),
                apply_to: ApplyTo::Queues,
                priority: 0,
                definition: serde_json::from_value(json!({"max-length": 10})).unwrap(),
            },
        )],
        ..Import::default()
    }
}

fn meta_version(store: &MemStore) -> u64 {
    store.recovered_meta().expect("meta").version
}

#[test]
fn an_import_is_one_metadata_batch_and_survives_a_restart() {
    let store = MemStore::new();
    let e = Engine::open(store.clone(), ManualClock::new()).expect("open");
    let before = meta_version(&store);
    e.import(doc(200)).expect("import");
    assert_eq!(
        meta_version(&store),
        before + 1,
        "one batch, not one write per item"
    );
    let t = e.tenant(DEFAULT_TENANT).expect("tenant");
    assert_eq!(t.queues().len(), 200);
    assert_eq!(t.exchange("imp-x").expect("x").binding_count(), 200);
    assert!(e
        .tenant("other")
        .is_some_and(|o| o.queue_named("in-other").is_some()));
    drop(e);
    let e = Engine::open(store.reopen(), ManualClock::new()).expect("reopen");
    let t = e.tenant(DEFAULT_TENANT).expect("tenant");
    assert_eq!(t.queues().len(), 200);
    assert_eq!(t.exchange("imp-x").expect("x").binding_count(), 200);
    assert_eq!(t.policies().len(), 1);
    assert!(e
        .tenant("other")
        .is_some_and(|o| o.queue_named("in-other").is_some()));
    // A second import of the same document changes nothing and is fine.
    e.import(doc(200)).expect("reimport");
    assert_eq!(t.queues().len(), 200);
}

#[test]
fn a_refused_import_changes_nothing() {
    let refusals: Vec<(Import, &str)> = vec![
        (
            {
                let mut d = doc(10);
                d.bindings[9].1.destination = "missing".into();
                d
            },
            "no queue 'missing'",
        ),
        (
            {
                let mut d = doc(10);
                d.queues[3].1.arguments = json!({"x-max-length": "ten"});
                d
            },
            "x-max-length",
        ),
        (
            {
                let mut d = doc(10);
                d.queues[5].1.name = "q".repeat(300);
                d
            },
            "at most 255",
        ),
        (
            {
                let mut d = doc(10);
                d.bindings[2].1.arguments = json!({"x-big": "a".repeat(20_000)});
                d
            },
            "more than 16384 bytes",
        ),
    ];
    for (d, why) in refusals {
        let store = MemStore::new();
        let e = Engine::open(store.clone(), ManualClock::new()).expect("open");
        let before = store.recovered_meta().expect("meta").meta;
        let err = e.import(d).expect_err("refused");
        assert!(err.to_string().contains(why), "{err} (wanted {why})");
        assert_eq!(store.recovered_meta().expect("meta").meta, before, "{why}");
        let t = e.tenant(DEFAULT_TENANT).expect("tenant");
        assert!(t.queues().is_empty(), "{why}: queues left");
        assert!(t.exchange("imp-x").is_err(), "{why}: exchange left");
        assert!(t.policies().is_empty(), "{why}: policy left");
        assert!(e.tenant("other").is_none(), "{why}: tenant left");
    }
}

#[test]
fn an_import_must_agree_with_existing_definitions() {
    let te = engine();
    let t = te.tenant();
    t.declare_queue(weir_engine::tenant::QueueDeclare {
        durable: true,
        ..qdecl("imp-0")
    })
    .expect("declare");
    let mut d = doc(3);
    d.queues[0].1.arguments = json!({"x-max-length": 1});
    let err = te.engine.import(d).expect_err("inequivalent");
    assert!(
        matches!(err, EngineError::PreconditionFailed(ref m) if m.contains("inequivalent arg 'x-max-length'")),
        "{err}"
    );
    assert_eq!(t.queues().len(), 1);
}

fn precondition(r: Result<impl std::fmt::Debug, EngineError>, text: &str) {
    match r {
        Err(EngineError::PreconditionFailed(m)) => assert!(m.contains(text), "{m}"),
        other => panic!("expected PreconditionFailed({text}), got {other:?}"),
    }
}

#[test]
fn declares_over_the_size_limits_are_refused() {
    let te = engine();
    let t = te.tenant();
    let big = json!({ "x-big": "a".repeat(20_000) });
    precondition(
        t.declare_queue(weir_engine::tenant::QueueDeclare {
            arguments: big.clone(),
            ..qdecl("q")
        }),
        "arguments of queue 'q' in vhost '/' take more than 16384 bytes",
    );
    let many: serde_json::Map<String, Value> =
        (0..200).map(|i| (format!("k{i}"), json!(i))).collect();
    precondition(
        t.declare_exchange(
            ExchangeDef {
                arguments: Value::Object(many),
                ..xdef("x", ExchangeKind::Direct)
            },
            false,
        ),
        "have 200 entries: at most 128",
    );
    precondition(t.declare_queue(qdecl(&"n".repeat(256))), "at most 255");
    precondition(
        t.declare_exchange(xdef(&"n".repeat(256), ExchangeKind::Topic), false),
        "at most 255",
    );
    queue(&t, "small");
    precondition(
        t.bind(
            "amq.direct",
            DestinationKind::Queue,
            "small",
            "k",
            big.clone(),
            CONN,
        ),
        "arguments of binding",
    );
    precondition(
        t.set_policy(PolicyDef {
            name: "p".into(),
            pattern: ".*".into(),
            apply_to: ApplyTo::All,
            priority: 0,
            definition: serde_json::from_value(big).unwrap(),
        }),
        "policy 'p'",
    );
    precondition(
        te.engine.add_tenant(&"v".repeat(300)).map(|_| ()),
        "vhost name",
    );
    assert_eq!(t.queues().len(), 1, "only 'small' was declared");
    let _: Arc<Engine> = te.engine.clone();
}
