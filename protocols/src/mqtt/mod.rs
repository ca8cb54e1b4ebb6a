//! MQTT 3.1.1 and 5.0, server side, without I/O.
//!
//! Packets are encoded and decoded by the `mqttbytes` crate (v4 = 3.1.1 and
//! v5 codecs), behind the checks it does not make (see `wire.rs`); this
//! module is the per-connection state machine around them: the CONNECT
//! handshake and version detection, keep-alive, packet ids and the in-flight
//! windows both ways (receive maximum), topic aliases both ways, maximum
//! packet size both ways, topic name and filter validation, and every
//! protocol error as the reason code the version allows (MQTT 5: CONNACK /
//! DISCONNECT with a reason code and string; 3.1.1: CONNACK return code or
//! closing the connection).
//!
//! Driving it is the same loop as the AMQP adapter: append read bytes to an
//! input buffer and call [`Connection::poll`] until it returns `None`, acting
//! on each [`Event`]; answer with the methods of [`Connection`] (they encode
//! into [`Connection::out`]); sleep until [`Connection::poll_timeout`] and
//! call [`Connection::handle_timeout`]; write `out` to the socket; hang up
//! once [`Connection::is_finished`] and `out` is empty. [`Connection`] says
//! exactly how a connection ends.
//!
//! # Layout
//!
//! * `connection`: [`Connection`], its phases, packet dispatch, endings.
//! * `handshake`: CONNECT (version detection, validation), CONNACK,
//!   DISCONNECT both ways.
//! * `inbound`: PUBLISH from the client, topic aliases, receive maximum,
//!   PUBACK / PUBREC / PUBREL / PUBCOMP for them.
//! * `outbound`: PUBLISH to the client, packet ids, the client's receive
//!   maximum and packet size, outgoing aliases, the client's acks.
//! * `subscribe`: SUBSCRIBE / UNSUBSCRIBE, SUBACK / UNSUBACK.
//! * `timers`: CONNECT timeout and keep-alive.
//! * `wire`: framing, property blocks, and what `mqttbytes` gets wrong.
//! * `topic`: topic name and filter checks, `$share`, matching.
//! * `config`, `event`, `reason`: what the session configures, receives,
//!   and the reason codes.

mod config;
mod connection;
mod event;
mod handshake;
mod inbound;
mod outbound;
pub mod reason;
mod subscribe;
mod timers;
mod topic;
mod wire;

pub use config::{ServerConfig, DEFAULT_MAXIMUM_CONNECT_SIZE};
pub use connection::Connection;
pub use event::*;
pub use outbound::{OutgoingPublish, SendError};
pub use timers::Timeout;
pub use topic::{validate_filter, validate_topic, SharedFilter, TopicError};
pub use wire::{MAX_USER_PROPERTIES, MAX_USER_PROPERTY_BYTES};
