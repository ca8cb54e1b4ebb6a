//! The engine's one timer: which partition needs attention next, and when.
//!
//! A partition with time-driven work (a message expiring, a delayed or
//! retried message falling due, entries waiting to be dead-lettered)
//! schedules itself here with the earliest time it cares about. The
//! engine's timer task (driven by the gateway, which owns the runtime:
//! [`crate::Engine::run_timers`]) sleeps until the earliest entry and then
//! asks each due partition to do its work in one batch. A partition is in
//! the heap at most once per distinct earlier deadline (it remembers what
//! it scheduled), so the heap is bounded by partitions with pending work,
//! not by messages; each partition keeps its own per-message index.

use crate::clock::SharedClock;
use crate::queue::Partition;
use parking_lot::Mutex;
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::{Arc, Weak};
use tokio::sync::Notify;

struct Due {
    at_ms: u64,
    partition: Weak<Partition>,
}

impl PartialEq for Due {
    fn eq(&self, other: &Self) -> bool {
        self.at_ms == other.at_ms
    }
}
impl Eq for Due {}
impl PartialOrd for Due {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Due {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.at_ms.cmp(&other.at_ms)
    }
}

/// Partitions with time-driven work, earliest first, on the engine's clock.
pub struct Timers {
    heap: Mutex<BinaryHeap<Reverse<Due>>>,
    changed: Notify,
    /// The engine's clock: every deadline scheduled here is on it, and the
    /// partitions scheduling here read it.
    clock: SharedClock,
}

impl Timers {
    /// No work scheduled yet; deadlines are on `clock`.
    pub fn new(clock: SharedClock) -> Self {
        Timers {
            heap: Mutex::default(),
            changed: Notify::new(),
            clock,
        }
    }

    /// The clock the deadlines are on.
    pub fn clock(&self) -> &SharedClock {
        &self.clock
    }

    /// Schedules `p` at `at_ms` (ms since epoch; 0 = now). The caller (the
    /// partition) only calls this for a deadline earlier than the one it
    /// scheduled before.
    pub(crate) fn schedule(&self, p: &Arc<Partition>, at_ms: u64) {
        let earliest = {
            let mut h = self.heap.lock();
            let earlier = h.peek().is_none_or(|Reverse(d)| at_ms < d.at_ms);
            h.push(Reverse(Due {
                at_ms,
                partition: Arc::downgrade(p),
            }));
            earlier
        };
        if earliest {
            self.changed.notify_one();
        }
    }

    /// Wakes the timer task for work that is not a deadline (the
    /// definitions feed: [`crate::Engine::run_timers`] applies it).
    pub(crate) fn poke(&self) {
        self.changed.notify_one();
    }

    /// The earliest scheduled time, if any.
    pub fn next_ms(&self) -> Option<u64> {
        self.heap.lock().peek().map(|Reverse(d)| d.at_ms)
    }

    /// Resolves when an earlier deadline was scheduled (the timer task
    /// then re-reads [`Self::next_ms`]).
    pub async fn changed(&self) {
        self.changed.notified().await
    }

    /// Takes every partition due at `now_ms` (live ones, each once).
    pub(crate) fn take_due(&self, now_ms: u64) -> Vec<Arc<Partition>> {
        let mut out: Vec<Arc<Partition>> = Vec::new();
        let mut h = self.heap.lock();
        while h.peek().is_some_and(|Reverse(d)| d.at_ms <= now_ms) {
            let Some(Reverse(d)) = h.pop() else { break };
            if let Some(p) = d.partition.upgrade() {
                if !out.iter().any(|x| Arc::ptr_eq(x, &p)) {
                    out.push(p);
                }
            }
        }
        out
    }
}
