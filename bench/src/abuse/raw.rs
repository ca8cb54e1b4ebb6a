//! Hand-built login frames (absurdly nested AMQPLAIN responses, wrong passwords) and a bare socket
//! to send them on, before any handshake.

use std::net::SocketAddr;
use std::time::Duration;

use amq_protocol::frame::AMQPFrame;
use amq_protocol::protocol::{connection, AMQPClass};
use bytes::BytesMut;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::conn::{err, take_frame, Context, Result, DEFAULT_FRAME_MAX};

/// `AMQP 0-9-1` protocol header.
pub const PROTOCOL_HEADER: &[u8] = b"AMQP\x00\x00\x09\x01";

/// Frame-end octet.
const FRAME_END: u8 = 0xCE;

/// A whole frame: type, channel, size, payload, frame-end.
pub fn frame(kind: u8, channel: u16, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(payload.len() + 8);
    out.push(kind);
    out.extend_from_slice(&channel.to_be_bytes());
    out.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    out.extend_from_slice(payload);
    out.push(FRAME_END);
    out
}

fn short_str(out: &mut Vec<u8>, s: &[u8]) {
    debug_assert!(s.len() <= 255);
    out.push(s.len() as u8);
    out.extend_from_slice(s);
}

fn long_str(out: &mut Vec<u8>, s: &[u8]) {
    out.extend_from_slice(&(s.len() as u32).to_be_bytes());
    out.extend_from_slice(s);
}

/// `connection.start-ok` (class 10, method 11) with empty client properties.
pub fn start_ok(mechanism: &str, response: &[u8]) -> Vec<u8> {
    let mut p = Vec::with_capacity(response.len() + 32);
    p.extend_from_slice(&10u16.to_be_bytes());
    p.extend_from_slice(&11u16.to_be_bytes());
    p.extend_from_slice(&0u32.to_be_bytes()); // client-properties: empty table
    short_str(&mut p, mechanism.as_bytes());
    long_str(&mut p, response);
    short_str(&mut p, b"en_US");
    frame(1, 0, &p)
}

/// PLAIN response `\0user\0pass`.
pub fn plain_response(user: &str, pass: &str) -> Vec<u8> {
    format!("\0{user}\0{pass}").into_bytes()
}

/// How the AMQPLAIN login response nests.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Nesting {
    /// Field arrays inside field arrays (`A`).
    Arrays,
    /// Field tables inside field tables (`F`), each with one entry named `a`.
    Tables,
}

/// An AMQPLAIN response (the content of a field table, without its length) whose single entry
/// `LOGIN` holds `depth` nested arrays or tables. Built outside-in without recursion: each level's
/// length is known from the depth alone.
pub fn nested_amqplain(nesting: Nesting, depth: usize) -> Vec<u8> {
    assert!(depth >= 1);
    // Bytes a level adds around the level inside it: arrays: type tag (1) of the inner item;
    // tables: entry name (shortstr "a": 2) + type tag (1).
    let per_level = match nesting {
        Nesting::Arrays => 1,
        Nesting::Tables => 3,
    };
    let tag = match nesting {
        Nesting::Arrays => b'A',
        Nesting::Tables => b'F',
    };
    let mut out = Vec::with_capacity(6 + 1 + depth * (4 + per_level));
    short_str(&mut out, b"LOGIN");
    out.push(tag);
    // Level k (1 = outermost) holds depth-k more levels; its content length is (depth-k)*(4+per_level).
    for k in 1..=depth {
        let inner = (depth - k) * (4 + per_level);
        out.extend_from_slice(&(inner as u32).to_be_bytes());
        if k < depth {
            if nesting == Nesting::Tables {
                short_str(&mut out, b"a");
            }
            out.push(tag);
        }
    }
    out
}

/// What a raw session ended with.
#[derive(Debug)]
pub enum End {
    /// The server sent `connection.close`.
    Close(u16),
    /// The server closed the socket without a close method.
    Eof,
    /// Nothing within the time limit.
    Timeout,
    /// Some other frame arrived first.
    Frame(String),
}

impl End {
    /// Short token for a figures line: `close:403`, `eof`, `timeout`.
    pub fn token(&self) -> String {
        match self {
            End::Close(code) => format!("close:{code}"),
            End::Eof => "eof".into(),
            End::Timeout => "timeout".into(),
            End::Frame(f) => format!("frame:{}", f.split_whitespace().next().unwrap_or("?")),
        }
    }
}

/// A bare AMQP socket: bytes out, frames in.
pub struct Raw {
    stream: TcpStream,
    rbuf: BytesMut,
}

impl Raw {
    /// Connect and send the protocol header; wait for `connection.start`.
    pub async fn connect_started(addr: SocketAddr) -> Result<Raw> {
        let stream = TcpStream::connect(addr)
            .await
            .ctx(format!("connecting to {addr}"))?;
        stream.set_nodelay(true).ctx("TCP_NODELAY")?;
        let mut raw = Raw {
            stream,
            rbuf: BytesMut::with_capacity(16 * 1024),
        };
        raw.send(PROTOCOL_HEADER).await?;
        match raw.next(Duration::from_secs(30)).await? {
            Some(AMQPFrame::Method(0, AMQPClass::Connection(connection::AMQPMethod::Start(_)))) => {
                Ok(raw)
            }
            other => err(format!("expected connection.start, got {other:?}")),
        }
    }

    /// Write bytes.
    pub async fn send(&mut self, bytes: &[u8]) -> Result<()> {
        self.stream.write_all(bytes).await.ctx("writing to socket")
    }

    /// Next frame; `None` on EOF; error on timeout.
    pub async fn next(&mut self, limit: Duration) -> Result<Option<AMQPFrame>> {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            // Before tune, no frame of the server's is larger than the default frame_max.
            if let Some(f) = take_frame(&mut self.rbuf, DEFAULT_FRAME_MAX)? {
                return Ok(Some(f));
            }
            let read = tokio::time::timeout_at(deadline, self.stream.read_buf(&mut self.rbuf));
            match read.await {
                Err(_) => return err("timeout"),
                Ok(Ok(0)) => return Ok(None),
                Ok(Ok(_)) => {}
                // A reset is how some servers end a refused login.
                Ok(Err(_)) => return Ok(None),
            }
        }
    }

    /// Wait for how the server ends this session (close, EOF) or for another frame.
    pub async fn outcome(&mut self, limit: Duration) -> End {
        match self.next(limit).await {
            Ok(None) => End::Eof,
            Ok(Some(AMQPFrame::Method(
                0,
                AMQPClass::Connection(connection::AMQPMethod::Close(c)),
            ))) => End::Close(c.reply_code),
            Ok(Some(f)) => End::Frame(format!("{f:?}")),
            Err(_) => End::Timeout,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use amq_protocol::frame::parse_frame;
    use amq_protocol::types::{AMQPValue, FieldTable};

    /// Parse an AMQPLAIN response the way a server would: as the content of a field table.
    fn parse_table(content: &[u8]) -> FieldTable {
        let mut buf = (content.len() as u32).to_be_bytes().to_vec();
        buf.extend_from_slice(content);
        let (rest, t) = amq_protocol::types::parsing::parse_field_table(&buf[..]).unwrap();
        assert!(rest.is_empty());
        t
    }

    fn depth_of(v: &AMQPValue) -> usize {
        match v {
            AMQPValue::FieldArray(a) => 1 + a.as_slice().first().map_or(0, depth_of),
            AMQPValue::FieldTable(t) => 1 + t.inner().values().next().map_or(0, depth_of),
            _ => 0,
        }
    }

    #[test]
    fn nested_responses_parse_to_the_requested_depth() {
        for nesting in [Nesting::Arrays, Nesting::Tables] {
            for depth in [1, 2, 7, 50] {
                let t = parse_table(&nested_amqplain(nesting, depth));
                let login = t.inner().get("LOGIN").expect("LOGIN entry");
                assert_eq!(depth_of(login), depth, "{nesting:?} {depth}");
            }
        }
    }

    #[test]
    fn attack_sizes_match_the_issue() {
        // "about 11 KB in all" for arrays 2,100 deep; tables 1,400 deep are of the same order.
        let a = nested_amqplain(Nesting::Arrays, 2100).len();
        let t = nested_amqplain(Nesting::Tables, 1400).len();
        assert!((10_000..12_000).contains(&a), "{a}");
        assert!((9_000..11_000).contains(&t), "{t}");
    }

    #[test]
    fn start_ok_parses_with_the_codec() {
        let bytes = start_ok("PLAIN", &plain_response("guest", "nope"));
        let (rest, f) = parse_frame(&bytes[..]).unwrap();
        assert!(rest.is_empty());
        match f {
            AMQPFrame::Method(0, AMQPClass::Connection(connection::AMQPMethod::StartOk(s))) => {
                assert_eq!(s.mechanism.as_str(), "PLAIN");
                assert_eq!(s.response.as_bytes(), b"\0guest\0nope");
            }
            other => panic!("{other:?}"),
        }
    }
}
