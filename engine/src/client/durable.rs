//! What a client's durability barrier waits for: the store's tickets of
//! its appends since the last barrier.
//!
//! A ticket covers its append and the earlier appends of the same
//! partitions, nothing else (store contract v2). So a barrier keeps, per
//! partition, the latest ticket of the client's appends there (a later
//! one covers the earlier), and waits for all of those: usually one.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use weir_backend::{Op, PartitionId, Store, StoreError, Ticket, Waiter};

/// Partition ids are small, dense numbers: a multiplicative hash is
/// enough, and cheaper than SipHash on every publish.
#[derive(Default)]
pub(crate) struct PartitionHasher(u64);

impl Hasher for PartitionHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(*b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

/// The latest ticket per partition of a client's appends not yet covered
/// by a barrier.
#[derive(Default)]
pub(crate) struct Unconfirmed {
    latest: HashMap<PartitionId, Ticket, BuildHasherDefault<PartitionHasher>>,
    /// The latest metadata and state-store tickets a barrier must cover
    /// (changes made for the client outside it: declares, MQTT session
    /// state, retained messages), each in its own ordering domain.
    side: [Ticket; 2],
    /// The side tickets an earlier barrier covered already.
    side_covered: [Ticket; 2],
}

impl Unconfirmed {
    /// `ticket` covers an append to `partition`.
    pub(crate) fn note(&mut self, partition: PartitionId, ticket: Ticket) {
        if ticket == Ticket::NONE {
            return;
        }
        let e = self.latest.entry(partition).or_default();
        *e = (*e).max(ticket);
    }

    /// The next barrier also covers metadata up to `meta` and the state
    /// store up to `state` (each the latest ticket of its domain).
    pub(crate) fn note_side(&mut self, meta: Ticket, state: Ticket) {
        for (i, t) in [meta, state].into_iter().enumerate() {
            if t > self.side_covered[i] {
                self.side[i] = self.side[i].max(t);
            }
        }
    }

    /// `ticket` covers the append of `ops`.
    pub(crate) fn note_ops(&mut self, ops: &[Op<'_>], ticket: Ticket) {
        // A batch of acks usually names one partition over and over: one
        // map update for the run, not one per settle.
        let mut last = None;
        for op in ops {
            if let Op::Settle { partition, .. } = op {
                if last != Some(*partition) {
                    self.note(*partition, ticket);
                    last = Some(*partition);
                }
                continue;
            }
            match op {
                Op::Publish { partitions, .. } => {
                    partitions.iter().for_each(|p| self.note(*p, ticket))
                }
                Op::Move {
                    partitions, from, ..
                } => {
                    partitions.iter().for_each(|p| self.note(*p, ticket));
                    self.note(*from, ticket);
                }
                Op::Settle { partition, .. }
                | Op::Requeue { partition, .. }
                | Op::Receipt { partition, .. }
                | Op::DropPartition { partition }
                | Op::Truncate { partition, .. } => self.note(*partition, ticket),
                // Metadata and state are waited for where they are written.
                Op::PutMeta { .. }
                | Op::DeleteMeta { .. }
                | Op::MetaBatch { .. }
                | Op::PutState { .. }
                | Op::DeleteState { .. } => {}
            }
        }
    }

    /// Calls `waiter` once every noted ticket is durable (with the first
    /// error, if one was not), and starts over. The store calls a handle's
    /// waiters in the order they were registered, so barriers complete in
    /// the order they were asked for, even one with nothing to wait for.
    pub(crate) fn barrier(&mut self, store: &dyn Store, waiter: Waiter) {
        let side = std::mem::take(&mut self.side);
        for (covered, t) in self.side_covered.iter_mut().zip(side) {
            *covered = (*covered).max(t);
        }
        if self.latest.len() <= 1 && side == [Ticket::NONE; 2] {
            // The usual case, without allocating.
            let t = self.latest.drain().next().map_or(Ticket::NONE, |(_, t)| t);
            store.when_durable(t, waiter);
            return;
        }
        let mut tickets: Vec<Ticket> = self.latest.drain().map(|(_, t)| t).collect();
        tickets.extend(side.into_iter().filter(|t| *t != Ticket::NONE));
        tickets.sort_unstable();
        tickets.dedup();
        match tickets.len() {
            0 => store.when_durable(Ticket::NONE, waiter),
            1 => store.when_durable(tickets[0], waiter),
            n => {
                let all = Arc::new(Countdown {
                    left: AtomicUsize::new(n),
                    failed: parking_lot::Mutex::new(None),
                    waiter: parking_lot::Mutex::new(Some(waiter)),
                });
                for t in tickets {
                    let all = all.clone();
                    store.when_durable(t, Box::new(move |r| all.done(r)));
                }
            }
        }
    }
}

/// One barrier over several tickets.
struct Countdown {
    left: AtomicUsize,
    failed: parking_lot::Mutex<Option<StoreError>>,
    waiter: parking_lot::Mutex<Option<Waiter>>,
}

impl Countdown {
    fn done(&self, r: Result<(), StoreError>) {
        if let Err(e) = r {
            self.failed.lock().get_or_insert(e);
        }
        if self.left.fetch_sub(1, Ordering::AcqRel) == 1 {
            let w = self.waiter.lock().take();
            if let Some(w) = w {
                match self.failed.lock().take() {
                    Some(e) => w(Err(e)),
                    None => w(Ok(())),
                }
            }
        }
    }
}
