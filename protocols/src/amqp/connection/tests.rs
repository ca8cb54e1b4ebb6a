//! White-box tests of the connection state machine (the black-box ones, on
//! the public API alone, are in `protocols/tests/amqp_connection.rs`).

use super::content::Content;
use super::*;
use amq_protocol::frame::{gen_frame, parse_frame, AMQPFrame};
use amq_protocol::protocol::{basic, channel};
use amq_protocol::types::FieldTable;

fn frame(f: AMQPFrame) -> Vec<u8> {
    cookie_factory::gen(gen_frame(&f), Vec::new())
        .expect("gen")
        .0
}

fn method(ch: u16, m: AMQPClass) -> Vec<u8> {
    frame(AMQPFrame::Method(ch, m))
}

/// Parses every frame the server wrote.
fn written(c: &mut Connection) -> Vec<AMQPFrame> {
    let mut out = Vec::new();
    let buf = c.out().split().freeze();
    let mut rest = &buf[..];
    while !rest.is_empty() {
        let (r, f) = parse_frame(rest).expect("server wrote a valid frame");
        out.push(f);
        rest = r;
    }
    out
}

fn open_connection() -> Connection {
    open_connection_with(ServerConfig::default())
}

fn open_connection_with(config: ServerConfig) -> Connection {
    let mut c = Connection::new(config);
    let mut input = BytesMut::from(&codec::PROTOCOL_HEADER[..]);
    assert!(c.poll(&mut input).is_none());
    let start_ok = connection::StartOk {
        client_properties: FieldTable::default(),
        mechanism: "PLAIN".into(),
        response: "\0guest\0guest".into(),
        locale: "en_US".into(),
    };
    input.extend_from_slice(&method(
        0,
        AMQPClass::Connection(connection::AMQPMethod::StartOk(start_ok)),
    ));
    match c.poll(&mut input) {
        Some(Event::Login {
            username, password, ..
        }) => assert_eq!((username.as_str(), password.expose()), ("guest", "guest")),
        other => panic!("expected login, got {other:?}"),
    }
    c.accept_login();
    let tune_ok = connection::TuneOk {
        channel_max: 10,
        frame_max: 8192,
        heartbeat: 0,
    };
    input.extend_from_slice(&method(
        0,
        AMQPClass::Connection(connection::AMQPMethod::TuneOk(tune_ok)),
    ));
    let open = connection::Open {
        virtual_host: "/".into(),
    };
    input.extend_from_slice(&method(
        0,
        AMQPClass::Connection(connection::AMQPMethod::Open(open)),
    ));
    match c.poll(&mut input) {
        Some(Event::OpenVhost { vhost }) => assert_eq!(vhost, "/"),
        other => panic!("expected open, got {other:?}"),
    }
    c.accept_open();
    assert_eq!(c.frame_max(), 8192);
    written(&mut c);
    c
}

fn close_code(frames: &[AMQPFrame]) -> Option<u16> {
    frames.iter().find_map(|f| match f {
        AMQPFrame::Method(0, AMQPClass::Connection(connection::AMQPMethod::Close(c))) => {
            Some(c.reply_code)
        }
        _ => None,
    })
}

#[test]
fn wrong_protocol_header_gets_ours_back() {
    let mut c = Connection::new(ServerConfig::default());
    let mut input = BytesMut::from(&b"HTTP/1.1"[..]);
    assert!(c.poll(&mut input).is_none());
    assert_eq!(&c.out()[..], codec::PROTOCOL_HEADER);
    assert!(c.is_finished());
}

#[test]
fn publish_is_assembled_from_split_body_frames() {
    let mut c = open_connection();
    let mut input = BytesMut::new();
    input.extend_from_slice(&method(
        1,
        AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
    ));
    assert!(matches!(c.poll(&mut input), Some(Event::ChannelOpened(1))));
    let publish = basic::Publish {
        exchange: "x".into(),
        routing_key: "k".into(),
        mandatory: true,
        immediate: false,
    };
    input.extend_from_slice(&method(
        1,
        AMQPClass::Basic(basic::AMQPMethod::Publish(publish)),
    ));
    let props = basic::AMQPProperties::default().with_delivery_mode(2);
    input.extend_from_slice(&frame(AMQPFrame::Header(
        1,
        amq_protocol::frame::AMQPContentHeader {
            class_id: 60,
            body_size: 6,
            properties: props,
        },
    )));
    input.extend_from_slice(&frame(AMQPFrame::Body(1, b"abc".to_vec())));
    assert!(
        c.poll(&mut input).is_none(),
        "incomplete until the last body frame"
    );
    input.extend_from_slice(&frame(AMQPFrame::Body(1, b"def".to_vec())));
    match c.poll(&mut input) {
        Some(Event::Publish {
            channel: 1,
            message,
        }) => {
            assert_eq!(&message.body[..], b"abcdef");
            assert_eq!(&message.exchange[..], b"x");
            assert!(message.mandatory && message.persistent);
        }
        other => panic!("expected publish, got {other:?}"),
    }
}

#[test]
fn protocol_errors_close_the_connection_with_their_codes() {
    // Method on a channel that was never opened: 504.
    let mut c = open_connection();
    let mut input = BytesMut::from(
        &method(
            3,
            AMQPClass::Basic(basic::AMQPMethod::Get(basic::Get {
                queue: "q".into(),
                no_ack: false,
            })),
        )[..],
    );
    assert!(c.poll(&mut input).is_none());
    assert_eq!(close_code(&written(&mut c)), Some(reply::CHANNEL_ERROR));

    // A frame over frame_max: 501.
    let mut c = open_connection();
    let mut input = BytesMut::from(&frame(AMQPFrame::Body(1, vec![0; 9000]))[..]);
    assert!(c.poll(&mut input).is_none());
    assert_eq!(close_code(&written(&mut c)), Some(reply::FRAME_ERROR));

    // A body frame with no publish before it: 505.
    let mut c = open_connection();
    let mut input = BytesMut::from(
        &method(
            1,
            AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
        )[..],
    );
    assert!(matches!(c.poll(&mut input), Some(Event::ChannelOpened(1))));
    input.extend_from_slice(&frame(AMQPFrame::Body(1, b"x".to_vec())));
    assert!(c.poll(&mut input).is_none());
    assert_eq!(close_code(&written(&mut c)), Some(reply::UNEXPECTED_FRAME));
    assert!(c.is_closing());
}

#[test]
fn frames_on_a_closing_channel_are_discarded() {
    let mut c = open_connection();
    let mut input = BytesMut::from(
        &method(
            1,
            AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
        )[..],
    );
    assert!(matches!(c.poll(&mut input), Some(Event::ChannelOpened(1))));
    c.close_channel(1, reply::NOT_FOUND, "NOT_FOUND - no queue", 60, 70);
    input.extend_from_slice(&method(
        1,
        AMQPClass::Basic(basic::AMQPMethod::Get(basic::Get {
            queue: "q".into(),
            no_ack: false,
        })),
    ));
    assert!(c.poll(&mut input).is_none(), "discarded while closing");
    input.extend_from_slice(&method(
        1,
        AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {})),
    ));
    assert!(c.poll(&mut input).is_none());
    // The channel number is free again.
    input.extend_from_slice(&method(
        1,
        AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
    ));
    assert!(matches!(c.poll(&mut input), Some(Event::ChannelOpened(1))));
    assert!(!c.is_closing());
}

/// A raw frame: type, channel, payload.
fn raw_frame(kind: u8, ch: u16, payload: &[u8]) -> Vec<u8> {
    let mut v = vec![kind];
    v.extend_from_slice(&ch.to_be_bytes());
    v.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    v.extend_from_slice(payload);
    v.push(codec::FRAME_END);
    v
}

/// A raw method frame from class and method ids and hand-built arguments.
fn raw_method(ch: u16, class_id: u16, method_id: u16, args: &[u8]) -> Vec<u8> {
    let mut p = class_id.to_be_bytes().to_vec();
    p.extend_from_slice(&method_id.to_be_bytes());
    p.extend_from_slice(args);
    raw_frame(codec::FRAME_METHOD, ch, &p)
}

fn short(s: &[u8]) -> Vec<u8> {
    let mut v = vec![s.len() as u8];
    v.extend_from_slice(s);
    v
}

fn long(s: &[u8]) -> Vec<u8> {
    let mut v = (s.len() as u32).to_be_bytes().to_vec();
    v.extend_from_slice(s);
    v
}

/// A field table (length prefix included) holding one entry nested
/// `levels` deep in arrays (`b'A'`) or tables (`b'F'`).
fn deep_table(kind: u8, levels: usize) -> Vec<u8> {
    long(&crate::amqp::sasl::tests::deep_entry(kind, levels))
}

/// A connection right after the protocol header (connection.start read).
fn after_header() -> (Connection, BytesMut) {
    let mut c = Connection::new(ServerConfig::default());
    let mut input = BytesMut::from(&codec::PROTOCOL_HEADER[..]);
    assert!(c.poll(&mut input).is_none());
    written(&mut c);
    (c, input)
}

fn start_ok(mechanism: &[u8], response: &[u8]) -> Vec<u8> {
    let mut args = long(&[]);
    args.extend_from_slice(&short(mechanism));
    args.extend_from_slice(&long(response));
    args.extend_from_slice(&short(b"en_US"));
    raw_method(0, 10, 11, &args)
}

fn amqplain_login(extra: &[u8]) -> Vec<u8> {
    let mut r = short(b"LOGIN");
    r.push(b'S');
    r.extend_from_slice(&long(b"guest"));
    r.extend_from_slice(&short(b"PASSWORD"));
    r.push(b'S');
    r.extend_from_slice(&long(b"guest"));
    r.extend_from_slice(extra);
    r
}

#[test]
fn deep_amqplain_response_closes_the_connection_instead_of_overflowing_the_stack() {
    // Issue 5, finding 0: the exact shapes that aborted the broker.
    for (kind, levels) in [(b'A', 2_100), (b'F', 1_400)] {
        let (mut c, mut input) = after_header();
        let entry = crate::amqp::sasl::tests::deep_entry(kind, levels);
        input.extend_from_slice(&start_ok(b"AMQPLAIN", &amqplain_login(&entry)));
        assert!(c.poll(&mut input).is_none(), "no login event");
        assert!(c.is_closing());
        let code = close_code(&written(&mut c));
        assert!(
            matches!(code, Some(reply::SYNTAX_ERROR | reply::ACCESS_REFUSED)),
            "{code:?}"
        );
    }
    // A well-formed AMQPLAIN login still works.
    let (mut c, mut input) = after_header();
    input.extend_from_slice(&start_ok(b"AMQPLAIN", &amqplain_login(&[])));
    assert!(matches!(
        c.poll(&mut input),
        Some(Event::Login { ref username, .. }) if username == "guest"
    ));
}

#[test]
fn plain_responses_of_odd_sizes_are_refused_with_a_close() {
    for resp in [
        Vec::new(),
        b"\0".to_vec(),
        b"\0\0\0\0".to_vec(),
        vec![0xff; 70_000],
        {
            let mut v = b"\0u\0".to_vec();
            v.resize(100_000, b'p');
            v
        },
    ] {
        let (mut c, mut input) = after_header();
        input.extend_from_slice(&start_ok(b"PLAIN", &resp));
        assert!(c.poll(&mut input).is_none(), "{} bytes", resp.len());
        assert_eq!(close_code(&written(&mut c)), Some(reply::ACCESS_REFUSED));
    }
    // A response longer than the frame it claims to be in: malformed method.
    let (mut c, mut input) = after_header();
    let mut args = long(&[]);
    args.extend_from_slice(&short(b"PLAIN"));
    args.extend_from_slice(&u32::MAX.to_be_bytes());
    args.extend_from_slice(b"\0u\0p");
    input.extend_from_slice(&raw_method(0, 10, 11, &args));
    assert!(c.poll(&mut input).is_none());
    assert_eq!(close_code(&written(&mut c)), Some(reply::SYNTAX_ERROR));
}

#[test]
fn deep_tables_in_every_table_carrying_method_close_without_a_crash() {
    // Before tune, frames of up to 128 KiB are read; after, 8 KiB here.
    let deep = || deep_table(b'A', 5_000);
    let deep_small = || deep_table(b'A', 1_500);
    // connection.start sent by a client, before login: amq-protocol
    // parses its server-properties table too.
    let (mut c, mut input) = after_header();
    let mut args = vec![0, 9];
    args.extend_from_slice(&deep());
    args.extend_from_slice(&long(b"PLAIN"));
    args.extend_from_slice(&long(b"en_US"));
    input.extend_from_slice(&raw_method(0, 10, 10, &args));
    assert!(c.poll(&mut input).is_none());
    assert_eq!(close_code(&written(&mut c)), Some(reply::SYNTAX_ERROR));
    // connection.start-ok's client-properties.
    let (mut c, mut input) = after_header();
    let mut args = deep();
    args.extend_from_slice(&short(b"PLAIN"));
    args.extend_from_slice(&long(b"\0guest\0guest"));
    args.extend_from_slice(&short(b"en_US"));
    input.extend_from_slice(&raw_method(0, 10, 11, &args));
    assert!(c.poll(&mut input).is_none());
    assert_eq!(close_code(&written(&mut c)), Some(reply::SYNTAX_ERROR));

    let s = |x: &[u8]| short(x);
    let cases: Vec<(u16, u16, Vec<u8>)> = vec![
        (
            40,
            10,
            [&[0, 0][..], &s(b"x"), &s(b"direct"), &[0]].concat(),
        ),
        (
            40,
            30,
            [&[0, 0][..], &s(b"d"), &s(b"s"), &s(b"k"), &[0]].concat(),
        ),
        (
            40,
            40,
            [&[0, 0][..], &s(b"d"), &s(b"s"), &s(b"k"), &[0]].concat(),
        ),
        (50, 10, [&[0, 0][..], &s(b"q"), &[0]].concat()),
        (
            50,
            20,
            [&[0, 0][..], &s(b"q"), &s(b"x"), &s(b"k"), &[0]].concat(),
        ),
        (50, 50, [&[0, 0][..], &s(b"q"), &s(b"x"), &s(b"k")].concat()),
        (60, 20, [&[0, 0][..], &s(b"q"), &s(b"t"), &[0]].concat()),
    ];
    for (class_id, method_id, mut args) in cases {
        let mut c = open_connection();
        let mut input = BytesMut::from(
            &method(
                1,
                AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
            )[..],
        );
        assert!(matches!(c.poll(&mut input), Some(Event::ChannelOpened(1))));
        args.extend_from_slice(&deep_small());
        input.extend_from_slice(&raw_method(1, class_id, method_id, &args));
        assert!(c.poll(&mut input).is_none(), "{class_id}.{method_id}");
        assert_eq!(
            close_code(&written(&mut c)),
            Some(reply::SYNTAX_ERROR),
            "{class_id}.{method_id}"
        );
    }
    // A content header's headers table.
    let mut c = open_connection();
    let mut input = BytesMut::from(
        &method(
            1,
            AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
        )[..],
    );
    assert!(matches!(c.poll(&mut input), Some(Event::ChannelOpened(1))));
    input.extend_from_slice(&raw_method(
        1,
        60,
        40,
        &[&[0, 0][..], &s(b""), &s(b"q"), &[0]].concat(),
    ));
    let mut header = vec![0, 60, 0, 0];
    header.extend_from_slice(&1u64.to_be_bytes());
    header.extend_from_slice(&(1u16 << 13).to_be_bytes());
    header.extend_from_slice(&deep_small());
    input.extend_from_slice(&raw_frame(codec::FRAME_HEADER, 1, &header));
    assert!(c.poll(&mut input).is_none());
    assert_eq!(close_code(&written(&mut c)), Some(reply::FRAME_ERROR));
    // And a stored property block handed to parse_properties.
    let mut props = (1u16 << 13).to_be_bytes().to_vec();
    props.extend_from_slice(&deep());
    assert!(parse_properties(&props).is_none());
}

#[test]
fn huge_declared_frame_sizes_are_refused_before_buffering() {
    for size in [u32::MAX, 131_065, 1 << 31] {
        let (mut c, mut input) = after_header();
        input.extend_from_slice(&[1, 0, 0]);
        input.extend_from_slice(&size.to_be_bytes());
        assert!(c.poll(&mut input).is_none());
        assert_eq!(close_code(&written(&mut c)), Some(reply::FRAME_ERROR));
        assert!(input.capacity() < 1 << 20, "reserved {}", input.capacity());
    }
}

/// publish + content header announcing `size` on `ch`, then `sent` body bytes.
fn partial_publish(ch: u16, size: u64, sent: usize, frame_max: usize) -> Vec<u8> {
    let mut v = method(
        ch,
        AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish {
            exchange: "".into(),
            routing_key: "q".into(),
            mandatory: false,
            immediate: false,
        })),
    );
    v.extend_from_slice(&frame(AMQPFrame::Header(
        ch,
        amq_protocol::frame::AMQPContentHeader {
            class_id: 60,
            body_size: size,
            properties: basic::AMQPProperties::default(),
        },
    )));
    let body = vec![b'x'; sent];
    for piece in body.chunks(frame_max - codec::FRAME_OVERHEAD) {
        v.extend_from_slice(&frame(AMQPFrame::Body(ch, piece.to_vec())));
    }
    v
}

fn channel_close_code(frames: &[AMQPFrame], ch: u16) -> Option<u16> {
    frames.iter().find_map(|f| match f {
        AMQPFrame::Method(c, AMQPClass::Channel(channel::AMQPMethod::Close(cl))) if *c == ch => {
            Some(cl.reply_code)
        }
        _ => None,
    })
}

#[test]
fn partial_content_is_capped_per_connection_across_channels() {
    let mut c = open_connection_with(ServerConfig {
        max_message_size: 100_000,
        ..ServerConfig::default()
    });
    let mut input = BytesMut::new();
    for ch in 1..=4 {
        input.extend_from_slice(&method(
            ch,
            AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
        ));
        assert!(matches!(c.poll(&mut input), Some(Event::ChannelOpened(n)) if n == ch));
    }
    written(&mut c);
    assert_eq!(c.partial_content_bytes(), 0);
    // One incomplete message may use all of max_message_size.
    input.extend_from_slice(&partial_publish(1, 100_000, 99_000, 8192));
    assert!(c.poll(&mut input).is_none());
    let one = c.partial_content_bytes();
    assert!((99_000..99_100).contains(&one), "{one}");
    assert!(written(&mut c).is_empty());
    // A second one on another channel would pass the cap: refused with 406.
    input.extend_from_slice(&partial_publish(2, 100_000, 20_000, 8192));
    assert!(
        matches!(c.poll(&mut input), Some(Event::ChannelClosed(2))),
        "the engine is told to release channel 2"
    );
    assert!(c.poll(&mut input).is_none());
    assert_eq!(
        channel_close_code(&written(&mut c), 2),
        Some(reply::PRECONDITION_FAILED)
    );
    assert_eq!(c.partial_content_bytes(), one, "channel 2 holds nothing");
    assert!(!c.is_closing(), "the connection and channel 1 go on");
    // Channel 1 completes: nothing is held any more.
    input.extend_from_slice(&frame(AMQPFrame::Body(1, vec![b'x'; 1_000])));
    match c.poll(&mut input) {
        Some(Event::Publish {
            channel: 1,
            message,
        }) => assert_eq!(message.body.len(), 100_000),
        other => panic!("expected publish, got {other:?}"),
    }
    assert!(c.poll(&mut input).is_none());
    assert_eq!(c.partial_content_bytes(), 0);
    // Small messages in progress on several channels fit together.
    for ch in [3, 4] {
        input.extend_from_slice(&partial_publish(ch, 40_000, 30_000, 8192));
    }
    assert!(c.poll(&mut input).is_none());
    assert!(written(&mut c).is_empty());
    assert!(c.partial_content_bytes() >= 60_000);
    // Closing the connection releases them.
    c.fail(reply::CONNECTION_FORCED, "test".into(), 0, 0);
    assert_eq!(c.partial_content_bytes(), 0);
}

#[test]
fn an_incomplete_message_does_not_pin_the_read_buffer() {
    let mut c = open_connection();
    let mut input = BytesMut::from(
        &method(
            1,
            AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
        )[..],
    );
    assert!(matches!(c.poll(&mut input), Some(Event::ChannelOpened(1))));
    input.extend_from_slice(&partial_publish(1, 10, 0, 8192));
    let range = input.as_ptr() as usize..input.as_ptr() as usize + input.capacity();
    assert!(c.poll(&mut input).is_none());
    let state = c.channels.get(&1).expect("channel 1");
    let Content::AwaitingBody {
        publish, header, ..
    } = &state.content
    else {
        panic!("expected a body to be awaited");
    };
    for b in [&publish.routing_key, &header.properties] {
        assert!(
            !range.contains(&(b.as_ptr() as usize)),
            "still a slice of the input"
        );
    }
}

#[test]
fn messages_are_copied_out_of_the_read_buffer() {
    let mut c = open_connection_with(ServerConfig::default());
    let mut input = BytesMut::from(
        &method(
            1,
            AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
        )[..],
    );
    assert!(matches!(c.poll(&mut input), Some(Event::ChannelOpened(1))));
    input.extend_from_slice(&partial_publish(1, 3, 3, 8192));
    let range = input.as_ptr() as usize..input.as_ptr() as usize + input.capacity();
    let Some(Event::Publish { message, .. }) = c.poll(&mut input) else {
        panic!("expected publish");
    };
    assert_eq!(&message.body[..], b"xxx");
    assert_eq!(&message.routing_key[..], b"q");
    for b in [&message.routing_key, &message.properties, &message.body] {
        assert!(!range.contains(&(b.as_ptr() as usize)));
    }
}

/// Throughput of small publishes fed in 64 KiB reads (each message copied
/// out of the read buffer); run with
/// `cargo test -p weir-protocols --release -- --ignored --nocapture measure`.
#[test]
#[ignore]
fn measure_small_publish_throughput() {
    let n = 1_000_000;
    let mut one = Vec::new();
    one.extend_from_slice(&partial_publish(1, 100, 100, 8192));
    let mut stream = Vec::with_capacity(one.len() * n);
    for _ in 0..n {
        stream.extend_from_slice(&one);
    }
    {
        let mut c = open_connection_with(ServerConfig::default());
        let mut input = BytesMut::from(
            &method(
                1,
                AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
            )[..],
        );
        assert!(matches!(c.poll(&mut input), Some(Event::ChannelOpened(1))));
        let started = std::time::Instant::now();
        let mut got = 0;
        for read in stream.chunks(64 * 1024) {
            input.reserve(64 * 1024);
            input.extend_from_slice(read);
            while let Some(ev) = c.poll(&mut input) {
                if let Event::Publish { message, .. } = ev {
                    got += message.body.len() / 100;
                }
            }
        }
        assert_eq!(got, n);
        let secs = started.elapsed().as_secs_f64();
        println!(
            "{n} publishes of 100 B in {secs:.3} s = {:.0} k msg/s",
            n as f64 / secs / 1000.0
        );
    }
}

#[test]
fn update_secret_is_an_event_answered_or_refused_by_the_session() {
    let update = || {
        method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::UpdateSecret(
                connection::UpdateSecret {
                    new_secret: "token-2".into(),
                    reason: "rotation".into(),
                },
            )),
        )
    };
    let mut c = open_connection();
    let mut input = BytesMut::from(&update()[..]);
    match c.poll(&mut input) {
        Some(Event::UpdateSecret { secret, reason }) => {
            assert_eq!((secret.expose(), reason.as_str()), ("token-2", "rotation"));
            // The secret never shows in logs.
            assert!(!format!("{secret:?}").contains("token-2"));
        }
        other => panic!("expected update-secret, got {other:?}"),
    }
    // Nothing is answered before the session decided.
    assert!(written(&mut c).is_empty());
    c.accept_update_secret();
    assert!(matches!(
        written(&mut c)[..],
        [AMQPFrame::Method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::UpdateSecretOk(_))
        )]
    ));
    assert!(c.is_open());

    let mut input = BytesMut::from(&update()[..]);
    assert!(matches!(
        c.poll(&mut input),
        Some(Event::UpdateSecret { .. })
    ));
    c.refuse_update_secret("New secret was refused by one of the backends");
    assert_eq!(close_code(&written(&mut c)), Some(reply::NOT_ALLOWED));
    assert!(!c.is_open());
}
