//! Sans-IO protocol adapters for Weir.
//!
//! An adapter takes the bytes a client sent and returns the bytes to write back
//! plus the normalized operations for the engine. It never touches a socket and
//! holds no engine state, so every protocol is testable without a network.
//!
//! * [`amqp`]: AMQP 0-9-1 (RabbitMQ's dialect), framed with `amq-protocol`.
//! * [`mqtt`]: MQTT 3.1.1 and 5.0, packets encoded and decoded with
//!   `mqttbytes` behind the checks it does not make.
//! * [`Secret`]: a client's password, redacted when formatted.
#![forbid(unsafe_code)]

pub mod amqp;
pub mod mqtt;
mod secret;

pub use secret::Secret;
