//! The shovel's ends on a NATS server, over NATS's text protocol (a small
//! client of its own: `CONNECT`, `SUB`, `PUB`, `MSG`/`HMSG`, `PING`/`PONG`).
//!
//! * Source, core NATS (`src-subject`): a subscription. Core NATS has no
//!   acknowledgements: what arrives while the shovel is disconnected is
//!   not kept by the server (at-most-once, NATS's own guarantee).
//! * Source, JetStream (`src-stream` + `src-consumer`): a durable pull
//!   consumer (created with explicit acks when missing), pulled in batches
//!   of the prefetch; each message is acknowledged (`+ACK` to its reply
//!   subject) only after the destination confirmed it, so JetStream
//!   redelivers what a failure left unacknowledged.
//! * Destination, core NATS (`dest-subject`, else the routing key): a
//!   batch is confirmed by a `PING`'s `PONG` (the server has processed
//!   every publish before it).
//! * Destination, JetStream (`dest-stream` given): each publish asks for
//!   the stream's acknowledgement; a batch is confirmed once every one
//!   came back without an error.

use std::sync::Arc;

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::tcp::OwnedWriteHalf;
use tokio::net::TcpStream;
use tokio::sync::{mpsc, Mutex};

use super::{Msg, ShovelError};

/// The largest message taken from the server (NATS's default max_payload
/// is 1 MiB; servers may raise it to 64 MiB).
const MAX_PAYLOAD: usize = 64 << 20;

/// What the server sent.
#[derive(Debug)]
enum Op {
    /// A message (`MSG` or `HMSG`); `status` is a JetStream status code
    /// (404 no messages, 408 request timeout, …) of a header-only message.
    Msg {
        reply: Option<String>,
        payload: bytes::Bytes,
        status: Option<u16>,
    },
    Pong,
    Err(String),
}

/// One connection: the writer here, a reader task forwarding ops.
struct Conn {
    wr: Arc<Mutex<OwnedWriteHalf>>,
    ops: mpsc::Receiver<Result<Op, String>>,
    reader: tokio::task::JoinHandle<()>,
    inbox: String,
}

impl Drop for Conn {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

fn closed(e: impl std::fmt::Display) -> ShovelError {
    ShovelError::Closed(format!("NATS: {e}"))
}

fn json_str(s: &str) -> String {
    serde_json::Value::String(s.to_string()).to_string()
}

impl Conn {
    async fn open(uri: &str) -> Result<Conn, ShovelError> {
        let rest = uri
            .strip_prefix("nats://")
            .ok_or_else(|| closed(format!("not a nats:// URI: {uri}")))?;
        let rest = rest.split('/').next().unwrap_or("");
        let (creds, hostport) = match rest.rsplit_once('@') {
            Some((c, h)) => (Some(c), h),
            None => (None, rest),
        };
        let addr = if hostport.contains(':') {
            hostport.to_string()
        } else {
            format!("{hostport}:4222")
        };
        let stream = TcpStream::connect(&addr).await.map_err(closed)?;
        let _ = stream.set_nodelay(true);
        let (rd, wr) = stream.into_split();
        let mut rd = BufReader::new(rd);
        let mut line = String::new();
        rd.read_line(&mut line).await.map_err(closed)?;
        if !line.starts_with("INFO") {
            return Err(closed(format!("expected INFO, got {line:?}")));
        }
        let mut connect = String::from(
            r#"{"verbose":false,"pedantic":false,"name":"weir-shovel","lang":"rust","version":"0.1","protocol":1,"headers":true,"no_responders":true"#,
        );
        if let Some(c) = creds {
            let (u, p) = c.split_once(':').unwrap_or((c, ""));
            connect.push_str(&format!(
                r#","user":{},"pass":{}"#,
                json_str(u),
                json_str(p)
            ));
        }
        connect.push('}');
        let wr = Arc::new(Mutex::new(wr));
        wr.lock()
            .await
            .write_all(format!("CONNECT {connect}\r\nPING\r\n").as_bytes())
            .await
            .map_err(closed)?;
        let (tx, mut ops) = mpsc::channel(4096);
        let reader = tokio::spawn(read_loop(rd, wr.clone(), tx));
        // The PONG to our PING: the login was accepted.
        match ops.recv().await {
            Some(Ok(Op::Pong)) => {}
            Some(Ok(Op::Err(e))) | Some(Err(e)) => return Err(closed(e)),
            other => return Err(closed(format!("unexpected answer to CONNECT: {other:?}"))),
        }
        let inbox = format!("_INBOX.weir.{:016x}", rand_u64());
        Ok(Conn {
            wr,
            ops,
            reader,
            inbox,
        })
    }

    async fn write(&self, bytes: &[u8]) -> Result<(), ShovelError> {
        self.wr.lock().await.write_all(bytes).await.map_err(closed)
    }

    async fn next(&mut self) -> Result<Op, ShovelError> {
        match self.ops.recv().await {
            Some(Ok(Op::Err(e))) => Err(closed(e)),
            Some(Ok(op)) => Ok(op),
            Some(Err(e)) => Err(closed(e)),
            None => Err(closed("connection closed")),
        }
    }

    fn try_next(&mut self) -> Result<Option<Op>, ShovelError> {
        match self.ops.try_recv() {
            Ok(Ok(Op::Err(e))) => Err(closed(e)),
            Ok(Ok(op)) => Ok(Some(op)),
            Ok(Err(e)) => Err(closed(e)),
            Err(mpsc::error::TryRecvError::Empty) => Ok(None),
            Err(mpsc::error::TryRecvError::Disconnected) => Err(closed("connection closed")),
        }
    }
}

fn rand_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    h.finish()
}

fn pub_frame(out: &mut Vec<u8>, subject: &str, reply: Option<&str>, payload: &[u8]) {
    out.extend_from_slice(b"PUB ");
    out.extend_from_slice(subject.as_bytes());
    if let Some(r) = reply {
        out.push(b' ');
        out.extend_from_slice(r.as_bytes());
    }
    out.extend_from_slice(format!(" {}\r\n", payload.len()).as_bytes());
    out.extend_from_slice(payload);
    out.extend_from_slice(b"\r\n");
}

async fn read_loop(
    mut rd: BufReader<tokio::net::tcp::OwnedReadHalf>,
    wr: Arc<Mutex<OwnedWriteHalf>>,
    tx: mpsc::Sender<Result<Op, String>>,
) {
    let r: Result<(), String> = async {
        let mut line = String::new();
        loop {
            line.clear();
            if rd.read_line(&mut line).await.map_err(|e| e.to_string())? == 0 {
                return Err("connection closed by the server".into());
            }
            if line.len() > 4096 {
                return Err("protocol line too long".into());
            }
            let l = line.trim_end();
            let mut parts = l.split_ascii_whitespace();
            let op = match parts.next().unwrap_or("") {
                "PING" => {
                    wr.lock()
                        .await
                        .write_all(b"PONG\r\n")
                        .await
                        .map_err(|e| e.to_string())?;
                    continue;
                }
                "PONG" => Op::Pong,
                "+OK" | "INFO" => continue,
                "-ERR" => Op::Err(l.trim_start_matches("-ERR").trim().to_string()),
                kind @ ("MSG" | "HMSG") => {
                    let args: Vec<&str> = parts.collect();
                    let bad = || format!("bad {kind} line {l:?}");
                    let num = |s: &str| s.parse::<usize>().map_err(|_| bad());
                    // MSG subject sid [reply] total; HMSG subject sid [reply] hdr total
                    let (reply, hdr, total) = match (kind, args.len()) {
                        ("MSG", 3) => (None, 0, num(args[2])?),
                        ("MSG", 4) => (Some(args[2].to_string()), 0, num(args[3])?),
                        ("HMSG", 4) => (None, num(args[2])?, num(args[3])?),
                        ("HMSG", 5) => (Some(args[2].to_string()), num(args[3])?, num(args[4])?),
                        _ => return Err(bad()),
                    };
                    if total > MAX_PAYLOAD || hdr > total {
                        return Err(format!("message of {total} bytes refused"));
                    }
                    let mut buf = vec![0u8; total + 2];
                    rd.read_exact(&mut buf).await.map_err(|e| e.to_string())?;
                    buf.truncate(total);
                    let status = (hdr > 0)
                        .then(|| {
                            // "NATS/1.0 408 Request Timeout\r\n…"
                            let h = String::from_utf8_lossy(&buf[..hdr]);
                            h.split_ascii_whitespace()
                                .nth(1)
                                .and_then(|c| c.parse::<u16>().ok())
                        })
                        .flatten();
                    let payload = bytes::Bytes::from(buf).slice(hdr..);
                    Op::Msg {
                        reply,
                        payload,
                        status,
                    }
                }
                _ => continue,
            };
            if tx.send(Ok(op)).await.is_err() {
                return Ok(());
            }
        }
    }
    .await;
    if let Err(e) = r {
        let _ = tx.send(Err(e)).await;
    }
}

/// A NATS subject or JetStream consumer, consumed.
pub struct NatsSource {
    conn: Conn,
    /// JetStream: (stream, consumer) and the messages still owed by the
    /// outstanding pull.
    js: Option<(String, String)>,
    owed: usize,
    /// Reply subjects of unacknowledged JetStream messages, by tag.
    acks: std::collections::VecDeque<(u64, String)>,
    next_tag: u64,
    subject: String,
}

impl NatsSource {
    /// Connects and subscribes (core NATS), or makes sure the durable
    /// consumer exists (JetStream).
    pub async fn open(
        uri: &str,
        subject: &str,
        js: Option<(String, String)>,
    ) -> Result<Self, ShovelError> {
        let conn = Conn::open(uri).await?;
        let mut s = NatsSource {
            conn,
            js,
            owed: 0,
            acks: Default::default(),
            next_tag: 1,
            subject: subject.to_string(),
        };
        let mut out = Vec::new();
        match &s.js {
            None => {
                out.extend_from_slice(format!("SUB {subject} 1\r\n").as_bytes());
            }
            Some((stream, consumer)) => {
                out.extend_from_slice(format!("SUB {}.> 1\r\n", s.conn.inbox).as_bytes());
                let cfg = serde_json::json!({
                    "stream_name": stream,
                    "config": {
                        "durable_name": consumer,
                        "ack_policy": "explicit",
                        "filter_subject": if subject.is_empty() { None } else { Some(subject) },
                    }
                });
                let reply = format!("{}.create", s.conn.inbox);
                pub_frame(
                    &mut out,
                    &format!("$JS.API.CONSUMER.DURABLE.CREATE.{stream}.{consumer}"),
                    Some(&reply),
                    cfg.to_string().as_bytes(),
                );
            }
        }
        out.extend_from_slice(b"PING\r\n");
        s.conn.write(&out).await?;
        loop {
            match s.conn.next().await? {
                Op::Pong if s.js.is_none() => break,
                Op::Msg { payload, .. } if s.js.is_some() => {
                    let v: serde_json::Value =
                        serde_json::from_slice(&payload).unwrap_or(serde_json::Value::Null);
                    if let Some(e) = v.get("error") {
                        // An existing consumer with another config is
                        // refused here but may still serve: say so, go on.
                        tracing::warn!(error = %e, "JetStream consumer create");
                    }
                    break;
                }
                _ => {}
            }
        }
        Ok(s)
    }

    async fn pull(&mut self, max: usize) -> Result<(), ShovelError> {
        let Some((stream, consumer)) = &self.js else {
            return Ok(());
        };
        let mut out = Vec::new();
        // Expires after 5 s (in ns): a 408 status ends it, and we pull again.
        let req = format!(r#"{{"batch":{max},"expires":5000000000}}"#);
        pub_frame(
            &mut out,
            &format!("$JS.API.CONSUMER.MSG.NEXT.{stream}.{consumer}"),
            Some(&format!("{}.pull", self.conn.inbox)),
            req.as_bytes(),
        );
        self.conn.write(&out).await?;
        self.owed = max;
        Ok(())
    }

    fn take(&mut self, op: Op, out: &mut Vec<Msg>) {
        let Op::Msg {
            reply,
            payload,
            status,
        } = op
        else {
            return;
        };
        if status.is_some() {
            // A pull's end (404 no messages, 408 timeout, 409 …).
            self.owed = 0;
            return;
        }
        let tag = self.next_tag;
        self.next_tag += 1;
        if self.js.is_some() {
            self.owed = self.owed.saturating_sub(1);
            if let Some(r) = reply {
                self.acks.push_back((tag, r));
            }
        }
        out.push(Msg {
            exchange: String::new(),
            routing_key: self.subject.clone(),
            header: None,
            body: payload,
            persistent: self.js.is_some(),
            ack: tag,
        });
    }

    /// Waits for at least one message, then takes what already arrived,
    /// up to `max`.
    pub async fn recv(&mut self, max: usize, out: &mut Vec<Msg>) -> Result<(), ShovelError> {
        loop {
            while out.len() < max {
                match self.conn.try_next()? {
                    Some(op) => self.take(op, out),
                    None => break,
                }
            }
            if !out.is_empty() {
                return Ok(());
            }
            if self.js.is_some() && self.owed == 0 {
                self.pull(max).await?;
            }
            let op = self.conn.next().await?;
            self.take(op, out);
            if !out.is_empty() && out.len() >= max {
                return Ok(());
            }
        }
    }

    /// Acknowledges the batch (JetStream; core NATS has nothing to ack).
    pub async fn ack(&mut self, batch: &[Msg]) -> Result<(), ShovelError> {
        let Some(last) = batch.last() else {
            return Ok(());
        };
        let mut out = Vec::new();
        while self.acks.front().is_some_and(|(t, _)| *t <= last.ack) {
            if let Some((_, reply)) = self.acks.pop_front() {
                pub_frame(&mut out, &reply, None, b"+ACK");
            }
        }
        if !out.is_empty() {
            self.conn.write(&out).await?;
        }
        Ok(())
    }
}

/// A NATS server published to.
pub struct NatsDest {
    conn: Conn,
    subject: Option<String>,
    jetstream: bool,
    subscribed: bool,
}

impl NatsDest {
    /// Connects.
    pub async fn open(
        uri: &str,
        subject: Option<String>,
        jetstream: bool,
    ) -> Result<Self, ShovelError> {
        Ok(NatsDest {
            conn: Conn::open(uri).await?,
            subject,
            jetstream,
            subscribed: false,
        })
    }

    /// Publishes the batch; with `confirm`, returns once the server (core
    /// NATS: a PONG after them) or the stream (JetStream: an ack each)
    /// confirmed every message.
    pub async fn send(&mut self, batch: &[Msg], confirm: bool) -> Result<(), ShovelError> {
        let mut out = Vec::new();
        let js = self.jetstream && confirm;
        if js && !self.subscribed {
            out.extend_from_slice(format!("SUB {}.> 1\r\n", self.conn.inbox).as_bytes());
            self.subscribed = true;
        }
        let reply = format!("{}.ack", self.conn.inbox);
        for m in batch {
            let subject = self.subject.as_deref().unwrap_or(&m.routing_key);
            if subject.is_empty() {
                return Err(ShovelError::Nacked("no NATS subject for a message".into()));
            }
            pub_frame(&mut out, subject, js.then_some(reply.as_str()), &m.body);
        }
        if confirm && !js {
            out.extend_from_slice(b"PING\r\n");
        }
        self.conn.write(&out).await?;
        if !confirm {
            return Ok(());
        }
        let mut acked = 0;
        loop {
            match self.conn.next().await? {
                Op::Pong if !js => return Ok(()),
                Op::Msg {
                    payload, status, ..
                } if js => {
                    if let Some(code) = status {
                        // 503: no stream listens on the subject.
                        return Err(ShovelError::Nacked(format!("JetStream status {code}")));
                    }
                    let v: serde_json::Value =
                        serde_json::from_slice(&payload).unwrap_or(serde_json::Value::Null);
                    if let Some(e) = v.get("error") {
                        return Err(ShovelError::Nacked(format!("JetStream: {e}")));
                    }
                    acked += 1;
                    if acked == batch.len() {
                        return Ok(());
                    }
                }
                _ => {}
            }
        }
    }
}
