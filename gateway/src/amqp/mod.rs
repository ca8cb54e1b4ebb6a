//! AMQP 0-9-1 sessions: the glue between the sans-IO adapter in
//! `weir-protocols` and the engine.
//!
//! * [`session`]: the connection task (socket I/O, event handling).
//! * [`channel`]: per-channel state (consumers, leases, confirms).
//! * [`convert`]: field tables to engine arguments, lazy message headers.

pub mod channel;
pub mod convert;
pub mod session;
