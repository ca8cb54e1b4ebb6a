//! A durable reply (declare-ok of a durable queue) waits for its fsync; the
//! connection that asked must keep working meanwhile: deliveries to its
//! consumers, on other channels, are not held behind that fsync.
//!
//! The real listener and session run in process over `MemStore`, whose
//! durability the test holds and releases: deterministic, no timing.

use futures_lite::StreamExt;
use lapin::options::{BasicConsumeOptions, BasicPublishOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Connection, ConnectionProperties};
use std::future::Future;
use std::time::Duration;
use weir_backend::testing::MemStore;

mod support;
use support::broker;

/// Whether `f` completes without waiting (polled once).
fn is_done<F: Future + Unpin>(f: &mut F) -> bool {
    let waker = std::task::Waker::noop();
    let mut cx = std::task::Context::from_waker(waker);
    std::pin::Pin::new(f).poll(&mut cx).is_ready()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_declare_waiting_for_its_fsync_does_not_hold_the_connections_deliveries() {
    let dir = tempfile::tempdir().expect("temp dir");
    let store = MemStore::new();
    let uri = broker(store.clone(), dir.path()).await;
    let props = ConnectionProperties::default();
    let a = Connection::connect(&uri, props.clone())
        .await
        .expect("A connects");
    let b = Connection::connect(&uri, props).await.expect("B connects");

    // A consumes from a transient queue on channel 1.
    let consume_ch = a.create_channel().await.expect("channel");
    consume_ch
        .queue_declare(
            "work".into(),
            QueueDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect("declare transient queue");
    let mut consumer = consume_ch
        .basic_consume(
            "work".into(),
            "c".into(),
            BasicConsumeOptions {
                no_ack: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .expect("consume");

    // From now on nothing becomes durable until the test says so.
    store.hold_durability(true);
    let declare_ch = a.create_channel().await.expect("channel");
    let mut declare = Box::pin(declare_ch.queue_declare(
        "durable-q".into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    ));
    // The declare reached the store (it waits for durability there).
    while store.held_waiters() == 0 {
        assert!(!is_done(&mut declare), "declare-ok came before its fsync");
        tokio::task::yield_now().await;
    }

    // B publishes a transient message to A's queue: A must get it now.
    let pub_ch = b.create_channel().await.expect("channel");
    pub_ch
        .basic_publish(
            "".into(),
            "work".into(),
            BasicPublishOptions::default(),
            b"not held",
            BasicProperties::default(),
        )
        .await
        .expect("publish");
    let delivery = tokio::time::timeout(Duration::from_secs(10), consumer.next())
        .await
        .expect("the delivery is not held behind the pending declare's fsync")
        .expect("consumer open")
        .expect("delivery");
    assert_eq!(delivery.data, b"not held");
    assert!(
        !is_done(&mut declare),
        "declare-ok must still wait for the fsync"
    );

    store.release();
    store.hold_durability(false);
    tokio::time::timeout(Duration::from_secs(10), declare)
        .await
        .expect("declare-ok once durable")
        .expect("declare succeeds");
}

// ----- raw AMQP frames, for pipelining several methods in one write -----

fn shortstr(s: &str) -> Vec<u8> {
    let mut v = vec![s.len() as u8];
    v.extend_from_slice(s.as_bytes());
    v
}

fn longstr(b: &[u8]) -> Vec<u8> {
    let mut v = (b.len() as u32).to_be_bytes().to_vec();
    v.extend_from_slice(b);
    v
}

fn method(channel: u16, class: u16, id: u16, args: &[u8]) -> Vec<u8> {
    let mut payload = class.to_be_bytes().to_vec();
    payload.extend_from_slice(&id.to_be_bytes());
    payload.extend_from_slice(args);
    let mut f = vec![1u8];
    f.extend_from_slice(&channel.to_be_bytes());
    f.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    f.extend_from_slice(&payload);
    f.push(0xce);
    f
}

fn durable_declare(ch: u16, queue: &str) -> Vec<u8> {
    let mut a = vec![0, 0];
    a.extend(shortstr(queue));
    a.push(0b10); // durable
    a.extend(longstr(b""));
    method(ch, 50, 10, &a)
}

fn consume(ch: u16, queue: &str, tag: &str) -> Vec<u8> {
    let mut a = vec![0, 0];
    a.extend(shortstr(queue));
    a.extend(shortstr(tag));
    a.push(0);
    a.extend(longstr(b""));
    method(ch, 60, 20, &a)
}

fn qos(ch: u16, prefetch: u16) -> Vec<u8> {
    let mut a = 0u32.to_be_bytes().to_vec();
    a.extend_from_slice(&prefetch.to_be_bytes());
    a.push(0);
    method(ch, 60, 10, &a)
}

/// A raw connection, opened and with channel 1 open.
struct Raw {
    sock: tokio::net::TcpStream,
    buf: Vec<u8>,
}

impl Raw {
    async fn open(addr: &str) -> Raw {
        use tokio::io::AsyncWriteExt;
        let sock = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let mut r = Raw {
            sock,
            buf: Vec::new(),
        };
        r.sock
            .write_all(b"AMQP\x00\x00\x09\x01")
            .await
            .expect("write");
        assert_eq!(r.method().await, (10, 10), "connection.start");
        let mut start_ok = longstr(b"");
        start_ok.extend(shortstr("PLAIN"));
        start_ok.extend(longstr(b"\0guest\0guest"));
        start_ok.extend(shortstr("en_US"));
        r.send(&method(0, 10, 11, &start_ok)).await;
        assert_eq!(r.method().await, (10, 30), "connection.tune");
        let mut tune_ok = 0u16.to_be_bytes().to_vec();
        tune_ok.extend_from_slice(&131072u32.to_be_bytes());
        tune_ok.extend_from_slice(&0u16.to_be_bytes());
        let mut open = shortstr("/");
        open.extend(shortstr(""));
        open.push(0);
        let mut both = method(0, 10, 31, &tune_ok);
        both.extend(method(0, 10, 40, &open));
        r.send(&both).await;
        assert_eq!(r.method().await, (10, 41), "connection.open-ok");
        r.send(&method(1, 20, 10, &shortstr(""))).await;
        assert_eq!(r.method().await, (20, 11), "channel.open-ok");
        r
    }

    async fn send(&mut self, bytes: &[u8]) {
        use tokio::io::AsyncWriteExt;
        self.sock.write_all(bytes).await.expect("write");
    }

    /// The next method frame's (class, method), skipping other frames.
    async fn method(&mut self) -> (u16, u16) {
        use tokio::io::AsyncReadExt;
        loop {
            if self.buf.len() >= 7 {
                let n = u32::from_be_bytes([self.buf[3], self.buf[4], self.buf[5], self.buf[6]])
                    as usize;
                if self.buf.len() >= 8 + n {
                    let kind = self.buf[0];
                    let payload = self.buf[7..7 + n].to_vec();
                    self.buf.drain(..8 + n);
                    if kind == 1 {
                        return (
                            u16::from_be_bytes([payload[0], payload[1]]),
                            u16::from_be_bytes([payload[2], payload[3]]),
                        );
                    }
                    continue;
                }
            }
            let mut chunk = [0u8; 4096];
            let n = tokio::time::timeout(Duration::from_secs(10), self.sock.read(&mut chunk))
                .await
                .expect("a reply within 10 s")
                .expect("read");
            assert!(n > 0, "broker closed the connection");
            self.buf.extend_from_slice(&chunk[..n]);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replies_queued_behind_a_durable_reply_keep_their_order() {
    let dir = tempfile::tempdir().expect("temp dir");
    let store = MemStore::new();
    let uri = broker(store.clone(), dir.path()).await;
    let addr = uri
        .trim_start_matches("amqp://guest:guest@")
        .trim_end_matches("/%2f")
        .to_string();
    let mut raw = Raw::open(&addr).await;

    // Pipelined: a durable declare (waits for its fsync), then a consume on
    // that queue and a qos, which need no store: their replies must still
    // come after the declare-ok, in order.
    store.hold_durability(true);
    let mut batch = durable_declare(1, "ordered");
    batch.extend(consume(1, "ordered", "c1"));
    batch.extend(qos(1, 5));
    raw.send(&batch).await;
    while store.held_waiters() == 0 {
        tokio::task::yield_now().await;
    }
    store.release();
    store.hold_durability(false);
    assert_eq!(raw.method().await, (50, 11), "queue.declare-ok first");
    assert_eq!(raw.method().await, (60, 21), "then basic.consume-ok");
    assert_eq!(raw.method().await, (60, 11), "then basic.qos-ok");

    // A failure caused by a later method waits for the pending reply too:
    // declare-ok, then the channel.close for the consume on a missing queue.
    store.hold_durability(true);
    let mut batch = durable_declare(1, "second");
    batch.extend(consume(1, "missing", "c2"));
    raw.send(&batch).await;
    while store.held_waiters() == 0 {
        tokio::task::yield_now().await;
    }
    store.release();
    store.hold_durability(false);
    assert_eq!(raw.method().await, (50, 11), "queue.declare-ok first");
    assert_eq!(raw.method().await, (20, 40), "then channel.close (404)");
}
