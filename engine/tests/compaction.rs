//! Compaction through the engine, in process over `MemStore` (which moves
//! every position it is shown): positions are collected under the partition
//! locks, copied with none held, and swapped back in for ready and leased
//! entries alike.

use bytes::Bytes;
use std::sync::Arc;
use weir_backend::testing::MemStore;
use weir_backend::{Location, MessageId, Store};
use weir_engine::client::{GetAck, Published, SubscribeOptions};
use weir_engine::exchange::HeaderLookup;
use weir_engine::lease::Settle;
use weir_engine::message::Message;
use weir_engine::properties::HeaderFormat;
use weir_engine::tenant::{QueueDeclare, RouteInput};
use weir_engine::ManualClock;
use weir_engine::{Client, Engine, DEFAULT_TENANT};

struct NoHeaders;
impl HeaderLookup for NoHeaders {
    fn header(&self, _: &str) -> Option<serde_json::Value> {
        None
    }
}

fn declare_durable(c: &mut Client, name: &str) {
    let (_, wait) = c
        .declare_queue(QueueDeclare {
            name: name.into(),
            passive: false,
            durable: true,
            exclusive: false,
            auto_delete: false,
            arguments: serde_json::json!({}),
            connection: c.id(),
        })
        .expect("declare");
    if let Some(w) = wait {
        w.blocking_recv().expect("store answered").expect("durable");
    }
}

fn publish(c: &mut Client, queue: &str, body: &str) {
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
            body: Bytes::copy_from_slice(body.as_bytes()),
            header_format: HeaderFormat::new(1),
            persistent: true,
            priority: 0,
            ttl_ms: None,
        })
        .expect("publish");
    assert!(matches!(published, Published::Routed { .. }));
}

/// Every (id, position) the queue's partitions hold.
fn positions(c: &Client, queue: &str) -> Vec<(MessageId, Location)> {
    let q = c.queue(queue).expect("queue");
    let mut out = Vec::new();
    for p in &q.partitions {
        p.for_each_location(|id, l| out.push((id, *l)));
    }
    out.sort_by_key(|(id, _)| *id);
    out
}

#[test]
fn compaction_swaps_ready_and_leased_positions_and_settles_follow() {
    let store = MemStore::new();
    {
        let e = Engine::open(store.clone(), ManualClock::new()).expect("engine");
        let mut c = Client::open(&e, DEFAULT_TENANT, "guest").expect("client");
        declare_durable(&mut c, "q");
        for b in ["a", "b", "c", "d", "e"] {
            publish(&mut c, "q", b);
        }
        c.commit();
        // Two leased, three ready.
        c.subscribe(
            "q",
            SubscribeOptions {
                scope: 1,
                tag: Bytes::from_static(b"t"),
                exclusive: false,
                no_ack: false,
                prefetch_count: 2,
                ..Default::default()
            },
        )
        .expect("subscribe");
        c.drain(&mut Vec::new());
        let mut tag = 0;
        while let Some(d) = c.next_delivery() {
            tag += 1;
            let (now, now_ms) = (c.clock().now(), c.clock().now_ms());
            c.lease(1, tag, d, now, now_ms);
        }
        c.finish_deliveries();
        c.commit();
        assert_eq!(c.leases(1), 2);

        let before = positions(&c, "q");
        assert_eq!(before.len(), 5);
        assert_eq!(e.compact().expect("compact"), 5, "every position moved");
        let after = positions(&c, "q");
        for ((id, old), (id2, new)) in before.iter().zip(&after) {
            assert_eq!(id, id2);
            assert_ne!(old, new, "message {id} kept its old position");
            // MemStore dropped the old copy: only the new position reads.
            assert_eq!(store.read(*new).expect("new position").id, *id);
            assert!(store.read(*old).is_err());
        }
        // The ack settles the leased message where it lives now.
        c.settle(1, 1, false, Settle::Ack).expect("ack");
        c.commit();
        assert_eq!(store.live_count(), 4);
        drop(c);
        store.close().expect("close");
    }
    let store: Arc<MemStore> = store.reopen();
    let e = Engine::open(store, ManualClock::new()).expect("engine");
    let mut c = Client::open(&e, DEFAULT_TENANT, "guest").expect("client");
    let mut got = Vec::new();
    while let Some(m) = c.get("q", GetAck::Auto).expect("get") {
        got.push(String::from_utf8(m.message.body.to_vec()).expect("utf-8"));
    }
    got.sort();
    assert_eq!(got, vec!["b", "c", "d", "e"]);
}
