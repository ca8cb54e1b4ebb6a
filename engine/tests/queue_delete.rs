//! Deleting a queue over the embedded log store: one store record
//! ([`Op::DropPartition`]) per partition whatever the queue's depth, and the
//! space of its messages given back by compaction and reclamation.

use std::sync::Arc;
use weir_backend::log::{LogOptions, LogStore};
use weir_backend::{MessageAttrs, MessageData, Op, PartitionId, Store};
use weir_engine::tenant::QueueDeclare;
use weir_engine::ManualClock;
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

/// A writer round of the log store after everything appended so far (it
/// reclaims after its round): a small record of its own, waited for (an
/// already expired receipt of a partition no queue has, so it pins
/// nothing; the log store's tickets cover every earlier append).
fn durable(store: &dyn Store) {
    let ticket = store
        .append(
            &[Op::Receipt {
                partition: PartitionId(1 << 62),
                key_hash: 0,
                expires_at_ms: 1,
            }],
            &mut Vec::new(),
        )
        .expect("append");
    let (tx, rx) = std::sync::mpsc::channel();
    store.when_durable(
        ticket,
        Box::new(move |r| {
            let _ = tx.send(r);
        }),
    );
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
        store.append(&ops, &mut locs).expect("append");
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
        let engine = Engine::open(store.clone(), ManualClock::new()).expect("engine");
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
    let engine = Engine::open(store.clone(), ManualClock::new()).expect("engine");
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
    let engine = Engine::open(store.clone(), ManualClock::new()).expect("engine");
    let t = tenant(&engine);
    assert!(t.queue("deep", CONN).is_err());
    assert_eq!(t.queue("small", CONN).expect("small").message_count(), 10);
    store.close().expect("close");
}

/// The figures of docs/BENCHMARKS.md ("Issue 21: deleting a queue of 1M
/// messages"): run in release with
/// `cargo test --release -p weir-engine --test queue_delete -- --ignored --nocapture`.
/// Default log options (64 MiB segments, fsync on), 16-byte bodies. The
/// engine's delete against what the delete did before this issue (a settle
/// per message, replayed here at the store).
#[test]
#[ignore = "a release-mode measurement, not a check"]
fn figures_deleting_a_million() {
    use std::time::Instant;
    const N: u64 = 1_000_000;
    let base = std::env::var_os("WEIR_BENCH_DIR").map(std::path::PathBuf::from);
    let tmp = |label: &str| {
        match &base {
            Some(b) => tempfile::Builder::new().prefix(label).tempdir_in(b),
            None => tempfile::Builder::new().prefix(label).tempdir(),
        }
        .expect("tempdir")
    };
    let body = [b'x'; 16];
    let fill16 = |store: &dyn Store, partition: PartitionId| {
        let first = store.allocate_ids(N);
        for chunk in (first..first + N).collect::<Vec<_>>().chunks(10_000) {
            let ops: Vec<Op<'_>> = chunk
                .iter()
                .map(|&id| Op::Publish {
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
            store.append(&ops, &mut Vec::new()).expect("append");
        }
        durable(store);
    };
    // Until every segment but the head is reclaimed.
    let reclaimed = |store: &dyn Store, compact: &dyn Fn() -> usize, sealed: u64| {
        let t = Instant::now();
        loop {
            while compact() > 0 {}
            durable(store);
            if store.stats().reclaimed_segments >= sealed {
                return t.elapsed();
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    };

    // Before this issue: one settle per message, at the store.
    {
        let dir = tmp("settles");
        let store = LogStore::open(dir.path(), LogOptions::default()).expect("store");
        fill16(&*store, PartitionId(1));
        store.close().expect("close");
        let store = LogStore::open(dir.path(), LogOptions::default()).expect("store");
        let msgs = store.recover_partition(PartitionId(1)).expect("recover");
        let s0 = store.stats();
        let t = Instant::now();
        let ops: Vec<Op<'_>> = msgs
            .iter()
            .map(|m| Op::Settle {
                partition: PartitionId(1),
                id: m.id,
                location: m.location,
            })
            .collect();
        let built = t.elapsed();
        store.append(&ops, &mut Vec::new()).expect("append");
        let appended = t.elapsed();
        durable(&*store);
        let done = t.elapsed();
        let s1 = store.stats();
        struct Nothing;
        impl weir_backend::LiveSet for Nothing {
            fn for_each_live(
                &self,
                _: &mut dyn FnMut(PartitionId, weir_backend::MessageId, weir_backend::Location),
            ) {
            }
            fn relocate(&self, moves: &[weir_backend::Relocation]) -> Vec<bool> {
                vec![false; moves.len()]
            }
        }
        let freed = reclaimed(
            &*store,
            &|| store.compact(&Nothing).expect("compact"),
            s0.segments - 1,
        );
        println!(
            "settle per message (store): {} segments, {} MB on disk; ops built {:.1} ms, appended {:.1} ms, durable {:.1} ms; {} bytes appended; all but the head segment reclaimed {:.1} ms later",
            s0.segments,
            s0.disk_bytes >> 20,
            built.as_secs_f64() * 1e3,
            appended.as_secs_f64() * 1e3,
            done.as_secs_f64() * 1e3,
            s1.appended_bytes - s0.appended_bytes,
            freed.as_secs_f64() * 1e3,
        );
        store.close().expect("close");
    }

    // Now: the engine's queue delete, one drop record.
    {
        let dir = tmp("drop");
        let deep = {
            let store = LogStore::open(dir.path(), LogOptions::default()).expect("store");
            let engine = Engine::open(store.clone(), ManualClock::new()).expect("engine");
            let deep = declare(&tenant(&engine), "deep");
            fill16(&*store, deep);
            store.close().expect("close");
            deep
        };
        let store = LogStore::open(dir.path(), LogOptions::default()).expect("store");
        let t = Instant::now();
        let engine = Engine::open(store.clone(), ManualClock::new()).expect("engine");
        let recovered = t.elapsed();
        let tn = tenant(&engine);
        assert_eq!(tn.queue("deep", CONN).expect("deep").message_count(), N);
        let s0 = store.stats();
        let t = Instant::now();
        let (count, wait) = tn.delete_queue("deep", false, false, CONN).expect("delete");
        let returned = t.elapsed();
        if let Some(w) = wait {
            w.blocking_recv().expect("store answered").expect("durable");
        }
        let done = t.elapsed();
        assert_eq!(count, N);
        let s1 = store.stats();
        let freed = reclaimed(
            &*store,
            &|| engine.compact().expect("compact"),
            s0.segments - 1,
        );
        println!(
            "drop (engine queue delete of partition {}): {} segments, {} MB on disk (engine recovered the queue in {:.0} ms); delete returned {:.1} ms, durable {:.1} ms; {} bytes appended; all but the head segment reclaimed {:.1} ms later",
            deep.0,
            s0.segments,
            s0.disk_bytes >> 20,
            recovered.as_secs_f64() * 1e3,
            returned.as_secs_f64() * 1e3,
            done.as_secs_f64() * 1e3,
            s1.appended_bytes - s0.appended_bytes,
            freed.as_secs_f64() * 1e3,
        );
        store.close().expect("close");
    }
}
