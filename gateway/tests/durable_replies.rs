//! A durable reply (declare-ok of a durable queue) waits for its fsync; the
//! connection that asked must keep working meanwhile: deliveries to its
//! consumers, on other channels, are not held behind that fsync.
//!
//! The real listener and session run in process over `MemStore`, whose
//! durability the test holds and releases: deterministic, no timing.

use futures_lite::StreamExt;
use lapin::options::{BasicConsumeOptions, BasicPublishOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Connection, ConnectionProperties};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use weir_backend::testing::MemStore;
use weir_gateway::config::{Cli, Config};
use weir_gateway::server::Broker;

/// A broker on a free port over `store`; returns its AMQP URI.
async fn broker(store: Arc<MemStore>, dir: &std::path::Path) -> String {
    let cli = Cli::try_parse_from([
        "weir",
        "--amqp-listen",
        "127.0.0.1:0",
        "--data-dir",
        dir.to_str().expect("utf-8 temp dir"),
        "--disk-free-limit",
        "1MB",
    ])
    .expect("flags parse");
    let cfg = Config::load_with_env(cli, |_| None).expect("config loads");
    let b = Broker::start_with_store(&cfg, store)
        .await
        .expect("broker starts");
    let addr = b.amqp_addr().expect("bound");
    tokio::spawn(b.run(std::future::pending()));
    format!("amqp://guest:guest@{addr}/%2f")
}

/// Whether `f` completes without waiting (polled once).
fn is_done<F: Future + Unpin>(f: &mut F) -> bool {
    let waker = std::task::Waker::noop();
    let mut cx = std::task::Context::from_waker(waker);
    std::pin::Pin::new(f).poll(&mut cx).is_ready()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_declare_waiting_for_its_fsync_does_not_hold_the_connections_deliveries() {
    let dir = tempfile::tempdir().expect("temp dir");
    let store = MemStore::new();
    let uri = broker(store.clone(), dir.path()).await;
    let props = ConnectionProperties::default();
    let a = Connection::connect(&uri, props.clone())
        .await
        .expect("A connects");
    let b = Connection::connect(&uri, props).await.expect("B connects");

    // A consumes from a transient queue on channel 1.
    let consume_ch = a.create_channel().await.expect("channel");
    consume_ch
        .queue_declare(
            "work".into(),
            QueueDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect("declare transient queue");
    let mut consumer = consume_ch
        .basic_consume(
            "work".into(),
            "c".into(),
            BasicConsumeOptions {
                no_ack: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .expect("consume");

    // From now on nothing becomes durable until the test says so.
    store.hold_durability(true);
    let declare_ch = a.create_channel().await.expect("channel");
    let mut declare = Box::pin(declare_ch.queue_declare(
        "durable-q".into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    ));
    // The declare reached the store (it waits for durability there).
    while store.held_waiters() == 0 {
        assert!(!is_done(&mut declare), "declare-ok came before its fsync");
        tokio::task::yield_now().await;
    }

    // B publishes a transient message to A's queue: A must get it now.
    let pub_ch = b.create_channel().await.expect("channel");
    pub_ch
        .basic_publish(
            "".into(),
            "work".into(),
            BasicPublishOptions::default(),
            b"not held",
            BasicProperties::default(),
        )
        .await
        .expect("publish");
    let delivery = tokio::time::timeout(Duration::from_secs(10), consumer.next())
        .await
        .expect("the delivery is not held behind the pending declare's fsync")
        .expect("consumer open")
        .expect("delivery");
    assert_eq!(delivery.data, b"not held");
    assert!(
        !is_done(&mut declare),
        "declare-ok must still wait for the fsync"
    );

    store.release();
    store.hold_durability(false);
    tokio::time::timeout(Duration::from_secs(10), declare)
        .await
        .expect("declare-ok once durable")
        .expect("declare succeeds");
}
