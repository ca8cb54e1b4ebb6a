//! Definitions made through other handles of the store reach this engine:
//! it watches the store's metadata change feed and applies what another
//! engine (next, another gateway) declared, bound or deleted.
//!
//! * The store calls the feed's wake on a change (on the writing thread,
//!   so it only sets a flag and pokes the timer task); the timer task's
//!   next [`Engine::run_timers`] applies the changes
//!   ([`Engine::apply_definition_changes`], also callable directly).
//! * Our own changes come back through the feed too. [`Feed::expect_own`]
//!   notes the keys of every change this engine makes before it appends
//!   it, and the feed skips that many events per key: an echo applied late
//!   could otherwise undo a later local change (a queue deleted and
//!   declared again).
//! * Applying is idempotent and local: a definition that exists stays as it
//!   is; a delete removes the object from memory without writing anything
//!   (the store already holds the delete). Queues declared elsewhere are
//!   routed to and listed, but their partitions stay with the handle that
//!   acquired them: this engine appends nothing for them (the store would
//!   answer `Fenced`).
//! * A new queue or exchange is stored with a conditional put (absent
//!   before): of two handles declaring one name at once, one wins, and the
//!   other applies the winner's definition and answers as for a redeclare.

use crate::meta::{self, BindingDef, DestinationKind, MetaEntry};
use crate::{Engine, EngineError, Result};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use weir_backend::{MetaChange, MetaEvent, MetaFeed, Op, StoreError, Ticket};

/// Whether `op` changes the metadata map.
pub(crate) fn is_meta(op: &Op<'_>) -> bool {
    matches!(
        op,
        Op::PutMeta { .. } | Op::DeleteMeta { .. } | Op::MetaBatch { .. }
    )
}

/// The engine's side of the change feed.
pub(crate) struct Feed {
    /// The metadata version applied so far.
    seen: AtomicU64,
    /// The store woke us: changes wait.
    pending: Arc<AtomicBool>,
    /// One application at a time, in version order.
    applying: Mutex<()>,
    /// Keys of our own changes whose events have not come back yet, with
    /// how many.
    own: Mutex<HashMap<Vec<u8>, u32>>,
}

impl Feed {
    /// A feed that has applied everything up to `version` (what open read).
    pub(crate) fn new(version: u64) -> Feed {
        Feed {
            seen: AtomicU64::new(version),
            pending: Arc::new(AtomicBool::new(false)),
            applying: Mutex::new(()),
            own: Mutex::new(HashMap::new()),
        }
    }

    /// Whether the store said changes wait.
    pub(crate) fn pending(&self) -> bool {
        self.pending.load(Ordering::Acquire)
    }

    /// Notes the metadata keys `ops` change, before they are appended.
    pub(crate) fn expect_own(&self, ops: &[Op<'_>]) {
        if !ops.iter().any(is_meta) {
            return;
        }
        let mut own = self.own.lock();
        for_each_key(ops, |k| *own.entry(k.to_vec()).or_default() += 1);
    }

    /// Takes back [`Feed::expect_own`] for ops that were not appended.
    pub(crate) fn unexpect_own(&self, ops: &[Op<'_>]) {
        let mut own = self.own.lock();
        for_each_key(ops, |k| {
            if let Some(n) = own.get_mut(k) {
                *n -= 1;
                if *n == 0 {
                    own.remove(k);
                }
            }
        });
    }

    /// Whether the event for `key` is the echo of our own change (and
    /// counts it off).
    fn is_own(&self, key: &[u8]) -> bool {
        let mut own = self.own.lock();
        match own.get_mut(key) {
            Some(n) => {
                *n -= 1;
                if *n == 0 {
                    own.remove(key);
                }
                true
            }
            None => false,
        }
    }
}

fn for_each_key(ops: &[Op<'_>], mut f: impl FnMut(&[u8])) {
    for op in ops {
        match op {
            Op::PutMeta { key, .. } | Op::DeleteMeta { key } => f(key),
            Op::MetaBatch { changes } => {
                for c in changes.iter() {
                    match c {
                        MetaChange::Put { key, .. } | MetaChange::Delete { key } => f(key),
                    }
                }
            }
            _ => {}
        }
    }
}

impl Engine {
    /// Applies the definitions changed through other handles of the store
    /// since the last call (or since open), and arms the store's wake for
    /// the next change. Returns how many changes were applied. Called by
    /// [`Engine::run_timers`] when the feed woke it; safe to call anytime
    /// with no engine lock held.
    pub fn apply_definition_changes(&self) -> usize {
        let _one = self.feed.applying.lock();
        let mut applied = 0;
        // Bounded: each round either applies changes (the feed is finite)
        // or ends.
        for _ in 0..64 {
            self.feed.pending.store(false, Ordering::Release);
            let since = self.feed.seen.load(Ordering::Acquire);
            let (pending, timers) = (self.feed.pending.clone(), self.timers.clone());
            let wake = Box::new(move || {
                pending.store(true, Ordering::Release);
                timers.poke();
            });
            match self.store.watch(since, wake) {
                Ok(MetaFeed::Changes(events)) if events.is_empty() => break,
                Ok(MetaFeed::Changes(events)) => {
                    for e in &events {
                        if !self.feed.is_own(&e.key) {
                            self.apply_event(e);
                            applied += 1;
                        }
                        self.feed.seen.fetch_max(e.version, Ordering::AcqRel);
                    }
                }
                Ok(MetaFeed::Reload) => {
                    // Too far behind for the feed: every definition again
                    // (existing ones stay as they are; a delete missed here
                    // is seen at the next restart).
                    let m = match self.store.recovered_meta() {
                        Ok(m) => m,
                        Err(e) => {
                            tracing::warn!(error = %e, "reloading definitions failed");
                            break;
                        }
                    };
                    self.feed.own.lock().clear();
                    for (key, value) in m.meta {
                        self.apply_event(&MetaEvent {
                            version: m.version,
                            key,
                            value: Some(value),
                        });
                        applied += 1;
                    }
                    self.feed.seen.fetch_max(m.version, Ordering::AcqRel);
                }
                Err(e) => {
                    tracing::warn!(error = %e, "reading the definitions feed failed");
                    break;
                }
            }
        }
        applied
    }

    /// Applies one change made through another handle, locally.
    fn apply_event(&self, e: &MetaEvent) {
        let key = &e.key[..];
        // MQTT session state and retained messages are read where they are
        // used, not kept in sync here.
        if crate::session_state::decode_key(key).is_some() {
            return;
        }
        let Some(value) = &e.value else {
            self.apply_delete(key);
            return;
        };
        if crate::retained::decode_entry(key, value).is_some() {
            return;
        }
        let Some(entry) = meta::decode(key, value) else {
            tracing::debug!(key = %String::from_utf8_lossy(key), "ignoring an undecodable definition from the feed");
            return;
        };
        let Some(engine) = self.me.get().and_then(std::sync::Weak::upgrade) else {
            return;
        };
        match entry {
            MetaEntry::Tenant(t) => {
                engine.tenant_or_create(&t);
            }
            MetaEntry::Exchange(t, def) => {
                let tenant = engine.tenant_or_create(&t);
                if tenant.exchange(&def.name).is_err() {
                    tenant.restore_exchange(def);
                }
            }
            MetaEntry::Queue(t, def) => {
                for p in &def.partitions {
                    self.next_partition.fetch_max(p + 1, Ordering::Relaxed);
                }
                let tenant = engine.tenant_or_create(&t);
                if !tenant.has_queue(&def.name) {
                    // Its partitions stay with the handle that declared it.
                    tenant.restore_queue(def);
                }
            }
            MetaEntry::Binding(t, b) => {
                if let Err(err) = engine.tenant_or_create(&t).restore_binding(&b) {
                    tracing::debug!(tenant = %t, source = %b.source, destination = %b.destination, error = %err, "binding from the feed whose ends are not here");
                }
            }
            MetaEntry::Policy(t, def) => {
                if let Err(err) = engine.tenant_or_create(&t).restore_policy(def) {
                    tracing::warn!(tenant = %t, error = %err, "ignoring a policy from the feed");
                }
            }
            MetaEntry::NextPartition(n) => {
                self.next_partition.fetch_max(n, Ordering::Relaxed);
            }
            MetaEntry::User(def) => self.restore_user(def),
            MetaEntry::Permission(def) => {
                if let Err(err) = self.permissions.set(def) {
                    tracing::warn!(error = %err, "ignoring permissions from the feed");
                }
            }
            MetaEntry::TopicPermission(def) => {
                if let Err(err) = self.permissions.set_topic(def) {
                    tracing::warn!(error = %err, "ignoring topic permissions from the feed");
                }
            }
        }
    }

    /// A definition deleted through another handle: forgotten here.
    fn apply_delete(&self, key: &[u8]) {
        let parts: Vec<&[u8]> = key.split(|b| *b == 0).collect();
        let text = |i: usize| parts.get(i).and_then(|p| std::str::from_utf8(p).ok());
        let (Some(kind), Some(tenant)) = (parts.first(), text(1)) else {
            return;
        };
        let Some(t) = self.tenant(tenant) else {
            return;
        };
        match *kind {
            b"x" => {
                if let Some(name) = text(2) {
                    t.forget_exchange(name);
                }
            }
            b"q" => {
                if let Some(name) = text(2) {
                    t.forget_queue(name);
                }
            }
            b"b" => {
                let (Some(source), Some(kind), Some(destination), Some(rk), Some(args)) =
                    (text(2), text(3), text(4), text(5), text(6))
                else {
                    return;
                };
                let destination_kind = match kind {
                    "q" => DestinationKind::Queue,
                    "x" => DestinationKind::Exchange,
                    _ => return,
                };
                let Ok(arguments) = serde_json::from_str(args) else {
                    return;
                };
                t.forget_binding(&BindingDef {
                    source: source.to_string(),
                    destination_kind,
                    destination: destination.to_string(),
                    key: rk.to_string(),
                    arguments,
                });
            }
            _ => {
                tracing::debug!(key = %String::from_utf8_lossy(key), "a delete from the feed not applied until restart");
            }
        }
    }

    /// Stores a new definition under `key` only if no handle stored one
    /// first (a conditional put on an absent key). `Ok(None)` when another
    /// handle won: its definition has been applied here meanwhile, and the
    /// caller answers as for an existing one.
    pub(crate) fn persist_new(
        &self,
        key: &[u8],
        value: &[u8],
    ) -> Result<Option<crate::DurableWait>> {
        let op = [Op::PutMeta { key, value }];
        self.feed.expect_own(&op);
        match self.store.put_if(key, Some(value), 0) {
            Ok((ticket, _)) => {
                self.last_meta_ticket
                    .fetch_max(ticket.get(), Ordering::AcqRel);
                let (tx, rx) = tokio::sync::oneshot::channel();
                self.store.when_durable(
                    ticket,
                    Box::new(move |r| {
                        let _ = tx.send(r);
                    }),
                );
                Ok(Some(rx))
            }
            Err(StoreError::Conflict { .. }) => {
                self.feed.unexpect_own(&op);
                Ok(None)
            }
            Err(e) => {
                self.feed.unexpect_own(&op);
                Err(EngineError::Store(e))
            }
        }
    }

    /// The latest ticket of a metadata change made here (it covers every
    /// earlier one): what a redeclare and a client's barrier wait for.
    pub(crate) fn meta_ticket(&self) -> Ticket {
        Ticket::new(self.last_meta_ticket.load(Ordering::Acquire))
    }
}
