//! Types shared by every store implementation.

use bytes::Bytes;
use std::collections::{BTreeMap, HashMap};

/// Unique, increasing id of a message for the life of a store.
pub type MessageId = u64;

/// Id of a segment file of the embedded log (a monotonically increasing number).
pub type SegmentId = u32;

/// Durable id of one partition of one queue: the unit of ordering, storage and
/// dispatch. Assigned by the engine and recorded in its metadata.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PartitionId(pub u64);

/// Where a record lives. For the embedded store: segment, byte offset of the
/// record's first byte, and the record's total length on disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Location {
    /// The segment holding the record.
    pub segment: SegmentId,
    /// Byte offset of the record within the segment.
    pub offset: u32,
    /// Length of the whole record (framing included).
    pub len: u32,
}

/// Attributes of a message that the engine needs without reading the body.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MessageAttrs {
    /// Priority (0 = lowest); unused until priority queues land.
    pub priority: u8,
    /// Absolute expiry in milliseconds since the Unix epoch; 0 = never.
    pub expires_at_ms: u64,
}

/// The content of a message as the engine hands it to the store.
#[derive(Clone, Copy, Debug)]
pub struct MessageData<'a> {
    /// The exchange it was published to.
    pub exchange: &'a str,
    /// The routing key it was published with.
    pub routing_key: &'a str,
    /// Opaque encoded properties/headers (the engine's format).
    pub header: &'a [u8],
    /// The body.
    pub body: &'a [u8],
    /// Attributes kept in memory by the engine.
    pub attrs: MessageAttrs,
}

/// One operation of an append batch.
#[derive(Clone, Debug)]
pub enum Op<'a> {
    /// A new message, live in each of `partitions` until settled there.
    Publish {
        /// The message id (from [`crate::Store::allocate_ids`]).
        id: MessageId,
        /// Every durable partition it was routed to (at least one).
        partitions: &'a [PartitionId],
        /// The message.
        data: MessageData<'a>,
    },
    /// The message `id` is settled (acked, purged, dropped) in `partition`.
    /// `location` is where the engine last saw it, so the store can account for
    /// the space it frees.
    Settle {
        /// The partition it leaves.
        partition: PartitionId,
        /// The message.
        id: MessageId,
        /// Its current location.
        location: Location,
    },
    /// Copies the live message `id` of `partition` forward from `from` into the
    /// head of the log, so the segment of `from` can be reclaimed. Produces a
    /// new location; the old copy no longer counts as live for `partition`.
    Relocate {
        /// The partition it lives in.
        partition: PartitionId,
        /// The message.
        id: MessageId,
        /// Its current location.
        from: Location,
    },
    /// Sets a metadata key.
    PutMeta {
        /// The key (engine-encoded).
        key: &'a [u8],
        /// The value (engine-encoded).
        value: &'a [u8],
    },
    /// Removes a metadata key.
    DeleteMeta {
        /// The key.
        key: &'a [u8],
    },
}

/// A message read back from the store.
#[derive(Clone, Debug)]
pub struct StoredMessage {
    /// Its id.
    pub id: MessageId,
    /// The exchange it was published to.
    pub exchange: String,
    /// The routing key it was published with.
    pub routing_key: String,
    /// Opaque encoded properties.
    pub header: Bytes,
    /// The body.
    pub body: Bytes,
    /// Attributes.
    pub attrs: MessageAttrs,
}

/// A live message found at recovery, without its body.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RecoveredMessage {
    /// Its id.
    pub id: MessageId,
    /// Where it lives now.
    pub location: Location,
    /// Length of header plus body, for byte counters and prefetch-size.
    pub size: u32,
    /// Attributes.
    pub attrs: MessageAttrs,
}

/// Everything the store found when it was opened.
#[derive(Debug, Default)]
pub struct Recovered {
    /// The metadata map at the last durable change, and its version.
    pub meta: BTreeMap<Vec<u8>, Vec<u8>>,
    /// The version of `meta`: the number of metadata changes ever made.
    pub meta_version: u64,
    /// Live messages per partition, in id order.
    pub partitions: HashMap<PartitionId, Vec<RecoveredMessage>>,
    /// Records dropped from a torn or corrupt tail (nothing confirmed is among
    /// them: they were never fsynced).
    pub truncated_bytes: u64,
}

/// Store counters.
#[derive(Clone, Copy, Debug, Default)]
pub struct StoreStats {
    /// Bytes appended since open.
    pub appended_bytes: u64,
    /// Number of fsyncs since open.
    pub syncs: u64,
    /// Number of segment files on disk.
    pub segments: u64,
    /// Total bytes of segment files on disk.
    pub disk_bytes: u64,
    /// Segments reclaimed since open.
    pub reclaimed_segments: u64,
}

/// Store failures.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// An I/O error, with what was being done.
    #[error("{context}: {source}")]
    Io {
        /// What failed.
        context: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// A record failed its checksum or could not be decoded where it must be intact.
    #[error("corrupt record at segment {segment} offset {offset}: {reason}")]
    Corrupt {
        /// Segment.
        segment: SegmentId,
        /// Offset.
        offset: u64,
        /// Why.
        reason: String,
    },
    /// A read named a location that holds no record.
    #[error("no record at {0:?}")]
    NotFound(Location),
    /// A single record is larger than the store accepts.
    #[error("record of {0} bytes exceeds the limit")]
    TooLarge(usize),
    /// The store is closed, or its writer failed earlier (after an fsync
    /// failure nothing further is acknowledged).
    #[error("store is closed")]
    Closed,
}

impl StoreError {
    /// Wraps an I/O error with context.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        StoreError::Io {
            context: context.into(),
            source,
        }
    }
}
