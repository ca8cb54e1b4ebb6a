//! A minimal AMQP 0-9-1 connection: framing over a tokio `TcpStream`, the connection handshake and
//! synchronous channel methods.
//!
//! Frames are encoded and decoded with `amq-protocol`'s codec (`gen_frame` / `parse_frame`); this module
//! only owns the buffers and the socket. There is exactly one channel per connection (channel 1),
//! because every load role (publisher, consumer) gets its own TCP connection anyway.

use std::fmt;
use std::net::SocketAddr;

use amq_protocol::frame::{
    gen_frame, parse_frame, AMQPContentHeader, AMQPFrame, ProtocolVersion, WriteContext,
};
use amq_protocol::protocol::{basic, channel, confirm, connection, AMQPClass, BasicProperties};
use amq_protocol::types::{AMQPValue, FieldTable, LongString, ShortString};
use amq_protocol::uri::AMQPUri;
use bytes::{Buf, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt, Interest};
use tokio::net::TcpStream;

/// The channel every connection of the benchmark uses.
pub const CHANNEL: u16 = 1;

/// Frame header (type, channel, size) plus the frame-end octet.
const FRAME_OVERHEAD: usize = 8;

/// frame_max we propose when the server leaves it unlimited (0). 128 KiB is RabbitMQ's default.
pub const DEFAULT_FRAME_MAX: u32 = 131_072;

/// An error with a human-readable chain of context, e.g. "publisher 1: handshake: connection refused".
#[derive(Debug)]
pub struct BenchError(pub String);

impl fmt::Display for BenchError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for BenchError {}

/// Result alias used across the crate.
pub type Result<T> = std::result::Result<T, BenchError>;

/// Shorthand to build an error from a message.
pub fn err<T>(msg: impl Into<String>) -> Result<T> {
    Err(BenchError(msg.into()))
}

/// Attach context to any displayable error (`.ctx("connecting")?`).
pub trait Context<T> {
    /// Prefix the error with `what`.
    fn ctx(self, what: impl fmt::Display) -> Result<T>;
}

impl<T, E: fmt::Display> Context<T> for std::result::Result<T, E> {
    fn ctx(self, what: impl fmt::Display) -> Result<T> {
        self.map_err(|e| BenchError(format!("{what}: {e}")))
    }
}

/// The encoded frames of one `basic.publish` on [`CHANNEL`] (method, content header, body frames)
/// of `size` bytes of `x`, the body split at `frame_max`; and the offset of the first body byte in
/// them (0 if the body is empty). Encoded once and copied per message by the publishers of both
/// tools.
#[allow(dead_code)] // used by weir-abuse, which compiles this file too
pub fn encode_publish(
    frame_max: u32,
    exchange: &str,
    routing_key: &str,
    size: usize,
    persistent: bool,
) -> Result<(Vec<u8>, usize)> {
    // delivery_mode 2 = persistent, 1 = transient.
    let props = BasicProperties::default().with_delivery_mode(if persistent { 2 } else { 1 });
    encode_publish_with(frame_max, exchange, routing_key, size, props)
}

/// [`encode_publish`] with the content header's properties given in full (priority, expiration...).
pub fn encode_publish_with(
    frame_max: u32,
    exchange: &str,
    routing_key: &str,
    size: usize,
    properties: BasicProperties,
) -> Result<(Vec<u8>, usize)> {
    let mut frames = vec![
        AMQPFrame::Method(
            CHANNEL,
            AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish {
                exchange: exchange.into(),
                routing_key: routing_key.into(),
                mandatory: false,
                immediate: false,
            })),
        ),
        AMQPFrame::Header(
            CHANNEL,
            AMQPContentHeader {
                class_id: 60,
                body_size: size as u64,
                properties,
            },
        ),
    ];
    // Bodies larger than a frame are split; 8 bytes of each frame are framing.
    let body = vec![b'x'; size];
    for part in body.chunks(frame_max as usize - FRAME_OVERHEAD) {
        frames.push(AMQPFrame::Body(CHANNEL, part.to_vec()));
    }
    let mut bytes = Vec::new();
    let mut body_offset = 0;
    for (i, frame) in frames.iter().enumerate() {
        if i == 2 {
            // Body frame payload starts after type (1) + channel (2) + size (4).
            body_offset = bytes.len() + 7;
        }
        bytes = encode(frame, bytes).ctx("encoding publish")?;
    }
    Ok((bytes, body_offset))
}

/// Append the encoding of `frame` to `buf`.
pub fn encode(frame: &AMQPFrame, buf: Vec<u8>) -> Result<Vec<u8>> {
    let (buf, _) = gen_frame(frame)(WriteContext::from(buf))
        .ctx("encoding frame")?
        .into_inner();
    Ok(buf)
}

/// Parse the next complete frame off the front of `rbuf`, if there is one. A frame announcing more
/// than `frame_max` (plus slack) is an error rather than something to wait for.
pub fn take_frame(rbuf: &mut BytesMut, frame_max: u32) -> Result<Option<AMQPFrame>> {
    let buf = &rbuf[..];
    if buf.len() < 7 {
        return Ok(None);
    }
    // Check completeness ourselves: cheaper than letting the parser fail with Incomplete, and it
    // lets us reject an absurd size before waiting forever for it.
    let size = u32::from_be_bytes([buf[3], buf[4], buf[5], buf[6]]) as usize;
    if size + FRAME_OVERHEAD > frame_max as usize + 4096 {
        return err(format!(
            "frame of {size} bytes exceeds frame_max {frame_max}"
        ));
    }
    if buf.len() < size + FRAME_OVERHEAD {
        return Ok(None);
    }
    match parse_frame(buf) {
        Ok((rest, frame)) => {
            let used = buf.len() - rest.len();
            rbuf.advance(used);
            Ok(Some(frame))
        }
        Err(e) => err(format!("malformed frame from server: {e}")),
    }
}

/// One AMQP connection with channel 1 open.
pub struct Conn {
    stream: TcpStream,
    /// Bytes read but not yet parsed into frames.
    rbuf: BytesMut,
    /// Frames encoded but not yet written; flushed with one `write_all` so a wakeup costs one syscall.
    pub wbuf: Vec<u8>,
    /// How much of `wbuf` [`Conn::pump`] has already written (always 0 for `flush` users).
    wpos: usize,
    /// Negotiated maximum frame size (including the 8 bytes of framing).
    pub frame_max: u32,
}

impl Conn {
    /// Connect, authenticate with PLAIN, tune, open the vhost and open channel 1.
    pub async fn open(uri: &AMQPUri) -> Result<Conn> {
        let host = &uri.authority.host;
        let port = uri.authority.port;
        let addr: SocketAddr = tokio::net::lookup_host((host.as_str(), port))
            .await
            .ctx(format!("resolving {host}:{port}"))?
            .next()
            .ok_or_else(|| BenchError(format!("{host}:{port} resolved to no address")))?;
        let stream = TcpStream::connect(addr)
            .await
            .ctx(format!("connecting to {addr}"))?;
        // Confirms and acks are tiny latency-sensitive frames; Nagle would hold them back.
        stream.set_nodelay(true).ctx("setting TCP_NODELAY")?;
        let mut conn = Conn {
            stream,
            rbuf: BytesMut::with_capacity(256 * 1024),
            wbuf: Vec::with_capacity(256 * 1024),
            wpos: 0,
            frame_max: DEFAULT_FRAME_MAX,
        };
        conn.handshake(uri)
            .await
            .ctx(format!("handshake with {addr}"))?;
        Ok(conn)
    }

    async fn handshake(&mut self, uri: &AMQPUri) -> Result<()> {
        self.push(&AMQPFrame::ProtocolHeader(ProtocolVersion::amqp_0_9_1()))?;
        self.flush().await?;

        let start = match self.recv_method(0).await? {
            AMQPClass::Connection(connection::AMQPMethod::Start(s)) => s,
            other => return err(format!("expected connection.start, got {other:?}")),
        };
        let mechanisms = String::from_utf8_lossy(start.mechanisms.as_bytes()).into_owned();
        if !mechanisms.split(' ').any(|m| m == "PLAIN") {
            return err(format!(
                "server does not offer PLAIN (offers: {mechanisms})"
            ));
        }

        let mut capabilities = FieldTable::default();
        // connection.blocked: brokers only send it to clients that say they understand it (the abuse
        // tool watches for it); authentication_failure_close: a refused login gets close 403, not EOF.
        for cap in [
            "publisher_confirms",
            "basic.nack",
            "consumer_cancel_notify",
            "connection.blocked",
            "authentication_failure_close",
        ] {
            capabilities.insert(ShortString::from(cap), AMQPValue::Boolean(true));
        }
        let mut props = FieldTable::default();
        props.insert(
            "product".into(),
            AMQPValue::LongString(LongString::from("weir-bench")),
        );
        props.insert("capabilities".into(), AMQPValue::FieldTable(capabilities));
        let user = &uri.authority.userinfo;
        let response = format!("\0{}\0{}", user.username, user.password);
        self.push_method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::StartOk(connection::StartOk {
                client_properties: props,
                mechanism: "PLAIN".into(),
                response: response.into(),
                locale: "en_US".into(),
            })),
        )?;
        self.flush().await?;

        let tune = match self.recv_method(0).await? {
            AMQPClass::Connection(connection::AMQPMethod::Tune(t)) => t,
            AMQPClass::Connection(connection::AMQPMethod::Secure(_)) => {
                return err("server sent connection.secure; only PLAIN is supported")
            }
            other => return err(format!("expected connection.tune, got {other:?}")),
        };
        self.frame_max = match tune.frame_max {
            0 => DEFAULT_FRAME_MAX,
            n => n.min(DEFAULT_FRAME_MAX),
        };
        if (self.frame_max as usize) < 4096 {
            return err(format!("server frame_max {} is too small", tune.frame_max));
        }
        self.push_method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::TuneOk(connection::TuneOk {
                channel_max: 1,
                frame_max: self.frame_max,
                // Heartbeats off: runs last seconds, and a missed heartbeat under saturation would only add
                // noise. Brokers honour 0 as "disabled".
                heartbeat: 0,
            })),
        )?;
        self.push_method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::Open(connection::Open {
                virtual_host: uri.vhost.as_str().into(),
            })),
        )?;
        self.flush().await?;
        match self.recv_method(0).await? {
            AMQPClass::Connection(connection::AMQPMethod::OpenOk(_)) => {}
            other => return err(format!("expected connection.open-ok, got {other:?}")),
        }

        let reply = self
            .call(AMQPClass::Channel(channel::AMQPMethod::Open(
                channel::Open {},
            )))
            .await
            .ctx("channel.open")?;
        match reply {
            AMQPClass::Channel(channel::AMQPMethod::OpenOk(_)) => Ok(()),
            other => err(format!("expected channel.open-ok, got {other:?}")),
        }
    }

    /// Encode a frame into the write buffer.
    pub fn push(&mut self, frame: &AMQPFrame) -> Result<()> {
        self.wbuf = encode(frame, std::mem::take(&mut self.wbuf))?;
        Ok(())
    }

    /// Encode a method frame into the write buffer.
    pub fn push_method(&mut self, channel: u16, method: AMQPClass) -> Result<()> {
        self.push(&AMQPFrame::Method(channel, method))
    }

    /// Write everything buffered in one call.
    pub async fn flush(&mut self) -> Result<()> {
        if self.wpos < self.wbuf.len() {
            self.stream
                .write_all(&self.wbuf[self.wpos..])
                .await
                .ctx("writing to socket")?;
        }
        self.wbuf.clear();
        self.wpos = 0;
        Ok(())
    }

    /// Bytes of `wbuf` not yet written by [`Conn::pump`].
    #[allow(dead_code)] // used by weir-abuse, which compiles this file too
    pub fn unwritten(&self) -> usize {
        self.wbuf.len() - self.wpos
    }

    /// Wait until the socket can make progress, then write what it takes of `wbuf` and read what has
    /// arrived. Unlike `flush`, it never blocks on a peer that stopped reading: frames the peer sends
    /// meanwhile (connection.blocked, close) are still read. Returns `false` on EOF.
    #[allow(dead_code)] // used by weir-abuse, which compiles this file too
    pub async fn pump(&mut self) -> Result<bool> {
        let want_write = self.wpos < self.wbuf.len();
        let interest = if want_write {
            Interest::READABLE | Interest::WRITABLE
        } else {
            Interest::READABLE
        };
        let ready = self.stream.ready(interest).await.ctx("polling socket")?;
        if want_write && ready.is_writable() {
            match self.stream.try_write(&self.wbuf[self.wpos..]) {
                Ok(n) => {
                    self.wpos += n;
                    if self.wpos == self.wbuf.len() {
                        self.wbuf.clear();
                        self.wpos = 0;
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => return err(format!("writing to socket: {e}")),
            }
        }
        if ready.is_readable() {
            if self.rbuf.capacity() - self.rbuf.len() < 64 * 1024 {
                self.rbuf.reserve(256 * 1024);
            }
            match self.stream.try_read_buf(&mut self.rbuf) {
                Ok(0) => return Ok(false),
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => return err(format!("reading from socket: {e}")),
            }
        }
        Ok(true)
    }

    /// Read whatever bytes are available (at least one); errors on EOF.
    pub async fn fill(&mut self) -> Result<()> {
        if self.rbuf.capacity() - self.rbuf.len() < 64 * 1024 {
            self.rbuf.reserve(256 * 1024);
        }
        let n = self
            .stream
            .read_buf(&mut self.rbuf)
            .await
            .ctx("reading from socket")?;
        if n == 0 {
            return err("server closed the connection");
        }
        Ok(())
    }

    /// Parse the next complete frame out of the read buffer, if there is one.
    pub fn next_frame(&mut self) -> Result<Option<AMQPFrame>> {
        take_frame(&mut self.rbuf, self.frame_max)
    }

    /// Wait for the next frame.
    pub async fn recv_frame(&mut self) -> Result<AMQPFrame> {
        loop {
            if let Some(frame) = self.next_frame()? {
                return Ok(frame);
            }
            self.fill().await?;
        }
    }

    /// Wait for the next method on `channel`, skipping heartbeats and connection.(un)blocked; a close
    /// from the server becomes an error carrying its reply code and text.
    pub async fn recv_method(&mut self, channel: u16) -> Result<AMQPClass> {
        loop {
            match self.recv_frame().await? {
                AMQPFrame::Method(_, AMQPClass::Connection(connection::AMQPMethod::Close(c))) => {
                    return err(format!(
                        "server closed the connection: {} {}",
                        c.reply_code,
                        c.reply_text.as_str()
                    ))
                }
                AMQPFrame::Method(_, AMQPClass::Channel(channel::AMQPMethod::Close(c))) => {
                    return err(format!(
                        "server closed the channel: {} {}",
                        c.reply_code,
                        c.reply_text.as_str()
                    ))
                }
                // A broker under a resource alarm may announce it at any time; it is not a reply.
                AMQPFrame::Method(
                    0,
                    AMQPClass::Connection(
                        connection::AMQPMethod::Blocked(_) | connection::AMQPMethod::Unblocked(_),
                    ),
                ) => {}
                AMQPFrame::Method(ch, m) if ch == channel => return Ok(m),
                AMQPFrame::Heartbeat => {}
                other => return err(format!("unexpected frame during setup: {other}")),
            }
        }
    }

    /// Send a synchronous method on channel 1 and wait for its reply.
    pub async fn call(&mut self, method: AMQPClass) -> Result<AMQPClass> {
        self.push_method(CHANNEL, method)?;
        self.flush().await?;
        self.recv_method(CHANNEL).await
    }

    /// Put channel 1 in confirm mode (`confirm.select`).
    pub async fn confirm_select(&mut self) -> Result<()> {
        let reply = self
            .call(AMQPClass::Confirm(confirm::AMQPMethod::Select(
                confirm::Select { nowait: false },
            )))
            .await
            .ctx("confirm.select")?;
        match reply {
            AMQPClass::Confirm(confirm::AMQPMethod::SelectOk(_)) => Ok(()),
            other => err(format!("expected confirm.select-ok, got {other:?}")),
        }
    }

    /// Close the connection politely (so brokers don't log "unexpectedly closed"), waiting at most
    /// one second and discarding any deliveries or confirms still in flight.
    pub async fn close(mut self) {
        let close = AMQPClass::Connection(connection::AMQPMethod::Close(connection::Close {
            reply_code: 200,
            reply_text: "bye".into(),
            class_id: 0,
            method_id: 0,
        }));
        let polite = async {
            self.push_method(0, close)?;
            self.flush().await?;
            loop {
                if let AMQPFrame::Method(
                    0,
                    AMQPClass::Connection(
                        connection::AMQPMethod::CloseOk(_) | connection::AMQPMethod::Close(_),
                    ),
                ) = self.recv_frame().await?
                {
                    return Ok::<(), BenchError>(());
                }
            }
        };
        // Best effort: the run's figures are already taken, so a failure here changes nothing.
        let _ = tokio::time::timeout(std::time::Duration::from_secs(1), polite).await;
    }
}
