//! Types shared by every store implementation.

use bytes::Bytes;
use std::collections::BTreeMap;

/// Unique, increasing id of a message for the life of a store.
pub type MessageId = u64;

/// Id of a segment file of the embedded log (a monotonically increasing number).
pub type SegmentId = u32;

/// Durable id of one partition of one queue: the unit of ordering, storage and
/// dispatch. Assigned by the engine and recorded in its metadata.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PartitionId(pub u64);

/// Where a stored message lives: an opaque position that each store defines
/// for itself (the embedded log encodes segment, offset and length; a
/// FoundationDB store would encode a versionstamp). The engine only keeps it
/// and hands it back to the store that returned it.
///
/// Twelve bytes with 4-byte alignment, so `Option<Location>` (16 bytes) in
/// every queue entry costs no more than before positions were opaque.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Location {
    words: [u32; 3],
}

const _: () = assert!(std::mem::size_of::<Location>() == 12);
const _: () = assert!(std::mem::size_of::<Option<Location>>() == 16);

impl Location {
    /// A position from its three words; only stores build positions.
    pub(crate) const fn from_words(words: [u32; 3]) -> Self {
        Location { words }
    }

    /// The three words a store encoded.
    pub(crate) const fn words(self) -> [u32; 3] {
        self.words
    }
}

impl std::fmt::Debug for Location {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let [a, b, c] = self.words;
        write!(f, "Location({a}:{b}:{c})")
    }
}

/// Every live position the engine holds, walked by [`crate::Store::compact`].
pub trait LiveSet {
    /// Calls `visit` once for every live (partition, message) whose position
    /// the caller keeps: ready and leased entries alike. The caller holds the
    /// partition's lock while visiting its entries, so a settle that runs
    /// concurrently sees the position `visit` wrote back. `visit` may replace
    /// the position (the store moved the record).
    fn for_each_live(&self, visit: &mut dyn FnMut(PartitionId, MessageId, &mut Location));
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
    /// What encoding `header` is in: opaque to the store, defined by the
    /// engine (e.g. 1 = AMQP 0-9-1 property block, 2 = Weir's neutral
    /// encoding). Stored with the record and returned by reads.
    pub header_format: u8,
    /// Opaque encoded properties/headers, in the `header_format` encoding.
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
    /// A message paged out of memory: a transient message, or one in a
    /// non-durable queue, that sits too deep in its queue to stay in RAM.
    /// Produces a [`Location`] like [`Op::Publish`] and counts as live (for
    /// reclamation) until settled, but is never worth an fsync and is
    /// ignored by recovery: a restart drops it, as it must.
    Page {
        /// The message id.
        id: MessageId,
        /// The partitions it is queued in (at least one).
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
    /// The tag of `header`'s encoding, as appended ([`MessageData::header_format`]).
    pub header_format: u8,
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

/// The metadata a store holds, as returned by
/// [`crate::Store::recovered_meta`].
#[derive(Debug, Default, Clone)]
pub struct RecoveredMeta {
    /// The metadata map at the last durable change.
    pub meta: BTreeMap<Vec<u8>, Vec<u8>>,
    /// The version of `meta`: the number of metadata changes ever made.
    pub version: u64,
    /// Bytes of a torn tail dropped when the store was opened (nothing
    /// confirmed is among them: they were never made durable).
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
    /// Another process holds the data directory's lock.
    #[error(
        "data directory {} is in use by another weir process{}; refusing to share it",
        dir.display(),
        holder.map(|p| format!(" (pid {p})")).unwrap_or_default()
    )]
    Locked {
        /// The data directory.
        dir: std::path::PathBuf,
        /// The pid written into the lock file by the holder, if readable.
        holder: Option<u32>,
    },
    /// Damage in the log that is not a torn tail: valid records follow it (or
    /// it is in a sealed segment), so it may hold confirmed data. The store
    /// refuses to open rather than drop it silently.
    #[error("{0}. Refusing to start so that nothing confirmed is dropped silently: run `weir repair` with the same --data-dir (or start with --repair) to move the damaged range into quarantine/ and keep every valid record")]
    Damaged(Box<Damage>),
    /// The disk is full: the store only accepts records that free space
    /// (settles, metadata) until space is available again.
    #[error("no space left for new messages in the store (disk full)")]
    NoSpace,
    /// The data directory was written in an on-disk format this build does
    /// not read (an older Weir without versioned segments, or a newer one).
    /// Nothing was changed.
    #[error("data directory {} holds a log in format {found} ({}), but this build of weir reads log format {expected}. Nothing was changed. {advice}", dir.display(), file.display())]
    UnsupportedFormat {
        /// The data directory.
        dir: std::path::PathBuf,
        /// The first file in the unsupported format.
        file: std::path::PathBuf,
        /// The format found (0 = segments without a header, before versions).
        found: u32,
        /// The format this build reads and writes.
        expected: u32,
        /// What to do about it.
        advice: String,
    },
}

/// A damaged byte range of a segment file found at recovery.
#[derive(Debug, Clone)]
pub struct Damage {
    /// The segment file.
    pub file: std::path::PathBuf,
    /// The segment.
    pub segment: SegmentId,
    /// First damaged byte.
    pub offset: u64,
    /// Length of the damaged range (up to the next valid record).
    pub len: u64,
    /// Why the first record there was rejected.
    pub reason: String,
    /// What the range held, as far as its record headers are readable.
    pub lost: Vec<LostRecord>,
}

impl std::fmt::Display for Damage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "corrupt data in log segment {} at offset {} ({} bytes: {}), not a torn tail; lost: ",
            self.file.display(),
            self.offset,
            self.len,
            self.reason
        )?;
        if self.lost.is_empty() {
            write!(
                f,
                "bytes {}..{} (no readable record header)",
                self.offset,
                self.offset + self.len
            )?;
        }
        for (i, l) in self.lost.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{l}")?;
        }
        Ok(())
    }
}

/// One record (or unreadable stretch) inside a damaged range.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LostRecord {
    /// A message record (publish, page or relocated copy).
    Message {
        /// Its id.
        id: MessageId,
        /// The partitions it was live in.
        partitions: Vec<PartitionId>,
    },
    /// A settle: the message may come back after repair (a duplicate, not a loss).
    Settle {
        /// The partition.
        partition: PartitionId,
        /// The message.
        id: MessageId,
    },
    /// A metadata change (a declare, bind or delete may be undone).
    Meta {
        /// Its version.
        version: u64,
    },
    /// Bytes with no readable record header.
    Unreadable {
        /// Offset in the segment.
        offset: u64,
        /// Length.
        len: u64,
    },
}

impl std::fmt::Display for LostRecord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LostRecord::Message { id, partitions } => {
                write!(
                    f,
                    "message id {id} in partitions {:?}",
                    partitions.iter().map(|p| p.0).collect::<Vec<_>>()
                )
            }
            LostRecord::Settle { partition, id } => {
                write!(
                    f,
                    "settle of message {id} in partition {} (it may be delivered again)",
                    partition.0
                )
            }
            LostRecord::Meta { version } => write!(f, "metadata change version {version}"),
            LostRecord::Unreadable { offset, len } => {
                write!(f, "{len} unreadable bytes at offset {offset}")
            }
        }
    }
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
