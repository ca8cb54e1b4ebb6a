//! Durable topology and persistent messages across a clean restart; the
//! shutdown handshake.

use lapin::options::*;
use lapin::types::FieldTable;
use lapin::{BasicProperties, ExchangeKind};
use std::collections::BTreeSet;
use weir_tests::raw::RawClient;
use weir_tests::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn durable_topology_and_unacked_persistent_messages_survive_restart() {
    let dir = tempfile::tempdir().unwrap();
    let mut broker = Broker::start_in(dir.path());
    {
        let conn = connect(&broker.url()).await;
        let ch = confirm_channel(&conn).await;
        ch.exchange_declare(
            "dx".into(),
            ExchangeKind::Direct,
            ExchangeDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
        ch.queue_declare(
            "dq".into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
        ch.queue_bind(
            "dq".into(),
            "dx".into(),
            "k".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
        ch.exchange_declare(
            "tx-ex".into(),
            ExchangeKind::Fanout,
            ExchangeDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
        declare_queue(&ch, "transient-q").await;
        for i in 0..10 {
            publish_confirmed(&ch, "dx", "k", format!("p{i}").as_bytes(), persistent()).await;
        }
        // Transient messages in a durable queue do not survive a restart.
        publish_confirmed(
            &ch,
            "dx",
            "k",
            b"transient",
            BasicProperties::default().with_delivery_mode(1),
        )
        .await;
        publish_confirmed(&ch, "", "transient-q", b"t", persistent()).await;

        // Consume everything, ack p0..p3 (p0, p1 singly, p2..p3 as multiple).
        let cch = conn.create_channel().await.unwrap();
        cch.basic_qos(20, BasicQosOptions::default()).await.unwrap();
        let mut consumer = cch
            .basic_consume(
                "dq".into(),
                "c".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        let mut ds = Vec::new();
        for _ in 0..11 {
            ds.push(next_delivery(&mut consumer).await);
        }
        assert_eq!(ds[0].data, b"p0");
        ds[0].ack(BasicAckOptions::default()).await.unwrap();
        ds[1].ack(BasicAckOptions::default()).await.unwrap();
        ds[3].ack(BasicAckOptions { multiple: true }).await.unwrap();
        // A synchronous method on the same channel: the acks were handled.
        assert_eq!(queue_len(&cch, "dq").await, 0);
        // Leave the connection open: shutdown must close it (320) and still
        // exit cleanly with the leases returned.
        broker.stop();
        assert!(
            broker.run_logs().contains("weir stopped"),
            "{}",
            broker.run_logs()
        );
    }

    broker.restart();
    let conn = connect(&broker.url()).await;
    let ch = confirm_channel(&conn).await;
    assert_eq!(
        queue_len(&ch, "dq").await,
        6,
        "exactly the unacked persistent messages"
    );
    // Non-durable queue and exchange are gone.
    let ch2 = conn.create_channel().await.unwrap();
    assert_code(
        ch2.queue_declare(
            "transient-q".into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await,
        404,
    );
    let ch3 = conn.create_channel().await.unwrap();
    assert_code(
        ch3.exchange_declare(
            "tx-ex".into(),
            ExchangeKind::Fanout,
            ExchangeDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await,
        404,
    );
    // The durable binding still routes.
    publish_confirmed(&ch, "dx", "k", b"after-restart", persistent()).await;
    assert_eq!(queue_len(&ch, "dq").await, 7);

    let mut bodies = Vec::new();
    while let Some(m) = ch
        .basic_get("dq".into(), BasicGetOptions::default())
        .await
        .unwrap()
    {
        bodies.push(String::from_utf8(m.delivery.data.clone()).unwrap());
        m.delivery.ack(BasicAckOptions::default()).await.unwrap();
    }
    assert_eq!(
        bodies,
        ["p4", "p5", "p6", "p7", "p8", "p9", "after-restart"],
        "order kept across restart"
    );
    conn.close(200, "bye".into()).await.unwrap();
    broker.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acks_after_restart_stay_acked() {
    let dir = tempfile::tempdir().unwrap();
    let mut broker = Broker::start_in(dir.path());
    let conn = connect(&broker.url()).await;
    let ch = confirm_channel(&conn).await;
    ch.queue_declare(
        "dq".into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .unwrap();
    for i in 0..5 {
        publish_confirmed(&ch, "", "dq", format!("p{i}").as_bytes(), persistent()).await;
    }
    conn.close(200, "bye".into()).await.unwrap();
    broker.stop();

    // Second run: ack two of them.
    broker.restart();
    let conn = connect(&broker.url()).await;
    let ch = conn.create_channel().await.unwrap();
    for want in ["p0", "p1"] {
        let m = ch
            .basic_get("dq".into(), BasicGetOptions::default())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(m.delivery.data, want.as_bytes());
        m.delivery.ack(BasicAckOptions::default()).await.unwrap();
    }
    assert_eq!(queue_len(&ch, "dq").await, 3);
    conn.close(200, "bye".into()).await.unwrap();
    broker.stop();

    // Third run: the acks of the second run held.
    broker.restart();
    let conn = connect(&broker.url()).await;
    let ch = conn.create_channel().await.unwrap();
    let mut got = BTreeSet::new();
    while let Some(m) = ch
        .basic_get("dq".into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
    {
        got.insert(String::from_utf8(m.delivery.data.clone()).unwrap());
    }
    assert_eq!(
        got,
        BTreeSet::from(["p2".to_string(), "p3".into(), "p4".into()])
    );
    conn.close(200, "bye".into()).await.unwrap();
    broker.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_closes_connections_with_320_and_exits_zero() {
    let mut broker = Broker::start();
    let mut raw = RawClient::open(broker.addr()).await;
    raw.open_channel(1).await;
    let pid = broker.pid().unwrap();
    // SAFETY: kill(2) on our child.
    unsafe {
        libc::kill(pid as libc::pid_t, libc::SIGTERM);
    }
    let close = raw
        .expect_connection_close()
        .await
        .expect("connection.close before EOF");
    assert_eq!(close.code, 320, "{close:?}");
    let status = broker.terminate();
    assert!(status.success(), "exit status {status}");
}
