//! Weir's storage layer: the persisted types, the [`Store`] trait, and its
//! implementations.
//!
//! The store never sees a wire protocol. A message is opaque bytes (`header`,
//! `body`) plus the few attributes the engine needs without reading the body
//! back (size, priority, expiry). Metadata (exchanges, queues, bindings) is an
//! opaque, versioned key/value map that the engine encodes; small values that
//! belong to no queue (session state, retained messages) are keys of the
//! state store, each versioned on its own ([`Op::PutState`],
//! [`Store::scan_state`]). Transient messages paged out of memory go to a
//! local [`Spill`], outside the durable contract.
//!
//! * [`log`]: the embedded, segmented, group-committed log store (default).
//! * `testing` (cargo feature `testing`): an in-memory store for in-process
//!   engine tests and the contract suite every implementation must pass.

pub mod lock;
pub mod log;
pub mod metrics;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
mod types;

pub use types::*;

/// Called once when everything appended before (and with) it is durable, or
/// when the store failed to make it durable.
pub type Waiter = Box<dyn FnOnce(Result<(), StoreError>) + Send + 'static>;

/// A durable message store.
///
/// Shaped so that an implementation over a transactional key/value store
/// (FoundationDB) fits as well as the embedded log: appends are batched and
/// return a position per published message synchronously; durability is
/// reported asynchronously through a [`Waiter`]; reads are by position;
/// metadata is a versioned key/value map.
pub trait Store: Send + Sync + 'static {
    /// Allocates `n` consecutive message ids and returns the first. Ids are
    /// unique for the life of the store (they survive restarts) and increase
    /// in allocation order.
    fn allocate_ids(&self, n: u64) -> MessageId;

    /// Appends `ops` in order. For every [`Op::Publish`] and [`Op::Move`]
    /// one [`Location`] (of the new record) is pushed onto `locations`, in
    /// order. When `waiter` is
    /// given it is called once all of `ops` (and everything appended before
    /// them) is durable: fsynced on the embedded store.
    ///
    /// Appends from different callers are ordered: if `append` A returns
    /// before `append` B starts, A's records precede B's in the store.
    ///
    /// While the disk is full, batches holding a publish or move fail
    /// with [`StoreError::NoSpace`] (nothing of them is appended); settles,
    /// requeues, receipts and metadata are still accepted. A waiter may be called with an error
    /// without the store failing for good (a write that ran out of space):
    /// its appends were not made durable yet.
    fn append(
        &self,
        ops: &[Op<'_>],
        locations: &mut Vec<Location>,
        waiter: Option<Waiter>,
    ) -> Result<(), StoreError>;

    /// [`Store::append`] on behalf of `owner`, reporting whether the owner
    /// is over its share of the store's write bandwidth.
    ///
    /// A log assigns positions at append time and makes a prefix of it
    /// durable per round, so an owner's record cannot overtake records
    /// appended before it. Fairness therefore works at admission: when
    /// several owners have work waiting and it exceeds one round's budget,
    /// an owner holding more than its share gets
    /// [`Admission::over_share`], and its producer waits for its own
    /// appends to be durable before appending more. The others' next
    /// appends then sit behind at most a budget's worth of it, not its whole
    /// backlog. Stores without such a writer accept everything (the
    /// default).
    fn append_for(
        &self,
        owner: Owner,
        ops: &[Op<'_>],
        locations: &mut Vec<Location>,
        waiter: Option<Waiter>,
    ) -> Result<Admission, StoreError> {
        let _ = owner;
        self.append(ops, locations, waiter)
            .map(|()| Admission::default())
    }

    /// Reads back a published message (not a [`Spill`]'s copy).
    fn read(&self, location: Location) -> Result<StoredMessage, StoreError>;

    /// The metadata map and its version: at open, what the last run left.
    fn recovered_meta(&self) -> Result<RecoveredMeta, StoreError>;

    /// Every partition that held live (published, unsettled) messages when
    /// the store was opened, whether or not a queue still owns it. The engine
    /// recovers the ones its queues own and settles the others.
    fn recovered_partitions(&self) -> Result<Vec<PartitionId>, StoreError>;

    /// The live messages of `partition` when the store was opened, in id
    /// order, without their bodies. [`Spill`] copies are never recovered.
    ///
    /// Call it once per partition, at startup, before appending anything for
    /// that partition (a gateway calls it only for the partitions it owns).
    /// The embedded store scanned everything at open and hands each list out
    /// once: a second call returns an empty list.
    fn recover_partition(
        &self,
        partition: PartitionId,
    ) -> Result<Vec<RecoveredMessage>, StoreError>;

    /// The idempotency receipts ([`Op::Receipt`]) of `partition` when the
    /// store was opened, not yet expired by the wall clock: one per key
    /// hash (the latest expiry appended for it), in no particular order.
    ///
    /// Call it once per partition, at startup (before the first
    /// [`Store::compact`], which may drop the lists nobody took), like
    /// [`Store::recover_partition`]; a second call returns an empty list.
    /// Receipts of partitions nobody asks for are simply left to expire.
    fn recover_receipts(&self, partition: PartitionId) -> Result<Vec<Receipt>, StoreError>;

    /// Moves live records so that space can be reclaimed. The store decides
    /// which positions are worth moving (it can decode its own), in three
    /// phases: it collects candidates through [`LiveSet::for_each_live`],
    /// reads them and appends copies with no caller lock held, then hands
    /// the copies to [`LiveSet::relocate`], which swaps each in where the
    /// caller still holds the old position. A copy the caller refuses (the
    /// message was settled or moved meanwhile) is garbage: the store never
    /// lets it outlive the settle (not in accounting, not at recovery).
    /// Returns how many positions moved; 0 when nothing is worth moving
    /// (then `live` is not walked at all). It may move only part of what is
    /// worth moving per call: call it again while it returns more than 0.
    /// Calls to `compact` run one at a time.
    fn compact(&self, live: &dyn LiveSet) -> Result<usize, StoreError>;

    /// Counters for metrics and benchmarks.
    fn stats(&self) -> StoreStats;

    /// Makes everything appended so far durable and stops background work.
    /// Further appends fail with [`StoreError::Closed`].
    fn close(&self) -> Result<(), StoreError>;

    // ----- the state store (contract v2) -----

    /// Every key of the state store ([`Op::PutState`]) starting with
    /// `prefix`, in key order, each with its value and its own version: what
    /// the appends so far left (at open, what the last run left). A caller
    /// recovers its keys by scanning its prefix once at startup; each
    /// prefix is independent of the others and of the metadata map.
    fn scan_state(&self, prefix: &[u8]) -> Result<Vec<StateEntry>, StoreError>;

    // ----- paging (contract v2): local, outside the durable contract -----

    /// The store's [`Spill`], if it has one: where the engine pages
    /// transient messages out of memory. None: nothing is paged (deep
    /// transient messages stay in memory).
    fn spill(&self) -> Option<&dyn Spill> {
        None
    }
}

/// Local storage for transient messages paged out of memory: a transient
/// message, or one in a non-durable queue, that sits too deep in its queue
/// to stay in RAM. Not part of the durable contract: never made durable on
/// purpose, never replicated, never recovered (a restart drops every copy,
/// as it must), and no record of a release is written.
///
/// Its positions are [`Location`]s that [`Spill::holds`] tells apart from
/// the store's: a caller reads and releases them here, never through
/// [`Store::read`] or an [`Op::Settle`] (a store ignores a spill position
/// named as an [`Op::Move`]'s source: the caller releases it here too). A
/// store that provides its own spill may relocate spilled copies during
/// [`Store::compact`] (they are among the positions a [`LiveSet`] shows);
/// a relocated copy stays spilled.
pub trait Spill: Send + Sync {
    /// Writes a copy of message `id`, queued in `partitions` (at least
    /// one), on behalf of `owner` (fairness as for [`Store::append_for`]),
    /// and returns its position. Fails with [`StoreError::NoSpace`] while
    /// the disk is full: the caller keeps the message in memory.
    fn spill(
        &self,
        owner: Owner,
        id: MessageId,
        partitions: &[PartitionId],
        data: MessageData<'_>,
    ) -> Result<(Location, Admission), StoreError>;

    /// Reads a spilled copy back.
    fn read(&self, location: Location) -> Result<StoredMessage, StoreError>;

    /// Whether `location` is a position of this spill (not the store's).
    fn holds(&self, location: Location) -> bool;

    /// The copy of `id` is no longer needed in `partition` (settled,
    /// purged, expired, moved): once released in every partition it was
    /// spilled for, its space can be reused. Releasing twice is harmless.
    fn release(&self, partition: PartitionId, id: MessageId, location: Location);

    /// Every copy spilled for `partition` is released (its queue was
    /// deleted). Call it only once the partition holds no stored message
    /// any more (non-durable, or dropped by [`Op::DropPartition`]): a store
    /// whose spill shares its accounting may release those too.
    fn release_partition(&self, partition: PartitionId);
}

/// Bytes available to an unprivileged user on the filesystem holding `path`
/// (`statvfs`: `f_bavail × f_frsize`). For disk watermarks.
pub fn free_bytes(path: &std::path::Path) -> std::io::Result<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    // SAFETY: statvfs is plain old data; zeroed is a valid value.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: c is a valid NUL-terminated path and st a valid out pointer.
    let rc = unsafe { libc::statvfs(c.as_ptr(), &mut st) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    #[allow(clippy::unnecessary_cast)] // the field types differ between targets
    Ok((st.f_bavail as u64).saturating_mul(st.f_frsize as u64))
}
