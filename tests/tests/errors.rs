//! Channel- and connection-level errors through lapin, with exact reply
//! codes; after every channel error the connection keeps working.

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

fn passive_x() -> ExchangeDeclareOptions {
    ExchangeDeclareOptions {
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn not_found_404() {
    let broker = Broker::start();
    let conn = connect(&broker.url()).await;

    let ch = conn.create_channel().await.unwrap();
    assert_code(
        ch.queue_declare("missing-q".into(), passive_q(), FieldTable::default())
            .await,
        404,
    );
    still_works(&conn).await;

    let ch = conn.create_channel().await.unwrap();
    assert_code(
        ch.exchange_declare(
            "missing-x".into(),
            ExchangeKind::Direct,
            passive_x(),
            FieldTable::default(),
        )
        .await,
        404,
    );
    still_works(&conn).await;

    let ch = conn.create_channel().await.unwrap();
    declare_queue(&ch, "q").await;
    assert_code(
        ch.queue_bind(
            "q".into(),
            "missing-x".into(),
            "k".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await,
        404,
    );
    still_works(&conn).await;

    let ch = conn.create_channel().await.unwrap();
    assert_code(
        ch.queue_bind(
            "missing-q".into(),
            "amq.direct".into(),
            "k".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await,
        404,
    );
    still_works(&conn).await;

    let ch = conn.create_channel().await.unwrap();
    assert_code(
        ch.basic_consume(
            "missing-q".into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await,
        404,
    );
    still_works(&conn).await;

    let ch = conn.create_channel().await.unwrap();
    assert_code(
        ch.basic_get("missing-q".into(), BasicGetOptions::default())
            .await,
        404,
    );
    still_works(&conn).await;

    // publish to a missing exchange: asynchronous channel.close 404.
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

    // ... and in confirm mode the confirm fails.
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn access_refused_403() {
    let broker = Broker::start();
    let conn = connect(&broker.url()).await;

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

    let ch = conn.create_channel().await.unwrap();
    declare_queue(&ch, "q").await;
    assert_code(
        ch.queue_bind(
            "q".into(),
            "".into(),
            "other".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await,
        403,
    );
    still_works(&conn).await;

    let ch = conn.create_channel().await.unwrap();
    assert_code(
        ch.exchange_delete("amq.direct".into(), ExchangeDeleteOptions::default())
            .await,
        403,
    );
    still_works(&conn).await;

    let ch = conn.create_channel().await.unwrap();
    assert_code(
        ch.queue_declare(
            "amq.q".into(),
            QueueDeclareOptions::default(),
            FieldTable::default(),
        )
        .await,
        403,
    );
    still_works(&conn).await;
    conn.close(200, "bye".into()).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resource_locked_405_exclusive_queue() {
    let broker = Broker::start();
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

    let other = connect(&broker.url()).await;
    let ch = other.create_channel().await.unwrap();
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
    still_works(&other).await;
    let ch = other.create_channel().await.unwrap();
    assert_code(
        ch.queue_declare(
            "excl".into(),
            QueueDeclareOptions {
                exclusive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await,
        405,
    );
    still_works(&other).await;
    let ch = other.create_channel().await.unwrap();
    assert_code(
        ch.queue_delete("excl".into(), QueueDeleteOptions::default())
            .await,
        405,
    );
    still_works(&other).await;

    // When the owner goes, the exclusive queue goes with it.
    owner.close(200, "bye".into()).await.unwrap();
    let ch = other.create_channel().await.unwrap();
    assert_code(
        ch.queue_declare("excl".into(), passive_q(), FieldTable::default())
            .await,
        404,
    );
    still_works(&other).await;
    other.close(200, "bye".into()).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn precondition_failed_406() {
    let broker = Broker::start();
    let conn = connect(&broker.url()).await;
    let ch = confirm_channel(&conn).await;
    declare_queue(&ch, "plain").await;
    ch.exchange_declare(
        "fx".into(),
        ExchangeKind::Fanout,
        ExchangeDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    ch.queue_bind(
        "plain".into(),
        "fx".into(),
        "".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    publish_confirmed(&ch, "", "plain", b"x", BasicProperties::default()).await;

    // Inequivalent queue redeclare (durable flag differs).
    let ch = conn.create_channel().await.unwrap();
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

    // Inequivalent exchange redeclare (type differs).
    let ch = conn.create_channel().await.unwrap();
    assert_code(
        ch.exchange_declare(
            "fx".into(),
            ExchangeKind::Topic,
            ExchangeDeclareOptions::default(),
            FieldTable::default(),
        )
        .await,
        406,
    );
    still_works(&conn).await;

    // queue.delete if-empty on a non-empty queue.
    let ch = conn.create_channel().await.unwrap();
    assert_code(
        ch.queue_delete(
            "plain".into(),
            QueueDeleteOptions {
                if_empty: true,
                ..Default::default()
            },
        )
        .await,
        406,
    );
    still_works(&conn).await;

    // exchange.delete if-unused on a bound exchange.
    let ch = conn.create_channel().await.unwrap();
    assert_code(
        ch.exchange_delete(
            "fx".into(),
            ExchangeDeleteOptions {
                if_unused: true,
                ..Default::default()
            },
        )
        .await,
        406,
    );
    still_works(&conn).await;

    // ack of a delivery tag never delivered.
    let ch = conn.create_channel().await.unwrap();
    let mut events = error_events(&conn);
    ch.basic_ack(4242, BasicAckOptions::default())
        .await
        .expect("ack is fire-and-forget");
    assert_eq!(next_error_code(&mut events).await, 406);
    still_works(&conn).await;

    // Double ack of a real tag.
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

    // Everything still there after the failures.
    let ch = conn.create_channel().await.unwrap();
    assert_eq!(queue_len(&ch, "plain").await, 0);
    ch.queue_delete(
        "plain".into(),
        QueueDeleteOptions {
            if_empty: true,
            ..Default::default()
        },
    )
    .await
    .expect("if-empty delete of an empty queue");
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
