//! Issue 5, decoders: a login frame that nests field tables or arrays
//! thousands deep (finding 0) and incomplete messages held open on many
//! channels (finding 9), against the real binary over raw TCP. Each test ends
//! by checking that the broker is alive and serves a new client promptly.

use std::time::Duration;
use weir_tests::raw::{self, RawClient, PROTOCOL_HEADER};
use weir_tests::*;

/// A table entry "k" holding arrays (`b'A'`) or tables (`b'F'`) nested
/// `levels` deep: five bytes per array level, seven per table level.
fn deep_entry(kind: u8, levels: usize) -> Vec<u8> {
    let mut v: Vec<u8> = vec![kind, 0, 0, 0, 0];
    for _ in 1..levels {
        let inner = if kind == b'F' {
            [&[1, b'k'][..], &v].concat()
        } else {
            v
        };
        v = [&[kind][..], &(inner.len() as u32).to_be_bytes(), &inner].concat();
    }
    [&[1, b'k'][..], &v].concat()
}

/// An AMQPLAIN response (a table body) with wrong credentials and `extra`.
fn amqplain(extra: &[u8]) -> Vec<u8> {
    let mut r = raw::shortstr("LOGIN");
    r.push(b'S');
    r.extend(raw::longstr(b"nobody"));
    r.extend(raw::shortstr("PASSWORD"));
    r.push(b'S');
    r.extend(raw::longstr(b"wrong"));
    r.extend_from_slice(extra);
    r
}

fn start_ok(mechanism: &str, response: &[u8]) -> Vec<u8> {
    let mut a = raw::longstr(&[]); // client-properties: empty table
    a.extend(raw::shortstr(mechanism));
    a.extend(raw::longstr(response));
    a.extend(raw::shortstr("en_US"));
    raw::method(0, 10, 11, &a)
}

/// Sends `frame` right after connection.start and expects a connection.close
/// (or the socket closed), then checks that a second client logs in within
/// 1 s and that the process is still alive.
async fn attack_before_login(broker: &mut Broker, what: &str, frame: &[u8]) {
    let mut c = RawClient::connect(broker.addr()).await;
    c.send(PROTOCOL_HEADER).await;
    c.expect_method(10, 10).await;
    let _ = c.try_send(frame).await;
    let close = c.expect_connection_close().await;
    if let Some(close) = &close {
        assert!(
            matches!(close.code, 502 | 403),
            "{what}: unexpected close {close:?}"
        );
    }
    let addr = broker.addr();
    let second = tokio::time::timeout(Duration::from_secs(1), async move {
        let mut c = RawClient::connect(addr).await;
        c.handshake("guest", "guest", "/").await
    })
    .await;
    assert!(
        matches!(second, Ok(Ok(()))),
        "{what}: a second client could not log in within 1 s: {second:?}\n{}",
        broker.logs()
    );
    assert!(broker.is_running(), "{what}: the broker exited");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deeply_nested_amqplain_login_is_refused_and_the_broker_survives() {
    let mut broker = Broker::start();
    // The two shapes of finding 0: ~11 KB each, no valid credentials.
    for (kind, levels) in [(b'A', 2_100), (b'F', 1_400)] {
        let response = amqplain(&deep_entry(kind, levels));
        let what = format!("AMQPLAIN with {levels} nested {}", kind as char);
        attack_before_login(&mut broker, &what, &start_ok("AMQPLAIN", &response)).await;
    }
    assert_broker_healthy(&broker.url()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deeply_nested_tables_anywhere_in_the_handshake_are_refused() {
    let mut broker = Broker::start();
    let deep = raw::longstr(&deep_entry(b'A', 5_000));
    // Nesting in client-properties (checked before too, kept as a guard).
    let mut a = deep.clone();
    a.extend(raw::shortstr("PLAIN"));
    a.extend(raw::longstr(b"\0guest\0guest"));
    a.extend(raw::shortstr("en_US"));
    attack_before_login(
        &mut broker,
        "deep client-properties",
        &raw::method(0, 10, 11, &a),
    )
    .await;
    // A client sending connection.start: amq-protocol parses its
    // server-properties table like any other method's.
    let mut a = vec![0, 9];
    a.extend_from_slice(&deep);
    a.extend(raw::longstr(b"PLAIN"));
    a.extend(raw::longstr(b"en_US"));
    attack_before_login(
        &mut broker,
        "client-sent connection.start",
        &raw::method(0, 10, 10, &a),
    )
    .await;
    assert_broker_healthy(&broker.url()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn incomplete_messages_on_many_channels_are_capped_per_connection() {
    // 4 MiB segments: messages (and, by default, all incomplete content of
    // one connection) are limited to a little under 4 MiB.
    let mut broker = Broker::start_with(&["--segment-mb", "4"]);
    let mut c = RawClient::open(broker.addr()).await;
    let chunk = c.frame_max as usize - 8;
    let channels = 8u16;
    for ch in 1..=channels {
        c.send(&raw::channel_open(ch)).await;
        c.expect_method(20, 11).await;
    }
    // Each channel announces 3 MiB and sends half of it: one alone is
    // fine, three together pass the cap.
    let half = vec![b'x'; 1536 * 1024];
    let send = async {
        for ch in 1..=channels {
            let mut out = raw::basic_publish(ch, "", "nowhere");
            out.extend(raw::content_header(ch, 3 << 20));
            for piece in half.chunks(chunk) {
                out.extend(raw::body(ch, piece));
            }
            if c.try_send(&out).await.is_err() {
                break;
            }
        }
    };
    tokio::time::timeout(OP_TIMEOUT, send)
        .await
        .expect("the broker kept reading");
    let close = c
        .expect_channel_close()
        .await
        .expect("a channel is closed, not the socket");
    assert_eq!(close.code, 406, "{close:?}");
    assert!(close.text.contains("incomplete messages"), "{close:?}");
    assert!(close.channel >= 3, "channels 1 and 2 fit: {close:?}");
    // The connection itself goes on: a new channel still opens.
    c.send(&raw::channel_open(100)).await;
    loop {
        let f = c.read_method().await.expect("connection still open");
        if f.method() == Some((20, 11)) && f.channel == 100 {
            break;
        }
    }
    assert!(broker.is_running());
    assert_broker_healthy(&broker.url()).await;
}
