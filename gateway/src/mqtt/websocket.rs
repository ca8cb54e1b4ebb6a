//! MQTT over WebSocket (MQTT 5 section 6): the HTTP upgrade on path
//! `/mqtt` with subprotocol `mqtt`, then binary frames carrying the MQTT
//! byte stream, which a pump copies to and from an in-memory pipe the
//! ordinary session reads and writes. Packets may span frames and frames
//! may hold several packets: the session's adapter sees only bytes.

use crate::server::Shared;
use futures_util::{SinkExt, StreamExt};
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio_tungstenite::tungstenite::handshake::server::{ErrorResponse, Request, Response};
use tokio_tungstenite::tungstenite::http::{HeaderValue, StatusCode};
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
use tokio_tungstenite::tungstenite::Message;

/// The path MQTT clients connect to.
const PATH: &str = "/mqtt";
/// The subprotocol they ask for (MQTT 5 6.0).
const SUBPROTOCOL: &str = "mqtt";
/// Bytes buffered between the WebSocket pump and the session, each way.
const PIPE: usize = 64 * 1024;
/// How long the HTTP upgrade may take.
const HANDSHAKE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

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

/// Serves one accepted WebSocket connection: the upgrade, then an MQTT
/// session over the frames.
pub async fn serve(
    stream: TcpStream,
    peer: SocketAddr,
    shared: Arc<Shared>,
    shutdown: watch::Receiver<bool>,
) {
    let _ = stream.set_nodelay(true);
    serve_stream(stream, peer, None, shared, shutdown).await;
}

/// [`serve`] over any stream: a TLS stream for MQTT over secure WebSocket
/// (`cert_user`: the CN of the client's verified certificate, for
/// `mqtt.ssl_cert_login`).
pub async fn serve_stream<S>(
    stream: S,
    peer: SocketAddr,
    cert_user: Option<String>,
    shared: Arc<Shared>,
    shutdown: watch::Receiver<bool>,
) where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let mut config = WebSocketConfig::default();
    // A frame or message larger than the largest MQTT packet is refused.
    let max = shared.mqtt.server.maximum_packet_size as usize + 16;
    config.max_message_size = Some(max);
    config.max_frame_size = Some(max);
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
    // Bytes from the session → binary frames out.
    let outbound = async move {
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
        let _ = ws_tx.close().await;
    };
    // Either direction ending ends the pump (a client that closed needs
    // no more output; a finished session, no more input).
    let pump = tokio::spawn(async move {
        tokio::select! {
            () = inbound => {}
            () = outbound => {}
        }
    });
    let (rd, wr) = tokio::io::split(session_end);
    // The pipe buffers nothing that needs a flush.
    super::session::serve_inner(rd, wr, peer, cert_user, false, shared, shutdown).await;
    // The session dropped its pipe end: the pump sees EOF and closes.
    let _ = pump.await;
}
