//! Issue 20, item 1: a no-ack consumer drains a durable queue of any depth
//! without a gap. Deep persistent messages keep only their store location
//! and are read back when delivered; a no-ack consumer sends nothing back,
//! so once the session stopped encoding at its write buffer's high-water
//! mark and then flushed the whole buffer to a fast reader, nothing woke it
//! for the deliveries it still held (it stalled for good without
//! heartbeats). Against the real binary, with lapin, heartbeats off so no
//! timer can hide a lost wake-up.

use lapin::options::{BasicConsumeOptions, BasicPublishOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use std::time::Duration;
use weir_tests::*;

/// The broker proposes no heartbeats (lapin then sends none either): a
/// lost wake-up stays lost instead of being hidden by the next heartbeat.
const NO_HEARTBEATS: &[&str] = &["--heartbeat", "0"];
/// Messages published: far deeper than the bodies a queue keeps in memory.
const MESSAGES: usize = 100_000;
/// Body size of each message.
const BODY: usize = 300;
/// Messages and body size where 2,000 deliveries (a no-ack consumer's
/// window) encode to more than the session's 1 MiB delivery high-water
/// mark.
const LARGE_MESSAGES: usize = 20_000;
const LARGE_BODY: usize = 2_000;
/// The whole drain, generous for a debug build on a loaded machine (it
/// takes 5-30 s); the broker before the fix stalled for good in the
/// larger-message tests.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(120);

/// Declares the durable queue `name` and publishes `n` persistent
/// `size`-byte messages to it, confirmed (pipelined in batches).
async fn fill(url: &str, name: &str, n: usize, size: usize) {
    let conn = connect(url).await;
    let ch = confirm_channel(&conn).await;
    ch.queue_declare(
        name.into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .expect("queue.declare");
    let body = vec![b'x'; size];
    let mut left = n;
    while left > 0 {
        let batch = left.min(1_000);
        let mut confirms = Vec::with_capacity(batch);
        for _ in 0..batch {
            let c = ch
                .basic_publish(
                    "".into(),
                    name.into(),
                    BasicPublishOptions::default(),
                    &body,
                    persistent(),
                )
                .await
                .expect("basic.publish");
            confirms.push(c);
        }
        for c in confirms {
            let c = within("confirm", c).await.expect("publisher confirm");
            assert!(c.is_ack(), "publish nacked: {c:?}");
        }
        left -= batch;
    }
    assert_eq!(queue_len(&ch, name).await as usize, n, "all published");
    conn.close(200, "bye".into()).await.expect("close");
}

/// Consumes `name` with `no_ack` until `n` messages arrived (each checked)
/// or [`DRAIN_TIMEOUT`] passed; then checks the queue is empty.
async fn drain_no_ack(b: &Broker, name: &str, n: usize, size: usize) {
    // No heartbeats: a lost wake-up stays lost instead of being hidden
    // by the heartbeat timer's next loop.
    let conn = connect(&b.url()).await;
    let ch = conn.create_channel().await.expect("channel.open");
    let mut consumer = ch
        .basic_consume(
            name.into(),
            "drain".into(),
            BasicConsumeOptions {
                no_ack: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .expect("basic.consume");
    let mut got = 0usize;
    let drained = tokio::time::timeout(DRAIN_TIMEOUT, async {
        while got < n {
            let d = consumer
                .next()
                .await
                .expect("consumer stream ended")
                .expect("delivery");
            assert_eq!(d.data.len(), size, "body of delivery {got}");
            got += 1;
        }
    })
    .await;
    if drained.is_err() {
        let probe = connect(&b.url()).await;
        let pch = probe.create_channel().await.expect("channel.open");
        let ready = queue_len(&pch, name).await;
        panic!(
            "no-ack consumer stalled: {got} of {n} received in {} s, {ready} still ready",
            DRAIN_TIMEOUT.as_secs()
        );
    }
    let probe = conn.create_channel().await.expect("channel.open");
    assert_eq!(queue_len(&probe, name).await, 0, "queue drained");
    conn.close(200, "bye".into()).await.expect("close");
}

/// The case, 100,000 persistent 300-byte messages in a durable
/// queue: a no-ack consumer receives every one of them. (lapin reads faster
/// than a debug broker writes, so before the fix this stalled only now and
/// then; pika, slower, stalled every time: see `scripts/abuse.sh
/// noack-drain`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_ack_consumer_drains_a_deep_durable_queue() {
    let b = Broker::start_with(NO_HEARTBEATS);
    fill(&b.url(), "deep", MESSAGES, BODY).await;
    drain_no_ack(&b, "deep", MESSAGES, BODY).await;
}

/// Larger messages: a no-ack consumer's credit (2,000 deliveries) is more
/// than the session encodes before its high-water mark (1 MiB), so every
/// batch stops there with deliveries in hand, even for a fast reader like
/// lapin (300-byte messages need a slower one, such as pika, for that).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_ack_consumer_drains_larger_messages() {
    let b = Broker::start_with(NO_HEARTBEATS);
    fill(&b.url(), "large", LARGE_MESSAGES, LARGE_BODY).await;
    drain_no_ack(&b, "large", LARGE_MESSAGES, LARGE_BODY).await;
}

/// The same after a restart: every message recovered from disk (none has
/// its body in memory), then drained by a no-ack consumer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_ack_consumer_drains_a_recovered_queue() {
    let mut b = Broker::start_with(NO_HEARTBEATS);
    fill(&b.url(), "recovered", LARGE_MESSAGES, LARGE_BODY).await;
    b.stop();
    b.restart();
    drain_no_ack(&b, "recovered", LARGE_MESSAGES, LARGE_BODY).await;
}
