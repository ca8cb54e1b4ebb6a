//! Errors as the client sees them: each engine error kind's AMQP reply code
//! once, the asynchronous closes (publish, ack), and login refusals. Which
//! operation fails with which error is tested in process
//! (`engine/tests/errors.rs`); after every channel error here the
//! connection keeps working.

use lapin::options::*;
use lapin::types::FieldTable;
use lapin::{BasicProperties, Connection, ExchangeKind};
use weir_tests::raw::RawClient;
use weir_tests::*;

fn passive_q() -> QueueDeclareOptions {
    QueueDeclareOptions {
        passive: true,
        ..Default::default()
    }
}

/// The connection still works: a new channel can declare, publish and get.
async fn still_works(conn: &Connection) {
    let ch = confirm_channel(conn).await;
    let q = declare_queue(&ch, "").await;
    publish_confirmed(
        &ch,
        "",
        q.name().as_str(),
        b"ok",
        BasicProperties::default(),
    )
    .await;
    let m = ch
        .basic_get(q.name().as_str().into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
        .expect("message");
    assert_eq!(m.delivery.data, b"ok");
    ch.close(200, "done".into()).await.unwrap();
}

/// Each engine error kind reaches the client as its reply code, closes only
/// the channel, and leaves the connection working. Which operation fails
/// with which kind is tested in process (`engine/tests/errors.rs`); this is
/// the AMQP mapping, once per code.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_errors_close_the_channel_with_their_reply_code() {
    let broker = Broker::start();
    let conn = connect(&broker.url()).await;

    // NotFound → 404.
    let ch = conn.create_channel().await.unwrap();
    assert_code(
        ch.queue_declare("missing-q".into(), passive_q(), FieldTable::default())
            .await,
        404,
    );
    still_works(&conn).await;

    // AccessRefused → 403.
    let ch = conn.create_channel().await.unwrap();
    assert_code(
        ch.exchange_declare(
            "amq.mine".into(),
            ExchangeKind::Direct,
            ExchangeDeclareOptions::default(),
            FieldTable::default(),
        )
        .await,
        403,
    );
    still_works(&conn).await;

    // PreconditionFailed → 406 (inequivalent redeclare).
    let ch = conn.create_channel().await.unwrap();
    declare_queue(&ch, "plain").await;
    assert_code(
        ch.queue_declare(
            "plain".into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await,
        406,
    );
    still_works(&conn).await;

    // ResourceLocked → 405, for another connection's exclusive queue; the
    // queue goes when its owner does.
    let owner = connect(&broker.url()).await;
    let och = owner.create_channel().await.unwrap();
    och.queue_declare(
        "excl".into(),
        QueueDeclareOptions {
            exclusive: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .unwrap();
    let ch = conn.create_channel().await.unwrap();
    assert_code(
        ch.basic_consume(
            "excl".into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await,
        405,
    );
    still_works(&conn).await;
    owner.close(200, "bye".into()).await.unwrap();
    let ch = conn.create_channel().await.unwrap();
    assert_code(
        ch.queue_declare("excl".into(), passive_q(), FieldTable::default())
            .await,
        404,
    );
    still_works(&conn).await;
    conn.close(200, "bye".into()).await.unwrap();
}

/// basic.publish has no reply: a publish to a missing exchange closes the
/// channel asynchronously, and in confirm mode the confirm fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_to_a_missing_exchange_closes_the_channel_404() {
    let broker = Broker::start();
    let conn = connect(&broker.url()).await;
    let ch = conn.create_channel().await.unwrap();
    let mut events = error_events(&conn);
    ch.basic_publish(
        "missing-x".into(),
        "k".into(),
        BasicPublishOptions::default(),
        b"x",
        BasicProperties::default(),
    )
    .await
    .expect("publish is fire-and-forget");
    assert_eq!(next_error_code(&mut events).await, 404);
    still_works(&conn).await;

    let ch = confirm_channel(&conn).await;
    let confirm = ch
        .basic_publish(
            "missing-x".into(),
            "k".into(),
            BasicPublishOptions::default(),
            b"x",
            BasicProperties::default(),
        )
        .await
        .expect("publish");
    match within("confirm after 404", confirm).await {
        Ok(c) => assert!(
            !c.is_ack(),
            "publish to a missing exchange was confirmed: {c:?}"
        ),
        Err(e) => assert_eq!(reply_code(&e), Some(404), "{e:?}"),
    }
    still_works(&conn).await;
    conn.close(200, "bye".into()).await.unwrap();
}

/// An ack of a tag never delivered, or acked already, closes the channel
/// with 406 (asynchronously: basic.ack has no reply).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_acks_are_406() {
    let broker = Broker::start();
    let conn = connect(&broker.url()).await;
    let ch = confirm_channel(&conn).await;
    declare_queue(&ch, "plain").await;
    publish_confirmed(&ch, "", "plain", b"x", BasicProperties::default()).await;

    let ch = conn.create_channel().await.unwrap();
    let mut events = error_events(&conn);
    ch.basic_ack(4242, BasicAckOptions::default())
        .await
        .expect("ack is fire-and-forget");
    assert_eq!(next_error_code(&mut events).await, 406);
    still_works(&conn).await;

    let ch = conn.create_channel().await.unwrap();
    let m = ch
        .basic_get("plain".into(), BasicGetOptions::default())
        .await
        .unwrap()
        .expect("message");
    let tag = m.delivery.delivery_tag;
    ch.basic_ack(tag, BasicAckOptions::default()).await.unwrap();
    let mut events = error_events(&conn);
    ch.basic_ack(tag, BasicAckOptions::default()).await.unwrap();
    assert_eq!(next_error_code(&mut events).await, 406);
    still_works(&conn).await;

    // The first ack held; nothing came back with the channel close.
    let ch = conn.create_channel().await.unwrap();
    assert_eq!(queue_len(&ch, "plain").await, 0);
    conn.close(200, "bye".into()).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_password_403_and_wrong_vhost_530() {
    let broker = Broker::start();

    // lapin refuses to connect (what kind of error it reports is lapin's).
    let r = within(
        "connect bad password",
        Connection::connect(
            &broker.url_with("guest", "nope", "%2f"),
            lapin::ConnectionProperties::default(),
        ),
    )
    .await;
    assert!(r.is_err(), "wrong password accepted");
    let r = within(
        "connect bad vhost",
        Connection::connect(
            &broker.url_with("guest", "guest", "no-such-vhost"),
            lapin::ConnectionProperties::default(),
        ),
    )
    .await;
    let e = r.expect_err("unknown vhost accepted");
    if let Some(code) = reply_code(&e) {
        assert_eq!(code, 530, "{e:?}");
    }

    // The exact codes, from the wire.
    let mut c = RawClient::connect(broker.addr()).await;
    let close = c
        .handshake("guest", "nope", "/")
        .await
        .expect_err("wrong password accepted");
    assert_eq!(close.code, 403, "{close:?}");
    let mut c = RawClient::connect(broker.addr()).await;
    let close = c
        .handshake("nobody", "guest", "/")
        .await
        .expect_err("unknown user accepted");
    assert_eq!(close.code, 403, "{close:?}");
    let mut c = RawClient::connect(broker.addr()).await;
    let close = c
        .handshake("guest", "guest", "no-such-vhost")
        .await
        .expect_err("unknown vhost accepted");
    assert_eq!(close.code, 530, "{close:?}");

    assert_broker_healthy(&broker.url()).await;
}
