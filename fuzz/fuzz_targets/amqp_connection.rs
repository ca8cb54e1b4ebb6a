//! Arbitrary bytes after the protocol header, fed to a `Connection` in chunks
//! of varying size and driven with `poll` until it wants more input or is
//! finished. The first byte picks options: a canned handshake (so the fuzzer
//! starts inside an open connection with channels), the chunk size, and the
//! small-message copy. Invariants: no panic, bounded work per input, the
//! partial-content total stays under its bound, and every frame the server
//! writes parses.
#![no_main]

use amq_protocol::frame::{gen_frame, parse_frame, AMQPFrame};
use amq_protocol::protocol::{channel, connection, AMQPClass};
use amq_protocol::types::FieldTable;
use bytes::BytesMut;
use libfuzzer_sys::fuzz_target;
use std::sync::OnceLock;
use weir_protocols::amqp::{codec, reply, Connection, Event, ServerConfig};

const MAX_MESSAGE: u64 = 64 * 1024;
const PARTIAL_LIMIT: u64 = 32 * 1024;

fn method(ch: u16, m: AMQPClass) -> Vec<u8> {
    // Generating into a Vec cannot fail.
    cookie_factory::gen(gen_frame(&AMQPFrame::Method(ch, m)), Vec::new())
        .expect("generating a frame into a Vec")
        .0
}

/// start-ok (PLAIN guest), tune-ok (frame_max 4096), open, channels 1..=3.
fn handshake() -> Vec<u8> {
    let mut v = method(
        0,
        AMQPClass::Connection(connection::AMQPMethod::StartOk(connection::StartOk {
            client_properties: FieldTable::default(),
            mechanism: "PLAIN".into(),
            response: "\0guest\0guest".into(),
            locale: "en_US".into(),
        })),
    );
    v.extend(method(
        0,
        AMQPClass::Connection(connection::AMQPMethod::TuneOk(connection::TuneOk {
            channel_max: 16,
            frame_max: 4096,
            heartbeat: 0,
        })),
    ));
    v.extend(method(
        0,
        AMQPClass::Connection(connection::AMQPMethod::Open(connection::Open {
            virtual_host: "/".into(),
        })),
    ));
    for ch in 1..=3 {
        v.extend(method(
            ch,
            AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
        ));
    }
    v
}

fn check_out(c: &mut Connection) {
    let out = c.out().split().freeze();
    let mut rest = &out[..];
    while !rest.is_empty() {
        match parse_frame(rest) {
            Ok((r, _)) => rest = r,
            Err(e) => panic!("server wrote an unparsable frame: {e:?}"),
        }
    }
}

/// Stack of the thread each input runs on: far more than 32 levels of
/// nesting need, far less than the main thread's 8 MiB, so parsing that
/// recursed without the depth bound overflows it (and aborts, which libFuzzer
/// reports) with inputs of a few KiB, as a tokio worker's 2 MiB did.
const STACK: usize = 256 * 1024;

fuzz_target!(|data: &[u8]| {
    let data = data.to_vec();
    let worker = std::thread::Builder::new()
        .stack_size(STACK)
        .spawn(move || run(&data))
        .expect("spawning the input's thread");
    if let Err(panic) = worker.join() {
        std::panic::resume_unwind(panic);
    }
});

fn run(data: &[u8]) {
    let Some((&opts, body)) = data.split_first() else {
        return;
    };
    let config = ServerConfig {
        frame_max: 16 * 1024,
        max_message_size: MAX_MESSAGE,
        max_partial_content: Some(PARTIAL_LIMIT),
        ..ServerConfig::default()
    };
    let frame_max = config.frame_max as usize;
    static HANDSHAKE: OnceLock<Vec<u8>> = OnceLock::new();
    let mut stream = codec::PROTOCOL_HEADER.to_vec();
    if opts & 1 != 0 {
        stream.extend_from_slice(HANDSHAKE.get_or_init(handshake));
    }
    stream.extend_from_slice(body);
    let chunk = 1usize << (((opts >> 1) & 7) * 2); // 1 B .. 16 KiB
    let mut c = Connection::new(config);
    let mut input = BytesMut::new();
    // Each event consumes at least one frame (8 bytes or more), so this many
    // polls returning Some mean a loop that does not consume its input.
    let mut budget = stream.len() + 64;
    for piece in stream.chunks(chunk) {
        input.extend_from_slice(piece);
        while let Some(ev) = c.poll(&mut input) {
            budget = budget
                .checked_sub(1)
                .expect("poll returns events without consuming input");
            match ev {
                Event::Login { username, .. } => {
                    if username == "guest" {
                        c.accept_login();
                    } else {
                        c.refuse_login("bad credentials");
                    }
                }
                Event::OpenVhost { vhost } => {
                    if vhost == "/" {
                        c.accept_open();
                    } else {
                        c.refuse_open("no such vhost");
                    }
                }
                Event::Method { channel, .. } if channel % 2 == 0 => {
                    // Let the engine "fail" some methods, to walk close paths.
                    c.close_channel(channel, reply::NOT_FOUND, "NOT_FOUND - fuzz", 50, 10);
                }
                Event::Publish { message, .. } => {
                    assert!(message.body.len() as u64 <= MAX_MESSAGE);
                }
                _ => {}
            }
            check_out(&mut c);
        }
        check_out(&mut c);
        // One message may use max_message_size; together at most the limit,
        // plus names and properties of at most one frame each.
        let bound = MAX_MESSAGE.max(PARTIAL_LIMIT) as usize + 4 * frame_max + 16 * 512;
        assert!(
            c.partial_content_bytes() <= bound,
            "{} bytes in incomplete messages",
            c.partial_content_bytes()
        );
        if c.is_finished() {
            break;
        }
    }
}
