//! Fair shares of the writer between share tags (tenants, to the engine).
//!
//! A commit round writes and syncs everything appended before it was taken,
//! in log order: positions are assigned at append time, and durability is a
//! prefix of the log. So a record cannot skip ahead of a backlog appended
//! before it, and a flooding tag would make every round large and every
//! other tag's confirm wait behind its data. Fairness is therefore decided
//! at admission: [`Shares`] counts, per tag, the bytes appended and not yet
//! written (pending, then in the round being written). When more than
//! [`ROUND_BUDGET`] bytes wait and several tags have some, a tag above
//! an equal share of the budget is told so ([`Admission::over_share`]); its
//! producer waits for its appends to be durable before appending more. The
//! other tags' next appends then ride in the next round behind at most
//! about a budget of its data. A tag stays counted for a few rounds after
//! its last append, so a steady publisher's next record is protected too.
//!
//! A single tag is never held back (the single-tenant hot path stays as
//! it was), and [`ShareTag::BROKER`] (the broker's own work) is neither held
//! back nor counted.

use crate::{Admission, ShareTag};
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// Share tags are small numbers the caller picks: a multiplicative hash is
/// enough, and cheaper than SipHash on every append.
#[derive(Default)]
struct TagHasher(u64);

impl Hasher for TagHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8 | u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }

    fn write_u32(&mut self, n: u32) {
        self.0 = u64::from(n).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

/// Bytes waiting for the writer above which tags are held to their
/// shares. A round this size is written in well under a millisecond; the
/// fsync dominates. Large enough that a busy tag's confirms still
/// pipeline several batches per round.
pub(crate) const ROUND_BUDGET: u64 = 256 << 10;

/// A tag counts as sharing the writer for this many rounds after its
/// last append: a steady publisher (one confirm per millisecond, say) has
/// nothing waiting between its appends, yet a flood must not build up a
/// backlog in front of its next one.
const PRESENT_ROUNDS: u64 = 64;

/// Bytes one tag has waiting for the writer.
#[derive(Default)]
struct Waiting {
    /// In `pending`.
    pending: u64,
    /// In the round being written.
    round: u64,
    /// The round its last append went to.
    seen: u64,
}

/// Per-tag bytes waiting for the writer.
#[derive(Default)]
pub(crate) struct Shares {
    /// Shares that appended within [`PRESENT_ROUNDS`]: its length is the
    /// number of tags sharing the writer.
    waiting: HashMap<ShareTag, Waiting, BuildHasherDefault<TagHasher>>,
    /// Bytes waiting, all tags.
    total: u64,
    /// Rounds taken so far.
    round: u64,
}

impl Shares {
    /// `bytes` were appended for `tag`. Returns what the tag is told.
    pub(crate) fn appended(&mut self, tag: ShareTag, bytes: u64) -> Admission {
        if tag == ShareTag::BROKER || bytes == 0 {
            return Admission::default();
        }
        let e = self.waiting.entry(tag).or_default();
        e.pending += bytes;
        e.seen = self.round;
        let mine = e.pending + e.round;
        self.total += bytes;
        let owners = self.waiting.len() as u64;
        Admission {
            over_share: owners > 1 && self.total > ROUND_BUDGET && mine > ROUND_BUDGET / owners,
        }
    }

    /// The writer took everything pending into a round.
    pub(crate) fn take_round(&mut self) {
        self.round += 1;
        for e in self.waiting.values_mut() {
            e.round += std::mem::take(&mut e.pending);
        }
    }

    /// The round taken last is in the kernel (or failed): its bytes no
    /// longer wait. Tags quiet for [`PRESENT_ROUNDS`] stop sharing.
    pub(crate) fn round_done(&mut self) {
        let mut total = 0;
        let round = self.round;
        self.waiting.retain(|_, e| {
            e.round = 0;
            total += e.pending;
            e.pending > 0 || e.seen + PRESENT_ROUNDS > round
        });
        self.total = total;
    }

    /// Bytes of `tag` waiting for the writer.
    #[cfg(test)]
    pub(crate) fn waiting(&self, tag: ShareTag) -> u64 {
        self.waiting.get(&tag).map_or(0, |e| e.pending + e.round)
    }

    /// Tags sharing the writer.
    #[cfg(test)]
    pub(crate) fn present(&self) -> usize {
        self.waiting.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_owner_is_never_held_back() {
        let mut o = Shares::default();
        for _ in 0..100 {
            assert!(!o.appended(ShareTag(1), ROUND_BUDGET).over_share);
        }
        // The broker's own work does not make a second owner.
        assert!(!o.appended(ShareTag::BROKER, 1).over_share);
        assert!(!o.appended(ShareTag(1), 1).over_share);
    }

    #[test]
    fn a_flooding_owner_is_over_its_share_and_a_quiet_one_is_not() {
        let mut o = Shares::default();
        assert!(!o.appended(ShareTag(1), ROUND_BUDGET).over_share);
        assert!(!o.appended(ShareTag(2), 100).over_share);
        assert!(o.appended(ShareTag(1), 1).over_share);
        assert!(!o.appended(ShareTag(2), 100).over_share);
        // Taken into a round, the flood still waits for the writer.
        o.take_round();
        assert!(o.appended(ShareTag(1), 1).over_share);
        // Written: nothing waits but what came after.
        o.round_done();
        assert_eq!(o.waiting(ShareTag(1)), 1);
        assert_eq!(o.waiting(ShareTag(2)), 0);
        assert!(!o.appended(ShareTag(1), ROUND_BUDGET / 2).over_share);
        // A steady owner stays present between its appends; gone quiet, it
        // no longer shares the writer.
        for _ in 0..PRESENT_ROUNDS {
            o.take_round();
            o.round_done();
        }
        assert_eq!(o.present(), 0);
        assert!(!o.appended(ShareTag(1), 2 * ROUND_BUDGET).over_share);
    }
}
