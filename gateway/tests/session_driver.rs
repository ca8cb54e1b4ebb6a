//! The session driver and its durability tickets, through the real
//! listeners and sessions in process over `MemStore`, whose durability the
//! tests hold and release (deterministic, no timing): the answers of a
//! batch share one store barrier and keep their order, for AMQP confirms,
//! MQTT PUBACKs and HTTP answers alike; every plain listener of the table
//! serves its protocol.

use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use weir_backend::testing::MemStore;

mod support;

/// How long any answer may take (a generous bound, not a synchronization).
const PATIENCE: Duration = Duration::from_secs(10);

/// Waits until the store holds a waiter: the broker asked for durability.
async fn until_held(store: &MemStore) {
    tokio::time::timeout(PATIENCE, async {
        while store.held_waiters() == 0 {
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("the broker asks the store for durability");
}

// ----- raw AMQP 0-9-1 -----

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

fn frame(kind: u8, channel: u16, payload: &[u8]) -> Vec<u8> {
    let mut f = vec![kind];
    f.extend_from_slice(&channel.to_be_bytes());
    f.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    f.extend_from_slice(payload);
    f.push(0xce);
    f
}

fn method(channel: u16, class: u16, id: u16, args: &[u8]) -> Vec<u8> {
    let mut payload = class.to_be_bytes().to_vec();
    payload.extend_from_slice(&id.to_be_bytes());
    payload.extend_from_slice(args);
    frame(1, channel, &payload)
}

/// basic.publish to the default exchange with its content (persistent:
/// delivery-mode 2).
fn publish(ch: u16, queue: &str, body: &[u8], persistent: bool) -> Vec<u8> {
    let mut a = vec![0, 0];
    a.extend(shortstr(""));
    a.extend(shortstr(queue));
    a.push(0);
    let mut f = method(ch, 60, 40, &a);
    let mut header = 60u16.to_be_bytes().to_vec();
    header.extend_from_slice(&0u16.to_be_bytes());
    header.extend_from_slice(&(body.len() as u64).to_be_bytes());
    if persistent {
        header.extend_from_slice(&0x1000u16.to_be_bytes());
        header.push(2);
    } else {
        header.extend_from_slice(&0u16.to_be_bytes());
    }
    f.extend(frame(2, ch, &header));
    f.extend(frame(3, ch, body));
    f
}

/// One method frame as read: channel, class, method, arguments.
type Method = (u16, u16, u16, Vec<u8>);

/// A raw AMQP connection, opened.
struct Amqp {
    sock: TcpStream,
    buf: Vec<u8>,
}

impl Amqp {
    async fn open(addr: std::net::SocketAddr) -> Amqp {
        let sock = TcpStream::connect(addr).await.expect("connect");
        let mut r = Amqp {
            sock,
            buf: Vec::new(),
        };
        r.send(b"AMQP\x00\x00\x09\x01").await;
        assert_eq!(r.method().await.1, 10, "connection.start");
        let mut start_ok = longstr(b"");
        start_ok.extend(shortstr("PLAIN"));
        start_ok.extend(longstr(b"\0guest\0guest"));
        start_ok.extend(shortstr("en_US"));
        r.send(&method(0, 10, 11, &start_ok)).await;
        assert_eq!(r.method().await.2, 30, "connection.tune");
        let mut tune_ok = 0u16.to_be_bytes().to_vec();
        tune_ok.extend_from_slice(&131072u32.to_be_bytes());
        tune_ok.extend_from_slice(&0u16.to_be_bytes());
        let mut open = shortstr("/");
        open.extend(shortstr(""));
        open.push(0);
        let mut both = method(0, 10, 31, &tune_ok);
        both.extend(method(0, 10, 40, &open));
        r.send(&both).await;
        assert_eq!(r.method().await.2, 41, "connection.open-ok");
        r
    }

    /// Opens channel `ch` with publisher confirms.
    async fn confirm_channel(&mut self, ch: u16) {
        self.send(&method(ch, 20, 10, &shortstr(""))).await;
        assert_eq!(self.ids().await, (ch, 20, 11), "channel.open-ok");
        self.send(&method(ch, 85, 10, &[0])).await;
        assert_eq!(self.ids().await, (ch, 85, 11), "confirm.select-ok");
    }

    /// The next method's channel, class and method.
    async fn ids(&mut self) -> (u16, u16, u16) {
        let (ch, class, id, _) = self.method().await;
        (ch, class, id)
    }

    async fn send(&mut self, bytes: &[u8]) {
        self.sock.write_all(bytes).await.expect("write");
    }

    /// The next method frame, skipping other frames.
    async fn method(&mut self) -> Method {
        loop {
            if self.buf.len() >= 7 {
                let n = u32::from_be_bytes([self.buf[3], self.buf[4], self.buf[5], self.buf[6]])
                    as usize;
                if self.buf.len() >= 8 + n {
                    let kind = self.buf[0];
                    let ch = u16::from_be_bytes([self.buf[1], self.buf[2]]);
                    let payload = self.buf[7..7 + n].to_vec();
                    self.buf.drain(..8 + n);
                    if kind == 1 {
                        let class = u16::from_be_bytes([payload[0], payload[1]]);
                        let id = u16::from_be_bytes([payload[2], payload[3]]);
                        return (ch, class, id, payload[4..].to_vec());
                    }
                    continue;
                }
            }
            let mut chunk = [0u8; 4096];
            let n = tokio::time::timeout(PATIENCE, self.sock.read(&mut chunk))
                .await
                .expect("a frame in time")
                .expect("read");
            assert!(n > 0, "broker closed the connection");
            self.buf.extend_from_slice(&chunk[..n]);
        }
    }

    /// The next basic.ack: (channel, delivery tag).
    async fn ack(&mut self) -> (u16, u64) {
        let (ch, class, id, args) = self.method().await;
        assert_eq!((class, id), (60, 80), "a basic.ack");
        let tag = u64::from_be_bytes(args[..8].try_into().expect("8 bytes"));
        (ch, tag)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn confirms_of_one_batch_share_one_store_barrier_and_keep_their_order() {
    let dir = tempfile::tempdir().expect("temp dir");
    let store = MemStore::new();
    let addrs = support::start(store.clone(), dir.path()).await;
    let mut c = Amqp::open(addrs.amqp).await;
    for ch in 1..=4 {
        c.confirm_channel(ch).await;
    }
    let mut declare = vec![0, 0];
    declare.extend(shortstr("q"));
    declare.push(0b10); // durable
    declare.extend(longstr(b""));
    c.send(&method(1, 50, 10, &declare)).await;
    assert_eq!(c.ids().await, (1, 50, 11), "queue.declare-ok");

    // One write, one batch: persistent publishes on three channels.
    store.hold_durability(true);
    let mut batch = publish(1, "q", b"a", true);
    batch.extend(publish(2, "q", b"b", true));
    batch.extend(publish(3, "q", b"c", true));
    c.send(&batch).await;
    until_held(&store).await;
    // A later batch: a transient publish on channel 1, whose confirm must
    // wait behind the persistent one (order), and one on channel 4, which
    // waits for nothing: its ack comes while the others are held, and
    // after it every earlier batch is done.
    let mut later = publish(1, "q", b"d", false);
    later.extend(publish(4, "q", b"e", false));
    c.send(&later).await;
    assert_eq!(c.ack().await, (4, 1), "a confirm that waits for nothing");
    assert_eq!(
        store.held_waiters(),
        1,
        "one store barrier for the three channels' confirms, none for the one queued behind"
    );

    store.hold_durability(false);
    let mut acks = Vec::new();
    for _ in 0..4 {
        acks.push(c.ack().await);
    }
    let on = |ch: u16| {
        acks.iter()
            .filter(|a| a.0 == ch)
            .map(|a| a.1)
            .collect::<Vec<_>>()
    };
    assert_eq!(on(1), [1, 2], "channel 1's confirms in order");
    assert_eq!(on(2), [1]);
    assert_eq!(on(3), [1]);
}

// ----- raw MQTT 3.1.1 -----

fn mqtt_str(s: &str) -> Vec<u8> {
    let mut v = (s.len() as u16).to_be_bytes().to_vec();
    v.extend_from_slice(s.as_bytes());
    v
}

/// A packet with its fixed header.
fn packet(first: u8, body: &[u8]) -> Vec<u8> {
    let mut p = vec![first];
    let mut n = body.len();
    loop {
        let mut b = (n % 128) as u8;
        n /= 128;
        if n > 0 {
            b |= 0x80;
        }
        p.push(b);
        if n == 0 {
            break;
        }
    }
    p.extend_from_slice(body);
    p
}

/// Takes the first whole packet off `buf`: its first byte and body.
fn take_packet(buf: &mut Vec<u8>) -> Option<(u8, Vec<u8>)> {
    let mut len = 0usize;
    let mut i = 1;
    loop {
        let b = *buf.get(i)?;
        len |= usize::from(b & 0x7f) << (7 * (i - 1));
        i += 1;
        if b & 0x80 == 0 {
            break;
        }
    }
    if buf.len() < i + len {
        return None;
    }
    let first = buf[0];
    let body = buf[i..i + len].to_vec();
    buf.drain(..i + len);
    Some((first, body))
}

fn connect(client_id: &str, clean: bool) -> Vec<u8> {
    let mut b = mqtt_str("MQTT");
    b.push(4);
    b.push(0x80 | 0x40 | if clean { 0x02 } else { 0 });
    b.extend_from_slice(&60u16.to_be_bytes());
    b.extend(mqtt_str(client_id));
    b.extend(mqtt_str("guest"));
    b.extend(mqtt_str("guest"));
    packet(0x10, &b)
}

fn subscribe(id: u16, filter: &str) -> Vec<u8> {
    let mut b = id.to_be_bytes().to_vec();
    b.extend(mqtt_str(filter));
    b.push(1);
    packet(0x82, &b)
}

fn publish1(id: u16, topic: &str, payload: &[u8]) -> Vec<u8> {
    let mut b = mqtt_str(topic);
    b.extend_from_slice(&id.to_be_bytes());
    b.extend_from_slice(payload);
    packet(0x32, &b)
}

/// A raw MQTT connection.
struct Mqtt {
    sock: TcpStream,
    buf: Vec<u8>,
}

impl Mqtt {
    async fn connect(addr: std::net::SocketAddr, client_id: &str, clean: bool) -> Mqtt {
        let sock = TcpStream::connect(addr).await.expect("connect");
        let mut m = Mqtt {
            sock,
            buf: Vec::new(),
        };
        m.send(&connect(client_id, clean)).await;
        let (first, body) = m.packet().await;
        assert_eq!((first, body[1]), (0x20, 0), "CONNACK accepted");
        m
    }

    async fn send(&mut self, bytes: &[u8]) {
        self.sock.write_all(bytes).await.expect("write");
    }

    /// The next packet: its first byte and body.
    async fn packet(&mut self) -> (u8, Vec<u8>) {
        loop {
            if let Some(p) = take_packet(&mut self.buf) {
                return p;
            }
            let mut chunk = [0u8; 4096];
            let n = tokio::time::timeout(PATIENCE, self.sock.read(&mut chunk))
                .await
                .expect("a packet in time")
                .expect("read");
            assert!(n > 0, "broker closed the connection");
            self.buf.extend_from_slice(&chunk[..n]);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_puback_waits_for_its_publish_to_be_durable_and_acks_keep_their_order() {
    let dir = tempfile::tempdir().expect("temp dir");
    let store = MemStore::new();
    let addrs = support::start(store.clone(), dir.path()).await;
    // A persistent session subscribed at QoS 1: publishes to `t` are stored.
    let mut sub = Mqtt::connect(addrs.mqtt, "keeper", false).await;
    sub.send(&subscribe(1, "t")).await;
    assert_eq!(sub.packet().await.0, 0x90, "SUBACK");

    let mut p = Mqtt::connect(addrs.mqtt, "publisher", true).await;
    store.hold_durability(true);
    // Stored (waits for the store), then unroutable (waits only for the
    // answer before it).
    let mut batch = publish1(7, "t", b"kept");
    batch.extend(publish1(8, "nobody", b"dropped"));
    p.send(&batch).await;
    until_held(&store).await;
    // A round trip that waits for nothing: PINGRESP overtakes the held
    // PUBACKs.
    p.send(&[0xc0, 0]).await;
    assert_eq!(p.packet().await.0, 0xd0, "PINGRESP, not a PUBACK");

    store.hold_durability(false);
    assert_eq!(
        p.packet().await,
        (0x40, vec![0, 7]),
        "PUBACK 7 once durable"
    );
    assert_eq!(p.packet().await, (0x40, vec![0, 8]), "then PUBACK 8");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http_answer_waits_for_its_change_to_be_durable() {
    let dir = tempfile::tempdir().expect("temp dir");
    let store = MemStore::new();
    let addrs = support::start(store.clone(), dir.path()).await;
    store.hold_durability(true);
    let body = br#"{"durable":true}"#;
    let request = format!(
        "PUT /api/queues/%2F/dq HTTP/1.1\r\nHost: x\r\nAuthorization: Basic Z3Vlc3Q6Z3Vlc3Q=\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    let mut sock = TcpStream::connect(addrs.http).await.expect("connect");
    sock.write_all(request.as_bytes()).await.expect("write");
    sock.write_all(body).await.expect("write");
    let mut answer = Box::pin(async move {
        let mut all = Vec::new();
        sock.read_to_end(&mut all).await.expect("read");
        String::from_utf8_lossy(&all).into_owned()
    });
    until_held(&store).await;
    let early = tokio::time::timeout(Duration::from_millis(50), &mut answer).await;
    assert!(early.is_err(), "answered before the queue was durable");
    store.hold_durability(false);
    let answer = tokio::time::timeout(PATIENCE, answer)
        .await
        .expect("answered once durable");
    assert!(answer.starts_with("HTTP/1.1 201"), "{answer}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_plain_listener_of_the_table_serves_its_protocol() {
    let dir = tempfile::tempdir().expect("temp dir");
    let addrs = support::start(MemStore::new(), dir.path()).await;
    // AMQP: the handshake (connection.open-ok).
    drop(Amqp::open(addrs.amqp).await);
    // MQTT over TCP: CONNACK.
    drop(Mqtt::connect(addrs.mqtt, "tcp", true).await);
    // MQTT over WebSocket: the upgrade, then CONNACK in a binary frame.
    drop(WsMqtt::connect(addrs.mqtt_ws, "ws").await);
}

/// An MQTT-over-WebSocket connection: frames by hand, the MQTT byte stream
/// inside them.
struct WsMqtt {
    sock: TcpStream,
    /// Bytes read, not yet parsed into frames.
    raw: Vec<u8>,
    /// The MQTT bytes of the frames parsed.
    mqtt: Vec<u8>,
}

impl WsMqtt {
    /// Upgrades, sends CONNECT (clean session) and checks CONNACK.
    async fn connect(addr: std::net::SocketAddr, client_id: &str) -> WsMqtt {
        let mut sock = TcpStream::connect(addr).await.expect("connect");
        sock.write_all(
            b"GET /mqtt HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
              Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\
              Sec-WebSocket-Protocol: mqtt\r\n\r\n",
        )
        .await
        .expect("write");
        let mut head = Vec::new();
        while !head.ends_with(b"\r\n\r\n") {
            let mut b = [0u8; 1];
            let n = tokio::time::timeout(PATIENCE, sock.read(&mut b))
                .await
                .expect("upgrade answer in time")
                .expect("read");
            assert!(n > 0, "closed during the upgrade");
            head.push(b[0]);
        }
        let head = String::from_utf8_lossy(&head);
        assert!(head.starts_with("HTTP/1.1 101"), "{head}");
        let mut ws = WsMqtt {
            sock,
            raw: Vec::new(),
            mqtt: Vec::new(),
        };
        ws.send(&connect(client_id, true)).await;
        let (first, body) = ws.packet().await;
        assert_eq!((first, body), (0x20, vec![0, 0]), "CONNACK accepted");
        ws
    }

    /// Sends MQTT bytes in one masked binary frame.
    async fn send(&mut self, bytes: &[u8]) {
        assert!(bytes.len() < 126);
        let mask = [1u8, 2, 3, 4];
        let mut f = vec![0x82, 0x80 | bytes.len() as u8];
        f.extend_from_slice(&mask);
        f.extend(bytes.iter().enumerate().map(|(i, b)| b ^ mask[i % 4]));
        self.sock.write_all(&f).await.expect("write");
    }

    /// The next MQTT packet, from however many frames.
    async fn packet(&mut self) -> (u8, Vec<u8>) {
        loop {
            if let Some(p) = take_packet(&mut self.mqtt) {
                return p;
            }
            // A whole frame from the server (unmasked)?
            if self.raw.len() >= 2 {
                let (len, at) = match self.raw[1] & 0x7f {
                    126 if self.raw.len() >= 4 => (
                        usize::from(u16::from_be_bytes([self.raw[2], self.raw[3]])),
                        4,
                    ),
                    127 if self.raw.len() >= 10 => (
                        u64::from_be_bytes(self.raw[2..10].try_into().expect("8 bytes")) as usize,
                        10,
                    ),
                    126 | 127 => (usize::MAX, 0),
                    n => (usize::from(n), 2),
                };
                if len != usize::MAX && self.raw.len() >= at + len {
                    assert_eq!(self.raw[0], 0x82, "a binary frame");
                    self.mqtt.extend_from_slice(&self.raw[at..at + len]);
                    self.raw.drain(..at + len);
                    continue;
                }
            }
            let mut chunk = vec![0u8; 64 * 1024];
            let n = tokio::time::timeout(PATIENCE, self.sock.read(&mut chunk))
                .await
                .expect("a frame in time")
                .expect("read");
            assert!(n > 0, "broker closed the connection");
            self.raw.extend_from_slice(&chunk[..n]);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_websocket_subscriber_that_stops_reading_gets_everything_once_it_reads_again() {
    let dir = tempfile::tempdir().expect("temp dir");
    let addrs = support::start(MemStore::new(), dir.path()).await;
    let mut sub = WsMqtt::connect(addrs.mqtt_ws, "ws-sub").await;
    let mut filter = 1u16.to_be_bytes().to_vec();
    filter.extend(mqtt_str("big"));
    filter.push(0);
    sub.send(&packet(0x82, &filter)).await;
    assert_eq!(sub.packet().await.0, 0x90, "SUBACK");

    // Far more than the socket buffers, the WebSocket pump's pipe and the
    // session's output hold: the session waits on a full pipe, as on a
    // full socket, until the client reads again.
    const COUNT: usize = 300;
    const SIZE: usize = 32 * 1024;
    let mut p = Mqtt::connect(addrs.mqtt, "ws-pub", true).await;
    for i in 0..COUNT {
        let mut body = mqtt_str("big");
        body.extend_from_slice(&(i as u16 + 1).to_be_bytes());
        body.extend(std::iter::repeat_n(i as u8, SIZE));
        p.send(&packet(0x32, &body)).await;
        assert_eq!(p.packet().await.0, 0x40, "PUBACK");
    }
    for i in 0..COUNT {
        let (first, body) = sub.packet().await;
        assert_eq!(first & 0xf0, 0x30, "a PUBLISH");
        let payload = &body[2 + 3..];
        assert_eq!(payload.len(), SIZE);
        assert_eq!(payload[0], i as u8, "in order");
    }
}

/// The task of every MQTT connection holds this future for the life of the
/// connection: the bulk of an idle device's memory. The driver must not
/// make it larger than the MQTT loop it replaced was (3,280 bytes,
/// measured before the driver at commit cda3866; 2,960 with it: its
/// sockets' readiness is polled, not awaited through a waiter node, and a
/// rate pause ends by the driver's one timer rather than a sleep of its
/// own).
#[test]
fn an_mqtt_connection_task_is_no_larger_than_before_the_driver() {
    fn size<A, B, C, D, F>(_: impl Fn(A, B, C, D) -> F) -> usize {
        std::mem::size_of::<F>()
    }
    let mqtt = size(weir_gateway::mqtt::session::serve);
    assert!(mqtt <= 3280, "MQTT connection future: {mqtt} bytes");
}
