//! The consumers of one partition and which of them takes the next message.
//!
//! Today: round robin over the consumers that have credit. Single active
//! consumer and consumer priorities choose here too, so the partition's
//! dispatch loop never changes with the policy.

use crate::consumer::Consumer;
use std::sync::Arc;

/// A partition's consumers, in registration order.
#[derive(Default)]
pub(crate) struct ConsumerSet {
    list: Vec<Arc<Consumer>>,
    /// Round-robin cursor into `list`.
    next: usize,
}

impl ConsumerSet {
    /// Adds a consumer (last in registration order).
    pub(crate) fn add(&mut self, c: Arc<Consumer>) {
        self.list.push(c);
    }

    /// Removes a consumer; returns how many remain.
    pub(crate) fn remove(&mut self, c: &Arc<Consumer>) -> usize {
        self.list.retain(|x| !Arc::ptr_eq(x, c));
        self.list.len()
    }

    /// Consumers attached.
    pub(crate) fn len(&self) -> usize {
        self.list.len()
    }

    /// Whether none is attached.
    pub(crate) fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    /// Takes every consumer (the partition is deleted).
    pub(crate) fn take_all(&mut self) -> Vec<Arc<Consumer>> {
        self.next = 0;
        std::mem::take(&mut self.list)
    }

    /// Drops consumers whose connection or channel went away without
    /// detaching (they raced with a cancel): never offer them anything.
    pub(crate) fn retain_live(&mut self) {
        if self.list.iter().any(|c| c.is_dead()) {
            self.list.retain(|c| !c.is_dead());
            self.next = 0;
        }
    }

    /// The consumer that takes the next message, of `size` bytes, with its
    /// credit already taken; None when no consumer can take it now.
    pub(crate) fn acquire(&mut self, size: u32) -> Option<Arc<Consumer>> {
        let n = self.list.len();
        for _ in 0..n {
            let i = self.next % n;
            self.next = (i + 1) % n;
            let c = &self.list[i];
            if c.try_acquire(size) {
                return Some(c.clone());
            }
        }
        None
    }
}
