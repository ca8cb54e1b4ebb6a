//! A tiny raw AMQP 0-9-1 client: hand-built frames for inputs no client
//! library will produce, and a reader of the server's frames.

use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

pub const PROTOCOL_HEADER: &[u8; 8] = b"AMQP\x00\x00\x09\x01";
pub const FRAME_METHOD: u8 = 1;
pub const FRAME_HEADER: u8 = 2;
pub const FRAME_BODY: u8 = 3;
pub const FRAME_HEARTBEAT: u8 = 8;
pub const FRAME_END: u8 = 0xCE;

/// One frame from the server.
#[derive(Debug, Clone)]
pub struct Frame {
    pub kind: u8,
    pub channel: u16,
    pub payload: Vec<u8>,
}

impl Frame {
    /// (class id, method id) of a method frame.
    pub fn method(&self) -> Option<(u16, u16)> {
        (self.kind == FRAME_METHOD && self.payload.len() >= 4).then(|| {
            (
                u16::from_be_bytes([self.payload[0], self.payload[1]]),
                u16::from_be_bytes([self.payload[2], self.payload[3]]),
            )
        })
    }
    fn args(&self) -> &[u8] {
        &self.payload[4..]
    }
}

/// What a connection.close or channel.close carried.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Close {
    pub channel: u16,
    pub code: u16,
    pub text: String,
    pub class_id: u16,
    pub method_id: u16,
}

pub fn shortstr(s: &str) -> Vec<u8> {
    let mut v = vec![s.len() as u8];
    v.extend_from_slice(s.as_bytes());
    v
}

pub fn longstr(s: &[u8]) -> Vec<u8> {
    let mut v = (s.len() as u32).to_be_bytes().to_vec();
    v.extend_from_slice(s);
    v
}

pub fn frame(kind: u8, channel: u16, payload: &[u8]) -> Vec<u8> {
    let mut v = vec![kind];
    v.extend_from_slice(&channel.to_be_bytes());
    v.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    v.extend_from_slice(payload);
    v.push(FRAME_END);
    v
}

pub fn method(channel: u16, class: u16, method: u16, args: &[u8]) -> Vec<u8> {
    let mut p = class.to_be_bytes().to_vec();
    p.extend_from_slice(&method.to_be_bytes());
    p.extend_from_slice(args);
    frame(FRAME_METHOD, channel, &p)
}

pub fn channel_open(ch: u16) -> Vec<u8> {
    method(ch, 20, 10, &shortstr(""))
}

pub fn channel_close(ch: u16) -> Vec<u8> {
    let mut a = 200u16.to_be_bytes().to_vec();
    a.extend(shortstr("bye"));
    a.extend_from_slice(&[0, 0, 0, 0]);
    method(ch, 20, 40, &a)
}

/// queue.declare (non-passive, auto-named unless `name` given).
pub fn queue_declare(ch: u16, name: &str) -> Vec<u8> {
    let mut a = vec![0, 0];
    a.extend(shortstr(name));
    a.push(0); // passive, durable, exclusive, auto-delete, no-wait all off
    a.extend_from_slice(&0u32.to_be_bytes()); // empty arguments table
    method(ch, 50, 10, &a)
}

pub fn exchange_declare(ch: u16, name: &str, kind: &str) -> Vec<u8> {
    let mut a = vec![0, 0];
    a.extend(shortstr(name));
    a.extend(shortstr(kind));
    a.push(0);
    a.extend_from_slice(&0u32.to_be_bytes());
    method(ch, 40, 10, &a)
}

pub fn basic_publish(ch: u16, exchange: &str, key: &str) -> Vec<u8> {
    let mut a = vec![0, 0];
    a.extend(shortstr(exchange));
    a.extend(shortstr(key));
    a.push(0);
    method(ch, 60, 40, &a)
}

/// Content header for class basic with no properties.
pub fn content_header(ch: u16, body_size: u64) -> Vec<u8> {
    let mut p = 60u16.to_be_bytes().to_vec();
    p.extend_from_slice(&0u16.to_be_bytes()); // weight
    p.extend_from_slice(&body_size.to_be_bytes());
    p.extend_from_slice(&0u16.to_be_bytes()); // property flags
    frame(FRAME_HEADER, ch, &p)
}

pub fn body(ch: u16, data: &[u8]) -> Vec<u8> {
    frame(FRAME_BODY, ch, data)
}

pub fn tx_select(ch: u16) -> Vec<u8> {
    method(ch, 90, 10, &[])
}

pub struct RawClient {
    pub stream: TcpStream,
    buf: Vec<u8>,
    /// frame_max the server offered in connection.tune.
    pub frame_max: u32,
}

const READ_TIMEOUT: Duration = Duration::from_secs(15);

impl RawClient {
    pub async fn connect(addr: std::net::SocketAddr) -> RawClient {
        let stream = TcpStream::connect(addr).await.expect("tcp connect");
        stream.set_nodelay(true).ok();
        RawClient {
            stream,
            buf: Vec::new(),
            frame_max: 0,
        }
    }

    /// Connects and completes the handshake as guest on vhost `/`.
    pub async fn open(addr: std::net::SocketAddr) -> RawClient {
        let mut c = Self::connect(addr).await;
        c.handshake("guest", "guest", "/").await.expect("handshake");
        c
    }

    pub async fn send(&mut self, bytes: &[u8]) {
        self.stream.write_all(bytes).await.expect("write");
    }

    /// Like [`send`](Self::send) but tolerates the server having gone.
    pub async fn try_send(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.stream.write_all(bytes).await
    }

    /// Reads raw bytes until EOF (or error), bounded.
    pub async fn read_to_eof(&mut self) -> Vec<u8> {
        let mut out = std::mem::take(&mut self.buf);
        let fut = async {
            let mut chunk = [0u8; 4096];
            loop {
                match self.stream.read(&mut chunk).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => out.extend_from_slice(&chunk[..n]),
                }
            }
        };
        tokio::time::timeout(READ_TIMEOUT, fut)
            .await
            .expect("server neither closed the socket nor stopped sending");
        out
    }

    /// Next frame, `None` on EOF/reset. Panics on timeout.
    pub async fn read_frame(&mut self) -> Option<Frame> {
        loop {
            if self.buf.len() >= 7 {
                let size = u32::from_be_bytes([self.buf[3], self.buf[4], self.buf[5], self.buf[6]])
                    as usize;
                if self.buf.len() >= 8 + size {
                    let f = Frame {
                        kind: self.buf[0],
                        channel: u16::from_be_bytes([self.buf[1], self.buf[2]]),
                        payload: self.buf[7..7 + size].to_vec(),
                    };
                    assert_eq!(
                        self.buf[7 + size],
                        FRAME_END,
                        "server frame lacks frame-end"
                    );
                    self.buf.drain(..8 + size);
                    return Some(f);
                }
            }
            let mut chunk = [0u8; 8192];
            let n = tokio::time::timeout(READ_TIMEOUT, self.stream.read(&mut chunk))
                .await
                .expect("timed out waiting for a frame");
            match n {
                Ok(0) | Err(_) => return None,
                Ok(n) => self.buf.extend_from_slice(&chunk[..n]),
            }
        }
    }

    /// Next method frame (skipping heartbeats).
    pub async fn read_method(&mut self) -> Option<Frame> {
        loop {
            let f = self.read_frame().await?;
            if f.kind == FRAME_HEARTBEAT {
                continue;
            }
            return Some(f);
        }
    }

    /// Expects a specific method next.
    pub async fn expect_method(&mut self, class: u16, method: u16) -> Frame {
        let f = self
            .read_method()
            .await
            .unwrap_or_else(|| panic!("EOF waiting for {class}.{method}"));
        assert_eq!(f.method(), Some((class, method)), "unexpected frame {f:?}");
        f
    }

    /// Reads until the server closes the connection (connection.close),
    /// answers close-ok and returns the close. Frames before it (e.g.
    /// replies to earlier methods) are skipped. `None` if the socket
    /// closed without a connection.close.
    pub async fn expect_connection_close(&mut self) -> Option<Close> {
        loop {
            let f = self.read_method().await?;
            if f.method() == Some((10, 50)) {
                let c = parse_close(&f);
                let _ = self.try_send(&method(0, 10, 51, &[])).await;
                return Some(c);
            }
        }
    }

    /// Reads until a channel.close arrives and answers close-ok.
    pub async fn expect_channel_close(&mut self) -> Option<Close> {
        loop {
            let f = self.read_method().await?;
            if f.method() == Some((10, 50)) {
                panic!(
                    "expected channel.close, got connection.close {:?}",
                    parse_close(&f)
                );
            }
            if f.method() == Some((20, 40)) {
                let c = parse_close(&f);
                let _ = self.try_send(&method(c.channel, 20, 41, &[])).await;
                return Some(c);
            }
        }
    }

    /// Client side of the handshake: header, start-ok (PLAIN), tune-ok,
    /// open. Returns the close if the server refused.
    pub async fn handshake(&mut self, user: &str, pass: &str, vhost: &str) -> Result<(), Close> {
        self.send(PROTOCOL_HEADER).await;
        self.expect_method(10, 10).await; // start
        let mut a = 0u32.to_be_bytes().to_vec(); // client-properties: empty table
        a.extend(shortstr("PLAIN"));
        a.extend(longstr(format!("\0{user}\0{pass}").as_bytes()));
        a.extend(shortstr("en_US"));
        self.send(&method(0, 10, 11, &a)).await;
        let f = self.read_method().await.ok_or_else(eof_close)?;
        if f.method() == Some((10, 50)) {
            let c = parse_close(&f);
            let _ = self.try_send(&method(0, 10, 51, &[])).await;
            return Err(c);
        }
        assert_eq!(
            f.method(),
            Some((10, 30)),
            "expected connection.tune, got {f:?}"
        );
        let args = f.args();
        let channel_max = u16::from_be_bytes([args[0], args[1]]);
        self.frame_max = u32::from_be_bytes([args[2], args[3], args[4], args[5]]);
        let mut t = channel_max.to_be_bytes().to_vec();
        t.extend_from_slice(&self.frame_max.to_be_bytes());
        t.extend_from_slice(&0u16.to_be_bytes()); // no heartbeats
        self.send(&method(0, 10, 31, &t)).await;
        let mut o = shortstr(vhost);
        o.extend(shortstr(""));
        o.push(0);
        self.send(&method(0, 10, 40, &o)).await;
        let f = self.read_method().await.ok_or_else(eof_close)?;
        if f.method() == Some((10, 50)) {
            let c = parse_close(&f);
            let _ = self.try_send(&method(0, 10, 51, &[])).await;
            return Err(c);
        }
        assert_eq!(
            f.method(),
            Some((10, 41)),
            "expected connection.open-ok, got {f:?}"
        );
        Ok(())
    }

    /// channel.open and wait for open-ok.
    pub async fn open_channel(&mut self, ch: u16) {
        self.send(&channel_open(ch)).await;
        let f = self.expect_method(20, 11).await;
        assert_eq!(f.channel, ch);
    }
}

fn eof_close() -> Close {
    Close {
        channel: 0,
        code: 0,
        text: "EOF".into(),
        class_id: 0,
        method_id: 0,
    }
}

pub fn parse_close(f: &Frame) -> Close {
    let a = f.args();
    let code = u16::from_be_bytes([a[0], a[1]]);
    let n = a[2] as usize;
    let text = String::from_utf8_lossy(&a[3..3 + n]).into_owned();
    let r = &a[3 + n..];
    Close {
        channel: f.channel,
        code,
        text,
        class_id: u16::from_be_bytes([r[0], r[1]]),
        method_id: u16::from_be_bytes([r[2], r[3]]),
    }
}
