//! Protocol features without a test elsewhere: heartbeats, channel_max and
//! frame_max negotiation, AMQPLAIN, basic.recover's 540, and configuration
//! through the environment and a TOML file. (What prefetch-size, global qos,
//! channel.flow and basic.recover do to deliveries is tested in process, in
//! `engine/tests/client.rs`.)

use lapin::options::*;
use lapin::types::FieldTable;
use std::time::Duration;
use weir_tests::raw::{self, longstr, method, shortstr, Close, RawClient, PROTOCOL_HEADER};
use weir_tests::*;

// ---------------------------------------------------------------------------
// raw frames and handshakes not in the shared helpers

/// What the client answers in connection.tune-ok.
#[derive(Clone, Copy)]
struct TuneOk {
    channel_max: u16,
    frame_max: u32,
    heartbeat: u16,
}

/// The server's offer in connection.tune.
#[derive(Debug, Clone, Copy)]
struct Offer {
    channel_max: u16,
    frame_max: u32,
    heartbeat: u16,
}

/// A raw handshake on vhost `/` with any mechanism and response, answering
/// connection.tune with `tune(offer)`. Returns the server's offer, or the
/// connection.close the server sent instead of the next step.
async fn handshake_raw(
    c: &mut RawClient,
    mechanism: &str,
    response: &[u8],
    tune: impl FnOnce(Offer) -> TuneOk,
) -> Result<Offer, Close> {
    c.send(PROTOCOL_HEADER).await;
    c.expect_method(10, 10).await; // start
    let mut a = 0u32.to_be_bytes().to_vec(); // client-properties: empty table
    a.extend(shortstr(mechanism));
    a.extend(longstr(response));
    a.extend(shortstr("en_US"));
    c.send(&method(0, 10, 11, &a)).await;
    let f = next_or_close(c).await?;
    assert_eq!(
        f.method(),
        Some((10, 30)),
        "expected connection.tune: {f:?}"
    );
    let t = &f.payload[4..];
    let offer = Offer {
        channel_max: u16::from_be_bytes([t[0], t[1]]),
        frame_max: u32::from_be_bytes([t[2], t[3], t[4], t[5]]),
        heartbeat: u16::from_be_bytes([t[6], t[7]]),
    };
    let ok = tune(offer);
    let mut a = ok.channel_max.to_be_bytes().to_vec();
    a.extend_from_slice(&ok.frame_max.to_be_bytes());
    a.extend_from_slice(&ok.heartbeat.to_be_bytes());
    c.send(&method(0, 10, 31, &a)).await;
    c.frame_max = ok.frame_max;
    let mut o = shortstr("/");
    o.extend(shortstr(""));
    o.push(0);
    // The server may already have closed after tune-ok.
    let _ = c.try_send(&method(0, 10, 40, &o)).await;
    let f = next_or_close(c).await?;
    assert_eq!(f.method(), Some((10, 41)), "expected open-ok: {f:?}");
    Ok(offer)
}

/// The next method frame; a connection.close (answered) or EOF as `Err`.
async fn next_or_close(c: &mut RawClient) -> Result<raw::Frame, Close> {
    let Some(f) = c.read_method().await else {
        return Err(Close {
            channel: 0,
            code: 0,
            text: "EOF".into(),
            class_id: 0,
            method_id: 0,
        });
    };
    if f.method() == Some((10, 50)) {
        let close = raw::parse_close(&f);
        let _ = c.try_send(&method(0, 10, 51, &[])).await;
        return Err(close);
    }
    Ok(f)
}

/// PLAIN handshake as guest/guest with the given tune-ok values.
async fn open_tuned(broker: &Broker, ok: TuneOk) -> Result<RawClient, Close> {
    let mut c = RawClient::connect(broker.addr()).await;
    handshake_raw(&mut c, "PLAIN", b"\0guest\0guest", |_| ok).await?;
    Ok(c)
}

/// An AMQPLAIN response: a field table without its length prefix.
fn amqplain(login: &str, password: &str) -> Vec<u8> {
    let mut r = shortstr("LOGIN");
    r.push(b'S');
    r.extend(longstr(login.as_bytes()));
    r.extend(shortstr("PASSWORD"));
    r.push(b'S');
    r.extend(longstr(password.as_bytes()));
    r
}

fn heartbeat_frame() -> Vec<u8> {
    raw::frame(raw::FRAME_HEARTBEAT, 0, &[])
}

/// basic.get with no-ack.
fn basic_get_no_ack(ch: u16, queue: &str) -> Vec<u8> {
    let mut a = vec![0, 0];
    a.extend(shortstr(queue));
    a.push(1);
    method(ch, 60, 70, &a)
}

/// Reads the content (header and body frames) following a deliver/get-ok;
/// checks every frame respects the client's frame_max.
async fn read_content(c: &mut RawClient) -> Vec<u8> {
    let h = c
        .read_frame()
        .await
        .expect("EOF waiting for content header");
    assert_eq!(
        h.kind,
        raw::FRAME_HEADER,
        "expected a content header: {h:?}"
    );
    let size = u64::from_be_bytes(h.payload[4..12].try_into().unwrap()) as usize;
    let mut body = Vec::with_capacity(size);
    while body.len() < size {
        let b = c.read_frame().await.expect("EOF waiting for a body frame");
        assert_eq!(b.kind, raw::FRAME_BODY, "expected a body frame: {b:?}");
        assert!(
            b.payload.len() + 8 <= c.frame_max as usize,
            "body frame of {} bytes exceeds the negotiated frame_max {}",
            b.payload.len() + 8,
            c.frame_max
        );
        body.extend_from_slice(&b.payload);
    }
    assert_eq!(body.len(), size);
    body
}

// ---------------------------------------------------------------------------
// 1. heartbeats

/// The one black-box heartbeat test: the adapter's timers are tested on a
/// manual clock (`protocols/tests/amqp_connection.rs`); this shows the
/// session drives them: bytes read keep a peer alive, heartbeats go out, and
/// a peer that falls silent is dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeats_keep_a_client_alive_and_a_silent_one_is_dropped() {
    let broker = Broker::start();
    let mut c = open_tuned(
        &broker,
        TuneOk {
            channel_max: 2047,
            frame_max: 131_072,
            heartbeat: 1,
        },
    )
    .await
    .expect("handshake");
    // Pacing, not synchronization: a heartbeat every 300 ms for ~2.7 s,
    // longer than the 2 s after which a silent peer is dropped.
    let mut every = tokio::time::interval(Duration::from_millis(300));
    for _ in 0..10 {
        every.tick().await;
        c.try_send(&heartbeat_frame())
            .await
            .expect("the server hung up on a client that sends heartbeats");
    }
    // Still connected and usable (server heartbeats in between are skipped).
    c.open_channel(1).await;
    c.send(&raw::queue_declare(1, "")).await;
    c.expect_method(50, 11).await;
    assert!(!broker.run_logs().contains("missed heartbeats"));

    // Now send nothing more; keep reading until the server hangs up.
    let mut heartbeats = 0;
    let mut others = Vec::new();
    let outcome = tokio::time::timeout(Duration::from_secs(20), async {
        while let Some(f) = c.read_frame().await {
            if f.kind == raw::FRAME_HEARTBEAT {
                assert_eq!(f.channel, 0, "heartbeat on a non-zero channel");
                heartbeats += 1;
            } else {
                others.push(f);
            }
        }
    })
    .await;
    assert!(
        outcome.is_ok(),
        "a client negotiating heartbeat=1 and sending nothing was still connected after 20 s \
         ({heartbeats} heartbeats received)"
    );
    assert!(
        heartbeats >= 1,
        "the server sent no heartbeat before disconnecting; other frames: {others:?}"
    );
    assert!(
        broker.wait_for_log("missed heartbeats", OP_TIMEOUT),
        "the disconnect was not for missed heartbeats"
    );
}

/// A client may have written frames behind its connection.close before it
/// reads the close-ok (amqplib flushes its channels' frames after it). The
/// server answers close-ok and reads (and drops) the rest until the client
/// closes, as RabbitMQ does: closing a socket with unread input resets the
/// connection, and the client's writes (or its read of the close-ok) fail
/// with ECONNRESET. 32 MB after the close is more than loopback's socket
/// buffers hold, so without the drain the write cannot complete.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frames_behind_connection_close_do_not_reset_the_close_ok() {
    let broker = Broker::start();
    let mut c = RawClient::open(broker.addr()).await;
    c.open_channel(1).await;
    let mut close_args = 200u16.to_be_bytes().to_vec();
    close_args.extend(shortstr("bye"));
    close_args.extend_from_slice(&[0, 0, 0, 0]);
    let mut out = method(0, 10, 50, &close_args);
    let mut publish = raw::basic_publish(1, "", "nowhere");
    publish.extend(raw::content_header(1, 1000));
    publish.extend(raw::body(1, &[b'x'; 1000]));
    while out.len() < 32 << 20 {
        out.extend_from_slice(&publish);
    }
    c.try_send(&out)
        .await
        .expect("the server reset the connection while the client still wrote behind its close");
    c.expect_method(10, 51).await;
}

// ---------------------------------------------------------------------------
// 2. channel_max / frame_max negotiation

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn channel_above_negotiated_channel_max_is_504() {
    let broker = Broker::start();
    let mut c = RawClient::connect(broker.addr()).await;
    let offer = handshake_raw(&mut c, "PLAIN", b"\0guest\0guest", |o| TuneOk {
        channel_max: 5,
        frame_max: o.frame_max,
        heartbeat: 0,
    })
    .await
    .expect("handshake");
    assert_eq!(offer.channel_max, 2047);
    assert_eq!(offer.frame_max, 131_072);
    assert_eq!(offer.heartbeat, 60);
    c.open_channel(5).await;
    c.send(&raw::channel_open(6)).await;
    let close = c
        .expect_connection_close()
        .await
        .expect("connection.close for channel 6 > channel_max 5");
    assert_eq!(close.code, 504, "{close:?}");
    assert_eq!((close.class_id, close.method_id), (20, 10), "{close:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn negotiated_frame_max_is_enforced_both_ways() {
    let broker = Broker::start();
    let mut c = open_tuned(
        &broker,
        TuneOk {
            channel_max: 0,
            frame_max: 4096,
            heartbeat: 0,
        },
    )
    .await
    .expect("handshake");
    c.open_channel(1).await;
    c.send(&raw::queue_declare(1, "fm")).await;
    c.expect_method(50, 11).await;

    // A 10 000-byte message in frames that fit 4096 is accepted...
    let body: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
    let mut m = raw::basic_publish(1, "", "fm");
    m.extend(raw::content_header(1, body.len() as u64));
    for part in body.chunks(4088) {
        m.extend(raw::body(1, part));
    }
    c.send(&m).await;
    // ...and comes back split to the client's frame_max too.
    c.send(&basic_get_no_ack(1, "fm")).await;
    c.expect_method(60, 71).await;
    assert_eq!(read_content(&mut c).await, body);

    // A body frame of 5000 bytes exceeds the negotiated 4096: 501.
    let mut m = raw::basic_publish(1, "", "fm");
    m.extend(raw::content_header(1, 5000));
    m.extend(raw::body(1, &[7u8; 5000]));
    let _ = c.try_send(&m).await;
    let close = c
        .expect_connection_close()
        .await
        .expect("connection.close for a frame over frame_max");
    assert_eq!(close.code, 501, "{close:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frame_max_outside_the_allowed_range_is_530() {
    let broker = Broker::start();
    for frame_max in [1024, 4095, 131_073] {
        let r = open_tuned(
            &broker,
            TuneOk {
                channel_max: 0,
                frame_max,
                heartbeat: 0,
            },
        )
        .await;
        let close = match r {
            Ok(_) => panic!("tune-ok frame_max {frame_max} was accepted"),
            Err(c) => c,
        };
        assert_eq!(close.code, 530, "frame_max {frame_max}: {close:?}");
        assert_eq!(
            (close.class_id, close.method_id),
            (10, 31),
            "frame_max {frame_max}: {close:?}"
        );
    }
    // The boundary itself is fine.
    let mut c = open_tuned(
        &broker,
        TuneOk {
            channel_max: 0,
            frame_max: 4096,
            heartbeat: 0,
        },
    )
    .await
    .expect("frame_max 4096 accepted");
    c.open_channel(1).await;
}

// ---------------------------------------------------------------------------
// 3. AMQPLAIN

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqplain_login() {
    let broker = Broker::start();
    let tune = |o: Offer| TuneOk {
        channel_max: o.channel_max,
        frame_max: o.frame_max,
        heartbeat: 0,
    };

    let mut c = RawClient::connect(broker.addr()).await;
    handshake_raw(&mut c, "AMQPLAIN", &amqplain("guest", "guest"), tune)
        .await
        .expect("AMQPLAIN guest/guest");
    c.open_channel(1).await;
    c.send(&raw::queue_declare(1, "")).await;
    c.expect_method(50, 11).await;

    for response in [
        amqplain("guest", "wrong"),
        amqplain("nobody", "guest"),
        // LOGIN without PASSWORD.
        {
            let mut r = shortstr("LOGIN");
            r.push(b'S');
            r.extend(longstr(b"guest"));
            r
        },
    ] {
        let mut c = RawClient::connect(broker.addr()).await;
        let close = handshake_raw(&mut c, "AMQPLAIN", &response, tune)
            .await
            .expect_err("bad AMQPLAIN credentials accepted");
        assert_eq!(close.code, 403, "{close:?}");
        assert_eq!((close.class_id, close.method_id), (10, 11), "{close:?}");
    }
}

// ---------------------------------------------------------------------------
// 4. basic.recover

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recover_without_requeue_is_540() {
    let broker = Broker::start();
    let mut c = RawClient::open(broker.addr()).await;
    c.open_channel(1).await;
    c.send(&method(1, 60, 110, &[0])).await;
    let close = c
        .expect_connection_close()
        .await
        .expect("connection.close for basic.recover(requeue=false)");
    assert_eq!(close.code, 540, "{close:?}");
    assert_eq!((close.class_id, close.method_id), (60, 110), "{close:?}");
}

// ---------------------------------------------------------------------------
// 5. configuration

/// `<dir>/log` holds at least one segment file.
fn has_segments(dir: &std::path::Path) -> bool {
    std::fs::read_dir(dir.join("log"))
        .map(|rd| {
            rd.filter_map(Result::ok)
                .any(|e| e.file_name().to_string_lossy().ends_with(".seg"))
        })
        .unwrap_or(false)
}

/// A durable queue and a persistent message, so the store must write.
async fn write_something(url: &str) {
    let conn = connect(url).await;
    let ch = confirm_channel(&conn).await;
    ch.queue_declare(
        "cfg-durable".into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .unwrap();
    publish_confirmed(&ch, "", "cfg-durable", b"kept", persistent()).await;
    conn.close(200, "bye".into()).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settings_from_environment_variables() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("from-env");
    let env_dir = dir.clone();
    let broker = Broker::start_custom(&dir, move |port, cmd| {
        cmd.env("WEIR_AMQP_LISTEN", format!("127.0.0.1:{port}"))
            .env("WEIR_DATA_DIR", &env_dir)
            .current_dir(env_dir.parent().unwrap());
    });
    assert_broker_healthy(&broker.url()).await;
    write_something(&broker.url()).await;
    assert!(
        has_segments(&dir),
        "no log segment in WEIR_DATA_DIR {}",
        dir.display()
    );
    assert!(
        !tmp.path().join("weir-data").exists(),
        "the default ./weir-data was used"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settings_and_users_from_a_config_file() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("from-file");
    let file = tmp.path().join("weir.toml");
    let (f, d) = (file.clone(), dir.clone());
    let broker = Broker::start_custom(&dir, move |port, cmd| {
        std::fs::write(
            &f,
            format!(
                "amqp_listen = \"127.0.0.1:{port}\"\n\
                 data_dir = {:?}\n\
                 default_pass = \"s3cret\"\n\
                 \n\
                 [[users]]\n\
                 name = \"alice\"\n\
                 password = \"wonderland\"\n",
                d.display().to_string()
            ),
        )
        .unwrap();
        cmd.arg("--config").arg(&f).current_dir(f.parent().unwrap());
    });

    assert_broker_healthy(&broker.url_with("guest", "s3cret", "%2f")).await;
    assert_broker_healthy(&broker.url_with("alice", "wonderland", "%2f")).await;
    for (user, pass) in [("guest", "guest"), ("alice", "guest"), ("alice", "s3cret")] {
        let mut c = RawClient::connect(broker.addr()).await;
        let close = c
            .handshake(user, pass, "/")
            .await
            .expect_err("wrong password accepted");
        assert_eq!(close.code, 403, "{user}/{pass}: {close:?}");
    }
    write_something(&broker.url_with("alice", "wonderland", "%2f")).await;
    assert!(
        has_segments(&dir),
        "no log segment in the config's data_dir {}",
        dir.display()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn config_file_with_an_unknown_key_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("typo.toml");
    std::fs::write(
        &file,
        format!(
            "amqp_listen = \"127.0.0.1:{}\"\ndata_dir = {:?}\nheartbeat_secs = 5\n",
            free_port(),
            tmp.path().join("data").display().to_string()
        ),
    )
    .unwrap();
    let (status, output) = run_weir_to_exit(|cmd| {
        cmd.arg("--config").arg(&file).current_dir(tmp.path());
    });
    assert!(
        !status.success(),
        "weir accepted a config with an unknown key\n{output}"
    );
    assert!(
        output.contains(&file.display().to_string()),
        "the error does not name the file {}:\n{output}",
        file.display()
    );
    assert!(
        output.contains("heartbeat_secs"),
        "the error does not name the unknown key:\n{output}"
    );
    assert!(!output.contains("AMQP listener ready"), "{output}");
}
