//! AMQP 0-9-1, as RabbitMQ speaks it.
//!
//! * [`codec`]: cutting frames from bytes, writing frames (hot-path frames by hand).
//! * [`connection`]: the per-connection state machine (handshake, channels,
//!   content assembly, protocol errors, timers on the caller's clock)
//!   producing [`connection::Event`]s.
//! * [`depth`]: the nesting bound applied before any table reaches `amq-protocol`.
//! * [`sasl`]: PLAIN and AMQPLAIN responses.
//! * [`reply`]: reply codes.

pub mod codec;
pub mod connection;
pub mod depth;
pub mod reply;
pub mod sasl;

pub use amq_protocol::protocol::{self as methods, AMQPClass};
pub use amq_protocol::types;
pub use connection::{Connection, Event, Publish, ServerConfig, Timeout};
