//! The byte streams a session runs over, as the driver waits on them: a
//! TCP socket (its own readiness and non-blocking calls), or the halves of
//! a stream that can only be polled (a TLS stream, the pipe behind a
//! WebSocket).
//!
//! Writes never wait inside a turn: [`WriteSide::write_some`] takes what
//! the stream takes now, and the driver waits in [`WriteSide::write`]
//! among its other wake-ups, so a client that does not read cannot
//! deadlock one that does not write.

use bytes::BytesMut;
use futures_util::FutureExt;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite};
use tokio::net::TcpStream;

/// How a session sizes its read buffer.
#[derive(Clone, Copy, Debug)]
pub enum Buffers {
    /// Always room for this many bytes (a busy AMQP connection reads tens
    /// of thousands of frames per read).
    Fixed(usize),
    /// Sized by use: a connection that has been quiet holds no buffer
    /// while it waits and a small one when it reads, one that filled its
    /// small one a large one; the output buffer is given back when empty
    /// and larger than `keep_out` (an IoT fleet is mostly idle
    /// connections).
    Elastic {
        /// Read buffer of a connection that has been quiet.
        idle: usize,
        /// Read buffer of a connection that filled its small one.
        busy: usize,
        /// Output buffer kept when empty.
        keep_out: usize,
    },
}

/// The reading side of a connection.
pub trait ReadSide: Send {
    /// Resolves when a read may make progress (wake-ups may be spurious);
    /// a stream that cannot tell without reading resolves at once. Cancel
    /// safe.
    fn ready(&mut self) -> impl Future<Output = io::Result<()>> + Send;
    /// Reads what is there into `input` (0 = end of stream; `WouldBlock` =
    /// a spurious wake-up). Cancel safe: nothing is lost when it is
    /// dropped while waiting.
    fn read(&mut self, input: &mut BytesMut) -> impl Future<Output = io::Result<usize>> + Send;
    /// Reads what is there now without waiting (`WouldBlock` when nothing
    /// is).
    fn read_now(&mut self, input: &mut BytesMut) -> io::Result<usize>;
}

/// The writing side of a connection: non-blocking writes, and a wait for
/// room.
pub trait WriteSide: Send {
    /// Writes as much of `out` as the stream takes now, without waiting.
    fn write_some(&mut self, out: &mut BytesMut) -> io::Result<usize>;
    /// Bytes taken by [`Self::write_some`] that still wait inside the
    /// stream (a TLS record buffer) for the socket.
    fn has_unflushed(&self) -> bool;
    /// Waits until the stream takes some of `out` and writes it (taking
    /// it off `out`), or without `out` (or with it empty) until what the
    /// stream buffered went out. Returns the bytes taken. Cancel safe:
    /// what it did not return as written stays in `out`.
    fn write(
        &mut self,
        out: Option<&mut BytesMut>,
    ) -> impl Future<Output = io::Result<usize>> + Send;
}

// Readiness through `poll_*_ready` rather than `readable()` /
// `writable()`: the futures hold two references instead of a waiter node,
// and a session's task future (an idle MQTT connection's memory) carries
// them all.
impl ReadSide for &TcpStream {
    fn ready(&mut self) -> impl Future<Output = io::Result<()>> + Send {
        let s: &TcpStream = self;
        std::future::poll_fn(move |cx| s.poll_read_ready(cx))
    }

    fn read(&mut self, input: &mut BytesMut) -> impl Future<Output = io::Result<usize>> + Send {
        std::future::ready(self.try_read_buf(input))
    }

    fn read_now(&mut self, input: &mut BytesMut) -> io::Result<usize> {
        self.try_read_buf(input)
    }
}

impl WriteSide for &TcpStream {
    fn write_some(&mut self, out: &mut BytesMut) -> io::Result<usize> {
        let mut total = 0;
        while !out.is_empty() {
            match self.try_write(out) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => {
                    bytes::Buf::advance(out, n);
                    total += n;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => return Err(e),
            }
        }
        Ok(total)
    }

    fn has_unflushed(&self) -> bool {
        false
    }

    fn write(
        &mut self,
        out: Option<&mut BytesMut>,
    ) -> impl Future<Output = io::Result<usize>> + Send {
        let s: &TcpStream = self;
        let mut out = out.filter(|o| !o.is_empty());
        std::future::poll_fn(move |cx| {
            let Some(out) = out.as_deref_mut() else {
                // A socket buffers nothing of ours.
                return Poll::Ready(Ok(0));
            };
            loop {
                ready!(s.poll_write_ready(cx))?;
                match s.try_write(out) {
                    Ok(0) => return Poll::Ready(Err(io::ErrorKind::WriteZero.into())),
                    Ok(n) => {
                        bytes::Buf::advance(out, n);
                        return Poll::Ready(Ok(n));
                    }
                    // A spurious readiness: cleared by `try_write`, wait again.
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                    Err(e) => return Poll::Ready(Err(e)),
                }
            }
        })
    }
}

impl<T: AsyncRead + Send> ReadSide for tokio::io::ReadHalf<T> {
    /// Nothing to wait on without reading: the read waits.
    fn ready(&mut self) -> impl Future<Output = io::Result<()>> + Send {
        std::future::ready(Ok(()))
    }

    async fn read(&mut self, input: &mut BytesMut) -> io::Result<usize> {
        // AsyncRead's read_buf is cancel safe.
        self.read_buf(input).await
    }

    fn read_now(&mut self, input: &mut BytesMut) -> io::Result<usize> {
        self.read_buf(input)
            .now_or_never()
            .unwrap_or_else(|| Err(io::ErrorKind::WouldBlock.into()))
    }
}

/// A poll-based writer (a TLS stream's or a pipe's write half) driven the
/// way the session drives a socket: [`WriteSide::write_some`] is polled
/// with a no-op waker (it never waits), [`WriteSide::write`] with the
/// task's own, which registers it with whatever the stream waits on (the
/// socket under a TLS stream, the reader of a full pipe).
pub struct PollWriter<W> {
    inner: W,
    /// A flush returned Pending: bytes may sit in the stream's buffer.
    unflushed: bool,
}

impl<W> PollWriter<W> {
    /// Wraps a write half.
    pub fn new(inner: W) -> Self {
        PollWriter {
            inner,
            unflushed: false,
        }
    }
}

impl<W: AsyncWrite + Unpin + Send> PollWriter<W> {
    /// Pushes what the stream buffered towards the socket, without waiting
    /// (what it cannot take now waits for [`WriteSide::write`]).
    fn try_flush(&mut self) -> io::Result<()> {
        let mut cx = Context::from_waker(std::task::Waker::noop());
        self.unflushed = match Pin::new(&mut self.inner).poll_flush(&mut cx) {
            Poll::Ready(r) => {
                r?;
                false
            }
            Poll::Pending => true,
        };
        Ok(())
    }
}

impl<W: AsyncWrite + Unpin + Send> WriteSide for PollWriter<W> {
    fn write_some(&mut self, out: &mut BytesMut) -> io::Result<usize> {
        let mut cx = Context::from_waker(std::task::Waker::noop());
        let mut total = 0;
        while !out.is_empty() {
            match Pin::new(&mut self.inner).poll_write(&mut cx, out) {
                Poll::Ready(Ok(0)) => return Err(io::ErrorKind::WriteZero.into()),
                Poll::Ready(Ok(n)) => {
                    bytes::Buf::advance(out, n);
                    total += n;
                }
                Poll::Ready(Err(e)) => return Err(e),
                Poll::Pending => break,
            }
        }
        self.try_flush()?;
        Ok(total)
    }

    fn has_unflushed(&self) -> bool {
        self.unflushed
    }

    fn write(
        &mut self,
        out: Option<&mut BytesMut>,
    ) -> impl Future<Output = io::Result<usize>> + Send {
        let mut out = out.filter(|o| !o.is_empty());
        std::future::poll_fn(move |cx| {
            let Some(out) = out.as_deref_mut() else {
                // Flush is cancel safe: what it did not write stays
                // buffered.
                ready!(Pin::new(&mut self.inner).poll_flush(cx))?;
                self.unflushed = false;
                return Poll::Ready(Ok(0));
            };
            let n = ready!(Pin::new(&mut self.inner).poll_write(cx, out))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            // Taken off `out` in the same poll that wrote it: nothing is
            // lost if the future is dropped.
            bytes::Buf::advance(out, n);
            self.try_flush()?;
            Poll::Ready(Ok(n))
        })
    }
}

/// Reads what is there into `input`, sized by `buffers`. An elastic
/// buffer: bytes already waiting go into the buffer it has; a read that
/// would wait with an empty buffer gives the buffer back first and takes
/// one of the same size once the stream is readable, so an idle connection
/// holds none and a busy one keeps its own. Cancel safe, as its awaits are.
pub async fn read_some<R: ReadSide>(
    rd: &mut R,
    input: &mut BytesMut,
    buffers: Buffers,
) -> io::Result<usize> {
    match buffers {
        Buffers::Fixed(size) => {
            rd.ready().await?;
            input.reserve(size);
        }
        Buffers::Elastic { idle, busy, .. } => {
            if input.is_empty() {
                let size = input.capacity().clamp(idle, busy);
                if input.capacity() > 0 {
                    match rd.read_now(input) {
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                        r => return r,
                    }
                    *input = BytesMut::new();
                }
                rd.ready().await?;
                input.reserve(size);
            } else {
                // Room was made before the wait (see `prepare`).
                rd.ready().await?;
            }
        }
    }
    rd.read(input).await
}

/// Before a wait, an elastic buffer's housekeeping: a burst's large read
/// buffer is given back once empty (the last read was small), an empty
/// output buffer larger than `keep_out` too, and a read buffer about to
/// fill gets room (at most `limit`, the largest packet the adapter takes
/// now: before login only a small one).
pub fn prepare(
    buffers: Buffers,
    input: &mut BytesMut,
    out: &mut BytesMut,
    last_read: usize,
    limit: usize,
) {
    let Buffers::Elastic {
        idle,
        busy,
        keep_out,
    } = buffers
    else {
        return;
    };
    if input.is_empty() && input.capacity() > busy && last_read < idle {
        *input = BytesMut::new();
    }
    if out.is_empty() && out.capacity() > keep_out {
        *out = BytesMut::new();
    }
    if input.capacity() > 0 && input.capacity() - input.len() < idle / 2 {
        let is_busy = input.capacity() >= idle || !input.is_empty();
        input.reserve(if is_busy { busy.min(limit) } else { idle });
    }
}
