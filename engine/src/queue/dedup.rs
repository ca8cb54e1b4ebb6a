//! Idempotent publish: a queue's receipts of the idempotency keys it took.
//!
//! A message carrying the header `x-idempotency-key` (or, in a queue
//! declared with `x-dedup-on-message-id: true`, its `message-id` property)
//! is enqueued at most once per queue within the queue's `x-dedup-window`
//! (ms, default two minutes): while a receipt for its key is live, a
//! duplicate is confirmed to its publisher and dropped.
//!
//! * **Keys** are kept as a 64-bit hash (the first 8 bytes of the key's
//!   BLAKE2s-256 digest): stable across restarts and versions, and with a
//!   million receipts in a window the chance that two different keys
//!   collide is about 3 × 10⁻⁸. A collision would drop the second message
//!   as a duplicate; finding one on purpose takes about 2³² hashes, and
//!   making one for someone else's key 2⁶⁴, so a publisher can only drop a
//!   message whose key it already knows, which it could do anyway.
//! * **Memory** is bounded: at most [`MAX_RECEIPTS`] receipts per queue
//!   (40 to 70 bytes each, map and FIFO with their growth slack: at most
//!   about 70 MB for a queue at the bound). Beyond it the oldest receipts are forgotten
//!   before their window ends, so a duplicate of a message that old is
//!   enqueued again: the guarantee weakens to "within the window or the
//!   last [`MAX_RECEIPTS`] keys, whichever is shorter". Expired receipts go
//!   at the next keyed publish to the queue (no scan: a FIFO in expiry
//!   order); the table itself is allocated on the first keyed publish.
//! * **Durability**: for a persistent message in a durable queue, the
//!   receipt is appended to the store ([`weir_backend::Op::Receipt`], named
//!   by the queue's first partition) in the same batch as the message's
//!   record (one writer round: after a crash, both or neither), so the
//!   publisher's confirm covers it; the store keeps it across restarts and
//!   compaction until it expires. In a queue that may refuse a publish (a
//!   length limit with `x-overflow: reject-publish[-dlx]`) the receipt is
//!   appended right after the queue took the message instead, still before
//!   the publish returns: a refused (nacked) publish must leave no receipt,
//!   or its retry after a restart would be dropped as a duplicate. (There a
//!   crash between the two appends can let a duplicate of an *unconfirmed*
//!   message in; never a loss.) Should a queue refuse a message whose
//!   receipt went with it (a policy imposing reject-publish was set at that
//!   moment), a cancellation is stored ([`cancel_id`]). A transient message,
//!   or a non-durable queue, keeps its receipt in memory only: after a
//!   restart the message is gone and so is its receipt.
//! * **Atomicity**: a publish locks the receipts of every queue it
//!   deduplicates in (in a global order: the queues' first partition ids)
//!   from the check through the store append and the enqueue, so of two
//!   publishers racing with one key exactly one enqueues, and the other's
//!   confirm (which waits for a durability barrier) covers the winner's
//!   record. A publish the queue refuses (`x-overflow: reject-publish`, a
//!   deleted queue, a full disk) leaves no receipt.

use super::Queue;
use crate::exchange::HeaderLookup;
use crate::message::Message;
use crate::properties::HeaderCodecs;
use parking_lot::{Mutex, MutexGuard};
use serde_json::Value;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use weir_backend::{PartitionId, Receipt, Ticket};

/// The header that carries a message's idempotency key.
pub const IDEMPOTENCY_KEY: &str = "x-idempotency-key";

/// Most receipts a queue keeps (see the module doc for what happens beyond).
pub const MAX_RECEIPTS: usize = 1_000_000;

/// Marks the store identity under which a queue's receipt cancellations
/// are kept (its first partition id with the top bit set; partition ids
/// never get there).
const CANCELS: u64 = 1 << 63;

/// Where the cancellations of the receipts stored under `partition` are
/// stored: a cancellation is a receipt there with the same key hash and
/// expiry; at recovery it removes the receipt unless a later one (a later
/// expiry) was stored for the key.
pub fn cancel_id(partition: PartitionId) -> PartitionId {
    PartitionId(partition.0 | CANCELS)
}

/// The 64-bit hash a key is kept (and stored) as.
pub fn key_hash(key: &[u8]) -> u64 {
    use blake2::{Blake2s256, Digest};
    let digest = Blake2s256::digest(key);
    let mut b = [0u8; 8];
    b.copy_from_slice(&digest[..8]);
    u64::from_le_bytes(b)
}

/// The receipts of one queue.
pub struct Dedup {
    receipts: Mutex<Option<Box<Receipts>>>,
    /// `x-dedup-on-message-id`.
    on_message_id: AtomicBool,
    /// `x-dedup-window` (ms).
    window_ms: AtomicU64,
    /// Most receipts kept ([`MAX_RECEIPTS`] unless changed).
    limit: AtomicUsize,
    /// Duplicates dropped since start.
    duplicates: AtomicU64,
    /// Receipts forgotten before their window ended, for the bound.
    forgotten: AtomicU64,
}

/// The table: a map for lookups and a FIFO in insertion (= expiry) order,
/// so expiry never scans.
#[derive(Default)]
struct Receipts {
    /// Key hash → expiry (ms since the epoch).
    by_key: HashMap<u64, u64>,
    /// (expiry, key hash), oldest first. An entry whose expiry differs from
    /// the map's is stale (the key was received again after expiring) and
    /// only leaves the FIFO.
    fifo: VecDeque<(u64, u64)>,
    /// Per partition of the queue, the store's latest ticket of a keyed
    /// publish into it: a duplicate is confirmed once these are durable
    /// (its original is among them).
    tickets: Vec<(PartitionId, Ticket)>,
}

impl Receipts {
    /// Forgets what expired at `now`, and the oldest beyond `limit`.
    /// Returns how many were forgotten early (for the bound).
    fn purge(&mut self, now: u64, limit: usize) -> u64 {
        let mut early = 0;
        while let Some(&(at, h)) = self.fifo.front() {
            let over = self.fifo.len() > limit;
            if at > now && !over {
                break;
            }
            self.fifo.pop_front();
            if self.by_key.get(&h) == Some(&at) {
                self.by_key.remove(&h);
                if at > now {
                    early += 1;
                }
            }
        }
        // Give memory back after a burst.
        if self.by_key.capacity() > 1024 && self.by_key.len() < self.by_key.capacity() / 4 {
            self.by_key.shrink_to(self.by_key.len() * 2);
            self.fifo.shrink_to(self.fifo.len() * 2);
        }
        early
    }

    /// Whether a live receipt for `h` exists at `now`; if not, records one
    /// until `expires_at`.
    fn check_insert(&mut self, h: u64, now: u64, expires_at: u64) -> bool {
        if self.by_key.get(&h).is_some_and(|&at| at > now) {
            return true;
        }
        self.by_key.insert(h, expires_at);
        self.fifo.push_back((expires_at, h));
        false
    }

    /// Undoes the [`Self::check_insert`] of `h` that just recorded it (the
    /// queue did not take the message).
    fn undo(&mut self, h: u64, expires_at: u64) {
        if self.by_key.get(&h) == Some(&expires_at) {
            self.by_key.remove(&h);
        }
        if self.fifo.back() == Some(&(expires_at, h)) {
            self.fifo.pop_back();
        }
    }
}

impl Dedup {
    /// Receipts of a queue with these arguments; nothing allocated yet.
    pub fn new(on_message_id: bool, window_ms: u64) -> Self {
        Dedup {
            receipts: Mutex::new(None),
            on_message_id: AtomicBool::new(on_message_id),
            window_ms: AtomicU64::new(window_ms),
            limit: AtomicUsize::new(MAX_RECEIPTS),
            duplicates: AtomicU64::new(0),
            forgotten: AtomicU64::new(0),
        }
    }

    /// Applies changed arguments (to receipts made from now on).
    pub(crate) fn configure(&self, on_message_id: bool, window_ms: u64) {
        self.on_message_id.store(on_message_id, Ordering::Relaxed);
        self.window_ms.store(window_ms, Ordering::Relaxed);
    }

    /// Whether `message-id` is a key in this queue.
    pub fn on_message_id(&self) -> bool {
        self.on_message_id.load(Ordering::Relaxed)
    }

    /// The window (ms).
    pub fn window_ms(&self) -> u64 {
        self.window_ms.load(Ordering::Relaxed)
    }

    /// Changes the most receipts kept (default [`MAX_RECEIPTS`], at least
    /// 1); the excess goes at the next keyed publish.
    pub fn set_limit(&self, limit: usize) {
        self.limit.store(limit.max(1), Ordering::Relaxed);
    }

    /// Receipts held (expired ones included until purged).
    pub fn len(&self) -> usize {
        self.receipts.lock().as_ref().map_or(0, |r| r.by_key.len())
    }

    /// Whether no receipt is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Duplicates dropped since start.
    pub fn duplicates(&self) -> u64 {
        self.duplicates.load(Ordering::Relaxed)
    }

    /// Receipts forgotten before their window ended (over the limit).
    pub fn forgotten_early(&self) -> u64 {
        self.forgotten.load(Ordering::Relaxed)
    }

    /// Whether a live receipt for `key_hash` is held at `now` (a publish
    /// with that key would be dropped).
    pub fn contains(&self, key_hash: u64, now: u64) -> bool {
        self.receipts
            .lock()
            .as_ref()
            .and_then(|r| r.by_key.get(&key_hash))
            .is_some_and(|&at| at > now)
    }

    /// Loads the receipts the store recovered (at startup, before any
    /// publish), dropping those expired at `now`, those `cancels` cancels
    /// (see [`cancel_id`]) and the oldest beyond the limit.
    pub fn restore(&self, mut receipts: Vec<Receipt>, cancels: Vec<Receipt>, now: u64) {
        let cancelled: HashMap<u64, u64> = cancels
            .into_iter()
            .map(|c| (c.key_hash, c.expires_at_ms))
            .collect();
        receipts.retain(|r| {
            r.expires_at_ms > now
                && cancelled
                    .get(&r.key_hash)
                    .is_none_or(|&c| r.expires_at_ms > c)
        });
        if receipts.is_empty() {
            return;
        }
        receipts.sort_unstable_by_key(|r| (r.expires_at_ms, r.key_hash));
        let mut g = self.receipts.lock();
        let t = g.get_or_insert_with(Box::default);
        for r in receipts {
            let at = t.by_key.entry(r.key_hash).or_insert(0);
            *at = (*at).max(r.expires_at_ms);
            t.fifo.push_back((r.expires_at_ms, r.key_hash));
        }
        let early = t.purge(now, self.limit.load(Ordering::Relaxed));
        self.forgotten.fetch_add(early, Ordering::Relaxed);
    }
}

/// The key of `message` in a queue: its `x-idempotency-key` header if it
/// has one (a string, or any other value as its JSON text; empty = none),
/// else its `message-id` where the queue asks for that.
struct Keys<'a> {
    header: Option<u64>,
    message_id: std::cell::OnceCell<Option<u64>>,
    message: &'a Message,
    codecs: &'a HeaderCodecs,
}

impl Keys<'_> {
    fn message_id(&self) -> Option<u64> {
        *self.message_id.get_or_init(|| {
            let p = self
                .codecs
                .decode(self.message.header_format, &self.message.properties)
                .ok()?;
            p.message_id
                .filter(|m| !m.is_empty())
                .map(|m| key_hash(m.as_bytes()))
        })
    }
}

/// One deduplicated queue of a publish.
struct Target {
    /// Index in the routed queues.
    queue: usize,
    /// Index in [`Check::guards`].
    guard: usize,
    hash: u64,
    expires_at: u64,
    duplicate: bool,
}

/// The idempotency check of one publish: which routed queues already hold
/// its key (there it is dropped), with the receipts of every queue that
/// deduplicates it locked until this is dropped (after the store append
/// and the enqueue).
pub struct Check<'q> {
    targets: Vec<Target>,
    guards: Vec<(PartitionId, MutexGuard<'q, Option<Box<Receipts>>>)>,
}

impl<'q> Check<'q> {
    /// Checks `message` against every queue of `queues` that deduplicates
    /// it, recording a receipt where none is live. `None` (nothing locked,
    /// nothing allocated) when no queue does.
    pub fn new(
        headers: &dyn HeaderLookup,
        message: &Message,
        codecs: &HeaderCodecs,
        queues: &'q [Arc<Queue>],
        now: u64,
    ) -> Option<Check<'q>> {
        // The byte scan first: most messages carry no key, and their
        // headers are then never parsed for it.
        let looked_up = if headers.may_have(IDEMPOTENCY_KEY) {
            headers.header(IDEMPOTENCY_KEY)
        } else {
            None
        };
        let header = match looked_up {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) if s.is_empty() => None,
            Some(Value::String(s)) => Some(key_hash(s.as_bytes())),
            Some(other) => Some(key_hash(other.to_string().as_bytes())),
        };
        if header.is_none() && !queues.iter().any(|q| q.dedup().on_message_id()) {
            return None;
        }
        let keys = Keys {
            header,
            message_id: std::cell::OnceCell::new(),
            message,
            codecs,
        };
        let mut targets = Vec::new();
        for (i, q) in queues.iter().enumerate() {
            let d = q.dedup();
            let hash = keys
                .header
                .or_else(|| d.on_message_id().then(|| keys.message_id()).flatten());
            if let Some(hash) = hash {
                targets.push((q.dedup_id(), i, hash));
            }
        }
        if targets.is_empty() {
            return None;
        }
        // One global lock order: two publishes locking the same queues
        // never wait on each other crosswise. A queue listed twice is
        // locked once (its second copy is then a duplicate of the first).
        targets.sort_unstable_by_key(|t| (t.0, t.1));
        let mut check = Check {
            targets: Vec::with_capacity(targets.len()),
            guards: Vec::with_capacity(targets.len()),
        };
        for (id, i, hash) in targets {
            let d = queues[i].dedup();
            if check.guards.last().is_none_or(|(g, _)| *g != id) {
                check.guards.push((id, d.receipts.lock()));
            }
            let guard = check.guards.len() - 1;
            let table = check.guards[guard].1.get_or_insert_with(Box::default);
            let limit = d.limit.load(Ordering::Relaxed);
            let early = table.purge(now, limit);
            if early > 0 {
                d.forgotten.fetch_add(early, Ordering::Relaxed);
            }
            let expires_at = now.saturating_add(d.window_ms()).max(1);
            let duplicate = table.check_insert(hash, now, expires_at);
            if duplicate {
                d.duplicates.fetch_add(1, Ordering::Relaxed);
            } else if table.fifo.len() > limit {
                // At the bound: the oldest goes (never the one just made).
                d.forgotten
                    .fetch_add(table.purge(now, limit), Ordering::Relaxed);
            }
            check.targets.push(Target {
                queue: i,
                guard,
                hash,
                expires_at,
                duplicate,
            });
        }
        Some(check)
    }

    fn target(&self, queue: usize) -> Option<&Target> {
        self.targets.iter().find(|t| t.queue == queue)
    }

    /// Whether the message is a duplicate in `queues[queue]`: it is not
    /// enqueued there.
    pub fn is_duplicate(&self, queue: usize) -> bool {
        self.target(queue).is_some_and(|t| t.duplicate)
    }

    /// Whether the message is a duplicate in some queue.
    pub fn any_duplicate(&self) -> bool {
        self.targets.iter().any(|t| t.duplicate)
    }

    /// The queue did not take the message (refused, deleted): its receipt
    /// goes.
    pub fn undo(&mut self, queue: usize) {
        for t in self.targets.iter_mut().filter(|t| t.queue == queue) {
            if !t.duplicate {
                if let Some(table) = self.guards[t.guard].1.as_mut() {
                    table.undo(t.hash, t.expires_at);
                }
                // Nothing to write to the store for it.
                t.duplicate = true;
            }
        }
    }

    /// Nothing was enqueued anywhere (the store refused the publish): every
    /// receipt it recorded goes.
    pub fn undo_all(&mut self) {
        // Newest first, so each undo finds its entry at the FIFO's back.
        for i in (0..self.targets.len()).rev() {
            let q = self.targets[i].queue;
            self.undo(q);
        }
    }

    /// The store's `ticket` covers this publish's record in `partition` of
    /// `queues[queue]`: a later duplicate there is confirmed after it.
    pub fn note_ticket(&mut self, queue: usize, partition: PartitionId, ticket: Ticket) {
        let Some(guard) = self.target(queue).map(|t| t.guard) else {
            return;
        };
        if let Some(table) = self.guards[guard].1.as_mut() {
            match table.tickets.iter_mut().find(|(p, _)| *p == partition) {
                Some((_, t)) => *t = (*t).max(ticket),
                None => table.tickets.push((partition, ticket)),
            }
        }
    }

    /// For a duplicate in `queues[queue]`: the tickets its original's
    /// confirmation waits for there (per partition of the queue, the latest
    /// keyed publish's).
    pub fn original_tickets(&self, queue: usize) -> Vec<(PartitionId, Ticket)> {
        self.target(queue)
            .and_then(|t| self.guards[t.guard].1.as_ref())
            .map(|table| table.tickets.clone())
            .unwrap_or_default()
    }

    /// The receipt recorded for `queues[queue]`, if one was: (the queue's
    /// store identity, key hash, expiry), to append to the store.
    pub fn receipt(&self, queue: usize) -> Option<(PartitionId, u64, u64)> {
        let t = self.target(queue).filter(|t| !t.duplicate)?;
        Some((self.guards[t.guard].0, t.hash, t.expires_at))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn window_expiry_and_reinsert() {
        let mut r = Receipts::default();
        assert!(!r.check_insert(1, 0, 100));
        assert!(r.check_insert(1, 50, 150), "duplicate within the window");
        assert!(r.check_insert(1, 99, 199));
        assert_eq!(r.purge(100, 10), 0);
        assert!(r.by_key.is_empty(), "expired at its deadline");
        assert!(!r.check_insert(1, 100, 200), "after the window it is new");
        // An expired entry not yet purged does not count, and its stale
        // FIFO entry does not remove the new one.
        assert!(!r.check_insert(2, 100, 150));
        assert!(!r.check_insert(2, 160, 260));
        assert_eq!(r.fifo.len(), 3);
        assert_eq!(r.purge(170, 10), 0);
        assert!(r.check_insert(2, 170, 270), "the fresh receipt is kept");
        assert!(r.check_insert(1, 170, 270));
    }

    #[test]
    fn the_bound_forgets_the_oldest_first() {
        let mut r = Receipts::default();
        for h in 0..10u64 {
            assert!(!r.check_insert(h, 0, 1_000 + h));
        }
        assert_eq!(r.purge(0, 4), 6);
        assert_eq!(r.by_key.len(), 4);
        for h in 0..6u64 {
            assert!(!r.by_key.contains_key(&h), "{h} forgotten");
        }
        for h in 6..10u64 {
            assert!(r.by_key.contains_key(&h), "{h} kept");
        }
    }

    #[test]
    fn undo_removes_only_the_entry_just_made() {
        let mut r = Receipts::default();
        assert!(!r.check_insert(1, 0, 100));
        assert!(!r.check_insert(2, 0, 100));
        r.undo(2, 100);
        assert_eq!(r.fifo.len(), 1);
        assert!(!r.by_key.contains_key(&2));
        assert!(r.check_insert(1, 1, 101));
    }

    #[test]
    fn restore_keeps_the_unexpired_newest_within_the_limit() {
        let d = Dedup::new(false, 1_000);
        d.set_limit(2);
        let rs = |k, e| Receipt {
            key_hash: k,
            expires_at_ms: e,
        };
        d.restore(
            vec![rs(1, 50), rs(2, 300), rs(3, 200), rs(4, 400), rs(5, 500)],
            // 5 was cancelled; 4's cancellation is of an older receipt.
            vec![rs(5, 500), rs(4, 350)],
            100,
        );
        assert!(!d.contains(1, 100), "expired");
        assert!(!d.contains(5, 100), "cancelled");
        assert!(!d.contains(3, 100), "oldest beyond the limit");
        assert!(d.contains(2, 100) && d.contains(4, 100));
        assert_eq!(d.forgotten_early(), 1);
        assert!(!d.contains(2, 300), "expires at its deadline");
    }

    #[test]
    fn key_hash_is_stable() {
        // Stored in the log: must never change.
        assert_eq!(key_hash(b"order-42"), key_hash(b"order-42"));
        assert_ne!(key_hash(b"order-42"), key_hash(b"order-43"));
        // BLAKE2s-256("") = 69217a30 79908094 …, read little-endian.
        assert_eq!(key_hash(b""), 0x9480_9079_307a_2169);
    }
}
