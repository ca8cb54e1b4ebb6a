//! The AMQP session's one-line mappings onto `engine::Client` that the
//! engine's own tests cannot see: channel.flow, basic.qos(global) and
//! basic.recover(requeue), through a real client over the real listener and
//! session, in process over `MemStore`. The engine behaviour behind each is
//! tested in `engine/tests/client.rs`; these show the wiring.
//!
//! Each test is deterministic: a publish is confirmed only after routing
//! and dispatch ran (transient messages are confirmed at the end of the
//! publisher's batch), so a passive declare afterwards reads whether the
//! message was handed to the consumer (0 ready) or held in the queue.

use futures_lite::StreamExt;
use lapin::options::{
    BasicConsumeOptions, BasicPublishOptions, BasicQosOptions, BasicRecoverOptions,
    ChannelFlowOptions, ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use std::time::Duration;
use weir_backend::testing::MemStore;

mod support;
use support::broker;

async fn connect() -> (Connection, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("temp dir");
    let uri = broker(MemStore::new(), dir.path()).await;
    let conn = Connection::connect(&uri, ConnectionProperties::default())
        .await
        .expect("connects");
    (conn, dir)
}

async fn declare(ch: &Channel, name: &str) {
    ch.queue_declare(
        name.into(),
        QueueDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .expect("declare");
}

async fn ready(ch: &Channel, name: &str) -> u32 {
    ch.queue_declare(
        name.into(),
        QueueDeclareOptions {
            passive: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .expect("passive declare")
    .message_count()
}

/// Publishes `body` to `queue` and waits for its confirm.
async fn publish(ch: &Channel, queue: &str, body: &[u8]) {
    ch.basic_publish(
        "".into(),
        queue.into(),
        BasicPublishOptions::default(),
        body,
        BasicProperties::default(),
    )
    .await
    .expect("publish")
    .await
    .expect("confirmed");
}

async fn consume(ch: &Channel, queue: &str, tag: &str) -> lapin::Consumer {
    ch.basic_consume(
        queue.into(),
        tag.into(),
        BasicConsumeOptions::default(),
        FieldTable::default(),
    )
    .await
    .expect("consume")
}

async fn next(c: &mut lapin::Consumer) -> lapin::message::Delivery {
    tokio::time::timeout(Duration::from_secs(10), c.next())
        .await
        .expect("a delivery within 10 s")
        .expect("consumer open")
        .expect("delivery")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn channel_flow_off_holds_deliveries_and_on_releases_them() {
    let (conn, _dir) = connect().await;
    let pubs = conn.create_channel().await.expect("channel");
    pubs.confirm_select(ConfirmSelectOptions::default())
        .await
        .expect("confirms");
    let ch = conn.create_channel().await.expect("channel");
    declare(&ch, "flow").await;
    let mut c = consume(&ch, "flow", "c").await;
    ch.channel_flow(ChannelFlowOptions { active: false })
        .await
        .expect("flow off");
    publish(&pubs, "flow", b"held").await;
    assert_eq!(ready(&pubs, "flow").await, 1, "flow off: nothing delivered");
    ch.channel_flow(ChannelFlowOptions { active: true })
        .await
        .expect("flow on");
    assert_eq!(next(&mut c).await.data, b"held");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn global_qos_is_one_window_for_the_channels_consumers() {
    let (conn, _dir) = connect().await;
    let pubs = conn.create_channel().await.expect("channel");
    pubs.confirm_select(ConfirmSelectOptions::default())
        .await
        .expect("confirms");
    let ch = conn.create_channel().await.expect("channel");
    declare(&ch, "g1").await;
    declare(&ch, "g2").await;
    ch.basic_qos(1, BasicQosOptions { global: true })
        .await
        .expect("qos");
    let mut c1 = consume(&ch, "g1", "c1").await;
    let _c2 = consume(&ch, "g2", "c2").await;
    publish(&pubs, "g1", b"first").await;
    publish(&pubs, "g2", b"second").await;
    // One window of 1 for both consumers: the second message waits.
    assert_eq!(ready(&pubs, "g2").await, 1, "the channel's window is full");
    let d = next(&mut c1).await;
    d.ack(Default::default()).await.expect("ack");
    // The ack gives the shared window back: g2's message goes out.
    let mut left = 1;
    for _ in 0..100 {
        left = ready(&pubs, "g2").await;
        if left == 0 {
            break;
        }
        // The ack and the passive declare travel on different channels:
        // ask again until the ack's batch has run (bounded, no sleep).
        tokio::task::yield_now().await;
    }
    assert_eq!(left, 0, "the ack freed the shared window");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recover_requeue_redelivers_every_unacked_message() {
    let (conn, _dir) = connect().await;
    let pubs = conn.create_channel().await.expect("channel");
    pubs.confirm_select(ConfirmSelectOptions::default())
        .await
        .expect("confirms");
    let ch = conn.create_channel().await.expect("channel");
    declare(&ch, "rec").await;
    let mut c = consume(&ch, "rec", "c").await;
    publish(&pubs, "rec", b"a").await;
    publish(&pubs, "rec", b"b").await;
    let first = [next(&mut c).await, next(&mut c).await];
    assert!(first.iter().all(|d| !d.redelivered));
    ch.basic_recover(BasicRecoverOptions { requeue: true })
        .await
        .expect("recover-ok");
    let again = [next(&mut c).await, next(&mut c).await];
    let bodies: Vec<&[u8]> = again.iter().map(|d| d.data.as_slice()).collect();
    assert_eq!(bodies, vec![b"a".as_slice(), b"b".as_slice()], "in order");
    assert!(again.iter().all(|d| d.redelivered), "marked redelivered");
}
