//! Message content edge cases (large, empty, multi-frame bodies, all
//! properties) and mandatory returns.

use lapin::options::*;
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, ExchangeKind};
use weir_tests::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_and_empty_bodies_round_trip() {
    let broker = Broker::start();
    let conn = connect(&broker.url()).await;
    let ch = confirm_channel(&conn).await;
    declare_queue(&ch, "big").await;
    let frame_max = conn.configuration().frame_max() as usize;
    let sizes = [
        0,
        1,
        frame_max - 9,
        frame_max - 8,
        frame_max - 7,
        frame_max,
        3 * frame_max + 5,
        1 << 20,
    ];
    let bodies: Vec<Vec<u8>> = sizes
        .iter()
        .map(|&n| (0..n).map(|i| (i * 31 % 251) as u8).collect())
        .collect();
    for b in &bodies {
        publish_confirmed(&ch, "", "big", b, BasicProperties::default()).await;
    }
    // Through basic.get and through a consumer.
    for (b, n) in bodies.iter().zip(sizes).take(4) {
        let m = ch
            .basic_get("big".into(), BasicGetOptions { no_ack: true })
            .await
            .unwrap()
            .expect("message");
        assert_eq!(m.delivery.data.len(), n);
        assert!(m.delivery.data == *b, "body of {n} bytes corrupted");
    }
    let mut consumer = ch
        .basic_consume(
            "big".into(),
            "c".into(),
            BasicConsumeOptions {
                no_ack: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    for (b, n) in bodies.iter().zip(sizes).skip(4) {
        let d = next_delivery(&mut consumer).await;
        assert_eq!(d.data.len(), n);
        assert!(d.data == *b, "body of {n} bytes corrupted");
    }
    conn.close(200, "bye".into()).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_basic_properties_round_trip_and_survive_restart() {
    let dir = tempfile::tempdir().unwrap();
    let mut broker = Broker::start_in(dir.path());
    let mut headers = FieldTable::default();
    headers.insert("str".into(), AMQPValue::LongString("v".into()));
    headers.insert("int".into(), AMQPValue::LongInt(-7));
    headers.insert("bool".into(), AMQPValue::Boolean(true));
    let mut nested = FieldTable::default();
    nested.insert("k".into(), AMQPValue::LongLongInt(1 << 40));
    headers.insert("table".into(), AMQPValue::FieldTable(nested));
    let props = BasicProperties::default()
        .with_content_type("application/json".into())
        .with_content_encoding("gzip".into())
        .with_headers(headers)
        .with_delivery_mode(2)
        .with_priority(3)
        .with_correlation_id("corr".into())
        .with_reply_to("replies".into())
        .with_expiration("600000".into())
        .with_message_id("mid".into())
        .with_timestamp(1_700_000_000)
        .with_type("type".into())
        .with_user_id("guest".into())
        .with_app_id("app".into());
    {
        let conn = connect(&broker.url()).await;
        let ch = confirm_channel(&conn).await;
        ch.queue_declare(
            "props".into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
        publish_confirmed(&ch, "", "props", b"p", props.clone()).await;
        publish_confirmed(&ch, "", "props", b"p", props.clone()).await;
        let m = ch
            .basic_get("props".into(), BasicGetOptions { no_ack: true })
            .await
            .unwrap()
            .unwrap();
        assert_eq!(m.delivery.properties, props);
        conn.close(200, "bye".into()).await.unwrap();
    }
    broker.stop();
    broker.restart();
    let conn = connect(&broker.url()).await;
    let ch = conn.create_channel().await.unwrap();
    let m = ch
        .basic_get("props".into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
        .expect("persisted");
    assert_eq!(m.delivery.properties, props, "properties after restart");
    conn.close(200, "bye".into()).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mandatory_unroutable_is_returned_then_confirmed() {
    let broker = Broker::start();
    let conn = connect(&broker.url()).await;
    let ch = confirm_channel(&conn).await;
    ch.exchange_declare(
        "lonely".into(),
        ExchangeKind::Direct,
        ExchangeDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    let confirm = ch
        .basic_publish(
            "lonely".into(),
            "nowhere".into(),
            BasicPublishOptions {
                mandatory: true,
                ..Default::default()
            },
            b"bounce",
            BasicProperties::default().with_message_id("m1".into()),
        )
        .await
        .unwrap();
    let c = within("confirm", confirm).await.unwrap();
    assert!(
        c.is_ack(),
        "unroutable mandatory publishes are still acked: {c:?}"
    );
    let ret = c.take_message().expect("basic.return before the ack");
    assert_eq!(ret.reply_code, 312, "NO_ROUTE");
    assert_eq!(ret.data, b"bounce");
    assert_eq!(ret.routing_key.as_str(), "nowhere");
    assert_eq!(
        ret.properties.message_id().as_ref().map(|s| s.as_str()),
        Some("m1")
    );
    // Non-mandatory unroutable: silently dropped, no return.
    let c = within(
        "confirm",
        ch.basic_publish(
            "lonely".into(),
            "nowhere".into(),
            BasicPublishOptions::default(),
            b"drop",
            BasicProperties::default(),
        )
        .await
        .unwrap(),
    )
    .await
    .unwrap();
    assert!(c.is_ack());
    assert!(c.take_message().is_none());
    conn.close(200, "bye".into()).await.unwrap();
}
