//! The limits and identity the server offers (from the configuration).

use super::event::QoS;
use std::time::Duration;

/// [`ServerConfig::maximum_connect_size`] by default: room for a client
/// id, a user name, a token-sized password (a JWT) and a small will.
pub const DEFAULT_MAXIMUM_CONNECT_SIZE: u32 = 8 * 1024;

/// Limits and identity the server offers (from the configuration).
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// Largest packet accepted from a client, fixed header included (MQTT 5
    /// CONNACK maximum packet size; larger packets: 0x95 packet too large
    /// on MQTT 5, the connection closed on 3.1.1). Checked as soon as the
    /// fixed header arrived, before the body is buffered.
    pub maximum_packet_size: u32,
    /// Largest CONNECT accepted, fixed header included: what a client may
    /// make the server buffer before it logged in (larger: CONNACK 0x95 on
    /// MQTT 5, the connection closed on 3.1.1; checked at the fixed header,
    /// so a larger one is never buffered). At most `maximum_packet_size`.
    pub maximum_connect_size: u32,
    /// QoS 1/2 publishes a client may have unacknowledged towards us
    /// (CONNACK receive maximum; more: 0x93). MQTT 5 only: 3.1.1 has no
    /// such limit on the wire, so the session paces a 3.1.1 client by
    /// reading less ([`super::Connection::incoming_in_flight`]).
    pub receive_maximum: u16,
    /// Topic aliases a client may use towards us (CONNACK), and the most
    /// the server uses towards a client (which may allow fewer).
    pub topic_alias_maximum: u16,
    /// Most levels in a topic name or filter (more: 0x90 / 0x8F).
    pub max_topic_levels: usize,
    /// Time allowed between accepting the socket and a complete CONNECT.
    pub connect_timeout: Duration,
    /// Server keep-alive imposed on clients asking for none or a longer
    /// one (MQTT 5 only; `None`: the client's own).
    pub server_keep_alive: Option<u16>,
    /// Whether `$share/...` filters are accepted (CONNACK shared
    /// subscription available).
    pub shared_subscriptions: bool,
    /// Highest QoS accepted (CONNACK maximum QoS).
    pub maximum_qos: QoS,
    /// Whether retained messages are supported (CONNACK retain available).
    pub retain_available: bool,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            maximum_packet_size: 1 << 20,
            maximum_connect_size: DEFAULT_MAXIMUM_CONNECT_SIZE,
            receive_maximum: 1024,
            topic_alias_maximum: 64,
            max_topic_levels: 32,
            connect_timeout: Duration::from_secs(10),
            server_keep_alive: None,
            shared_subscriptions: true,
            maximum_qos: QoS::ExactlyOnce,
            retain_available: true,
        }
    }
}
