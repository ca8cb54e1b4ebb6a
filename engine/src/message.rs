//! Messages and queue entries.

use crate::properties::HeaderFormat;
use bytes::Bytes;
use std::sync::Arc;
use weir_backend::{Location, MessageId};

/// A published message. Shared (`Arc`) by every queue it was routed to; its
/// byte fields are slices of the buffer it arrived in, never copied per queue.
#[derive(Debug)]
pub struct Message {
    /// Store-wide id (also used for transient messages, so ids order everything).
    pub id: MessageId,
    /// Exchange it was published to.
    pub exchange: Bytes,
    /// Routing key it was published with.
    pub routing_key: Bytes,
    /// Encoded properties in `header_format`: for an AMQP publisher, the
    /// raw AMQP property block, passed through untouched to AMQP consumers.
    pub properties: Bytes,
    /// The body.
    pub body: Bytes,
    /// The encoding of `properties`, stored with the message as its header
    /// tag (one byte: it sits in `Message`'s padding).
    pub header_format: HeaderFormat,
    /// Persistent (delivery-mode 2): stored when routed to a durable queue.
    pub persistent: bool,
    /// Priority.
    pub priority: u8,
    /// The publisher's own time to live in ms, relative to its enqueue in
    /// each queue (AMQP's `expiration` property, already checked as
    /// RabbitMQ checks it); None when it has none.
    pub ttl_ms: Option<u64>,
}

impl Message {
    /// Bytes counted against prefetch-size, queue byte counters and
    /// `x-max-length-bytes`: the body only, as RabbitMQ counts them.
    pub fn size(&self) -> u32 {
        self.body.len().min(u32::MAX as usize) as u32
    }
}

/// One message's place in one partition.
///
/// Kept small: a queue holds one per queued message, and a million queued
/// messages must cost well under 100 bytes each. The body is dropped from
/// memory (`message: None`) once a durable entry sits deep in a queue; it is
/// read back from the store when delivered.
#[derive(Debug, Clone)]
pub struct Entry {
    /// Position in the partition: FIFO order, and where a requeue puts it back.
    pub seq: u64,
    /// The message id.
    pub id: MessageId,
    /// Where the store keeps it (durable queue, persistent message).
    pub location: Option<Location>,
    /// Size (the body's length, as RabbitMQ counts queue bytes).
    pub size: u32,
    /// Delivered before (or possibly before: recovered after a restart).
    pub redelivered: bool,
    /// Times delivered.
    pub attempts: u16,
    /// Priority level in its partition (0 unless the queue has `x-max-priority`).
    pub priority: u8,
    /// When it entered the queue (ms since epoch), for oldest-message age.
    pub enqueued_ms: u64,
    /// When it expires (ms since epoch; 0 = never): the lower of the
    /// queue's TTL and the message's own.
    pub expires_at_ms: u64,
    /// The message, while it is kept in memory.
    pub message: Option<Arc<Message>>,
}

// A million queued messages must cost well under 100 B each (DESIGN §6).
const _: () = assert!(std::mem::size_of::<Entry>() <= 64);

impl Entry {
    /// The id a tombstone carries: an entry removed from the middle of a
    /// ready list (expired) and skipped until the list sheds it. Store ids
    /// count up from 1 and never reach it.
    pub(crate) const TOMBSTONE_ID: u64 = u64::MAX;

    /// Whether this is a tombstone (see [`Entry::TOMBSTONE_ID`]).
    pub(crate) fn is_tombstone(&self) -> bool {
        self.id == Self::TOMBSTONE_ID
    }
}
