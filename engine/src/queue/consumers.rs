//! The consumers of one partition and which of them takes the next message.
//!
//! * Consumer priorities (`x-priority`): a message goes to the
//!   highest-priority consumers that can take it (credit, flow, room on the
//!   way to their connection), round robin among equals; a lower priority
//!   gets messages only while every higher one is blocked. The list is
//!   kept sorted (highest first, registration order within a priority), so
//!   the common case, every consumer at priority 0, is one group and the
//!   same round robin as without priorities.
//! * Single active consumer (`x-single-active-consumer`): the first live
//!   consumer in registration order takes everything; the others are
//!   attached and idle until it goes. Priorities do not reorder it (see
//!   `docs/semantics.md`). A queue attaches a consumer to all its
//!   partitions in one step under its lock, and a dead consumer stays dead,
//!   so every partition of a queue picks the same active consumer.
//!
//! The partition's dispatch loop asks [`ConsumerSet::acquire`] and never
//! changes with the policy.

use crate::consumer::Consumer;
use std::sync::Arc;

/// The consumers of one priority: `list[start..end]` of the set, where
/// `start` is the previous group's `end`.
#[derive(Debug, Clone, Copy)]
struct Group {
    priority: i32,
    end: usize,
    /// Round-robin cursor, relative to the group's start (< its length).
    next: usize,
}

/// A partition's consumers.
#[derive(Default)]
pub(crate) struct ConsumerSet {
    /// Highest priority first, registration order within a priority;
    /// registration order only under single active consumer.
    list: Vec<Arc<Consumer>>,
    /// The priorities present in `list`, in its order (empty when `list`
    /// is; unused under single active consumer).
    groups: Vec<Group>,
    /// `x-single-active-consumer`.
    single_active: bool,
}

impl ConsumerSet {
    /// An empty set; `single_active` for a queue with
    /// `x-single-active-consumer`.
    pub(crate) fn new(single_active: bool) -> Self {
        ConsumerSet {
            single_active,
            ..ConsumerSet::default()
        }
    }

    /// Adds a consumer: after every consumer of its priority or higher
    /// (after every consumer under single active consumer).
    pub(crate) fn add(&mut self, c: Arc<Consumer>) {
        if self.single_active {
            self.list.push(c);
            return;
        }
        let p = c.priority();
        let at = self.list.partition_point(|x| x.priority() >= p);
        self.list.insert(at, c);
        self.rebuild_groups();
    }

    /// Removes a consumer; returns how many remain.
    pub(crate) fn remove(&mut self, c: &Arc<Consumer>) -> usize {
        let before = self.list.len();
        self.list.retain(|x| !Arc::ptr_eq(x, c));
        if self.list.len() != before {
            self.rebuild_groups();
        }
        self.list.len()
    }

    /// The consumers, in offer order.
    pub(crate) fn list(&self) -> &[Arc<Consumer>] {
        &self.list
    }

    /// Consumers attached.
    pub(crate) fn len(&self) -> usize {
        self.list.len()
    }

    /// Whether none is attached.
    #[cfg_attr(not(debug_assertions), allow(dead_code))]
    pub(crate) fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    /// Takes every consumer (the partition is deleted).
    pub(crate) fn take_all(&mut self) -> Vec<Arc<Consumer>> {
        self.groups.clear();
        std::mem::take(&mut self.list)
    }

    /// Drops consumers whose connection or channel went away without
    /// detaching (they raced with a cancel): never offer them anything.
    pub(crate) fn retain_live(&mut self) {
        if self.list.iter().any(|c| c.is_dead()) {
            self.list.retain(|c| !c.is_dead());
            self.rebuild_groups();
        }
    }

    /// The consumer that takes the next message, of `size` bytes, with its
    /// credit already taken; None when no consumer can take it now.
    pub(crate) fn acquire(&mut self, size: u32) -> Option<Arc<Consumer>> {
        if self.single_active {
            // The active one is the first live consumer; while it cannot
            // take the message nobody does.
            let c = self.list.iter().find(|c| !c.is_dead())?;
            return c.try_acquire(size).then(|| c.clone());
        }
        let mut start = 0;
        for g in &mut self.groups {
            let n = g.end - start;
            for _ in 0..n {
                let c = &self.list[start + g.next];
                g.next += 1;
                if g.next == n {
                    g.next = 0;
                }
                if c.try_acquire(size) {
                    return Some(c.clone());
                }
            }
            start = g.end;
        }
        None
    }

    /// Recomputes the groups after `list` changed, keeping each surviving
    /// priority's round-robin cursor (wrapped into its new length).
    fn rebuild_groups(&mut self) {
        if self.single_active {
            return;
        }
        let old = std::mem::take(&mut self.groups);
        let mut start = 0;
        while start < self.list.len() {
            let priority = self.list[start].priority();
            let n = self.list[start..]
                .iter()
                .take_while(|c| c.priority() == priority)
                .count();
            let next = old
                .iter()
                .find(|g| g.priority == priority)
                .map_or(0, |g| g.next % n);
            self.groups.push(Group {
                priority,
                end: start + n,
                next,
            });
            start += n;
        }
        debug_assert!(
            self.groups
                .windows(2)
                .all(|w| w[0].priority > w[1].priority),
            "consumer groups out of priority order"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::consumer::{ConnHandle, Credit};
    use std::sync::atomic::AtomicBool;

    fn consumer(tag: &'static str, priority: i32, prefetch: u32) -> Arc<Consumer> {
        Consumer::new(
            bytes::Bytes::from_static(tag.as_bytes()),
            1,
            false,
            false,
            priority,
            ConnHandle::new(1),
            Credit::new(prefetch, 0),
            None,
            Arc::new(AtomicBool::new(true)),
        )
    }

    fn take(set: &mut ConsumerSet, n: usize) -> Vec<String> {
        (0..n)
            .map(|_| {
                set.acquire(1)
                    .map(|c| String::from_utf8_lossy(c.tag()).into_owned())
                    .unwrap_or_else(|| "-".into())
            })
            .collect()
    }

    #[test]
    fn highest_priority_with_credit_first_round_robin_among_equals() {
        let mut set = ConsumerSet::new(false);
        set.add(consumer("low", 0, 0));
        set.add(consumer("hi-a", 5, 2));
        set.add(consumer("mid", 1, 1));
        set.add(consumer("hi-b", 5, 2));
        // hi-a and hi-b alternate until both are out of credit, then mid
        // (one), then low takes the rest.
        assert_eq!(
            take(&mut set, 7),
            ["hi-a", "hi-b", "hi-a", "hi-b", "mid", "low", "low"]
        );
    }

    #[test]
    fn removing_a_consumer_keeps_the_others_order() {
        let mut set = ConsumerSet::new(false);
        let a = consumer("a", 0, 0);
        set.add(a.clone());
        set.add(consumer("b", 0, 0));
        set.add(consumer("c", 0, 0));
        assert_eq!(take(&mut set, 2), ["a", "b"]);
        assert_eq!(set.remove(&a), 2);
        assert_eq!(take(&mut set, 3), ["b", "c", "b"]);
        let hi = consumer("hi", 3, 0);
        set.add(hi.clone());
        assert_eq!(take(&mut set, 2), ["hi", "hi"]);
        hi.cancel();
        set.retain_live();
        assert_eq!(set.len(), 2);
        assert_eq!(take(&mut set, 2), ["c", "b"]);
    }

    #[test]
    fn single_active_takes_everything_in_registration_order() {
        let mut set = ConsumerSet::new(true);
        let first = consumer("first", 0, 2);
        set.add(first.clone());
        // A higher priority does not take over under single active consumer.
        set.add(consumer("second", 9, 0));
        set.add(consumer("third", 0, 0));
        // The active one out of credit: nobody else takes the message.
        assert_eq!(take(&mut set, 3), ["first", "first", "-"]);
        first.cancel();
        assert_eq!(take(&mut set, 2), ["second", "second"]);
        set.retain_live();
        assert_eq!(set.len(), 2);
    }
}
