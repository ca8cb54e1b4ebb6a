//! lapin conveniences: connect, confirm-mode channels, declares, confirmed
//! publishes, deliveries, and the reply codes of channel/connection errors
//! (also those that arrive asynchronously, as connection events).

use futures_lite::StreamExt;
use lapin::options::{
    BasicConsumeOptions, BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};

use crate::OP_TIMEOUT;

/// Bounds a future with [`OP_TIMEOUT`], panicking with `what` on timeout.
pub async fn within<F: std::future::Future>(what: &str, f: F) -> F::Output {
    match tokio::time::timeout(OP_TIMEOUT, f).await {
        Ok(v) => v,
        Err(_) => panic!("timed out: {what}"),
    }
}

pub async fn connect(url: &str) -> Connection {
    within(
        "connect",
        Connection::connect(url, ConnectionProperties::default()),
    )
    .await
    .unwrap_or_else(|e| panic!("connecting to {url}: {e}"))
}

/// A channel in confirm mode.
pub async fn confirm_channel(conn: &Connection) -> Channel {
    let ch = conn.create_channel().await.expect("channel.open");
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .expect("confirm.select");
    ch
}

/// The AMQP reply code of a channel/connection close error, if it is one.
pub fn reply_code(e: &lapin::Error) -> Option<u16> {
    match e.kind() {
        lapin::ErrorKind::ProtocolError(amqp) => Some(amqp.get_id()),
        _ => None,
    }
}

/// Asserts `r` failed with AMQP reply `code`.
#[track_caller]
pub fn assert_code<T: std::fmt::Debug>(r: Result<T, lapin::Error>, code: u16) {
    match r {
        Ok(v) => panic!("expected AMQP error {code}, got Ok({v:?})"),
        Err(e) => assert_eq!(
            reply_code(&e),
            Some(code),
            "expected reply {code}, got error {e:?}"
        ),
    }
}

/// Declares a plain (non-durable) queue.
pub async fn declare_queue(ch: &Channel, name: &str) -> lapin::Queue {
    ch.queue_declare(
        name.into(),
        QueueDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap_or_else(|e| panic!("declaring {name}: {e}"))
}

/// Message count of `name` via a passive declare.
pub async fn queue_len(ch: &Channel, name: &str) -> u32 {
    ch.queue_declare(
        name.into(),
        QueueDeclareOptions {
            passive: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .unwrap_or_else(|e| panic!("passive declare {name}: {e}"))
    .message_count()
}

pub fn persistent() -> BasicProperties {
    BasicProperties::default().with_delivery_mode(2)
}

/// Publishes and waits for a positive confirm (the channel must be in
/// confirm mode).
pub async fn publish_confirmed(
    ch: &Channel,
    exchange: &str,
    key: &str,
    body: &[u8],
    props: BasicProperties,
) {
    let confirm = within(
        "publish",
        ch.basic_publish(
            exchange.into(),
            key.into(),
            BasicPublishOptions::default(),
            body,
            props,
        ),
    )
    .await
    .expect("basic.publish");
    let c = within("confirm", confirm).await.expect("publisher confirm");
    assert!(
        c.is_ack(),
        "publish to {exchange:?}/{key:?} was nacked: {c:?}"
    );
}

/// Next delivery from a consumer, bounded by [`OP_TIMEOUT`].
pub async fn next_delivery(consumer: &mut lapin::Consumer) -> lapin::message::Delivery {
    within("delivery", consumer.next())
        .await
        .expect("consumer stream ended")
        .expect("delivery error")
}

/// Opens a fresh connection and checks it can declare, publish and get.
pub async fn assert_broker_healthy(url: &str) {
    let conn = connect(url).await;
    let ch = confirm_channel(&conn).await;
    let q = declare_queue(&ch, "").await;
    let name = q.name().as_str().to_string();
    publish_confirmed(&ch, "", &name, b"health", BasicProperties::default()).await;
    let got = ch
        .basic_get(
            name.as_str().into(),
            lapin::options::BasicGetOptions { no_ack: true },
        )
        .await
        .expect("basic.get")
        .expect("health message");
    assert_eq!(got.delivery.data, b"health");
    conn.close(200, "bye".into())
        .await
        .expect("connection.close");
}

/// Connection events, to observe asynchronous channel closes (after a
/// publish or an ack). Subscribe before triggering the error.
pub fn error_events(
    conn: &Connection,
) -> std::pin::Pin<Box<dyn futures_lite::Stream<Item = lapin::Event> + Send>> {
    Box::pin(conn.events_listener())
}

/// The reply code of the next error event.
pub async fn next_error_code(
    events: &mut std::pin::Pin<Box<dyn futures_lite::Stream<Item = lapin::Event> + Send>>,
) -> u16 {
    loop {
        match within("an error event", events.next()).await {
            Some(lapin::Event::Error(e)) => {
                return reply_code(&e).unwrap_or_else(|| panic!("not an AMQP close: {e:?}"))
            }
            Some(_) => continue,
            None => panic!("event stream ended"),
        }
    }
}

/// basic.consume on `queue` with tag `tag` (acks required), panicking on error.
pub async fn consume(ch: &Channel, queue: &str, tag: &str) -> lapin::Consumer {
    ch.basic_consume(
        queue.into(),
        tag.into(),
        BasicConsumeOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap_or_else(|e| panic!("basic.consume {queue}: {e}"))
}
