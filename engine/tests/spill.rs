//! Paging through the store's spill (contract v2), over the log store:
//! transient messages deep in a queue are spilled, read back from the
//! spill when taken, released without a store record when settled (their
//! space given back), and gone after a restart.

use bytes::Bytes;
use weir_backend::log::{LogOptions, LogStore};
use weir_backend::Store;
use weir_engine::client::{GetAck, Published};
use weir_engine::exchange::HeaderLookup;
use weir_engine::message::Message;
use weir_engine::properties::HeaderFormat;
use weir_engine::queue::HOT_ENTRIES;
use weir_engine::tenant::{QueueDeclare, RouteInput};
use weir_engine::ManualClock;
use weir_engine::{Client, Engine, DEFAULT_TENANT};

struct NoHeaders;
impl HeaderLookup for NoHeaders {
    fn header(&self, _: &str) -> Option<serde_json::Value> {
        None
    }
}

fn opts() -> LogOptions {
    LogOptions {
        segment_size: 64 << 10,
        sync: false,
        ..LogOptions::default()
    }
}

fn declare(e: &Engine, name: &str, durable: bool) {
    let (_, wait) = e
        .tenant(DEFAULT_TENANT)
        .expect("tenant")
        .declare_queue(QueueDeclare {
            name: name.into(),
            passive: false,
            durable,
            exclusive: false,
            auto_delete: false,
            arguments: serde_json::json!({}),
            connection: 1,
        })
        .expect("declare");
    if let Some(w) = wait {
        w.blocking_recv().expect("store answered").expect("durable");
    }
}

fn publish(c: &mut Client, queue: &str, body: String) {
    let route = RouteInput {
        exchange: "",
        routing_key: queue,
        headers: &NoHeaders,
    };
    let published = c
        .publish(&route, |id| Message {
            id,
            exchange: Bytes::new(),
            routing_key: Bytes::copy_from_slice(queue.as_bytes()),
            properties: Bytes::new(),
            body: Bytes::from(body),
            header_format: HeaderFormat::new(1),
            persistent: false,
            priority: 0,
            ttl_ms: None,
        })
        .expect("publish");
    assert!(matches!(published, Published::Routed { .. }));
}

/// A writer round of the log store after everything appended so far (it
/// reclaims after its round): a small record of its own, waited for (an
/// already expired receipt of a partition no queue has, so it pins
/// nothing; the log store's tickets cover every earlier append).
fn durable(store: &dyn Store) {
    let ticket = store
        .append(
            &[weir_backend::Op::Receipt {
                partition: weir_backend::PartitionId(1 << 62),
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

#[test]
fn deep_transient_messages_are_spilled_read_back_released_and_not_recovered() {
    const DEEP: usize = 1500;
    let n = HOT_ENTRIES + DEEP;
    let body = |i: usize| format!("{i:0>200}");
    let dir = tempfile::tempdir().expect("tempdir");
    {
        let store = LogStore::open(dir.path(), opts()).expect("store");
        let e = Engine::open(store.clone(), ManualClock::new()).expect("engine");
        declare(&e, "t", false);
        declare(&e, "d", true);
        let mut c = Client::open(&e, DEFAULT_TENANT, "guest").expect("client");
        let before = store.stats().appended_bytes;
        for i in 0..n {
            publish(&mut c, "t", body(i));
        }
        c.commit();
        let spilled = store.stats().appended_bytes - before;
        assert!(
            spilled >= (DEEP * 200) as u64,
            "the deep {DEEP} were not spilled: {spilled} bytes appended"
        );
        // Taken in order, the deep ones read back from the spill.
        let before = store.stats().appended_bytes;
        for i in 0..n {
            let got = c.get("t", GetAck::Auto).expect("get").expect("a message");
            assert_eq!(got.message.body, body(i).as_bytes(), "message {i}");
        }
        assert!(c.get("t", GetAck::Auto).expect("get").is_none());
        c.commit();
        assert_eq!(
            store.stats().appended_bytes,
            before,
            "settling spilled copies appended store records"
        );
        // Their segments are reclaimed.
        durable(&*store);
        durable(&*store);
        let stats = store.stats();
        assert!(
            stats.disk_bytes < 128 << 10,
            "released copies kept their space: {stats:?}"
        );
        // Transient messages deep in a durable queue are spilled too, and a
        // restart drops them.
        for i in 0..n {
            publish(&mut c, "d", body(i));
        }
        c.commit();
        durable(&*store);
        drop(c);
        store.close().expect("close");
    }
    let store = LogStore::open(dir.path(), opts()).expect("store");
    assert!(
        store.recovered_partitions().expect("partitions").is_empty(),
        "spilled copies came back after a restart"
    );
    let e = Engine::open(store.clone(), ManualClock::new()).expect("engine");
    let mut c = Client::open(&e, DEFAULT_TENANT, "guest").expect("client");
    assert!(c.get("d", GetAck::Auto).expect("get").is_none());
    store.close().expect("close");
}
