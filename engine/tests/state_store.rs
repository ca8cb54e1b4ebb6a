//! MQTT session state and retained messages live in the store's state store
//! (contract v2), not in the metadata map: each key carries its own version,
//! writing them leaves the metadata version alone, and the engine recovers
//! them per prefix after a restart.

use bytes::Bytes;
use std::sync::Arc;
use weir_backend::testing::MemStore;
use weir_backend::Store;
use weir_engine::properties::{HeaderFormat, MessageHeader};
use weir_engine::ManualClock;
use weir_engine::{DurableWait, Engine, Tenant, DEFAULT_TENANT};

const NOW: u64 = 1_000_000;

fn durable(w: DurableWait) {
    w.blocking_recv().expect("store answered").expect("durable");
}

fn tenant(e: &Engine) -> Arc<Tenant> {
    e.tenant(DEFAULT_TENANT).expect("default tenant")
}

fn retain(t: &Tenant, topic: &str, body: &str) {
    let w = t
        .retain(
            topic,
            MessageHeader::new(HeaderFormat::new(3), Bytes::new()),
            Bytes::from(body.to_owned()),
            None,
            NOW,
        )
        .expect("retain")
        .expect("a set has a wait");
    durable(w);
}

/// (key, version) of every state-store key under `prefix`.
fn versions(store: &dyn Store, prefix: &[u8]) -> Vec<(Vec<u8>, u64)> {
    store
        .scan_state(prefix)
        .expect("scan")
        .into_iter()
        .map(|e| (e.key, e.version))
        .collect()
}

#[test]
fn retained_and_session_state_are_versioned_per_key_outside_the_metadata() {
    let store = MemStore::new();
    let e = Engine::open(store.clone(), ManualClock::new()).expect("engine");
    let t = tenant(&e);
    let meta_version = store.recovered_meta().expect("meta").version;

    retain(&t, "a/b", "1");
    retain(&t, "a/b", "2");
    retain(&t, "c", "1");
    durable(
        t.update_session_state(&[("mqtt\0dev\0in\u{0}1", Some(&b"x"[..]))])
            .expect("update"),
    );
    durable(
        t.update_session_state(&[("mqtt\0dev\0in\u{0}1", Some(&b"y"[..]))])
            .expect("update"),
    );

    assert_eq!(
        store.recovered_meta().expect("meta").version,
        meta_version,
        "retained messages and session state must not move the metadata version"
    );
    assert_eq!(
        versions(&*store, b"r\0"),
        vec![(b"r\0/\0a/b".to_vec(), 2), (b"r\0/\0c".to_vec(), 1)],
        "each topic counts its own versions"
    );
    assert_eq!(
        versions(&*store, b"s\0"),
        vec![(b"s\0/\0mqtt\0dev\0in\x001".to_vec(), 2)]
    );

    // A clear and a removal delete their keys.
    durable(
        t.retain(
            "c",
            MessageHeader::new(HeaderFormat::new(3), Bytes::new()),
            Bytes::new(),
            None,
            NOW,
        )
        .expect("clear")
        .expect("a clear of a set topic has a wait"),
    );
    durable(
        t.update_session_state(&[("mqtt\0dev\0in\u{0}1", None)])
            .expect("update"),
    );
    assert_eq!(versions(&*store, b"r\0"), vec![(b"r\0/\0a/b".to_vec(), 2)]);
    assert!(versions(&*store, b"s\0").is_empty());

    // Recovered from the state store after a restart.
    durable(
        t.update_session_state(&[("mqtt\0dev\0out\u{0}2", Some(&b"P"[..]))])
            .expect("update"),
    );
    let store = store.reopen();
    let e = Engine::open(store.clone(), ManualClock::new()).expect("engine");
    let t = tenant(&e);
    let got = t.retained("#", NOW);
    assert_eq!(got.len(), 1);
    assert_eq!(
        (got[0].topic.as_str(), &got[0].body[..]),
        ("a/b", &b"2"[..])
    );
    assert_eq!(
        t.session_state("mqtt\0dev\0"),
        vec![("mqtt\0dev\0out\u{0}2".to_string(), b"P".to_vec())]
    );
}
