//! Routing through the tenant API, in process: the default exchange, direct,
//! fanout, topic and headers exchanges, exchange-to-exchange bindings,
//! unbinding, and how deletes and auto-delete change what routes where.
//!
//! The tables are those of the conformance scenarios (which RabbitMQ
//! answers the same way), so a routing rule is checked here in microseconds
//! and its agreement with RabbitMQ there; the black-box suite keeps one
//! publish-and-consume per client library.

mod support;

use serde_json::{json, Value};
use support::*;
use weir_engine::exchange::ExchangeKind;
use weir_engine::tenant::QueueDeclare;

#[test]
fn default_exchange_routes_by_queue_name_and_drops_the_unknown() {
    let e = engine();
    let t = e.tenant();
    queue(&t, "work");
    queue(&t, "other");
    assert_eq!(route(&t, "", "work"), ["work"]);
    // Unroutable: no queue, no error (a publisher gets its confirm).
    assert!(route(&t, "", "no-such-queue").is_empty());
    // The default exchange exists for a passive declare only.
    assert!(t
        .declare_exchange(xdef("", ExchangeKind::Direct), true)
        .is_ok());
}

#[test]
fn direct_routes_by_exact_key_and_unbind_stops_only_that_key() {
    let e = engine();
    let t = e.tenant();
    exchange(&t, "x", ExchangeKind::Direct);
    for (q, keys) in [("a", &["a"][..]), ("b", &["b"]), ("ab", &["a", "b"])] {
        queue(&t, q);
        for k in keys {
            bind(&t, q, "x", k);
        }
    }
    assert_eq!(route(&t, "x", "a"), ["a", "ab"]);
    assert_eq!(route(&t, "x", "b"), ["ab", "b"]);
    assert!(route(&t, "x", "c").is_empty());
    // The same binding twice is one binding.
    bind(&t, "a", "x", "a");
    assert_eq!(route(&t, "x", "a"), ["a", "ab"]);

    unbind(&t, "ab", "x", "a");
    assert_eq!(route(&t, "x", "a"), ["a"]);
    assert_eq!(route(&t, "x", "b"), ["ab", "b"]);
    // Unbinding what is not bound succeeds and changes nothing.
    unbind(&t, "ab", "x", "a");
    assert_eq!(route(&t, "x", "b"), ["ab", "b"]);
}

#[test]
fn fanout_ignores_keys() {
    let e = engine();
    let t = e.tenant();
    exchange(&t, "f", ExchangeKind::Fanout);
    for (i, q) in ["q0", "q1", "q2"].iter().enumerate() {
        queue(&t, q);
        bind(&t, q, "f", &format!("ignored-{i}"));
    }
    assert_eq!(route(&t, "f", "any.key"), ["q0", "q1", "q2"]);
    assert_eq!(route(&t, "f", ""), ["q0", "q1", "q2"]);
}

/// The keys every topic pattern below is tried against.
const TOPIC_KEYS: &[&str] = &[
    "quick.orange.rabbit",
    "lazy.orange.elephant",
    "quick.orange.fox",
    "lazy.brown.fox",
    "lazy.pink.rabbit",
    "quick.brown.fox",
    "orange",
    "quick.orange.male.rabbit",
    "lazy.orange.male.rabbit",
    "lazy",
    "end",
    "x.y.end",
    "a.b",
    "a.x.y.b",
    "ab",
    "",
    ".orange.",
];

#[test]
fn topic_star_is_one_word_and_hash_is_zero_or_more() {
    let table: &[(&str, &[&str])] = &[
        (
            "*.orange.*",
            &[
                "quick.orange.rabbit",
                "lazy.orange.elephant",
                "quick.orange.fox",
                ".orange.",
            ],
        ),
        ("*.*.rabbit", &["quick.orange.rabbit", "lazy.pink.rabbit"]),
        (
            "lazy.#",
            &[
                "lazy.orange.elephant",
                "lazy.brown.fox",
                "lazy.pink.rabbit",
                "lazy.orange.male.rabbit",
                "lazy",
            ],
        ),
        ("#.end", &["end", "x.y.end"]),
        ("a.#.b", &["a.b", "a.x.y.b"]),
        ("quick.orange.rabbit", &["quick.orange.rabbit"]),
        ("#", TOPIC_KEYS),
    ];
    let e = engine();
    let t = e.tenant();
    exchange(&t, "topic", ExchangeKind::Topic);
    for (i, (pattern, _)) in table.iter().enumerate() {
        let q = format!("q{i}");
        queue(&t, &q);
        bind(&t, &q, "topic", pattern);
    }
    for (i, (pattern, want)) in table.iter().enumerate() {
        let q = format!("q{i}");
        let got: Vec<&str> = TOPIC_KEYS
            .iter()
            .copied()
            .filter(|k| route(&t, "topic", k).contains(&q))
            .collect();
        assert_eq!(got, *want, "keys matching {pattern:?}");
    }
}

#[test]
fn headers_match_all_any_and_exact_types() {
    let bindings: &[(&str, Value)] = &[
        ("all_ab", json!({"x-match": "all", "a": "1", "b": "2"})),
        ("any_ab", json!({"x-match": "any", "a": "1", "b": "2"})),
        // x-match defaults to all.
        ("default_is_all", json!({"a": "1", "b": "2"})),
        // No header to compare: every message matches `all`.
        ("all_empty", json!({"x-match": "all"})),
    ];
    let messages: &[(&str, Value)] = &[
        ("both", json!({"a": "1", "b": "2"})),
        ("only_a", json!({"a": "1"})),
        ("only_b", json!({"b": "2"})),
        ("a_wrong", json!({"a": "9", "b": "2"})),
        ("extra", json!({"a": "1", "b": "2", "c": "3"})),
        ("none", json!({})),
        // The integer 1 is not the string "1".
        ("int_a", json!({"a": 1, "b": "2"})),
    ];
    let want: &[(&str, &[&str])] = &[
        ("all_ab", &["both", "extra"]),
        (
            "any_ab",
            &["both", "only_a", "only_b", "a_wrong", "extra", "int_a"],
        ),
        ("default_is_all", &["both", "extra"]),
        (
            "all_empty",
            &[
                "both", "only_a", "only_b", "a_wrong", "extra", "none", "int_a",
            ],
        ),
    ];
    let e = engine();
    let t = e.tenant();
    exchange(&t, "h", ExchangeKind::Headers);
    for (q, args) in bindings {
        queue(&t, q);
        bind_args(&t, q, "h", "", args.clone());
    }
    for (q, expected) in want {
        let got: Vec<&str> = messages
            .iter()
            .filter(|(_, h)| {
                let headers = Headers(h.as_object().expect("an object").clone());
                try_route(&t, "h", "key-ignored", &headers)
                    .expect("route")
                    .iter()
                    .any(|n| n == q)
            })
            .map(|(name, _)| *name)
            .collect();
        assert_eq!(got, *expected, "messages reaching {q}");
    }
}

#[test]
fn exchange_to_exchange_keeps_the_routing_key_and_survives_cycles() {
    let e = engine();
    let t = e.tenant();
    exchange(&t, "src", ExchangeKind::Topic);
    exchange(&t, "mid", ExchangeKind::Fanout);
    exchange(&t, "leaf", ExchangeKind::Direct);
    bind_x(&t, "mid", "src", "a.#");
    bind_x(&t, "leaf", "mid", "");
    for q in ["q.src", "q.mid", "q.leaf"] {
        queue(&t, q);
    }
    bind(&t, "q.src", "src", "#");
    bind(&t, "q.mid", "mid", "");
    bind(&t, "q.leaf", "leaf", "a.x");

    // The key is the publish's at every hop: leaf (direct) sees "a.x".
    assert_eq!(route(&t, "src", "a.x"), ["q.leaf", "q.mid", "q.src"]);
    assert_eq!(route(&t, "src", "a.y"), ["q.mid", "q.src"]);
    assert_eq!(route(&t, "src", "b.x"), ["q.src"]);

    // A cycle neither loops nor delivers twice.
    bind_x(&t, "src", "leaf", "a.x");
    assert_eq!(route(&t, "src", "a.x"), ["q.leaf", "q.mid", "q.src"]);
    assert_eq!(route(&t, "leaf", "a.x"), ["q.leaf", "q.mid", "q.src"]);

    // exchange.unbind cuts the path.
    t.unbind(
        "src",
        weir_engine::meta::DestinationKind::Exchange,
        "mid",
        "a.#",
        json!({}),
        CONN,
    )
    .expect("exchange.unbind");
    assert_eq!(route(&t, "src", "a.z"), ["q.src"]);
}

#[test]
fn a_queue_reached_by_several_paths_gets_the_message_once() {
    let e = engine();
    let t = e.tenant();
    exchange(&t, "src", ExchangeKind::Direct);
    exchange(&t, "fan", ExchangeKind::Fanout);
    exchange(&t, "top", ExchangeKind::Topic);
    bind_x(&t, "fan", "src", "k");
    bind_x(&t, "top", "src", "k");
    queue(&t, "q");
    bind(&t, "q", "src", "k");
    bind(&t, "q", "fan", "");
    bind(&t, "q", "top", "#");
    bind(&t, "q", "top", "k");
    assert_eq!(route(&t, "src", "k"), ["q"]);
}

#[test]
fn internal_exchanges_route_only_from_other_exchanges() {
    let e = engine();
    let t = e.tenant();
    exchange(&t, "front", ExchangeKind::Fanout);
    t.declare_exchange(
        weir_engine::exchange::ExchangeDef {
            internal: true,
            delayed: false,
            ..xdef("inner", ExchangeKind::Fanout)
        },
        false,
    )
    .expect("declaring an internal exchange");
    bind_x(&t, "inner", "front", "");
    queue(&t, "q");
    bind(&t, "q", "inner", "");
    assert_eq!(route(&t, "front", "k"), ["q"]);
    assert!(matches!(
        try_route(&t, "inner", "k", &no_headers()),
        Err(weir_engine::EngineError::AccessRefused(_))
    ));
}

#[test]
fn deleting_a_queue_removes_its_bindings_even_from_a_namesake() {
    let e = engine();
    let t = e.tenant();
    exchange(&t, "x", ExchangeKind::Direct);
    queue(&t, "q");
    queue(&t, "stays");
    bind(&t, "q", "x", "k");
    bind(&t, "stays", "x", "k");
    assert_eq!(
        t.delete_queue("q", false, false, CONN).expect("delete").0,
        0
    );
    assert_eq!(route(&t, "x", "k"), ["stays"]);
    assert!(route(&t, "", "q").is_empty());
    // A new queue of the same name starts unbound.
    queue(&t, "q");
    assert_eq!(route(&t, "x", "k"), ["stays"]);
    assert_eq!(route(&t, "", "q"), ["q"]);
}

#[test]
fn deleting_an_exchange_removes_the_bindings_to_it() {
    let e = engine();
    let t = e.tenant();
    exchange(&t, "src", ExchangeKind::Fanout);
    exchange(&t, "dst", ExchangeKind::Fanout);
    bind_x(&t, "dst", "src", "");
    queue(&t, "via-dst");
    queue(&t, "direct");
    bind(&t, "via-dst", "dst", "");
    bind(&t, "direct", "src", "");
    t.delete_exchange("dst", false).expect("exchange.delete");
    assert_eq!(route(&t, "src", "k"), ["direct"]);
    // Redeclared, it has no bindings in either direction.
    exchange(&t, "dst", ExchangeKind::Fanout);
    assert_eq!(route(&t, "src", "k"), ["direct"]);
    assert!(route(&t, "dst", "k").is_empty());
}

#[test]
fn auto_delete_exchange_goes_with_its_last_binding_only() {
    let e = engine();
    let t = e.tenant();
    t.declare_exchange(
        weir_engine::exchange::ExchangeDef {
            auto_delete: true,
            ..xdef("ad", ExchangeKind::Fanout)
        },
        false,
    )
    .expect("declare");
    // Never bound: an unrelated queue's delete must not take it (a bug once).
    queue(&t, "unrelated");
    t.delete_queue("unrelated", false, false, CONN)
        .expect("delete");
    assert!(exchange_exists(&t, "ad"));

    queue(&t, "q1");
    queue(&t, "q2");
    bind(&t, "q1", "ad", "");
    bind(&t, "q2", "ad", "");
    unbind(&t, "q1", "ad", "");
    assert!(exchange_exists(&t, "ad"), "one binding left");
    // Deleting the bound queue removes the last binding: the exchange goes.
    t.delete_queue("q2", false, false, CONN).expect("delete");
    assert!(!exchange_exists(&t, "ad"));
}

#[test]
fn a_long_auto_delete_exchange_chain_cascades_without_recursion() {
    // Each exchange is bound to the next; deleting the last leaves its
    // predecessor without bindings, and so on down to the head. 20,000
    // stack frames would overflow a thread's stack (a bug once).
    const CHAIN: usize = 20_000;
    let e = engine();
    let t = e.tenant();
    let name = |i: usize| format!("chain.{i}");
    for i in 0..CHAIN {
        t.declare_exchange(
            weir_engine::exchange::ExchangeDef {
                auto_delete: true,
                ..xdef(&name(i), ExchangeKind::Fanout)
            },
            false,
        )
        .expect("declare");
    }
    for i in 0..CHAIN - 1 {
        bind_x(&t, &name(i + 1), &name(i), "");
    }
    t.delete_exchange(&name(CHAIN - 1), false)
        .expect("deleting the chain's end");
    assert!(!exchange_exists(&t, &name(0)), "the head was auto-deleted");
    assert!(!exchange_exists(&t, &name(CHAIN / 2)));
}

#[test]
fn exclusive_queues_go_with_their_connection_and_others_stay() {
    let e = engine();
    let t = e.tenant();
    t.declare_queue(QueueDeclare {
        exclusive: true,
        ..qdecl("mine")
    })
    .expect("declare exclusive");
    t.declare_queue(QueueDeclare {
        exclusive: true,
        connection: OTHER,
        ..qdecl("theirs")
    })
    .expect("declare exclusive");
    queue(&t, "shared");
    t.connection_closed(CONN);
    assert!(!queue_exists(&t, "mine"));
    assert!(queue_exists(&t, "shared"));
    assert!(matches!(
        t.queue("theirs", OTHER),
        Ok(q) if q.name() == "theirs"
    ));
}

#[test]
fn server_named_queues_are_distinct_and_routable() {
    let e = engine();
    let t = e.tenant();
    let a = queue(&t, "").name;
    let b = queue(&t, "").name;
    assert!(
        a.starts_with("amq.gen-") && a.len() > "amq.gen-".len(),
        "{a}"
    );
    assert_ne!(a, b);
    assert_eq!(route(&t, "", &a), std::slice::from_ref(&a));
}
