//! AMQP transactions (tx.select / tx.commit / tx.rollback) and the
//! `expiration` check, through lapin over the real listener and session,
//! in process over `MemStore`.
//!
//! Deterministic without sleeps: a connection's frames are handled in
//! order, so a passive declare sent after a publish (or an ack) sees its
//! effect or its absence; commit-ok waits for the store's durability,
//! which the test holds and releases.

use lapin::options::{
    BasicAckOptions, BasicGetOptions, BasicPublishOptions, BasicRecoverOptions,
    ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use std::future::Future;
use std::sync::Arc;
use weir_backend::testing::MemStore;

mod support;
use support::broker;

async fn connect() -> (Connection, Arc<MemStore>, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("temp dir");
    let store = MemStore::new();
    let uri = broker(store.clone(), dir.path()).await;
    let conn = Connection::connect(&uri, ConnectionProperties::default())
        .await
        .expect("connects");
    (conn, store, dir)
}

async fn declare(ch: &Channel, name: &str, durable: bool) {
    ch.queue_declare(
        name.into(),
        QueueDeclareOptions {
            durable,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .expect("declare");
}

/// Ready messages of `queue`, read on a fresh channel of `conn` (so after
/// every frame sent before on any channel of it).
async fn ready(conn: &Connection, queue: &str) -> u32 {
    let ch = conn.create_channel().await.expect("channel");
    let n = ch
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .expect("passive declare")
        .message_count();
    ch.close(200, "bye".into()).await.expect("close");
    n
}

async fn publish_with(ch: &Channel, queue: &str, body: &[u8], props: BasicProperties) {
    ch.basic_publish(
        "".into(),
        queue.into(),
        BasicPublishOptions::default(),
        body,
        props,
    )
    .await
    .expect("publish sent");
}

async fn publish(ch: &Channel, queue: &str, body: &[u8]) {
    publish_with(ch, queue, body, BasicProperties::default()).await;
}

/// Takes one message with a lease; returns its delivery tag and body.
async fn get(ch: &Channel, queue: &str) -> (u64, Vec<u8>, bool) {
    let m = ch
        .basic_get(queue.into(), BasicGetOptions { no_ack: false })
        .await
        .expect("get")
        .expect("a message");
    (
        m.delivery.delivery_tag,
        m.delivery.data.clone(),
        m.delivery.redelivered,
    )
}

async fn ack(ch: &Channel, tag: u64) {
    ch.basic_ack(tag, BasicAckOptions::default())
        .await
        .expect("ack sent");
}

fn reply_code(e: &lapin::Error) -> Option<u16> {
    match e.kind() {
        lapin::ErrorKind::ProtocolError(amqp) => Some(amqp.get_id()),
        _ => None,
    }
}

#[track_caller]
fn assert_code<T: std::fmt::Debug>(r: Result<T, lapin::Error>, code: u16) {
    match r {
        Ok(v) => panic!("expected AMQP error {code}, got Ok({v:?})"),
        Err(e) => assert_eq!(reply_code(&e), Some(code), "got {e:?}"),
    }
}

type Events = std::pin::Pin<Box<dyn futures_lite::Stream<Item = lapin::Event> + Send>>;

/// The connection's events from now on (a channel closed by the broker
/// after a method without a reply shows up here).
fn events(conn: &Connection) -> Events {
    Box::pin(conn.events_listener())
}

/// The reply code of the next error event (the timeout only bounds a
/// failing test).
async fn next_error_code(events: &mut Events) -> u16 {
    use futures_lite::StreamExt;
    loop {
        let next = tokio::time::timeout(std::time::Duration::from_secs(10), events.next());
        match next.await.expect("an error event in time") {
            Some(lapin::Event::Error(e)) => return reply_code(&e).expect("an AMQP close"),
            Some(_) => continue,
            None => panic!("event stream ended"),
        }
    }
}

/// Whether `f` completes without waiting (polled once).
fn is_done<F: Future + Unpin>(f: &mut F) -> bool {
    let waker = std::task::Waker::noop();
    let mut cx = std::task::Context::from_waker(waker);
    std::pin::Pin::new(f).poll(&mut cx).is_ready()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publishes_take_effect_at_commit_and_vanish_on_rollback() {
    let (conn, _store, _dir) = connect().await;
    let ch = conn.create_channel().await.expect("channel");
    declare(&ch, "q", false).await;
    ch.tx_select().await.expect("tx.select");

    publish(&ch, "q", b"a").await;
    publish(&ch, "q", b"b").await;
    assert_eq!(ready(&conn, "q").await, 0, "visible before commit");
    ch.tx_commit().await.expect("commit");
    assert_eq!(ready(&conn, "q").await, 2, "committed publishes");

    publish(&ch, "q", b"gone").await;
    ch.tx_rollback().await.expect("rollback");
    assert_eq!(ready(&conn, "q").await, 2, "rolled back publish");

    // The channel stays transacted after either.
    publish(&ch, "q", b"c").await;
    assert_eq!(ready(&conn, "q").await, 2);
    ch.tx_commit().await.expect("commit");
    let bodies: Vec<Vec<u8>> = {
        let plain = conn.create_channel().await.expect("channel");
        let mut v = Vec::new();
        for _ in 0..3 {
            let m = plain
                .basic_get("q".into(), BasicGetOptions { no_ack: true })
                .await
                .expect("get")
                .expect("message");
            v.push(m.delivery.data.clone());
        }
        v
    };
    assert_eq!(bodies, vec![b"a".to_vec(), b"b".to_vec(), b"c".to_vec()]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acks_take_effect_at_commit_and_rollback_leaves_them_unacked() {
    let (conn, _store, _dir) = connect().await;
    let setup = conn.create_channel().await.expect("channel");
    declare(&setup, "q", false).await;
    for b in [b"1", b"2", b"3"] {
        publish(&setup, "q", b).await;
    }
    assert_eq!(ready(&conn, "q").await, 3);

    // Rolled back: the ack never happened, the message is still leased
    // (not back in the queue), and can be acked again.
    let ch = conn.create_channel().await.expect("channel");
    ch.tx_select().await.expect("tx.select");
    let (t1, body, _) = get(&ch, "q").await;
    assert_eq!(body, b"1");
    ack(&ch, t1).await;
    ch.tx_rollback().await.expect("rollback");
    assert_eq!(ready(&conn, "q").await, 2, "still leased after rollback");
    ack(&ch, t1).await;
    ch.tx_commit().await.expect("commit");

    // Acked in a transaction but not committed: closing the channel
    // returns the message (the ack did not take effect).
    let (t2, body, _) = get(&ch, "q").await;
    assert_eq!(body, b"2");
    ack(&ch, t2).await;
    ch.close(200, "bye".into()).await.expect("close");
    assert_eq!(ready(&conn, "q").await, 2, "uncommitted ack returned it");

    // Committed: gone for good, even when the channel then closes.
    let ch = conn.create_channel().await.expect("channel");
    ch.tx_select().await.expect("tx.select");
    let (t, body, redelivered) = get(&ch, "q").await;
    assert_eq!((body.as_slice(), redelivered), (&b"2"[..], true));
    ch.basic_ack(t, BasicAckOptions { multiple: true })
        .await
        .expect("ack sent");
    ch.tx_commit().await.expect("commit");
    ch.close(200, "bye".into()).await.expect("close");
    assert_eq!(ready(&conn, "q").await, 1, "only 3 is left");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_multiple_ack_covers_the_leases_held_when_it_arrives() {
    let (conn, _store, _dir) = connect().await;
    let ch = conn.create_channel().await.expect("channel");
    declare(&ch, "q", false).await;
    for b in [b"1", b"2"] {
        publish(&ch, "q", b).await;
    }
    ch.tx_select().await.expect("tx.select");
    get(&ch, "q").await;
    // multiple with tag 0: every lease held now (only t1).
    ch.basic_ack(0, BasicAckOptions { multiple: true })
        .await
        .expect("ack sent");
    get(&ch, "q").await;
    ch.tx_commit().await.expect("commit");
    // The second lease was not covered: recover returns it.
    ch.basic_recover(BasicRecoverOptions { requeue: true })
        .await
        .expect("recover");
    assert_eq!(ready(&conn, "q").await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commit_ok_waits_for_the_publishes_to_be_durable() {
    let (conn, store, _dir) = connect().await;
    let ch = conn.create_channel().await.expect("channel");
    declare(&ch, "dq", true).await;
    ch.tx_select().await.expect("tx.select");
    store.hold_durability(true);
    publish_with(
        &ch,
        "dq",
        b"p",
        BasicProperties::default().with_delivery_mode(2),
    )
    .await;
    let mut commit = Box::pin(ch.tx_commit());
    while store.held_waiters() == 0 {
        assert!(!is_done(&mut commit), "commit-ok before the fsync");
        tokio::task::yield_now().await;
    }
    store.release();
    store.hold_durability(false);
    commit.await.expect("commit-ok once durable");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unroutable_mandatory_publishes_are_returned_at_commit() {
    let (conn, _store, _dir) = connect().await;
    let ch = conn.create_channel().await.expect("channel");
    ch.tx_select().await.expect("tx.select");
    ch.basic_publish(
        "".into(),
        "no-such-queue".into(),
        BasicPublishOptions {
            mandatory: true,
            ..Default::default()
        },
        b"r",
        BasicProperties::default(),
    )
    .await
    .expect("publish sent");
    ch.tx_rollback().await.expect("rollback");
    // Rolled back: nothing was returned.
    assert!(ch.wait_for_confirms().await.expect("returns").is_empty());
    ch.basic_publish(
        "".into(),
        "no-such-queue".into(),
        BasicPublishOptions {
            mandatory: true,
            ..Default::default()
        },
        b"r",
        BasicProperties::default(),
    )
    .await
    .expect("publish sent");
    ch.tx_commit().await.expect("commit");
    let returned = ch.wait_for_confirms().await.expect("returns");
    assert_eq!(returned.len(), 1, "returned before commit-ok");
    assert_eq!(returned[0].delivery.data, b"r");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transaction_errors_are_406_as_in_rabbitmq() {
    let (conn, _store, _dir) = connect().await;

    let ch = conn.create_channel().await.expect("channel");
    assert_code(ch.tx_commit().await, 406);
    let ch = conn.create_channel().await.expect("channel");
    assert_code(ch.tx_rollback().await, 406);

    let ch = conn.create_channel().await.expect("channel");
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .expect("confirm");
    assert_code(ch.tx_select().await, 406);

    let ch = conn.create_channel().await.expect("channel");
    ch.tx_select().await.expect("tx.select");
    ch.tx_select().await.expect("tx.select again");
    assert_code(
        ch.confirm_select(ConfirmSelectOptions::default()).await,
        406,
    );

    // An ack of a tag the transaction already acked: unknown, at once.
    let ch = conn.create_channel().await.expect("channel");
    declare(&ch, "q", false).await;
    publish(&ch, "q", b"x").await;
    ch.tx_select().await.expect("tx.select");
    let (t, _, _) = get(&ch, "q").await;
    ack(&ch, t).await;
    let mut ev = events(&conn);
    ack(&ch, t).await;
    assert_eq!(next_error_code(&mut ev).await, 406);
    // The channel closed with its transaction: the lease went back.
    assert_eq!(ready(&conn, "q").await, 1);

    // A publish to a missing exchange fails when published, not at commit.
    let ch = conn.create_channel().await.expect("channel");
    ch.tx_select().await.expect("tx.select");
    let mut ev = events(&conn);
    ch.basic_publish(
        "no-such-exchange".into(),
        "k".into(),
        BasicPublishOptions::default(),
        b"x",
        BasicProperties::default(),
    )
    .await
    .expect("publish sent");
    assert_eq!(next_error_code(&mut ev).await, 404);

    // The connection survives all of it.
    assert!(conn.status().connected());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_is_bounded() {
    let (conn, _store, _dir) = connect().await;
    let ch = conn.create_channel().await.expect("channel");
    declare(&ch, "q", false).await;
    ch.tx_select().await.expect("tx.select");
    // 32 MiB per connection: the 33rd MiB is refused.
    let body = vec![0u8; 1 << 20];
    let mut ev = events(&conn);
    for _ in 0..32 {
        publish(&ch, "q", &body).await;
    }
    assert_eq!(next_error_code(&mut ev).await, 406);
    assert_eq!(ready(&conn, "q").await, 0, "nothing of it was published");
    // A fresh channel has the whole allowance again.
    let ch = conn.create_channel().await.expect("channel");
    ch.tx_select().await.expect("tx.select");
    for _ in 0..8 {
        publish(&ch, "q", &body).await;
    }
    ch.tx_commit().await.expect("commit");
    assert_eq!(ready(&conn, "q").await, 8);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_expiration_is_refused_with_406() {
    let (conn, _store, _dir) = connect().await;
    let ch = conn.create_channel().await.expect("channel");
    declare(&ch, "q", false).await;
    for good in ["0", "60000", "+50000", "4294967296", "315360000000"] {
        publish_with(
            &ch,
            "q",
            b"ok",
            BasicProperties::default().with_expiration(good.into()),
        )
        .await;
    }
    // Expiration "0" with no consumer waiting expires at once (RabbitMQ's
    // rule): four are left.
    assert_eq!(ready(&conn, "q").await, 4);
    for bad in ["abc", "-1", "1.5", "315360000001", ""] {
        let ch = conn.create_channel().await.expect("channel");
        let mut ev = events(&conn);
        publish_with(
            &ch,
            "q",
            b"bad",
            BasicProperties::default().with_expiration(bad.into()),
        )
        .await;
        assert_eq!(next_error_code(&mut ev).await, 406, "{bad:?}");
    }
    assert_eq!(ready(&conn, "q").await, 4, "no refused message queued");
    assert!(conn.status().connected());
}
