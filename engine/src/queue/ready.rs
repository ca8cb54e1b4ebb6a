//! A partition's ready messages: FIFO by `seq` within each priority level,
//! highest level first.
//!
//! A queue without `x-max-priority` has one level. A requeued entry goes
//! back to its place (by `seq`) in its own level. Entries can be removed
//! from the middle (TTL expiry) in O(log n): the entry is swapped for a
//! tombstone that keeps its `seq`, skipped at the front, and shed in one
//! pass once tombstones outnumber a level's live entries, so removal never
//! scans per message and a level's memory stays within twice its live
//! entries.

use crate::message::Entry;
use std::collections::VecDeque;
use std::sync::Arc;
use weir_quota::TenantQuota;

/// Tombstones a level tolerates before it is compacted, beyond half its
/// live entries (avoids compacting tiny levels over and over).
const TOMBSTONE_SLACK: usize = 64;

#[derive(Default)]
struct Level {
    q: VecDeque<Entry>,
    /// Tombstones in `q`; never at its front.
    dead: usize,
}

impl Level {
    fn live(&self) -> usize {
        self.q.len() - self.dead
    }

    /// Drops tombstones from the front so `front()` is live.
    fn trim_front(&mut self) {
        while self.q.front().is_some_and(|e| e.is_tombstone()) {
            self.q.pop_front();
            self.dead -= 1;
        }
    }

    fn find(&self, seq: u64) -> Option<usize> {
        let i = self.q.partition_point(|x| x.seq < seq);
        (self.q.get(i)?.seq == seq).then_some(i)
    }
}

/// The ready list of one partition.
pub(crate) struct ReadyList {
    /// One per priority level, lowest first.
    levels: Vec<Level>,
    len: usize,
    bytes: u64,
    /// Live entries by delivery attempts so far, one count per bucket of
    /// [`crate::stats::ATTEMPT_BUCKETS`] (kept with `len`, so reading it
    /// costs no walk).
    attempts: [u64; crate::stats::ATTEMPT_BUCKETS.len()],
    /// Bytes of live entries whose message is only in the store (not in
    /// memory): `bytes` less these is the list's share of its tenant's
    /// memory (`max-memory`).
    paged: u64,
    /// The tenant's counters of queued messages, bytes and paged bytes,
    /// kept in step with `len`, `bytes` and `paged` (one atomic add per
    /// change; none for `paged` while messages are in memory).
    quota: Option<Arc<TenantQuota>>,
}

impl Drop for ReadyList {
    fn drop(&mut self) {
        // A deleted queue (or one dropped at shutdown) gives its count back.
        if let Some(q) = &self.quota {
            q.unpaged(self.paged);
            q.dequeued(self.len as u64, self.bytes);
        }
    }
}

impl ReadyList {
    /// An empty list with `max_priority + 1` levels.
    #[cfg(test)]
    pub(crate) fn new(max_priority: u8) -> Self {
        Self::counted(max_priority, None)
    }

    /// An empty list whose entries count towards a tenant's `quota`.
    pub(crate) fn counted(max_priority: u8, quota: Option<Arc<TenantQuota>>) -> Self {
        ReadyList {
            levels: (0..=max_priority).map(|_| Level::default()).collect(),
            len: 0,
            bytes: 0,
            attempts: Default::default(),
            paged: 0,
            quota,
        }
    }

    fn added(&mut self, size: u32, attempts: u16, in_memory: bool) {
        self.attempts[crate::stats::attempt_bucket(attempts)] += 1;
        self.len += 1;
        self.bytes += u64::from(size);
        if !in_memory {
            self.paged += u64::from(size);
        }
        if let Some(q) = &self.quota {
            if !in_memory {
                q.paged(u64::from(size));
            }
            q.queued(1, u64::from(size));
        }
    }

    fn removed(&mut self, size: u32, attempts: u16, in_memory: bool) {
        self.attempts[crate::stats::attempt_bucket(attempts)] -= 1;
        self.len -= 1;
        self.bytes -= u64::from(size);
        if !in_memory {
            self.paged -= u64::from(size);
        }
        if let Some(q) = &self.quota {
            if !in_memory {
                q.unpaged(u64::from(size));
            }
            q.dequeued(1, u64::from(size));
        }
    }

    /// Highest priority level (0 for a plain queue).
    pub(crate) fn max_priority(&self) -> u8 {
        (self.levels.len() - 1) as u8
    }

    /// The level an entry of priority `p` belongs to (priorities above the
    /// queue's maximum count as the maximum, as in RabbitMQ).
    pub(crate) fn level_of(&self, p: u8) -> u8 {
        p.min(self.max_priority())
    }

    /// Live entries.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Whether no live entry is ready.
    #[cfg_attr(not(debug_assertions), allow(dead_code))]
    pub(crate) fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes of live entries.
    pub(crate) fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Live entries by delivery attempts (see [`crate::stats::ATTEMPT_BUCKETS`]).
    pub(crate) fn attempts(&self) -> [u64; crate::stats::ATTEMPT_BUCKETS.len()] {
        self.attempts
    }

    /// Appends a new entry at the tail of its level. Its `seq` must be
    /// larger than any in the list.
    pub(crate) fn push_back(&mut self, mut e: Entry) {
        debug_assert!(!e.is_tombstone());
        e.priority = self.level_of(e.priority);
        let level = &mut self.levels[e.priority as usize];
        debug_assert!(level.q.back().is_none_or(|x| x.seq < e.seq));
        let (size, attempts, in_memory) = (e.size, e.attempts, e.message.is_some());
        level.q.push_back(e);
        self.added(size, attempts, in_memory);
    }

    /// Puts an entry back at its place (by `seq`) in its level.
    pub(crate) fn put_back(&mut self, mut e: Entry) {
        debug_assert!(!e.is_tombstone());
        e.priority = self.level_of(e.priority);
        let level = &mut self.levels[e.priority as usize];
        // Requeues usually go back to the front; search from there.
        let pos = level.q.partition_point(|x| x.seq < e.seq);
        debug_assert!(
            level.q.get(pos).is_none_or(|x| x.seq != e.seq),
            "entry requeued twice"
        );
        let (size, attempts, in_memory) = (e.size, e.attempts, e.message.is_some());
        level.q.insert(pos, e);
        self.added(size, attempts, in_memory);
    }

    /// The next entry to deliver: the oldest of the highest non-empty level.
    pub(crate) fn front(&self) -> Option<&Entry> {
        self.levels.iter().rev().find_map(|l| l.q.front())
    }

    /// Takes the next entry to deliver.
    pub(crate) fn pop_front(&mut self) -> Option<Entry> {
        let level = self.levels.iter_mut().rev().find(|l| !l.q.is_empty())?;
        let e = level.q.pop_front()?;
        debug_assert!(!e.is_tombstone(), "a tombstone at the front of a level");
        level.trim_front();
        self.removed(e.size, e.attempts, e.message.is_some());
        Some(e)
    }

    /// Removes the live entry with `seq` at priority level `priority`, if
    /// it is ready.
    #[cfg(test)]
    pub(crate) fn remove(&mut self, seq: u64, priority: u8) -> Option<Entry> {
        self.remove_if(seq, priority, |_| true)
    }

    /// Removes the live entry with `seq` at level `priority` if it is ready
    /// and `pred` holds for it.
    pub(crate) fn remove_if(
        &mut self,
        seq: u64,
        priority: u8,
        pred: impl FnOnce(&Entry) -> bool,
    ) -> Option<Entry> {
        let at = self.level_of(priority) as usize;
        let level = &mut self.levels[at];
        let i = level.find(seq)?;
        if level.q[i].is_tombstone() || !pred(&level.q[i]) {
            return None;
        }
        let tomb = Entry {
            seq,
            id: Entry::TOMBSTONE_ID,
            location: None,
            size: 0,
            redelivered: false,
            attempts: 0,
            priority: 0,
            enqueued_ms: 0,
            expires_at_ms: 0,
            message: None,
        };
        let e = std::mem::replace(&mut level.q[i], tomb);
        level.dead += 1;
        level.trim_front();
        if level.dead > level.live() / 2 + TOMBSTONE_SLACK {
            level.q.retain(|e| !e.is_tombstone());
            level.dead = 0;
        }
        self.removed(e.size, e.attempts, e.message.is_some());
        Some(e)
    }

    /// Takes every live entry, highest level first (purge, delete).
    pub(crate) fn drain(&mut self) -> Vec<Entry> {
        let mut out = Vec::with_capacity(self.len);
        for l in self.levels.iter_mut().rev() {
            out.extend(l.q.drain(..).filter(|e| !e.is_tombstone()));
            l.dead = 0;
        }
        if let Some(q) = &self.quota {
            q.unpaged(self.paged);
            q.dequeued(self.len as u64, self.bytes);
        }
        self.len = 0;
        self.bytes = 0;
        self.attempts = Default::default();
        self.paged = 0;
        out
    }

    /// Every live entry, lowest level first, each level in `seq` order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &Entry> {
        self.levels
            .iter()
            .flat_map(|l| l.q.iter())
            .filter(|e| !e.is_tombstone())
    }

    /// Every live entry, mutably (compaction rewrites locations).
    pub(crate) fn iter_mut(&mut self) -> impl Iterator<Item = &mut Entry> {
        self.levels
            .iter_mut()
            .flat_map(|l| l.q.iter_mut())
            .filter(|e| !e.is_tombstone())
    }

    /// Slots in use, tombstones included (what the list costs in memory).
    #[cfg_attr(not(debug_assertions), allow(dead_code))]
    pub(crate) fn total_slots(&self) -> usize {
        self.levels.iter().map(|l| l.q.len()).sum()
    }

    /// Checks counters and order (debug builds; walks the list).
    #[cfg(debug_assertions)]
    pub(crate) fn check(&self) -> Result<(), String> {
        let mut len = 0;
        let mut bytes = 0u64;
        for (p, l) in self.levels.iter().enumerate() {
            let mut prev: Option<u64> = None;
            let mut dead = 0;
            if l.q.front().is_some_and(|e| e.is_tombstone()) {
                return Err(format!("level {p}: a tombstone at the front"));
            }
            for e in &l.q {
                if prev.is_some_and(|s| s >= e.seq) {
                    return Err(format!("level {p}: out of seq order"));
                }
                prev = Some(e.seq);
                if e.is_tombstone() {
                    dead += 1;
                    continue;
                }
                if e.priority as usize != p {
                    return Err(format!("level {p}: holds an entry of level {}", e.priority));
                }
                len += 1;
                bytes += u64::from(e.size);
            }
            if dead != l.dead {
                return Err(format!("level {p}: {dead} tombstones, counted {}", l.dead));
            }
        }
        if len != self.len || bytes != self.bytes {
            return Err(format!(
                "{len} entries / {bytes} bytes, counted {} / {}",
                self.len, self.bytes
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn e(seq: u64, priority: u8) -> Entry {
        Entry {
            seq,
            id: seq,
            location: None,
            size: 10,
            redelivered: false,
            attempts: 0,
            priority,
            enqueued_ms: 0,
            expires_at_ms: 0,
            message: None,
        }
    }

    fn order(r: &mut ReadyList) -> Vec<u64> {
        std::iter::from_fn(|| r.pop_front().map(|e| e.seq)).collect()
    }

    #[test]
    fn strict_priority_fifo_within_a_level_and_requeue_to_place() {
        let mut r = ReadyList::new(9);
        for (seq, p) in [(1, 0), (2, 5), (3, 5), (4, 200), (5, 0)] {
            r.push_back(e(seq, p));
        }
        // 200 counts as the maximum, 9.
        let first = r.pop_front().expect("one");
        assert_eq!((first.seq, first.priority), (4, 9));
        let second = r.pop_front().expect("two");
        assert_eq!(second.seq, 2);
        r.put_back(second);
        r.put_back(first);
        assert_eq!(order(&mut r), vec![4, 2, 3, 1, 5]);
        r.check().expect("consistent");
    }

    #[test]
    fn removal_from_the_middle_leaves_tombstones_that_are_shed() {
        let mut r = ReadyList::new(0);
        for seq in 0..1000 {
            r.push_back(e(seq, 0));
        }
        for seq in (0..1000).filter(|s| s % 3 != 0) {
            assert_eq!(r.remove(seq, 0).map(|e| e.seq), Some(seq));
        }
        assert!(r.remove(1, 0).is_none(), "removed twice");
        r.check().expect("consistent");
        assert_eq!(r.len(), 334);
        assert!(r.total_slots() < 334 * 2 + TOMBSTONE_SLACK);
        let left = order(&mut r);
        assert_eq!(left, (0..1000).filter(|s| s % 3 == 0).collect::<Vec<_>>());
        assert_eq!(r.total_slots(), 0);
    }
}
