//! The engine's errors, in process: which operation fails with which
//! [`EngineError`] kind (the AMQP adapter maps NotFound to 404,
//! AccessRefused to 403, ResourceLocked to 405, PreconditionFailed to 406;
//! the black-box suite checks that mapping once), RabbitMQ's error texts,
//! and the operations that succeed where one might expect an error.

mod support;

use serde_json::json;
use support::*;
use weir_engine::exchange::{ExchangeDef, ExchangeKind};
use weir_engine::meta::DestinationKind;
use weir_engine::tenant::QueueDeclare;
use weir_engine::EngineError;

/// Asserts `r` failed with the error kind `kind` (a pattern).
macro_rules! assert_err {
    ($r:expr, $kind:pat) => {
        match $r {
            Err($kind) => {}
            Err(other) => panic!("expected {}, got {other:?}", stringify!($kind)),
            Ok(_) => panic!("expected {}, got Ok", stringify!($kind)),
        }
    };
}

#[test]
fn missing_queues_and_exchanges_are_not_found() {
    let e = engine();
    let t = e.tenant();
    queue(&t, "q");
    exchange(&t, "x", ExchangeKind::Direct);
    let passive_q = QueueDeclare {
        passive: true,
        ..qdecl("missing-q")
    };
    assert_err!(t.declare_queue(passive_q), EngineError::NotFound(_));
    assert_err!(
        t.declare_exchange(xdef("missing-x", ExchangeKind::Direct), true),
        EngineError::NotFound(_)
    );
    // consume, get and purge look the queue up the same way.
    assert_err!(t.queue("missing-q", CONN), EngineError::NotFound(_));
    assert_err!(t.purge_queue("missing-q", CONN), EngineError::NotFound(_));
    // Either end of a binding.
    let no_args = || json!({});
    assert_err!(
        t.bind(
            "missing-x",
            DestinationKind::Queue,
            "q",
            "k",
            no_args(),
            CONN
        ),
        EngineError::NotFound(_)
    );
    assert_err!(
        t.bind(
            "amq.direct",
            DestinationKind::Queue,
            "missing-q",
            "k",
            no_args(),
            CONN
        ),
        EngineError::NotFound(_)
    );
    assert_err!(
        t.bind(
            "x",
            DestinationKind::Exchange,
            "missing-x",
            "k",
            no_args(),
            CONN
        ),
        EngineError::NotFound(_)
    );
    // Unbinding from a missing exchange is not an error (RabbitMQ's
    // idempotent teardown): deleting_or_unbinding_what_is_not_there_succeeds.
    // Publishing to a missing exchange (the default exchange never is).
    assert_err!(
        try_route(&t, "missing-x", "k", &no_headers()),
        EngineError::NotFound(_)
    );
}

#[test]
fn not_found_texts_follow_rabbitmq() {
    let e = engine();
    let t = e.tenant();
    let err = t.queue("nope", CONN).err().expect("missing queue");
    assert_eq!(err.to_string(), "NOT_FOUND - no queue 'nope' in vhost '/'");
    let err = t.exchange("nope").err().expect("missing exchange");
    assert_eq!(
        err.to_string(),
        "NOT_FOUND - no exchange 'nope' in vhost '/'"
    );
}

#[test]
fn deleting_or_unbinding_what_is_not_there_succeeds() {
    let e = engine();
    let t = e.tenant();
    assert_eq!(
        t.delete_queue("missing-q", false, false, CONN)
            .expect("queue.delete of a missing queue")
            .0,
        0
    );
    t.delete_exchange("missing-x", false)
        .expect("exchange.delete of a missing exchange");
    exchange(&t, "x", ExchangeKind::Direct);
    queue(&t, "q");
    t.unbind(
        "x",
        DestinationKind::Queue,
        "q",
        "never-bound",
        json!({}),
        CONN,
    )
    .expect("unbinding a missing binding");
    // A missing source or destination too, as in RabbitMQ (issue 11).
    for (source, kind, dest) in [
        ("missing-x", DestinationKind::Queue, "q"),
        ("x", DestinationKind::Queue, "missing-q"),
        ("x", DestinationKind::Exchange, "missing-x"),
        ("missing-x", DestinationKind::Exchange, "x"),
    ] {
        t.unbind(source, kind, dest, "k", json!({}), CONN)
            .unwrap_or_else(|e| panic!("unbind {source} -> {dest}: {e}"));
    }
}

#[test]
fn reserved_names_and_the_default_exchange_are_access_refused() {
    let e = engine();
    let t = e.tenant();
    queue(&t, "q");
    assert_err!(
        t.declare_exchange(xdef("amq.mine", ExchangeKind::Direct), false),
        EngineError::AccessRefused(_)
    );
    assert_err!(
        t.declare_exchange(xdef("", ExchangeKind::Direct), false),
        EngineError::AccessRefused(_)
    );
    assert_err!(
        t.delete_exchange("amq.direct", false),
        EngineError::AccessRefused(_)
    );
    assert_err!(t.delete_exchange("", false), EngineError::AccessRefused(_));
    assert_err!(
        t.declare_queue(qdecl("amq.q")),
        EngineError::AccessRefused(_)
    );
    // Binding to or from the default exchange.
    assert_err!(
        t.bind("", DestinationKind::Queue, "q", "other", json!({}), CONN),
        EngineError::AccessRefused(_)
    );
    exchange(&t, "x", ExchangeKind::Direct);
    assert_err!(
        t.bind("x", DestinationKind::Exchange, "", "k", json!({}), CONN),
        EngineError::AccessRefused(_)
    );
    // The standard exchanges exist with their types, for passive declares
    // and for redeclares that match.
    for (name, kind) in [
        ("amq.direct", ExchangeKind::Direct),
        ("amq.fanout", ExchangeKind::Fanout),
        ("amq.topic", ExchangeKind::Topic),
        ("amq.headers", ExchangeKind::Headers),
        ("amq.match", ExchangeKind::Headers),
    ] {
        t.declare_exchange(xdef(name, kind), true)
            .unwrap_or_else(|err| panic!("passive declare of {name}: {err}"));
        t.declare_exchange(
            ExchangeDef {
                durable: true,
                ..xdef(name, kind)
            },
            false,
        )
        .unwrap_or_else(|err| panic!("equivalent redeclare of {name}: {err}"));
    }
}

#[test]
fn another_connections_exclusive_queue_is_locked() {
    let e = engine();
    let t = e.tenant();
    t.declare_queue(QueueDeclare {
        exclusive: true,
        ..qdecl("excl")
    })
    .expect("declare exclusive");
    let as_other = |q: QueueDeclare| QueueDeclare {
        connection: OTHER,
        ..q
    };
    // declare (exclusive or passive), consume/get (the lookup), purge,
    // delete and bind from another connection.
    assert_err!(
        t.declare_queue(as_other(QueueDeclare {
            exclusive: true,
            ..qdecl("excl")
        })),
        EngineError::ResourceLocked(_)
    );
    assert_err!(
        t.declare_queue(as_other(QueueDeclare {
            passive: true,
            ..qdecl("excl")
        })),
        EngineError::ResourceLocked(_)
    );
    assert_err!(t.queue("excl", OTHER), EngineError::ResourceLocked(_));
    assert_err!(t.purge_queue("excl", OTHER), EngineError::ResourceLocked(_));
    assert_err!(
        t.delete_queue("excl", false, false, OTHER),
        EngineError::ResourceLocked(_)
    );
    assert_err!(
        t.bind(
            "amq.direct",
            DestinationKind::Queue,
            "excl",
            "k",
            json!({}),
            OTHER
        ),
        EngineError::ResourceLocked(_)
    );
    // The owner may do all of it; redeclaring without `exclusive` is a lock
    // conflict even for the owner, as in RabbitMQ.
    t.queue("excl", CONN).expect("owner's lookup");
    t.bind(
        "amq.direct",
        DestinationKind::Queue,
        "excl",
        "k",
        json!({}),
        CONN,
    )
    .expect("owner's bind");
    assert_err!(
        t.declare_queue(qdecl("excl")),
        EngineError::ResourceLocked(_)
    );
    t.delete_queue("excl", false, false, CONN)
        .expect("owner's delete");
    assert!(!queue_exists(&t, "excl"));
}

#[test]
fn inequivalent_queue_redeclares_are_precondition_failed() {
    let e = engine();
    let t = e.tenant();
    let original = QueueDeclare {
        durable: true,
        arguments: json!({"x-max-length": 10}),
        ..qdecl("q")
    };
    t.declare_queue(original.clone()).expect("declare");
    // The same declare again is fine, and answers the counts.
    let (again, _) = t.declare_queue(original.clone()).expect("equivalent");
    assert_eq!(
        (again.name.as_str(), again.messages, again.consumers),
        ("q", 0, 0)
    );
    assert_err!(
        t.declare_queue(QueueDeclare {
            durable: false,
            ..original.clone()
        }),
        EngineError::PreconditionFailed(_)
    );
    assert_err!(
        t.declare_queue(QueueDeclare {
            auto_delete: true,
            ..original.clone()
        }),
        EngineError::PreconditionFailed(_)
    );
    let err = t
        .declare_queue(QueueDeclare {
            arguments: json!({"x-max-length": 20}),
            ..original.clone()
        })
        .expect_err("x-max-length differs");
    assert_eq!(
        err.to_string(),
        "PRECONDITION_FAILED - inequivalent arg 'x-max-length' for queue 'q' in vhost '/': received '20' but current is '10'"
    );
    // A passive declare ignores every flag.
    t.declare_queue(QueueDeclare {
        passive: true,
        ..qdecl("q")
    })
    .expect("passive");
    // Unchecked arguments do not count; x-queue-type "classic" equals absent.
    t.declare_queue(QueueDeclare {
        arguments: json!({"x-max-length": 10, "x-queue-type": "classic", "x-custom": 1}),
        ..original
    })
    .expect("equivalent arguments");
    // An unknown queue type is refused at creation.
    assert_err!(
        t.declare_queue(QueueDeclare {
            arguments: json!({"x-queue-type": "stream-of-consciousness"}),
            ..qdecl("q2")
        }),
        EngineError::PreconditionFailed(_)
    );
}

#[test]
fn inequivalent_exchange_redeclares_are_precondition_failed() {
    let e = engine();
    let t = e.tenant();
    exchange(&t, "x", ExchangeKind::Direct);
    exchange(&t, "x", ExchangeKind::Direct);
    let err = t
        .declare_exchange(xdef("x", ExchangeKind::Fanout), false)
        .expect_err("type differs");
    assert_eq!(
        err.to_string(),
        "PRECONDITION_FAILED - inequivalent arg 'type' for exchange 'x' in vhost '/': received 'fanout' but current is 'direct'"
    );
    for def in [
        ExchangeDef {
            durable: true,
            ..xdef("x", ExchangeKind::Direct)
        },
        ExchangeDef {
            auto_delete: true,
            ..xdef("x", ExchangeKind::Direct)
        },
        ExchangeDef {
            internal: true,
            delayed: false,
            ..xdef("x", ExchangeKind::Direct)
        },
    ] {
        assert_err!(
            t.declare_exchange(def, false),
            EngineError::PreconditionFailed(_)
        );
    }
    // A passive declare does not compare.
    t.declare_exchange(xdef("x", ExchangeKind::Topic), true)
        .expect("passive");
}

#[test]
fn conditional_deletes_are_precondition_failed_when_the_condition_fails() {
    let e = engine();
    let t = e.tenant();
    exchange(&t, "x", ExchangeKind::Fanout);
    queue(&t, "q");
    bind(&t, "q", "x", "");
    assert_err!(
        t.delete_exchange("x", true),
        EngineError::PreconditionFailed(_)
    );
    assert!(exchange_exists(&t, "x"));
    // An exchange bound only as a destination is not "in use".
    exchange(&t, "dest-only", ExchangeKind::Fanout);
    bind_x(&t, "dest-only", "x", "");
    t.delete_exchange("dest-only", true)
        .expect("if-unused delete of an exchange with no bindings of its own");
    unbind(&t, "q", "x", "");
    t.delete_exchange("x", true)
        .expect("if-unused delete once unbound");
    // if-empty and if-unused on an empty queue without consumers.
    assert_eq!(
        t.delete_queue("q", true, true, CONN)
            .expect("conditional delete")
            .0,
        0
    );
}

#[test]
fn errors_leave_the_state_as_it_was() {
    let e = engine();
    let t = e.tenant();
    exchange(&t, "x", ExchangeKind::Direct);
    queue(&t, "q");
    bind(&t, "q", "x", "k");
    let _ = t.declare_exchange(xdef("x", ExchangeKind::Fanout), false);
    let _ = t.declare_queue(QueueDeclare {
        durable: true,
        ..qdecl("q")
    });
    let _ = t.delete_exchange("x", true);
    let _ = t.bind("x", DestinationKind::Queue, "missing", "k", json!({}), CONN);
    assert_eq!(route(&t, "x", "k"), ["q"]);
    assert!(matches!(
        t.exchange("x"),
        Ok(x) if x.def.kind == ExchangeKind::Direct
    ));
    assert!(matches!(t.queue("q", CONN), Ok(q) if !q.def.durable));
}
