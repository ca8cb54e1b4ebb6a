//! basic.consume's `x-priority` and the message `priority` property reach
//! the engine from AMQP: through lapin over the real listener and session,
//! in process over `MemStore`. Who receives is tested in
//! `engine/tests/consumers.rs`; these show the wiring.

use futures_lite::StreamExt;
use lapin::options::{
    BasicConsumeOptions, BasicGetOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};
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

fn table(k: &str, v: AMQPValue) -> FieldTable {
    let mut t = FieldTable::default();
    t.insert(k.into(), v);
    t
}

async fn declare(ch: &Channel, name: &str, args: FieldTable) {
    ch.queue_declare(name.into(), QueueDeclareOptions::default(), args)
        .await
        .expect("declare");
}

/// Publishes `body` with `priority` to `queue` and waits for its confirm
/// (given after routing and dispatch ran).
async fn publish(ch: &Channel, queue: &str, body: &[u8], priority: u8) {
    ch.basic_publish(
        "".into(),
        queue.into(),
        BasicPublishOptions::default(),
        body,
        BasicProperties::default().with_priority(priority),
    )
    .await
    .expect("publish")
    .await
    .expect("confirmed");
}

async fn consume(ch: &Channel, queue: &str, tag: &str, args: FieldTable) -> lapin::Consumer {
    ch.basic_consume(
        queue.into(),
        tag.into(),
        BasicConsumeOptions::default(),
        args,
    )
    .await
    .expect("consume")
}

async fn next(c: &mut lapin::Consumer) -> Vec<u8> {
    tokio::time::timeout(Duration::from_secs(10), c.next())
        .await
        .expect("a delivery within 10 s")
        .expect("consumer open")
        .expect("delivery")
        .data
}

fn reply_code(e: &lapin::Error) -> Option<u16> {
    match e.kind() {
        lapin::ErrorKind::ProtocolError(amqp) => Some(amqp.get_id()),
        _ => None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn x_priority_sends_messages_to_the_higher_consumer_while_it_has_credit() {
    let (conn, _dir) = connect().await;
    let pubs = conn.create_channel().await.expect("channel");
    pubs.confirm_select(ConfirmSelectOptions::default())
        .await
        .expect("confirms");
    declare(&pubs, "q", FieldTable::default()).await;
    let lo_ch = conn.create_channel().await.expect("channel");
    let mut lo = consume(&lo_ch, "q", "lo", FieldTable::default()).await;
    let hi_ch = conn.create_channel().await.expect("channel");
    hi_ch
        .basic_qos(1, BasicQosOptions::default())
        .await
        .expect("qos");
    let mut hi = consume(
        &hi_ch,
        "q",
        "hi",
        table("x-priority", AMQPValue::ShortInt(5)),
    )
    .await;
    publish(&pubs, "q", b"first", 0).await;
    publish(&pubs, "q", b"second", 0).await;
    // The higher one, registered later, takes the first; out of credit, the
    // lower one takes the second.
    assert_eq!(next(&mut hi).await, b"first");
    assert_eq!(next(&mut lo).await, b"second");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_non_integer_x_priority_is_refused_with_406_after_the_queue_lookup() {
    let (conn, _dir) = connect().await;
    let ch = conn.create_channel().await.expect("channel");
    declare(&ch, "q", FieldTable::default()).await;
    let bad = || table("x-priority", AMQPValue::LongString("high".into()));
    let e = ch
        .basic_consume(
            "q".into(),
            "c".into(),
            BasicConsumeOptions::default(),
            bad(),
        )
        .await
        .expect_err("refused");
    assert_eq!(reply_code(&e), Some(406), "{e:?}");
    let ch = conn.create_channel().await.expect("channel");
    let e = ch
        .basic_consume(
            "absent".into(),
            "c".into(),
            BasicConsumeOptions::default(),
            bad(),
        )
        .await
        .expect_err("refused");
    assert_eq!(reply_code(&e), Some(404), "{e:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_priority_property_orders_a_priority_queue() {
    let (conn, _dir) = connect().await;
    let ch = conn.create_channel().await.expect("channel");
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .expect("confirms");
    declare(
        &ch,
        "pq",
        table("x-max-priority", AMQPValue::ShortShortUInt(9)),
    )
    .await;
    for (body, p) in [("p1", 1u8), ("p9", 9), ("p5", 5), ("p9b", 9), ("p0", 0)] {
        publish(&ch, "pq", body.as_bytes(), p).await;
    }
    let mut order = Vec::new();
    while let Some(m) = ch
        .basic_get("pq".into(), BasicGetOptions { no_ack: true })
        .await
        .expect("get")
    {
        order.push(String::from_utf8(m.delivery.data).expect("utf-8"));
    }
    assert_eq!(order, ["p9", "p9b", "p5", "p1", "p0"]);
}
