//! A partition: the unit of ordering, storage and dispatch.

use super::consumers::ConsumerSet;
use super::ready::ReadyList;
use crate::args::{Overflow, QueueArgs, RetryType};
use crate::consumer::{Consumer, Delivery};
use crate::deadletter::DeadReason;
use crate::message::Entry;
use crate::timers::Timers;
use parking_lot::{Mutex, MutexGuard};
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use weir_backend::{Location, MessageId, Op, PartitionId};

/// Entries deeper than this in a partition keep only their location in
/// memory; their bodies are read back from the store when delivered, so
/// memory does not grow with queue depth. Durable entries have a location
/// anyway; transient ones (a transient message, or any message in a
/// non-durable queue) published while the partition is this deep are paged
/// to the store's spill for it (`weir_backend::Spill`: local, never
/// fsynced, dropped at restart; see `crate::spill`).
pub const HOT_ENTRIES: usize = 2048;

/// Most expired entries one [`Partition::take_due`] hands out: a million
/// messages expiring at once are a series of short critical sections, not
/// one long one, so publishers to the queue never stall behind expiry.
const MAX_DUE_BATCH: usize = 4096;

/// Why leased entries come back to their queue: `x-delayed-retry-type`
/// delays some kinds of return and not others.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Return {
    /// The consumer rejected or nacked them with requeue.
    Failed,
    /// Their consumer went away (channel or connection closed, consumer
    /// timeout, transaction rollback of a closed channel).
    Released,
}

impl Return {
    /// Whether a queue retrying `kind` delays this return.
    fn delayed_by(self, kind: RetryType) -> bool {
        matches!(
            (kind, self),
            (RetryType::All, _)
                | (RetryType::Failed, Return::Failed)
                | (RetryType::Returned, Return::Released)
        )
    }
}

/// The `seq` of a delayed message that has not entered its queue yet: it
/// gets its place (the tail) when it is due. A delayed retry keeps its seq
/// and returns to its place.
const UNPLACED: u64 = u64::MAX;

/// An entry held back until `at` (ms since the epoch): a delayed message
/// (`x-delay`) or a delayed retry. 72 bytes: the location-only entry plus
/// its time, within the 100 B per delayed message DESIGN §6 allows.
struct Delayed {
    at: u64,
    entry: Entry,
}

impl PartialEq for Delayed {
    fn eq(&self, o: &Self) -> bool {
        (self.at, self.entry.id) == (o.at, o.entry.id)
    }
}
impl Eq for Delayed {}
impl PartialOrd for Delayed {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Delayed {
    /// Reversed: the heap's top is the earliest due (ids break ties in
    /// publish order, so equal due times enter in publish order).
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        (o.at, o.entry.id).cmp(&(self.at, self.entry.id))
    }
}

/// The largest delivery limit that can be counted to: attempts are 16-bit.
const MAX_DELIVERY_LIMIT: u32 = u16::MAX as u32 - 1;

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
    /// Sum over deliveries of the time each message waited in the queue
    /// (enqueue to delivery), ms: with `delivered`, a mean latency over
    /// any interval.
    pub waited_ms: AtomicU64,
    /// Leased (delivered, unsettled) messages.
    pub leased: AtomicU64,
    /// Bytes of leased messages.
    pub leased_bytes: AtomicU64,
    /// Messages that left dead (rejected, expired, over a limit), counted
    /// when the timer task takes them.
    pub dead_lettered: AtomicU64,
    /// Of `dead_lettered`, the expired ones.
    pub expired: AtomicU64,
}

/// One partition of a queue.
pub struct Partition {
    /// Durable id in the store.
    pub id: PartitionId,
    /// Whether messages here are written to the store.
    pub durable: bool,
    /// One of several partitions of its queue (`x-partitions` > 1).
    pub partitioned: bool,
    state: Mutex<PartitionState>,
    /// Counters.
    pub counters: Counters,
    /// Ready messages, readable without the lock.
    ready_len: AtomicU64,
    /// Set when its queue is deleted: returned leases are settled, not requeued.
    deleted: AtomicBool,
    /// The engine's timer, for time-driven work (expiry, dead-letters);
    /// None in unit tests that drive [`Partition::take_due`] by hand.
    timers: Option<Arc<Timers>>,
    /// The earliest time this partition has in `timers` (u64::MAX: none).
    scheduled: AtomicU64,
    /// Its queue has a delivery limit (or is a quorum queue): returned
    /// messages show `x-delivery-count`. Read without the lock per delivery.
    counts_deliveries: AtomicBool,
    /// Its queue (dead-lettering needs the queue's arguments and tenant).
    queue: std::sync::Weak<super::Queue>,
    /// A stream queue's partition: its events live here (`crate::stream`),
    /// never in the ready list.
    pub stream: Option<Box<crate::stream::StreamLog>>,
}

/// What [`Partition::enqueue`] did with an entry.
#[derive(Debug)]
#[must_use = "refused and dropped entries must be settled or dead-lettered"]
pub enum Enqueued {
    /// Queued. `dropped` are heads pushed out by `x-overflow: drop-head`;
    /// they are already on their way to the dead-letter exchange (or
    /// settled, without one) through the partition's dead-letter list.
    Queued,
    /// The queue was deleted meanwhile: settle it in the store.
    Deleted(Entry),
    /// Refused by `x-overflow: reject-publish[-dlx]`: the publisher's
    /// confirm is a nack.
    Overflow {
        /// The refused entry.
        entry: Entry,
        /// `reject-publish-dlx`: the partition dead-letters it (and settles
        /// its record then); otherwise the caller settles it.
        dead_lettered: bool,
    },
}

impl Enqueued {
    /// Whether it was queued.
    pub fn is_queued(&self) -> bool {
        matches!(self, Enqueued::Queued)
    }
}

/// Work a partition hands to the engine's timer task.
#[derive(Debug, Default)]
pub struct DueWork {
    /// Entries to dead-letter (or settle, without a dead-letter exchange),
    /// each with why.
    pub dead: Vec<(Entry, DeadReason)>,
    /// The queue is unused past its `x-expires`: delete it.
    pub queue_expired: bool,
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
    /// Index of ready entries with an expiry: (expires_at_ms, seq,
    /// priority), earliest first. Entries that left the ready list are
    /// skipped when popped; rebuilt when stale ones outnumber the ready list.
    expiry: BinaryHeap<Reverse<(u64, u64, u8)>>,
    /// Entries waiting for the timer task to dead-letter (or settle) them.
    /// Their records are live until then (compaction sees them).
    dead: Vec<(Entry, DeadReason)>,
    /// Delayed messages and delayed retries, earliest due first. Grown by
    /// an eighth at a time, not doubled, so a million delayed messages cost
    /// about their own 72 bytes each.
    delayed: BinaryHeap<Delayed>,
    /// How many of `delayed` are retries (already placed): a partitioned
    /// queue holds its partition back while one waits, for per-key order.
    retrying: usize,
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
        Self::of_queue(id, durable, args, None, std::sync::Weak::new(), None)
    }

    /// An empty partition of `queue`, scheduling its timed work on `timers`;
    /// its ready messages count towards its tenant's `quota`.
    pub(crate) fn of_queue(
        id: PartitionId,
        durable: bool,
        args: Arc<QueueArgs>,
        timers: Option<Arc<Timers>>,
        queue: std::sync::Weak<super::Queue>,
        quota: Option<Arc<weir_quota::TenantQuota>>,
    ) -> Arc<Self> {
        let counts_deliveries = AtomicBool::new(
            args.delivery_limit.is_some() || args.queue_type == crate::args::QueueType::Quorum,
        );
        let stream = (args.queue_type == crate::args::QueueType::Stream)
            .then(|| Box::new(crate::stream::StreamLog::new(id, &args)));
        Arc::new(Partition {
            stream,
            id,
            durable,
            partitioned: args.partitions > 1,
            counts_deliveries,
            state: Mutex::new(PartitionState {
                ready: ReadyList::counted(args.max_priority.unwrap_or(0), quota),
                consumers: ConsumerSet::new(args.single_active_consumer),
                args,
                next_seq: 0,
                deleted: false,
                expiry: BinaryHeap::new(),
                dead: Vec::new(),
                delayed: BinaryHeap::new(),
                retrying: 0,
                leased: HashMap::new(),
            }),
            counters: Counters::default(),
            ready_len: AtomicU64::new(0),
            deleted: AtomicBool::new(false),
            timers,
            scheduled: AtomicU64::new(u64::MAX),
            queue,
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
        st.expiry.clear();
        let mut entries = st.ready.drain();
        entries.extend(std::mem::take(&mut st.delayed).into_iter().map(|d| d.entry));
        st.retrying = 0;
        let dead: Vec<Entry> = st.dead.drain(..).map(|(e, _)| e).collect();
        for mut e in dead {
            if let Some(l) = st.leased.remove(&e.id) {
                e.location = Some(l);
            }
            entries.push(e);
        }
        (consumers, entries)
    }

    /// Now, on the engine's clock (ms since epoch): the one its timers
    /// are on (no field of its own: a queue costs no more memory), the
    /// system clock for a partition without timers (unit tests).
    #[inline]
    pub(crate) fn now_ms(&self) -> u64 {
        match &self.timers {
            Some(t) => t.clock().now_ms(),
            None => crate::clock::Clock::now_ms(&crate::clock::SystemClock),
        }
    }

    /// Whether its queue was deleted.
    pub fn is_deleted(&self) -> bool {
        self.deleted.load(Ordering::Acquire)
    }

    /// Ready messages.
    pub fn ready_len(&self) -> u64 {
        self.ready_len.load(Ordering::Relaxed)
    }

    /// Appends recovered entries (already in id order) at startup, each
    /// with the time before which it must not be delivered (0 = at once):
    /// a delayed message or retry that was waiting keeps waiting. Entries
    /// without a stored deadline get the queue's TTL from now (a restart
    /// does not make them immortal).
    pub fn restore(self: &Arc<Self>, entries: impl IntoIterator<Item = (Entry, u64)>) {
        let now = self.now_ms();
        let mut st = self.lock();
        let mut next_due = None::<u64>;
        for (mut e, deliver_at) in entries {
            if let Some(ttl) = st.args.message_ttl {
                let at = now.saturating_add(ttl).max(1);
                if e.expires_at_ms == 0 || at < e.expires_at_ms {
                    e.expires_at_ms = at;
                }
            }
            e.priority = st.ready.level_of(e.priority);
            if deliver_at > now {
                e.seq = UNPLACED;
                next_due = Some(next_due.map_or(deliver_at, |n| n.min(deliver_at)));
                push_delayed(&mut st.delayed, deliver_at, e);
                continue;
            }
            e.seq = st.next_seq;
            st.next_seq += 1;
            if e.expires_at_ms != 0 {
                st.expiry
                    .push(Reverse((e.expires_at_ms, e.seq, e.priority)));
            }
            st.ready.push_back(e);
        }
        // Drops whose removal was not on disk before a crash come back:
        // drop-head applies the limit again now, not at the next publish.
        if st.args.overflow == Overflow::DropHead && self.drop_over_limit(&mut st) {
            next_due = Some(0);
        }
        let next = st.expiry.peek().map(|Reverse((at, _, _))| *at);
        let next = match (next, next_due) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        self.ready_len
            .store(st.ready.len() as u64, Ordering::Relaxed);
        drop(st);
        if let Some(at) = next {
            self.schedule(at);
        }
    }

    /// Asks the engine's timer to call [`Self::take_due`] at `at_ms`.
    pub(crate) fn schedule_at(self: &Arc<Self>, at_ms: u64) {
        self.schedule(at_ms)
    }

    /// Asks the engine's timer to call [`Self::take_due`] at `at_ms` (0 =
    /// at once), unless an earlier call is already scheduled.
    fn schedule(self: &Arc<Self>, at_ms: u64) {
        if self.scheduled.fetch_min(at_ms, Ordering::AcqRel) <= at_ms {
            return;
        }
        if let Some(t) = &self.timers {
            t.schedule(self, at_ms);
        }
    }

    /// Queues an entry for the timer task to dead-letter; returns whether
    /// the list was empty (then the caller schedules the timer at once).
    fn push_dead(&self, st: &mut PartitionState, e: Entry, why: DeadReason) -> bool {
        // Its position is tracked with the leases' (compaction moves it
        // there) until the timer task is done with it.
        if let Some(l) = e.location {
            st.leased.insert(e.id, l);
        }
        st.dead.push((e, why));
        st.dead.len() == 1
    }

    /// Where a dead-listed entry's record is now.
    pub fn dead_location(&self, e: &Entry) -> Option<Location> {
        self.leased_location(e)
    }

    /// The timer task is done with these dead-listed entries (their
    /// records are settled or moved).
    pub fn forget_dead(&self, ids: impl Iterator<Item = MessageId>) {
        let mut st = self.lock();
        for id in ids {
            st.leased.remove(&id);
        }
    }

    /// Applies new queue arguments (see [`super::Queue::set_args`]).
    pub(crate) fn set_args(self: &Arc<Self>, args: Arc<QueueArgs>) {
        if let Some(s) = &self.stream {
            s.set_args(&args);
        }
        self.counts_deliveries.store(
            args.delivery_limit.is_some() || args.queue_type == crate::args::QueueType::Quorum,
            Ordering::Relaxed,
        );
        let wake = {
            let mut st = self.lock();
            st.args = args;
            // A lowered limit drops heads only under drop-head; a queue
            // that rejects publishes keeps what it has and refuses more
            // until it is below the limit again (RabbitMQ's behaviour).
            let wake = st.args.overflow == Overflow::DropHead && self.drop_over_limit(&mut st);
            self.ready_len
                .store(st.ready.len() as u64, Ordering::Relaxed);
            wake
        };
        if wake {
            self.schedule(0);
        }
    }

    /// Whether returned messages show how often they were delivered.
    pub fn counts_deliveries(&self) -> bool {
        self.counts_deliveries.load(Ordering::Relaxed)
    }

    /// The queue this partition belongs to (None once it is gone).
    pub fn queue(&self) -> Option<Arc<super::Queue>> {
        self.queue.upgrade()
    }

    /// The timer task's work at `now_ms`: ready entries whose time has
    /// come (expired), and everything waiting to be dead-lettered. Then
    /// schedules the next deadline.
    pub fn take_due(self: &Arc<Self>, now_ms: u64) -> DueWork {
        // Taken out of the timer: the next schedule pushes again.
        self.scheduled.store(u64::MAX, Ordering::Release);
        let mut work = DueWork::default();
        let mut woken = Vec::new();
        let next = {
            let mut st = self.lock();
            let mut released = 0;
            while st.delayed.peek().is_some_and(|d| d.at <= now_ms) && released < MAX_DUE_BATCH {
                let Some(Delayed { entry, .. }) = st.delayed.pop() else {
                    break;
                };
                released += 1;
                if entry.seq == UNPLACED {
                    let mut entry = entry;
                    entry.enqueued_ms = now_ms;
                    // Full and refusing publishes: there is no publisher
                    // left to nack, so it is dead-lettered (or dropped).
                    if let Enqueued::Overflow { entry, .. } =
                        self.enqueue_locked(&mut st, entry, &mut woken, &mut None)
                    {
                        let _ = self.push_dead(&mut st, entry, DeadReason::Maxlen);
                    }
                } else {
                    st.retrying -= 1;
                    self.return_ready(&mut st, entry, now_ms);
                }
            }
            if released > 0 {
                self.dispatch_locked(&mut st, &mut woken);
            }
            while let Some(&Reverse((at, seq, prio))) = st.expiry.peek() {
                if at > now_ms || work.dead.len() >= MAX_DUE_BATCH {
                    break;
                }
                st.expiry.pop();
                // Gone from the ready list (delivered, purged) or requeued
                // with another deadline: nothing to do for this index entry.
                if let Some(e) = st.ready.remove_if(seq, prio, |e| e.expires_at_ms == at) {
                    work.dead.push((e, DeadReason::Expired));
                }
            }
            work.dead.append(&mut st.dead);
            if !work.dead.is_empty() {
                let expired = work
                    .dead
                    .iter()
                    .filter(|(_, r)| *r == DeadReason::Expired)
                    .count() as u64;
                self.counters
                    .dead_lettered
                    .fetch_add(work.dead.len() as u64, Ordering::Relaxed);
                self.counters.expired.fetch_add(expired, Ordering::Relaxed);
            }
            prune_expiry(&mut st);
            self.ready_len
                .store(st.ready.len() as u64, Ordering::Relaxed);
            let expiry = st.expiry.peek().map(|Reverse((at, _, _))| *at);
            match (expiry, st.delayed.peek().map(|d| d.at)) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            }
        };
        wake_all(woken);
        // x-expires: the queue's idle check rides on its first partition.
        let idle = self
            .queue()
            .filter(|q| Arc::ptr_eq(&q.partitions[0], self))
            .and_then(|q| q.idle_deadline());
        let next = match idle {
            Some(at) if at <= now_ms => {
                work.queue_expired = true;
                next
            }
            Some(at) => Some(next.map_or(at, |n| n.min(at))),
            None => next,
        };
        if let Some(at) = next {
            self.schedule(at);
        }
        work
    }

    /// Adds a new message at the tail and hands out whatever consumers can
    /// take, applying the queue's TTL and length limits.
    pub fn enqueue(self: &Arc<Self>, entry: Entry) -> Enqueued {
        self.enqueue_at(entry, 0)
    }

    /// [`Self::enqueue`], or, when `deliver_at_ms` is in the future (a
    /// delayed message), holds the entry until then: it enters the queue
    /// (its TTL, its length limits, its place at the tail) when due.
    pub fn enqueue_at(self: &Arc<Self>, mut entry: Entry, deliver_at_ms: u64) -> Enqueued {
        let mut woken = Vec::new();
        let mut wake_timer = None;
        let result = {
            let mut st = self.lock();
            if st.deleted {
                return Enqueued::Deleted(entry);
            }
            if deliver_at_ms > entry.enqueued_ms {
                if entry.location.is_some() {
                    // Held by location only: read back when delivered.
                    entry.message = None;
                }
                entry.seq = UNPLACED;
                if st.delayed.peek().is_none_or(|d| deliver_at_ms < d.at) {
                    wake_timer = Some(deliver_at_ms);
                }
                push_delayed(&mut st.delayed, deliver_at_ms, entry);
                Enqueued::Queued
            } else {
                let r = self.enqueue_locked(&mut st, entry, &mut woken, &mut wake_timer);
                self.ready_len
                    .store(st.ready.len() as u64, Ordering::Relaxed);
                r
            }
        };
        if let Some(at) = wake_timer {
            self.schedule(at);
        }
        wake_all(woken);
        result
    }

    /// Enqueues under the lock: length limits, TTL, tail, dispatch. Sets
    /// `wake_timer` when the timer must run earlier than planned.
    fn enqueue_locked(
        self: &Arc<Self>,
        st: &mut PartitionState,
        mut entry: Entry,
        woken: &mut Vec<Arc<Consumer>>,
        wake_timer: &mut Option<u64>,
    ) -> Enqueued {
        let args = &st.args;
        if args.overflow != Overflow::DropHead
            && (args.max_length.is_some_and(|m| st.ready.len() as u64 >= m)
                || args
                    .max_length_bytes
                    .is_some_and(|m| st.ready.bytes() + u64::from(entry.size) > m))
        {
            let dead_lettered = args.overflow == Overflow::RejectPublishDlx;
            if dead_lettered && self.push_dead(st, entry.clone(), DeadReason::Maxlen) {
                *wake_timer = Some(0);
            }
            return Enqueued::Overflow {
                entry,
                dead_lettered,
            };
        }
        if let Some(ttl) = args.message_ttl {
            let at = entry.enqueued_ms.saturating_add(ttl).max(1);
            if entry.expires_at_ms == 0 || at < entry.expires_at_ms {
                entry.expires_at_ms = at;
            }
        }
        entry.seq = st.next_seq;
        st.next_seq += 1;
        entry.priority = st.ready.level_of(entry.priority);
        if st.ready.len() >= HOT_ENTRIES && entry.location.is_some() {
            // Deep in the queue: keep only where it is stored.
            entry.message = None;
        }
        if entry.expires_at_ms != 0 {
            let at = entry.expires_at_ms;
            if st
                .expiry
                .peek()
                .is_none_or(|Reverse((first, _, _))| at < *first)
            {
                *wake_timer = Some(wake_timer.map_or(at, |w| w.min(at)));
            }
            st.expiry.push(Reverse((at, entry.seq, entry.priority)));
        }
        // TTL 0: delivered now to a consumer that can take it, or
        // expired now (RabbitMQ's rule), never left to the timer.
        let immediate = (entry.expires_at_ms != 0 && entry.expires_at_ms <= entry.enqueued_ms)
            .then_some((entry.seq, entry.priority));
        st.ready.push_back(entry);
        self.counters.published.fetch_add(1, Ordering::Relaxed);
        self.dispatch_locked(st, woken);
        if let Some((seq, priority)) = immediate {
            if let Some(e) = st.ready.remove_if(seq, priority, |_| true) {
                if self.push_dead(st, e, DeadReason::Expired) {
                    *wake_timer = Some(0);
                }
            }
        }
        if (st.args.max_length.is_some() || st.args.max_length_bytes.is_some())
            && self.drop_over_limit(st)
        {
            *wake_timer = Some(0);
        }
        Enqueued::Queued
    }

    /// `x-overflow: drop-head`: drops heads past the length limits into the
    /// dead-letter list. Returns whether the timer must run.
    fn drop_over_limit(self: &Arc<Self>, st: &mut PartitionState) -> bool {
        let (max_len, max_bytes) = (
            st.args.max_length.unwrap_or(u64::MAX),
            st.args.max_length_bytes.unwrap_or(u64::MAX),
        );
        let mut wake = false;
        while st.ready.len() as u64 > max_len || st.ready.bytes() > max_bytes {
            let Some(e) = st.ready.pop_front() else { break };
            wake |= self.push_dead(st, e, DeadReason::Maxlen);
        }
        wake
    }

    /// Puts leased entries back at their original positions, marked
    /// redelivered, or holds them back for a delayed retry when the queue
    /// retries this kind of return after a delay. Entries over the delivery
    /// limit are dead-lettered instead. For durable entries whose attempts
    /// count (a delivery limit, a quorum queue) or whose retry is delayed,
    /// an [`Op::Requeue`] is pushed to `ops`: the caller appends it, so the
    /// count and the retry time survive a restart.
    #[must_use = "entries refused by a deleted partition must be settled"]
    pub fn requeue(
        self: &Arc<Self>,
        entries: impl IntoIterator<Item = Entry>,
        why: Return,
        ops: &mut Vec<Op<'static>>,
    ) -> Vec<Entry> {
        self.put_back(entries, Some((why, ops)))
    }

    /// Puts back entries that were queued for a consumer but never written
    /// (the consumer went away first). They were not delivered, so they keep
    /// their redelivered flag and attempt count.
    #[must_use = "entries refused by a deleted partition must be settled"]
    pub fn unsend(self: &Arc<Self>, entries: impl IntoIterator<Item = Entry>) -> Vec<Entry> {
        self.put_back(entries, None)
    }

    /// Returns leased entries to the ready list (by `seq`, their original
    /// place) and offers them to consumers; a deleted partition refuses
    /// them. `delivered` is None for entries that were never written.
    fn put_back(
        self: &Arc<Self>,
        entries: impl IntoIterator<Item = Entry>,
        mut delivered: Option<(Return, &mut Vec<Op<'static>>)>,
    ) -> Vec<Entry> {
        let mut woken = Vec::new();
        let mut refused = Vec::new();
        let mut wake_timer = None::<u64>;
        let counts = self.counts_deliveries();
        {
            let mut st = self.lock();
            let now = self.now_ms();
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
                let Some((why, ops)) = delivered.as_mut() else {
                    self.counters.delivered.fetch_sub(1, Ordering::Relaxed);
                    e.attempts = e.attempts.saturating_sub(1);
                    self.return_ready(&mut st, e, now);
                    continue;
                };
                e.redelivered = true;
                // A poison message: returned more often than allowed.
                if st
                    .args
                    .delivery_limit
                    // The count is 16 bits (an entry stays 64 B): larger
                    // limits act as 65,534 rather than never.
                    .is_some_and(|limit| u32::from(e.attempts) > limit.min(MAX_DELIVERY_LIMIT))
                {
                    if self.push_dead(&mut st, e, DeadReason::DeliveryLimit) {
                        wake_timer = Some(0);
                    }
                    continue;
                }
                let retry_at = st
                    .args
                    .delayed_retry
                    .filter(|r| why.delayed_by(r.kind))
                    .map(|r| now.saturating_add(r.delay_ms(u32::from(e.attempts))))
                    .filter(|&at| at > now);
                if let (Some(l), true) = (e.location, counts || retry_at.is_some()) {
                    if self.durable {
                        ops.push(Op::Requeue {
                            partition: self.id,
                            id: e.id,
                            location: l,
                            attempts: u32::from(e.attempts),
                            deliver_at_ms: retry_at.unwrap_or(0),
                        });
                    }
                }
                if let Some(at) = retry_at {
                    if st.delayed.peek().is_none_or(|d| at < d.at) {
                        wake_timer = Some(wake_timer.map_or(at, |w| w.min(at)));
                    }
                    if e.location.is_some() {
                        e.message = None;
                    }
                    st.retrying += 1;
                    push_delayed(&mut st.delayed, at, e);
                    continue;
                }
                if let Some(at) = self.return_ready(&mut st, e, now) {
                    wake_timer = Some(wake_timer.map_or(at, |w| w.min(at)));
                }
            }
            self.dispatch_locked(&mut st, &mut woken);
            self.ready_len
                .store(st.ready.len() as u64, Ordering::Relaxed);
        }
        if let Some(at) = wake_timer {
            self.schedule(at);
        }
        wake_all(woken);
        refused
    }

    /// Puts an entry that has its place (`seq`) back into the ready list,
    /// or into the dead-letter list if it expired meanwhile. Returns when
    /// the timer must run (0: at once), if that changed.
    fn return_ready(&self, st: &mut PartitionState, e: Entry, now: u64) -> Option<u64> {
        debug_assert!(e.seq != UNPLACED, "an entry returns to a place it had");
        if e.expires_at_ms != 0 {
            if e.expires_at_ms <= now {
                return self.push_dead(st, e, DeadReason::Expired).then_some(0);
            }
            st.expiry
                .push(Reverse((e.expires_at_ms, e.seq, e.priority)));
        }
        st.ready.put_back(e);
        None
    }

    /// Leased entries rejected without requeue, on a queue with a
    /// dead-letter exchange: they leave the lease and wait for the timer
    /// task to dead-letter them (their records stay live until then).
    pub fn reject(self: &Arc<Self>, entries: impl IntoIterator<Item = Entry>) {
        let mut wake_timer = false;
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
                wake_timer |= self.push_dead(&mut st, e, DeadReason::Rejected);
            }
        }
        if wake_timer {
            self.schedule(0);
        }
    }

    /// Whether rejected or expired messages of this queue go somewhere
    /// (a dead-letter exchange is set).
    pub fn dead_letters(&self) -> bool {
        self.lock().args.dead_letter_exchange.is_some()
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
        let mut now = 0;
        // A partition of a partitioned queue (ordering keys) has one message
        // out at a time: the next of its keys is delivered only once the
        // previous one is settled or back in place, so per-key order holds
        // across nacks and redeliveries whatever the consumers' prefetch.
        let ordered = st.args.partitions > 1;
        while let Some(front) = st.ready.front() {
            if ordered && (self.counters.leased.load(Ordering::Relaxed) > 0 || st.retrying > 0) {
                break;
            }
            let (expires_at, size) = (front.expires_at_ms, front.size);
            if expires_at != 0 && self.expired_head(st, &mut now) {
                continue;
            }
            let Some(c) = st.consumers.acquire(size) else {
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
        prune_expiry(st);
    }

    /// Whether the head has expired (`now` is read once, lazily); if so it
    /// moves to the dead-letter list and the timer is asked to run. Expired
    /// messages are never delivered, even if the timer runs late.
    fn expired_head(self: &Arc<Self>, st: &mut PartitionState, now: &mut u64) -> bool {
        let Some(front) = st.ready.front() else {
            return false;
        };
        if *now == 0 {
            *now = self.now_ms();
        }
        // Deliverable up to and including its deadline's millisecond: a
        // message with TTL 0 still reaches a consumer waiting for it at
        // once (RabbitMQ's rule); the timer drops it otherwise.
        if front.expires_at_ms >= *now {
            return false;
        }
        let Some(e) = st.ready.pop_front() else {
            return false;
        };
        if self.push_dead(st, e, DeadReason::Expired) {
            // Under the lock: `schedule` only touches atomics and the
            // timer's own lock, never a partition's.
            self.schedule(0);
        }
        true
    }

    /// Takes the head message for basic.get; returns it with the number of
    /// messages left.
    pub fn get(self: &Arc<Self>) -> Option<(Entry, u64)> {
        let mut st = self.lock();
        // A partition of a partitioned queue has one message out at a
        // time, for basic.get as for consumers (per-key order).
        if st.args.partitions > 1
            && (self.counters.leased.load(Ordering::Relaxed) > 0 || st.retrying > 0)
        {
            return None;
        }
        let mut now = 0;
        while st.ready.front().is_some_and(|f| f.expires_at_ms != 0) {
            if !self.expired_head(&mut st, &mut now) {
                break;
            }
        }
        let Some(mut e) = st.ready.pop_front() else {
            // Expired heads may have just left: the counter follows.
            self.ready_len.store(0, Ordering::Relaxed);
            return None;
        };
        if let Some(l) = e.location {
            st.leased.insert(e.id, l);
        }
        e.attempts = e.attempts.saturating_add(1);
        if now == 0 {
            now = self.now_ms();
        }
        self.counters
            .waited_ms
            .fetch_add(now.saturating_sub(e.enqueued_ms), Ordering::Relaxed);
        self.counters.delivered.fetch_add(1, Ordering::Relaxed);
        if e.redelivered {
            // As for consumers: RabbitMQ counts a redelivered get too.
            self.counters.redelivered.fetch_add(1, Ordering::Relaxed);
        }
        self.counters.leased.fetch_add(1, Ordering::Relaxed);
        self.counters
            .leased_bytes
            .fetch_add(e.size as u64, Ordering::Relaxed);
        let left = st.ready.len() as u64;
        self.ready_len.store(left, Ordering::Relaxed);
        Some((e, left))
    }

    /// Removes every ready message, and every delayed one (delayed messages
    /// and retries are the queue's too); returns them (the caller settles
    /// them in the store).
    pub fn purge(&self) -> Vec<Entry> {
        let mut st = self.lock();
        self.ready_len.store(0, Ordering::Relaxed);
        let mut out = st.ready.drain();
        out.extend(std::mem::take(&mut st.delayed).into_iter().map(|d| d.entry));
        st.retrying = 0;
        out
    }

    /// Messages held back until a later time (delayed messages and delayed
    /// retries); not counted as ready.
    pub fn delayed_len(&self) -> u64 {
        self.lock().delayed.len() as u64
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
                .map(|e| self.now_ms().saturating_sub(e.enqueued_ms))
                .unwrap_or(0),
            consumers: st.consumers.len() as u32,
        }
    }

    /// A delivery of it reached its client after waiting `ms` in the queue
    /// (the session's batch clock: no clock read here).
    #[inline]
    pub fn waited(&self, ms: u64) {
        self.counters.waited_ms.fetch_add(ms, Ordering::Relaxed);
    }

    /// Adds its monotonic counters and its depth (atomics only, no lock)
    /// into a queue's.
    pub(crate) fn add_counters(&self, into: &mut crate::stats::QueueCounters) {
        let c = &self.counters;
        into.published += c.published.load(Ordering::Relaxed);
        into.delivered += c.delivered.load(Ordering::Relaxed);
        into.acked += c.acked.load(Ordering::Relaxed);
        into.redelivered += c.redelivered.load(Ordering::Relaxed);
        into.dead_lettered += c.dead_lettered.load(Ordering::Relaxed);
        into.expired += c.expired.load(Ordering::Relaxed);
        into.waited_ms += c.waited_ms.load(Ordering::Relaxed);
        into.ready += self.ready_len.load(Ordering::Relaxed);
        into.leased += c.leased.load(Ordering::Relaxed);
    }

    /// Its live consumers (for the management API's consumer list).
    pub fn consumers(&self) -> Vec<Arc<Consumer>> {
        let st = self.lock();
        st.consumers
            .list()
            .iter()
            .filter(|c| !c.is_dead())
            .cloned()
            .collect()
    }

    /// Adds this partition's figures into `into` (one short lock, no walk).
    pub fn add_stats(&self, into: &mut crate::stats::QueueStats) {
        let st = self.lock();
        into.ready += st.ready.len() as u64;
        into.ready_bytes += st.ready.bytes();
        into.delayed += st.delayed.len() as u64;
        into.consumers = into.consumers.max(st.consumers.len() as u32);
        for (a, n) in into.attempts.iter_mut().zip(st.ready.attempts()) {
            *a += n;
        }
        if let Some(t) = st.ready.front().map(|e| e.enqueued_ms) {
            into.oldest_enqueued_ms = Some(into.oldest_enqueued_ms.map_or(t, |o| o.min(t)));
        }
        drop(st);
        into.leased += self.counters.leased.load(Ordering::Relaxed);
        into.leased_bytes += self.counters.leased_bytes.load(Ordering::Relaxed);
        self.add_counters(&mut into.counters);
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
        if !st.delayed.is_empty() {
            // A heap has no iter_mut; a location is not part of its order,
            // so the vector stays a valid heap.
            let mut held = std::mem::take(&mut st.delayed).into_vec();
            for d in &mut held {
                if let Some(l) = d.entry.location.as_mut() {
                    f(d.entry.id, l);
                }
            }
            st.delayed = BinaryHeap::from(held);
        }
    }

    /// Compaction's swap: for each `(id, old, new)`, if the ready or leased
    /// entry `id` is still at `old`, it moves to `new`; the result says
    /// which did (a settle or move since the store collected `old` wins).
    /// One pass over the ready list for the whole batch.
    pub fn swap_locations(&self, swaps: &[(MessageId, Location, Location)]) -> Vec<bool> {
        let mut done = vec![false; swaps.len()];
        let mut st = self.lock();
        let mut ready: HashMap<MessageId, usize> = HashMap::new();
        for (i, &(id, old, new)) in swaps.iter().enumerate() {
            match st.leased.get_mut(&id) {
                Some(l) if *l == old => {
                    *l = new;
                    done[i] = true;
                }
                Some(_) => {}
                None => {
                    ready.insert(id, i);
                }
            }
        }
        if !ready.is_empty() {
            for e in st.ready.iter_mut() {
                let Some(i) = ready.get(&e.id).copied() else {
                    continue;
                };
                let (_, old, new) = swaps[i];
                if e.location == Some(old) {
                    e.location = Some(new);
                    done[i] = true;
                }
                ready.remove(&e.id);
                if ready.is_empty() {
                    break;
                }
            }
        }
        if !ready.is_empty() && !st.delayed.is_empty() {
            let mut held = std::mem::take(&mut st.delayed).into_vec();
            for d in &mut held {
                let Some(i) = ready.get(&d.entry.id).copied() else {
                    continue;
                };
                let (_, old, new) = swaps[i];
                if d.entry.location == Some(old) {
                    d.entry.location = Some(new);
                    done[i] = true;
                }
            }
            st.delayed = BinaryHeap::from(held);
        }
        done
    }
}

/// Drops stale expiry-index entries (delivered before they expired) once
/// they outnumber the ready list, so the index stays O(ready): called where
/// messages leave (dispatch) as well as from the timer, since a consumer
/// that keeps up may leave the earliest deadline hours away. Amortised O(1)
/// per stale entry.
fn prune_expiry(st: &mut PartitionState) {
    if st.expiry.len() > 2 * st.ready.len() + 1024 {
        let live: Vec<_> = st
            .ready
            .iter()
            .filter(|e| e.expires_at_ms != 0)
            .map(|e| Reverse((e.expires_at_ms, e.seq, e.priority)))
            .collect();
        st.expiry = BinaryHeap::from(live);
    }
}

/// Adds to the delayed heap, growing it by an eighth rather than doubling
/// (a deep delay heap would otherwise keep up to twice its size).
fn push_delayed(heap: &mut BinaryHeap<Delayed>, at: u64, entry: Entry) {
    if heap.len() == heap.capacity() && heap.len() >= 1024 {
        heap.reserve_exact(heap.len() / 8);
    }
    heap.push(Delayed { at, entry });
}

const _: () = assert!(std::mem::size_of::<Delayed>() <= 72);

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
            enqueued_ms: 0,
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
            0,
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
            assert!(p.enqueue(entry(id)).is_queued());
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
        assert!(p
            .requeue(vec![first.entry], Return::Failed, &mut Vec::new())
            .is_empty());
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
            assert!(p.enqueue(e).is_queued());
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
    fn the_expiry_index_stays_bounded_while_a_consumer_keeps_up() {
        let args = QueueArgs {
            message_ttl: Some(3_600_000),
            ..QueueArgs::default()
        };
        let p = Partition::with_args(PartitionId(1), false, Arc::new(args));
        let conn = ConnHandle::new(1);
        assert!(p.add_consumer(consumer(&conn, 0)));
        for id in 0..20_000 {
            assert!(p.enqueue(entry(id)).is_queued());
            // Delivered at once: each leaves a stale index entry behind.
            let d = drained(&conn);
            conn.unsent_done(d.len() as u32);
        }
        assert_eq!(p.ready_len(), 0);
        let index = p.lock().expiry.len();
        assert!(index <= 1024 + 1, "stale expiry entries kept: {index}");
    }

    #[test]
    fn round_robin_over_consumers() {
        let p = Partition::new(PartitionId(1), false);
        let a = ConnHandle::new(1);
        let b = ConnHandle::new(2);
        assert!(p.add_consumer(consumer(&a, 0)));
        assert!(p.add_consumer(consumer(&b, 0)));
        for id in 1..=6 {
            assert!(p.enqueue(entry(id)).is_queued());
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
            header_format: crate::properties::HeaderFormat::new(1),
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
            assert!(p.enqueue(e).is_queued());
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
            assert!(p.enqueue(entry(id)).is_queued());
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
