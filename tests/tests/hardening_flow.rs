//! Flow control and resource bounds (issue 5, findings 5–9 and 11), against
//! the real binary: memory and disk alarms with `connection.blocked`, a
//! queued message pinning only its own bytes, a consumer that stops reading,
//! a client that stalls in the middle of a message, and slowed failed logins.

use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions, QueuePurgeOptions};
use lapin::types::FieldTable;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;
use weir_tests::hardening::{broker_rss, declare_durable, split_frame, wait_until, Tmpfs};
use weir_tests::raw::{self, Frame};
use weir_tests::*;

/// A raw AMQP client that advertises the `connection.blocked` capability,
/// with its socket split so one task can write while another reads.
struct Client {
    r: OwnedReadHalf,
    w: Option<OwnedWriteHalf>,
    buf: Vec<u8>,
}

/// client-properties = { capabilities: { connection.blocked: true } }
fn client_properties() -> Vec<u8> {
    let mut caps = raw::shortstr("connection.blocked");
    caps.extend_from_slice(b"t\x01");
    let mut inner = (caps.len() as u32).to_be_bytes().to_vec();
    inner.extend(caps);
    let mut entry = raw::shortstr("capabilities");
    entry.push(b'F');
    entry.extend(inner);
    let mut table = (entry.len() as u32).to_be_bytes().to_vec();
    table.extend(entry);
    table
}

impl Client {
    /// Connects and logs in; `Err` carries the connection.close of a refusal.
    async fn login(
        addr: std::net::SocketAddr,
        user: &str,
        pass: &str,
    ) -> Result<Client, raw::Close> {
        let stream = TcpStream::connect(addr).await.expect("tcp connect");
        stream.set_nodelay(true).ok();
        let (r, w) = stream.into_split();
        let mut c = Client {
            r,
            w: Some(w),
            buf: Vec::new(),
        };
        c.send(raw::PROTOCOL_HEADER).await;
        c.expect(10, 10).await;
        let mut a = client_properties();
        a.extend(raw::shortstr("PLAIN"));
        a.extend(raw::longstr(format!("\0{user}\0{pass}").as_bytes()));
        a.extend(raw::shortstr("en_US"));
        c.send(&raw::method(0, 10, 11, &a)).await;
        let f = c.method().await.expect("answer to start-ok");
        if f.method() == Some((10, 50)) {
            return Err(raw::parse_close(&f));
        }
        assert_eq!(f.method(), Some((10, 30)), "expected tune, got {f:?}");
        // Accept the server's channel_max and frame_max, no heartbeats.
        let mut t = f.payload[4..10].to_vec();
        t.extend_from_slice(&0u16.to_be_bytes());
        c.send(&raw::method(0, 10, 31, &t)).await;
        let mut o = raw::shortstr("/");
        o.extend(raw::shortstr(""));
        o.push(0);
        c.send(&raw::method(0, 10, 40, &o)).await;
        c.expect(10, 41).await;
        Ok(c)
    }

    async fn open(addr: std::net::SocketAddr) -> Client {
        let mut c = Self::login(addr, "guest", "guest").await.expect("login");
        c.send(&raw::channel_open(1)).await;
        c.expect(20, 11).await;
        c
    }

    async fn send(&mut self, bytes: &[u8]) {
        let w = self.w.as_mut().expect("writer taken");
        w.write_all(bytes).await.expect("write");
    }

    /// Hands the writing half to another task.
    fn take_writer(&mut self) -> OwnedWriteHalf {
        self.w.take().expect("writer taken")
    }

    /// Next frame; `None` on EOF.
    async fn frame(&mut self) -> Option<Frame> {
        loop {
            if let Some((f, len)) = split_frame(&self.buf) {
                self.buf.drain(..len);
                return Some(f);
            }
            let mut chunk = [0u8; 16384];
            match self.r.read(&mut chunk).await {
                Ok(0) | Err(_) => return None,
                Ok(n) => self.buf.extend_from_slice(&chunk[..n]),
            }
        }
    }

    /// Next method frame (heartbeats and content skipped).
    async fn method(&mut self) -> Option<Frame> {
        loop {
            let f = self.frame().await?;
            if f.kind == raw::FRAME_METHOD {
                return Some(f);
            }
        }
    }

    /// Reads until method `class.method` arrives; panics after OP_TIMEOUT.
    async fn expect(&mut self, class: u16, method: u16) -> Frame {
        within(&format!("method {class}.{method}"), async {
            loop {
                let f = self
                    .method()
                    .await
                    .unwrap_or_else(|| panic!("EOF waiting for {class}.{method}"));
                if f.method() == Some((class, method)) {
                    return f;
                }
                assert_ne!(
                    f.method(),
                    Some((10, 50)),
                    "connection closed: {:?}",
                    raw::parse_close(&f)
                );
            }
        })
        .await
    }
}

/// basic.publish + header + body (one frame) of `body` to the default
/// exchange, routing key `key`, on channel 1.
fn publish_frames(key: &str, body: &[u8]) -> Vec<u8> {
    weir_tests::hardening::publish_frames(1, "", key, body)
}

/// basic.consume on channel 1, manual ack.
fn consume_frame(queue: &str) -> Vec<u8> {
    let mut a = vec![0, 0];
    a.extend(raw::shortstr(queue));
    a.extend(raw::shortstr("stalled"));
    a.push(0); // no-local, no-ack, exclusive, no-wait all off
    a.extend_from_slice(&0u32.to_be_bytes());
    raw::method(1, 60, 20, &a)
}

/// Finding 6: past the memory watermark, publishers get connection.blocked
/// and are no longer read; a consumer still drains the queue, and once
/// memory falls the publisher gets connection.unblocked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_alarm_blocks_publishers_and_consumers_still_drain() {
    let b = Broker::start_with(&["--memory-limit", "96MB"]);
    let admin = connect(&b.url()).await;
    let ach = admin.create_channel().await.expect("channel");
    declare_queue(&ach, "mem").await;

    let mut reader = Client::open(b.addr()).await;
    let body = vec![7u8; 64 * 1024];
    let batch: Vec<u8> = (0..16).flat_map(|_| publish_frames("mem", &body)).collect();
    // Write until the broker stops reading us; read until it says why.
    let mut w = reader.take_writer();
    let writer = tokio::spawn(async move {
        // 1 GB at most: far past the 96 MB watermark.
        for _ in 0..1000 {
            if w.write_all(&batch).await.is_err() {
                break;
            }
        }
        w
    });
    let blocked = reader.expect(10, 60).await;
    let reason = String::from_utf8_lossy(&blocked.payload[5..]).into_owned();
    assert_eq!(reason, "low on memory");
    assert!(b.wait_for_log("memory alarm set", OP_TIMEOUT));

    // The publisher is no longer read: the queue stops growing.
    let mut last = queue_len(&ach, "mem").await;
    let mut stable = 0;
    let deadline = Instant::now() + OP_TIMEOUT;
    while stable < 5 {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let now = queue_len(&ach, "mem").await;
        stable = if now == last { stable + 1 } else { 0 };
        last = now;
        assert!(
            Instant::now() < deadline,
            "queue kept growing while blocked"
        );
    }
    assert!(
        !writer.is_finished(),
        "the blocked publisher's writes should be stuck"
    );
    assert!(last > 0);

    // A consumer connection is still served: it drains and acks everything.
    let consumer_conn = connect(&b.url()).await;
    let cch = consumer_conn.create_channel().await.expect("channel");
    cch.basic_qos(100, BasicQosOptions::default())
        .await
        .expect("qos");
    let mut consumer = cch
        .basic_consume(
            "mem".into(),
            "drain".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect("consume");
    for _ in 0..last {
        let d = within("a delivery while blocked", next_delivery(&mut consumer)).await;
        d.ack(BasicAckOptions::default()).await.expect("ack");
    }
    // The purge is served too (the connection only consumes).
    ach.queue_purge("mem".into(), QueuePurgeOptions::default())
        .await
        .expect("purge");
    // Memory falls (queue drained, heap trimmed): unblocked. Meanwhile the
    // publisher's writes are read again, so cancel the consumer's queue
    // first so they do not refill memory: delete the queue.
    cch.close(200, "bye".into()).await.ok();
    ach.queue_delete("mem".into(), Default::default())
        .await
        .expect("delete");
    within("connection.unblocked", reader.expect(10, 61)).await;
    assert!(b.wait_for_log("memory alarm cleared", OP_TIMEOUT));
    writer.abort();
}

/// Finding 5: with less free disk than the watermark, publishers get
/// connection.blocked ("low on disk space") and are not read after the
/// publish in hand; consumers, acks and purges keep working.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disk_alarm_blocks_publishers_and_consumers_still_work() {
    let b = Broker::start_with(&["--disk-free-limit", "1PB"]);
    let admin = connect(&b.url()).await;
    let ach = admin.create_channel().await.expect("channel");
    declare_durable(&ach, "disk").await;

    // The publish in hand is taken, then connection.blocked...
    let mut publisher = Client::open(b.addr()).await;
    publisher.send(&publish_frames("disk", b"x")).await;
    let blocked = publisher.expect(10, 60).await;
    assert_eq!(
        String::from_utf8_lossy(&blocked.payload[5..]),
        "low on disk space"
    );
    wait_until("the publish in hand", OP_TIMEOUT, || async {
        queue_len(&ach, "disk").await == 1
    })
    .await;
    // ...then the publisher is no longer read.
    let second: Vec<u8> = (0..10).flat_map(|_| publish_frames("disk", b"y")).collect();
    publisher.send(&second).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        queue_len(&ach, "disk").await,
        1,
        "blocked publisher was read"
    );

    // Consumers and acks work.
    let cch = admin.create_channel().await.expect("channel");
    let mut consumer = cch
        .basic_consume(
            "disk".into(),
            "c".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect("consume");
    let d = within(
        "a delivery during the disk alarm",
        next_delivery(&mut consumer),
    )
    .await;
    assert_eq!(&d.data[..], b"x");
    d.ack(BasicAckOptions::default()).await.expect("ack");
    cch.close(200, "bye".into()).await.expect("close");
    let purged = ach
        .queue_purge("disk".into(), QueuePurgeOptions::default())
        .await
        .expect("purge during the disk alarm");
    assert_eq!(purged, 0);
}

/// Finding 7: a queued one-byte message must not keep alive the socket read
/// buffer it arrived in (old code: ≈ 240 KB per message when each was
/// followed by a 120 KB unroutable one).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_message_pins_only_its_own_bytes() {
    const N: usize = 3000;
    let b = Broker::start_with(&["--memory-limit", "8GB"]);
    let admin = connect(&b.url()).await;
    let ach = admin.create_channel().await.expect("channel");
    declare_queue(&ach, "small").await;
    let mut c = Client::open(b.addr()).await;
    let big = vec![1u8; 120 * 1024];
    let mut pair = publish_frames("small", b"s");
    pair.extend(publish_frames("nowhere", &big));
    // Warm up the broker's buffers before the baseline.
    c.send(&publish_frames("nowhere", &big)).await;
    let before = broker_rss(&b);
    for _ in 0..N {
        c.send(&pair).await;
    }
    wait_until(
        "every small message queued",
        Duration::from_secs(60),
        || async { queue_len(&ach, "small").await as usize == N },
    )
    .await;
    let after = broker_rss(&b);
    let per_message = after.saturating_sub(before) / N as u64;
    eprintln!("RSS {before} -> {after}: {per_message} bytes per queued 1-byte message");
    assert!(
        per_message < 4096,
        "{per_message} bytes of RSS per queued 1-byte message"
    );
}

/// Finding 8: a consumer with unlimited prefetch that stops reading its
/// socket is handed only a bounded number of messages: the broker's memory
/// stays bounded and the rest of the queue stays available to others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_unlimited_consumer_holds_bounded_memory() {
    const N: usize = 10_000;
    let b = Broker::start_with(&["--memory-limit", "8GB", "--fsync", "false"]);
    let admin = connect(&b.url()).await;
    let ach = confirm_channel(&admin).await;
    declare_durable(&ach, "deep").await;
    let body = vec![3u8; 10 * 1024];
    for _ in 0..N / 500 {
        let mut confirms = Vec::new();
        for _ in 0..500 {
            confirms.push(
                ach.basic_publish(
                    "".into(),
                    "deep".into(),
                    Default::default(),
                    &body,
                    persistent(),
                )
                .await
                .expect("publish"),
            );
        }
        for c in confirms {
            assert!(c.await.expect("confirm").is_ack(), "publish nacked");
        }
    }
    assert_eq!(queue_len(&ach, "deep").await as usize, N);
    let before = broker_rss(&b);

    // prefetch 0 (unlimited), manual ack, and never read the socket again.
    let mut stalled = Client::open(b.addr()).await;
    stalled.send(&consume_frame("deep")).await;
    // Let the broker hand it what it will, then measure.
    wait_until("deliveries to stop", OP_TIMEOUT, || async {
        let a = queue_len(&ach, "deep").await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        a == queue_len(&ach, "deep").await && a < N as u32
    })
    .await;
    let after = broker_rss(&b);
    let left = queue_len(&ach, "deep").await;
    eprintln!(
        "stalled consumer: RSS {before} -> {after}, {} of {N} messages left in the queue",
        left
    );
    assert!(
        after.saturating_sub(before) < 48 << 20,
        "RSS grew by {} bytes for a consumer that reads nothing",
        after - before
    );
    assert!(
        left as usize > N / 2,
        "the stalled consumer took {} messages",
        N as u32 - left
    );

    // Another consumer is served from the rest of the queue (each delivery
    // bounded by OP_TIMEOUT; the time taken is printed, not asserted).
    let other = connect(&b.url()).await;
    let och = other.create_channel().await.expect("channel");
    och.basic_qos(50, BasicQosOptions::default())
        .await
        .expect("qos");
    let mut c = och
        .basic_consume(
            "deep".into(),
            "other".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect("consume");
    let started = Instant::now();
    for _ in 0..200 {
        let d = within("a delivery to the second consumer", next_delivery(&mut c)).await;
        d.ack(BasicAckOptions::default()).await.expect("ack");
    }
    eprintln!("second consumer: 200 messages in {:?}", started.elapsed());
    drop(stalled);
}

/// Finding 9 (stall inside one frame): a client that stops in the middle of
/// a large frame is closed after the partial-content timeout and its buffer
/// is freed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_stalled_mid_frame_is_closed_after_the_timeout() {
    // Segments large enough for a 48 MB message.
    let b = Broker::start_with(&[
        "--partial-content-timeout",
        "2",
        "--frame-max",
        "67108864",
        "--segment-mb",
        "256",
        "--memory-limit",
        "8GB",
    ]);
    let mut c = Client::open(b.addr()).await;
    let before = broker_rss(&b);
    // One 48 MB body frame announced; 40 MB of it sent.
    let mut head = raw::basic_publish(1, "", "nowhere");
    head.extend(raw::content_header(1, 48 << 20));
    head.push(raw::FRAME_BODY);
    head.extend_from_slice(&1u16.to_be_bytes());
    head.extend_from_slice(&(48u32 << 20).to_be_bytes());
    c.send(&head).await;
    let chunk = vec![0u8; 1 << 20];
    for _ in 0..40 {
        c.send(&chunk).await;
    }
    let started = Instant::now();
    let close = within("connection.close of the stalled client", c.expect(10, 50)).await;
    let close = raw::parse_close(&close);
    assert_eq!(close.code, 506, "{close:?}");
    assert!(started.elapsed() >= Duration::from_secs(1));
    c.send(&raw::method(0, 10, 51, &[])).await;
    // The broker is still healthy and lets go of the buffer.
    assert_broker_healthy(&b.url()).await;
    let peak_guess = before + (40 << 20);
    wait_until("RSS to drop", OP_TIMEOUT, || async {
        broker_rss(&b) < peak_guess - (20 << 20)
    })
    .await;
}

/// Finding 9: clients that each sent most of a large multi-frame message
/// and stopped are closed after the partial-content timeout, and the broker
/// lets go of their buffers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_stalled_mid_message_are_closed_and_memory_returns() {
    const CLIENTS: usize = 10;
    let b = Broker::start_with(&["--partial-content-timeout", "2", "--memory-limit", "8GB"]);
    let before = broker_rss(&b);
    let mut clients = Vec::new();
    for _ in 0..CLIENTS {
        let mut c = Client::open(b.addr()).await;
        let mut head = raw::basic_publish(1, "", "nowhere");
        head.extend(raw::content_header(1, 12 << 20));
        c.send(&head).await;
        // 10 MB of the announced 12 MB, in frames of frame_max.
        let frame = raw::body(1, &vec![0u8; 131_072 - 8]);
        let frames = (10 << 20) / (131_072 - 8);
        for _ in 0..frames {
            c.send(&frame).await;
        }
        clients.push(c);
    }
    let held = broker_rss(&b);
    eprintln!("{CLIENTS} stalled clients: RSS {before} -> {held}");
    for c in &mut clients {
        let close = within("connection.close of a stalled client", c.expect(10, 50)).await;
        assert_eq!(raw::parse_close(&close).code, 506);
    }
    drop(clients);
    wait_until("RSS to drop", OP_TIMEOUT, || async {
        broker_rss(&b) < before + ((CLIENTS as u64) << 20) * 10 / 2
    })
    .await;
    assert_broker_healthy(&b.url()).await;
}

/// Finding 11: failed logins from one address are slowed (a growing delay
/// before the 403), while a correct login is not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_logins_are_slowed_and_good_ones_are_not() {
    let b = Broker::start();
    let started = Instant::now();
    for _ in 0..5 {
        let refused = Client::login(b.addr(), "guest", "wrong").await;
        let close = match refused {
            Err(c) => c,
            Ok(_) => panic!("wrong password accepted"),
        };
        assert_eq!(close.code, 403);
        assert!(close.text.starts_with("ACCESS_REFUSED"), "{close:?}");
    }
    let took = started.elapsed();
    // 100 + 200 + 400 + 800 + 1600 ms documented; a lower bound only.
    assert!(
        took >= Duration::from_millis(3000),
        "5 failed logins took only {took:?}"
    );
    // While a sixth guess waits out its delay, a correct login goes through.
    let addr = b.addr();
    let guess = tokio::spawn(async move { Client::login(addr, "guest", "wrong").await.is_err() });
    let t = Instant::now();
    let ok = Client::login(b.addr(), "guest", "guest").await;
    assert!(ok.is_ok(), "correct login refused");
    assert!(
        t.elapsed() < Duration::from_secs(1),
        "a correct login waited {:?}",
        t.elapsed()
    );
    assert!(guess.await.expect("guess task"), "sixth guess accepted");
}

/// Finding 5: the disk alarm clears by itself once space is freed, and the
/// blocked publisher gets connection.unblocked and is read again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disk_alarm_clears_when_space_returns() {
    let Some(fs) = Tmpfs::mount("64m") else {
        return;
    };
    let data = fs.path().join("data");
    std::fs::create_dir_all(&data).expect("data dir");
    let b = Broker::start_in_with(&data, &["--segment-mb", "1", "--disk-free-limit", "24MB"]);
    let admin = connect(&b.url()).await;
    let ach = admin.create_channel().await.expect("channel");
    declare_durable(&ach, "space").await;
    // Take the free space below the watermark with a file of our own.
    let hog = fs.path().join("hog");
    std::fs::write(&hog, vec![0u8; 48 << 20]).expect("hog file");
    assert!(b.wait_for_log("disk alarm set", OP_TIMEOUT));
    let mut publisher = Client::open(b.addr()).await;
    publisher.send(&publish_frames("space", b"a")).await;
    publisher.expect(10, 60).await;
    publisher.send(&publish_frames("space", b"b")).await;
    // Space returns: the alarm clears, the publisher is unblocked and read.
    std::fs::remove_file(&hog).expect("remove hog");
    within("connection.unblocked", publisher.expect(10, 61)).await;
    assert!(b.wait_for_log("disk alarm cleared", OP_TIMEOUT));
    wait_until("the held publish", OP_TIMEOUT, || async {
        queue_len(&ach, "space").await == 2
    })
    .await;
}
