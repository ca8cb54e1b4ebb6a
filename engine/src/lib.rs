//! The routing and lease engine: tenants, exchanges, queues, bindings,
//! consumers and leases. It never sees a wire format; adapters call it with
//! plain values and map its [`EngineError`]s to their own codes.
//!
//! * [`client`]: the per-client interface every protocol session uses:
//!   publish, subscribe, get, leases, settles, the batch's commit.
//! * [`lease`]: delivered, unsettled messages and how they are settled.
//! * [`tenant`]: declare/delete/bind/route within one tenant (AMQP vhost).
//! * [`exchange`]: exchanges, bindings, routing algorithms.
//! * [`queue`]: queues and partitions, ready lists, dispatch, counters.
//! * [`consumer`]: consumers, credit windows, the per-connection outbox.
//! * [`message`]: messages and queue entries.
//! * [`meta`]: how definitions are stored in the store's metadata map.
//! * [`retained`]: MQTT retained messages, per tenant and topic, durable.
//! * [`session_state`]: durable protocol session state (MQTT QoS 2 ids).
//! * [`stats`]: per-queue figures (depth, bytes, oldest message,
//!   attempts, counters) for the management API and metrics.
//! * [`permissions`], [`definitions`]: users' permissions per tenant and
//!   topic, durable users and permissions, definitions import (one batch).
//! * [`bounds`]: size limits of names, arguments and other definitions.
//! * [`topic`]: topic matching (AMQP patterns, MQTT filters) and the
//!   mapping between MQTT topics and AMQP routing keys, in one place.

#![forbid(unsafe_code)]

pub mod args;
pub mod auth;
pub mod bounds;
pub mod client;
pub mod clock;
pub mod consumer;
pub mod deadletter;
pub mod definitions;
pub mod error;
pub mod exchange;
mod feed;
pub mod lease;
pub mod login;
pub mod message;
pub mod meta;
pub mod permissions;
pub mod policy;
pub mod properties;
pub mod queue;
mod readback;
pub mod reply_to;
pub mod retained;
pub mod session_state;
mod spill;
pub mod stats;
pub mod stream;
pub mod tenant;
pub mod timers;
pub mod topic;

pub use client::Client;
pub use clock::{Clock, ManualClock, SharedClock, SystemClock};
pub use error::{ClientError, EngineError, Result};
pub use tenant::Tenant;

use message::Entry;
use parking_lot::RwLock;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use tokio::sync::oneshot;
use weir_backend::{
    LiveSet, Location, MessageId, Op, PartitionId, Relocation, Store, StoreError, Ticket,
};

/// The default tenant (AMQP vhost `/`).
pub const DEFAULT_TENANT: &str = "/";

/// Resolves when a metadata change is durable.
pub type DurableWait = oneshot::Receiver<std::result::Result<(), StoreError>>;

/// The engine: every tenant, over one store.
pub struct Engine {
    store: Arc<dyn Store>,
    /// Where every deadline starts: the only source of "now" (see [`clock`]).
    clock: SharedClock,
    tenants: RwLock<HashMap<String, Arc<Tenant>>>,
    next_partition: AtomicU64,
    next_connection: AtomicU64,
    /// Partitions of deleted queues whose leases are still out: compaction
    /// keeps moving those records so they do not pin the log.
    retired: parking_lot::Mutex<Vec<std::sync::Weak<queue::Partition>>>,
    /// Partitions with timed work (expiry, dead-letters), earliest first.
    pub timers: Arc<timers::Timers>,
    /// Dead-lettering counters.
    pub dead_letters: deadletter::DeadLetterStats,
    /// The header-codec registry (dead-lettering and delivery counts rewrite
    /// headers in the message's own format, whatever protocol owns it).
    codecs: parking_lot::RwLock<Arc<properties::HeaderCodecs>>,
    /// Bounds of retained messages and the bytes they take.
    pub(crate) retained: retained::RetainedBudget,
    /// Logins: the table of `users` (see [`definitions`]).
    auth: Arc<auth::Authenticator>,
    /// Users by name, as stored.
    users: RwLock<std::collections::BTreeMap<String, permissions::UserDef>>,
    /// Permissions and topic permissions, as clients check them.
    permissions: Arc<permissions::Permissions>,
    /// Per-user limits (`[[quota.users]]`), on top of each tenant's.
    pub user_quotas: weir_quota::UserQuotas,
    /// Per-connection overrides (`[[quota.connections]]`), applied by the
    /// sessions, which know a connection's name.
    pub connection_quotas: weir_quota::ConnectionQuotas,
    /// The store's latest ticket of a metadata change made here: a
    /// redeclare waits for it (it covers every earlier one).
    last_meta_ticket: AtomicU64,
    /// The store's latest ticket of a state-store change made here (MQTT
    /// session state, retained messages): a client's barrier covers it.
    last_state_ticket: AtomicU64,
    /// Definitions made through other handles of the store (`feed.rs`).
    feed: feed::Feed,
    /// Itself, for work that starts from `&self` and creates tenants (the
    /// feed).
    me: std::sync::OnceLock<std::sync::Weak<Engine>>,
}

impl Engine {
    /// Builds the engine from what the store recovered: definitions from
    /// its metadata, then, partition by partition, every live message back
    /// in its queue in id order, marked redelivered (it may have been
    /// delivered before the restart). Messages of partitions no queue owns
    /// are settled. Queues get back their unexpired idempotency receipts.
    ///
    /// Every deadline is computed from `clock`: the broker passes
    /// [`SystemClock`], tests a [`ManualClock`] they move by hand.
    pub fn open(store: Arc<dyn Store>, clock: SharedClock) -> Result<Arc<Self>> {
        let recovered = store.recovered_meta()?;
        let auth = auth::Authenticator::new([])
            .map_err(|e| EngineError::PreconditionFailed(format!("authentication: {e}")))?;
        let engine = Arc::new(Engine {
            store: store.clone(),
            clock: clock.clone(),
            tenants: RwLock::new(HashMap::new()),
            next_partition: AtomicU64::new(1),
            next_connection: AtomicU64::new(1),
            retired: parking_lot::Mutex::new(Vec::new()),
            timers: Arc::new(timers::Timers::new(clock.clone())),
            dead_letters: Default::default(),
            codecs: parking_lot::RwLock::new(Arc::new(properties::HeaderCodecs::new())),
            retained: Default::default(),
            auth: Arc::new(auth),
            users: RwLock::new(Default::default()),
            permissions: Default::default(),
            user_quotas: Default::default(),
            connection_quotas: Default::default(),
            last_meta_ticket: AtomicU64::new(0),
            last_state_ticket: AtomicU64::new(0),
            feed: feed::Feed::new(recovered.version),
            me: std::sync::OnceLock::new(),
        });
        let _ = engine.me.set(Arc::downgrade(&engine));
        engine.tenant_or_create(DEFAULT_TENANT);
        let mut any_user = false;

        let mut bindings = Vec::new();
        let mut queues = Vec::new();
        // Protocol session state and retained messages live in the store's
        // state store, each under its own key prefix (no global version).
        for e in store.scan_state(session_state::KEY_PREFIX)? {
            if let Some((t, key)) = session_state::decode_key(&e.key) {
                engine
                    .tenant_or_create(&t)
                    .session_state
                    .restore(key, e.value);
            }
        }
        // Streams' retention points: the first offset each partition keeps.
        let mut stream_points = HashMap::new();
        for e in store.scan_state(stream::STATE_PREFIX)? {
            if let (Some(p), Some(t)) = (
                stream::partition_of_key(&e.key),
                stream::Truncation::from_state(&e.value),
            ) {
                stream_points.insert(p, t);
            }
        }
        for e in store.scan_state(retained::KEY_PREFIX)? {
            match retained::decode_entry(&e.key, &e.value) {
                Some(Ok((t, m))) => engine.tenant_or_create(&t).retained.restore(&engine, m),
                Some(Err(err)) => {
                    tracing::warn!(key = %String::from_utf8_lossy(&e.key), error = %err, "ignoring an unreadable retained message")
                }
                None => {}
            }
        }
        for (k, v) in &recovered.meta {
            match meta::decode(k, v) {
                Some(meta::MetaEntry::Tenant(t)) => {
                    engine.tenant_or_create(&t);
                }
                Some(meta::MetaEntry::Exchange(t, def)) => {
                    engine.tenant_or_create(&t).restore_exchange(def);
                }
                Some(meta::MetaEntry::Queue(t, def)) => queues.push((t, def)),
                Some(meta::MetaEntry::Binding(t, b)) => bindings.push((t, b)),
                Some(meta::MetaEntry::Policy(t, def)) => {
                    let name = def.name.clone();
                    if let Err(e) = engine.tenant_or_create(&t).restore_policy(def) {
                        tracing::warn!(tenant = %t, policy = %name, error = %e, "ignoring a stored policy");
                    }
                }
                Some(meta::MetaEntry::NextPartition(n)) => {
                    engine.next_partition.fetch_max(n, Ordering::Relaxed);
                }
                Some(meta::MetaEntry::User(def)) => {
                    any_user = true;
                    engine.restore_user(def);
                }
                Some(meta::MetaEntry::Permission(def)) => {
                    let (u, t) = (def.user.clone(), def.vhost.clone());
                    if let Err(e) = engine.permissions.set(def) {
                        tracing::warn!(user = %u, tenant = %t, error = %e, "ignoring stored permissions");
                    }
                }
                Some(meta::MetaEntry::TopicPermission(def)) => {
                    let (u, t) = (def.user.clone(), def.vhost.clone());
                    if let Err(e) = engine.permissions.set_topic(def) {
                        tracing::warn!(user = %u, tenant = %t, error = %e, "ignoring stored topic permissions");
                    }
                }
                None => {
                    tracing::warn!(key = %String::from_utf8_lossy(k), "ignoring undecodable metadata entry")
                }
            }
        }
        if !any_user {
            engine.default_user();
        }
        let mut owned = std::collections::HashSet::new();
        let mut restored_messages = 0u64;
        for (t, def) in queues {
            for p in &def.partitions {
                engine.next_partition.fetch_max(p + 1, Ordering::Relaxed);
            }
            let q = engine.tenant_or_create(&t).restore_queue(def);
            // This engine takes its queues over (a restart, or another
            // gateway's crash): whoever held them before is fenced.
            for p in &q.partitions {
                store.acquire(p.id)?;
            }
            // Idempotency receipts, stored under the queue's first partition
            // (only a durable queue stores any).
            if q.partitions[0].durable {
                let id = q.dedup_id();
                q.dedup().restore(
                    store.recover_receipts(id)?,
                    store.recover_receipts(queue::dedup::cancel_id(id))?,
                    clock.now_ms(),
                );
            }
            for p in &q.partitions {
                owned.insert(p.id);
                let msgs = store.recover_partition(p.id)?;
                restored_messages += msgs.len() as u64;
                if let Some(log) = &p.stream {
                    // A stream's events stay in the store: only its sparse
                    // index is rebuilt (`stream::StreamLog::recover`).
                    let saved = stream_points.get(&p.id).copied();
                    if let Some(before) = log.recover(msgs, saved) {
                        store.append(
                            &[Op::Truncate {
                                partition: p.id,
                                before,
                            }],
                            &mut Vec::new(),
                        )?;
                    }
                    continue;
                }
                let now = clock.now_ms();
                p.restore(msgs.into_iter().map(|m| {
                    let e = Entry {
                        seq: 0,
                        id: m.id,
                        location: Some(m.location),
                        size: m.size,
                        redelivered: true,
                        // Delivery attempts are durable (`Op::Requeue`):
                        // a poison message does not get a fresh budget.
                        attempts: u16::try_from(m.attempts).unwrap_or(u16::MAX),
                        priority: m.attrs.priority,
                        enqueued_ms: now,
                        expires_at_ms: m.attrs.expires_at_ms,
                        message: None,
                    };
                    (e, m.attrs.deliver_at_ms)
                }));
            }
        }
        for (t, b) in bindings {
            if let Err(e) = engine.tenant_or_create(&t).restore_binding(&b) {
                tracing::warn!(tenant = %t, source = %b.source, destination = %b.destination, error = %e, "dropping binding whose ends are gone");
            }
        }
        // Messages of partitions that no queue owns (deleted before the
        // crash, the drop record lost): drop them so their space is freed,
        // one record per partition. Only those nobody holds: in a shared
        // store another handle's new queue may not be in our definitions
        // yet, and is not ours to empty.
        let mut orphans = Vec::new();
        let mut orphaned = 0;
        for pid in store.recovered_partitions()? {
            if owned.contains(&pid) || store.try_acquire(pid)?.is_none() {
                continue;
            }
            orphaned += store.recover_partition(pid)?.len();
            orphans.push(Op::DropPartition { partition: pid });
        }
        if !orphans.is_empty() {
            tracing::info!(
                partitions = orphans.len(),
                messages = orphaned,
                "dropping messages of deleted queues"
            );
            store.append(&orphans, &mut Vec::new())?;
        }
        // Retained messages that expired while the broker was down.
        engine.sweep_retained();
        // From here on, definitions made through other handles arrive.
        engine.apply_definition_changes();
        if recovered.truncated_bytes > 0 {
            tracing::warn!(
                bytes = recovered.truncated_bytes,
                "store dropped an unconfirmed torn tail at recovery"
            );
        }
        tracing::info!(
            tenants = engine.tenants.read().len(),
            messages = restored_messages,
            meta_version = recovered.version,
            "engine recovered"
        );
        Ok(engine)
    }

    /// The store.
    pub fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }

    /// The clock every deadline is computed from. Sessions read it once
    /// per batch for the times they pass in (lease times, a publish's
    /// expiry), so they agree with the engine's own reads.
    pub fn clock(&self) -> &SharedClock {
        &self.clock
    }

    /// A tenant by name.
    pub fn tenant(&self, name: &str) -> Option<Arc<Tenant>> {
        self.tenants.read().get(name).cloned()
    }

    /// Creates tenant `name` durably (its record in the store's metadata),
    /// or finds it. A new tenant comes with the wait of its record, to be
    /// awaited before anyone is told it exists. An empty name is refused.
    pub fn add_tenant(self: &Arc<Self>, name: &str) -> Result<(Arc<Tenant>, Option<DurableWait>)> {
        if name.is_empty() {
            return Err(EngineError::PreconditionFailed(
                "a vhost needs a name".to_string(),
            ));
        }
        if let Some(t) = self.tenant(name) {
            return Ok((t, None));
        }
        bounds::check_name("vhost", name)?;
        let wait = self.persist(&[Op::PutMeta {
            key: &meta::tenant_key(name),
            value: b"{}",
        }])?;
        Ok((self.tenant_or_create(name), Some(wait)))
    }

    /// The tenants' names, sorted.
    pub fn tenant_names(&self) -> Vec<String> {
        let mut v: Vec<String> = self.tenants.read().keys().cloned().collect();
        v.sort();
        v
    }

    fn tenant_or_create(self: &Arc<Self>, name: &str) -> Arc<Tenant> {
        if let Some(t) = self.tenant(name) {
            return t;
        }
        let mut w = self.tenants.write();
        w.entry(name.to_string())
            .or_insert_with(|| Tenant::new(name, Arc::downgrade(self), self.clock.clone()))
            .clone()
    }

    /// Installs the header-codec registry the gateway's composition root
    /// built (the engine's own format plus each protocol's, under its
    /// number), before it accepts connections: clients opened earlier keep
    /// the registry they started with.
    pub fn set_codecs(&self, codecs: Arc<properties::HeaderCodecs>) {
        *self.codecs.write() = codecs;
    }

    /// The registered header codecs.
    pub fn codecs(&self) -> Arc<properties::HeaderCodecs> {
        self.codecs.read().clone()
    }

    /// Sets the bounds of retained messages (before accepting connections;
    /// a change applies to retained publishes from then on).
    pub fn set_retained_limits(&self, limits: retained::RetainedLimits) {
        self.retained.set_limits(limits);
    }

    /// The bounds of retained messages.
    pub fn retained_limits(&self) -> retained::RetainedLimits {
        self.retained.limits()
    }

    /// Bytes (topic + header + body) every tenant's retained messages take.
    pub fn retained_bytes(&self) -> u64 {
        self.retained.bytes()
    }

    /// Removes the retained messages of every tenant that expired by now
    /// (the engine's clock), from memory and (without waiting) from the
    /// store; returns how many. Lookups skip expired ones anyway: this only
    /// frees their space, so calling it every few seconds is plenty.
    pub fn sweep_retained(&self) -> usize {
        let now_ms = self.clock.now_ms();
        self.tenants()
            .iter()
            .map(|t| t.sweep_retained(self, now_ms))
            .sum()
    }

    /// Runs the timed work due by now (the engine's clock: expiry,
    /// dead-lettering, idle queues), one batch per partition; returns when
    /// to call again (ms since epoch, on the same clock), if anything is
    /// scheduled. The gateway's timer task calls it; it sleeps until the
    /// returned time or until [`timers::Timers::changed`]. Tests on a
    /// [`ManualClock`] advance it and call this.
    pub fn run_timers(&self) -> Option<u64> {
        // The feed pokes the timer task when another handle changed a
        // definition.
        if self.feed.pending() {
            self.apply_definition_changes();
        }
        let now_ms = self.clock.now_ms();
        for p in self.timers.take_due(now_ms) {
            let work = p.take_due(now_ms);
            deadletter::process(self, &p, work.dead);
            if work.queue_expired {
                if let Some(q) = p.queue() {
                    if let Some(t) = self.tenant(&q.tenant) {
                        t.expire_idle(&q, now_ms);
                    }
                }
            }
        }
        self.timers.next_ms()
    }

    /// A fresh connection id.
    pub fn next_connection_id(&self) -> u64 {
        self.next_connection.fetch_add(1, Ordering::Relaxed)
    }

    /// Allocates a new partition id (recorded with the queue's definition)
    /// and takes it for this engine's handle of the store.
    pub(crate) fn allocate_partition(&self) -> PartitionId {
        let id = PartitionId(self.next_partition.fetch_add(1, Ordering::Relaxed));
        if let Err(e) = self.store.acquire(id) {
            // Only a closed store refuses: its appends fail anyway.
            tracing::debug!(partition = id.0, error = %e, "acquiring a new partition");
        }
        id
    }

    pub(crate) fn next_partition_hint(&self) -> u64 {
        self.next_partition.load(Ordering::Relaxed)
    }

    /// The latest ticket of a state-store change made here (it covers every
    /// earlier one: the state store is one ordering domain).
    pub(crate) fn state_ticket(&self) -> Ticket {
        Ticket::new(self.last_state_ticket.load(Ordering::Acquire))
    }

    /// Appends metadata ops; the receiver resolves once they are durable.
    /// No ops: once every metadata change made here so far is durable (a
    /// redeclare answers when the original is on disk).
    pub(crate) fn persist(&self, ops: &[Op<'_>]) -> Result<DurableWait> {
        let (tx, rx) = oneshot::channel();
        let ticket = if ops.is_empty() {
            Ticket::new(self.last_meta_ticket.load(Ordering::Acquire))
        } else {
            // Our own changes come back through the feed: not applied twice.
            self.feed.expect_own(ops);
            let ticket = match self.store.append(ops, &mut Vec::new()) {
                Ok(t) => t,
                Err(e) => {
                    self.feed.unexpect_own(ops);
                    return Err(e.into());
                }
            };
            if ops.iter().any(feed::is_meta) {
                self.last_meta_ticket
                    .fetch_max(ticket.get(), Ordering::AcqRel);
            }
            if ops
                .iter()
                .any(|op| matches!(op, Op::PutState { .. } | Op::DeleteState { .. }))
            {
                self.last_state_ticket
                    .fetch_max(ticket.get(), Ordering::AcqRel);
            }
            ticket
        };
        self.store.when_durable(
            ticket,
            Box::new(move |r| {
                let _ = tx.send(r);
            }),
        );
        Ok(rx)
    }

    /// Remembers the partitions of a deleted queue until their leases end.
    pub(crate) fn retire(&self, partitions: &[Arc<queue::Partition>]) {
        let mut r = self.retired.lock();
        r.retain(|w| w.upgrade().is_some_and(|p| p.has_leases()));
        r.extend(
            partitions
                .iter()
                .filter(|p| p.has_leases())
                .map(Arc::downgrade),
        );
    }

    /// Lets the store move live records so it can reclaim space (the
    /// embedded log relocates the survivors of sparse old segments). The
    /// store is shown every position the engine holds: the entries of every
    /// partition (non-durable ones hold paged records too) and of deleted
    /// queues' partitions whose leases are still out. Returns how many
    /// entries moved.
    pub fn compact(&self) -> Result<usize> {
        Ok(self.store.compact(&Positions {
            engine: self,
            partitions: Default::default(),
        })?)
    }

    /// Every tenant.
    pub fn tenants(&self) -> Vec<Arc<Tenant>> {
        self.tenants.read().values().cloned().collect()
    }
}

/// Every position the engine holds, for [`Store::compact`]. The store reads
/// and copies records between [`LiveSet::for_each_live`] and
/// [`LiveSet::relocate`], with no partition lock held.
struct Positions<'a> {
    engine: &'a Engine,
    /// The partitions walked by `for_each_live`, for the swap (a deleted
    /// queue's partition is still reachable through them).
    partitions: std::cell::RefCell<HashMap<PartitionId, Arc<queue::Partition>>>,
}

impl Positions<'_> {
    /// Every partition of every queue, and those of deleted queues whose
    /// leases are still out.
    fn collect(&self) -> HashMap<PartitionId, Arc<queue::Partition>> {
        let mut partitions = HashMap::new();
        for t in self.engine.tenants.read().values() {
            for q in t.queues() {
                partitions.extend(q.partitions.iter().map(|p| (p.id, p.clone())));
            }
        }
        let mut retired = self.engine.retired.lock();
        retired.retain(|w| w.upgrade().is_some_and(|p| p.has_leases()));
        partitions.extend(
            retired
                .iter()
                .filter_map(|w| w.upgrade())
                .map(|p| (p.id, p)),
        );
        partitions
    }
}

impl LiveSet for Positions<'_> {
    fn for_each_live(&self, visit: &mut dyn FnMut(PartitionId, MessageId, Location)) {
        let partitions = self.collect();
        for p in partitions.values() {
            // Under the partition's lock: only collects.
            p.for_each_location(|id, location| visit(p.id, id, *location));
        }
        *self.partitions.borrow_mut() = partitions;
    }

    fn relocate(&self, moves: &[Relocation]) -> Vec<bool> {
        if self.partitions.borrow().is_empty() {
            *self.partitions.borrow_mut() = self.collect();
        }
        let partitions = self.partitions.borrow();
        let mut done = vec![false; moves.len()];
        // Grouped per partition: one lock and one pass over its ready list.
        type Swaps = Vec<(MessageId, Location, Location)>;
        let mut groups: HashMap<PartitionId, (Vec<usize>, Swaps)> = HashMap::new();
        for (i, m) in moves.iter().enumerate() {
            let g = groups.entry(m.partition).or_default();
            g.0.push(i);
            g.1.push((m.id, m.old, m.new));
        }
        for (pid, (idx, swaps)) in groups {
            // A partition gone meanwhile holds nothing: its copies are refused.
            let Some(p) = partitions.get(&pid) else {
                continue;
            };
            for (i, ok) in idx.into_iter().zip(p.swap_locations(&swaps)) {
                done[i] = ok;
            }
        }
        done
    }
}
