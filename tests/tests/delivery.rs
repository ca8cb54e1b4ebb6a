//! Acknowledgement semantics: nack/reject with requeue, prefetch.

use lapin::options::*;
use lapin::types::FieldTable;
use lapin::BasicProperties;
use weir_tests::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reject_and_nack_requeue_to_original_position() {
    let broker = Broker::start();
    let conn = connect(&broker.url()).await;
    let ch = confirm_channel(&conn).await;
    declare_queue(&ch, "rq").await;
    for i in 1..=4 {
        publish_confirmed(
            &ch,
            "",
            "rq",
            format!("m{i}").as_bytes(),
            BasicProperties::default(),
        )
        .await;
    }
    let get = |ch: lapin::Channel| async move {
        ch.basic_get("rq".into(), BasicGetOptions::default())
            .await
            .expect("basic.get")
            .expect("a message")
    };
    let m1 = get(ch.clone()).await;
    let m2 = get(ch.clone()).await;
    assert_eq!(m1.delivery.data, b"m1");
    assert_eq!(m2.delivery.data, b"m2");
    assert!(!m1.delivery.redelivered);

    // reject(requeue) m1: it goes back ahead of m3, flagged redelivered.
    m1.delivery
        .reject(BasicRejectOptions { requeue: true })
        .await
        .unwrap();
    let again = get(ch.clone()).await;
    assert_eq!(
        again.delivery.data, b"m1",
        "a requeued message returns to its original place"
    );
    assert!(
        again.delivery.redelivered,
        "requeued message must be redelivered=true"
    );

    // nack(requeue) m2: also back ahead of m3.
    m2.delivery
        .nack(BasicNackOptions {
            multiple: false,
            requeue: true,
        })
        .await
        .unwrap();
    let m2b = get(ch.clone()).await;
    assert_eq!(m2b.delivery.data, b"m2");
    assert!(m2b.delivery.redelivered);
    let m3 = get(ch.clone()).await;
    assert_eq!(m3.delivery.data, b"m3");
    assert!(!m3.delivery.redelivered);

    // nack multiple requeue of everything outstanding (m1, m2, m3), in order.
    m3.delivery
        .nack(BasicNackOptions {
            multiple: true,
            requeue: true,
        })
        .await
        .unwrap();
    let mut order = Vec::new();
    while let Some(m) = ch
        .basic_get("rq".into(), BasicGetOptions::default())
        .await
        .unwrap()
    {
        order.push((
            String::from_utf8(m.delivery.data.clone()).unwrap(),
            m.delivery.redelivered,
        ));
        m.delivery.ack(BasicAckOptions::default()).await.unwrap();
    }
    assert_eq!(
        order,
        [
            ("m1".into(), true),
            ("m2".into(), true),
            ("m3".into(), true),
            ("m4".into(), false)
        ]
    );

    // reject without requeue drops the message (no DLX configured).
    publish_confirmed(&ch, "", "rq", b"drop-me", BasicProperties::default()).await;
    let d = get(ch.clone()).await;
    d.delivery
        .reject(BasicRejectOptions { requeue: false })
        .await
        .unwrap();
    assert_eq!(queue_len(&ch, "rq").await, 0);
    conn.close(200, "bye".into()).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumer_nack_requeue_redelivers_first() {
    let broker = Broker::start();
    let conn = connect(&broker.url()).await;
    let ch = confirm_channel(&conn).await;
    declare_queue(&ch, "cq").await;
    for i in 1..=3 {
        publish_confirmed(
            &ch,
            "",
            "cq",
            format!("m{i}").as_bytes(),
            BasicProperties::default(),
        )
        .await;
    }
    let cch = conn.create_channel().await.unwrap();
    cch.basic_qos(1, BasicQosOptions::default()).await.unwrap();
    let mut consumer = cch
        .basic_consume(
            "cq".into(),
            "c".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let d = next_delivery(&mut consumer).await;
    assert_eq!(d.data, b"m1");
    d.nack(BasicNackOptions {
        multiple: false,
        requeue: true,
    })
    .await
    .unwrap();
    let d = next_delivery(&mut consumer).await;
    assert_eq!(d.data, b"m1", "requeued message comes back before m2");
    assert!(d.redelivered);
    d.ack(BasicAckOptions::default()).await.unwrap();
    for want in ["m2", "m3"] {
        let d = next_delivery(&mut consumer).await;
        assert_eq!(d.data, want.as_bytes());
        assert!(!d.redelivered);
        d.ack(BasicAckOptions::default()).await.unwrap();
    }
    conn.close(200, "bye".into()).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefetch_limits_unacked_deliveries() {
    let broker = Broker::start();
    let conn = connect(&broker.url()).await;
    let ch = confirm_channel(&conn).await;
    declare_queue(&ch, "pq").await;
    for i in 0..6 {
        publish_confirmed(
            &ch,
            "",
            "pq",
            format!("m{i}").as_bytes(),
            BasicProperties::default(),
        )
        .await;
    }
    let cch = conn.create_channel().await.unwrap();
    cch.basic_qos(2, BasicQosOptions::default()).await.unwrap();
    let mut consumer = cch
        .basic_consume(
            "pq".into(),
            "c".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let d0 = next_delivery(&mut consumer).await;
    let d1 = next_delivery(&mut consumer).await;
    assert_eq!(
        (d0.data.as_slice(), d1.data.as_slice()),
        (&b"m0"[..], &b"m1"[..])
    );
    // With 2 unacked the broker must hold the rest: ready count stays 4.
    // (A synchronous round trip on another channel; any third delivery would
    // already have left the ready set.)
    assert_eq!(queue_len(&ch, "pq").await, 4, "prefetch 2 exceeded");
    d0.ack(BasicAckOptions::default()).await.unwrap();
    let d2 = next_delivery(&mut consumer).await;
    assert_eq!(d2.data, b"m2");
    assert_eq!(
        queue_len(&ch, "pq").await,
        3,
        "one ack frees exactly one slot"
    );
    // Multiple-ack of d1..d2 frees two slots.
    d2.ack(BasicAckOptions { multiple: true }).await.unwrap();
    let d3 = next_delivery(&mut consumer).await;
    let d4 = next_delivery(&mut consumer).await;
    assert_eq!(
        (d3.data.as_slice(), d4.data.as_slice()),
        (&b"m3"[..], &b"m4"[..])
    );
    assert_eq!(queue_len(&ch, "pq").await, 1);
    drop(d1);
    conn.close(200, "bye".into()).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unacked_messages_return_when_consumer_connection_closes() {
    let broker = Broker::start();
    let conn = connect(&broker.url()).await;
    let ch = confirm_channel(&conn).await;
    declare_queue(&ch, "lq").await;
    for i in 0..3 {
        publish_confirmed(
            &ch,
            "",
            "lq",
            format!("m{i}").as_bytes(),
            BasicProperties::default(),
        )
        .await;
    }
    let conn2 = connect(&broker.url()).await;
    let c2 = conn2.create_channel().await.unwrap();
    let mut consumer = c2
        .basic_consume(
            "lq".into(),
            "c".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    for _ in 0..3 {
        next_delivery(&mut consumer).await;
    }
    assert_eq!(queue_len(&ch, "lq").await, 0);
    conn2.close(200, "bye".into()).await.unwrap();
    // After close-ok the server has released the leases.
    let mut order = Vec::new();
    while let Some(m) = ch
        .basic_get("lq".into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
    {
        assert!(m.delivery.redelivered);
        order.push(String::from_utf8(m.delivery.data.clone()).unwrap());
    }
    assert_eq!(order, ["m0", "m1", "m2"]);
    conn.close(200, "bye".into()).await.unwrap();
}
