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

mod consumers;
pub mod dedup;
mod partition;
mod ready;

pub use partition::{Counters, Depth, DueWork, Enqueued, Partition, Return, HOT_ENTRIES};

use crate::args::QueueArgs;
use crate::consumer::Consumer;
use crate::exchange::HeaderLookup;
use parking_lot::{Mutex, RwLock};
use serde_json::Value;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use weir_backend::PartitionId;

/// The header that names a message's ordering key.
pub const ORDERING_KEY: &str = "x-ordering-key";

/// The header holding a message's delay in ms, honoured by queues declared
/// `x-delayed: true` and by `x-delayed-message` exchanges.
pub const DELAY_HEADER: &str = "x-delay";

/// FNV-1a: stable across processes and versions (a key must keep its
/// partition after a restart), cheap for short keys.
pub fn ordering_hash(key: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in key {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
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
    /// exclusivity and the queue has consumers or single active consumer.
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
    /// The arguments it acts on (declared, over its policy's).
    args: RwLock<Arc<QueueArgs>>,
    /// Set once deleted: late operations fail with NOT_FOUND.
    deleted: AtomicBool,
    /// Its consumers, counted under one lock so that an exclusivity check
    /// and the attach it allows are one step.
    attached: Mutex<Attached>,
    /// Last use (ms since epoch) for `x-expires`: declared, consumed from
    /// or read with a get, or its last consumer left.
    last_used_ms: AtomicU64,
    /// Publishes routed here since start (round-robin partition choice).
    next_partition: AtomicU64,
    /// The exchanges with a binding to this queue.
    pub sources: super::exchange::Sources,
    /// Receipts of idempotency keys (idempotent publish).
    dedup: dedup::Dedup,
    /// Declared `x-delayed: true`: honours `x-delay` (fixed at declare; not
    /// a policy key), read per publish without a lock.
    pub delayed: bool,
    /// The effective `x-message-ttl` (argument or policy), u64::MAX for
    /// none: read per publish without a lock.
    message_ttl: AtomicU64,
}

impl Queue {
    /// A queue with its partitions, without timed work (expiry and
    /// dead-lettering wait for [`Partition::take_due`] calls): for tests.
    pub fn new(def: QueueDef, tenant: Arc<str>, exclusive_owner: Option<u64>) -> Arc<Self> {
        Self::with_timers(def, tenant, exclusive_owner, None, None)
    }

    /// A queue with its partitions, scheduling their timed work (expiry,
    /// dead-lettering) on the engine's `timers`; its ready messages count
    /// towards its tenant's `quota`.
    pub fn with_timers(
        def: QueueDef,
        tenant: Arc<str>,
        exclusive_owner: Option<u64>,
        timers: Option<Arc<crate::timers::Timers>>,
        quota: Option<Arc<weir_quota::TenantQuota>>,
    ) -> Arc<Self> {
        assert!(
            !def.partitions.is_empty(),
            "a queue has at least one partition"
        );
        // Exclusive queues die with their connection, so nothing in them is
        // worth an fsync.
        let stored = def.durable && exclusive_owner.is_none();
        let exclusive_owner = exclusive_owner
            .map(|o| std::num::NonZeroU64::new(o).expect("connection ids start at 1"));
        // Declares check their arguments; a stored definition that no
        // longer parses (an older Weir accepted it) runs without them.
        let args = QueueArgs::parse(&def.arguments).unwrap_or_else(|e| {
            tracing::warn!(queue = %def.name, tenant = %tenant, error = %e, "ignoring the queue's invalid arguments");
            QueueArgs::parse(&Value::Null).unwrap_or_default()
        });
        let args = Arc::new(args);
        let dedup = dedup::Dedup::new(args.dedup_on_message_id, args.dedup_window_ms);
        let delayed = args.delayed;
        let message_ttl = args.message_ttl.unwrap_or(u64::MAX);
        // Without timers (tests of a bare queue), on the system clock.
        let now_ms = timers.as_ref().map_or_else(
            || crate::clock::Clock::now_ms(&crate::clock::SystemClock),
            |t| t.clock().now_ms(),
        );
        Arc::new_cyclic(|me| Queue {
            partitions: def
                .partitions
                .iter()
                .map(|p| {
                    Partition::of_queue(
                        PartitionId(*p),
                        stored,
                        args.clone(),
                        timers.clone(),
                        me.clone(),
                        quota.clone(),
                    )
                })
                .collect(),
            def,
            tenant,
            exclusive_owner,
            args: RwLock::new(args),
            deleted: AtomicBool::new(false),
            attached: Mutex::new(Attached::default()),
            last_used_ms: AtomicU64::new(now_ms),
            next_partition: AtomicU64::new(0),
            sources: Default::default(),
            dedup,
            delayed,
            message_ttl: AtomicU64::new(message_ttl),
        })
    }

    /// The connection owning it, for an exclusive queue.
    pub fn exclusive_owner(&self) -> Option<u64> {
        self.exclusive_owner.map(|o| o.get())
    }

    /// The arguments it acts on.
    pub fn args(&self) -> Arc<QueueArgs> {
        self.args.read().clone()
    }

    /// Replaces the arguments it acts on (a policy was set or removed).
    /// What shapes a queue at declare (`x-max-priority`, `x-partitions`)
    /// stays as declared; limits apply at once (a lower max-length drops
    /// the excess heads), TTLs to messages enqueued from now on.
    pub(crate) fn set_args(&self, mut args: QueueArgs) {
        let current = self.args();
        args.max_priority = current.max_priority;
        args.partitions = current.partitions;
        if args == *current {
            return;
        }
        let args = Arc::new(args);
        self.dedup
            .configure(args.dedup_on_message_id, args.dedup_window_ms);
        self.message_ttl
            .store(args.message_ttl.unwrap_or(u64::MAX), Ordering::Relaxed);
        *self.args.write() = args.clone();
        for p in &self.partitions {
            p.set_args(args.clone());
        }
        if args.expires.is_some() {
            self.touch();
        }
    }

    /// Whether it may refuse a publish: a length limit with
    /// `x-overflow: reject-publish` or `reject-publish-dlx`.
    pub fn may_refuse_publish(&self) -> bool {
        let a = self.args.read();
        a.overflow != crate::args::Overflow::DropHead
            && (a.max_length.is_some() || a.max_length_bytes.is_some())
    }

    /// Its receipts of idempotency keys.
    pub fn dedup(&self) -> &dedup::Dedup {
        &self.dedup
    }

    /// The identity its receipts are stored under: its first partition.
    pub fn dedup_id(&self) -> PartitionId {
        self.partitions[0].id
    }

    /// The queue's name.
    /// The queue's message TTL in ms (argument or policy), if any.
    pub fn message_ttl(&self) -> Option<u64> {
        Some(self.message_ttl.load(Ordering::Relaxed)).filter(|&t| t != u64::MAX)
    }

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

    /// Records a use of the queue (RabbitMQ's definition for `x-expires`:
    /// a declare, a get, a consumer attaching or the last one leaving) and,
    /// for a queue with `x-expires`, schedules the idle check.
    pub fn touch(&self) {
        let now = self.partitions[0].now_ms();
        self.last_used_ms.store(now, Ordering::Relaxed);
        if let Some(ms) = self.args().expires {
            self.partitions[0].schedule_at(now.saturating_add(ms));
        }
    }

    /// When the queue expires if unused from now on (`x-expires`), given
    /// it has no consumers.
    pub(crate) fn idle_deadline(&self) -> Option<u64> {
        let ms = self.args().expires?;
        (self.consumer_count() == 0)
            .then(|| self.last_used_ms.load(Ordering::Relaxed).saturating_add(ms))
    }

    /// Live consumers.
    pub fn consumer_count(&self) -> u32 {
        self.attached.lock().count
    }

    /// Attaches `c` to every partition, checking exclusivity in the same
    /// step: with an exclusive consumer attached nobody else may attach, and
    /// an exclusive consumer attaches only to a queue without consumers and
    /// without single active consumer (RabbitMQ refuses that too).
    ///
    /// One step under the queue's lock also gives every partition the same
    /// registration order, so under single active consumer all partitions
    /// pick the same active consumer.
    pub(crate) fn attach_consumer(&self, c: &Arc<Consumer>) -> Result<(), AttachError> {
        let mut a = self.attached.lock();
        if self.is_deleted() {
            return Err(AttachError::NotFound);
        }
        if a.exclusive
            || (c.exclusive() && (a.count > 0 || self.args.read().single_active_consumer))
        {
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

    /// The partition a new message goes to. With one partition, always
    /// it; with `x-partitions` > 1, the message's `x-ordering-key` header
    /// picks it by a stable hash (the same key, the same partition, across
    /// restarts), and a message without a key goes round robin. The
    /// headers are only looked at for a partitioned queue.
    pub fn partition_for_publish(&self, headers: &dyn HeaderLookup) -> &Arc<Partition> {
        let n = self.partitions.len();
        if n == 1 {
            return &self.partitions[0];
        }
        let i = match headers.header(ORDERING_KEY) {
            Some(Value::String(k)) => ordering_hash(k.as_bytes()) % n as u64,
            Some(Value::Null) | None => self.next_partition.fetch_add(1, Ordering::Relaxed),
            Some(other) => ordering_hash(other.to_string().as_bytes()) % n as u64,
        };
        &self.partitions[i as usize % n]
    }

    /// Ready messages over all partitions.
    pub fn message_count(&self) -> u64 {
        self.partitions.iter().map(|p| p.ready_len()).sum()
    }

    /// Its live consumers (each is attached to every partition).
    pub fn consumers(&self) -> Vec<Arc<Consumer>> {
        self.partitions[0].consumers()
    }

    /// Its monotonic counters over all partitions: atomics only, no lock
    /// (see [`crate::stats`]).
    pub fn counters(&self) -> crate::stats::QueueCounters {
        let mut c = crate::stats::QueueCounters::default();
        for p in &self.partitions {
            p.add_counters(&mut c);
        }
        c
    }

    /// A snapshot of its figures: each partition's lock taken once,
    /// briefly, no walk over messages (see [`crate::stats`]). The
    /// consumer count is the queue's.
    pub fn stats(&self) -> crate::stats::QueueStats {
        let mut s = crate::stats::QueueStats::default();
        for p in &self.partitions {
            p.add_stats(&mut s);
        }
        s.consumers = self.consumer_count();
        s
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
