//! More handles on one open log store, as the processes sharing a networked
//! store would have: each owns the partitions it acquired (`partitions.rs`);
//! messages, metadata and its change feed are shared. For tests of what
//! several gateways over one store do, and for the contract suite.

use super::partitions::FIRST_HANDLE;
use super::LogStore;
use crate::{
    Admission, Epoch, LiveSet, Location, MessageId, MessageRef, MetaFeed, Op, PartitionId,
    RangeMessage, ReadFuture, Receipt, RecoveredMessage, RecoveredMeta, ShareTag, StateEntry,
    Store, StoreError, StoreStats, StoredMessage, Ticket, Waiter, Wake,
};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Numbers the handles after the store's own ([`FIRST_HANDLE`]).
static NEXT_HANDLE: AtomicU64 = AtomicU64::new(FIRST_HANDLE + 1);

/// A second (third, …) handle on a [`LogStore`] (see
/// [`LogStore::handle`]). Closing any handle closes the store.
pub struct LogHandle {
    store: Arc<LogStore>,
    id: u64,
}

impl std::fmt::Debug for LogHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LogHandle")
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

impl LogStore {
    /// Another handle on this store: its own ownership of partitions
    /// ([`Store::acquire`]), the same messages, metadata and change feed.
    /// From the first extra handle on, every append checks ownership.
    pub fn handle(self: &Arc<Self>) -> Arc<LogHandle> {
        self.shared.state.lock().owners.multi = true;
        Arc::new(LogHandle {
            store: self.clone(),
            id: NEXT_HANDLE.fetch_add(1, Ordering::Relaxed),
        })
    }
}

impl Store for LogHandle {
    fn allocate_ids(&self, n: u64) -> MessageId {
        self.store.allocate_ids(n)
    }

    fn append(&self, ops: &[Op<'_>], locations: &mut Vec<Location>) -> Result<Ticket, StoreError> {
        self.store
            .append_as(self.id, ShareTag::BROKER, ops, locations)
            .map(|(t, _)| t)
    }

    fn append_for(
        &self,
        tag: ShareTag,
        ops: &[Op<'_>],
        locations: &mut Vec<Location>,
    ) -> Result<(Ticket, Admission), StoreError> {
        self.store.append_as(self.id, tag, ops, locations)
    }

    fn when_durable(&self, ticket: Ticket, waiter: Waiter) {
        self.store.when_durable_now(ticket, waiter)
    }

    fn read_many(&self, refs: &[MessageRef]) -> ReadFuture<Vec<Result<StoredMessage, StoreError>>> {
        self.store.read_many(refs)
    }

    fn read_range(
        &self,
        partition: PartitionId,
        from: MessageId,
        max: usize,
    ) -> ReadFuture<Result<Vec<RangeMessage>, StoreError>> {
        self.store.read_range(partition, from, max)
    }

    fn read(&self, location: Location) -> Result<StoredMessage, StoreError> {
        self.store.read_now(location)
    }

    fn recovered_meta(&self) -> Result<RecoveredMeta, StoreError> {
        Ok(self.store.meta_now())
    }

    fn put_if(
        &self,
        key: &[u8],
        value: Option<&[u8]>,
        expected: u64,
    ) -> Result<(Ticket, u64), StoreError> {
        self.store.put_if_as(self.id, key, value, expected)
    }

    fn watch(&self, since: u64, wake: Wake) -> Result<MetaFeed, StoreError> {
        self.store.watch_now(since, wake)
    }

    fn acquire(&self, partition: PartitionId) -> Result<Epoch, StoreError> {
        self.store.acquire_as(self.id, partition)
    }

    fn try_acquire(&self, partition: PartitionId) -> Result<Option<Epoch>, StoreError> {
        self.store.try_acquire_as(self.id, partition)
    }

    fn recovered_partitions(&self) -> Result<Vec<PartitionId>, StoreError> {
        self.store.recovered_partitions()
    }

    fn recover_partition(
        &self,
        partition: PartitionId,
    ) -> Result<Vec<RecoveredMessage>, StoreError> {
        self.store.recover_partition_as(self.id, partition)
    }

    fn recover_receipts(&self, partition: PartitionId) -> Result<Vec<Receipt>, StoreError> {
        self.store.recover_receipts_as(self.id, partition)
    }

    fn compact(&self, live: &dyn LiveSet) -> Result<usize, StoreError> {
        self.store.compact_now(live)
    }

    fn stats(&self) -> StoreStats {
        self.store.stats_now()
    }

    fn close(&self) -> Result<(), StoreError> {
        self.store.close_now()
    }

    fn scan_state(&self, prefix: &[u8]) -> Result<Vec<StateEntry>, StoreError> {
        Ok(self.store.scan_state_now(prefix))
    }

    fn spill(&self) -> Option<&dyn crate::Spill> {
        Some(&*self.store)
    }
}
