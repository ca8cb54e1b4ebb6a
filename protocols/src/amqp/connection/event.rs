//! What a connection hands to the session.

use crate::Secret;
use amq_protocol::protocol::AMQPClass;
use bytes::Bytes;

/// A message assembled from basic.publish, its content header and body frames.
#[derive(Clone, Debug)]
pub struct Publish {
    /// Target exchange name.
    pub exchange: Bytes,
    /// Routing key.
    pub routing_key: Bytes,
    /// Return it if unroutable.
    pub mandatory: bool,
    /// Deprecated `immediate` flag (refused, as RabbitMQ does).
    pub immediate: bool,
    /// The raw property block (flags and values), kept verbatim for delivery.
    pub properties: Bytes,
    /// delivery-mode 2.
    pub persistent: bool,
    /// The `priority` property.
    pub priority: Option<u8>,
    /// The body.
    pub body: Bytes,
}

/// What the engine has to act on.
#[derive(Debug)]
pub enum Event {
    /// The client chose a mechanism and sent credentials. Answer with
    /// [`Connection::accept_login`](super::Connection::accept_login) or [`Connection::refuse_login`](super::Connection::refuse_login).
    Login {
        /// PLAIN or AMQPLAIN.
        mechanism: String,
        /// User name.
        username: String,
        /// Password (its `Debug` prints `<redacted>`; `&password` derefs
        /// to `&str`).
        password: Secret,
    },
    /// connection.update-secret (RabbitMQ's extension, for credentials
    /// that expire): answer with
    /// [`Connection::accept_update_secret`](super::Connection::accept_update_secret)
    /// or [`Connection::refuse_update_secret`](super::Connection::refuse_update_secret).
    UpdateSecret {
        /// The new secret (its `Debug` prints `<redacted>`).
        secret: Secret,
        /// Why the client sends it.
        reason: String,
    },
    /// connection.open: answer with [`Connection::accept_open`](super::Connection::accept_open) or close.
    OpenVhost {
        /// The virtual host (tenant) asked for.
        vhost: String,
    },
    /// A channel was opened (open-ok already queued).
    ChannelOpened(u16),
    /// A channel is gone: the client closed it (close-ok already queued), or
    /// this connection closed it for a content error (message too large,
    /// partial-content cap; channel.close already queued). Release its state.
    ChannelClosed(u16),
    /// A channel-level method for the engine.
    Method {
        /// Channel.
        channel: u16,
        /// The method.
        method: AMQPClass,
    },
    /// basic.qos, with the prefetch-size `amq-protocol` does not keep.
    Qos {
        /// Channel.
        channel: u16,
        /// Byte limit (0 = none).
        prefetch_size: u32,
        /// Message limit (0 = none).
        prefetch_count: u16,
        /// Channel-wide rather than per consumer.
        global: bool,
    },
    /// A complete message.
    Publish {
        /// Channel.
        channel: u16,
        /// The message.
        message: Publish,
    },
    /// basic.ack from a consumer.
    Ack {
        /// Channel.
        channel: u16,
        /// Tag.
        delivery_tag: u64,
        /// Up to and including the tag.
        multiple: bool,
    },
    /// channel.flow from the client (flow-ok already queued).
    Flow {
        /// Channel.
        channel: u16,
        /// Deliveries allowed.
        active: bool,
    },
    /// The client closed the connection (close-ok queued). Flush and hang up.
    Closed,
}
