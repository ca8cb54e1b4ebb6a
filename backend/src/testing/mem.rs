//! [`MemStore`]: everything in memory, durability on a manual switch.

use crate::{
    Admission, Epoch, LiveSet, Location, MessageData, MessageId, MessageRef, MetaChange, MetaEvent,
    MetaFeed, Op, PartitionId, RangeMessage, ReadFuture, Receipt, RecoveredMessage, RecoveredMeta,
    Relocation, ShareTag, StateEntry, Store, StoreError, StoreStats, StoredMessage, Ticket, Waiter,
    Wake,
};
use bytes::Bytes;
use parking_lot::Mutex;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

/// Marks MemStore positions (third word), so a position from another store
/// is never mistaken for one of ours.
const MEM_TAG: u32 = 0x4d45_4d00;
/// Marks the positions of MemStore's [`crate::Spill`] (third word).
const MEM_SPILL_TAG: u32 = 0x4d45_4d01;

/// The ticket domain of metadata changes (they are one more partition of
/// their own, see [`Ticket`]).
const META: Domain = Domain::Meta;

/// An in-memory [`Store`] for in-process tests.
///
/// * Positions are slots in a map; [`Store::compact`] moves *every* live
///   position it is shown, so callers' handling of moved positions is
///   exercised on every call.
/// * Tickets are durable as soon as their append returns, unless
///   [`MemStore::hold_durability`] is on: then appends stay pending until
///   [`MemStore::release`] (everything) or [`MemStore::release_ticket`]
///   (one ticket and what it covers, per partition), which lets a test
///   prove that nothing waits on an fsync it should not wait on, and that
///   nothing relies on durability across partitions.
/// * [`MemStore::crash`] gives a new store over what was durable: only what
///   completed tickets covered (a prefix per partition).
///   [`MemStore::reopen`] is a clean restart: everything survives except
///   paged messages, and idempotency receipts expired by the wall clock.
/// * [`MemStore::handle`] gives another handle on the same data, as a
///   second process would have: ownership ([`Store::acquire`]) is per
///   handle, metadata and its change feed are shared.
/// * [`MemStore::defer_reads`] makes reads answer on the second poll, so
///   callers cannot assume a ready future.
pub struct MemStore {
    shared: Arc<Shared>,
    handle: u64,
}

struct Shared {
    state: Mutex<State>,
    /// Held while waiters are called, so that one called at once never
    /// overtakes one being called by another thread (reentrant: a waiter
    /// may register another).
    calls: parking_lot::ReentrantMutex<()>,
    next_id: AtomicU64,
    next_handle: AtomicU64,
    defer_reads: AtomicBool,
}

/// The ordering domains of tickets: a partition, the metadata map, or the
/// state store.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Domain {
    Part(PartitionId),
    Meta,
    State,
}

/// Everything a store holds, as of some point of its append sequence.
#[derive(Default, Clone)]
struct Data {
    records: HashMap<u64, Record>,
    /// Current slot of every live (partition, id).
    live: HashMap<PartitionId, BTreeMap<MessageId, u64>>,
    /// Last requeue (attempts, deliver_at_ms) of every live (partition, id)
    /// requeued since it was published.
    requeued: HashMap<(PartitionId, MessageId), (u32, u64)>,
    meta: BTreeMap<Vec<u8>, Vec<u8>>,
    meta_version: u64,
    key_versions: BTreeMap<Vec<u8>, u64>,
    /// The latest expiry of every (partition, key hash) receipt appended.
    receipts: HashMap<(PartitionId, u64), u64>,
    /// The state store: per key, its version and value.
    state: BTreeMap<Vec<u8>, (u64, Vec<u8>)>,
}

#[derive(Clone)]
struct Record {
    msg: StoredMessage,
    paged: bool,
    /// Partitions whose current position is this record.
    live: u32,
}

/// An op with everything it needs to be applied again later (to the
/// durable copy), positions included.
#[derive(Clone)]
enum Owned {
    Publish {
        slot: u64,
        partitions: Vec<PartitionId>,
        msg: StoredMessage,
        paged: bool,
        /// A move: the message leaves this (partition, id) in the same step.
        from: Option<(PartitionId, MessageId)>,
    },
    Settle(PartitionId, MessageId),
    Requeue(PartitionId, MessageId, u32, u64),
    Receipt(PartitionId, u64, u64),
    Meta(Vec<(Vec<u8>, Option<Vec<u8>>)>),
    /// Every message of the partition below the id leaves it
    /// (`MessageId::MAX`: a drop).
    Cut(PartitionId, MessageId),
    /// A state-store key set (`Some`) or removed.
    State(Vec<u8>, Option<Vec<u8>>),
    /// A compaction copy of (partition, id) from one slot to another.
    Relocate {
        partition: PartitionId,
        id: MessageId,
        from: u64,
        to: u64,
    },
}

/// An append not yet durable.
struct Pending {
    ticket: u64,
    domains: Vec<Domain>,
    ops: Vec<Owned>,
}

struct State {
    /// As appended.
    now: Data,
    /// What a crash keeps.
    durable: Data,
    /// Appends not yet durable, in append order.
    journal: Vec<Pending>,
    next_slot: u64,
    next_ticket: u64,
    /// Waiters of tickets not yet durable.
    waiting: Vec<(u64, Waiter)>,
    hold: bool,
    closed: bool,
    appended_bytes: u64,
    /// Every partition with live stored messages when this store opened.
    opened_partitions: Vec<PartitionId>,
    /// Current holder (handle) and epoch of every acquired partition.
    holders: HashMap<PartitionId, (u64, Epoch)>,
    /// The last epoch given for each partition (kept across restarts).
    epochs: HashMap<PartitionId, u64>,
    /// Every metadata change since `history_base`.
    history: Vec<MetaEvent>,
    history_base: u64,
    /// Armed by `watch`; called at the next metadata change.
    wakes: Vec<Wake>,
}

impl State {
    fn new(now: Data) -> State {
        State {
            durable: now.clone(),
            history_base: now.meta_version,
            now,
            journal: Vec::new(),
            next_slot: 0,
            next_ticket: 1,
            waiting: Vec::new(),
            hold: false,
            closed: false,
            appended_bytes: 0,
            opened_partitions: Vec::new(),
            holders: HashMap::new(),
            epochs: HashMap::new(),
            history: Vec::new(),
            wakes: Vec::new(),
        }
    }

    /// Makes the journal entry at `idx`, and every earlier one sharing a
    /// domain with what is made durable, durable (a prefix per partition).
    fn make_durable(&mut self, idx: usize) {
        let mut domains: BTreeSet<Domain> = self.journal[idx].domains.iter().copied().collect();
        let mut take = vec![false; idx + 1];
        take[idx] = true;
        for i in (0..idx).rev() {
            if self.journal[i].domains.iter().any(|d| domains.contains(d)) {
                take[i] = true;
                domains.extend(self.journal[i].domains.iter().copied());
            }
        }
        let mut kept = Vec::with_capacity(self.journal.len());
        for (i, p) in std::mem::take(&mut self.journal).into_iter().enumerate() {
            if take.get(i).copied().unwrap_or(false) {
                for op in &p.ops {
                    self.durable.apply(op);
                }
            } else {
                kept.push(p);
            }
        }
        self.journal = kept;
    }

    fn make_all_durable(&mut self) {
        for p in std::mem::take(&mut self.journal) {
            for op in &p.ops {
                self.durable.apply(op);
            }
        }
    }

    fn is_durable(&self, ticket: u64) -> bool {
        !self.journal.iter().any(|p| p.ticket == ticket)
    }

    /// Takes the waiters that can be called now: the longest run, in
    /// registration order, of waiters whose tickets are durable (a waiter
    /// never overtakes an earlier one).
    fn completed(&mut self) -> Vec<Waiter> {
        let n = self
            .waiting
            .iter()
            .take_while(|(t, _)| self.is_durable(*t))
            .count();
        self.waiting.drain(..n).map(|(_, w)| w).collect()
    }

    /// Fails with `Fenced` when another handle than `handle` holds `p`.
    fn check_holder(&self, handle: u64, p: PartitionId) -> Result<(), StoreError> {
        match self.holders.get(&p) {
            Some((h, _)) if *h != handle => Err(StoreError::Fenced(p)),
            _ => Ok(()),
        }
    }

    /// A new store's state over `data`, as a restart of this one.
    fn restarted(&self, data: Data) -> State {
        let mut next = State::new(data);
        next.next_slot = self.next_slot;
        next.epochs = self.epochs.clone();
        let parts: BTreeSet<PartitionId> = next
            .now
            .live
            .iter()
            .filter(|(_, ids)| !ids.is_empty())
            .map(|(p, _)| *p)
            .collect();
        next.opened_partitions = parts.into_iter().collect();
        next
    }
}

impl Data {
    fn apply(&mut self, op: &Owned) {
        match op {
            Owned::Publish {
                slot,
                partitions,
                msg,
                paged,
                from,
            } => {
                if let Some((p, id)) = from {
                    self.settle(*p, *id);
                }
                self.records.insert(
                    *slot,
                    Record {
                        msg: msg.clone(),
                        paged: *paged,
                        live: 0,
                    },
                );
                for p in partitions {
                    let old = self.live.entry(*p).or_default().insert(msg.id, *slot);
                    if let Some(old) = old {
                        self.unlive(old);
                    }
                    self.requeued.remove(&(*p, msg.id));
                    if let Some(r) = self.records.get_mut(slot) {
                        r.live += 1;
                    }
                }
                if self.records.get(slot).is_some_and(|r| r.live == 0) {
                    self.records.remove(slot);
                }
            }
            Owned::Settle(p, id) => self.settle(*p, *id),
            Owned::Requeue(p, id, attempts, deliver_at) => {
                // Only a live message has a delivery state to keep.
                if self.live.get(p).is_some_and(|m| m.contains_key(id)) {
                    self.requeued.insert((*p, *id), (*attempts, *deliver_at));
                }
            }
            Owned::Receipt(p, key_hash, expires) => {
                let e = self.receipts.entry((*p, *key_hash)).or_default();
                *e = (*e).max(*expires);
            }
            Owned::Meta(changes) => {
                self.meta_version += 1;
                for (key, value) in changes {
                    match value {
                        Some(v) => {
                            self.meta.insert(key.clone(), v.clone());
                            self.key_versions.insert(key.clone(), self.meta_version);
                        }
                        None => {
                            self.meta.remove(key);
                            self.key_versions.remove(key);
                        }
                    }
                }
            }
            Owned::Cut(p, before) => self.cut(*p, *before),
            Owned::State(key, value) => match value {
                Some(v) => {
                    let version = self.state.get(key).map_or(1, |(n, _)| n + 1);
                    self.state.insert(key.clone(), (version, v.clone()));
                }
                None => {
                    self.state.remove(key);
                }
            },
            Owned::Relocate {
                partition,
                id,
                from,
                to,
            } => {
                let Some(slot) = self.live.get(partition).and_then(|m| m.get(id)).copied() else {
                    return;
                };
                if slot != *from {
                    return;
                }
                let Some(rec) = self.records.get(&slot).cloned() else {
                    return;
                };
                self.records.insert(*to, Record { live: 1, ..rec });
                self.unlive(slot);
                if let Some(m) = self.live.get_mut(partition) {
                    m.insert(*id, *to);
                }
            }
        }
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

    fn read(&self, location: Location) -> Result<StoredMessage, StoreError> {
        slot_of(location)
            .and_then(|s| self.records.get(&s))
            .map(|r| r.msg.clone())
            .ok_or(StoreError::NotFound(location))
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

    /// What survives a restart: no paged records, no expired receipts.
    fn restart(&self, now_ms: u64) -> Data {
        let mut next = Data {
            meta: self.meta.clone(),
            meta_version: self.meta_version,
            key_versions: self.key_versions.clone(),
            state: self.state.clone(),
            ..Data::default()
        };
        for (&(p, key_hash), &expires_at_ms) in &self.receipts {
            if expires_at_ms > now_ms {
                next.receipts.insert((p, key_hash), expires_at_ms);
            }
        }
        for (p, ids) in &self.live {
            for (&id, &slot) in ids {
                let Some(r) = self.records.get(&slot).filter(|r| !r.paged) else {
                    continue;
                };
                let kept = next.records.entry(slot).or_insert_with(|| Record {
                    live: 0,
                    ..r.clone()
                });
                kept.live += 1;
                next.live.entry(*p).or_default().insert(id, slot);
                if let Some(&rq) = self.requeued.get(&(*p, id)) {
                    next.requeued.insert((*p, id), rq);
                }
            }
        }
        next
    }

    /// The live stored messages of `p`, in id order.
    fn recovered(&self, p: PartitionId) -> Vec<RecoveredMessage> {
        let Some(ids) = self.live.get(&p) else {
            return Vec::new();
        };
        ids.iter()
            .filter_map(|(&id, &slot)| {
                let r = self.records.get(&slot).filter(|r| !r.paged)?;
                let mut attrs = r.msg.attrs;
                let mut attempts = 0;
                if let Some(&(a, d)) = self.requeued.get(&(p, id)) {
                    (attempts, attrs.deliver_at_ms) = (a, d);
                }
                Some(RecoveredMessage {
                    id,
                    location: location_of(slot),
                    size: r.msg.body.len() as u32,
                    attempts,
                    attrs,
                })
            })
            .collect()
    }
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
                    MetaChange::Put { key, value } => var(key) + var(value),
                    MetaChange::Delete { key } => var(key),
                })
                .sum::<u64>()
        }
        _ => 16,
    }
}

fn owned_message(id: MessageId, data: &MessageData<'_>) -> StoredMessage {
    StoredMessage {
        id,
        exchange: data.exchange.to_string(),
        routing_key: data.routing_key.to_string(),
        header_format: data.header_format,
        header: Bytes::copy_from_slice(data.header),
        body: Bytes::copy_from_slice(data.body),
        attrs: data.attrs,
    }
}

/// The spill: records like published ones, marked paged (dropped by a
/// restart), with positions of their own tag; local, so never journaled
/// (nothing of it is durable).
impl crate::Spill for MemStore {
    fn spill(
        &self,
        _tag: ShareTag,
        id: MessageId,
        partitions: &[PartitionId],
        data: MessageData<'_>,
    ) -> Result<(Location, Admission), StoreError> {
        if partitions.is_empty() {
            return Err(invalid("a spilled message needs at least one partition"));
        }
        let mut st = self.shared.state.lock();
        if st.closed {
            return Err(StoreError::Closed);
        }
        let slot = st.next_slot;
        st.next_slot += 1;
        st.appended_bytes += (data.header.len() + data.body.len()) as u64;
        st.now.apply(&Owned::Publish {
            slot,
            partitions: partitions.to_vec(),
            msg: owned_message(id, &data),
            paged: true,
            from: None,
        });
        self.shared.next_id.fetch_max(id + 1, Ordering::SeqCst);
        Ok((spill_location_of(slot), Admission::default()))
    }

    fn read(&self, location: Location) -> Result<StoredMessage, StoreError> {
        if !is_spilled(location) {
            return Err(StoreError::NotFound(location));
        }
        self.shared.state.lock().now.read(location)
    }

    fn holds(&self, location: Location) -> bool {
        is_spilled(location)
    }

    fn release(&self, partition: PartitionId, id: MessageId, location: Location) {
        if is_spilled(location) {
            self.shared.state.lock().now.settle(partition, id);
        }
    }

    fn release_partition(&self, partition: PartitionId) {
        self.shared.state.lock().now.cut(partition, MessageId::MAX);
    }
}

impl std::fmt::Debug for MemStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemStore")
            .field("handle", &self.handle)
            .finish_non_exhaustive()
    }
}

impl Default for MemStore {
    fn default() -> Self {
        MemStore::over(State::new(Data::default()), 1)
    }
}

/// A read that answers on its second poll (see [`MemStore::defer_reads`]).
struct Deferred<T> {
    value: Option<T>,
    polled: bool,
}

impl<T: Unpin> Future for Deferred<T> {
    type Output = T;
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        if !self.polled {
            self.polled = true;
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        match self.value.take() {
            Some(v) => Poll::Ready(v),
            None => Poll::Pending,
        }
    }
}

impl MemStore {
    fn over(state: State, next_id: u64) -> MemStore {
        MemStore {
            shared: Arc::new(Shared {
                state: Mutex::new(state),
                calls: parking_lot::ReentrantMutex::new(()),
                next_id: AtomicU64::new(next_id),
                next_handle: AtomicU64::new(2),
                defer_reads: AtomicBool::new(false),
            }),
            handle: 1,
        }
    }

    /// An empty store.
    pub fn new() -> Arc<MemStore> {
        Arc::new(MemStore::default())
    }

    /// Another handle on this store's data, as a second process sharing
    /// the store would have: its own ownership of partitions, the same
    /// messages, metadata and change feed.
    pub fn handle(&self) -> Arc<MemStore> {
        Arc::new(MemStore {
            shared: self.shared.clone(),
            handle: self.shared.next_handle.fetch_add(1, Ordering::Relaxed),
        })
    }

    /// While `hold` is on, appends stay pending (not durable); switching it
    /// off makes everything durable and completes every waiter
    /// (successfully), in append order.
    pub fn hold_durability(&self, hold: bool) {
        self.shared.state.lock().hold = hold;
        if !hold {
            self.release();
        }
    }

    /// Makes everything appended so far durable and completes every
    /// waiter (successfully), in append order. The hold stays as it is.
    pub fn release(&self) {
        let _calls = self.shared.calls.lock();
        let done = {
            let mut st = self.shared.state.lock();
            st.make_all_durable();
            st.completed()
        };
        for w in done {
            w(Ok(()));
        }
    }

    /// Makes `ticket` durable, with what it covers and nothing else: the
    /// earlier appends sharing a partition with it (transitively, so that
    /// every partition keeps a prefix). Completes the waiters of the
    /// tickets that are durable now.
    pub fn release_ticket(&self, ticket: Ticket) {
        let _calls = self.shared.calls.lock();
        let done = {
            let mut st = self.shared.state.lock();
            if let Some(i) = st.journal.iter().position(|p| p.ticket == ticket.get()) {
                st.make_durable(i);
            }
            st.completed()
        };
        for w in done {
            w(Ok(()));
        }
    }

    /// Whether everything `ticket` covers is durable.
    pub fn ticket_durable(&self, ticket: Ticket) -> bool {
        ticket == Ticket::NONE || self.shared.state.lock().is_durable(ticket.get())
    }

    /// Breaks the contract on purpose, for the contract suite's own tests:
    /// makes the append of `ticket` durable *without* the earlier appends
    /// of its partitions.
    #[doc(hidden)]
    pub fn release_only(&self, ticket: Ticket) {
        let _calls = self.shared.calls.lock();
        let done = {
            let mut st = self.shared.state.lock();
            if let Some(i) = st.journal.iter().position(|p| p.ticket == ticket.get()) {
                let p = st.journal.remove(i);
                for op in &p.ops {
                    st.durable.apply(op);
                }
            }
            st.completed()
        };
        for w in done {
            w(Ok(()));
        }
    }

    /// Waiters pending under the hold.
    pub fn held_waiters(&self) -> usize {
        self.shared.state.lock().waiting.len()
    }

    /// The tickets of the appends not yet durable, in append order.
    pub fn pending_tickets(&self) -> Vec<Ticket> {
        self.shared
            .state
            .lock()
            .journal
            .iter()
            .map(|p| Ticket::new(p.ticket))
            .collect()
    }

    /// Appends not yet durable (under the hold).
    pub fn pending_appends(&self) -> usize {
        self.shared.state.lock().journal.len()
    }

    /// Live (partition, message) pairs, paged ones included.
    pub fn live_count(&self) -> usize {
        self.shared
            .state
            .lock()
            .now
            .live
            .values()
            .map(|m| m.len())
            .sum()
    }

    /// While on, every read's future answers on its second poll instead of
    /// being ready at once.
    pub fn defer_reads(&self, on: bool) {
        self.shared.defer_reads.store(on, Ordering::Relaxed);
    }

    /// A new store over this one's data, as a clean restart would see it:
    /// metadata and ids kept, every live published message recovered per
    /// partition, paged messages dropped. This store is closed (every
    /// append made durable first, as a clean close does).
    pub fn reopen(&self) -> Arc<MemStore> {
        self.release();
        self.restart(false)
    }

    /// A new store over what was durable here, as after a power cut: only
    /// what completed tickets covered survives (a prefix of each
    /// partition), paged messages are dropped, pending waiters are dropped
    /// uncalled (the process that waited is gone). This store is closed.
    pub fn crash(&self) -> Arc<MemStore> {
        self.restart(true)
    }

    fn restart(&self, crashed: bool) -> Arc<MemStore> {
        let mut st = self.shared.state.lock();
        st.closed = true;
        let base = if crashed { &st.durable } else { &st.now };
        let data = base.restart(crate::log::now_ms());
        let next = st.restarted(data);
        st.waiting.clear();
        st.wakes.clear();
        Arc::new(MemStore::over(
            next,
            self.shared.next_id.load(Ordering::SeqCst),
        ))
    }

    /// Records `ops` (already validated) at the end of the journal, in
    /// `now`, and in `durable` unless held. Returns the ticket.
    fn record(&self, st: &mut State, ops: Vec<Owned>, domains: Vec<Domain>) -> (Ticket, Vec<Wake>) {
        let meta_changed = ops.iter().any(|o| matches!(o, Owned::Meta(_)));
        let mut wakes = Vec::new();
        for op in &ops {
            st.now.apply(op);
            if let Owned::Meta(changes) = op {
                let version = st.now.meta_version;
                for (key, value) in changes {
                    st.history.push(MetaEvent {
                        version,
                        key: key.clone(),
                        value: value.clone(),
                    });
                }
            }
        }
        if meta_changed {
            wakes = std::mem::take(&mut st.wakes);
        }
        if domains.is_empty() {
            // Touches nothing: covers nothing.
            for op in &ops {
                st.durable.apply(op);
            }
            return (Ticket::NONE, wakes);
        }
        let ticket = st.next_ticket;
        st.next_ticket += 1;
        if st.hold {
            st.journal.push(Pending {
                ticket,
                domains,
                ops,
            });
        } else {
            // Durable at once, so everything before is too.
            st.make_all_durable();
            for op in &ops {
                st.durable.apply(op);
            }
        }
        (Ticket::new(ticket), wakes)
    }
}

fn invalid(what: &str) -> StoreError {
    StoreError::Invalid(what.to_string())
}

impl Store for MemStore {
    fn allocate_ids(&self, n: u64) -> MessageId {
        self.shared.next_id.fetch_add(n, Ordering::SeqCst)
    }

    fn append(&self, ops: &[Op<'_>], locations: &mut Vec<Location>) -> Result<Ticket, StoreError> {
        for op in ops {
            if let Op::Publish { partitions, .. } | Op::Move { partitions, .. } = op {
                if partitions.is_empty() {
                    return Err(invalid("a publish needs at least one partition"));
                }
            }
        }
        let mut st = self.shared.state.lock();
        if st.closed {
            return Err(StoreError::Closed);
        }
        // Ownership first: a fenced batch leaves nothing behind.
        let mut domains: Vec<Domain> = Vec::new();
        for op in ops {
            let mut add = |d: Domain| {
                if !domains.contains(&d) {
                    domains.push(d);
                }
            };
            match op {
                Op::Publish { partitions, .. } => {
                    partitions.iter().for_each(|p| add(Domain::Part(*p)))
                }
                Op::Move {
                    partitions, from, ..
                } => {
                    partitions.iter().for_each(|p| add(Domain::Part(*p)));
                    add(Domain::Part(*from));
                }
                Op::Settle { partition, .. }
                | Op::Requeue { partition, .. }
                | Op::Receipt { partition, .. }
                | Op::DropPartition { partition }
                | Op::Truncate { partition, .. } => add(Domain::Part(*partition)),
                Op::PutMeta { .. } | Op::DeleteMeta { .. } | Op::MetaBatch { .. } => add(META),
                Op::PutState { .. } | Op::DeleteState { .. } => add(Domain::State),
            }
        }
        for d in &domains {
            if let Domain::Part(p) = d {
                st.check_holder(self.handle, *p)?;
            }
        }
        let mut owned = Vec::with_capacity(ops.len());
        for op in ops {
            st.appended_bytes += record_bytes(op);
            owned.push(match op {
                Op::Publish {
                    id,
                    partitions,
                    data,
                } => {
                    let slot = st.next_slot;
                    st.next_slot += 1;
                    st.appended_bytes += (data.header.len() + data.body.len()) as u64;
                    self.shared.next_id.fetch_max(id + 1, Ordering::SeqCst);
                    locations.push(location_of(slot));
                    Owned::Publish {
                        slot,
                        partitions: partitions.to_vec(),
                        msg: owned_message(*id, data),
                        paged: false,
                        from: None,
                    }
                }
                Op::Move {
                    id,
                    partitions,
                    data,
                    from,
                    from_id,
                    ..
                } => {
                    // One step: atomic, as the contract asks.
                    let slot = st.next_slot;
                    st.next_slot += 1;
                    st.appended_bytes += (data.header.len() + data.body.len()) as u64;
                    self.shared.next_id.fetch_max(id + 1, Ordering::SeqCst);
                    locations.push(location_of(slot));
                    Owned::Publish {
                        slot,
                        partitions: partitions.to_vec(),
                        msg: owned_message(*id, data),
                        paged: false,
                        from: Some((*from, *from_id)),
                    }
                }
                Op::Settle { partition, id, .. } => Owned::Settle(*partition, *id),
                Op::Requeue {
                    partition,
                    id,
                    attempts,
                    deliver_at_ms,
                    ..
                } => Owned::Requeue(*partition, *id, *attempts, *deliver_at_ms),
                Op::Receipt {
                    partition,
                    key_hash,
                    expires_at_ms,
                } => Owned::Receipt(*partition, *key_hash, *expires_at_ms),
                Op::PutMeta { key, value } => {
                    Owned::Meta(vec![(key.to_vec(), Some(value.to_vec()))])
                }
                Op::DeleteMeta { key } => Owned::Meta(vec![(key.to_vec(), None)]),
                Op::DropPartition { partition } => Owned::Cut(*partition, MessageId::MAX),
                Op::Truncate { partition, before } => Owned::Cut(*partition, *before),
                Op::PutState { key, value } => Owned::State(key.to_vec(), Some(value.to_vec())),
                Op::DeleteState { key } => Owned::State(key.to_vec(), None),
                Op::MetaBatch { changes } => Owned::Meta(
                    changes
                        .iter()
                        .map(|c| match c {
                            MetaChange::Put { key, value } => (key.to_vec(), Some(value.to_vec())),
                            MetaChange::Delete { key } => (key.to_vec(), None),
                        })
                        .collect(),
                ),
            });
        }
        let (ticket, wakes) = self.record(&mut st, owned, domains);
        drop(st);
        for w in wakes {
            w();
        }
        Ok(ticket)
    }

    fn when_durable(&self, ticket: Ticket, waiter: Waiter) {
        let _calls = self.shared.calls.lock();
        let mut st = self.shared.state.lock();
        let durable = ticket == Ticket::NONE || st.is_durable(ticket.get());
        if durable && st.waiting.is_empty() {
            drop(st);
            waiter(Ok(()));
            return;
        }
        st.waiting.push((ticket.get(), waiter));
    }

    fn read_many(&self, refs: &[MessageRef]) -> ReadFuture<Vec<Result<StoredMessage, StoreError>>> {
        let out: Vec<_> = refs.iter().map(|r| self.read(r.location)).collect();
        if self.shared.defer_reads.load(Ordering::Relaxed) {
            Box::pin(Deferred {
                value: Some(out),
                polled: false,
            })
        } else {
            crate::ready(out)
        }
    }

    fn read_range(
        &self,
        partition: PartitionId,
        from: MessageId,
        max: usize,
    ) -> ReadFuture<Result<Vec<RangeMessage>, StoreError>> {
        let out = {
            let st = self.shared.state.lock();
            let mut out = Vec::new();
            if let Some(ids) = st.now.live.get(&partition) {
                for (&id, &slot) in ids.range(from..) {
                    if out.len() >= max {
                        break;
                    }
                    let Some(r) = st.now.records.get(&slot).filter(|r| !r.paged) else {
                        continue;
                    };
                    let mut message = r.msg.clone();
                    let mut attempts = 0;
                    if let Some(&(a, d)) = st.now.requeued.get(&(partition, id)) {
                        (attempts, message.attrs.deliver_at_ms) = (a, d);
                    }
                    out.push(RangeMessage {
                        at: MessageRef::new(partition, id, location_of(slot)),
                        attempts,
                        message,
                    });
                }
            }
            Ok(out)
        };
        if self.shared.defer_reads.load(Ordering::Relaxed) {
            Box::pin(Deferred {
                value: Some(out),
                polled: false,
            })
        } else {
            crate::ready(out)
        }
    }

    fn read(&self, location: Location) -> Result<StoredMessage, StoreError> {
        if is_spilled(location) {
            // The spill's: read through `Spill::read`.
            return Err(StoreError::NotFound(location));
        }
        self.shared.state.lock().now.read(location)
    }

    fn recovered_meta(&self) -> Result<RecoveredMeta, StoreError> {
        let st = self.shared.state.lock();
        Ok(RecoveredMeta {
            meta: st.now.meta.clone(),
            version: st.now.meta_version,
            key_versions: st.now.key_versions.clone(),
            truncated_bytes: 0,
        })
    }

    fn put_if(
        &self,
        key: &[u8],
        value: Option<&[u8]>,
        expected: u64,
    ) -> Result<(Ticket, u64), StoreError> {
        let mut st = self.shared.state.lock();
        if st.closed {
            return Err(StoreError::Closed);
        }
        let found = st.now.key_versions.get(key).copied().unwrap_or(0);
        if found != expected {
            return Err(StoreError::Conflict { expected, found });
        }
        let op = Owned::Meta(vec![(key.to_vec(), value.map(<[u8]>::to_vec))]);
        let (ticket, wakes) = self.record(&mut st, vec![op], vec![META]);
        let version = st.now.meta_version;
        drop(st);
        for w in wakes {
            w();
        }
        Ok((ticket, version))
    }

    fn watch(&self, since: u64, wake: Wake) -> Result<MetaFeed, StoreError> {
        let mut st = self.shared.state.lock();
        if st.closed {
            return Err(StoreError::Closed);
        }
        if since < st.history_base {
            return Ok(MetaFeed::Reload);
        }
        let changes: Vec<MetaEvent> = st
            .history
            .iter()
            .filter(|e| e.version > since)
            .cloned()
            .collect();
        if changes.is_empty() {
            st.wakes.push(wake);
        }
        Ok(MetaFeed::Changes(changes))
    }

    fn acquire(&self, partition: PartitionId) -> Result<Epoch, StoreError> {
        let mut st = self.shared.state.lock();
        if st.closed {
            return Err(StoreError::Closed);
        }
        let e = st.epochs.entry(partition).or_default();
        *e += 1;
        let epoch = Epoch(*e);
        st.holders.insert(partition, (self.handle, epoch));
        Ok(epoch)
    }

    fn try_acquire(&self, partition: PartitionId) -> Result<Option<Epoch>, StoreError> {
        {
            let st = self.shared.state.lock();
            if let Some((h, e)) = st.holders.get(&partition) {
                return Ok((*h == self.handle).then_some(*e));
            }
        }
        self.acquire(partition).map(Some)
    }

    fn recovered_partitions(&self) -> Result<Vec<PartitionId>, StoreError> {
        Ok(self.shared.state.lock().opened_partitions.clone())
    }

    fn recover_partition(
        &self,
        partition: PartitionId,
    ) -> Result<Vec<RecoveredMessage>, StoreError> {
        let st = self.shared.state.lock();
        st.check_holder(self.handle, partition)?;
        Ok(st.now.recovered(partition))
    }

    fn recover_receipts(&self, partition: PartitionId) -> Result<Vec<Receipt>, StoreError> {
        let st = self.shared.state.lock();
        st.check_holder(self.handle, partition)?;
        let now = crate::log::now_ms();
        Ok(st
            .now
            .receipts
            .iter()
            .filter(|((p, _), e)| *p == partition && **e > now)
            .map(|((_, key_hash), e)| Receipt {
                key_hash: *key_hash,
                expires_at_ms: *e,
            })
            .collect())
    }

    fn compact(&self, live: &dyn LiveSet) -> Result<usize, StoreError> {
        // Compaction never drops a receipt before it expires; expired ones
        // are forgotten here as the log store forgets them.
        let now = crate::log::now_ms();
        {
            let mut st = self.shared.state.lock();
            st.now.receipts.retain(|_, e| *e > now);
        }
        // Collect first, with no lock of ours held: the caller's locks are
        // held around `visit`, and its appends take ours.
        let mut todo = Vec::new();
        live.for_each_live(&mut |partition, id, location| todo.push((partition, id, location)));
        let mut copies = Vec::new();
        {
            let mut st = self.shared.state.lock();
            if st.closed {
                return Err(StoreError::Closed);
            }
            let mut ops = Vec::new();
            let mut domains = Vec::new();
            for (partition, id, old) in todo {
                // Only what is still live where the caller saw it: a settle
                // since then wins.
                let Some(slot) = st
                    .now
                    .live
                    .get(&partition)
                    .and_then(|m| m.get(&id))
                    .copied()
                else {
                    continue;
                };
                if slot_of(old) != Some(slot) {
                    continue;
                }
                let new = st.next_slot;
                st.next_slot += 1;
                ops.push(Owned::Relocate {
                    partition,
                    id,
                    from: slot,
                    to: new,
                });
                if !domains.contains(&Domain::Part(partition)) {
                    domains.push(Domain::Part(partition));
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
            if !ops.is_empty() {
                self.record(&mut st, ops, domains);
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
        let st = self.shared.state.lock();
        StoreStats {
            appended_bytes: st.appended_bytes,
            // What the records still held take: the space a drop,
            // truncation or settle gives back shows here at once.
            disk_bytes: st
                .now
                .records
                .values()
                .map(|r| (r.msg.header.len() + r.msg.body.len()) as u64)
                .sum(),
            ..StoreStats::default()
        }
    }

    fn scan_state(&self, prefix: &[u8]) -> Result<Vec<StateEntry>, StoreError> {
        let st = self.shared.state.lock();
        Ok(st
            .now
            .state
            .range(prefix.to_vec()..)
            .take_while(|(k, _)| k.starts_with(prefix))
            .map(|(k, (version, value))| StateEntry {
                key: k.clone(),
                value: value.clone(),
                version: *version,
            })
            .collect())
    }

    fn spill(&self) -> Option<&dyn crate::Spill> {
        Some(self)
    }

    fn close(&self) -> Result<(), StoreError> {
        self.shared.state.lock().closed = true;
        // Closing makes everything durable.
        self.release();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{MessageAttrs, MessageData};

    fn publish_to(store: &MemStore, p: PartitionId) -> (Location, Ticket) {
        let id = store.allocate_ids(1);
        let mut locs = Vec::new();
        let t = store
            .append(
                &[Op::Publish {
                    id,
                    partitions: &[p],
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
            )
            .unwrap();
        (locs[0], t)
    }

    fn publish(store: &MemStore, waiter: Option<Waiter>) -> Location {
        let (loc, t) = publish_to(store, PartitionId(1));
        if let Some(w) = waiter {
            store.when_durable(t, w);
        }
        loc
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
    fn a_released_ticket_covers_its_partitions_only() {
        let store = MemStore::new();
        store.hold_durability(true);
        let (a, _) = publish_to(&store, PartitionId(1));
        let (_, tb) = publish_to(&store, PartitionId(2));
        let (_, tc) = publish_to(&store, PartitionId(1));
        store.release_ticket(tc);
        assert_eq!(store.pending_appends(), 1, "P2's append is still pending");
        let crashed = store.crash();
        let p1 = crashed.recover_partition(PartitionId(1)).unwrap();
        assert_eq!(p1.len(), 2, "P1's prefix up to the ticket survived");
        assert_eq!(p1[0].location, a);
        assert!(
            crashed
                .recover_partition(PartitionId(2))
                .unwrap()
                .is_empty(),
            "P2 was never durable"
        );
        let _ = tb;
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
        fn second_handle(&mut self, _store: &Arc<dyn Store>) -> Option<Arc<dyn Store>> {
            Some(self.current.as_ref().expect("created first").handle())
        }
        fn crash(&mut self, store: Arc<dyn Store>) -> Option<Arc<dyn Store>> {
            drop(store);
            let old = self.current.take().expect("created first");
            let s = old.crash();
            self.current = Some(s.clone());
            Some(s)
        }
        fn hold(&mut self, _store: &Arc<dyn Store>) -> bool {
            self.current
                .as_ref()
                .expect("created first")
                .hold_durability(true);
            true
        }
        fn release(&mut self, _store: &Arc<dyn Store>, ticket: Ticket) {
            self.current
                .as_ref()
                .expect("created first")
                .release_ticket(ticket);
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
