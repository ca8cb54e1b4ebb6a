//! AMQP 0-9-1 sessions: the glue between the sans-IO adapter in
//! `weir-protocols` and the engine's per-client interface
//! ([`crate::engine::Client`]).
//!
//! * [`session`]: the connection task (socket loop, method handlers by
//!   class, delivery encoding, queued replies).
//! * [`headers`]: AMQP's basic property block ⇄ the engine's properties
//!   (the AMQP header codec, number 1), field tables to engine arguments.

pub mod headers;
pub mod session;
