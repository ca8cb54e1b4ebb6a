//! A partition: the unit of ordering, storage and dispatch.

use super::consumers::ConsumerSet;
use super::ready::ReadyList;
use crate::args::QueueArgs;
use crate::consumer::{Consumer, Delivery};
use crate::message::{now_ms, Entry};
use parking_lot::{Mutex, MutexGuard};
use std::collections::HashMap;
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

struct PartitionState {
    ready: ReadyList,
    /// The queue's arguments (a copy, so the hot path reads them under the
    /// lock it holds anyway).
    args: Arc<QueueArgs>,
    next_seq: u64,
    consumers: ConsumerSet,
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
        if self.ready.total_slots() > 4096 {
            return;
        }
        if let Err(e) = self.ready.check() {
            panic!("partition {:?}: ready list: {e}", p.id);
        }
        for e in self.ready.iter() {
            assert!(
                e.seq < self.next_seq.max(1),
                "partition {:?}: an entry's seq is not yet assigned",
                p.id
            );
            assert!(
                !self.leased.contains_key(&e.id),
                "partition {:?}: message {} is both ready and leased",
                p.id,
                e.id
            );
        }
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
        Self::with_args(id, durable, Arc::default())
    }

    /// An empty partition of a queue with arguments `args`.
    pub fn with_args(id: PartitionId, durable: bool, args: Arc<QueueArgs>) -> Arc<Self> {
        Arc::new(Partition {
            id,
            durable,
            state: Mutex::new(PartitionState {
                ready: ReadyList::new(args.max_priority.unwrap_or(0)),
                args,
                next_seq: 0,
                consumers: ConsumerSet::default(),
                deleted: false,
                leased: HashMap::new(),
            }),
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
        self.ready_len.store(0, Ordering::Relaxed);
        let consumers = st.consumers.take_all();
        (consumers, st.ready.drain())
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
                st.ready.put_back(e);
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
        st.consumers.retain_live();
        while let Some(front) = st.ready.front() {
            let Some(c) = st.consumers.acquire(front.size) else {
                break;
            };
            let Some(mut entry) = st.ready.pop_front() else {
                break;
            };
            if let Some(l) = entry.location {
                st.leased.insert(entry.id, l);
            }
            entry.attempts = entry.attempts.saturating_add(1);
            self.counters.delivered.fetch_add(1, Ordering::Relaxed);
            self.counters.leased.fetch_add(1, Ordering::Relaxed);
            self.counters
                .leased_bytes
                .fetch_add(entry.size as u64, Ordering::Relaxed);
            if entry.redelivered {
                self.counters.redelivered.fetch_add(1, Ordering::Relaxed);
            }
            if !woken.iter().any(|w| Arc::ptr_eq(&w.conn, &c.conn)) {
                woken.push(c.clone());
            }
            let conn = c.conn.clone();
            conn.push(Delivery {
                consumer: c,
                partition: self.clone(),
                entry,
            });
        }
    }

    /// Takes the head message for basic.get; returns it with the number of
    /// messages left.
    pub fn get(&self) -> Option<(Entry, u64)> {
        let mut st = self.lock();
        let mut e = st.ready.pop_front()?;
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
        self.ready_len.store(0, Ordering::Relaxed);
        st.ready.drain()
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
            st.consumers.add(c);
            self.dispatch_locked(&mut st, &mut woken);
            self.ready_len
                .store(st.ready.len() as u64, Ordering::Relaxed);
        }
        wake_all(woken);
        true
    }

    /// Detaches a consumer; returns how many remain.
    pub(crate) fn remove_consumer(&self, c: &Arc<Consumer>) -> usize {
        self.lock().consumers.remove(c)
    }

    /// Depth snapshot.
    pub fn depth(&self) -> Depth {
        let st = self.lock();
        Depth {
            ready: st.ready.len() as u64,
            ready_bytes: st.ready.bytes(),
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

fn wake_all(woken: Vec<Arc<Consumer>>) {
    for c in woken {
        c.conn.wake();
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
            priority: 0,
            dead: false,
            enqueued_ms: now_ms(),
            expires_at_ms: 0,
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
            ttl_ms: None,
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
