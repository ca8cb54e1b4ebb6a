//! The HTTP listener's connections: a bounded number at once (503 beyond
//! it), hyper's header-read timeout, and an idle timeout on the socket.
//!
//! axum's own `serve` has no connection limit and no timeouts, so this is
//! its accept loop with them: hyper's HTTP/1 builder (`header_read_timeout`,
//! a bounded read buffer) per connection, hyper-util's graceful shutdown.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::extract::connect_info::IntoMakeServiceWithConnectInfo;
use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Semaphore};
use tokio::time::{Instant, Sleep};
use tower_service::Service;

/// `[http]`'s connection limit and timeouts.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Most connections at once (None = no limit).
    pub max_connections: Option<usize>,
    /// Time to receive a request's headers, from when the connection is
    /// ready for them (opened, or its previous answer sent).
    pub header_timeout: Option<Duration>,
    /// Time a connection may move no byte either way.
    pub idle_timeout: Option<Duration>,
}

impl Limits {
    /// The limits of an `[http]` section (0 = none).
    pub fn of(c: &crate::config::HttpConfig) -> Self {
        let secs = |s: u64| (s > 0).then(|| Duration::from_secs(s));
        Limits {
            max_connections: (c.max_connections > 0).then_some(c.max_connections),
            header_timeout: secs(c.header_timeout),
            idle_timeout: secs(c.idle_timeout),
        }
    }
}

/// Largest read buffer of a connection: bounds a request's headers (431
/// beyond it) and what a connection holds while they trickle in.
const MAX_BUF: usize = 64 * 1024;
/// Connections over the limit being answered at once; more are closed
/// without an answer, so a flood cannot hold file descriptors this way.
const REFUSING_MAX: usize = 64;
/// How long a refused connection is given to take its 503.
const REFUSE_LINGER: Duration = Duration::from_secs(1);
/// Longest back-off after failed accepts (out of file descriptors).
const ACCEPT_BACKOFF_MAX: Duration = Duration::from_secs(1);

/// Serves `app` on `listener` until `shutdown` turns true; requests in
/// flight then finish (the caller bounds how long it waits).
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: Limits,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut make: IntoMakeServiceWithConnectInfo<Router, SocketAddr> =
        app.into_make_service_with_connect_info::<SocketAddr>();
    let mut http1 = hyper::server::conn::http1::Builder::new();
    http1
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .max_buf_size(MAX_BUF);
    let slots = limits.max_connections.map(|n| Arc::new(Semaphore::new(n)));
    let refusing = Arc::new(Semaphore::new(REFUSING_MAX));
    let graceful = GracefulShutdown::new();
    let mut backoff = Duration::from_millis(10);
    loop {
        let (tcp, peer) = tokio::select! {
            // (The guard `wait_for` returns is not Send: dropped inside.)
            _ = async { drop(shutdown.wait_for(|s| *s).await) } => break,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of file descriptors and the like: back off (the
                    // pending connection stays queued), keep serving.
                    tracing::warn!(error = %e, "HTTP accept failed");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(ACCEPT_BACKOFF_MAX);
                    continue;
                }
            },
        };
        backoff = Duration::from_millis(10);
        let permit = match &slots {
            None => None,
            Some(s) => match s.clone().try_acquire_owned() {
                Ok(p) => Some(p),
                Err(_) => {
                    if let Ok(r) = refusing.clone().try_acquire_owned() {
                        let max = limits.max_connections.unwrap_or(0);
                        tokio::spawn(async move {
                            refuse(tcp, max).await;
                            drop(r);
                        });
                    }
                    continue;
                }
            },
        };
        let _ = tcp.set_nodelay(true);
        let svc = match make.call(peer).await {
            Ok(svc) => svc,
            Err(never) => match never {},
        };
        let io = TokioIo::new(IdleStream::new(tcp, limits.idle_timeout));
        let conn = graceful.watch(http1.serve_connection(io, TowerToHyperService::new(svc)));
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(%peer, error = %e, "HTTP connection ended");
            }
            drop(permit);
        });
    }
    drop(listener);
    graceful.shutdown().await;
}

/// Answers a connection over the limit with a 503 and a JSON body, then
/// closes it (after reading what the client sent, so the close does not
/// reset the connection before the client read the answer).
async fn refuse(mut tcp: TcpStream, max: usize) {
    let body = format!(
        "{{\"error\":\"service_unavailable\",\"reason\":\"too many HTTP connections (at most {max})\"}}"
    );
    let answer = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nretry-after: 1\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = tokio::time::timeout(REFUSE_LINGER, async {
        tcp.write_all(answer.as_bytes()).await?;
        tcp.shutdown().await?;
        let mut sink = [0u8; 4096];
        while tcp.read(&mut sink).await? > 0 {}
        io::Result::Ok(())
    })
    .await;
}

/// A socket that fails with `TimedOut` once no byte has moved either way
/// for `limit` while an operation waits: a client that does not read its
/// answer, stalls its request body or says nothing at all. (hyper has a
/// header timeout but no timeout for writes or bodies.)
pub struct IdleStream {
    io: TcpStream,
    limit: Option<Duration>,
    /// Armed when an operation first waits after progress.
    deadline: Pin<Box<Sleep>>,
    armed: bool,
}

impl IdleStream {
    /// Wraps `io`; `None` never times out.
    pub fn new(io: TcpStream, limit: Option<Duration>) -> Self {
        IdleStream {
            io,
            limit,
            deadline: Box::pin(tokio::time::sleep(Duration::ZERO)),
            armed: false,
        }
    }

    /// The inner operation is waiting: wait on the deadline too.
    fn waiting<T>(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<T>> {
        let Some(limit) = self.limit else {
            return Poll::Pending;
        };
        if !self.armed {
            self.armed = true;
            self.deadline.as_mut().reset(Instant::now() + limit);
        }
        match self.deadline.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "HTTP connection idle",
            ))),
            Poll::Pending => Poll::Pending,
        }
    }

    /// Bytes moved: the idle clock starts again at the next wait.
    fn moved<T>(&mut self, r: Poll<io::Result<T>>, cx: &mut Context<'_>) -> Poll<io::Result<T>> {
        match r {
            Poll::Pending => self.waiting(cx),
            ready => {
                self.armed = false;
                ready
            }
        }
    }
}

impl AsyncRead for IdleStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.io).poll_read(cx, buf);
        this.moved(r, cx)
    }
}

impl AsyncWrite for IdleStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.io).poll_write(cx, buf);
        this.moved(r, cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.io).poll_write_vectored(cx, bufs);
        this.moved(r, cx)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}
