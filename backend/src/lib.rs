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

/// Called once when a [`Ticket`] is durable, or when the store failed to
/// make it durable.
pub type Waiter = Box<dyn FnOnce(Result<(), StoreError>) + Send + 'static>;

/// Called once when the metadata map changes after a watched version
/// ([`Store::watch`]).
pub type Wake = Box<dyn FnOnce() + Send + 'static>;

/// A durable message store.
///
/// Shaped so that an implementation over a transactional key/value store
/// (FoundationDB) fits as well as the embedded log, and so that several
/// handles (processes) can share one store:
///
/// * appends are batched and return a position per published message and a
///   [`Ticket`] synchronously; durability is reported per ticket through a
///   [`Waiter`] ([`Store::when_durable`]), per partition, never store-wide;
/// * a partition is written by the handle that [`Store::acquire`]d it last:
///   a deposed handle's appends fail with [`StoreError::Fenced`];
/// * reads are asynchronous and batched ([`Store::read_many`],
///   [`Store::read_range`]);
/// * metadata is a key/value map with a version per key, conditional puts
///   ([`Store::put_if`]) and a change feed ([`Store::watch`]).
///
/// The contract is checked by `testing::contract` (cargo feature
/// `testing`), which every implementation runs.
pub trait Store: Send + Sync + 'static {
    /// Allocates `n` consecutive message ids and returns the first. Ids are
    /// unique for the life of the store (they survive restarts) and increase
    /// in allocation order.
    fn allocate_ids(&self, n: u64) -> MessageId;

    // ----- appends and durability -----

    /// Appends `ops` in order. For every [`Op::Publish`] and [`Op::Move`]
    /// one [`Location`] (of the new record) is pushed onto `locations`, in
    /// order. Returns the batch's [`Ticket`]: it covers
    /// this batch and every earlier append of this handle that touched one
    /// of its partitions (metadata changes are one more partition of their
    /// own, state-store changes another). An empty batch returns
    /// [`Ticket::NONE`].
    ///
    /// Within a partition, records keep append order, and a crash keeps a
    /// prefix of them: a settle is never durable before its publish.
    /// Appends from different callers are ordered: if `append` A returns
    /// before `append` B starts, A's records precede B's in every partition
    /// they share.
    ///
    /// A batch naming a partition that another handle [`Store::acquire`]d
    /// after this one (or that another handle holds while this one never
    /// acquired it) fails whole with [`StoreError::Fenced`].
    ///
    /// While the disk is full, batches holding a publish or move fail
    /// with [`StoreError::NoSpace`] (nothing of them is appended); settles,
    /// requeues, receipts and metadata are still accepted.
    fn append(&self, ops: &[Op<'_>], locations: &mut Vec<Location>) -> Result<Ticket, StoreError>;

    /// [`Store::append`] on behalf of `tag`, also reporting whether the
    /// tag is over its share of the store's write bandwidth.
    ///
    /// A log assigns positions at append time and makes a prefix of it
    /// durable per round, so a tag's record cannot overtake records
    /// appended before it. Fairness therefore works at admission: when
    /// several tags have work waiting and it exceeds one round's budget,
    /// a tag holding more than its share gets [`Admission::over_share`],
    /// and its producer waits for its own appends to be durable before
    /// appending more. The others' next appends then sit behind at most a
    /// budget's worth of it, not its whole backlog. Stores without such a
    /// writer accept everything (the default).
    fn append_for(
        &self,
        tag: ShareTag,
        ops: &[Op<'_>],
        locations: &mut Vec<Location>,
    ) -> Result<(Ticket, Admission), StoreError> {
        let _ = tag;
        self.append(ops, locations)
            .map(|t| (t, Admission::default()))
    }

    /// Calls `waiter` once everything `ticket` covers is durable (fsynced
    /// on the embedded store), or with the error that kept it from being
    /// durable. A waiter may be called with an error without the store
    /// failing for good (a write that ran out of space: those appends were
    /// not made durable). It may be called on the caller's thread, before
    /// this returns (a ticket already durable, [`Ticket::NONE`]), or on a
    /// thread of the store's: it must not block.
    ///
    /// A handle calls its waiters in the order they were registered: a
    /// waiter never overtakes an earlier one, even when its own ticket is
    /// durable sooner (a client's confirmations stay in order). This orders
    /// the calls, not the commits.
    fn when_durable(&self, ticket: Ticket, waiter: Waiter);

    // ----- reads -----

    /// Reads back published messages (not a [`Spill`]'s copies), one result per reference,
    /// in order. The future may be ready at once (the embedded log reads
    /// from its page cache while building it) or complete later (a network
    /// store); either way the caller awaits it without blocking a thread.
    fn read_many(&self, refs: &[MessageRef]) -> ReadFuture<Vec<Result<StoredMessage, StoreError>>>;

    /// Up to `max` live stored messages of `partition` with ids from
    /// `from` on, in id order, with their positions. For consumers that
    /// read a partition as a sequence.
    fn read_range(
        &self,
        partition: PartitionId,
        from: MessageId,
        max: usize,
    ) -> ReadFuture<Result<Vec<RangeMessage>, StoreError>>;

    /// Up to `max` live stored messages of `partition` from the message
    /// `first` names on (included), in id order, with their positions: a
    /// stream consumer reading a partition as a sequence, resuming at a
    /// position it kept (a stream's sparse index keeps one per chunk). A
    /// store that can seek to a position (the embedded log reads forward
    /// from it) answers without looking at anything before it; the default
    /// is [`Store::read_range`] from `first`'s id.
    fn read_from(
        &self,
        first: MessageRef,
        max: usize,
    ) -> ReadFuture<Result<Vec<RangeMessage>, StoreError>> {
        self.read_range(first.partition, first.id, max)
    }

    /// Reads one message by position, blocking the calling thread: for
    /// tools and tests. The engine reads through [`Store::read_many`].
    fn read(&self, location: Location) -> Result<StoredMessage, StoreError>;

    // ----- metadata -----

    /// The metadata map as of now, with its version and each key's version.
    /// At open, what the last run left.
    fn recovered_meta(&self) -> Result<RecoveredMeta, StoreError>;

    /// Sets `key` to `value` (`None`: deletes it) if its version is still
    /// `expected` (0: the key must be absent), as one metadata change;
    /// returns the change's ticket and the key's new version. Fails with
    /// [`StoreError::Conflict`] (nothing written) when another change to
    /// the key came first, through any handle.
    fn put_if(
        &self,
        key: &[u8],
        value: Option<&[u8]>,
        expected: u64,
    ) -> Result<(Ticket, u64), StoreError>;

    /// The metadata changes after version `since`, made through any handle
    /// of the store, in version order. When there are none yet, `wake` is
    /// called once the next one is made (on the writing thread: it must not
    /// block); otherwise it is dropped uncalled. [`MetaFeed::Reload`] when
    /// the store no longer holds the changes after `since`.
    fn watch(&self, since: u64, wake: Wake) -> Result<MetaFeed, StoreError>;

    // ----- ownership and recovery -----

    /// Makes this handle the owner of `partition` with a new epoch: appends
    /// for it through any other handle fail with [`StoreError::Fenced`]
    /// from now on, including the handle that held it before. Recovery of
    /// the partition ([`Store::recover_partition`]) may follow at any time.
    fn acquire(&self, partition: PartitionId) -> Result<Epoch, StoreError>;

    /// [`Store::acquire`], but only when no other handle holds `partition`
    /// (for a partition nobody claims, such as one of a deleted queue):
    /// `None` when another does.
    fn try_acquire(&self, partition: PartitionId) -> Result<Option<Epoch>, StoreError>;

    /// Every partition that held live (published, unsettled) messages when
    /// the store was opened; it may list more, never fewer.
    fn recovered_partitions(&self) -> Result<Vec<PartitionId>, StoreError>;

    /// The live stored messages of `partition`, in id order, without their
    /// bodies, as of the call: what every handle appended for it. [`Spill`]
    /// copies are never recovered. Call it after [`Store::acquire`], at
    /// any time (at startup, or when taking a partition over from another
    /// handle); it fails with [`StoreError::Fenced`] while another handle
    /// holds the partition.
    fn recover_partition(
        &self,
        partition: PartitionId,
    ) -> Result<Vec<RecoveredMessage>, StoreError>;

    /// The idempotency receipts ([`Op::Receipt`]) of `partition` not yet
    /// expired by the wall clock: one per key hash (the latest expiry
    /// appended for it), in no particular order, as of the call. Like
    /// [`Store::recover_partition`], after [`Store::acquire`].
    fn recover_receipts(&self, partition: PartitionId) -> Result<Vec<Receipt>, StoreError>;

    // ----- space -----

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
    /// one), on behalf of `tag` (fairness as for [`Store::append_for`]),
    /// and returns its position. Fails with [`StoreError::NoSpace`] while
    /// the disk is full: the caller keeps the message in memory.
    fn spill(
        &self,
        tag: ShareTag,
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

/// Runs `f` to completion on the calling thread, parking it while the
/// future is pending: for tests and tools that read from a store without a
/// runtime. Never call it on a runtime's worker thread.
pub fn block_on<F: std::future::Future>(f: F) -> F::Output {
    use std::task::{Context, Poll, Wake as TaskWake, Waker};
    struct Unpark(std::thread::Thread);
    impl TaskWake for Unpark {
        fn wake(self: std::sync::Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = Waker::from(std::sync::Arc::new(Unpark(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    let mut f = std::pin::pin!(f);
    loop {
        if let Poll::Ready(v) = f.as_mut().poll(&mut cx) {
            return v;
        }
        std::thread::park();
    }
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
