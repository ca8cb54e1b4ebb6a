//! Retained messages (MQTT), in process: set, replace and clear; lookup by
//! filter with wildcards and the `$`-topic rule; the bounds; expiry; the
//! durability wait; and recovery after a restart, on the in-memory store
//! and on the real log store in a temp dir.

use bytes::Bytes;
use std::sync::Arc;
use weir_backend::log::{LogOptions, LogStore};
use weir_backend::testing::MemStore;
use weir_backend::{Op, Store};
use weir_engine::message::now_ms;
use weir_engine::properties::{HeaderFormat, MessageHeader};
use weir_engine::retained::{RetainError, RetainedLimits, RetainedMessage};
use weir_engine::{DurableWait, Engine, Tenant, DEFAULT_TENANT};

const NOW: u64 = 1_000_000;

fn header(tag: u8) -> MessageHeader {
    MessageHeader::new(HeaderFormat::Mqtt, Bytes::from(vec![tag]))
}

fn tenant(e: &Engine) -> Arc<Tenant> {
    e.tenant(DEFAULT_TENANT).expect("default tenant")
}

fn durable(w: DurableWait) {
    w.blocking_recv().expect("store answered").expect("durable");
}

/// Sets `topic` to `body` (no expiry), waiting until durable.
fn set(t: &Tenant, topic: &str, body: &str) {
    let w = t
        .retain(topic, header(1), Bytes::from(body.to_owned()), None, NOW)
        .unwrap_or_else(|e| panic!("retaining {topic}: {e}"))
        .expect("a set always has a wait");
    durable(w);
}

fn clear(t: &Tenant, topic: &str) -> bool {
    match t
        .retain(topic, header(0), Bytes::new(), None, NOW)
        .expect("a clear is never refused")
    {
        Some(w) => {
            durable(w);
            true
        }
        None => false,
    }
}

/// (topic, body) of what `filter` finds at `now`.
fn found_at(t: &Tenant, filter: &str, now: u64) -> Vec<(String, String)> {
    t.retained(filter, now)
        .iter()
        .map(|m| {
            (
                m.topic.clone(),
                String::from_utf8_lossy(&m.body).into_owned(),
            )
        })
        .collect()
}

fn found(t: &Tenant, filter: &str) -> Vec<(String, String)> {
    found_at(t, filter, NOW)
}

fn topics(t: &Tenant, filter: &str) -> Vec<String> {
    found(t, filter).into_iter().map(|(t, _)| t).collect()
}

fn pair(t: &str, b: &str) -> (String, String) {
    (t.to_owned(), b.to_owned())
}

#[test]
fn set_replace_and_clear() {
    let e = Engine::open(MemStore::new()).expect("engine");
    let t = tenant(&e);
    assert!(found(&t, "a/b").is_empty());
    set(&t, "a/b", "one");
    assert_eq!(found(&t, "a/b"), vec![pair("a/b", "one")]);
    let first = t.retained("a/b", NOW);
    assert_eq!(first[0].header, header(1));
    set(&t, "a/b", "two");
    assert_eq!(found(&t, "a/b"), vec![pair("a/b", "two")]);
    assert_eq!(t.retained_count(), 1);
    assert!(clear(&t, "a/b"), "clearing a retained message waits");
    assert!(found(&t, "a/b").is_empty());
    assert_eq!(t.retained_count(), 0);
    assert!(!clear(&t, "a/b"), "nothing to clear: nothing to wait for");
    assert_eq!(e.retained_bytes(), 0);
    // A clear may carry a header: only the empty payload counts.
    set(&t, "x", "v");
    assert!(t
        .retain("x", header(9), Bytes::new(), None, NOW)
        .expect("clear")
        .is_some());
    assert!(found(&t, "x").is_empty());
}

#[test]
fn the_wait_resolves_only_when_the_store_made_it_durable() {
    let store = MemStore::new();
    let e = Engine::open(store.clone()).expect("engine");
    let t = tenant(&e);
    store.hold_durability(true);
    let mut w = t
        .retain("a", header(1), Bytes::from_static(b"v"), None, NOW)
        .expect("retain")
        .expect("wait");
    // Visible at once; acknowledged only once durable.
    assert_eq!(found(&t, "a"), vec![pair("a", "v")]);
    assert!(w.try_recv().is_err(), "not durable yet");
    store.release();
    w.blocking_recv().expect("answered").expect("durable");
    store.hold_durability(false);
}

#[test]
fn filters_match_with_wildcards_and_the_dollar_rule() {
    let e = Engine::open(MemStore::new()).expect("engine");
    let t = tenant(&e);
    for topic in [
        "a",
        "a/b",
        "a/b/c",
        "a/c",
        "a/",
        "ab",
        "/a",
        "b/b",
        "$SYS/broker/load",
        "$SYS/x",
        "a/$x",
    ] {
        set(&t, topic, topic);
    }
    let all_but_dollar = ["/a", "a", "a/", "a/$x", "a/b", "a/b/c", "a/c", "ab", "b/b"];
    assert_eq!(topics(&t, "#"), all_but_dollar);
    assert_eq!(
        topics(&t, "a/#"),
        ["a", "a/", "a/$x", "a/b", "a/b/c", "a/c"]
    );
    assert_eq!(topics(&t, "a/+"), ["a/", "a/$x", "a/b", "a/c"]);
    assert_eq!(topics(&t, "+/b"), ["a/b", "b/b"]);
    assert_eq!(topics(&t, "+"), ["a", "ab"]);
    assert_eq!(topics(&t, "+/+"), ["/a", "a/", "a/$x", "a/b", "a/c", "b/b"]);
    assert_eq!(topics(&t, "a/+/c"), ["a/b/c"]);
    assert_eq!(topics(&t, "a/b/#"), ["a/b", "a/b/c"]);
    assert_eq!(topics(&t, "+/#"), all_but_dollar);
    // `$` topics only through a filter that names their first level.
    assert_eq!(topics(&t, "$SYS/#"), ["$SYS/broker/load", "$SYS/x"]);
    assert_eq!(topics(&t, "$SYS/+"), ["$SYS/x"]);
    assert_eq!(topics(&t, "$SYS/+/load"), ["$SYS/broker/load"]);
    assert!(topics(&t, "+/broker/load").is_empty());
    assert!(topics(&t, "+/x").is_empty());
    // Exact filters.
    assert_eq!(topics(&t, "a/b"), ["a/b"]);
    assert_eq!(topics(&t, "$SYS/x"), ["$SYS/x"]);
    assert!(topics(&t, "a/b/c/d").is_empty());
    assert!(topics(&t, "nothing/#").is_empty());
}

#[test]
fn the_message_count_is_bounded_per_tenant() {
    let store = MemStore::new();
    // A second tenant, as a restart would find it.
    let other = weir_engine::meta::tenant_key("other");
    store
        .append(
            &[Op::PutMeta {
                key: &other,
                value: b"{}",
            }],
            &mut Vec::new(),
            None,
        )
        .expect("append");
    let e = Engine::open(store).expect("engine");
    e.set_retained_limits(RetainedLimits {
        max_messages_per_tenant: 2,
        max_total_bytes: 0,
    });
    let t = tenant(&e);
    set(&t, "a", "1");
    set(&t, "b", "2");
    let err = t
        .retain("c", header(1), Bytes::from_static(b"3"), None, NOW)
        .expect_err("a third topic is over the bound");
    assert!(err.is_quota_exceeded(), "{err}");
    assert!(matches!(err, RetainError::TooManyMessages { limit: 2, .. }));
    assert!(topics(&t, "c").is_empty(), "nothing kept");
    // Replacing one is always allowed, and a clear makes room.
    set(&t, "a", "1 again");
    assert!(clear(&t, "b"));
    set(&t, "c", "3");
    assert_eq!(topics(&t, "#"), ["a", "c"]);
    // The bound is per tenant.
    let o = e.tenant("other").expect("other tenant");
    set(&o, "a", "1");
    set(&o, "b", "2");
    assert_eq!(o.retained_count(), 2);
}

#[test]
fn the_bytes_are_bounded_over_every_tenant() {
    let store = MemStore::new();
    let other = weir_engine::meta::tenant_key("other");
    store
        .append(
            &[Op::PutMeta {
                key: &other,
                value: b"{}",
            }],
            &mut Vec::new(),
            None,
        )
        .expect("append");
    let e = Engine::open(store).expect("engine");
    // Each message below: 1 topic byte + 1 header byte + body.
    e.set_retained_limits(RetainedLimits {
        max_messages_per_tenant: 0,
        max_total_bytes: 30,
    });
    let t = tenant(&e);
    let o = e.tenant("other").expect("other tenant");
    set(&t, "a", "0123456789"); // 12
    set(&o, "a", "0123456789"); // 24
    assert_eq!(e.retained_bytes(), 24);
    let err = o
        .retain("b", header(1), Bytes::from_static(b"0123456"), None, NOW)
        .expect_err("31 bytes is over the bound");
    assert!(matches!(err, RetainError::TooManyBytes { limit: 30 }));
    assert!(err.is_quota_exceeded());
    assert_eq!(e.retained_bytes(), 24, "a refusal takes nothing");
    // Exactly at the bound is fine.
    let w = o
        .retain("b", header(1), Bytes::from_static(b"0123"), None, NOW)
        .expect("30 bytes is at the bound")
        .expect("wait");
    durable(w);
    assert_eq!(e.retained_bytes(), 30);
    // Growing a message is refused; shrinking one is not; one larger than
    // the whole bound never fits.
    assert!(t
        .retain(
            "a",
            header(1),
            Bytes::from_static(b"0123456789X"),
            None,
            NOW
        )
        .is_err());
    set(&t, "a", "01");
    assert_eq!(e.retained_bytes(), 22);
    assert!(t
        .retain("z", header(1), Bytes::from(vec![0u8; 100]), None, NOW)
        .is_err());
    assert!(clear(&o, "a"));
    assert!(clear(&o, "b"));
    assert!(clear(&t, "a"));
    assert_eq!(e.retained_bytes(), 0);
    // A bound lowered under what is held: clears and shrinks still work.
    set(&t, "a", "0123456789");
    e.set_retained_limits(RetainedLimits {
        max_messages_per_tenant: 0,
        max_total_bytes: 5,
    });
    set(&t, "a", "012345678");
    assert!(clear(&t, "a"));
}

#[test]
fn expired_messages_are_not_found_and_are_swept() {
    let store = MemStore::new();
    let e = Engine::open(store.clone()).expect("engine");
    e.set_retained_limits(RetainedLimits {
        max_messages_per_tenant: 2,
        max_total_bytes: 0,
    });
    let t = tenant(&e);
    let w = t
        .retain(
            "s/1",
            header(1),
            Bytes::from_static(b"v"),
            Some(NOW + 100),
            NOW,
        )
        .expect("retain")
        .expect("wait");
    durable(w);
    set(&t, "s/2", "forever");
    assert_eq!(
        found_at(&t, "s/+", NOW + 100).len(),
        2,
        "alive at its deadline"
    );
    assert_eq!(topics_at(&t, "s/+", NOW + 101), ["s/2"]);
    assert_eq!(topics_at(&t, "s/1", NOW + 101), Vec::<String>::new());
    let m = &t.retained("s/1", NOW)[0];
    assert_eq!(m.expires_at_ms, Some(NOW + 100));
    assert!(!m.is_expired(NOW + 100) && m.is_expired(NOW + 101));
    // An expired message does not count against the bounds: a new topic
    // fits (and the expired one is removed on the way).
    let w = t
        .retain("s/3", header(1), Bytes::from_static(b"v"), None, NOW + 200)
        .expect("the expired one makes room")
        .expect("wait");
    durable(w);
    assert_eq!(t.retained_count(), 2);
    // An already expired publish clears.
    assert!(t
        .retain(
            "s/3",
            header(1),
            Bytes::from_static(b"v"),
            Some(NOW),
            NOW + 1
        )
        .expect("clear")
        .is_some());
    assert_eq!(topics_at(&t, "#", NOW + 300), ["s/2"]);
    // The sweep removes expired ones from the store too.
    let w = t
        .retain(
            "s/4",
            header(1),
            Bytes::from_static(b"v"),
            Some(NOW + 400),
            NOW,
        )
        .expect("retain")
        .expect("wait");
    durable(w);
    assert_eq!(e.sweep_retained(NOW + 400), 0);
    assert_eq!(e.sweep_retained(NOW + 401), 1);
    assert_eq!(t.retained_count(), 1);
    let e2 = Engine::open(store.reopen()).expect("reopen");
    assert_eq!(topics_at(&tenant(&e2), "#", NOW), ["s/2"]);
}

fn topics_at(t: &Tenant, filter: &str, now: u64) -> Vec<String> {
    found_at(t, filter, now)
        .into_iter()
        .map(|(t, _)| t)
        .collect()
}

#[test]
fn retained_messages_survive_a_restart_of_the_memory_store() {
    let store = MemStore::new();
    let e = Engine::open(store.clone()).expect("engine");
    let t = tenant(&e);
    set(&t, "a/b", "kept");
    set(&t, "a/c", "cleared");
    assert!(clear(&t, "a/c"));
    drop(t);
    drop(e);
    let e = Engine::open(store.reopen()).expect("reopen");
    let t = tenant(&e);
    assert_eq!(found(&t, "#"), vec![pair("a/b", "kept")]);
    assert_eq!(e.retained_bytes(), 3 + 1 + 4);
}

/// The log store of these tests: 4 KiB segments, so retained messages are
/// spread over many segments and reclamation checkpoints the metadata.
fn log_opts() -> LogOptions {
    LogOptions {
        segment_size: 4096,
        sync: false,
        ..LogOptions::default()
    }
}

#[test]
fn retained_messages_survive_a_restart_of_the_log_store() {
    let dir = tempfile::tempdir().expect("tempdir");
    let real_now = now_ms();
    let expected: Vec<RetainedMessage>;
    {
        let store = LogStore::open(dir.path(), log_opts()).expect("store");
        let e = Engine::open(store.clone()).expect("engine");
        let t = tenant(&e);
        // Many generations of a few topics: most records are dead, so the
        // store reclaims segments and checkpoints its metadata map.
        for round in 0..40 {
            for i in 0..10 {
                let body = format!("round {round} topic {i} {}", "x".repeat(100));
                let w = t
                    .retain(
                        &format!("dev/{i}/state"),
                        header(i as u8),
                        Bytes::from(body),
                        Some(real_now + 3_600_000),
                        real_now,
                    )
                    .expect("retain")
                    .expect("wait");
                durable(w);
            }
        }
        assert!(clear(&t, "dev/3/state"));
        // One that expires while the broker is down (set as if earlier).
        let w = t
            .retain(
                "dev/gone",
                header(1),
                Bytes::from_static(b"v"),
                Some(real_now - 1),
                real_now - 10,
            )
            .expect("retain")
            .expect("wait");
        durable(w);
        // Binary payloads and a topic with a NUL-free but odd shape.
        let w = t
            .retain(
                "/odd//topic/",
                MessageHeader::new(HeaderFormat::Amqp091, Bytes::from_static(&[0, 0])),
                Bytes::from_static(&[0, 255, 0, 7]),
                None,
                real_now,
            )
            .expect("retain")
            .expect("wait");
        durable(w);
        expected = t
            .retained("#", real_now - 10)
            .into_iter()
            .filter(|m| m.topic != "dev/gone")
            .map(|m| (*m).clone())
            .collect();
        assert_eq!(expected.len(), 10);
        assert!(
            dir.path().join("meta.checkpoint").exists(),
            "old segments were reclaimed behind a metadata checkpoint"
        );
        drop(t);
        drop(e);
        store.close().expect("close");
    }
    for restart in 0..2 {
        let store = LogStore::open(dir.path(), log_opts()).expect("reopen");
        let e = Engine::open(store.clone()).expect("engine");
        let t = tenant(&e);
        let back: Vec<RetainedMessage> = t
            .retained("#", real_now - 10)
            .into_iter()
            .map(|m| (*m).clone())
            .collect();
        assert_eq!(back, expected, "restart {restart}");
        assert_eq!(t.retained_count(), 10, "the expired one was swept at open");
        assert_eq!(
            e.retained_bytes(),
            expected.iter().map(RetainedMessage::size).sum::<u64>()
        );
        drop(t);
        drop(e);
        store.close().expect("close");
    }
}
