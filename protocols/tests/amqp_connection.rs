//! The AMQP adapter driven in process, through its public API only: bytes in,
//! events and bytes out, time as plain `Instant` values the test advances.
//! No socket, no sleep: each test runs in microseconds.
//!
//! White-box checks (buffer ownership, partial-content accounting, nesting
//! bounds) live next to the code, in `src/amqp/connection/tests.rs`.

use amq_protocol::frame::{gen_frame, parse_frame, AMQPContentHeader, AMQPFrame};
use amq_protocol::protocol::{basic, channel, connection, AMQPClass};
use amq_protocol::types::FieldTable;
use bytes::BytesMut;
use std::time::{Duration, Instant};
use weir_protocols::amqp::connection::{Timeout, CLOSE_TIMEOUT, HANDSHAKE_TIMEOUT};
use weir_protocols::amqp::{codec, reply, Connection, Event, ServerConfig};

// ---------------------------------------------------------------- helpers

fn frame(f: AMQPFrame) -> Vec<u8> {
    cookie_factory::gen(gen_frame(&f), Vec::new())
        .expect("generating into a Vec")
        .0
}

fn method(ch: u16, m: AMQPClass) -> Vec<u8> {
    frame(AMQPFrame::Method(ch, m))
}

fn raw_frame(kind: u8, ch: u16, payload: &[u8]) -> Vec<u8> {
    let mut v = vec![kind];
    v.extend_from_slice(&ch.to_be_bytes());
    v.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    v.extend_from_slice(payload);
    v.push(codec::FRAME_END);
    v
}

/// Every frame the server queued (and empties `out`).
fn written(c: &mut Connection) -> Vec<AMQPFrame> {
    let buf = c.out().split().freeze();
    let mut rest = &buf[..];
    let mut frames = Vec::new();
    while !rest.is_empty() {
        let (r, f) = parse_frame(rest).expect("the server wrote a valid frame");
        frames.push(f);
        rest = r;
    }
    frames
}

/// The reply code of the connection.close the server wrote, if any.
fn connection_close(frames: &[AMQPFrame]) -> Option<u16> {
    frames.iter().find_map(|f| match f {
        AMQPFrame::Method(0, AMQPClass::Connection(connection::AMQPMethod::Close(c))) => {
            Some(c.reply_code)
        }
        _ => None,
    })
}

/// The reply code of the channel.close the server wrote on `ch`, if any.
fn channel_close(frames: &[AMQPFrame], ch: u16) -> Option<u16> {
    frames.iter().find_map(|f| match f {
        AMQPFrame::Method(c, AMQPClass::Channel(channel::AMQPMethod::Close(cl))) if *c == ch => {
            Some(cl.reply_code)
        }
        _ => None,
    })
}

fn start_ok(user: &str, pass: &str) -> Vec<u8> {
    method(
        0,
        AMQPClass::Connection(connection::AMQPMethod::StartOk(connection::StartOk {
            client_properties: FieldTable::default(),
            mechanism: "PLAIN".into(),
            response: format!("\0{user}\0{pass}").as_str().into(),
            locale: "en_US".into(),
        })),
    )
}

fn tune_ok(frame_max: u32, heartbeat: u16) -> Vec<u8> {
    method(
        0,
        AMQPClass::Connection(connection::AMQPMethod::TuneOk(connection::TuneOk {
            channel_max: 10,
            frame_max,
            heartbeat,
        })),
    )
}

fn open_vhost() -> Vec<u8> {
    method(
        0,
        AMQPClass::Connection(connection::AMQPMethod::Open(connection::Open {
            virtual_host: "/".into(),
        })),
    )
}

fn channel_open(ch: u16) -> Vec<u8> {
    method(
        ch,
        AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
    )
}

fn publish(ch: u16, routing_key: &str) -> Vec<u8> {
    method(
        ch,
        AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish {
            exchange: "".into(),
            routing_key: routing_key.into(),
            mandatory: false,
            immediate: false,
        })),
    )
}

fn content_header(ch: u16, body_size: u64, properties: basic::AMQPProperties) -> Vec<u8> {
    frame(AMQPFrame::Header(
        ch,
        AMQPContentHeader {
            class_id: 60,
            body_size,
            properties,
        },
    ))
}

fn body(ch: u16, bytes: &[u8]) -> Vec<u8> {
    frame(AMQPFrame::Body(ch, bytes.to_vec()))
}

/// A connection accepted at `t0`, taken through the whole handshake (the
/// client asks for `heartbeat` seconds), with its output written at `t0`.
fn open_at(t0: Instant, heartbeat: u16) -> (Connection, BytesMut) {
    let mut c = Connection::new_at(ServerConfig::default(), t0);
    let mut input = BytesMut::from(&codec::PROTOCOL_HEADER[..]);
    input.extend_from_slice(&start_ok("guest", "guest"));
    c.on_read(t0);
    assert!(matches!(c.poll(&mut input), Some(Event::Login { .. })));
    c.accept_login();
    input.extend_from_slice(&tune_ok(8192, heartbeat));
    input.extend_from_slice(&open_vhost());
    assert!(matches!(c.poll(&mut input), Some(Event::OpenVhost { .. })));
    c.accept_open();
    assert!(c.poll(&mut input).is_none());
    assert!(c.is_open());
    written(&mut c);
    c.on_write(t0);
    (c, input)
}

fn open_channel(c: &mut Connection, input: &mut BytesMut, ch: u16) {
    input.extend_from_slice(&channel_open(ch));
    assert!(matches!(c.poll(input), Some(Event::ChannelOpened(n)) if n == ch));
    written(c);
}

fn secs(s: f64) -> Duration {
    Duration::from_secs_f64(s)
}

fn is_heartbeat(frames: &[AMQPFrame]) -> bool {
    matches!(frames, [AMQPFrame::Heartbeat])
}

// ---------------------------------------------------------------- handshake

#[test]
fn handshake_reaches_open_with_the_offered_limits() {
    let t0 = Instant::now();
    let config = ServerConfig {
        frame_max: 65_536,
        channel_max: 100,
        heartbeat: 30,
        ..ServerConfig::default()
    };
    let mut c = Connection::new_at(config, t0);
    let mut input = BytesMut::from(&codec::PROTOCOL_HEADER[..]);
    assert!(c.poll(&mut input).is_none());
    match &written(&mut c)[..] {
        [AMQPFrame::Method(0, AMQPClass::Connection(connection::AMQPMethod::Start(s)))] => {
            assert_eq!((s.version_major, s.version_minor), (0, 9));
            assert_eq!(s.mechanisms.as_bytes(), b"PLAIN AMQPLAIN");
        }
        other => panic!("expected connection.start, got {other:?}"),
    }
    assert_eq!(c.poll_timeout(), Some(t0 + HANDSHAKE_TIMEOUT));

    input.extend_from_slice(&start_ok("alice", "s3cret-pw"));
    let login = c.poll(&mut input).expect("a login event");
    assert!(
        !format!("{login:?}").contains("s3cret-pw"),
        "the password is not printed: {login:?}"
    );
    let Event::Login {
        mechanism,
        username,
        password,
    } = login
    else {
        panic!("expected login, got {login:?}");
    };
    assert_eq!((mechanism.as_str(), username.as_str()), ("PLAIN", "alice"));
    let as_str: &str = &password;
    assert_eq!(as_str, "s3cret-pw");
    // Nothing is interpreted while the engine decides.
    input.extend_from_slice(&tune_ok(16_384, 10));
    assert!(c.poll(&mut input).is_none());
    c.accept_login();
    match &written(&mut c)[..] {
        [AMQPFrame::Method(0, AMQPClass::Connection(connection::AMQPMethod::Tune(t)))] => {
            assert_eq!((t.frame_max, t.channel_max, t.heartbeat), (65_536, 100, 30));
        }
        other => panic!("expected connection.tune, got {other:?}"),
    }
    // The client's tune-ok is taken now; open waits for the engine.
    input.extend_from_slice(&open_vhost());
    match c.poll(&mut input) {
        Some(Event::OpenVhost { vhost }) => assert_eq!(vhost, "/"),
        other => panic!("expected open, got {other:?}"),
    }
    assert!(!c.is_open());
    c.accept_open();
    assert!(matches!(
        &written(&mut c)[..],
        [AMQPFrame::Method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::OpenOk(_))
        )]
    ));
    assert!(c.is_open() && !c.is_closing());
    assert_eq!((c.frame_max(), c.heartbeat()), (16_384, 10));
    // The handshake timer is gone; the heartbeat timers replace it.
    assert_eq!(c.poll_timeout(), Some(t0 + secs(5.0)));
}

#[test]
fn refused_login_and_vhost_close_with_their_codes() {
    let mut c = Connection::new(ServerConfig::default());
    let mut input = BytesMut::from(&codec::PROTOCOL_HEADER[..]);
    input.extend_from_slice(&start_ok("mallory", "x"));
    assert!(matches!(c.poll(&mut input), Some(Event::Login { .. })));
    c.refuse_login("bad credentials");
    assert_eq!(
        connection_close(&written(&mut c)),
        Some(reply::ACCESS_REFUSED)
    );
    assert!(c.is_closing());

    let mut c = Connection::new(ServerConfig::default());
    let mut input = BytesMut::from(&codec::PROTOCOL_HEADER[..]);
    input.extend_from_slice(&start_ok("guest", "guest"));
    assert!(matches!(c.poll(&mut input), Some(Event::Login { .. })));
    c.accept_login();
    input.extend_from_slice(&tune_ok(8192, 0));
    input.extend_from_slice(&open_vhost());
    assert!(matches!(c.poll(&mut input), Some(Event::OpenVhost { .. })));
    c.refuse_open("no access to this vhost");
    assert_eq!(connection_close(&written(&mut c)), Some(reply::NOT_ALLOWED));
}

// ---------------------------------------------------------------- timers

#[test]
fn a_heartbeat_is_sent_after_half_the_interval_without_writes() {
    let t0 = Instant::now();
    let (mut c, _) = open_at(t0, 10);
    assert_eq!(c.poll_timeout(), Some(t0 + secs(5.0)));
    c.handle_timeout(t0 + secs(4.9));
    assert!(c.out().is_empty(), "too early");
    // A write postpones it.
    c.on_write(t0 + secs(3.0));
    assert_eq!(c.poll_timeout(), Some(t0 + secs(8.0)));
    c.handle_timeout(t0 + secs(7.9));
    assert!(c.out().is_empty());
    c.handle_timeout(t0 + secs(8.0));
    assert!(is_heartbeat(&written(&mut c)));
    // One heartbeat per half interval, even before the session writes it.
    assert_eq!(c.poll_timeout(), Some(t0 + secs(13.0)));
    c.handle_timeout(t0 + secs(9.0));
    assert!(c.out().is_empty());
    assert!(c.is_open() && c.timed_out().is_none());
}

#[test]
fn no_heartbeat_timers_when_heartbeats_are_off() {
    let t0 = Instant::now();
    let (mut c, _) = open_at(t0, 0);
    assert_eq!(c.poll_timeout(), None);
    c.handle_timeout(t0 + secs(3600.0));
    assert!(c.is_open() && c.out().is_empty());
}

#[test]
fn the_peer_is_dead_after_two_intervals_without_reads() {
    let t0 = Instant::now();
    let (mut c, _) = open_at(t0, 10);
    // Our heartbeats keep going out; the peer's do not come in.
    let mut t = t0;
    while t < t0 + secs(19.0) {
        t += secs(5.0).min(t0 + secs(19.9) - t);
        c.handle_timeout(t);
        written(&mut c);
        c.on_write(t);
    }
    assert!(c.is_open(), "19.9 s of silence is not yet two intervals");
    assert_eq!(c.poll_timeout(), Some(t0 + secs(20.0)));
    c.handle_timeout(t0 + secs(20.0));
    assert!(c.is_finished());
    assert_eq!(c.timed_out(), Some(Timeout::Heartbeat));
    assert!(c.out().is_empty(), "nothing more is written to a dead peer");
    assert_eq!(c.poll_timeout(), None);
    assert_eq!(
        Timeout::Heartbeat.to_string(),
        "missed heartbeats from client"
    );
}

#[test]
fn a_read_restarts_the_peer_silence() {
    let t0 = Instant::now();
    let (mut c, mut input) = open_at(t0, 10);
    input.extend_from_slice(&raw_frame(codec::FRAME_HEARTBEAT, 0, &[]));
    c.on_read(t0 + secs(15.0));
    assert!(c.poll(&mut input).is_none());
    c.on_write(t0 + secs(15.0));
    c.handle_timeout(t0 + secs(20.0));
    assert!(c.is_open(), "last read at 15 s");
    c.on_write(t0 + secs(30.0));
    c.handle_timeout(t0 + secs(34.9));
    assert!(c.is_open());
    c.handle_timeout(t0 + secs(35.0));
    assert_eq!(c.timed_out(), Some(Timeout::Heartbeat));
}

#[test]
fn time_the_session_did_not_read_is_not_peer_silence() {
    let t0 = Instant::now();
    let (mut c, _) = open_at(t0, 10);
    c.pause_reads(t0 + secs(1.0));
    // Only the send timer runs while paused.
    c.on_write(t0 + secs(1.0));
    assert_eq!(c.poll_timeout(), Some(t0 + secs(6.0)));
    c.handle_timeout(t0 + secs(100.0));
    assert!(c.is_open(), "paused for 99 s: not the peer's fault");
    assert!(is_heartbeat(&written(&mut c)), "heartbeats still go out");
    c.on_write(t0 + secs(100.0));
    // Resumed: silence counts from the resume, once.
    c.resume_reads(t0 + secs(100.0));
    c.resume_reads(t0 + secs(110.0));
    c.on_write(t0 + secs(119.0));
    c.handle_timeout(t0 + secs(119.9));
    assert!(c.is_open());
    assert_eq!(c.poll_timeout(), Some(t0 + secs(120.0)));
    c.handle_timeout(t0 + secs(120.0));
    assert_eq!(c.timed_out(), Some(Timeout::Heartbeat));
}

#[test]
fn a_handshake_not_completed_in_time_ends_the_connection() {
    let t0 = Instant::now();
    // A client that connects and sends nothing.
    let mut c = Connection::new_at(ServerConfig::default(), t0);
    assert_eq!(c.poll_timeout(), Some(t0 + HANDSHAKE_TIMEOUT));
    c.handle_timeout(t0 + secs(9.9));
    assert!(!c.is_finished());
    c.handle_timeout(t0 + HANDSHAKE_TIMEOUT);
    assert!(c.is_finished());
    assert_eq!(c.timed_out(), Some(Timeout::Handshake));

    // One stuck waiting for the engine's login answer, after reads: the
    // timer runs from the connect, not from the last read.
    let mut c = Connection::new_at(ServerConfig::default(), t0);
    let mut input = BytesMut::from(&codec::PROTOCOL_HEADER[..]);
    input.extend_from_slice(&start_ok("guest", "guest"));
    c.on_read(t0 + secs(9.0));
    assert!(matches!(c.poll(&mut input), Some(Event::Login { .. })));
    assert!(!c.out().is_empty(), "connection.start is queued");
    c.handle_timeout(t0 + secs(10.0));
    assert_eq!(c.timed_out(), Some(Timeout::Handshake));
    assert!(c.out().is_empty(), "hung up without flushing");

    // A completed handshake disarms it.
    let (mut c, _) = open_at(t0, 0);
    c.handle_timeout(t0 + secs(60.0));
    assert!(c.is_open() && c.timed_out().is_none());
}

#[test]
fn a_close_the_peer_does_not_answer_times_out() {
    let t0 = Instant::now();
    let (mut c, mut input) = open_at(t0, 10);
    // The close starts without a time: the deadline is "now" until the
    // session's next call brings one.
    c.on_read(t0 + secs(30.0));
    c.shutdown("broker shutdown");
    assert_eq!(
        connection_close(&written(&mut c)),
        Some(reply::CONNECTION_FORCED)
    );
    assert!(c.is_closing() && !c.is_finished());
    let due = c.poll_timeout().expect("a deadline");
    assert!(due <= t0 + secs(30.0), "due at once, to be armed");
    let t1 = t0 + secs(31.0);
    c.handle_timeout(t1);
    assert!(!c.is_finished());
    assert_eq!(c.poll_timeout(), Some(t1 + CLOSE_TIMEOUT));
    // Heartbeats stop while closing; frames other than close-ok are ignored.
    c.handle_timeout(t1 + secs(4.9));
    assert!(c.out().is_empty() && !c.is_finished());
    input.extend_from_slice(&channel_open(1));
    assert!(c.poll(&mut input).is_none());
    c.handle_timeout(t1 + CLOSE_TIMEOUT);
    assert!(c.is_finished());
    assert_eq!(c.timed_out(), Some(Timeout::Close));

    // Answered in time: finished, no timeout.
    let (mut c, mut input) = open_at(t0, 0);
    c.fail(reply::INTERNAL_ERROR, "INTERNAL_ERROR - x".into(), 0, 0);
    assert_eq!(
        connection_close(&written(&mut c)),
        Some(reply::INTERNAL_ERROR)
    );
    c.handle_timeout(t0 + secs(1.0));
    input.extend_from_slice(&method(
        0,
        AMQPClass::Connection(connection::AMQPMethod::CloseOk(connection::CloseOk {})),
    ));
    assert!(c.poll(&mut input).is_none());
    assert!(c.is_finished() && c.out().is_empty());
    assert_eq!(c.poll_timeout(), None, "finished and flushed");
    c.handle_timeout(t0 + secs(60.0));
    assert_eq!(c.timed_out(), None);
}

#[test]
fn a_finished_connection_whose_output_is_not_read_times_out() {
    // The client closed; our close-ok is queued but never written.
    let t0 = Instant::now();
    let (mut c, mut input) = open_at(t0, 10);
    input.extend_from_slice(&method(
        0,
        AMQPClass::Connection(connection::AMQPMethod::Close(connection::Close {
            reply_code: 200,
            reply_text: "bye".into(),
            class_id: 0,
            method_id: 0,
        })),
    ));
    c.on_read(t0 + secs(1.0));
    assert!(matches!(c.poll(&mut input), Some(Event::Closed)));
    assert!(c.is_finished() && !c.out().is_empty());
    c.handle_timeout(t0 + secs(1.0));
    c.handle_timeout(t0 + secs(1.0) + CLOSE_TIMEOUT);
    assert_eq!(c.timed_out(), Some(Timeout::Close));
    assert!(c.out().is_empty());
}

// ---------------------------------------------------------------- channels

#[test]
fn channels_open_close_and_flow() {
    let t0 = Instant::now();
    let (mut c, mut input) = open_at(t0, 0);
    input.extend_from_slice(&channel_open(1));
    assert!(matches!(c.poll(&mut input), Some(Event::ChannelOpened(1))));
    assert!(matches!(
        &written(&mut c)[..],
        [AMQPFrame::Method(
            1,
            AMQPClass::Channel(channel::AMQPMethod::OpenOk(_))
        )]
    ));
    assert!(c.channel_is_usable(1) && !c.channel_is_usable(2));

    input.extend_from_slice(&method(
        1,
        AMQPClass::Channel(channel::AMQPMethod::Flow(channel::Flow { active: false })),
    ));
    assert!(matches!(
        c.poll(&mut input),
        Some(Event::Flow {
            channel: 1,
            active: false
        })
    ));
    assert!(matches!(
        &written(&mut c)[..],
        [AMQPFrame::Method(
            1,
            AMQPClass::Channel(channel::AMQPMethod::FlowOk(channel::FlowOk {
                active: false
            }))
        )]
    ));

    // A client close: close-ok, and the engine is told.
    input.extend_from_slice(&method(
        1,
        AMQPClass::Channel(channel::AMQPMethod::Close(channel::Close {
            reply_code: 200,
            reply_text: "".into(),
            class_id: 0,
            method_id: 0,
        })),
    ));
    assert!(matches!(c.poll(&mut input), Some(Event::ChannelClosed(1))));
    assert!(matches!(
        &written(&mut c)[..],
        [AMQPFrame::Method(
            1,
            AMQPClass::Channel(channel::AMQPMethod::CloseOk(_))
        )]
    ));
    assert!(!c.channel_is_usable(1));
    // Other channel methods go to the engine as they are.
    open_channel(&mut c, &mut input, 1);
    input.extend_from_slice(&method(
        1,
        AMQPClass::Queue(amq_protocol::protocol::queue::AMQPMethod::Declare(
            amq_protocol::protocol::queue::Declare {
                queue: "q".into(),
                passive: false,
                durable: true,
                exclusive: false,
                auto_delete: false,
                nowait: false,
                arguments: FieldTable::default(),
            },
        )),
    ));
    assert!(matches!(
        c.poll(&mut input),
        Some(Event::Method {
            channel: 1,
            method: AMQPClass::Queue(_)
        })
    ));
    assert!(c.is_open());
}

#[test]
fn channel_numbers_are_checked() {
    let t0 = Instant::now();
    // Past channel_max (10, from tune-ok): 504.
    let (mut c, mut input) = open_at(t0, 0);
    input.extend_from_slice(&channel_open(11));
    assert!(c.poll(&mut input).is_none());
    assert_eq!(
        connection_close(&written(&mut c)),
        Some(reply::CHANNEL_ERROR)
    );
    // Opened twice: 504.
    let (mut c, mut input) = open_at(t0, 0);
    open_channel(&mut c, &mut input, 2);
    input.extend_from_slice(&channel_open(2));
    assert!(c.poll(&mut input).is_none());
    assert_eq!(
        connection_close(&written(&mut c)),
        Some(reply::CHANNEL_ERROR)
    );
    // A channel before connection.open: 503 (any frame but close, really).
    let mut c = Connection::new_at(ServerConfig::default(), t0);
    let mut input = BytesMut::from(&codec::PROTOCOL_HEADER[..]);
    input.extend_from_slice(&start_ok("guest", "guest"));
    assert!(matches!(c.poll(&mut input), Some(Event::Login { .. })));
    c.accept_login();
    input.extend_from_slice(&tune_ok(8192, 0));
    input.extend_from_slice(&channel_open(1));
    assert!(c.poll(&mut input).is_none());
    assert_eq!(
        connection_close(&written(&mut c)),
        Some(reply::COMMAND_INVALID)
    );
}

#[test]
fn a_channel_over_the_open_channels_limit_is_refused_without_open_ok() {
    let (mut c, mut input) = open_at(Instant::now(), 0);
    c.limit_open_channels(Some(1));
    open_channel(&mut c, &mut input, 1);
    input.extend_from_slice(&channel_open(2));
    assert!(c.poll(&mut input).is_none());
    let frames = written(&mut c);
    assert_eq!(connection_close(&frames), Some(reply::NOT_ALLOWED));
    assert!(
        !frames.iter().any(|f| matches!(
            f,
            AMQPFrame::Method(2, AMQPClass::Channel(channel::AMQPMethod::OpenOk(_)))
        )),
        "no channel.open-ok for the refused channel: {frames:?}"
    );
}

// ---------------------------------------------------------------- content

#[test]
fn messages_are_assembled_across_reads_and_interleaved_channels() {
    let t0 = Instant::now();
    let (mut c, mut input) = open_at(t0, 0);
    open_channel(&mut c, &mut input, 1);
    open_channel(&mut c, &mut input, 2);
    let props = basic::AMQPProperties::default()
        .with_delivery_mode(2)
        .with_priority(7)
        .with_content_type("text/plain".into());
    let mut stream = Vec::new();
    stream.extend(publish(1, "one"));
    stream.extend(content_header(1, 5, props));
    stream.extend(body(1, b"he"));
    // Channel 2 completes a message (empty body: no body frame at all)
    // while channel 1's is in progress.
    stream.extend(publish(2, "two"));
    stream.extend(content_header(2, 0, basic::AMQPProperties::default()));
    stream.extend(body(1, b"llo"));
    // One byte per read: frames cut anywhere.
    let mut got = Vec::new();
    for b in stream {
        input.extend_from_slice(&[b]);
        while let Some(ev) = c.poll(&mut input) {
            got.push(ev);
        }
    }
    assert!(input.is_empty());
    assert_eq!(c.partial_content_bytes(), 0);
    let [Event::Publish {
        channel: 2,
        message: two,
    }, Event::Publish {
        channel: 1,
        message: one,
    }] = &got[..]
    else {
        panic!("expected two publishes, channel 2 first: {got:?}");
    };
    assert_eq!((&two.routing_key[..], two.body.len()), (&b"two"[..], 0));
    assert!(!two.persistent && two.priority.is_none());
    assert_eq!(
        (&one.routing_key[..], &one.body[..]),
        (&b"one"[..], &b"hello"[..])
    );
    assert!(one.persistent);
    assert_eq!(one.priority, Some(7));
    let decoded = weir_protocols::amqp::connection::parse_properties(&one.properties)
        .expect("the raw property block decodes");
    assert_eq!(
        decoded.content_type().as_ref().map(|s| s.as_str()),
        Some("text/plain")
    );
    assert!(written(&mut c).is_empty(), "publishes have no reply");
}

#[test]
fn a_message_over_max_message_size_closes_only_its_channel() {
    let t0 = Instant::now();
    let mut c = Connection::new_at(
        ServerConfig {
            max_message_size: 1000,
            ..ServerConfig::default()
        },
        t0,
    );
    let mut input = BytesMut::from(&codec::PROTOCOL_HEADER[..]);
    input.extend_from_slice(&start_ok("guest", "guest"));
    assert!(matches!(c.poll(&mut input), Some(Event::Login { .. })));
    c.accept_login();
    input.extend_from_slice(&tune_ok(8192, 0));
    input.extend_from_slice(&open_vhost());
    assert!(matches!(c.poll(&mut input), Some(Event::OpenVhost { .. })));
    c.accept_open();
    written(&mut c);
    open_channel(&mut c, &mut input, 1);
    input.extend_from_slice(&publish(1, "q"));
    input.extend_from_slice(&content_header(1, 1001, basic::AMQPProperties::default()));
    input.extend_from_slice(&body(1, &[0; 1001]));
    assert!(matches!(c.poll(&mut input), Some(Event::ChannelClosed(1))));
    assert!(c.poll(&mut input).is_none(), "its body frame is discarded");
    assert_eq!(
        channel_close(&written(&mut c), 1),
        Some(reply::PRECONDITION_FAILED)
    );
    assert!(c.is_open());
}

// ---------------------------------------------------------------- errors

/// Feeds `bytes` to an open connection with channel 1 open and returns the
/// reply code of the connection.close it wrote.
fn close_code_after(bytes: &[u8]) -> Option<u16> {
    let (mut c, mut input) = open_at(Instant::now(), 0);
    open_channel(&mut c, &mut input, 1);
    input.extend_from_slice(bytes);
    while c.poll(&mut input).is_some() {}
    let code = connection_close(&written(&mut c));
    assert!(code.is_none() || c.is_closing());
    code
}

#[test]
fn frame_and_protocol_errors_close_the_connection_with_their_codes() {
    let mut bad_end = channel_open(2);
    *bad_end.last_mut().expect("a frame") = 0;
    let get_on_0 = method(
        0,
        AMQPClass::Basic(basic::AMQPMethod::Get(basic::Get {
            queue: "q".into(),
            no_ack: false,
        })),
    );
    let open_on_1 = method(
        1,
        AMQPClass::Connection(connection::AMQPMethod::Open(connection::Open {
            virtual_host: "/".into(),
        })),
    );
    let method_mid_content = [
        publish(1, "q"),
        content_header(1, 10, basic::AMQPProperties::default()),
        publish(1, "q"),
    ]
    .concat();
    let body_too_long = [
        publish(1, "q"),
        content_header(1, 2, basic::AMQPProperties::default()),
        body(1, b"abc"),
    ]
    .concat();
    let header_without_publish = content_header(1, 1, basic::AMQPProperties::default());
    let cases: Vec<(&str, Vec<u8>, u16)> = vec![
        ("bad frame-end octet", bad_end, reply::FRAME_ERROR),
        (
            "heartbeat on a channel",
            raw_frame(codec::FRAME_HEARTBEAT, 1, &[]),
            reply::FRAME_ERROR,
        ),
        (
            "unknown frame type",
            raw_frame(9, 0, &[]),
            reply::FRAME_ERROR,
        ),
        (
            "method frame too short",
            raw_frame(codec::FRAME_METHOD, 1, &[0, 60]),
            reply::FRAME_ERROR,
        ),
        (
            "body longer than announced",
            body_too_long,
            reply::FRAME_ERROR,
        ),
        (
            "method inside content",
            method_mid_content,
            reply::UNEXPECTED_FRAME,
        ),
        (
            "header without publish",
            header_without_publish,
            reply::UNEXPECTED_FRAME,
        ),
        (
            "undecodable arguments",
            raw_frame(codec::FRAME_METHOD, 1, &[0, 50, 0, 10, 0]),
            reply::SYNTAX_ERROR,
        ),
        (
            "basic method on channel 0",
            get_on_0,
            reply::COMMAND_INVALID,
        ),
        (
            "connection method on channel 1",
            open_on_1,
            reply::COMMAND_INVALID,
        ),
        (
            "content on an unopened channel",
            body(5, b"x"),
            reply::CHANNEL_ERROR,
        ),
    ];
    for (what, bytes, code) in cases {
        assert_eq!(close_code_after(&bytes), Some(code), "{what}");
    }
}

#[test]
fn frame_max_is_negotiated_and_enforced() {
    // A tune-ok below the 4096 minimum: 530.
    let mut c = Connection::new(ServerConfig::default());
    let mut input = BytesMut::from(&codec::PROTOCOL_HEADER[..]);
    input.extend_from_slice(&start_ok("guest", "guest"));
    assert!(matches!(c.poll(&mut input), Some(Event::Login { .. })));
    c.accept_login();
    written(&mut c);
    input.extend_from_slice(&tune_ok(1024, 0));
    assert!(c.poll(&mut input).is_none());
    assert_eq!(connection_close(&written(&mut c)), Some(reply::NOT_ALLOWED));

    // After tune-ok at 8192, a frame of exactly 8192 bytes passes and one
    // byte more is refused.
    let overhead = codec::FRAME_OVERHEAD;
    let (mut c, mut input) = open_at(Instant::now(), 0);
    open_channel(&mut c, &mut input, 1);
    input.extend_from_slice(&publish(1, "q"));
    input.extend_from_slice(&content_header(
        1,
        2 * (8192 - overhead) as u64,
        basic::AMQPProperties::default(),
    ));
    input.extend_from_slice(&body(1, &vec![0; 8192 - overhead]));
    assert!(c.poll(&mut input).is_none());
    assert!(c.is_open(), "a frame of frame_max bytes is fine");
    input.extend_from_slice(&body(1, &vec![0; 8192 - overhead + 1]));
    assert!(c.poll(&mut input).is_none());
    assert_eq!(connection_close(&written(&mut c)), Some(reply::FRAME_ERROR));
}
