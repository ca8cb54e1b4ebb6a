//! MQTT 3.1.1 and 5.0: the listener's sessions over the engine.
//!
//! * [`session`]: one connection's task (socket I/O around the sans-IO
//!   adapter `weir_protocols::mqtt`, events onto an engine client).
//! * [`convert`]: topics ⇄ routing keys, MQTT messages ⇄ the engine's
//!   message properties.
//! * [`registry`]: connected client ids (takeover) and delayed wills.
//! * [`websocket`]: MQTT over WebSocket (`/mqtt`, subprotocol `mqtt`).

pub mod convert;
pub mod registry;
pub mod session;
pub mod websocket;

use weir_protocols::mqtt::ServerConfig;

/// What every MQTT connection shares.
pub struct MqttShared {
    /// The adapter's limits.
    pub server: ServerConfig,
    /// Connected client ids and delayed wills.
    pub registry: registry::Registry,
    /// Most MQTT connections at once (0 = no limit).
    pub max_connections: usize,
    /// Most messages queued per session (0 = no limit); beyond it the
    /// oldest are dropped.
    pub max_queued_messages: u64,
    /// Longest session expiry granted, seconds (0 = no limit).
    pub max_session_expiry_secs: u32,
    /// Over TLS, a verified client certificate's CN logs in without a
    /// password (`mqtt.ssl_cert_login`).
    pub ssl_cert_login: bool,
    /// Most subscriptions of one session (0 = no limit).
    pub max_subscriptions: usize,
}
