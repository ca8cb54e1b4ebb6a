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

pub mod client;
pub mod consumer;
pub mod error;
pub mod exchange;
pub mod lease;
pub mod message;
pub mod meta;
pub mod queue;
pub mod tenant;

pub use client::Client;
pub use error::{ClientError, EngineError, Result};
pub use tenant::Tenant;

use message::{now_ms, Entry};
use parking_lot::RwLock;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use tokio::sync::oneshot;
use weir_backend::{Op, PartitionId, Store, StoreError};

/// The default tenant (AMQP vhost `/`).
pub const DEFAULT_TENANT: &str = "/";

/// Resolves when a metadata change is durable.
pub type DurableWait = oneshot::Receiver<std::result::Result<(), StoreError>>;

/// The engine: every tenant, over one store.
pub struct Engine {
    store: Arc<dyn Store>,
    tenants: RwLock<HashMap<String, Arc<Tenant>>>,
    next_partition: AtomicU64,
    next_connection: AtomicU64,
    /// Partitions of deleted queues whose leases are still out: compaction
    /// keeps moving those records so they do not pin the log.
    retired: parking_lot::Mutex<Vec<std::sync::Weak<queue::Partition>>>,
}

impl Engine {
    /// Builds the engine from what the store recovered: definitions, then every
    /// live message, back in its queue in id order, marked redelivered (it
    /// may have been delivered before the restart).
    pub fn open(store: Arc<dyn Store>) -> Result<Arc<Self>> {
        let recovered = store.take_recovered();
        let engine = Arc::new(Engine {
            store: store.clone(),
            tenants: RwLock::new(HashMap::new()),
            next_partition: AtomicU64::new(1),
            next_connection: AtomicU64::new(1),
            retired: parking_lot::Mutex::new(Vec::new()),
        });
        engine.tenant_or_create(DEFAULT_TENANT);

        let mut bindings = Vec::new();
        let mut queues = Vec::new();
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
                Some(meta::MetaEntry::NextPartition(n)) => {
                    engine.next_partition.fetch_max(n, Ordering::Relaxed);
                }
                None => {
                    tracing::warn!(key = %String::from_utf8_lossy(k), "ignoring undecodable metadata entry")
                }
            }
        }
        let mut live = recovered.partitions;
        let mut restored_messages = 0u64;
        for (t, def) in queues {
            for p in &def.partitions {
                engine.next_partition.fetch_max(p + 1, Ordering::Relaxed);
            }
            let q = engine.tenant_or_create(&t).restore_queue(def);
            for p in &q.partitions {
                if let Some(msgs) = live.remove(&p.id) {
                    restored_messages += msgs.len() as u64;
                    p.restore(msgs.into_iter().map(|m| Entry {
                        seq: 0,
                        id: m.id,
                        location: Some(m.location),
                        size: m.size,
                        redelivered: true,
                        attempts: 0,
                        enqueued_ms: now_ms(),
                        message: None,
                    }));
                }
            }
        }
        for (t, b) in bindings {
            if let Err(e) = engine.tenant_or_create(&t).restore_binding(&b) {
                tracing::warn!(tenant = %t, source = %b.source, destination = %b.destination, error = %e, "dropping binding whose ends are gone");
            }
        }
        // Messages of partitions that no queue owns (deleted before the
        // crash, settle records lost): settle them so their space is freed.
        let mut orphans = Vec::new();
        for (pid, msgs) in live {
            for m in msgs {
                orphans.push(Op::Settle {
                    partition: pid,
                    id: m.id,
                    location: m.location,
                });
            }
        }
        if !orphans.is_empty() {
            tracing::info!(
                messages = orphans.len(),
                "settling messages of deleted queues"
            );
            store.append(&orphans, &mut Vec::new(), None)?;
        }
        if recovered.truncated_bytes > 0 {
            tracing::warn!(
                bytes = recovered.truncated_bytes,
                "store dropped an unconfirmed torn tail at recovery"
            );
        }
        tracing::info!(
            tenants = engine.tenants.read().len(),
            messages = restored_messages,
            meta_version = recovered.meta_version,
            "engine recovered"
        );
        Ok(engine)
    }

    /// The store.
    pub fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }

    /// A tenant by name.
    pub fn tenant(&self, name: &str) -> Option<Arc<Tenant>> {
        self.tenants.read().get(name).cloned()
    }

    fn tenant_or_create(self: &Arc<Self>, name: &str) -> Arc<Tenant> {
        if let Some(t) = self.tenant(name) {
            return t;
        }
        let mut w = self.tenants.write();
        w.entry(name.to_string())
            .or_insert_with(|| Tenant::new(name, Arc::downgrade(self)))
            .clone()
    }

    /// A fresh connection id.
    pub fn next_connection_id(&self) -> u64 {
        self.next_connection.fetch_add(1, Ordering::Relaxed)
    }

    /// Allocates a new partition id (recorded with the queue's definition).
    pub(crate) fn allocate_partition(&self) -> PartitionId {
        PartitionId(self.next_partition.fetch_add(1, Ordering::Relaxed))
    }

    pub(crate) fn next_partition_hint(&self) -> u64 {
        self.next_partition.load(Ordering::Relaxed)
    }

    /// Appends metadata ops; the receiver resolves once they are durable.
    pub(crate) fn persist(&self, ops: &[Op<'_>]) -> Result<DurableWait> {
        let (tx, rx) = oneshot::channel();
        self.store.append(
            ops,
            &mut Vec::new(),
            Some(Box::new(move |r| {
                let _ = tx.send(r);
            })),
        )?;
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

    /// Relocates the survivors of sparse old segments so the store can
    /// reclaim them. Returns how many entries moved.
    pub fn compact(&self) -> Result<usize> {
        let candidates = self.store.compaction_candidates();
        if candidates.is_empty() {
            return Ok(0);
        }
        let mut partitions: Vec<Arc<queue::Partition>> = Vec::new();
        for t in self.tenants.read().values() {
            for q in t.queues() {
                // Every partition: non-durable ones hold paged records too.
                partitions.extend(q.partitions.iter().cloned());
            }
        }
        {
            let mut retired = self.retired.lock();
            retired.retain(|w| w.upgrade().is_some_and(|p| p.has_leases()));
            partitions.extend(retired.iter().filter_map(|w| w.upgrade()));
        }
        let mut moved = 0;
        let mut locs = Vec::with_capacity(1);
        for segment in candidates {
            for p in &partitions {
                let mut err = None;
                p.for_each_in_segment(segment, |id, location| {
                    if err.is_some() {
                        return;
                    }
                    let from = *location;
                    locs.clear();
                    let op = Op::Relocate {
                        partition: p.id,
                        id,
                        from,
                    };
                    match self.store.append(&[op], &mut locs, None) {
                        Ok(()) => {
                            if let Some(l) = locs.first() {
                                *location = *l;
                                moved += 1;
                            }
                        }
                        Err(x) => err = Some(x),
                    }
                });
                if let Some(e) = err {
                    return Err(e.into());
                }
            }
        }
        Ok(moved)
    }

    /// Every tenant.
    pub fn tenants(&self) -> Vec<Arc<Tenant>> {
        self.tenants.read().values().cloned().collect()
    }
}
