//! Deleting a queue over the embedded log store: one store record
//! ([`Op::DropPartition`]) per partition whatever the queue's depth, and the
//! space of its messages given back by compaction and reclamation.

use std::sync::Arc;
use weir_backend::log::{LogOptions, LogStore};
use weir_backend::{MessageAttrs, MessageData, Op, PartitionId, Store};
use weir_engine::tenant::QueueDeclare;
use weir_engine::{Engine, Tenant, DEFAULT_TENANT};

const CONN: u64 = 1;

fn opts() -> LogOptions {
    LogOptions {
        // Small segments: the queue spans dozens of them.
        segment_size: 1 << 20,
        sync: false,
        ..LogOptions::default()
    }
}

fn tenant(engine: &Engine) -> Arc<Tenant> {
    engine.tenant(DEFAULT_TENANT).expect("default tenant")
}

fn declare(t: &Tenant, name: &str) -> PartitionId {
    let (_, wait) = t
        .declare_queue(QueueDeclare {
            name: name.into(),
            passive: false,
            durable: true,
            exclusive: false,
            auto_delete: false,
            arguments: serde_json::json!({}),
            connection: CONN,
        })
        .expect("declare");
    if let Some(w) = wait {
        w.blocking_recv().expect("store answered").expect("durable");
    }
    t.queue(name, CONN).expect("declared").partitions[0].id
}

/// Waits until everything appended so far is durable.
fn durable(store: &dyn Store) {
    let (tx, rx) = std::sync::mpsc::channel();
    store
        .append(
            &[],
            &mut Vec::new(),
            Some(Box::new(move |r| {
                let _ = tx.send(r);
            })),
        )
        .expect("append");
    rx.recv().expect("waiter").expect("durable");
}

/// Appends `n` durable messages with 8-byte bodies to `partition`
/// directly, as a long run of publishes would have left them.
fn fill(store: &dyn Store, partition: PartitionId, n: u64) {
    const BATCH: u64 = 10_000;
    let body = [b'x'; 8];
    let mut done = 0;
    let mut locs = Vec::new();
    while done < n {
        let k = (n - done).min(BATCH);
        let first = store.allocate_ids(k);
        let ops: Vec<Op<'_>> = (first..first + k)
            .map(|id| Op::Publish {
                id,
                partitions: std::slice::from_ref(&partition),
                data: MessageData {
                    exchange: "",
                    routing_key: "deep",
                    header_format: 1,
                    header: b"",
                    body: &body,
                    attrs: MessageAttrs::default(),
                },
            })
            .collect();
        locs.clear();
        store.append(&ops, &mut locs, None).expect("append");
        done += k;
    }
    durable(store);
}

#[test]
fn deleting_a_queue_of_a_million_durable_messages_is_one_record_and_frees_its_space() {
    const N: u64 = 1_000_000;
    let dir = tempfile::tempdir().expect("tempdir");
    // A deep queue and a small one beside it, declared through the engine.
    let (deep, small) = {
        let store = LogStore::open(dir.path(), opts()).expect("store");
        let engine = Engine::open(store.clone()).expect("engine");
        let t = tenant(&engine);
        let ids = (declare(&t, "deep"), declare(&t, "small"));
        store.close().expect("close");
        ids
    };
    {
        let store = LogStore::open(dir.path(), opts()).expect("store");
        fill(&*store, deep, N);
        fill(&*store, small, 10);
        store.close().expect("close");
    }
    let store = LogStore::open(dir.path(), opts()).expect("store");
    let engine = Engine::open(store.clone()).expect("engine");
    let t = tenant(&engine);
    assert_eq!(t.queue("deep", CONN).expect("deep").message_count(), N);
    let before = store.stats();
    assert!(before.segments > 40, "{before:?}");

    let (count, wait) = t.delete_queue("deep", false, false, CONN).expect("delete");
    assert_eq!(count, N);
    if let Some(w) = wait {
        w.blocking_recv().expect("store answered").expect("durable");
    }
    let appended = store.stats().appended_bytes - before.appended_bytes;
    // One drop record (17 bytes) and the queue's metadata delete; a settle
    // per message would be 25 MB.
    assert!(
        appended < 256,
        "deleting a queue of {N} messages appended {appended} bytes"
    );

    // Compaction moves the small queue's survivors; the emptied segments
    // are reclaimed.
    while engine.compact().expect("compact") > 0 {}
    durable(&*store);
    durable(&*store);
    let after = store.stats();
    assert!(
        after.segments <= 3 && after.disk_bytes < 2 << 20,
        "space not given back: {before:?} → {after:?}"
    );
    assert!(after.reclaimed_segments + 3 >= before.segments, "{after:?}");
    store.close().expect("close");
    drop(engine);

    // The drop holds across a restart: nothing of the deep queue comes back,
    // the small one is whole.
    let store = LogStore::open(dir.path(), opts()).expect("store");
    assert_eq!(
        store.recovered_partitions().expect("partitions"),
        vec![small]
    );
    let engine = Engine::open(store.clone()).expect("engine");
    let t = tenant(&engine);
    assert!(t.queue("deep", CONN).is_err());
    assert_eq!(t.queue("small", CONN).expect("small").message_count(), 10);
    store.close().expect("close");
}
