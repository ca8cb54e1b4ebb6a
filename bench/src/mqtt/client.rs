//! One MQTT 3.1.1 connection over a tokio `TcpStream`: buffers, CONNECT/CONNACK, SUBSCRIBE/SUBACK,
//! and packet-at-a-time reads. The load roles drive it by hand, like weir-bench's `Conn`.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

use bytes::{Buf, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};

use crate::conn::{err, BenchError, Context, Result};
use crate::wire::{self, ConnectOpts, Packet};

/// How long a handshake step (CONNACK, SUBACK) may take before the run gives up.
const REPLY_TIMEOUT: Duration = Duration::from_secs(60);

/// Where and as whom to connect.
#[derive(Debug, Clone)]
pub struct Target {
    pub addr: SocketAddr,
    pub user: Option<String>,
    pub pass: Option<String>,
    /// Spread connections over source addresses 127.0.0.2 .. 127.0.0.251 (loopback targets only):
    /// one source address has ~28,000 ephemeral ports, and thousands of connections per run, a
    /// few runs in a row, leave that many in TIME_WAIT.
    pub spread: bool,
}

impl Target {
    /// The source address of connection number `i`, if spread.
    fn local_for(&self, i: usize) -> Option<SocketAddr> {
        (self.spread && self.addr.ip().is_loopback() && self.addr.is_ipv4()).then(|| {
            let host = 2 + (i % 250) as u8;
            SocketAddr::new(IpAddr::V4(Ipv4Addr::new(127, 0, 0, host)), 0)
        })
    }
}

/// An open MQTT connection (CONNACK received).
pub struct MqttConn {
    stream: TcpStream,
    /// Bytes read and not yet parsed.
    rbuf: BytesMut,
    /// Read size: `rbuf` is grown by this much before each read.
    read_chunk: usize,
    /// Packets encoded and not yet written; written with one `write_all` per wake-up.
    pub wbuf: Vec<u8>,
    next_packet_id: u16,
}

impl MqttConn {
    /// Connect (from the `i`-th source address when spreading) and complete CONNECT/CONNACK.
    /// Returns the connection and CONNACK's session-present flag. `read_chunk` sizes the read
    /// buffer: small for thousands of idle or fan-out connections, larger for the load roles.
    pub async fn open(
        t: &Target,
        i: usize,
        client_id: &str,
        clean_session: bool,
        keep_alive: u16,
        read_chunk: usize,
    ) -> Result<(MqttConn, bool)> {
        let stream = match t.local_for(i) {
            Some(local) => {
                let s = TcpSocket::new_v4().ctx("socket")?;
                s.bind(local).ctx(format!("binding {local}"))?;
                s.connect(t.addr).await
            }
            None => TcpStream::connect(t.addr).await,
        }
        .ctx(format!("connecting to {}", t.addr))?;
        // PUBACKs are tiny and latency-sensitive; Nagle would hold them back.
        stream.set_nodelay(true).ctx("setting TCP_NODELAY")?;
        let mut c = MqttConn {
            stream,
            rbuf: BytesMut::with_capacity(read_chunk),
            read_chunk,
            wbuf: Vec::new(),
            next_packet_id: 0,
        };
        wire::connect(
            &mut c.wbuf,
            &ConnectOpts {
                client_id,
                user: t.user.as_deref(),
                pass: t.pass.as_deref(),
                clean_session,
                keep_alive,
            },
        );
        c.flush().await.ctx("sending CONNECT")?;
        match c.reply().await.ctx("waiting for CONNACK")? {
            Packet::ConnAck {
                session_present,
                code: 0,
            } => Ok((c, session_present)),
            Packet::ConnAck { code, .. } => err(format!("CONNACK refused the connection: {code}")),
            other => err(format!("expected CONNACK, got {other:?}")),
        }
    }

    /// The next packet, waiting for it (bounded by [`REPLY_TIMEOUT`]).
    async fn reply(&mut self) -> Result<Packet> {
        tokio::time::timeout(REPLY_TIMEOUT, async {
            loop {
                if let Some(p) = self.next()? {
                    return Ok(p);
                }
                self.fill().await?;
            }
        })
        .await
        .map_err(|_| BenchError(format!("no reply within {REPLY_TIMEOUT:?}")))?
    }

    /// Subscribe to `filter` at `qos`; returns the granted QoS. Deliveries that arrive before the
    /// SUBACK (a persistent session's backlog) are an error: sessions start fresh.
    pub async fn subscribe(&mut self, filter: &str, qos: u8) -> Result<u8> {
        let id = self.packet_id();
        wire::subscribe(&mut self.wbuf, id, filter, qos);
        self.flush().await.ctx("sending SUBSCRIBE")?;
        match self.reply().await.ctx("waiting for SUBACK")? {
            Packet::SubAck { packet_id, code } if packet_id == id => {
                if code == 0x80 {
                    return err(format!("subscription to {filter} refused"));
                }
                Ok(code)
            }
            other => err(format!("expected SUBACK, got {other:?}")),
        }
    }

    fn packet_id(&mut self) -> u16 {
        self.next_packet_id = self.next_packet_id.checked_add(1).unwrap_or(1);
        self.next_packet_id
    }

    /// Read whatever the socket has (at least one byte). The broker closing is an error.
    pub async fn fill(&mut self) -> Result<()> {
        if self.rbuf.capacity() - self.rbuf.len() < self.read_chunk / 2 {
            self.rbuf.reserve(self.read_chunk);
        }
        let n = self.stream.read_buf(&mut self.rbuf).await.ctx("reading")?;
        if n == 0 {
            return err("the broker closed the connection");
        }
        Ok(())
    }

    /// The next complete packet in the read buffer, if any.
    #[inline]
    pub fn next(&mut self) -> Result<Option<Packet>> {
        match wire::parse(&self.rbuf)? {
            Some((p, n)) => {
                self.rbuf.advance(n);
                Ok(Some(p))
            }
            None => Ok(None),
        }
    }

    /// Write everything in `wbuf`.
    pub async fn flush(&mut self) -> Result<()> {
        if self.wbuf.is_empty() {
            return Ok(());
        }
        self.stream.write_all(&self.wbuf).await.ctx("writing")?;
        self.wbuf.clear();
        Ok(())
    }

    /// Whether the broker still holds the connection open: nothing to read and no EOF. Only for
    /// connections that expect nothing (the idle ones).
    pub fn alive(&self) -> bool {
        let mut b = [0u8; 64];
        match self.stream.try_read(&mut b) {
            Ok(0) => false,
            Ok(_) => true, // something unexpected, but the connection is open
            Err(e) => e.kind() == std::io::ErrorKind::WouldBlock,
        }
    }

    /// Send DISCONNECT (a clean end: no will, the session kept if persistent) and close.
    pub async fn close(mut self) {
        wire::disconnect(&mut self.wbuf);
        let _ = tokio::time::timeout(Duration::from_secs(5), self.flush()).await;
        let _ = self.stream.shutdown().await;
    }

    /// [`MqttConn::close`] without waiting: for thousands of connections at the end of a run.
    pub fn close_now(mut self) {
        wire::disconnect(&mut self.wbuf);
        let _ = self.stream.try_write(&self.wbuf);
    }
}

/// Open `n` connections, at most `concurrency` handshakes at a time (a burst of thousands would
/// overflow the broker's listen backlog and wait out SYN retransmits). `open(i)` opens the `i`-th;
/// the result is in index order.
pub async fn open_many<F, Fut, T>(n: usize, concurrency: usize, open: F) -> Result<Vec<T>>
where
    F: Fn(usize) -> Fut,
    Fut: std::future::Future<Output = Result<T>> + Send + 'static,
    T: Send + 'static,
{
    let mut set = tokio::task::JoinSet::new();
    let mut out: Vec<Option<T>> = (0..n).map(|_| None).collect();
    let collect = |r: std::result::Result<(usize, Result<T>), tokio::task::JoinError>,
                   out: &mut Vec<Option<T>>|
     -> Result<()> {
        let (i, r) = r.ctx("connection task")?;
        out[i] = Some(r.ctx(format!("connection {i}"))?);
        Ok(())
    };
    for i in 0..n {
        if set.len() >= concurrency.max(1) {
            if let Some(r) = set.join_next().await {
                collect(r, &mut out)?;
            }
        }
        let f = open(i);
        set.spawn(async move { (i, f.await) });
    }
    while let Some(r) = set.join_next().await {
        collect(r, &mut out)?;
    }
    Ok(out.into_iter().flatten().collect())
}
