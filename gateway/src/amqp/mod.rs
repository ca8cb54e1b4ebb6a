//! AMQP 0-9-1 sessions: the glue between the sans-IO adapter in
//! `weir-protocols` and the engine's per-client interface
//! ([`crate::engine::Client`]).
//!
//! * [`session`]: the connection task (socket loop, method handlers by
//!   class, delivery encoding, queued replies).
//! * [`convert`]: field tables to engine arguments, lazy message headers.

pub mod convert;
pub mod session;
