//! What the server offers a client.

/// Limits and identity the server advertises.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// Largest frame accepted and offered in connection.tune.
    pub frame_max: u32,
    /// Highest channel number offered.
    pub channel_max: u16,
    /// Heartbeat interval offered, in seconds (0 disables).
    pub heartbeat: u16,
    /// Largest message body accepted (RabbitMQ's `max_message_size`).
    pub max_message_size: u64,
    /// Most bytes that incomplete messages (publish seen, body not yet
    /// complete) on all channels of one connection may hold together
    /// ([`Connection::partial_content_bytes`](super::Connection::partial_content_bytes)); `None` means
    /// [`Self::max_message_size`]. One incomplete message is always allowed
    /// up to `max_message_size`, so this bounds how far many channels can
    /// multiply it. A frame that would pass the limit while other channels
    /// hold content closes its channel with 406 PRECONDITION_FAILED.
    pub max_partial_content: Option<u64>,
    /// Product version string.
    pub version: String,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            frame_max: 131_072,
            channel_max: 2047,
            heartbeat: 60,
            max_message_size: 128 * 1024 * 1024,
            max_partial_content: None,
            version: env!("CARGO_PKG_VERSION").to_string(),
        }
    }
}
