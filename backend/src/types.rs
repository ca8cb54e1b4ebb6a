//! Types shared by every store implementation.

use bytes::Bytes;
use std::collections::BTreeMap;

/// Unique, increasing id of a message for the life of a store.
pub type MessageId = u64;

/// The fair-share tag of an append: whose work it is, as the store's
/// write fairness sees it. An opaque number the caller picks (the engine
/// uses one per tenant); the store never learns what it stands for, it only
/// keeps one tag from filling every commit round ahead of the others (see
/// [`crate::Store::append_for`]). [`ShareTag::BROKER`] is work of the broker
/// itself and is never held back.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ShareTag(pub u32);

impl ShareTag {
    /// The broker's own work (timers, recovery, definitions), and every
    /// append made through [`crate::Store::append`].
    pub const BROKER: ShareTag = ShareTag(0);
}

/// What the store says about a share tag after one of its appends.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Admission {
    /// Several tags have work waiting for the writer, more than one round's
    /// budget of it, and this tag holds more than its share. A caller
    /// should stop producing for this tag until its appends so far are
    /// durable (a barrier): then the others' appends are not queued behind
    /// its backlog. Never set while a single tag is writing.
    pub over_share: bool,
}

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
    /// A position from three words the store chose. Only the store that
    /// built a position gives it meaning: a store in another crate encodes
    /// its own (a key, a versionstamp) and decodes it with
    /// [`Location::words`]. A store should tag one word so that positions of
    /// another store are recognized as such (a read of one is
    /// [`StoreError::NotFound`]).
    pub const fn from_words(words: [u32; 3]) -> Self {
        Location { words }
    }

    /// The three words the store encoded, as given to
    /// [`Location::from_words`].
    pub const fn words(self) -> [u32; 3] {
        self.words
    }
}

impl std::fmt::Debug for Location {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let [a, b, c] = self.words;
        write!(f, "Location({a}:{b}:{c})")
    }
}

/// Every live position the engine holds, shown to [`crate::Store::compact`].
///
/// Compaction runs in three phases so that no caller lock is held across
/// disk I/O: [`LiveSet::for_each_live`] collects the positions (under the
/// caller's locks, quickly), the store then reads the records worth moving
/// and appends copies with no caller lock held, and [`LiveSet::relocate`]
/// swaps the positions in (under the caller's locks again) where they did
/// not change meanwhile.
pub trait LiveSet {
    /// Calls `visit` once for every live (partition, message, position) the
    /// caller keeps: ready and leased entries alike. `visit` is quick (it
    /// only collects), so the caller may hold its partition locks around it.
    fn for_each_live(&self, visit: &mut dyn FnMut(PartitionId, MessageId, Location));

    /// For each of `moves` (in any order): if the caller still holds
    /// `(partition, id)` at `old`, it replaces that position with `new` and
    /// reports `true` at the same index of the returned vector. It reports
    /// `false` when the message left meanwhile (settled, moved, purged): a
    /// settle or move wins over compaction, and the copy at `new` is garbage
    /// the store accounts as such. The result has exactly `moves.len()`
    /// entries.
    fn relocate(&self, moves: &[Relocation]) -> Vec<bool>;
}

/// One copy made by compaction, for [`LiveSet::relocate`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Relocation {
    /// The partition the message is live in.
    pub partition: PartitionId,
    /// The message.
    pub id: MessageId,
    /// Where the caller held it when [`LiveSet::for_each_live`] showed it.
    pub old: Location,
    /// Where the copy is.
    pub new: Location,
}

/// Attributes of a message that the engine needs without reading the body.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MessageAttrs {
    /// Priority (0 = lowest); unused until priority queues land.
    pub priority: u8,
    /// Absolute expiry in milliseconds since the Unix epoch; 0 = never.
    pub expires_at_ms: u64,
    /// Absolute time in milliseconds since the Unix epoch before which the
    /// message must not be delivered (a delayed message, or a delayed
    /// retry after [`Op::Requeue`]); 0 = deliverable at once.
    pub deliver_at_ms: u64,
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
    /// Dead-lettering a stored message, atomically: the message `from_id`
    /// leaves partition `from` (settled there, as by [`Op::Settle`]) and a
    /// new message `id` is published to `partitions` (at least one; a
    /// message dropped for lack of a route is an [`Op::Settle`]). One record
    /// with one checksum: after a crash it is applied entirely or not at
    /// all, never in both queues, never in neither. Produces a [`Location`]
    /// like [`Op::Publish`]. Adds a message, so while the disk is full it is
    /// refused like a publish ([`StoreError::NoSpace`]).
    Move {
        /// The new message's id (from [`crate::Store::allocate_ids`]).
        id: MessageId,
        /// Every durable partition the new message is routed to (at least one).
        partitions: &'a [PartitionId],
        /// The new message (e.g. with its death headers).
        data: MessageData<'a>,
        /// The partition the old message leaves.
        from: PartitionId,
        /// The old message.
        from_id: MessageId,
        /// The old message's current location (as for [`Op::Settle`]).
        from_location: Location,
    },
    /// The live message `id` of `partition` was returned (requeued) after
    /// `attempts` deliveries and must not be delivered again before
    /// `deliver_at_ms` (0 = at once). Recovery reports the last recorded
    /// values ([`RecoveredMessage::attempts`], `attrs.deliver_at_ms`) until
    /// the message is settled; they survive compaction. A small record (no
    /// body), accepted like a settle while the disk is full. The engine keeps
    /// the current values in memory: [`crate::Store::read`] may return the
    /// published `deliver_at_ms` or a later requeue's.
    Requeue {
        /// The partition it is live in.
        partition: PartitionId,
        /// The message.
        id: MessageId,
        /// Its current location (informational for the embedded log).
        location: Location,
        /// Deliveries so far.
        attempts: u32,
        /// Not before this (ms since the Unix epoch); 0 = at once.
        deliver_at_ms: u64,
    },
    /// An idempotency receipt: a message with the key whose hash is
    /// `key_hash` was enqueued in the queue whose durable identity is
    /// `partition` (the engine names a queue by its first partition), and a
    /// duplicate must be dropped until `expires_at_ms` (ms since the Unix
    /// epoch). Recovery reports every receipt not yet expired by the wall
    /// clock ([`crate::Store::recover_receipts`]); the store keeps it
    /// across compaction and reclamation until it expires, then forgets it.
    /// A small record (no body), accepted like a settle while the disk is
    /// full. Receipts are never settled: a later receipt for the same
    /// (partition, key) with a later expiry extends it.
    Receipt {
        /// The queue's first partition.
        partition: PartitionId,
        /// A 64-bit hash of the idempotency key (the engine chooses it).
        key_hash: u64,
        /// Until when (ms since the Unix epoch) duplicates are dropped.
        expires_at_ms: u64,
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
    /// Several metadata changes made together: after a crash either all of
    /// them are in the recovered map or none (one record with one
    /// checksum on the embedded log; one transaction elsewhere). For
    /// changes that only make sense whole, such as a definitions import.
    /// Later changes to a key in the batch win. Accepted while the disk is
    /// full, like the other metadata ops; a batch is one record, so it is
    /// bounded by the store's largest record ([`StoreError::TooLarge`]).
    MetaBatch {
        /// The changes, in order.
        changes: &'a [MetaChange<'a>],
    },

    // ----- partition lifecycle and the state store (contract v2) -----
    /// Every message live in `partition` when this op is appended leaves it,
    /// as if each were settled there, in one small record whatever their
    /// number (a queue delete). Recovery reports none of them, and the
    /// store reclaims their space (the log store once compaction and
    /// reclamation reach their segments). A message also live in other
    /// partitions stays live there; messages appended to `partition` after
    /// this op are not affected. A settle, requeue or move of a dropped
    /// message appended later (an ack racing the delete) is a no-op.
    /// Accepted while the disk is full, like a settle.
    DropPartition {
        /// The partition emptied.
        partition: PartitionId,
    },
    /// Retention: every message live in `partition` with an id below
    /// `before`, when this op is appended, leaves it, as by
    /// [`Op::DropPartition`] (one record; recovery honours it; space is
    /// reclaimed). Messages of `partition` with an id at or above `before`
    /// stay. The caller holds none of the truncated messages any more: a
    /// later settle, requeue or move of one is a no-op. Accepted while the
    /// disk is full.
    Truncate {
        /// The partition cut.
        partition: PartitionId,
        /// The first id kept.
        before: MessageId,
    },
    /// Sets `key` in the state store ([`crate::Store::scan_state`]): small
    /// durable values that belong to no queue (protocol session state,
    /// retained messages, stream cursors). Each key has its own version,
    /// 1 at its first put and one more at each put after that (a delete
    /// forgets it): there is no version shared by every key, so writes to
    /// different keys never conflict. Durable like every op (the batch's
    /// waiter); accepted while the disk is full, like metadata.
    PutState {
        /// The key (caller-encoded; a caller groups keys under prefixes).
        key: &'a [u8],
        /// The value.
        value: &'a [u8],
    },
    /// Removes `key` from the state store (a no-op if it is absent).
    DeleteState {
        /// The key.
        key: &'a [u8],
    },
}

/// One key of the state store, as [`crate::Store::scan_state`] returns it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StateEntry {
    /// The key.
    pub key: Vec<u8>,
    /// Its value.
    pub value: Vec<u8>,
    /// Its own version: puts of this key since it was last absent (1 after
    /// the first). Unrelated to other keys' versions.
    pub version: u64,
}

/// One change of an [`Op::MetaBatch`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MetaChange<'a> {
    /// Sets `key` to `value`.
    Put {
        /// The key (engine-encoded).
        key: &'a [u8],
        /// The value (engine-encoded).
        value: &'a [u8],
    },
    /// Removes `key`.
    Delete {
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
    /// Length of the body, for byte counters (`x-max-length-bytes` counts
    /// bodies, as RabbitMQ does) and prefetch-size.
    pub size: u32,
    /// Deliveries recorded by the last [`Op::Requeue`]; 0 if never requeued.
    pub attempts: u32,
    /// Attributes; `deliver_at_ms` is the last [`Op::Requeue`]'s when there
    /// was one, else the published one.
    pub attrs: MessageAttrs,
}

/// An idempotency receipt found at recovery ([`Op::Receipt`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Receipt {
    /// The hash of the key, as appended.
    pub key_hash: u64,
    /// Until when duplicates are dropped (ms since the Unix epoch).
    pub expires_at_ms: u64,
}

/// The metadata a store holds, as returned by
/// [`crate::Store::recovered_meta`].
#[derive(Debug, Default, Clone)]
pub struct RecoveredMeta {
    /// The metadata map at the last durable change.
    pub meta: BTreeMap<Vec<u8>, Vec<u8>>,
    /// The version of `meta`: the number of metadata changes ever made.
    pub version: u64,
    /// Each key's version: the version of the change that last set it, at
    /// most `version`; every change to the key gives it a larger one. What
    /// [`crate::Store::put_if`] expects. (After a restart a store may
    /// report a larger version than the key had, e.g. its checkpoint's.)
    pub key_versions: BTreeMap<Vec<u8>, u64>,
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

// ----- store contract v2: tickets, ownership, metadata versions, reads, errors -----

/// A durability ticket: what [`crate::Store::append`] returns.
///
/// A ticket covers its own append and every earlier append of the same
/// handle that touched one of the same partitions (metadata changes count
/// as one more partition of their own, and so do state-store changes): once
/// [`crate::Store::when_durable`] reports it, all of those survive a crash.
/// It says nothing about appends to other partitions: a store may make
/// partitions durable independently. Tickets of one handle increase in
/// append order, so of two tickets for the same partition the larger covers
/// the smaller; that is all a caller may conclude from their order.
///
/// [`Ticket::NONE`] covers nothing (an append that touched no partition):
/// it is durable at once.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Ticket(u64);

impl Ticket {
    /// Covers nothing; durable at once.
    pub const NONE: Ticket = Ticket(0);

    /// A ticket from the number a store chose for it (stores only; `0` is
    /// [`Ticket::NONE`]).
    pub const fn new(n: u64) -> Ticket {
        Ticket(n)
    }

    /// The number the store chose.
    pub const fn get(self) -> u64 {
        self.0
    }
}

/// An ownership epoch of one partition: what [`crate::Store::acquire`]
/// returns. Each acquire of a partition gets a larger epoch than every
/// earlier acquire of it in the same store, and deposes the holder of the
/// earlier one: its appends for that partition fail with
/// [`StoreError::Fenced`] from then on.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Epoch(pub u64);

/// A stored message as [`crate::Store::read_many`] names it: the partition
/// it is live in, its id and its position. A store keyed by (partition, id)
/// reads by those, a log by the position; the caller gives all three.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MessageRef {
    /// A partition the message is live in.
    pub partition: PartitionId,
    /// Its id.
    pub id: MessageId,
    /// Its position, as the store last returned it.
    pub location: Location,
}

impl MessageRef {
    /// A reference to message `id`, live in `partition` at `location`.
    pub const fn new(partition: PartitionId, id: MessageId, location: Location) -> Self {
        MessageRef {
            partition,
            id,
            location,
        }
    }
}

/// A message of [`crate::Store::read_range`]: where it is and what it holds.
#[derive(Clone, Debug)]
pub struct RangeMessage {
    /// Its id, partition and position.
    pub at: MessageRef,
    /// Deliveries recorded by the last [`Op::Requeue`] in that partition.
    pub attempts: u32,
    /// The message.
    pub message: StoredMessage,
}

/// The answer of an asynchronous read: a future the caller awaits on its
/// own runtime (the store crate stays free of any runtime). A store that
/// answers at once returns a ready one ([`ready`]).
pub type ReadFuture<T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send + 'static>>;

/// A [`ReadFuture`] that is ready at once.
pub fn ready<T: Send + 'static>(value: T) -> ReadFuture<T> {
    Box::pin(std::future::ready(value))
}

/// One change of the metadata map, as the change feed shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MetaEvent {
    /// The version the change made (the key's version from then on).
    pub version: u64,
    /// The key.
    pub key: Vec<u8>,
    /// Its new value; `None`: deleted.
    pub value: Option<Vec<u8>>,
}

/// What [`crate::Store::watch`] returns.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum MetaFeed {
    /// Every change after the version asked for, in version order (empty:
    /// none yet).
    Changes(Vec<MetaEvent>),
    /// The store no longer holds the changes after that version (it keeps
    /// a bounded history): reload the whole map
    /// ([`crate::Store::recovered_meta`]) and watch from its version.
    #[default]
    Reload,
}

/// An I/O error with what was being done: the usual cause of
/// [`StoreError::Backend`].
#[derive(Debug, thiserror::Error)]
#[error("{context}: {source}")]
pub struct IoContext {
    /// What failed.
    pub context: String,
    /// The error.
    #[source]
    pub source: std::io::Error,
}

/// Store failures, in kinds every store can speak; what only one store
/// knows (a log's segments and offsets) is inside [`StoreError::Backend`].
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// A transient failure: nothing of the call took effect, and the same
    /// call may succeed later (a write that ran out of space, a transaction
    /// that lost a race, a timeout).
    #[error("temporary store failure, try again: {0}")]
    Retryable(String),
    /// A conditional write ([`crate::Store::put_if`]) found the key at
    /// another version than expected; nothing was written.
    #[error("metadata key changed concurrently: expected version {expected}, found {found}")]
    Conflict {
        /// The version the caller expected (0: absent).
        expected: u64,
        /// The key's version in the store (0: absent).
        found: u64,
    },
    /// Another handle acquired the partition since this one did (or this
    /// one never did while another holds it): nothing was appended.
    #[error("partition {} is held by another owner (fenced)", .0 .0)]
    Fenced(PartitionId),
    /// The store is out of space: only records that free space (settles,
    /// metadata) are accepted until space is available again.
    #[error("no space left for new messages in the store (disk full)")]
    NoSpace,
    /// A single record is larger than the store accepts.
    #[error("record of {0} bytes exceeds the limit")]
    TooLarge(usize),
    /// The store is closed, or failed earlier for good (after a failed
    /// fsync nothing further is acknowledged).
    #[error("store is closed")]
    Closed,
    /// A read named a position that holds no message (settled and
    /// reclaimed, moved, or a position of another store).
    #[error("no record at {0:?}")]
    NotFound(Location),
    /// A call the contract does not allow (a publish without partitions);
    /// nothing of it took effect.
    #[error("invalid store call: {0}")]
    Invalid(String),
    /// Anything else, in the store's own terms (the log store's
    /// `weir_backend::log::LogError`, an [`IoContext`]). Use
    /// [`StoreError::backend`] to look inside.
    #[error(transparent)]
    Backend(Box<dyn std::error::Error + Send + Sync + 'static>),
}

impl StoreError {
    /// Wraps an I/O error with what was being done.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        StoreError::Backend(Box::new(IoContext {
            context: context.into(),
            source,
        }))
    }

    /// The store-specific error inside [`StoreError::Backend`], if it is a `T`.
    pub fn backend<T: std::error::Error + 'static>(&self) -> Option<&T> {
        match self {
            StoreError::Backend(e) => e.downcast_ref::<T>(),
            _ => None,
        }
    }
}
