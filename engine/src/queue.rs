//! Queues and their partitions.
//!
//! A partition is the unit of ordering, storage and dispatch: its ready
//! messages are FIFO by `seq`, it owns a durable [`PartitionId`] in the store,
//! and (in a cluster) one gateway at a time will own it. Every queue has at
//! least one. A partition's state sits behind its own mutex, so publishing to
//! or consuming from one queue never contends with another queue.
//!
//! Leases (delivered, unacknowledged entries) are held by the engine client
//! that received them ([`crate::client::Client`]), not here: the client
//! settles or returns them, and releasing a closed scope's leases is one walk
//! over that scope's map.

use super::consumer::{Consumer, Delivery};
use super::message::{now_ms, Entry};
use parking_lot::{Mutex, MutexGuard};
use serde_json::Value;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use weir_backend::{Location, MessageId, PartitionId};

/// Entries deeper than this in a partition keep only their location in
/// memory; their bodies are read back from the store when delivered, so
/// memory does not grow with queue depth. Durable entries have a location
/// anyway; transient ones (a transient message, or any message in a
/// non-durable queue) published while the partition is this deep are paged
/// to the store for it (`Op::Page`: never fsynced, dropped at restart).
pub const HOT_ENTRIES: usize = 2048;

/// Cheap counters kept for every partition.
#[derive(Default, Debug)]
pub struct Counters {
    /// Messages enqueued.
    pub published: AtomicU64,
    /// Deliveries made (basic.deliver and basic.get-ok).
    pub delivered: AtomicU64,
    /// Messages settled by acknowledgement.
    pub acked: AtomicU64,
    /// Deliveries that were a redelivery.
    pub redelivered: AtomicU64,
    /// Leased (delivered, unsettled) messages.
    pub leased: AtomicU64,
    /// Bytes of leased messages.
    pub leased_bytes: AtomicU64,
}

/// One partition of a queue.
pub struct Partition {
    /// Durable id in the store.
    pub id: PartitionId,
    /// Whether messages here are written to the store.
    pub durable: bool,
    state: Mutex<PartitionState>,
    /// Counters.
    pub counters: Counters,
    /// Ready messages, readable without the lock.
    ready_len: AtomicU64,
    /// Set when its queue is deleted: returned leases are settled, not requeued.
    deleted: AtomicBool,
}

#[derive(Default)]
struct PartitionState {
    ready: VecDeque<Entry>,
    ready_bytes: u64,
    next_seq: u64,
    consumers: Vec<Arc<Consumer>>,
    /// Round-robin cursor into `consumers`.
    next_consumer: usize,
    /// The queue was deleted.
    deleted: bool,
    /// Current store location of every leased (delivered, unsettled) durable
    /// entry. The channel holding the lease has a copy of the entry, but
    /// compaction may move the record meanwhile: settles and requeues take
    /// the location from here. Bounded by the consumers' credit.
    leased: HashMap<MessageId, Location>,
}

impl PartitionState {
    /// The partition's invariants, checked when a critical section ends
    /// (debug and test builds). The O(1) ones always; the walks only while
    /// the ready list is short, so deep-queue tests stay linear.
    #[cfg(debug_assertions)]
    fn check(&self, p: &Partition) {
        let len = self.ready.len() as u64;
        assert_eq!(
            p.ready_len.load(Ordering::Relaxed),
            len,
            "partition {:?}: ready_len counter differs from the ready list",
            p.id
        );
        if self.deleted {
            assert!(
                self.ready.is_empty() && self.consumers.is_empty(),
                "partition {:?}: a deleted partition holds entries or consumers",
                p.id
            );
        }
        if self.ready.len() > 4096 {
            return;
        }
        let mut bytes = 0u64;
        let mut prev: Option<u64> = None;
        for e in &self.ready {
            bytes += u64::from(e.size);
            assert!(
                prev.is_none_or(|s| s < e.seq) && e.seq < self.next_seq.max(1),
                "partition {:?}: ready list out of seq order",
                p.id
            );
            prev = Some(e.seq);
            assert!(
                !self.leased.contains_key(&e.id),
                "partition {:?}: message {} is both ready and leased",
                p.id,
                e.id
            );
        }
        assert_eq!(
            bytes, self.ready_bytes,
            "partition {:?}: ready_bytes differs from the ready entries",
            p.id
        );
    }
}

/// A partition's state under its lock. In debug and test builds the
/// partition's invariants are checked when the guard drops, i.e. at the end
/// of every critical section.
struct Locked<'a> {
    st: MutexGuard<'a, PartitionState>,
    #[cfg_attr(not(debug_assertions), allow(dead_code))]
    p: &'a Partition,
}

impl std::ops::Deref for Locked<'_> {
    type Target = PartitionState;
    fn deref(&self) -> &PartitionState {
        &self.st
    }
}

impl std::ops::DerefMut for Locked<'_> {
    fn deref_mut(&mut self) -> &mut PartitionState {
        &mut self.st
    }
}

impl Drop for Locked<'_> {
    fn drop(&mut self) {
        #[cfg(debug_assertions)]
        if !std::thread::panicking() {
            self.st.check(self.p);
        }
    }
}

/// Snapshot of a partition's depth.
#[derive(Clone, Copy, Debug, Default)]
pub struct Depth {
    /// Ready messages.
    pub ready: u64,
    /// Bytes of ready messages.
    pub ready_bytes: u64,
    /// Leased messages.
    pub leased: u64,
    /// Age of the oldest ready message in ms (0 if none).
    pub oldest_age_ms: u64,
    /// Consumers attached.
    pub consumers: u32,
}

impl Partition {
    /// Takes the partition's lock (see [`Locked`]).
    fn lock(&self) -> Locked<'_> {
        Locked {
            st: self.state.lock(),
            p: self,
        }
    }

    /// An empty partition.
    pub fn new(id: PartitionId, durable: bool) -> Arc<Self> {
        Arc::new(Partition {
            id,
            durable,
            state: Mutex::new(PartitionState::default()),
            counters: Counters::default(),
            ready_len: AtomicU64::new(0),
            deleted: AtomicBool::new(false),
        })
    }

    /// Deletes the partition: from now on it refuses entries and consumers.
    /// Returns the consumers it had and its ready entries, taken atomically
    /// with the flag so nothing slips in between.
    pub fn delete(&self) -> (Vec<Arc<Consumer>>, Vec<Entry>) {
        let mut st = self.lock();
        st.deleted = true;
        self.deleted.store(true, Ordering::Release);
        st.ready_bytes = 0;
        self.ready_len.store(0, Ordering::Relaxed);
        let consumers = std::mem::take(&mut st.consumers);
        (consumers, st.ready.drain(..).collect())
    }

    /// Whether its queue was deleted.
    pub fn is_deleted(&self) -> bool {
        self.deleted.load(Ordering::Acquire)
    }

    /// Ready messages.
    pub fn ready_len(&self) -> u64 {
        self.ready_len.load(Ordering::Relaxed)
    }

    /// Appends recovered entries (already in id order) at startup.
    pub fn restore(&self, entries: impl IntoIterator<Item = Entry>) {
        let mut st = self.lock();
        for mut e in entries {
            e.seq = st.next_seq;
            st.next_seq += 1;
            st.ready_bytes += e.size as u64;
            st.ready.push_back(e);
        }
        self.ready_len
            .store(st.ready.len() as u64, Ordering::Relaxed);
    }

    /// Adds a new message at the tail and hands out whatever consumers can take.
    /// Returns the entry if the queue was deleted meanwhile: the caller
    /// settles it in the store.
    #[must_use = "an entry refused by a deleted partition must be settled"]
    pub fn enqueue(self: &Arc<Self>, mut entry: Entry) -> Option<Entry> {
        let mut woken = Vec::new();
        {
            let mut st = self.lock();
            if st.deleted {
                return Some(entry);
            }
            entry.seq = st.next_seq;
            st.next_seq += 1;
            if st.ready.len() >= HOT_ENTRIES && entry.location.is_some() {
                // Deep in the queue: keep only where it is stored.
                entry.message = None;
            }
            st.ready_bytes += entry.size as u64;
            st.ready.push_back(entry);
            self.counters.published.fetch_add(1, Ordering::Relaxed);
            self.dispatch_locked(&mut st, &mut woken);
            self.ready_len
                .store(st.ready.len() as u64, Ordering::Relaxed);
        }
        wake_all(woken);
        None
    }

    /// Puts leased entries back at their original positions, marked redelivered.
    #[must_use = "entries refused by a deleted partition must be settled"]
    pub fn requeue(self: &Arc<Self>, entries: impl IntoIterator<Item = Entry>) -> Vec<Entry> {
        self.put_back(entries, true)
    }

    /// Puts back entries that were queued for a consumer but never written
    /// (the consumer went away first). They were not delivered, so they keep
    /// their redelivered flag and attempt count.
    #[must_use = "entries refused by a deleted partition must be settled"]
    pub fn unsend(self: &Arc<Self>, entries: impl IntoIterator<Item = Entry>) -> Vec<Entry> {
        self.put_back(entries, false)
    }

    /// Returns leased entries to the ready list (by `seq`, their original
    /// place) and offers them to consumers; a deleted partition refuses them.
    fn put_back(
        self: &Arc<Self>,
        entries: impl IntoIterator<Item = Entry>,
        delivered: bool,
    ) -> Vec<Entry> {
        let mut woken = Vec::new();
        let mut refused = Vec::new();
        {
            let mut st = self.lock();
            for mut e in entries {
                if let Some(l) = st.leased.remove(&e.id) {
                    e.location = Some(l);
                }
                self.counters.leased.fetch_sub(1, Ordering::Relaxed);
                self.counters
                    .leased_bytes
                    .fetch_sub(e.size as u64, Ordering::Relaxed);
                if st.deleted {
                    refused.push(e);
                    continue;
                }
                if delivered {
                    e.redelivered = true;
                } else {
                    self.counters.delivered.fetch_sub(1, Ordering::Relaxed);
                    e.attempts = e.attempts.saturating_sub(1);
                }
                st.ready_bytes += e.size as u64;
                insert_by_seq(&mut st.ready, e);
            }
            self.dispatch_locked(&mut st, &mut woken);
            self.ready_len
                .store(st.ready.len() as u64, Ordering::Relaxed);
        }
        wake_all(woken);
        refused
    }

    /// Whether any durable entry of this partition is leased.
    pub fn has_leases(&self) -> bool {
        !self.lock().leased.is_empty()
    }

    /// Where a leased entry's record is now.
    pub fn leased_location(&self, entry: &Entry) -> Option<Location> {
        let l = entry.location?;
        Some(
            self.state
                .lock()
                .leased
                .get(&entry.id)
                .copied()
                .unwrap_or(l),
        )
    }

    /// A leased entry was settled (acked, or rejected without requeue).
    /// Returns where its record is now, for the store's settle.
    #[must_use = "a settled durable entry must be settled in the store"]
    pub fn settled(&self, entry: &Entry, acked: bool) -> Option<Location> {
        let location = entry
            .location
            .map(|l| self.lock().leased.remove(&entry.id).unwrap_or(l));
        self.counters.leased.fetch_sub(1, Ordering::Relaxed);
        self.counters
            .leased_bytes
            .fetch_sub(entry.size as u64, Ordering::Relaxed);
        if acked {
            self.counters.acked.fetch_add(1, Ordering::Relaxed);
        }
        location
    }

    /// [`Self::settled`] for many entries, taking the lock once; `stored`
    /// receives the current location of each durable one.
    pub fn settled_many(
        &self,
        entries: &[Entry],
        acked: bool,
        mut stored: impl FnMut(MessageId, Location),
    ) {
        let bytes: u64 = entries.iter().map(|e| e.size as u64).sum();
        let n = entries.len() as u64;
        self.counters.leased.fetch_sub(n, Ordering::Relaxed);
        self.counters
            .leased_bytes
            .fetch_sub(bytes, Ordering::Relaxed);
        if acked {
            self.counters.acked.fetch_add(n, Ordering::Relaxed);
        }
        if entries.iter().all(|e| e.location.is_none()) {
            return;
        }
        let mut st = self.lock();
        for e in entries {
            if let Some(l) = e.location {
                stored(e.id, st.leased.remove(&e.id).unwrap_or(l));
            }
        }
    }

    /// Tries to deliver ready messages to consumers with credit.
    pub fn dispatch(self: &Arc<Self>) {
        if self.ready_len() == 0 {
            return;
        }
        let mut woken = Vec::new();
        {
            let mut st = self.lock();
            self.dispatch_locked(&mut st, &mut woken);
            self.ready_len
                .store(st.ready.len() as u64, Ordering::Relaxed);
        }
        wake_all(woken);
    }

    fn dispatch_locked(self: &Arc<Self>, st: &mut PartitionState, woken: &mut Vec<Arc<Consumer>>) {
        if st.consumers.iter().any(|c| c.is_dead()) {
            // A consumer whose connection or channel went away without
            // detaching (it raced with a cancel): never offer it anything.
            st.consumers.retain(|c| !c.is_dead());
            st.next_consumer = 0;
        }
        let n = st.consumers.len();
        if n == 0 {
            return;
        }
        // Round robin: each pass offers one message to each consumer in turn;
        // stop when a full pass finds no consumer with credit.
        let mut idle = 0;
        while idle < n {
            let Some(front) = st.ready.front() else { break };
            let size = front.size;
            let i = st.next_consumer % n;
            st.next_consumer = (i + 1) % n;
            let c = &st.consumers[i];
            if !c.try_acquire(size) {
                idle += 1;
                continue;
            }
            idle = 0;
            let Some(mut entry) = st.ready.pop_front() else {
                break;
            };
            if let Some(l) = entry.location {
                st.leased.insert(entry.id, l);
            }
            st.ready_bytes -= entry.size as u64;
            entry.attempts = entry.attempts.saturating_add(1);
            self.counters.delivered.fetch_add(1, Ordering::Relaxed);
            self.counters.leased.fetch_add(1, Ordering::Relaxed);
            self.counters
                .leased_bytes
                .fetch_add(entry.size as u64, Ordering::Relaxed);
            if entry.redelivered {
                self.counters.redelivered.fetch_add(1, Ordering::Relaxed);
            }
            c.conn.push(Delivery {
                consumer: c.clone(),
                partition: self.clone(),
                entry,
            });
            if !woken.iter().any(|w| Arc::ptr_eq(&w.conn, &c.conn)) {
                woken.push(c.clone());
            }
        }
    }

    /// Takes the head message for basic.get; returns it with the number of
    /// messages left.
    pub fn get(&self) -> Option<(Entry, u64)> {
        let mut st = self.lock();
        let mut e = st.ready.pop_front()?;
        st.ready_bytes -= e.size as u64;
        if let Some(l) = e.location {
            st.leased.insert(e.id, l);
        }
        e.attempts = e.attempts.saturating_add(1);
        self.counters.delivered.fetch_add(1, Ordering::Relaxed);
        self.counters.leased.fetch_add(1, Ordering::Relaxed);
        self.counters
            .leased_bytes
            .fetch_add(e.size as u64, Ordering::Relaxed);
        let left = st.ready.len() as u64;
        self.ready_len.store(left, Ordering::Relaxed);
        Some((e, left))
    }

    /// Removes every ready message; returns them (the caller settles them in the store).
    pub fn purge(&self) -> Vec<Entry> {
        let mut st = self.lock();
        st.ready_bytes = 0;
        self.ready_len.store(0, Ordering::Relaxed);
        st.ready.drain(..).collect()
    }

    /// Attaches a consumer and starts delivering to it.
    /// Returns false if the queue was deleted meanwhile. Only
    /// [`Queue::attach_consumer`] calls it, so a queue's exclusivity is
    /// checked and its consumers attached in one step.
    #[must_use]
    pub(crate) fn add_consumer(self: &Arc<Self>, c: Arc<Consumer>) -> bool {
        let mut woken = Vec::new();
        {
            let mut st = self.lock();
            if st.deleted {
                return false;
            }
            st.consumers.push(c);
            self.dispatch_locked(&mut st, &mut woken);
            self.ready_len
                .store(st.ready.len() as u64, Ordering::Relaxed);
        }
        wake_all(woken);
        true
    }

    /// Detaches a consumer; returns how many remain.
    pub(crate) fn remove_consumer(&self, c: &Arc<Consumer>) -> usize {
        let mut st = self.lock();
        st.consumers.retain(|x| !Arc::ptr_eq(x, c));
        st.consumers.len()
    }

    /// Depth snapshot.
    pub fn depth(&self) -> Depth {
        let st = self.lock();
        Depth {
            ready: st.ready.len() as u64,
            ready_bytes: st.ready_bytes,
            leased: self.counters.leased.load(Ordering::Relaxed),
            oldest_age_ms: st
                .ready
                .front()
                .map(|e| now_ms().saturating_sub(e.enqueued_ms))
                .unwrap_or(0),
            consumers: st.consumers.len() as u32,
        }
    }

    /// Calls `f` on the store position of every ready and leased entry
    /// (compaction: the store decides which to move and writes the new
    /// position back), under the partition's lock. Leased entries too, so a
    /// long-held lease does not pin its record (and, the embedded log
    /// reclaiming oldest-first, everything after it).
    pub fn for_each_location(&self, mut f: impl FnMut(MessageId, &mut Location)) {
        let mut st = self.lock();
        for e in st.ready.iter_mut() {
            if let Some(l) = e.location.as_mut() {
                f(e.id, l);
            }
        }
        for (id, l) in st.leased.iter_mut() {
            f(*id, l);
        }
    }
}

fn insert_by_seq(ready: &mut VecDeque<Entry>, e: Entry) {
    // Requeues usually go back to the front; search from there.
    let pos = ready.partition_point(|x| x.seq < e.seq);
    debug_assert!(
        ready.get(pos).is_none_or(|x| x.seq != e.seq),
        "entry requeued twice"
    );
    ready.insert(pos, e);
}

fn wake_all(woken: Vec<Arc<Consumer>>) {
    for c in woken {
        c.conn.wake();
    }
}

/// Definition of a queue, as declared and as persisted.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct QueueDef {
    /// Name.
    pub name: String,
    /// Survives restarts.
    pub durable: bool,
    /// Deleted when its last consumer goes.
    pub auto_delete: bool,
    /// Arguments (`x-…`), as JSON.
    pub arguments: Value,
    /// Store ids of its partitions.
    pub partitions: Vec<u64>,
}

/// Why a consumer could not attach to a queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttachError {
    /// The queue was deleted.
    NotFound,
    /// The queue has an exclusive consumer, or the new consumer asked for
    /// exclusivity and the queue has consumers.
    Exclusive,
}

/// The consumers of a queue, as its lock sees them.
#[derive(Default)]
struct Attached {
    /// Live consumers over all partitions.
    count: u32,
    /// One of them is exclusive (then it is the only one).
    exclusive: bool,
}

/// A queue.
pub struct Queue {
    /// Definition.
    pub def: QueueDef,
    /// Tenant name.
    pub tenant: Arc<str>,
    /// Owning connection for exclusive queues.
    /// (Non-zero, so the option costs no extra word per queue.)
    exclusive_owner: Option<std::num::NonZeroU64>,
    /// Partitions (≥ 1).
    pub partitions: Vec<Arc<Partition>>,
    /// Set once deleted: late operations fail with NOT_FOUND.
    deleted: AtomicBool,
    /// Its consumers, counted under one lock so that an exclusivity check
    /// and the attach it allows are one step.
    attached: Mutex<Attached>,
    /// Publishes routed here since start (round-robin partition choice).
    next_partition: AtomicU64,
    /// The exchanges with a binding to this queue.
    pub sources: super::exchange::Sources,
}

impl Queue {
    /// A queue with its partitions.
    pub fn new(def: QueueDef, tenant: Arc<str>, exclusive_owner: Option<u64>) -> Arc<Self> {
        assert!(
            !def.partitions.is_empty(),
            "a queue has at least one partition"
        );
        // Exclusive queues die with their connection, so nothing in them is
        // worth an fsync.
        let stored = def.durable && exclusive_owner.is_none();
        let exclusive_owner = exclusive_owner
            .map(|o| std::num::NonZeroU64::new(o).expect("connection ids start at 1"));
        let partitions = def
            .partitions
            .iter()
            .map(|p| Partition::new(PartitionId(*p), stored))
            .collect();
        Arc::new(Queue {
            def,
            tenant,
            exclusive_owner,
            partitions,
            deleted: AtomicBool::new(false),
            attached: Mutex::new(Attached::default()),
            next_partition: AtomicU64::new(0),
            sources: Default::default(),
        })
    }

    /// The connection owning it, for an exclusive queue.
    pub fn exclusive_owner(&self) -> Option<u64> {
        self.exclusive_owner.map(|o| o.get())
    }

    /// The queue's name.
    pub fn name(&self) -> &str {
        &self.def.name
    }

    /// Whether it was deleted.
    pub fn is_deleted(&self) -> bool {
        self.deleted.load(Ordering::Acquire)
    }

    /// Marks it deleted (its tenant does, before deleting its partitions).
    pub(crate) fn mark_deleted(&self) {
        // Under the consumers' lock: an attach either finishes before (and
        // its consumer is taken and cancelled by the partitions' deletion)
        // or sees the flag.
        let _a = self.attached.lock();
        self.deleted.store(true, Ordering::Release);
    }

    /// Live consumers.
    pub fn consumer_count(&self) -> u32 {
        self.attached.lock().count
    }

    /// Attaches `c` to every partition, checking exclusivity in the same
    /// step: with an exclusive consumer attached nobody else may attach, and
    /// an exclusive consumer attaches only to a queue without consumers.
    pub(crate) fn attach_consumer(&self, c: &Arc<Consumer>) -> Result<(), AttachError> {
        let mut a = self.attached.lock();
        if self.is_deleted() {
            return Err(AttachError::NotFound);
        }
        if a.exclusive || (c.exclusive() && a.count > 0) {
            return Err(AttachError::Exclusive);
        }
        for (i, p) in self.partitions.iter().enumerate() {
            if !p.add_consumer(c.clone()) {
                // Partition deleted without its queue being marked first
                // (the tenant always marks first): undo, never half attach.
                c.cancel();
                for p in &self.partitions[..i] {
                    p.remove_consumer(c);
                }
                return Err(AttachError::NotFound);
            }
        }
        a.count += 1;
        a.exclusive |= c.exclusive();
        Ok(())
    }

    /// Cancels `c` and detaches it from every partition. Returns how many
    /// consumers remain, or None if `c` was no longer live (cancelled
    /// before, or its queue was deleted).
    pub(crate) fn detach_consumer(&self, c: &Arc<Consumer>) -> Option<u32> {
        let mut a = self.attached.lock();
        let was_live = c.cancel();
        for p in &self.partitions {
            p.remove_consumer(c);
        }
        if !was_live || self.is_deleted() {
            return None;
        }
        debug_assert!(a.count > 0, "detaching from a queue without consumers");
        a.count = a.count.saturating_sub(1);
        if c.exclusive() {
            a.exclusive = false;
        }
        Some(a.count)
    }

    /// The partition a new message goes to. With one partition, always it;
    /// with ordering keys (a later feature) a hash of the key picks it.
    pub fn partition_for_publish(&self) -> &Arc<Partition> {
        if self.partitions.len() == 1 {
            return &self.partitions[0];
        }
        let i =
            self.next_partition.fetch_add(1, Ordering::Relaxed) as usize % self.partitions.len();
        &self.partitions[i]
    }

    /// Ready messages over all partitions.
    pub fn message_count(&self) -> u64 {
        self.partitions.iter().map(|p| p.ready_len()).sum()
    }

    /// Depth over all partitions.
    pub fn depth(&self) -> Depth {
        let mut d = Depth::default();
        for p in &self.partitions {
            let x = p.depth();
            d.ready += x.ready;
            d.ready_bytes += x.ready_bytes;
            d.leased += x.leased;
            d.oldest_age_ms = d.oldest_age_ms.max(x.oldest_age_ms);
            d.consumers = d.consumers.max(x.consumers);
        }
        d
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::consumer::{ConnHandle, Credit, Notice};
    use std::sync::atomic::AtomicBool;

    fn entry(id: u64) -> Entry {
        Entry {
            seq: 0,
            id,
            location: None,
            size: 10,
            redelivered: false,
            attempts: 0,
            enqueued_ms: now_ms(),
            message: None,
        }
    }

    fn consumer(conn: &Arc<ConnHandle>, prefetch: u32) -> Arc<Consumer> {
        Consumer::new(
            bytes::Bytes::from_static(b"c"),
            1,
            false,
            false,
            conn.clone(),
            Credit::new(prefetch, 0),
            None,
            Arc::new(AtomicBool::new(true)),
        )
    }

    fn drained(conn: &ConnHandle) -> Vec<Delivery> {
        let mut d = Vec::new();
        let mut n: Vec<Notice> = Vec::new();
        conn.drain(&mut d, &mut n);
        d
    }

    #[test]
    fn credit_bounds_deliveries_and_requeue_restores_position() {
        let p = Partition::new(PartitionId(1), false);
        for id in 1..=4 {
            assert!(p.enqueue(entry(id)).is_none());
        }
        let conn = ConnHandle::new(1);
        let c = consumer(&conn, 2);
        assert!(p.add_consumer(c.clone()));
        let got = drained(&conn);
        assert_eq!(
            got.iter().map(|d| d.entry.id).collect::<Vec<_>>(),
            vec![1, 2]
        );
        assert_eq!(p.ready_len(), 2);
        // Give back message 1 (requeue) and its credit: it is next again.
        let first = got.into_iter().next().expect("one delivery");
        c.release(first.entry.size);
        assert!(p.requeue(vec![first.entry]).is_empty());
        let again = drained(&conn);
        assert_eq!(again.len(), 1);
        assert_eq!(again[0].entry.id, 1);
        assert!(again[0].entry.redelivered);
        assert_eq!(again[0].entry.attempts, 2);
    }

    #[test]
    fn compaction_reaches_leased_entries_and_settles_use_the_new_location() {
        let p = Partition::new(PartitionId(1), true);
        let at = weir_backend::testing::location;
        for id in 1..=2 {
            let mut e = entry(id);
            e.location = Some(at(1));
            assert!(p.enqueue(e).is_none());
        }
        let conn = ConnHandle::new(1);
        let c = consumer(&conn, 1);
        assert!(p.add_consumer(c.clone()));
        let leased = drained(&conn).into_iter().next().expect("one delivery");
        assert_eq!(leased.entry.id, 1);
        // Compaction moves both records out of segment 1: the ready one and
        // the leased one (whose entry the channel holds a stale copy of).
        let mut seen = Vec::new();
        p.for_each_location(|id, l| {
            if *l == at(1) {
                seen.push(id);
                *l = at(9);
            }
        });
        seen.sort();
        assert_eq!(seen, vec![1, 2]);
        assert_eq!(
            leased.entry.location,
            Some(at(1)),
            "the lease's copy is stale"
        );
        assert_eq!(p.leased_location(&leased.entry), Some(at(9)));
        assert_eq!(p.settled(&leased.entry, true), Some(at(9)));
        c.release(leased.entry.size);
        p.dispatch();
        let next = drained(&conn).into_iter().next().expect("second delivery");
        assert_eq!(next.entry.location, Some(at(9)));
    }

    #[test]
    fn round_robin_over_consumers() {
        let p = Partition::new(PartitionId(1), false);
        let a = ConnHandle::new(1);
        let b = ConnHandle::new(2);
        assert!(p.add_consumer(consumer(&a, 0)));
        assert!(p.add_consumer(consumer(&b, 0)));
        for id in 1..=6 {
            assert!(p.enqueue(entry(id)).is_none());
        }
        let ids = |v: Vec<Delivery>| v.into_iter().map(|d| d.entry.id).collect::<Vec<_>>();
        assert_eq!(ids(drained(&a)), vec![1, 3, 5]);
        assert_eq!(ids(drained(&b)), vec![2, 4, 6]);
    }

    /// Enqueues `n` entries sharing one message into a partition, giving a
    /// store location to those `stored` picks; returns how many entries
    /// still hold the message.
    fn bodies_kept(durable: bool, n: u64, stored: impl Fn(u64) -> bool) -> usize {
        let p = Partition::new(PartitionId(1), durable);
        let msg = Arc::new(crate::message::Message {
            id: 1,
            exchange: bytes::Bytes::new(),
            routing_key: bytes::Bytes::new(),
            properties: bytes::Bytes::new(),
            body: bytes::Bytes::from_static(b"x"),
            header_format: crate::properties::HeaderFormat::Amqp091,
            persistent: durable,
            priority: 0,
        });
        for id in 0..n {
            let mut e = entry(id);
            if stored(id) {
                e.location = Some(weir_backend::testing::location(1));
            }
            e.message = Some(msg.clone());
            assert!(p.enqueue(e).is_none());
        }
        Arc::strong_count(&msg) - 1
    }

    #[test]
    fn deep_entries_with_a_location_drop_their_bodies() {
        let hot = HOT_ENTRIES as u64;
        // Durable: only the hot head keeps the message in memory.
        assert_eq!(bodies_kept(true, hot + 10, |_| true), HOT_ENTRIES);
        // Non-durable, every other deep entry paged by the session: entries
        // without a location (not paged) must keep their bodies.
        assert_eq!(
            bodies_kept(false, hot + 20, |id| id >= hot && id % 2 == 0),
            HOT_ENTRIES + 10
        );
    }

    #[test]
    fn unlimited_prefetch_takes_only_the_connections_unsent_window() {
        use crate::consumer::UNSENT_MAX_COUNT;
        let p = Partition::new(PartitionId(1), false);
        let n = UNSENT_MAX_COUNT as u64 * 2 + 10;
        for id in 0..n {
            assert!(p.enqueue(entry(id)).is_none());
        }
        let conn = ConnHandle::new(1);
        assert!(p.add_consumer(consumer(&conn, 0)));
        let d = drained(&conn);
        assert_eq!(d.len(), UNSENT_MAX_COUNT as usize, "bounded by the window");
        assert_eq!(p.ready_len(), n - UNSENT_MAX_COUNT as u64);
        // Nothing more while nothing is written.
        p.dispatch();
        assert!(drained(&conn).is_empty());
        // Written: room again, and the connection knows to redispatch.
        conn.unsent_done(d.len() as u32);
        assert!(conn.take_starved());
        assert!(!conn.take_starved());
        p.dispatch();
        assert_eq!(drained(&conn).len(), UNSENT_MAX_COUNT as usize);
        assert_eq!(conn.unsent(), UNSENT_MAX_COUNT);
    }
}
