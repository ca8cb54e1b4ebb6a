//! lapin against the real binary: the basics a lapin application relies on,
//! once. Routing rules and engine errors are tested in process
//! (`engine/tests/routing.rs`, `engine/tests/errors.rs`); what is left here
//! is what only the wire shows: declare-ok counts, confirms, consumer
//! deliveries with their tags and routing key, acks, basic.get with its
//! message count and properties, and a headers exchange matching on an AMQP
//! field table (the adapter's table → engine conversion).

use lapin::options::*;
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, ExchangeKind};
use weir_tests::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lapin_basics() {
    let broker = Broker::start();
    let conn = connect(&broker.url()).await;
    let ch = confirm_channel(&conn).await;
    let q = declare_queue(&ch, "work").await;
    assert_eq!((q.message_count(), q.consumer_count()), (0, 0));
    for i in 0..20 {
        publish_confirmed(
            &ch,
            "",
            "work",
            format!("m{i}").as_bytes(),
            BasicProperties::default(),
        )
        .await;
    }
    // Unroutable publishes through the default exchange are confirmed and dropped.
    publish_confirmed(
        &ch,
        "",
        "no-such-queue",
        b"lost",
        BasicProperties::default(),
    )
    .await;
    assert_eq!(queue_len(&ch, "work").await, 20);

    let cch = conn.create_channel().await.unwrap();
    cch.basic_qos(5, BasicQosOptions::default()).await.unwrap();
    let mut consumer = cch
        .basic_consume(
            "work".into(),
            "c1".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    for i in 0..20 {
        let d = next_delivery(&mut consumer).await;
        assert_eq!(d.data, format!("m{i}").as_bytes(), "FIFO order");
        assert_eq!(d.delivery_tag, i + 1);
        assert!(!d.redelivered);
        assert_eq!(d.routing_key.as_str(), "work");
        d.ack(BasicAckOptions::default()).await.unwrap();
    }
    cch.basic_cancel("c1".into(), BasicCancelOptions::default())
        .await
        .unwrap();
    // The acks were handled before this reply (same channel, in order).
    assert_eq!(queue_len(&cch, "work").await, 0);

    // basic.get: empty, then a message with its properties and the count left.
    assert!(ch
        .basic_get("work".into(), BasicGetOptions::default())
        .await
        .unwrap()
        .is_none());
    let props = BasicProperties::default()
        .with_content_type("text/plain".into())
        .with_message_id("id-1".into());
    for body in [b"g0", b"g1"] {
        publish_confirmed(&ch, "", "work", body, props.clone()).await;
    }
    let m = ch
        .basic_get("work".into(), BasicGetOptions::default())
        .await
        .unwrap()
        .expect("g0");
    assert_eq!(m.delivery.data, b"g0");
    assert_eq!(m.message_count, 1, "messages left after the get");
    assert_eq!(m.delivery.properties, props);
    m.delivery.ack(BasicAckOptions::default()).await.unwrap();

    // A headers exchange matches on the publish's field table.
    ch.exchange_declare(
        "hx".into(),
        ExchangeKind::Headers,
        ExchangeDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    declare_queue(&ch, "h").await;
    let table = |pairs: &[(&str, AMQPValue)]| {
        let mut t = FieldTable::default();
        for (k, v) in pairs {
            t.insert((*k).into(), v.clone());
        }
        t
    };
    let s = |v: &str| AMQPValue::LongString(v.into());
    ch.queue_bind(
        "h".into(),
        "hx".into(),
        "".into(),
        QueueBindOptions::default(),
        table(&[
            ("x-match", s("all")),
            ("format", s("pdf")),
            ("n", AMQPValue::LongInt(7)),
        ]),
    )
    .await
    .unwrap();
    for (body, headers) in [
        (
            "match",
            table(&[("format", s("pdf")), ("n", AMQPValue::LongInt(7))]),
        ),
        ("wrong-type", table(&[("format", s("pdf")), ("n", s("7"))])),
        ("missing", table(&[("format", s("pdf"))])),
    ] {
        publish_confirmed(
            &ch,
            "hx",
            "",
            body.as_bytes(),
            BasicProperties::default().with_headers(headers),
        )
        .await;
    }
    let mut got = Vec::new();
    while let Some(m) = ch
        .basic_get("h".into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
    {
        got.push(String::from_utf8(m.delivery.data.clone()).unwrap());
    }
    assert_eq!(got, ["match"]);
    conn.close(200, "bye".into()).await.unwrap();
}
