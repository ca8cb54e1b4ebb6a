//! Idempotent publish (issue 7, item 10) through lapin against the real
//! binary: the receipts survive `kill -9` in the middle of confirmed
//! publishing: after the restart, the publisher's retry of everything it
//! sent enqueues nothing twice.
//!
//! The rules themselves (a duplicate within `x-dedup-window` confirmed and
//! dropped, never returned; `x-dedup-on-message-id`; the window's end on
//! the engine's clock; the arguments' 406s) are tested in process, without
//! a process or a sleep: engine/tests/dedup.rs. Weir alone has this
//! (RabbitMQ 3.10 does not): conformance scenario
//! conformance/weirconf/scenarios/idempotency.py.

use lapin::options::*;
use lapin::types::{AMQPValue, FieldTable};
use lapin::Confirmation;
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use weir_tests::*;

const QUEUE: &str = "idem";

/// A dead broker must not hang a publisher for long.
const STEP_TIMEOUT: Duration = Duration::from_secs(10);

fn keyed(key: &str) -> BasicProperties {
    let mut h = FieldTable::default();
    h.insert(
        "x-idempotency-key".into(),
        AMQPValue::LongString(key.into()),
    );
    persistent().with_headers(h)
}

async fn declare_durable(ch: &Channel, name: &str, args: FieldTable) {
    ch.queue_declare(
        name.into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        args,
    )
    .await
    .unwrap_or_else(|e| panic!("declaring {name}: {e}"));
}

/// Publishes (mandatory) and returns the broker's confirmation.
async fn publish(ch: &Channel, queue: &str, body: &[u8], props: BasicProperties) -> Confirmation {
    let confirm = within(
        "publish",
        ch.basic_publish(
            "".into(),
            queue.into(),
            BasicPublishOptions {
                mandatory: true,
                ..Default::default()
            },
            body,
            props,
        ),
    )
    .await
    .expect("basic.publish");
    within("confirm", confirm).await.expect("publisher confirm")
}

/// A positive confirm without a returned message.
#[track_caller]
fn assert_plain_ack(c: &Confirmation, what: &str) {
    assert!(
        matches!(c, Confirmation::Ack(None)),
        "{what}: expected a plain ack, got {c:?}"
    );
}

/// Takes every ready message of `queue` (auto-ack) and counts their bodies.
async fn drain(ch: &Channel, queue: &str) -> BTreeMap<String, u32> {
    let mut seen = BTreeMap::new();
    while let Some(m) = within(
        "basic.get",
        ch.basic_get(queue.into(), BasicGetOptions { no_ack: true }),
    )
    .await
    .expect("basic.get")
    {
        *seen
            .entry(String::from_utf8_lossy(&m.delivery.data).into_owned())
            .or_insert(0) += 1;
    }
    seen
}

#[derive(Default, Debug)]
struct Sent {
    /// Every key published (in order), confirmed or not.
    attempted: Vec<String>,
    /// Keys the broker confirmed.
    confirmed: Vec<String>,
}

/// Publishes keyed messages with confirms, 16 in flight, until the
/// connection dies (the broker is killed). Reports progress on `progress`.
async fn publish_until_killed(url: String, progress: watch::Sender<usize>) -> Sent {
    let mut sent = Sent::default();
    let Ok(Ok(conn)) = tokio::time::timeout(
        STEP_TIMEOUT,
        Connection::connect(&url, ConnectionProperties::default()),
    )
    .await
    else {
        return sent;
    };
    let Ok(ch) = conn.create_channel().await else {
        return sent;
    };
    if ch
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .is_err()
    {
        return sent;
    }
    let mut n = 0u64;
    loop {
        let mut pending = Vec::new();
        for _ in 0..16 {
            let key = format!("k{n}");
            n += 1;
            sent.attempted.push(key.clone());
            let published = ch
                .basic_publish(
                    "".into(),
                    QUEUE.into(),
                    BasicPublishOptions::default(),
                    key.as_bytes(),
                    keyed(&key),
                )
                .await;
            match published {
                Ok(c) => pending.push((key, c)),
                Err(_) => return sent,
            }
        }
        for (key, c) in pending {
            match tokio::time::timeout(STEP_TIMEOUT, c).await {
                Ok(Ok(c)) if c.is_ack() => sent.confirmed.push(key),
                Ok(Ok(c)) => panic!("{key} nacked: {c:?}"),
                _ => return sent,
            }
        }
        progress.send_replace(sent.confirmed.len());
    }
}

/// Confirmed publishing, `kill -9` in the middle, restart, and the
/// publisher retries everything it sent: each key is in the queue exactly
/// once (nothing confirmed lost, nothing duplicated), keys consumed before
/// the crash are not enqueued again, and new keys still are.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receipts_survive_kill9_in_the_middle_of_confirmed_publishing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut broker = Broker::start_in(dir.path());
    {
        let conn = connect(&broker.url()).await;
        let ch = confirm_channel(&conn).await;
        declare_durable(&ch, QUEUE, FieldTable::default()).await;
        // Published and consumed before the crash: only receipts remain.
        for i in 0..50 {
            let key = format!("early{i}");
            assert_plain_ack(
                &publish(&ch, QUEUE, key.as_bytes(), keyed(&key)).await,
                &key,
            );
        }
        assert_eq!(drain(&ch, QUEUE).await.len(), 50);
        conn.close(200, "bye".into()).await.expect("close");
    }
    let (tx, mut progress) = watch::channel(0usize);
    let publisher = tokio::spawn(publish_until_killed(broker.url(), tx));
    within(
        "300 confirmed publishes",
        progress.wait_for(|confirmed| *confirmed >= 300),
    )
    .await
    .expect("publisher running");
    // In the middle: more publishes are in flight right now.
    broker.kill9();
    let sent = within("publisher to notice the crash", publisher)
        .await
        .expect("publisher task");
    assert!(sent.confirmed.len() >= 300, "{sent:?}");
    broker.restart();

    let conn = connect(&broker.url()).await;
    let ch = Arc::new(confirm_channel(&conn).await);
    // The retry: everything attempted, in order, and the early keys again.
    let retry: Vec<String> = (0..50)
        .map(|i| format!("early{i}"))
        .chain(sent.attempted.iter().cloned())
        .collect();
    for key in &retry {
        assert_plain_ack(
            &publish(&ch, QUEUE, key.as_bytes(), keyed(key)).await,
            &format!("retry of {key}"),
        );
    }
    assert_plain_ack(
        &publish(&ch, QUEUE, b"fresh", keyed("fresh")).await,
        "fresh",
    );
    let seen = drain(&ch, QUEUE).await;
    for key in &sent.attempted {
        assert_eq!(
            seen.get(key).copied().unwrap_or(0),
            1,
            "{key} (confirmed before the crash: {})",
            sent.confirmed.contains(key)
        );
    }
    assert_eq!(seen.get("fresh"), Some(&1));
    assert!(
        seen.keys().all(|k| !k.starts_with("early")),
        "consumed before the crash, enqueued again: {:?}",
        seen.keys()
            .filter(|k| k.starts_with("early"))
            .collect::<Vec<_>>()
    );
    assert_eq!(seen.len(), sent.attempted.len() + 1);
    conn.close(200, "bye".into()).await.expect("close");
}
