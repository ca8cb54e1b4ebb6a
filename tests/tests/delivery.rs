//! The session's wiring of leases, once, against the real binary: a
//! consumer's prefetch, its acks, and the unacknowledged messages a closed
//! channel or connection gives back. What a requeue, a credit window or a
//! closed scope does is tested in process (`engine/tests/client.rs`).

use lapin::options::*;
use lapin::types::FieldTable;
use lapin::BasicProperties;
use weir_tests::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closed_channels_and_connections_return_unacked_messages() {
    let broker = Broker::start();
    let conn = connect(&broker.url()).await;
    let ch = confirm_channel(&conn).await;
    declare_queue(&ch, "dq").await;
    for i in 0..6 {
        publish_confirmed(
            &ch,
            "",
            "dq",
            format!("m{i}").as_bytes(),
            BasicProperties::default(),
        )
        .await;
    }

    // Prefetch 3: three go out; one ack lets exactly one more out.
    let consumer_conn = connect(&broker.url()).await;
    let c1 = consumer_conn.create_channel().await.unwrap();
    c1.basic_qos(3, BasicQosOptions::default()).await.unwrap();
    let mut consumer = c1
        .basic_consume(
            "dq".into(),
            "c1".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(next_delivery(&mut consumer).await);
    }
    // A synchronous round trip on another channel: a fourth delivery would
    // already have left the ready set.
    assert_eq!(queue_len(&ch, "dq").await, 3, "prefetch 3 exceeded");
    held[1].ack(BasicAckOptions::default()).await.unwrap();
    let d = next_delivery(&mut consumer).await;
    assert_eq!(d.data, b"m3");
    assert_eq!(queue_len(&ch, "dq").await, 2);

    // Closing the channel returns m0, m2 and m3 to their places, redelivered.
    c1.close(200, "bye".into()).await.unwrap();
    let c2 = consumer_conn.create_channel().await.unwrap();
    let mut consumer = c2
        .basic_consume(
            "dq".into(),
            "c2".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let mut order = Vec::new();
    for _ in 0..5 {
        let d = next_delivery(&mut consumer).await;
        order.push((String::from_utf8(d.data.clone()).unwrap(), d.redelivered));
    }
    let want = |v: &[(&str, bool)]| -> Vec<(String, bool)> {
        v.iter().map(|(b, r)| ((*b).to_owned(), *r)).collect()
    };
    assert_eq!(
        order,
        want(&[
            ("m0", true),
            ("m2", true),
            ("m3", true),
            ("m4", false),
            ("m5", false)
        ])
    );

    // Closing the connection returns all five; after close-ok they are back.
    consumer_conn.close(200, "bye".into()).await.unwrap();
    let mut back = Vec::new();
    while let Some(m) = ch
        .basic_get("dq".into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
    {
        back.push((
            String::from_utf8(m.delivery.data.clone()).unwrap(),
            m.delivery.redelivered,
        ));
    }
    assert_eq!(
        back,
        want(&[
            ("m0", true),
            ("m2", true),
            ("m3", true),
            ("m4", true),
            ("m5", true)
        ])
    );
    conn.close(200, "bye".into()).await.unwrap();
}
