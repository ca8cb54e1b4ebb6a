//! MQTT 3.1.1 and 5.0: the listener's sessions over the engine.
//!
//! * [`session`]: one connection's task (socket I/O around the sans-IO
//!   adapter `weir_protocols::mqtt`, events onto an engine client).
//! * [`message_format`]: topics ⇄ routing keys, MQTT publishes ⇄ the
//!   engine's messages (the MQTT header codec, number 3).
//! * [`registry`]: connected client ids (takeover) and delayed wills.
//! * [`websocket`]: MQTT over WebSocket (`/mqtt`, subprotocol `mqtt`).
//! * [`Mqtt`], [`MqttWebSocket`]: how the listeners hand them a connection.

pub mod message_format;
pub mod registry;
pub mod session;
pub mod websocket;

use crate::server::{Door, Services};
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use tokio::net::TcpStream;
use tokio::sync::watch;
use weir_protocols::mqtt::ServerConfig;

/// MQTT sockets that may be open beyond `max_connections`: room for
/// clients over the limit to be told so (CONNACK 0x97) rather than cut
/// off. Each costs at most the CONNECT size for the CONNECT timeout.
pub const LOGIN_HEADROOM: usize = 256;

/// What every MQTT connection shares.
pub struct MqttShared {
    /// The adapter's limits.
    pub server: ServerConfig,
    /// Connected client ids and delayed wills.
    pub registry: registry::Registry,
    /// Most MQTT clients logged in at once (0 = no limit).
    pub max_connections: usize,
    /// MQTT sockets open (TCP, WebSocket, TLS), logged in or not.
    pub open: Arc<AtomicUsize>,
    /// Most messages queued per session (0 = no limit); beyond it the
    /// oldest are dropped.
    pub max_queued_messages: u64,
    /// Longest session expiry granted, seconds (0 = no limit).
    pub max_session_expiry_secs: u32,
    /// Over TLS, a verified client certificate's CN logs in without a
    /// password (`mqtt.ssl_cert_login`).
    pub ssl_cert_login: bool,
    /// Anonymous clients log in as this user (`mqtt.allow_anonymous`,
    /// `mqtt.default_user`); `None`: they are refused.
    pub anonymous_user: Option<String>,
    /// Most subscriptions of one session (0 = no limit).
    pub max_subscriptions: usize,
}

impl MqttShared {
    /// A slot for a new MQTT socket, or `None` (close it at once) when
    /// `max_connections` + [`LOGIN_HEADROOM`] are open: what clients that
    /// never log in can hold is bounded. Released when the slot drops.
    pub fn admit(&self) -> Option<OpenSlot> {
        let n = self.open.fetch_add(1, Ordering::Relaxed);
        let slot = OpenSlot(self.open.clone());
        if self.max_connections > 0 && n >= self.max_connections.saturating_add(LOGIN_HEADROOM) {
            return None;
        }
        Some(slot)
    }
}

/// One open MQTT socket, counted in [`MqttShared::open`] while held.
pub struct OpenSlot(Arc<AtomicUsize>);

impl Drop for OpenSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// MQTT over TCP (`[mqtt] listen`, and `tls_listen` for MQTTS).
pub struct Mqtt;

/// MQTT over WebSocket (`[mqtt] ws_listen`, and `wss_listen` over TLS).
pub struct MqttWebSocket;

impl Door for Mqtt {
    type Slot = OpenSlot;

    fn admit(services: &Services) -> Option<OpenSlot> {
        services.mqtt.admit()
    }

    fn serve(
        stream: TcpStream,
        peer: SocketAddr,
        services: Arc<Services>,
        shutdown: watch::Receiver<bool>,
    ) -> impl Future<Output = ()> + Send + 'static {
        session::serve(stream, peer, services, shutdown)
    }

    fn serve_tls(
        stream: crate::tls::TlsStream,
        identity: crate::tls::PeerIdentity,
        peer: SocketAddr,
        services: Arc<Services>,
        shutdown: watch::Receiver<bool>,
    ) -> impl Future<Output = ()> + Send + 'static {
        session::serve_tls(stream, peer, identity, services, shutdown)
    }
}

impl Door for MqttWebSocket {
    type Slot = OpenSlot;

    fn admit(services: &Services) -> Option<OpenSlot> {
        services.mqtt.admit()
    }

    fn serve(
        stream: TcpStream,
        peer: SocketAddr,
        services: Arc<Services>,
        shutdown: watch::Receiver<bool>,
    ) -> impl Future<Output = ()> + Send + 'static {
        websocket::serve(stream, peer, services, shutdown)
    }

    fn serve_tls(
        stream: crate::tls::TlsStream,
        identity: crate::tls::PeerIdentity,
        peer: SocketAddr,
        services: Arc<Services>,
        shutdown: watch::Receiver<bool>,
    ) -> impl Future<Output = ()> + Send + 'static {
        websocket::serve_tls(stream, peer, identity, services, shutdown)
    }
}
