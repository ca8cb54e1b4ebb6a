//! MQTT 3.1.1 and 5.0, server side, without I/O.
//!
//! Packets are encoded and decoded by the `mqttbytes` crate (v4 = 3.1.1 and
//! v5 codecs); this module is the per-connection state machine around them:
//! the CONNECT handshake and version detection, keep-alive, packet ids and
//! the in-flight windows both ways (receive maximum), topic aliases both
//! ways, maximum packet size both ways, topic name and filter validation, and
//! every protocol error as the reason code the version allows (MQTT 5:
//! CONNACK / DISCONNECT with a reason code and string; 3.1.1: CONNACK return
//! code or closing the connection).
//!
//! Driving it is the same loop as the AMQP adapter: append read bytes to an
//! input buffer and call [`Connection::poll`] until it returns `None`, acting
//! on each [`Event`]; answer with the methods of [`Connection`] (they encode
//! into [`Connection::out`]); sleep until [`Connection::poll_timeout`] and
//! call [`Connection::handle_timeout`]; write `out` to the socket; hang up
//! once [`Connection::is_finished`] and `out` is empty.

mod connection;
mod event;
mod topic;

pub use connection::{Connection, OutgoingPublish, SendError, ServerConfig};
pub use event::*;
pub use topic::{matches, validate_filter, validate_topic, SharedFilter, TopicError};
