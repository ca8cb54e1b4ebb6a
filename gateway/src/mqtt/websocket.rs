//! MQTT over WebSocket (MQTT 5 section 6): the HTTP upgrade on path
//! `/mqtt` with subprotocol `mqtt`, then binary frames carrying the MQTT
//! byte stream, which a pump copies to and from an in-memory pipe the
//! ordinary session reads and writes. Packets may span frames and frames
//! may hold several packets: the session's adapter sees only bytes.
//!
//! Two bounds sit below the adapter, where tungstenite buffers: a whole
//! WebSocket message is read before the session sees a byte of it, so
//! until CONNACK success the socket yields at most [`PRE_LOGIN_SLACK`]
//! bytes beyond the largest CONNECT (upgrade request included; more:
//! close 1009); and answers to pings wait in a bounded write buffer,
//! further pongs to a client that does not read being coalesced into one.

use crate::server::Services;
use crate::session::io::PollWriter;
use futures_util::{SinkExt, StreamExt};
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio_tungstenite::tungstenite::handshake::server::{ErrorResponse, Request, Response};
use tokio_tungstenite::tungstenite::http::{HeaderValue, StatusCode};
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::protocol::{CloseFrame, WebSocketConfig};
use tokio_tungstenite::tungstenite::Message;

/// The path MQTT clients connect to.
const PATH: &str = "/mqtt";
/// The subprotocol they ask for (MQTT 5 6.0).
const SUBPROTOCOL: &str = "mqtt";
/// Bytes buffered between the WebSocket pump and the session, each way.
const PIPE: usize = 64 * 1024;
/// How long the HTTP upgrade may take.
const HANDSHAKE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);
/// How long a close frame may take to go out.
const CLOSE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);
/// Bytes read before login beyond the largest CONNECT: the upgrade request
/// (a browser's, cookies and all) and the frames' headers.
const PRE_LOGIN_SLACK: usize = 16 * 1024;
/// Pongs (and a close) waiting for a client that does not read, beyond one
/// frame of session output: past it further pongs replace the last one.
const CONTROL_BACKLOG: usize = 16 * 1024;

/// The socket under tungstenite: until `opened` is set, reads stop with an
/// error once `budget` bytes were read (tungstenite would otherwise buffer
/// a message of any configured size from a client that never logs in).
struct PreLogin<S> {
    inner: S,
    budget: usize,
    opened: Arc<AtomicBool>,
    /// `opened` was seen set: no more counting.
    open: bool,
    /// The budget ran out (to tell the client with close 1009).
    exceeded: Arc<AtomicBool>,
}

impl<S: AsyncRead + Unpin> AsyncRead for PreLogin<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        if !this.open && this.opened.load(Ordering::Acquire) {
            this.open = true;
        }
        if this.open {
            return Pin::new(&mut this.inner).poll_read(cx, buf);
        }
        if this.budget == 0 {
            this.exceeded.store(true, Ordering::Relaxed);
            return Poll::Ready(Err(std::io::Error::other(
                "more bytes than a CONNECT before login",
            )));
        }
        // Read into at most `budget` bytes of `buf` (zeroed first: only
        // before login, a few KB).
        let want = buf.remaining().min(this.budget);
        let mut limited = ReadBuf::new(buf.initialize_unfilled_to(want));
        let r = Pin::new(&mut this.inner).poll_read(cx, &mut limited);
        let n = limited.filled().len();
        if let Poll::Ready(Ok(())) = r {
            buf.advance(n);
            this.budget -= n;
        }
        r
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for PreLogin<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, data)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

/// Checks the upgrade request: path `/mqtt`, and subprotocol `mqtt` when
/// the client offers subprotocols (it is echoed back).
#[allow(clippy::result_large_err)] // tungstenite's callback signature
fn check_request(req: &Request, mut resp: Response) -> Result<Response, ErrorResponse> {
    if req.uri().path() != PATH {
        let mut e = ErrorResponse::new(Some(format!(
            "no WebSocket endpoint at {}; MQTT is at {PATH}",
            req.uri().path()
        )));
        *e.status_mut() = StatusCode::NOT_FOUND;
        return Err(e);
    }
    if let Some(offered) = req.headers().get("Sec-WebSocket-Protocol") {
        let ok = offered
            .to_str()
            .unwrap_or("")
            .split(',')
            .any(|p| p.trim().eq_ignore_ascii_case(SUBPROTOCOL));
        if !ok {
            let mut e = ErrorResponse::new(Some("the subprotocol must be mqtt".into()));
            *e.status_mut() = StatusCode::BAD_REQUEST;
            return Err(e);
        }
        resp.headers_mut().insert(
            "Sec-WebSocket-Protocol",
            HeaderValue::from_static(SUBPROTOCOL),
        );
    }
    Ok(resp)
}

/// Serves one accepted WebSocket connection (admitted by the listener:
/// [`super::MqttShared::admit`]): the upgrade, then an MQTT session over
/// the frames.
pub async fn serve(
    stream: TcpStream,
    peer: SocketAddr,
    services: Arc<Services>,
    shutdown: watch::Receiver<bool>,
) {
    let _ = stream.set_nodelay(true);
    serve_stream(stream, peer, None, services, shutdown).await;
}

/// [`serve`] over TLS (handshake done): MQTT over secure WebSocket. A
/// verified client certificate's CN is the user of a certificate login
/// (`mqtt.ssl_cert_login`).
pub async fn serve_tls(
    stream: crate::tls::TlsStream,
    peer: SocketAddr,
    identity: crate::tls::PeerIdentity,
    services: Arc<Services>,
    shutdown: watch::Receiver<bool>,
) {
    let cert_user = identity.verified.then_some(identity.common_name).flatten();
    serve_stream(stream, peer, cert_user, services, shutdown).await;
}

/// [`serve`] over any stream (`cert_user`: the CN of the client's
/// verified certificate).
async fn serve_stream<S>(
    stream: S,
    peer: SocketAddr,
    cert_user: Option<String>,
    shared: Arc<Services>,
    shutdown: watch::Receiver<bool>,
) where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let mut config = WebSocketConfig::default();
    // A frame or message larger than the largest MQTT packet is refused.
    let max = shared.mqtt.server.maximum_packet_size as usize + 16;
    config.max_message_size = Some(max);
    config.max_frame_size = Some(max);
    // Output is written at once (the pump flushes each frame anyway), and
    // what waits for a client that does not read is one frame of session
    // output plus a bounded backlog of pongs: tungstenite queues a pong per
    // ping otherwise, without a limit.
    config.write_buffer_size = 0;
    config.max_write_buffer_size = PIPE + 16 + CONTROL_BACKLOG;
    let opened = Arc::new(AtomicBool::new(false));
    let exceeded = Arc::new(AtomicBool::new(false));
    let stream = PreLogin {
        inner: stream,
        budget: shared.mqtt.server.maximum_connect_size as usize + PRE_LOGIN_SLACK,
        opened: opened.clone(),
        open: false,
        exceeded: exceeded.clone(),
    };
    let upgrade =
        tokio_tungstenite::accept_hdr_async_with_config(stream, check_request, Some(config));
    let ws = match tokio::time::timeout(HANDSHAKE_TIMEOUT, upgrade).await {
        Ok(Ok(ws)) => ws,
        Ok(Err(e)) => {
            tracing::debug!(%peer, error = %e, "MQTT WebSocket upgrade refused");
            return;
        }
        Err(_) => {
            tracing::debug!(%peer, "MQTT WebSocket upgrade timed out");
            return;
        }
    };
    let (session_end, pump_end) = tokio::io::duplex(PIPE);
    let (mut ws_tx, mut ws_rx) = ws.split();
    let (mut pipe_rd, mut pipe_wr) = tokio::io::split(pump_end);
    // Frames in → bytes to the session.
    let inbound = async move {
        while let Some(msg) = ws_rx.next().await {
            match msg {
                Ok(Message::Binary(b)) => {
                    if pipe_wr.write_all(&b).await.is_err() {
                        break;
                    }
                }
                Ok(Message::Close(_)) | Err(_) => break,
                // MQTT 5 6.0: text frames close the connection.
                Ok(Message::Text(_)) => break,
                // Pings are answered by tungstenite.
                Ok(_) => {}
            }
        }
        let _ = pipe_wr.shutdown().await;
    };
    // Either direction ending ends the pump (a client that closed needs
    // no more output; a finished session, no more input), then a close
    // frame goes out: 1009 when the client sent too much before login.
    let pump = tokio::spawn(async move {
        // Bytes from the session → binary frames out.
        let outbound = async {
            let mut buf = vec![0u8; PIPE];
            loop {
                match pipe_rd.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        let frame = Message::Binary(bytes::Bytes::copy_from_slice(&buf[..n]));
                        if ws_tx.send(frame).await.is_err() {
                            break;
                        }
                    }
                }
            }
        };
        tokio::select! {
            () = inbound => {}
            () = outbound => {}
        }
        let close = exceeded.load(Ordering::Relaxed).then(|| CloseFrame {
            code: CloseCode::Size,
            reason: "more than a CONNECT before login".into(),
        });
        // Bounded: a client that does not read gets no more time.
        let _ = tokio::time::timeout(CLOSE_TIMEOUT, ws_tx.send(Message::Close(close))).await;
    });
    let (rd, wr) = tokio::io::split(session_end);
    // A full pipe makes the session wait as a full socket does.
    super::session::serve_on(
        rd,
        PollWriter::new(wr),
        peer,
        cert_user,
        Some(opened),
        shared,
        shutdown,
    )
    .await;
    // The session dropped its pipe end: the pump sees EOF and closes.
    let _ = pump.await;
}
