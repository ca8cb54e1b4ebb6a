//! Issue 20, item 2 and part of item 6: what an MQTT client can hold before
//! it logged in (a 16 MiB CONNECT over TCP and over WebSocket, sockets that
//! never send a CONNECT), user properties in a CONNECT's will and in a
//! PUBLISH, and the pongs owed to a WebSocket client that pings and never
//! reads. Raw sockets against the real binary; each attack ends by checking
//! that a fresh MQTT client and a fresh AMQP client are served within 1 s.

use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use weir_tests::hardening::broker_rss;
use weir_tests::raw::RawClient;
use weir_tests::*;

/// What the tests declare: the configured maximum packet size (default).
const SIXTEEN_MIB: usize = 16 << 20;
/// How long an answer may take; the base binary gives none before its
/// 10 s CONNECT timeout.
const ANSWER: Duration = Duration::from_secs(5);

/// A variable byte integer.
fn varint(mut v: usize) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let mut b = (v % 128) as u8;
        v /= 128;
        if v > 0 {
            b |= 0x80;
        }
        out.push(b);
        if v == 0 {
            return out;
        }
    }
}

fn string(s: &[u8]) -> Vec<u8> {
    [&(s.len() as u16).to_be_bytes()[..], s].concat()
}

/// A packet: first byte, remaining length, body.
fn packet(byte1: u8, body: &[u8]) -> Vec<u8> {
    [&[byte1][..], &varint(body.len()), body].concat()
}

/// An MQTT 5 CONNECT, user guest/guest, with a will on "w" whose property
/// block is `will_props` (None: no will).
fn connect5(client_id: &str, will_props: Option<&[u8]>) -> Vec<u8> {
    let mut flags = 0x02 | 0x80 | 0x40; // clean start, user name, password
    if will_props.is_some() {
        flags |= 0x04;
    }
    let mut body = [&string(b"MQTT")[..], &[5, flags, 0, 30, 0]].concat();
    body.extend(string(client_id.as_bytes()));
    if let Some(p) = will_props {
        body.extend(varint(p.len()));
        body.extend_from_slice(p);
        body.extend(string(b"w"));
        body.extend(string(b"gone"));
    }
    body.extend(string(b"guest"));
    body.extend(string(b"guest"));
    packet(0x10, &body)
}

/// `n` empty user properties (5 bytes each on the wire).
fn empty_user_props(n: usize) -> Vec<u8> {
    [38u8, 0, 0, 0, 0].repeat(n)
}

/// Reads one MQTT packet (first byte, body) from `s`, or None on EOF,
/// error or after `wait`.
async fn read_packet(s: &mut (impl AsyncReadExt + Unpin), wait: Duration) -> Option<(u8, Vec<u8>)> {
    tokio::time::timeout(wait, async {
        let b1 = s.read_u8().await.ok()?;
        let mut len = 0usize;
        for i in 0..4 {
            let b = s.read_u8().await.ok()?;
            len |= usize::from(b & 0x7F) << (7 * i);
            if b & 0x80 == 0 {
                break;
            }
        }
        let mut body = vec![0; len];
        s.read_exact(&mut body).await.ok()?;
        Some((b1, body))
    })
    .await
    .ok()
    .flatten()
}

/// A fresh MQTT 3.1.1 client logs in and a fresh AMQP client opens a
/// connection, each within 1 s.
async fn fresh_clients_are_served(broker: &mut Broker, what: &str) {
    let start = Instant::now();
    let mqtt = tokio::time::timeout(Duration::from_secs(1), async {
        let mut s = TcpStream::connect(("127.0.0.1", broker.mqtt_port()))
            .await
            .ok()?;
        let mut body = [&string(b"MQTT")[..], &[4, 0xC2, 0, 30]].concat();
        body.extend(string(b"fresh"));
        body.extend(string(b"guest"));
        body.extend(string(b"guest"));
        s.write_all(&packet(0x10, &body)).await.ok()?;
        read_packet(&mut s, Duration::from_secs(1)).await
    })
    .await;
    assert!(
        matches!(&mqtt, Ok(Some((0x20, b))) if b == &[0, 0]),
        "{what}: a fresh MQTT client was not logged in within 1 s: {mqtt:?}\n{}",
        broker.logs()
    );
    let mqtt_took = start.elapsed();
    let addr = broker.addr();
    let start = Instant::now();
    let amqp = tokio::time::timeout(Duration::from_secs(1), async move {
        RawClient::connect(addr)
            .await
            .handshake("guest", "guest", "/")
            .await
    })
    .await;
    assert!(
        matches!(amqp, Ok(Ok(()))),
        "{what}: a fresh AMQP client could not log in within 1 s: {amqp:?}"
    );
    println!(
        "{what}: fresh MQTT client in {mqtt_took:?}, AMQP in {:?}",
        start.elapsed()
    );
    assert!(broker.is_running(), "{what}: the broker exited");
}

/// Writes `total` bytes of zeros after `head` (ignoring the error of a
/// socket the broker closed) and returns how many were written.
async fn write_flood(w: &mut (impl AsyncWriteExt + Unpin), head: &[u8], total: usize) -> usize {
    if w.write_all(head).await.is_err() {
        return 0;
    }
    let chunk = vec![0u8; 64 * 1024];
    let mut sent = head.len();
    while sent < total {
        let n = chunk.len().min(total - sent);
        if w.write_all(&chunk[..n]).await.is_err() {
            break;
        }
        sent += n;
    }
    sent
}

/// The first bytes of an MQTT 5 CONNECT announcing `total` bytes in all.
fn big_connect_head(total: usize) -> Vec<u8> {
    let remaining = total - 5; // 4-byte length: 16 MiB needs it
    let mut len = varint(remaining);
    assert_eq!(len.len(), 4);
    let mut head = vec![0x10];
    head.append(&mut len);
    head.extend(string(b"MQTT"));
    head.push(5);
    head
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_16_mib_connect_before_login_is_refused_at_its_header_over_tcp() {
    let mut broker = Broker::start_mqtt_with(&[]);
    let before = broker_rss(&broker);
    let port = broker.mqtt_port();
    // Eight clients each announce a 16 MiB CONNECT and send all of it but
    // its last byte (a complete one would be answered by any broker).
    let clients: Vec<_> = (0..8)
        .map(|_| {
            tokio::spawn(async move {
                let s = TcpStream::connect(("127.0.0.1", port))
                    .await
                    .expect("connect");
                let (mut rd, mut wr) = s.into_split();
                let answer = tokio::spawn(async move { read_packet(&mut rd, ANSWER * 3).await });
                let sent =
                    write_flood(&mut wr, &big_connect_head(SIXTEEN_MIB), SIXTEEN_MIB - 1).await;
                (sent, answer, wr)
            })
        })
        .collect();
    let mut held = Vec::new();
    for c in clients {
        held.push(c.await.expect("client task"));
    }
    // All sent (or cut off): what the broker holds now is what they cost.
    let grew = broker_rss(&broker).saturating_sub(before);
    let sent: Vec<usize> = held.iter().map(|(n, _, _)| *n).collect();
    println!("RSS grew by {} KB; bytes sent: {sent:?}", grew / 1024);
    for (_, answer, _wr) in held {
        let answer = tokio::time::timeout(ANSWER, answer).await;
        // MQTT 5: CONNACK with reason 0x95 (packet too large).
        assert!(
            matches!(&answer, Ok(Ok(Some((0x20, body)))) if body.get(1) == Some(&0x95)),
            "a 16 MiB CONNECT got no CONNACK 0x95 within {ANSWER:?}: {answer:?}"
        );
    }
    assert!(
        grew < 32 << 20,
        "8 clients before login grew the broker by {} MB",
        grew >> 20
    );
    fresh_clients_are_served(&mut broker, "16 MiB CONNECT over TCP").await;
}

/// An upgraded MQTT-over-WebSocket connection (raw: frames by hand).
async fn ws_connect(port: u16) -> TcpStream {
    let mut s = TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect");
    let req = format!(
        "GET /mqtt HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\n\
         Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\
         Sec-WebSocket-Version: 13\r\nSec-WebSocket-Protocol: mqtt\r\n\r\n"
    );
    s.write_all(req.as_bytes()).await.expect("upgrade request");
    let mut resp = Vec::new();
    while !resp.ends_with(b"\r\n\r\n") {
        let b = tokio::time::timeout(ANSWER, s.read_u8())
            .await
            .expect("upgrade answer in time")
            .expect("upgrade answer");
        resp.push(b);
    }
    assert!(
        resp.starts_with(b"HTTP/1.1 101"),
        "{}",
        String::from_utf8_lossy(&resp)
    );
    s
}

/// A client frame header (FIN, `opcode`, masked with a zero key: the
/// payload goes as is).
fn ws_header(opcode: u8, len: usize) -> Vec<u8> {
    let mut h = vec![0x80 | opcode];
    if len < 126 {
        h.push(0x80 | len as u8);
    } else if len <= 0xFFFF {
        h.push(0x80 | 126);
        h.extend((len as u16).to_be_bytes());
    } else {
        h.push(0x80 | 127);
        h.extend((len as u64).to_be_bytes());
    }
    h.extend([0, 0, 0, 0]);
    h
}

/// Reads one server frame: (opcode, payload), or None on EOF, error or
/// after `wait`.
async fn ws_read(s: &mut (impl AsyncReadExt + Unpin), wait: Duration) -> Option<(u8, Vec<u8>)> {
    tokio::time::timeout(wait, async {
        let b0 = s.read_u8().await.ok()?;
        let b1 = s.read_u8().await.ok()?;
        let len = match b1 & 0x7F {
            126 => usize::from(s.read_u16().await.ok()?),
            127 => s.read_u64().await.ok()? as usize,
            n => usize::from(n),
        };
        let mut payload = vec![0; len];
        s.read_exact(&mut payload).await.ok()?;
        Some((b0 & 0x0F, payload))
    })
    .await
    .ok()
    .flatten()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_16_mib_message_before_login_is_refused_over_websocket() {
    let mut broker = Broker::start_mqtt_with(&["--mqtt-ws-listen", "127.0.0.1:0"]);
    let ws_port = broker.listener_port("MQTT WebSocket");
    let before = broker_rss(&broker);
    // Eight clients each send one binary message of 16 MiB (a CONNECT
    // announcing as much) but its last byte: tungstenite would hold it all.
    let clients: Vec<_> = (0..8)
        .map(|_| {
            tokio::spawn(async move {
                let s = ws_connect(ws_port).await;
                let (mut rd, mut wr) = s.into_split();
                let answer = tokio::spawn(async move { ws_read(&mut rd, ANSWER * 3).await });
                let head = [ws_header(2, SIXTEEN_MIB), big_connect_head(SIXTEEN_MIB)].concat();
                let total = head.len() - big_connect_head(SIXTEEN_MIB).len() + SIXTEEN_MIB - 1;
                let sent = write_flood(&mut wr, &head, total).await;
                (sent, answer, wr)
            })
        })
        .collect();
    let mut held = Vec::new();
    for c in clients {
        held.push(c.await.expect("client task"));
    }
    let grew = broker_rss(&broker).saturating_sub(before);
    let sent: Vec<usize> = held.iter().map(|(n, _, _)| *n).collect();
    println!("RSS grew by {} KB; bytes sent: {sent:?}", grew / 1024);
    for (_, answer, _wr) in held {
        let answer = tokio::time::timeout(ANSWER, answer).await;
        // A close frame with 1009 (message too big).
        assert!(
            matches!(&answer, Ok(Ok(Some((8, p)))) if p.get(..2) == Some(&[0x03, 0xF1])),
            "a 16 MiB WebSocket message before login got no close 1009 within {ANSWER:?}: {answer:?}"
        );
    }
    assert!(
        grew < 32 << 20,
        "8 WebSocket clients before login grew the broker by {} MB",
        grew >> 20
    );
    fresh_clients_are_served(&mut broker, "16 MiB message over WebSocket").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sockets_that_never_log_in_are_bounded_by_the_connection_limit() {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("weir.toml");
    std::fs::write(&file, "[mqtt]\nmax_connections = 2\n").unwrap();
    let mut broker = Broker::start_mqtt_with(&["--config", file.to_str().unwrap()]);
    let port = broker.mqtt_port();
    // The limit plus the login headroom (256) may wait for their CONNECT;
    // 20 more are closed at once, without reading.
    let extra = 20;
    let mut socks = Vec::new();
    for _ in 0..2 + 256 + extra {
        socks.push(
            TcpStream::connect(("127.0.0.1", port))
                .await
                .expect("connect"),
        );
    }
    let mut closed = 0;
    let deadline = Instant::now() + Duration::from_secs(3);
    for s in &mut socks {
        let left = deadline.saturating_duration_since(Instant::now());
        let mut b = [0u8; 1];
        if let Ok(r) =
            tokio::time::timeout(left.max(Duration::from_millis(1)), s.read(&mut b)).await
        {
            // EOF or reset: closed by the broker.
            if matches!(r, Ok(0) | Err(_)) {
                closed += 1;
            }
        }
    }
    assert_eq!(
        closed, extra,
        "sockets beyond max_connections + 256 are closed at once"
    );
    // Once they go, clients log in again.
    drop(socks);
    let served = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            let mut s = TcpStream::connect(("127.0.0.1", port))
                .await
                .expect("connect");
            let _ = s.write_all(&connect5("after", None)).await;
            if let Some((0x20, b)) = read_packet(&mut s, Duration::from_secs(1)).await {
                return b;
            }
        }
    })
    .await;
    assert!(
        matches!(&served, Ok(b) if b.get(1) == Some(&0)),
        "{served:?}"
    );
    assert!(broker.is_running());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn user_properties_in_a_will_and_a_publish_are_bounded() {
    let mut broker = Broker::start_mqtt_with(&[]);
    let port = broker.mqtt_port();
    // A will with 1,000 empty user properties (5 KB; 3.3 million of them
    // cost ~150 MB): CONNACK 0x95.
    let mut s = TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect");
    let will = empty_user_props(1_000);
    s.write_all(&connect5("will-props", Some(&will)))
        .await
        .expect("send");
    let answer = read_packet(&mut s, ANSWER).await;
    assert!(
        matches!(&answer, Some((0x20, b)) if b.get(1) == Some(&0x95)),
        "a will with 1,000 user properties: {answer:?}"
    );

    // A PUBLISH with 100,000 empty user properties after login: DISCONNECT
    // 0x95.
    let mut s = TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect");
    s.write_all(&connect5("pub-props", None))
        .await
        .expect("send");
    let answer = read_packet(&mut s, ANSWER).await;
    assert!(
        matches!(&answer, Some((0x20, b)) if b.get(1) == Some(&0)),
        "{answer:?}"
    );
    let props = empty_user_props(100_000);
    let mut body = string(b"t");
    body.extend(varint(props.len()));
    body.extend(props);
    body.extend_from_slice(b"payload");
    s.write_all(&packet(0x30, &body)).await.expect("send");
    let answer = read_packet(&mut s, ANSWER).await;
    assert!(
        matches!(&answer, Some((0xE0, b)) if b.first() == Some(&0x95)),
        "a PUBLISH with 100,000 user properties: {answer:?}"
    );
    fresh_clients_are_served(&mut broker, "user properties").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pongs_for_a_websocket_client_that_never_reads_are_bounded() {
    let mut broker = Broker::start_mqtt_with(&["--mqtt-ws-listen", "127.0.0.1:0"]);
    let ws_port = broker.listener_port("MQTT WebSocket");
    // Logged in, so the pre-login bound plays no part.
    let mut s = ws_connect(ws_port).await;
    let connect = connect5("pinger", None);
    s.write_all(&[ws_header(2, connect.len()), connect].concat())
        .await
        .expect("CONNECT");
    let connack = ws_read(&mut s, ANSWER).await;
    assert!(
        matches!(&connack, Some((2, p)) if p.first() == Some(&0x20) && p.get(3) == Some(&0)),
        "{connack:?}"
    );
    let before = broker_rss(&broker);
    // 400,000 pings of 125 bytes, never reading a pong: ~50 MB of pongs.
    let ping = [ws_header(9, 125), vec![b'p'; 125]].concat();
    let batch = ping.repeat(1_000);
    let started = Instant::now();
    for _ in 0..400 {
        s.write_all(&batch).await.expect("pings");
    }
    let grew = broker_rss(&broker).saturating_sub(before);
    println!(
        "400,000 pings in {:?}; RSS grew by {} KB",
        started.elapsed(),
        grew / 1024
    );
    assert!(
        grew < 16 << 20,
        "pongs owed to a client that does not read grew the broker by {} MB",
        grew >> 20
    );
    fresh_clients_are_served(&mut broker, "WebSocket ping flood").await;
    drop(s);
}
