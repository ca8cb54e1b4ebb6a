//! [`MemStore`]: everything in memory, durability on a manual switch.

use crate::{
    Admission, LiveSet, Location, MessageData, MessageId, Op, Owner, PartitionId, Receipt,
    RecoveredMessage, RecoveredMeta, Relocation, StateEntry, Store, StoreError, StoreStats,
    StoredMessage, Waiter,
};
use bytes::Bytes;
use parking_lot::Mutex;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Marks MemStore positions (third word), so a position from another store
/// is never mistaken for one of ours.
const MEM_TAG: u32 = 0x4d45_4d00;
/// Marks the positions of MemStore's [`Spill`] (third word).
const MEM_SPILL_TAG: u32 = 0x4d45_4d01;

/// An in-memory [`Store`] for in-process tests.
///
/// * Positions are slots in a map; [`Store::compact`] moves *every* live
///   position it is shown, so callers' handling of moved positions is
///   exercised on every call.
/// * Waiters complete as soon as their append returns, unless
///   [`MemStore::hold_durability`] is on: then they stay pending until
///   [`MemStore::release`] (or switching the hold off), which lets a test
///   prove that nothing waits on an fsync it should not wait on.
/// * [`MemStore::reopen`] gives a new store over the same data, as a clean
///   restart would (paged messages are dropped, everything else survives;
///   idempotency receipts survive until they expire by the wall clock, as
///   in the log store).
pub struct MemStore {
    state: Mutex<State>,
    next_id: AtomicU64,
}

#[derive(Default)]
struct State {
    records: HashMap<u64, Record>,
    next_slot: u64,
    /// Current slot of every live (partition, id).
    live: HashMap<PartitionId, BTreeMap<MessageId, u64>>,
    /// Last requeue (attempts, deliver_at_ms) of every live (partition, id)
    /// requeued since it was published.
    requeued: HashMap<(PartitionId, MessageId), (u32, u64)>,
    meta: BTreeMap<Vec<u8>, Vec<u8>>,
    meta_version: u64,
    /// The latest expiry of every (partition, key hash) receipt appended.
    receipts: HashMap<(PartitionId, u64), u64>,
    recovered: HashMap<PartitionId, Vec<RecoveredMessage>>,
    recovered_receipts: HashMap<PartitionId, Vec<Receipt>>,
    recovered_partitions: Vec<PartitionId>,
    hold: bool,
    held: Vec<Waiter>,
    /// The state store: per key, its version and value.
    state_map: BTreeMap<Vec<u8>, (u64, Vec<u8>)>,
    closed: bool,
    appended_bytes: u64,
}

#[derive(Clone)]
struct Record {
    msg: StoredMessage,
    paged: bool,
    /// Partitions whose current position is this record.
    live: u32,
}

/// The slot of one of our positions, stored or spilled.
fn slot_of(loc: Location) -> Option<u64> {
    let [hi, lo, tag] = loc.words();
    (tag == MEM_TAG || tag == MEM_SPILL_TAG).then_some((u64::from(hi) << 32) | u64::from(lo))
}

fn is_spilled(loc: Location) -> bool {
    loc.words()[2] == MEM_SPILL_TAG
}

fn location_of(slot: u64) -> Location {
    Location::from_words([(slot >> 32) as u32, slot as u32, MEM_TAG])
}

fn spill_location_of(slot: u64) -> Location {
    Location::from_words([(slot >> 32) as u32, slot as u32, MEM_SPILL_TAG])
}

impl State {
    fn insert(&mut self, rec: Record) -> u64 {
        let slot = self.next_slot;
        self.next_slot += 1;
        self.records.insert(slot, rec);
        slot
    }

    /// Stores a new message record live in `partitions`; returns its slot.
    fn publish(
        &mut self,
        id: MessageId,
        partitions: &[PartitionId],
        data: &MessageData<'_>,
        paged: bool,
    ) -> u64 {
        let msg = StoredMessage {
            id,
            exchange: data.exchange.to_string(),
            routing_key: data.routing_key.to_string(),
            header_format: data.header_format,
            header: Bytes::copy_from_slice(data.header),
            body: Bytes::copy_from_slice(data.body),
            attrs: data.attrs,
        };
        self.appended_bytes += (data.header.len() + data.body.len()) as u64;
        let slot = self.insert(Record {
            msg,
            paged,
            live: 0,
        });
        for p in partitions {
            let old = self.live.entry(*p).or_default().insert(id, slot);
            if let Some(old) = old {
                self.unlive(old);
            }
            self.requeued.remove(&(*p, id));
            if let Some(r) = self.records.get_mut(&slot) {
                r.live += 1;
            }
        }
        slot
    }

    /// The message `id` leaves `partition` (settled or moved away).
    fn settle(&mut self, partition: PartitionId, id: MessageId) {
        // The live map knows the current slot; the location the caller
        // names is only a hint for stores that need it.
        let slot = self.live.get_mut(&partition).and_then(|m| m.remove(&id));
        if self.live.get(&partition).is_some_and(|m| m.is_empty()) {
            self.live.remove(&partition);
        }
        if let Some(slot) = slot {
            self.unlive(slot);
        }
        self.requeued.remove(&(partition, id));
    }

    /// Every message of `partition` below `before` leaves it (a drop when
    /// `before` is `MessageId::MAX`).
    fn cut(&mut self, partition: PartitionId, before: MessageId) {
        let Some(map) = self.live.get_mut(&partition) else {
            return;
        };
        let kept = map.split_off(&before);
        let gone = std::mem::replace(map, kept);
        if map.is_empty() {
            self.live.remove(&partition);
        }
        for (id, slot) in gone {
            self.unlive(slot);
            self.requeued.remove(&(partition, id));
        }
    }

    /// One partition stops living at `slot`; drops the record when none does.
    fn unlive(&mut self, slot: u64) {
        if let Some(r) = self.records.get_mut(&slot) {
            r.live = r.live.saturating_sub(1);
            if r.live == 0 {
                self.records.remove(&slot);
            }
        }
    }
}

/// What an op other than a message adds to `appended_bytes` (a message
/// counts its header and body when it is stored): a small record's worth,
/// so that a caller appending one op per message shows in the counter.
fn record_bytes(op: &Op<'_>) -> u64 {
    let var = |b: &[u8]| b.len() as u64;
    match op {
        Op::Publish { .. } | Op::Move { .. } => 0,
        Op::PutMeta { key, value } | Op::PutState { key, value } => 16 + var(key) + var(value),
        Op::DeleteMeta { key } | Op::DeleteState { key } => 16 + var(key),
        Op::MetaBatch { changes } => {
            16 + changes
                .iter()
                .map(|c| match c {
                    crate::MetaChange::Put { key, value } => var(key) + var(value),
                    crate::MetaChange::Delete { key } => var(key),
                })
                .sum::<u64>()
        }
        _ => 16,
    }
}

impl State {
    fn read(&self, location: Location) -> Result<StoredMessage, StoreError> {
        slot_of(location)
            .and_then(|s| self.records.get(&s))
            .map(|r| r.msg.clone())
            .ok_or(StoreError::NotFound(location))
    }
}

/// The spill: records like published ones, marked paged (dropped by
/// [`MemStore::reopen`]), with positions of their own tag.
impl crate::Spill for MemStore {
    fn spill(
        &self,
        _owner: Owner,
        id: MessageId,
        partitions: &[PartitionId],
        data: MessageData<'_>,
    ) -> Result<(Location, Admission), StoreError> {
        if partitions.is_empty() {
            return Err(StoreError::io(
                "spill",
                std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    "a spilled message needs at least one partition",
                ),
            ));
        }
        let mut st = self.state.lock();
        if st.closed {
            return Err(StoreError::Closed);
        }
        let slot = st.publish(id, partitions, &data, true);
        self.next_id.fetch_max(id + 1, Ordering::SeqCst);
        Ok((spill_location_of(slot), Admission::default()))
    }

    fn read(&self, location: Location) -> Result<StoredMessage, StoreError> {
        if !is_spilled(location) {
            return Err(StoreError::NotFound(location));
        }
        self.state.lock().read(location)
    }

    fn holds(&self, location: Location) -> bool {
        is_spilled(location)
    }

    fn release(&self, partition: PartitionId, id: MessageId, location: Location) {
        if is_spilled(location) {
            self.state.lock().settle(partition, id);
        }
    }

    fn release_partition(&self, partition: PartitionId) {
        self.state.lock().cut(partition, MessageId::MAX);
    }
}

impl std::fmt::Debug for MemStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemStore").finish_non_exhaustive()
    }
}

impl Default for MemStore {
    fn default() -> Self {
        MemStore {
            state: Mutex::new(State::default()),
            next_id: AtomicU64::new(1),
        }
    }
}

impl MemStore {
    /// An empty store.
    pub fn new() -> Arc<MemStore> {
        Arc::new(MemStore::default())
    }

    /// While `hold` is on, waiters stay pending; switching it off completes
    /// every pending waiter (successfully), in append order.
    pub fn hold_durability(&self, hold: bool) {
        self.state.lock().hold = hold;
        if !hold {
            self.release();
        }
    }

    /// Completes every pending waiter (successfully), in append order. The
    /// hold stays as it is.
    pub fn release(&self) {
        let held = std::mem::take(&mut self.state.lock().held);
        for w in held {
            w(Ok(()));
        }
    }

    /// Waiters pending under the hold.
    pub fn held_waiters(&self) -> usize {
        self.state.lock().held.len()
    }

    /// Live (partition, message) pairs, paged ones included.
    pub fn live_count(&self) -> usize {
        self.state.lock().live.values().map(|m| m.len()).sum()
    }

    /// A new store over this one's data, as a clean restart would see it:
    /// metadata and ids kept, every live published message recovered per
    /// partition, paged messages dropped. This store is closed.
    pub fn reopen(&self) -> Arc<MemStore> {
        let mut st = self.state.lock();
        st.closed = true;
        let mut next = State {
            meta: st.meta.clone(),
            meta_version: st.meta_version,
            state_map: st.state_map.clone(),
            ..State::default()
        };
        next.next_slot = st.next_slot;
        let now = crate::log::now_ms();
        for (&(p, key_hash), &expires_at_ms) in &st.receipts {
            if expires_at_ms > now {
                next.receipts.insert((p, key_hash), expires_at_ms);
                next.recovered_receipts.entry(p).or_default().push(Receipt {
                    key_hash,
                    expires_at_ms,
                });
            }
        }
        for (p, ids) in &st.live {
            let mut msgs = Vec::new();
            for (&id, &slot) in ids {
                let Some(r) = st.records.get(&slot).filter(|r| !r.paged) else {
                    continue;
                };
                let kept = next.records.entry(slot).or_insert_with(|| Record {
                    live: 0,
                    ..r.clone()
                });
                kept.live += 1;
                next.live.entry(*p).or_default().insert(id, slot);
                let mut attrs = r.msg.attrs;
                let mut attempts = 0;
                if let Some(&(a, d)) = st.requeued.get(&(*p, id)) {
                    (attempts, attrs.deliver_at_ms) = (a, d);
                    next.requeued.insert((*p, id), (a, d));
                }
                msgs.push(RecoveredMessage {
                    id,
                    location: location_of(slot),
                    size: r.msg.body.len() as u32,
                    attempts,
                    attrs,
                });
            }
            if !msgs.is_empty() {
                next.recovered_partitions.push(*p);
                next.recovered.insert(*p, msgs);
            }
        }
        next.recovered_partitions.sort_unstable();
        Arc::new(MemStore {
            state: Mutex::new(next),
            next_id: AtomicU64::new(self.next_id.load(Ordering::SeqCst)),
        })
    }
}

impl Store for MemStore {
    fn allocate_ids(&self, n: u64) -> MessageId {
        self.next_id.fetch_add(n, Ordering::SeqCst)
    }

    fn append(
        &self,
        ops: &[Op<'_>],
        locations: &mut Vec<Location>,
        waiter: Option<Waiter>,
    ) -> Result<(), StoreError> {
        for op in ops {
            if let Op::Publish { partitions, .. } | Op::Move { partitions, .. } = op {
                if partitions.is_empty() {
                    return Err(StoreError::io(
                        "append",
                        std::io::Error::new(
                            std::io::ErrorKind::InvalidInput,
                            "publish needs at least one partition",
                        ),
                    ));
                }
            }
        }
        let mut st = self.state.lock();
        if st.closed {
            return Err(StoreError::Closed);
        }
        for op in ops {
            st.appended_bytes += record_bytes(op);
            match op {
                Op::Publish {
                    id,
                    partitions,
                    data,
                } => {
                    let slot = st.publish(*id, partitions, data, false);
                    self.next_id.fetch_max(id + 1, Ordering::SeqCst);
                    locations.push(location_of(slot));
                }
                Op::Move {
                    id,
                    partitions,
                    data,
                    from,
                    from_id,
                    ..
                } => {
                    // One step under the lock: atomic, as the contract asks.
                    st.settle(*from, *from_id);
                    let slot = st.publish(*id, partitions, data, false);
                    self.next_id.fetch_max(id + 1, Ordering::SeqCst);
                    locations.push(location_of(slot));
                }
                Op::Settle { partition, id, .. } => st.settle(*partition, *id),
                Op::Requeue {
                    partition,
                    id,
                    attempts,
                    deliver_at_ms,
                    ..
                } => {
                    // Only a live message has a delivery state to keep.
                    if st.live.get(partition).is_some_and(|m| m.contains_key(id)) {
                        st.requeued
                            .insert((*partition, *id), (*attempts, *deliver_at_ms));
                    }
                }
                Op::Receipt {
                    partition,
                    key_hash,
                    expires_at_ms,
                } => {
                    let e = st.receipts.entry((*partition, *key_hash)).or_default();
                    *e = (*e).max(*expires_at_ms);
                }
                Op::PutMeta { key, value } => {
                    st.meta_version += 1;
                    st.meta.insert(key.to_vec(), value.to_vec());
                }
                Op::DeleteMeta { key } => {
                    st.meta_version += 1;
                    st.meta.remove(*key);
                }
                Op::DropPartition { partition } => st.cut(*partition, MessageId::MAX),
                Op::Truncate { partition, before } => st.cut(*partition, *before),
                Op::PutState { key, value } => {
                    let version = st.state_map.get(*key).map_or(1, |(v, _)| v + 1);
                    st.state_map.insert(key.to_vec(), (version, value.to_vec()));
                }
                Op::DeleteState { key } => {
                    st.state_map.remove(*key);
                }
                Op::MetaBatch { changes } => {
                    st.meta_version += 1;
                    for c in changes.iter() {
                        match c {
                            crate::MetaChange::Put { key, value } => {
                                st.meta.insert(key.to_vec(), value.to_vec());
                            }
                            crate::MetaChange::Delete { key } => {
                                st.meta.remove(*key);
                            }
                        }
                    }
                }
            }
        }
        let Some(w) = waiter else { return Ok(()) };
        if st.hold || !st.held.is_empty() {
            // Behind earlier pending waiters: durability completes in order.
            st.held.push(w);
            let hold = st.hold;
            drop(st);
            if !hold {
                self.release();
            }
        } else {
            drop(st);
            w(Ok(()));
        }
        Ok(())
    }

    fn read(&self, location: Location) -> Result<StoredMessage, StoreError> {
        if is_spilled(location) {
            return Err(StoreError::NotFound(location));
        }
        self.state.lock().read(location)
    }

    fn spill(&self) -> Option<&dyn crate::Spill> {
        Some(self)
    }

    fn recovered_meta(&self) -> Result<RecoveredMeta, StoreError> {
        let st = self.state.lock();
        Ok(RecoveredMeta {
            meta: st.meta.clone(),
            version: st.meta_version,
            truncated_bytes: 0,
        })
    }

    fn recovered_partitions(&self) -> Result<Vec<PartitionId>, StoreError> {
        Ok(self.state.lock().recovered_partitions.clone())
    }

    fn recover_partition(
        &self,
        partition: PartitionId,
    ) -> Result<Vec<RecoveredMessage>, StoreError> {
        Ok(self
            .state
            .lock()
            .recovered
            .remove(&partition)
            .unwrap_or_default())
    }

    fn recover_receipts(&self, partition: PartitionId) -> Result<Vec<Receipt>, StoreError> {
        Ok(self
            .state
            .lock()
            .recovered_receipts
            .remove(&partition)
            .unwrap_or_default())
    }

    fn compact(&self, live: &dyn LiveSet) -> Result<usize, StoreError> {
        // Compaction never drops a receipt before it expires; expired ones
        // are forgotten here as the log store forgets them.
        let now = crate::log::now_ms();
        {
            let mut st = self.state.lock();
            st.receipts.retain(|_, e| *e > now);
            st.recovered_receipts.clear();
        }
        // Collect first, with no lock of ours held: the caller's locks are
        // held around `visit`, and its appends take ours.
        let mut todo = Vec::new();
        live.for_each_live(&mut |partition, id, location| todo.push((partition, id, location)));
        let mut copies = Vec::new();
        {
            let mut st = self.state.lock();
            if st.closed {
                return Err(StoreError::Closed);
            }
            for (partition, id, old) in todo {
                // Only what is still live where the caller saw it: a settle
                // since then wins.
                let Some(slot) = st.live.get(&partition).and_then(|m| m.get(&id)).copied() else {
                    continue;
                };
                if slot_of(old) != Some(slot) {
                    continue;
                }
                let Some(rec) = st.records.get(&slot).cloned() else {
                    continue;
                };
                let new = st.insert(Record { live: 1, ..rec });
                st.unlive(slot);
                if let Some(m) = st.live.get_mut(&partition) {
                    m.insert(id, new);
                }
                copies.push(Relocation {
                    partition,
                    id,
                    old,
                    // A spilled copy stays spilled.
                    new: if is_spilled(old) {
                        spill_location_of(new)
                    } else {
                        location_of(new)
                    },
                });
            }
        }
        if copies.is_empty() {
            return Ok(0);
        }
        // The live map already names the copies: a settle the caller appends
        // later, whichever position it names, frees the right slot.
        let swapped = live.relocate(&copies);
        debug_assert_eq!(swapped.len(), copies.len());
        Ok(swapped.into_iter().filter(|s| *s).count())
    }

    fn stats(&self) -> StoreStats {
        let st = self.state.lock();
        StoreStats {
            appended_bytes: st.appended_bytes,
            // What the records still held take: the space a drop,
            // truncation or settle gives back shows here at once.
            disk_bytes: st
                .records
                .values()
                .map(|r| (r.msg.header.len() + r.msg.body.len()) as u64)
                .sum(),
            ..StoreStats::default()
        }
    }

    fn scan_state(&self, prefix: &[u8]) -> Result<Vec<StateEntry>, StoreError> {
        let st = self.state.lock();
        Ok(st
            .state_map
            .range(prefix.to_vec()..)
            .take_while(|(k, _)| k.starts_with(prefix))
            .map(|(k, (version, value))| StateEntry {
                key: k.clone(),
                value: value.clone(),
                version: *version,
            })
            .collect())
    }

    fn close(&self) -> Result<(), StoreError> {
        self.state.lock().closed = true;
        // Closing makes everything durable.
        self.release();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{MessageAttrs, MessageData};

    fn publish(store: &MemStore, waiter: Option<Waiter>) -> Location {
        let id = store.allocate_ids(1);
        let mut locs = Vec::new();
        store
            .append(
                &[Op::Publish {
                    id,
                    partitions: &[PartitionId(1)],
                    data: MessageData {
                        exchange: "",
                        routing_key: "q",
                        header_format: 1,
                        header: b"",
                        body: b"x",
                        attrs: MessageAttrs::default(),
                    },
                }],
                &mut locs,
                waiter,
            )
            .unwrap();
        locs[0]
    }

    #[test]
    fn held_waiters_complete_only_on_release_in_order() {
        let store = MemStore::new();
        let done = Arc::new(Mutex::new(Vec::new()));
        let waiter = |n: usize| -> Waiter {
            let done = done.clone();
            Box::new(move |r| {
                r.unwrap();
                done.lock().push(n);
            })
        };
        publish(&store, Some(waiter(0)));
        assert_eq!(*done.lock(), vec![0], "not held: completes at once");
        store.hold_durability(true);
        publish(&store, Some(waiter(1)));
        publish(&store, Some(waiter(2)));
        assert_eq!(store.held_waiters(), 2);
        assert_eq!(*done.lock(), vec![0], "held");
        store.release();
        assert_eq!(*done.lock(), vec![0, 1, 2]);
        publish(&store, Some(waiter(3)));
        assert_eq!(store.held_waiters(), 1, "still holding after release");
        store.hold_durability(false);
        assert_eq!(*done.lock(), vec![0, 1, 2, 3]);
    }

    #[test]
    fn positions_of_other_stores_are_not_found() {
        let store = MemStore::new();
        let loc = publish(&store, None);
        assert!(store.read(loc).is_ok());
        assert!(matches!(
            store.read(crate::testing::location(0)),
            Err(StoreError::NotFound(_))
        ));
    }

    struct MemHarness {
        current: Option<Arc<MemStore>>,
        persists: bool,
    }

    impl crate::testing::contract::Harness for MemHarness {
        fn create(&mut self) -> Arc<dyn Store> {
            let s = MemStore::new();
            self.current = Some(s.clone());
            s
        }
        fn persists(&self) -> bool {
            self.persists
        }
        fn reopen(&mut self, store: Arc<dyn Store>) -> Arc<dyn Store> {
            drop(store);
            let old = self.current.take().expect("created first");
            let s = old.reopen();
            self.current = Some(s.clone());
            s
        }
    }

    #[test]
    fn mem_store_passes_the_store_contract() {
        for persists in [false, true] {
            crate::testing::contract::run_all(&mut MemHarness {
                current: None,
                persists,
            });
        }
    }
}
