//! Stream queues against the real binary with lapin: declared with
//! RabbitMQ's stream arguments, consumed with every `x-stream-offset` form
//! (each delivery carrying `x-stream-offset`), the refusals RabbitMQ makes
//! (no prefetch) and Weir's own (an offset dropped by retention), and a
//! stream surviving `kill -9`.

use lapin::options::*;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Connection};
use std::time::{SystemTime, UNIX_EPOCH};
use weir_tests::*;

fn table(entries: &[(&str, AMQPValue)]) -> FieldTable {
    let mut t = FieldTable::default();
    for (k, v) in entries {
        t.insert(ShortString::from(k.to_string()), v.clone());
    }
    t
}

fn text(s: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s))
}

async fn declare_stream(ch: &Channel, name: &str, extra: &[(&str, AMQPValue)]) {
    let mut args = vec![("x-queue-type", text("stream"))];
    args.extend_from_slice(extra);
    ch.queue_declare(
        name.into(),
        QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        },
        table(&args),
    )
    .await
    .expect("stream declared");
}

/// Consumes `n` deliveries from `stream` starting at `offset` (None: no
/// argument) on a fresh channel with prefetch 100; returns their
/// `x-stream-offset` headers and bodies, after checking nothing more comes
/// at once.
async fn read(
    conn: &Connection,
    stream: &str,
    offset: Option<AMQPValue>,
    n: usize,
) -> Vec<(i64, String)> {
    let ch = conn.create_channel().await.expect("channel");
    ch.basic_qos(100, BasicQosOptions::default())
        .await
        .expect("qos");
    let args = offset.map_or_else(FieldTable::default, |o| table(&[("x-stream-offset", o)]));
    let mut consumer = ch
        .basic_consume(
            stream.into(),
            "".into(),
            BasicConsumeOptions::default(),
            args,
        )
        .await
        .expect("consume");
    let mut out = Vec::new();
    for _ in 0..n {
        let d = next_delivery(&mut consumer).await;
        let offset = d
            .properties
            .headers()
            .as_ref()
            .and_then(|h| h.inner().get("x-stream-offset").cloned())
            .map(|v| match v {
                AMQPValue::LongLongInt(n) => n,
                other => panic!("x-stream-offset is a long, not {other:?}"),
            })
            .expect("every delivery carries x-stream-offset");
        out.push((offset, String::from_utf8_lossy(&d.data).into_owned()));
        d.ack(BasicAckOptions::default()).await.expect("ack");
    }
    ch.close(200, "done".into()).await.expect("channel close");
    out
}

fn offsets(got: &[(i64, String)]) -> Vec<i64> {
    got.iter().map(|(o, _)| *o).collect()
}

async fn publish_n(ch: &Channel, stream: &str, from: usize, to: usize) {
    for i in from..to {
        publish_confirmed(
            ch,
            "",
            stream,
            format!("e{i}").as_bytes(),
            BasicProperties::default(),
        )
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_x_stream_offset_form_with_lapin() {
    let broker = Broker::start();
    let conn = connect(&broker.url()).await;
    let ch = confirm_channel(&conn).await;
    declare_stream(
        &ch,
        "events",
        &[
            ("x-max-age", text("7D")),
            ("x-max-length-bytes", AMQPValue::LongLongInt(1_000_000_000)),
            (
                "x-stream-max-segment-size-bytes",
                AMQPValue::LongLongInt(100_000_000),
            ),
        ],
    )
    .await;
    publish_n(&ch, "events", 0, 10).await;
    let all: Vec<i64> = (0..10).collect();
    assert_eq!(
        offsets(&read(&conn, "events", Some(text("first")), 10).await),
        all
    );
    let got = read(&conn, "events", Some(text("first")), 10).await;
    assert_eq!(got[3], (3, "e3".to_string()), "offset and body agree");
    assert_eq!(
        offsets(&read(&conn, "events", Some(text("last")), 1).await),
        vec![9]
    );
    assert_eq!(
        offsets(&read(&conn, "events", Some(AMQPValue::LongLongInt(6)), 4).await),
        vec![6, 7, 8, 9]
    );
    assert_eq!(
        offsets(&read(&conn, "events", Some(AMQPValue::ShortInt(8)), 2).await),
        vec![8, 9]
    );
    let hour_ago = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("time")
        .as_secs()
        - 3600;
    assert_eq!(
        offsets(&read(&conn, "events", Some(AMQPValue::Timestamp(hour_ago)), 10).await),
        all
    );
    assert_eq!(
        offsets(&read(&conn, "events", Some(text("1h")), 10).await),
        all
    );
    assert_eq!(
        offsets(&read(&conn, "events", Some(text("30m")), 10).await),
        all
    );

    // `next` (and no argument): only what is published after the consume.
    for offset in [Some(text("next")), None] {
        let cch = conn.create_channel().await.expect("channel");
        cch.basic_qos(10, BasicQosOptions::default())
            .await
            .expect("qos");
        let args = offset.map_or_else(FieldTable::default, |o| table(&[("x-stream-offset", o)]));
        let mut consumer = cch
            .basic_consume(
                "events".into(),
                "".into(),
                BasicConsumeOptions::default(),
                args,
            )
            .await
            .expect("consume");
        let before = read(&conn, "events", Some(text("last")), 1).await[0].0;
        publish_n(&ch, "events", before as usize + 1, before as usize + 2).await;
        let d = next_delivery(&mut consumer).await;
        let h = d
            .properties
            .headers()
            .as_ref()
            .expect("headers")
            .inner()
            .clone();
        assert_eq!(
            h.get("x-stream-offset"),
            Some(&AMQPValue::LongLongInt(before + 1))
        );
        cch.close(200, "done".into()).await.expect("close");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_refusals_no_prefetch_and_an_offset_lost_to_retention() {
    let broker = Broker::start();
    let conn = connect(&broker.url()).await;
    let ch = confirm_channel(&conn).await;
    // 100-byte events, at most 2,000 bytes kept.
    declare_stream(
        &ch,
        "small",
        &[("x-max-length-bytes", AMQPValue::LongLongInt(2_000))],
    )
    .await;
    let body = vec![b'x'; 100];
    for _ in 0..100 {
        publish_confirmed(&ch, "", "small", &body, BasicProperties::default()).await;
    }

    // RabbitMQ's refusal: a stream consumer needs a prefetch count.
    let cch = conn.create_channel().await.expect("channel");
    let r = cch
        .basic_consume(
            "small".into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await;
    let e = r.map(|_| ()).expect_err("refused without basic.qos");
    assert_eq!(reply_code(&e), Some(406), "{e:?}");
    assert!(
        e.to_string().contains("consumer prefetch count is not set"),
        "{e}"
    );

    // Weir's: offset 0 was dropped by retention. Refused, never skipped.
    let cch = conn.create_channel().await.expect("channel");
    cch.basic_qos(10, BasicQosOptions::default())
        .await
        .expect("qos");
    let r = cch
        .basic_consume(
            "small".into(),
            "".into(),
            BasicConsumeOptions::default(),
            table(&[("x-stream-offset", AMQPValue::LongLongInt(0))]),
        )
        .await;
    let e = r.map(|_| ()).expect_err("refused: offset 0 is gone");
    assert_eq!(reply_code(&e), Some(406), "{e:?}");
    let msg = e.to_string();
    assert!(msg.contains("offset out of range"), "{msg}");
    // The oldest offset it names is where `first` starts, and the count
    // lost is that offset (from 0).
    let first = read(&conn, "small", Some(text("first")), 1).await[0].0;
    assert!(first > 0);
    assert!(
        msg.contains(&format!("oldest available offset is {first}")),
        "{msg}"
    );
    assert!(
        msg.contains(&format!("{first} events were lost to retention")),
        "{msg}"
    );
    // And from there on everything is delivered.
    let got = read(
        &conn,
        "small",
        Some(AMQPValue::LongLongInt(first)),
        (100 - first) as usize,
    )
    .await;
    assert_eq!(offsets(&got), (first..100).collect::<Vec<_>>());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_survives_kill_9_with_its_offsets() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut broker = Broker::start_in(dir.path());
    {
        let conn = connect(&broker.url()).await;
        let ch = confirm_channel(&conn).await;
        declare_stream(&ch, "log", &[]).await;
        publish_n(&ch, "log", 0, 50).await;
    }
    broker.kill9();
    broker.restart();
    let conn = connect(&broker.url()).await;
    let ch = confirm_channel(&conn).await;
    let got = read(&conn, "log", Some(text("first")), 50).await;
    assert_eq!(offsets(&got), (0..50).collect::<Vec<_>>());
    assert_eq!(got[49].1, "e49");
    // Read back from the store (not the process's memory), from the middle.
    let got = read(&conn, "log", Some(AMQPValue::LongLongInt(31)), 19).await;
    assert_eq!(offsets(&got), (31..50).collect::<Vec<_>>());
    publish_n(&ch, "log", 50, 51).await;
    assert_eq!(
        read(&conn, "log", Some(text("last")), 1).await,
        vec![(50, "e50".to_string())]
    );
    let _ = ch.close(200, "bye".into()).await;
}
