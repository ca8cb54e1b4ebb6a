//! Logins cannot be starved (issue 20, item 5), against the real binary.
//!
//! 400 concurrent wrong-password HTTP requests from one address
//! (127.0.0.1) used to queue, first come first served, for the few argon2
//! slots every protocol shares: another user's first login from another
//! address waited behind all of them (32 s in the issue) and still did
//! right after the flood. Now each source gets its own turns, a source
//! over its failure budget is refused without hashing (HTTP 429, AMQP 403,
//! MQTT CONNACK 5, with any password), and known logins come from the
//! cache. The other client logs in from 127.0.0.2 (any loopback /8 address
//! works on Linux). Scheduling and counting are in `engine/tests/logins.rs`.

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};
use weir_tests::hardening::wait_until;
use weir_tests::http::Http;
use weir_tests::raw::RawClient;
use weir_tests::*;

const FLOOD: usize = 400;
/// Generous: the first login of a user costs one argon2 hash (tens of ms in
/// this build) and waits for at most one other verification per source.
const SERVED_WITHIN: Duration = Duration::from_secs(5);

fn b64(s: &str) -> String {
    const T: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for c in s.as_bytes().chunks(3) {
        let n = (u32::from(c[0]) << 16)
            | (u32::from(*c.get(1).unwrap_or(&0)) << 8)
            | u32::from(*c.get(2).unwrap_or(&0));
        for i in 0..4 {
            out.push(if i <= c.len() {
                T[((n >> (18 - 6 * i)) & 63) as usize] as char
            } else {
                '='
            });
        }
    }
    out
}

/// A TCP connection to `port` on 127.0.0.1 from the address `from`.
async fn connect_from(from: &str, port: u16) -> TcpStream {
    let from: IpAddr = from.parse().expect("ip");
    let s = TcpSocket::new_v4().expect("socket");
    s.bind(SocketAddr::new(from, 0))
        .expect("bind a loopback address");
    s.connect(SocketAddr::from(([127, 0, 0, 1], port)))
        .await
        .expect("connect")
}

/// Sends `GET path` with Basic credentials on `s`.
async fn send_get(s: &mut TcpStream, path: &str, user: &str, pass: &str) {
    let req = format!(
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nAuthorization: Basic {}\r\n\r\n",
        b64(&format!("{user}:{pass}"))
    );
    s.write_all(req.as_bytes()).await.expect("send request");
}

/// Reads a whole answer: status and body.
async fn read_answer(s: &mut TcpStream) -> (u16, String) {
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).await.expect("read answer");
    let text = String::from_utf8_lossy(&raw).to_string();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (status, body.to_string())
}

/// One `GET /api/whoami` from `from`: status, body, and how long it took.
async fn whoami(from: &str, port: u16, user: &str, pass: &str) -> (u16, String, Duration) {
    let t = Instant::now();
    let r = tokio::time::timeout(Duration::from_secs(120), async {
        let mut s = connect_from(from, port).await;
        send_get(&mut s, "/api/whoami", user, pass).await;
        read_answer(&mut s).await
    })
    .await
    .unwrap_or((0, "no answer within 120 s".into()));
    (r.0, r.1, t.elapsed())
}

/// A JSON error body with `error` (and a reason).
#[track_caller]
fn json_error(body: &str) -> String {
    let v: Value = serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {body}"));
    assert!(v["reason"].as_str().is_some_and(|r| !r.is_empty()), "{v}");
    v["error"].as_str().expect("error field").to_string()
}

/// An MQTT 3.1.1 CONNECT as `user`/`pass`; returns the CONNACK's return code.
async fn mqtt_connack(port: u16, user: &str, pass: &str) -> u8 {
    let mut var = vec![0, 4, b'M', b'Q', b'T', b'T', 4, 0xC2, 0, 30];
    for field in ["login-test", user, pass] {
        var.extend((field.len() as u16).to_be_bytes());
        var.extend(field.as_bytes());
    }
    let mut packet = vec![0x10, var.len() as u8];
    packet.extend(var);
    let mut s = TcpStream::connect(("127.0.0.1", port)).await.expect("mqtt");
    s.write_all(&packet).await.expect("CONNECT");
    let mut ack = [0u8; 4];
    s.read_exact(&mut ack).await.expect("CONNACK");
    assert_eq!(ack[0], 0x20, "not a CONNACK: {ack:?}");
    ack[3]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_login_flood_from_one_address_does_not_starve_other_users() {
    let b = Broker::start_mqtt_with(&[]);
    let port = b.http_port();
    let admin = Http::new(port, "guest", "guest");
    for user in ["alice", "bob"] {
        let r = admin.put(
            &format!("/api/users/{user}"),
            json!({"password": format!("{user}-pw"), "tags": "management"}),
        );
        assert_eq!(r.status, 201, "{}", r.text);
    }

    // The flood: 400 wrong passwords at once from 127.0.0.1.
    let sent = Arc::new(AtomicUsize::new(0));
    let (tx, mut answers) = tokio::sync::mpsc::unbounded_channel();
    let mut flood = tokio::task::JoinSet::new();
    for i in 0..FLOOD {
        let (sent, tx) = (sent.clone(), tx.clone());
        flood.spawn(async move {
            let mut s = connect_from("127.0.0.1", port).await;
            send_get(&mut s, "/api/overview", "guest", &format!("wrong-{i}")).await;
            sent.fetch_add(1, Ordering::Relaxed);
            let _ = tx.send(read_answer(&mut s).await);
        });
    }
    drop(tx);
    wait_until("the flood sent", Duration::from_secs(60), || {
        let sent = sent.clone();
        async move { sent.load(Ordering::Relaxed) == FLOOD }
    })
    .await;
    let first = tokio::time::timeout(Duration::from_secs(60), answers.recv())
        .await
        .expect("the flood is answered")
        .expect("an answer");

    // During the flood: Alice's first login, from another address.
    let (status, body, took) = whoami("127.0.0.2", port, "alice", "alice-pw").await;
    eprintln!("Alice's first login during the flood: {status} in {took:?}");
    assert_eq!(status, 200, "{body}");
    assert!(
        took < SERVED_WITHIN,
        "Alice's first login during the flood took {took:?}"
    );

    // Every refusal is a 401 or a 429 with a JSON body; wait for ten, so
    // 127.0.0.1 has used up its budget (failures are recorded before the
    // answer's delay starts).
    let mut refused = vec![first];
    while refused.len() < 10 {
        let a = tokio::time::timeout(Duration::from_secs(120), answers.recv())
            .await
            .expect("flood answers")
            .expect("an answer");
        refused.push(a);
    }
    for (status, body) in &refused {
        let error = json_error(body);
        match status {
            401 => assert_eq!(error, "not_authorized"),
            429 => assert_eq!(error, "too_many_requests"),
            s => panic!("flood answer {s}: {body}"),
        }
    }
    // The attacker gives up: its connections close, queued or not.
    flood.abort_all();
    while flood.join_next().await.is_some() {}

    // Right after the flood: Bob's first login from the other address.
    let (status, body, took) = whoami("127.0.0.2", port, "bob", "bob-pw").await;
    eprintln!("Bob's first login right after the flood: {status} in {took:?}");
    assert_eq!(status, 200, "{body}");
    assert!(
        took < SERVED_WITHIN,
        "Bob's first login right after the flood took {took:?}"
    );

    // 127.0.0.1 is over its budget on every protocol: refused without a
    // check, even with the right password (known to the cache), while the
    // same login from elsewhere goes through.
    let http = whoami("127.0.0.1", port, "guest", "guest");
    let amqp = async {
        let mut c = RawClient::connect(b.addr()).await;
        c.handshake("guest", "guest", "/").await
    };
    let mqtt = mqtt_connack(b.mqtt_port(), "guest", "guest");
    let ((status, body, _), amqp, mqtt) = tokio::join!(http, amqp, mqtt);
    assert_eq!(status, 429, "{body}");
    assert_eq!(json_error(&body), "too_many_requests");
    let close = amqp.expect_err("an over-budget AMQP login is refused");
    assert_eq!(close.code, 403, "{close:?}");
    assert!(close.text.starts_with("ACCESS_REFUSED"), "{close:?}");
    assert!(close.text.contains("too many failed logins"), "{close:?}");
    assert_eq!(mqtt, 5, "CONNACK not authorized");
    let (status, body, took) = whoami("127.0.0.2", port, "guest", "guest").await;
    assert_eq!(status, 200, "{body}");
    assert!(took < SERVED_WITHIN, "{took:?}");
}
