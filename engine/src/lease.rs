//! Leases: delivered, unsettled messages, held by the engine client that
//! received them until the client settles or returns them.

use crate::consumer::Consumer;
use crate::message::Entry;
use crate::queue::Partition;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

/// How a lease is settled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Settle {
    /// Processed: removed from its queue (and from the store).
    Ack,
    /// Back to its queue at its original place, marked redelivered.
    Requeue,
    /// Removed without processing (reject/nack without requeue; a
    /// dead-letter exchange will take it here later).
    Drop,
}

/// One delivered, unsettled message.
pub(crate) struct Lease {
    /// The partition it came from.
    pub(crate) partition: Arc<Partition>,
    /// The consumer whose credit it holds (None for a get).
    pub(crate) consumer: Option<Arc<Consumer>>,
    /// The entry; a stored entry's copy drops its body once written (a
    /// requeue reads it back), and its location may be stale: the
    /// partition knows where compaction moved it.
    pub(crate) entry: Entry,
    /// When it was written to the client: a lease older than the consumer
    /// timeout closes its scope.
    pub(crate) since: Instant,
}

/// The leases of one scope, by delivery tag. Tags increase in delivery
/// order (asserted), so the first lease is the oldest.
#[derive(Default)]
pub(crate) struct Leases {
    by_tag: BTreeMap<u64, Lease>,
}

impl Leases {
    /// Records a lease under a tag greater than every earlier one.
    pub(crate) fn insert(&mut self, tag: u64, lease: Lease) {
        debug_assert!(
            self.by_tag.last_key_value().is_none_or(|(t, _)| *t < tag),
            "delivery tags must increase within a scope"
        );
        self.by_tag.insert(tag, lease);
    }

    /// Removes exactly `tag`.
    pub(crate) fn remove(&mut self, tag: u64) -> Option<Lease> {
        self.by_tag.remove(&tag)
    }

    /// Removes every lease up to and including `tag` (0 = all). As in
    /// RabbitMQ, `tag` itself must be outstanding unless it is 0; `None`
    /// otherwise.
    pub(crate) fn take_up_to(&mut self, tag: u64) -> Option<Vec<Lease>> {
        if tag == 0 {
            return Some(self.take_all());
        }
        if !self.by_tag.contains_key(&tag) {
            return None;
        }
        let rest = self.by_tag.split_off(&(tag + 1));
        let taken = std::mem::replace(&mut self.by_tag, rest);
        Some(taken.into_values().collect())
    }

    /// Appends the outstanding tags up to and including `tag` (0 = all) to
    /// `out`, in order.
    pub(crate) fn tags_up_to(&self, tag: u64, out: &mut Vec<u64>) {
        let end = if tag == 0 { u64::MAX } else { tag };
        out.extend(self.by_tag.range(..=end).map(|(t, _)| *t));
    }

    /// Whether `tag` is outstanding.
    pub(crate) fn contains(&self, tag: u64) -> bool {
        self.by_tag.contains_key(&tag)
    }

    /// Removes every lease.
    pub(crate) fn take_all(&mut self) -> Vec<Lease> {
        std::mem::take(&mut self.by_tag).into_values().collect()
    }

    /// When the oldest lease was written.
    pub(crate) fn oldest(&self) -> Option<Instant> {
        self.by_tag.first_key_value().map(|(_, l)| l.since)
    }

    /// Number of leases.
    pub(crate) fn len(&self) -> usize {
        self.by_tag.len()
    }
}
