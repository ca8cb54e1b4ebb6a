//! Bad input on raw TCP: garbage, wrong protocol headers and frames that
//! break the protocol after the handshake. Every test ends by checking that
//! a fresh lapin connection still works.

use rand::{Rng, RngCore};
use weir_tests::raw::{self, RawClient, PROTOCOL_HEADER};
use weir_tests::*;

/// Sends `bytes` as the very first thing and returns everything the server
/// wrote before closing.
async fn first_bytes(broker: &Broker, bytes: &[u8]) -> Vec<u8> {
    let mut c = RawClient::connect(broker.addr()).await;
    // The server may close as soon as it has seen enough; ignore EPIPE.
    let _ = c.try_send(bytes).await;
    c.read_to_eof().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_bytes_get_protocol_header_or_close() {
    let broker = Broker::start();
    let mut rng = rand::thread_rng();
    let mut tasks = Vec::new();
    for i in 0..16 {
        let len = rng.gen_range(1..2048);
        let mut bytes = vec![0u8; len];
        rng.fill_bytes(&mut bytes);
        if bytes.starts_with(b"AMQP") {
            bytes[0] = b'X';
        }
        let addr = broker.addr();
        tasks.push(tokio::spawn(async move {
            let mut c = RawClient::connect(addr).await;
            let _ = c.try_send(&bytes).await;
            (i, bytes.len(), c.read_to_eof().await)
        }));
    }
    for t in tasks {
        let (i, len, out) = t.await.unwrap();
        assert!(
            out.is_empty() || out == PROTOCOL_HEADER,
            "blob {i} ({len} bytes): server answered {out:?}"
        );
    }
    assert_broker_healthy(&broker.url()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_protocol_headers_get_ours_back_and_close() {
    let broker = Broker::start();
    let cases: [&[u8]; 5] = [
        b"AMQP\x00\x00\x09\x02",
        b"AMQP\x01\x01\x00\x09", // AMQP 0-9 style header
        b"AMQP\x00\x01\x00\x00", // AMQP 1.0
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
        b"HTTP/1.1",
    ];
    for case in cases {
        let out = first_bytes(&broker, case).await;
        assert_eq!(
            out,
            PROTOCOL_HEADER,
            "for header {:?}",
            String::from_utf8_lossy(case)
        );
    }
    // A truncated header followed by the client hanging up.
    let mut c = RawClient::connect(broker.addr()).await;
    c.send(b"AMQ").await;
    c.stream.shutdown_write().await;
    let out = c.read_to_eof().await;
    assert!(out.is_empty() || out == PROTOCOL_HEADER, "{out:?}");
    assert_broker_healthy(&broker.url()).await;
}

trait ShutdownWrite {
    async fn shutdown_write(&mut self);
}
impl ShutdownWrite for tokio::net::TcpStream {
    async fn shutdown_write(&mut self) {
        use tokio::io::AsyncWriteExt;
        let _ = self.shutdown().await;
    }
}

/// Runs `bytes` after a successful handshake and returns the server's
/// connection.close.
async fn after_handshake(broker: &Broker, setup: &[Vec<u8>], bytes: &[u8]) -> raw::Close {
    let mut c = RawClient::open(broker.addr()).await;
    for s in setup {
        c.send(s).await;
    }
    let _ = c.try_send(bytes).await;
    let close = c
        .expect_connection_close()
        .await
        .expect("server closed the socket without connection.close");
    // After close-ok the server closes the socket (read_to_eof panics if it
    // stays open).
    c.read_to_eof().await;
    close
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_frame_is_501() {
    let broker = Broker::start();
    let probe = RawClient::open(broker.addr()).await;
    let frame_max = probe.frame_max;
    assert!(frame_max >= 4096, "frame_max {frame_max}");
    drop(probe);
    // A body frame announcing a payload bigger than frame_max; only the
    // header and a little of the payload are sent.
    let mut f = vec![raw::FRAME_METHOD, 0, 1];
    f.extend_from_slice(&(frame_max + 1).to_be_bytes());
    f.extend_from_slice(&[0u8; 64]);
    let close = after_handshake(&broker, &[raw::channel_open(1)], &f).await;
    assert_eq!(close.code, 501, "{close:?}");

    // A frame exactly at frame_max (payload = frame_max - 8) is fine: a
    // publish whose body frame fills it.
    let mut c = RawClient::open(broker.addr()).await;
    c.open_channel(1).await;
    c.send(&raw::queue_declare(1, "big")).await;
    c.expect_method(50, 11).await;
    let payload = vec![b'x'; frame_max as usize - 8];
    c.send(&raw::basic_publish(1, "", "big")).await;
    c.send(&raw::content_header(1, payload.len() as u64)).await;
    c.send(&raw::body(1, &payload)).await;
    // Round trip: a passive declare shows the message.
    c.send(&raw::queue_declare(1, "big")).await;
    let ok = c.expect_method(50, 11).await;
    let p = &ok.payload[4..];
    let n = p[0] as usize;
    let count = u32::from_be_bytes([p[1 + n], p[2 + n], p[3 + n], p[4 + n]]);
    assert_eq!(count, 1, "frame of exactly frame_max accepted");
    assert_broker_healthy(&broker.url()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_frame_end_and_unknown_frame_type_are_501() {
    let broker = Broker::start();
    let mut f = raw::channel_open(1);
    *f.last_mut().unwrap() = 0x00;
    let close = after_handshake(&broker, &[], &f).await;
    assert_eq!(close.code, 501, "bad frame-end: {close:?}");

    let f = raw::frame(9, 0, b"abc");
    let close = after_handshake(&broker, &[], &f).await;
    assert_eq!(close.code, 501, "unknown frame type: {close:?}");
    assert_broker_healthy(&broker.url()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn method_on_unopened_channel_is_504() {
    let broker = Broker::start();
    let close = after_handshake(&broker, &[], &raw::queue_declare(5, "q")).await;
    assert_eq!(close.code, 504, "{close:?}");
    assert_eq!((close.class_id, close.method_id), (50, 10), "{close:?}");
    assert_broker_healthy(&broker.url()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn method_on_closed_channel_is_504() {
    let broker = Broker::start();
    let mut c = RawClient::open(broker.addr()).await;
    c.open_channel(1).await;
    c.send(&raw::channel_close(1)).await;
    c.expect_method(20, 41).await;
    c.send(&raw::queue_declare(1, "q")).await;
    let close = c.expect_connection_close().await.expect("connection.close");
    assert_eq!(close.code, 504, "{close:?}");
    assert_broker_healthy(&broker.url()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn channel_open_twice_is_504() {
    let broker = Broker::start();
    let mut c = RawClient::open(broker.addr()).await;
    c.open_channel(1).await;
    c.send(&raw::channel_open(1)).await;
    let close = c.expect_connection_close().await.expect("connection.close");
    assert_eq!(close.code, 504, "{close:?}");
    assert_broker_healthy(&broker.url()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn content_without_publish_is_505() {
    let broker = Broker::start();
    let close = after_handshake(&broker, &[raw::channel_open(1)], &raw::body(1, b"orphan")).await;
    assert_eq!(close.code, 505, "body without publish: {close:?}");

    let close = after_handshake(&broker, &[raw::channel_open(1)], &raw::content_header(1, 3)).await;
    assert_eq!(close.code, 505, "header without publish: {close:?}");

    // A method where the content header should be.
    let setup = [raw::channel_open(1), raw::basic_publish(1, "", "q")];
    let close = after_handshake(&broker, &setup, &raw::queue_declare(1, "q")).await;
    assert_eq!(
        close.code, 505,
        "method instead of content header: {close:?}"
    );

    // A body bigger than announced in the header.
    let setup = [
        raw::channel_open(1),
        raw::basic_publish(1, "", "q"),
        raw::content_header(1, 2),
    ];
    let close = after_handshake(&broker, &setup, &raw::body(1, b"too long")).await;
    assert!(
        matches!(close.code, 501 | 505),
        "body longer than announced: {close:?}"
    );
    assert_broker_healthy(&broker.url()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tx_select_is_answered() {
    // Transactions are supported (their semantics: gateway/tests/transactions.rs).
    let broker = Broker::start();
    let mut c = RawClient::open(broker.addr()).await;
    c.open_channel(1).await;
    c.send(&raw::tx_select(1)).await;
    c.expect_method(90, 11).await;
    assert_broker_healthy(&broker.url()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_exchange_type_is_503() {
    let broker = Broker::start();
    let close = after_handshake(
        &broker,
        &[raw::channel_open(1)],
        &raw::exchange_declare(1, "weird", "x-no-such-type"),
    )
    .await;
    assert_eq!(close.code, 503, "{close:?}");
    // Through lapin too.
    let conn = connect(&broker.url()).await;
    let ch = conn.create_channel().await.unwrap();
    let r = ch
        .exchange_declare(
            "weird2".into(),
            lapin::ExchangeKind::Custom("x-no-such-type".into()),
            Default::default(),
            Default::default(),
        )
        .await;
    assert_code(r, 503);
    assert_broker_healthy(&broker.url()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_after_handshake_closes_only_that_connection() {
    let broker = Broker::start();
    // A bystander connection that must survive.
    let conn = connect(&broker.url()).await;
    let ch = confirm_channel(&conn).await;
    declare_queue(&ch, "bystander").await;

    let mut rng = rand::thread_rng();
    for _ in 0..8 {
        let mut bytes = vec![0u8; rng.gen_range(8..512)];
        rng.fill_bytes(&mut bytes);
        let mut c = RawClient::open(broker.addr()).await;
        let _ = c.try_send(&bytes).await;
        // Either a connection.close (any error code) or a plain close.
        if let Some(close) = c.expect_connection_close().await {
            assert!(close.code >= 500, "{close:?}");
        }
    }
    publish_confirmed(
        &ch,
        "",
        "bystander",
        b"still here",
        lapin::BasicProperties::default(),
    )
    .await;
    assert_eq!(queue_len(&ch, "bystander").await, 1);
    assert_broker_healthy(&broker.url()).await;
}
