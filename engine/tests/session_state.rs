//! Durable protocol session state (MQTT's QoS 2 packet ids), in process:
//! set, replace, remove, lookup by prefix, the durability wait, and recovery
//! after a restart of the real log store, other tenants' keys apart.

use std::sync::Arc;
use weir_backend::log::{LogOptions, LogStore};
use weir_backend::Store;
use weir_engine::ManualClock;
use weir_engine::{DurableWait, Engine, Tenant, DEFAULT_TENANT};

fn durable(w: DurableWait) {
    w.blocking_recv().expect("store answered").expect("durable");
}

fn tenant(e: &Engine, name: &str) -> Arc<Tenant> {
    e.tenant(name).expect("tenant")
}

fn keys(t: &Tenant, prefix: &str) -> Vec<(String, Vec<u8>)> {
    t.session_state(prefix)
}

#[test]
fn session_state_is_found_by_prefix_and_survives_a_restart_of_the_log_store() {
    let dir = tempfile::tempdir().expect("tempdir");
    let opts = LogOptions {
        segment_size: 4096,
        sync: false,
        ..LogOptions::default()
    };
    {
        let store = LogStore::open(dir.path(), opts.clone()).expect("store");
        let e = Engine::open(store.clone(), ManualClock::new()).expect("engine");
        let t = tenant(&e, DEFAULT_TENANT);
        // Many generations: segments are reclaimed behind a metadata checkpoint.
        for round in 0..50u8 {
            durable(
                t.update_session_state(&[
                    ("mqtt\0a\0out\u{0}1", Some(&[b'P', round][..])),
                    ("mqtt\0a\0in\u{0}7", Some(&[][..])),
                    ("mqtt\0ab\0in\u{0}1", Some(&[round][..])),
                ])
                .expect("update"),
            );
        }
        // Removed in one append with a change.
        durable(
            t.update_session_state(&[
                ("mqtt\0a\0in\u{0}7", None),
                ("mqtt\0a\0out\u{0}2", Some(&b"R"[..])),
            ])
            .expect("update"),
        );
        assert_eq!(
            keys(&t, "mqtt\0a\0"),
            vec![
                ("mqtt\0a\0out\u{0}1".to_string(), vec![b'P', 49]),
                ("mqtt\0a\0out\u{0}2".to_string(), b"R".to_vec()),
            ],
            "a prefix does not reach client `ab`"
        );
        store.close().expect("close");
    }
    let store = LogStore::open(dir.path(), opts).expect("reopen");
    let e = Engine::open(store.clone(), ManualClock::new()).expect("engine");
    let t = tenant(&e, DEFAULT_TENANT);
    assert_eq!(
        keys(&t, "mqtt\0"),
        vec![
            ("mqtt\0a\0out\u{0}1".to_string(), vec![b'P', 49]),
            ("mqtt\0a\0out\u{0}2".to_string(), b"R".to_vec()),
            ("mqtt\0ab\0in\u{0}1".to_string(), vec![49]),
        ]
    );
    store.close().expect("close");
}
