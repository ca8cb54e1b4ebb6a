//! Stream queues (`x-queue-type: stream`): append-only partitions read by
//! offset, as RabbitMQ 3.10's streams are read over AMQP.
//!
//! * `log.rs` — [`StreamLog`]: one per partition of a stream queue. Every
//!   event gets a dense per-partition offset (from 0) and a publish time;
//!   what the process keeps per stored event is a **sparse index**, one
//!   [`log::Chunk`] per up to [`log::CHUNK_EVENTS`] events (its first
//!   offset, position and times, its bytes), plus a bounded hot tail of the
//!   newest events in memory. Retention (`x-max-age`, `x-max-length-bytes`,
//!   policy `max-age`) drops whole chunks with one `Op::Truncate`.
//! * `reader.rs` — a consumer's cursor, kept by the engine client that
//!   subscribed: it reads forward from a chunk's position
//!   ([`weir_backend::Store::read_from`]) or from the hot tail, as far as
//!   the consumer's credit allows; acks only give credit back.
//! * `offset.rs` — `x-stream-offset` (`first`, `last`, `next`, a number, a
//!   timestamp, an interval such as `1h`) and `x-max-age` texts.
//!
//! The first offset a partition keeps survives restarts in the state
//! store (key [`state_key`]), written before each truncation.

mod log;
mod offset;
pub(crate) mod reader;

pub use log::{Refusal, StreamLog, StreamStats, Truncation};
pub use offset::{parse_age, OffsetSpec, OffsetSpecError};

use weir_backend::PartitionId;

/// The prefix of the state store's keys for streams.
pub const STATE_PREFIX: &[u8] = b"x\0";

/// The state-store key of a stream partition's retention point.
pub fn state_key(p: PartitionId) -> Vec<u8> {
    let mut k = STATE_PREFIX.to_vec();
    k.extend_from_slice(&p.0.to_be_bytes());
    k
}

/// The partition a state-store key of [`STATE_PREFIX`] names.
pub fn partition_of_key(key: &[u8]) -> Option<PartitionId> {
    let rest = key.strip_prefix(STATE_PREFIX)?;
    Some(PartitionId(u64::from_be_bytes(rest.try_into().ok()?)))
}

/// The header every stream delivery carries: its offset (a long).
pub const OFFSET_HEADER: &str = "x-stream-offset";
