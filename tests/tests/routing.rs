//! Routing through every exchange type, exchange-to-exchange bindings,
//! basic.get and consume with acks.

use lapin::options::*;
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, ExchangeKind};
use std::collections::BTreeSet;
use weir_tests::*;

async fn declare_exchange(ch: &Channel, name: &str, kind: ExchangeKind) {
    ch.exchange_declare(
        name.into(),
        kind,
        ExchangeDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap_or_else(|e| panic!("declaring exchange {name}: {e}"));
}

async fn bind(ch: &Channel, queue: &str, exchange: &str, key: &str, args: FieldTable) {
    ch.queue_bind(
        queue.into(),
        exchange.into(),
        key.into(),
        QueueBindOptions::default(),
        args,
    )
    .await
    .unwrap_or_else(|e| panic!("binding {queue} to {exchange}/{key}: {e}"));
}

/// Drains `queue` with basic.get (no-ack) and returns the bodies in order.
async fn drain(ch: &Channel, queue: &str) -> Vec<String> {
    let mut out = Vec::new();
    while let Some(m) = ch
        .basic_get(queue.into(), BasicGetOptions { no_ack: true })
        .await
        .expect("basic.get")
    {
        out.push(String::from_utf8(m.delivery.data.clone()).unwrap());
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn default_exchange_consume_with_acks() {
    let broker = Broker::start();
    let conn = connect(&broker.url()).await;
    let ch = confirm_channel(&conn).await;
    declare_queue(&ch, "work").await;
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
        assert!(!d.redelivered);
        assert_eq!(d.routing_key.as_str(), "work");
        d.ack(BasicAckOptions::default()).await.unwrap();
    }
    cch.basic_cancel("c1".into(), BasicCancelOptions::default())
        .await
        .unwrap();
    // The acks were handled before this reply (same channel, in order).
    assert_eq!(queue_len(&cch, "work").await, 0);
    conn.close(200, "bye".into()).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn direct_fanout_topic_headers() {
    let broker = Broker::start();
    let conn = connect(&broker.url()).await;
    let ch = confirm_channel(&conn).await;

    // direct
    declare_exchange(&ch, "ex.direct", ExchangeKind::Direct).await;
    for q in ["d.red", "d.green", "d.both"] {
        declare_queue(&ch, q).await;
    }
    bind(&ch, "d.red", "ex.direct", "red", FieldTable::default()).await;
    bind(&ch, "d.green", "ex.direct", "green", FieldTable::default()).await;
    bind(&ch, "d.both", "ex.direct", "red", FieldTable::default()).await;
    bind(&ch, "d.both", "ex.direct", "green", FieldTable::default()).await;
    for key in ["red", "green", "blue"] {
        publish_confirmed(
            &ch,
            "ex.direct",
            key,
            key.as_bytes(),
            BasicProperties::default(),
        )
        .await;
    }
    assert_eq!(drain(&ch, "d.red").await, ["red"]);
    assert_eq!(drain(&ch, "d.green").await, ["green"]);
    assert_eq!(drain(&ch, "d.both").await, ["red", "green"]);

    // fanout: keys ignored
    declare_exchange(&ch, "ex.fanout", ExchangeKind::Fanout).await;
    for q in ["f.1", "f.2"] {
        declare_queue(&ch, q).await;
        bind(&ch, q, "ex.fanout", "ignored", FieldTable::default()).await;
    }
    publish_confirmed(
        &ch,
        "ex.fanout",
        "whatever",
        b"all",
        BasicProperties::default(),
    )
    .await;
    assert_eq!(drain(&ch, "f.1").await, ["all"]);
    assert_eq!(drain(&ch, "f.2").await, ["all"]);

    // topic
    declare_exchange(&ch, "ex.topic", ExchangeKind::Topic).await;
    let patterns = [
        ("t.star", "stock.*.nyse"),
        ("t.hash", "stock.#"),
        ("t.all", "#"),
        ("t.exact", "stock.ibm.nyse"),
    ];
    for (q, p) in patterns {
        declare_queue(&ch, q).await;
        bind(&ch, q, "ex.topic", p, FieldTable::default()).await;
    }
    for key in [
        "stock.ibm.nyse",
        "stock.ibm",
        "stock",
        "stock.a.b.nyse",
        "bond.x.nyse",
    ] {
        publish_confirmed(
            &ch,
            "ex.topic",
            key,
            key.as_bytes(),
            BasicProperties::default(),
        )
        .await;
    }
    assert_eq!(drain(&ch, "t.star").await, ["stock.ibm.nyse"]);
    assert_eq!(
        drain(&ch, "t.hash").await,
        ["stock.ibm.nyse", "stock.ibm", "stock", "stock.a.b.nyse"]
    );
    assert_eq!(
        drain(&ch, "t.all").await,
        [
            "stock.ibm.nyse",
            "stock.ibm",
            "stock",
            "stock.a.b.nyse",
            "bond.x.nyse"
        ]
    );
    assert_eq!(drain(&ch, "t.exact").await, ["stock.ibm.nyse"]);

    // headers
    declare_exchange(&ch, "ex.headers", ExchangeKind::Headers).await;
    let mut all = FieldTable::default();
    all.insert("x-match".into(), AMQPValue::LongString("all".into()));
    all.insert("format".into(), AMQPValue::LongString("pdf".into()));
    all.insert("type".into(), AMQPValue::LongString("report".into()));
    let mut any = FieldTable::default();
    any.insert("x-match".into(), AMQPValue::LongString("any".into()));
    any.insert("format".into(), AMQPValue::LongString("pdf".into()));
    any.insert("type".into(), AMQPValue::LongString("report".into()));
    declare_queue(&ch, "h.all").await;
    declare_queue(&ch, "h.any").await;
    bind(&ch, "h.all", "ex.headers", "", all).await;
    bind(&ch, "h.any", "ex.headers", "", any).await;
    let hdrs = |pairs: &[(&str, &str)]| {
        let mut t = FieldTable::default();
        for (k, v) in pairs {
            t.insert((*k).into(), AMQPValue::LongString((*v).into()));
        }
        BasicProperties::default().with_headers(t)
    };
    publish_confirmed(
        &ch,
        "ex.headers",
        "",
        b"both",
        hdrs(&[("format", "pdf"), ("type", "report")]),
    )
    .await;
    publish_confirmed(
        &ch,
        "ex.headers",
        "",
        b"one",
        hdrs(&[("format", "pdf"), ("type", "log")]),
    )
    .await;
    publish_confirmed(&ch, "ex.headers", "", b"none", hdrs(&[("format", "zip")])).await;
    publish_confirmed(&ch, "ex.headers", "", b"empty", BasicProperties::default()).await;
    assert_eq!(drain(&ch, "h.all").await, ["both"]);
    assert_eq!(drain(&ch, "h.any").await, ["both", "one"]);
    conn.close(200, "bye".into()).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exchange_to_exchange_bindings() {
    let broker = Broker::start();
    let conn = connect(&broker.url()).await;
    let ch = confirm_channel(&conn).await;
    declare_exchange(&ch, "e2e.src", ExchangeKind::Topic).await;
    declare_exchange(&ch, "e2e.mid", ExchangeKind::Fanout).await;
    declare_exchange(&ch, "e2e.leaf", ExchangeKind::Direct).await;
    ch.exchange_bind(
        "e2e.mid".into(),
        "e2e.src".into(),
        "a.#".into(),
        ExchangeBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .expect("exchange.bind src->mid");
    ch.exchange_bind(
        "e2e.leaf".into(),
        "e2e.mid".into(),
        "".into(),
        ExchangeBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .expect("exchange.bind mid->leaf");
    declare_queue(&ch, "q.mid").await;
    declare_queue(&ch, "q.leaf").await;
    declare_queue(&ch, "q.src").await;
    bind(&ch, "q.mid", "e2e.mid", "", FieldTable::default()).await;
    bind(&ch, "q.leaf", "e2e.leaf", "a.x", FieldTable::default()).await;
    bind(&ch, "q.src", "e2e.src", "#", FieldTable::default()).await;

    for key in ["a.x", "a.y", "b.x"] {
        publish_confirmed(
            &ch,
            "e2e.src",
            key,
            key.as_bytes(),
            BasicProperties::default(),
        )
        .await;
    }
    assert_eq!(drain(&ch, "q.src").await, ["a.x", "a.y", "b.x"]);
    assert_eq!(drain(&ch, "q.mid").await, ["a.x", "a.y"]);
    // The routing key is preserved across exchange hops.
    assert_eq!(drain(&ch, "q.leaf").await, ["a.x"]);

    // A cycle must not loop or duplicate.
    ch.exchange_bind(
        "e2e.src".into(),
        "e2e.leaf".into(),
        "a.x".into(),
        ExchangeBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .expect("exchange.bind leaf->src (cycle)");
    publish_confirmed(&ch, "e2e.src", "a.x", b"cycle", BasicProperties::default()).await;
    assert_eq!(drain(&ch, "q.src").await, ["cycle"]);
    assert_eq!(drain(&ch, "q.mid").await, ["cycle"]);
    assert_eq!(drain(&ch, "q.leaf").await, ["cycle"]);

    ch.exchange_unbind(
        "e2e.mid".into(),
        "e2e.src".into(),
        "a.#".into(),
        ExchangeUnbindOptions::default(),
        FieldTable::default(),
    )
    .await
    .expect("exchange.unbind");
    publish_confirmed(
        &ch,
        "e2e.src",
        "a.z",
        b"after-unbind",
        BasicProperties::default(),
    )
    .await;
    assert_eq!(drain(&ch, "q.mid").await, Vec::<String>::new());
    assert_eq!(drain(&ch, "q.src").await, ["after-unbind"]);
    conn.close(200, "bye".into()).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn basic_get_ack_and_counts() {
    let broker = Broker::start();
    let conn = connect(&broker.url()).await;
    let ch = confirm_channel(&conn).await;
    declare_queue(&ch, "g").await;
    assert!(
        ch.basic_get("g".into(), BasicGetOptions::default())
            .await
            .unwrap()
            .is_none(),
        "empty queue"
    );
    let props = BasicProperties::default()
        .with_content_type("text/plain".into())
        .with_message_id("id-1".into())
        .with_correlation_id("corr".into());
    for i in 0..3 {
        publish_confirmed(&ch, "", "g", format!("g{i}").as_bytes(), props.clone()).await;
    }
    let m = ch
        .basic_get("g".into(), BasicGetOptions::default())
        .await
        .unwrap()
        .expect("g0");
    assert_eq!(m.delivery.data, b"g0");
    assert_eq!(m.message_count, 2, "messages left after the get");
    assert_eq!(
        m.delivery
            .properties
            .content_type()
            .as_ref()
            .map(|s| s.as_str()),
        Some("text/plain")
    );
    assert_eq!(
        m.delivery
            .properties
            .message_id()
            .as_ref()
            .map(|s| s.as_str()),
        Some("id-1")
    );
    assert_eq!(
        m.delivery
            .properties
            .correlation_id()
            .as_ref()
            .map(|s| s.as_str()),
        Some("corr")
    );
    m.delivery.ack(BasicAckOptions::default()).await.unwrap();
    let seen: BTreeSet<_> = drain(&ch, "g").await.into_iter().collect();
    assert_eq!(seen, BTreeSet::from(["g1".to_string(), "g2".to_string()]));
    assert_eq!(queue_len(&ch, "g").await, 0);
    conn.close(200, "bye".into()).await.unwrap();
}
