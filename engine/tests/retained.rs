//! Retained messages (MQTT), in process: set, replace and clear; lookup by
//! filter with wildcards and the `$`-topic rule (the topic trie against a
//! scan of every topic; lookups in bounded steps); the bounds, per tenant
//! and over all; expiry; the durability wait; and recovery after a
//! restart, on the in-memory store and on the real log store in a temp dir.

use bytes::Bytes;
use std::sync::Arc;
use weir_backend::log::{LogOptions, LogStore};
use weir_backend::testing::MemStore;
use weir_backend::{Op, Store};
use weir_engine::properties::{HeaderFormat, MessageHeader};
use weir_engine::retained::{
    RetainError, RetainedCursor, RetainedLimits, RetainedMessage, STEP_NODES,
};
use weir_engine::{Clock, ManualClock};
use weir_engine::{DurableWait, Engine, Tenant, DEFAULT_TENANT};

const NOW: u64 = 1_000_000;

fn header(tag: u8) -> MessageHeader {
    MessageHeader::new(HeaderFormat::new(3), Bytes::from(vec![tag]))
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
    let e = Engine::open(MemStore::new(), ManualClock::new()).expect("engine");
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
    let e = Engine::open(store.clone(), ManualClock::new()).expect("engine");
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
    let e = Engine::open(MemStore::new(), ManualClock::new()).expect("engine");
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
        )
        .expect("append");
    let e = Engine::open(store, ManualClock::new()).expect("engine");
    e.set_retained_limits(RetainedLimits {
        max_messages_per_tenant: 2,
        max_bytes_per_tenant: 0,
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
        )
        .expect("append");
    let e = Engine::open(store, ManualClock::new()).expect("engine");
    // Each message below: 1 topic byte + 1 header byte + body.
    e.set_retained_limits(RetainedLimits {
        max_messages_per_tenant: 0,
        max_bytes_per_tenant: 0,
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
        max_bytes_per_tenant: 0,
        max_total_bytes: 5,
    });
    set(&t, "a", "012345678");
    assert!(clear(&t, "a"));
}

#[test]
fn expired_messages_are_not_found_and_are_swept() {
    let store = MemStore::new();
    let clock = ManualClock::starting_at(NOW);
    let e = Engine::open(store.clone(), clock.clone()).expect("engine");
    e.set_retained_limits(RetainedLimits {
        max_messages_per_tenant: 2,
        max_bytes_per_tenant: 0,
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
    // On the engine's clock: alive at its deadline, gone a millisecond on.
    clock.set_ms(NOW + 400);
    assert_eq!(e.sweep_retained(), 0);
    clock.set_ms(NOW + 401);
    assert_eq!(e.sweep_retained(), 1);
    assert_eq!(t.retained_count(), 1);
    let e2 = Engine::open(store.reopen(), clock.clone()).expect("reopen");
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
    let e = Engine::open(store.clone(), ManualClock::new()).expect("engine");
    let t = tenant(&e);
    set(&t, "a/b", "kept");
    set(&t, "a/c", "cleared");
    assert!(clear(&t, "a/c"));
    drop(t);
    drop(e);
    let e = Engine::open(store.reopen(), ManualClock::new()).expect("reopen");
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
    let clock = ManualClock::new();
    let real_now = clock.now_ms();
    let expected: Vec<RetainedMessage>;
    {
        let store = LogStore::open(dir.path(), log_opts()).expect("store");
        let e = Engine::open(store.clone(), clock.clone()).expect("engine");
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
                MessageHeader::new(HeaderFormat::new(1), Bytes::from_static(&[0, 0])),
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
        let e = Engine::open(store.clone(), clock.clone()).expect("engine");
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

/// Engine over a store that already knows tenant `other` (as a restart
/// would find it).
fn engine_with_other() -> (Arc<Engine>, Arc<MemStore>) {
    let store = MemStore::new();
    let other = weir_engine::meta::tenant_key("other");
    store
        .append(
            &[Op::PutMeta {
                key: &other,
                value: b"{}",
            }],
            &mut Vec::new(),
        )
        .expect("append");
    (
        Engine::open(store.clone(), ManualClock::new()).expect("engine"),
        store,
    )
}

/// Every topic of 1 to 3 levels over a small alphabet (empty levels, `$`
/// levels, a character sorting before `/`), and every filter over the same
/// levels and the wildcards: the trie finds exactly what a scan of every
/// topic with `topic::mqtt_matches` finds, also when walked one message per step.
#[test]
fn the_trie_finds_what_a_scan_of_every_topic_finds() {
    let e = Engine::open(MemStore::new(), ManualClock::new()).expect("engine");
    let t = tenant(&e);
    let levels = ["", "a", "b", "a-b", "$s"];
    let mut all: Vec<String> = Vec::new();
    let mut paths: Vec<Vec<&str>> = levels.iter().map(|l| vec![*l]).collect();
    for _ in 0..2 {
        let deeper: Vec<Vec<&str>> = paths
            .iter()
            .filter(|p| p.len() == paths.iter().map(Vec::len).max().unwrap_or(0))
            .flat_map(|p| {
                levels.iter().map(move |l| {
                    let mut q = p.clone();
                    q.push(l);
                    q
                })
            })
            .collect();
        paths.extend(deeper);
    }
    for p in &paths {
        let topic = p.join("/");
        // MQTT topic names are never empty.
        if topic.is_empty() {
            continue;
        }
        set(&t, &topic, &topic);
        all.push(topic);
    }
    assert_eq!(t.retained_count(), all.len());
    let filter_levels = ["", "a", "a-b", "$s", "+"];
    let mut filters: Vec<String> = vec!["#".into()];
    for a in filter_levels {
        filters.push(a.into());
        filters.push(format!("{a}/#"));
        for b in filter_levels {
            filters.push(format!("{a}/{b}"));
            filters.push(format!("{a}/{b}/#"));
            for c in filter_levels {
                filters.push(format!("{a}/{b}/{c}"));
            }
        }
    }
    for f in &filters {
        let mut expected: Vec<String> = all
            .iter()
            .filter(|tp| weir_engine::topic::mqtt_matches(f, tp))
            .cloned()
            .collect();
        expected.sort();
        let mut got: Vec<String> = t.retained(f, NOW).iter().map(|m| m.topic.clone()).collect();
        got.sort();
        assert_eq!(got, expected, "filter {f}");
        // One per step: the cursor resumes where it stopped.
        let mut cursor = RetainedCursor::new(f);
        let mut stepped: Vec<Arc<RetainedMessage>> = Vec::new();
        let mut steps = 0;
        while !cursor.is_done() {
            let before = stepped.len();
            t.retained_next(&mut cursor, 1, NOW, &mut stepped);
            assert!(
                stepped.len() - before <= 1,
                "filter {f}: at most max per step"
            );
            steps += 1;
            assert!(steps <= all.len() + 2, "filter {f}: the walk ends");
        }
        let mut stepped: Vec<String> = stepped.iter().map(|m| m.topic.clone()).collect();
        stepped.sort();
        assert_eq!(stepped, expected, "filter {f}, one per step");
    }
}

/// A filter that matches nothing among many topics is walked in steps of
/// at most `STEP_NODES` index nodes (the caller serves others between
/// them); a literal filter level goes straight to its branch.
#[test]
fn lookups_visit_a_bounded_number_of_nodes_per_step() {
    let (e, _store) = engine_with_other();
    let t = tenant(&e);
    let n = 3 * STEP_NODES;
    for i in 0..n {
        let w = t
            .retain(
                &format!("r/{i}"),
                header(1),
                Bytes::from_static(b"v"),
                None,
                NOW,
            )
            .expect("retain")
            .expect("wait");
        durable(w);
    }
    // `+/+/x`: every `r/<i>` has to be looked at for an `x` below it.
    let mut cursor = RetainedCursor::new("+/+/x");
    let mut out: Vec<Arc<RetainedMessage>> = Vec::new();
    let mut steps = 0;
    while !cursor.is_done() {
        t.retained_next(&mut cursor, usize::MAX, NOW, &mut out);
        steps += 1;
    }
    assert!(out.is_empty());
    assert!(
        (3..=5).contains(&steps),
        "{n} topics in steps of {STEP_NODES} nodes: {steps} steps"
    );
    // A literal level is looked up, not scanned: one step.
    for f in ["+/17", "r/17", "+/17/#", "r/+/x"] {
        let mut cursor = RetainedCursor::new(f);
        let mut out: Vec<Arc<RetainedMessage>> = Vec::new();
        if f == "r/+/x" {
            // (a scan under `r`: more than one step)
            while !cursor.is_done() {
                t.retained_next(&mut cursor, usize::MAX, NOW, &mut out);
            }
            assert!(out.is_empty());
            continue;
        }
        t.retained_next(&mut cursor, usize::MAX, NOW, &mut out);
        assert!(cursor.is_done(), "{f} in one step");
        assert_eq!(out.len(), 1, "{f}");
        assert_eq!(out[0].topic, "r/17");
    }
    // Everything, a batch at a time: each once.
    let mut cursor = RetainedCursor::new("#");
    let mut out: Vec<Arc<RetainedMessage>> = Vec::new();
    while !cursor.is_done() {
        let before = out.len();
        t.retained_next(&mut cursor, 100, NOW, &mut out);
        assert!(out.len() - before <= 100);
    }
    let mut topics: Vec<String> = out.iter().map(|m| m.topic.clone()).collect();
    topics.sort();
    topics.dedup();
    assert_eq!(topics.len(), n, "every message exactly once");
    // Another tenant's lookup sees only its own.
    let o = e.tenant("other").expect("other tenant");
    assert!(o.retained("#", NOW).is_empty());
}

/// A cursor holds a position, not a reference: messages set after it are
/// found, cleared ones are not, and none twice.
#[test]
fn a_cursor_sees_changes_made_between_its_steps() {
    let e = Engine::open(MemStore::new(), ManualClock::new()).expect("engine");
    let t = tenant(&e);
    for topic in ["d/1", "d/2", "d/3", "d/3/x"] {
        set(&t, topic, "v");
    }
    let mut cursor = RetainedCursor::new("d/#");
    let mut out: Vec<Arc<RetainedMessage>> = Vec::new();
    t.retained_next(&mut cursor, 1, NOW, &mut out);
    assert_eq!(out[0].topic, "d/1");
    // Before the cursor, after it, and the one it stands on.
    set(&t, "d/0", "new, before");
    set(&t, "d/9", "new, after");
    assert!(clear(&t, "d/2"));
    set(&t, "d/1", "replaced");
    while !cursor.is_done() {
        t.retained_next(&mut cursor, 1, NOW, &mut out);
    }
    let topics: Vec<&str> = out.iter().map(|m| m.topic.as_str()).collect();
    assert_eq!(topics, ["d/1", "d/3", "d/3/x", "d/9"]);
    // Clearing a topic with levels under it keeps them; clearing those
    // removes the branch.
    assert!(clear(&t, "d/3"));
    assert_eq!(topics_at(&t, "d/3/#", NOW), ["d/3/x"]);
    assert!(clear(&t, "d/3/x"));
    assert!(topics_at(&t, "d/3/#", NOW).is_empty());
    assert_eq!(topics_at(&t, "d/#", NOW), ["d/0", "d/1", "d/9"]);
}

/// Bytes are budgeted per tenant, with the total over every tenant as a
/// ceiling: one tenant at its budget leaves the others theirs.
#[test]
fn the_bytes_are_budgeted_per_tenant_under_the_total() {
    let (e, store) = engine_with_other();
    // Each message: 1 topic byte + 1 header byte + body.
    e.set_retained_limits(RetainedLimits {
        max_messages_per_tenant: 0,
        max_bytes_per_tenant: 30,
        max_total_bytes: 50,
    });
    let t = tenant(&e);
    let o = e.tenant("other").expect("other tenant");
    set(&t, "a", "0123456789"); // 12
    set(&t, "b", "0123456789"); // 24
    let err = t
        .retain("c", header(1), Bytes::from_static(b"0123456789"), None, NOW)
        .expect_err("36 bytes is over the tenant's budget");
    assert!(
        matches!(&err, RetainError::TenantBytes { tenant, limit: 30 } if tenant == DEFAULT_TENANT),
        "{err}"
    );
    assert!(err.is_quota_exceeded());
    assert_eq!(t.retained_bytes(), 24, "a refusal takes nothing");
    // The other tenant has its own budget...
    set(&o, "a", "0123456789");
    set(&o, "b", "0123456789");
    assert_eq!(o.retained_bytes(), 24);
    assert_eq!(e.retained_bytes(), 48);
    // ...under the ceiling over both.
    let err = o
        .retain("c", header(1), Bytes::from_static(b"0"), None, NOW)
        .expect_err("51 bytes in all is over the total");
    assert!(
        matches!(err, RetainError::TooManyBytes { limit: 50 }),
        "{err}"
    );
    // Exactly at the tenant's budget is fine; shrinking and clearing always are.
    assert!(clear(&o, "b"));
    set(&t, "c", "0123");
    assert_eq!(t.retained_bytes(), 30);
    set(&t, "a", "0");
    assert!(clear(&t, "b"));
    assert_eq!(t.retained_bytes(), 3 + 6);
    assert_eq!(e.retained_bytes(), 9 + 12);
    // Counted again at recovery, per tenant.
    drop((t, o));
    drop(e);
    let e = Engine::open(store.reopen(), ManualClock::new()).expect("reopen");
    assert_eq!(tenant(&e).retained_bytes(), 9);
    assert_eq!(e.tenant("other").expect("other").retained_bytes(), 12);
    assert_eq!(e.retained_bytes(), 21);
}
