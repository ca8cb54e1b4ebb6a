//! Fair shares of the writer between owners (tenants, to the engine).
//!
//! A commit round writes and syncs everything appended before it was taken,
//! in log order: positions are assigned at append time, and durability is a
//! prefix of the log. So a record cannot skip ahead of a backlog appended
//! before it, and a flooding owner would make every round large and every
//! other owner's confirm wait behind its data. Fairness is therefore decided
//! at admission: [`Owners`] counts, per owner, the bytes appended and not yet
//! written (pending, then in the round being written). When more than
//! [`ROUND_BUDGET`] bytes wait and several owners have some, an owner above
//! an equal share of the budget is told so ([`Admission::over_share`]); its
//! producer waits for its appends to be durable before appending more. The
//! other owners' next appends then ride in the next round behind at most
//! about a budget of its data. An owner stays counted for a few rounds after
//! its last append, so a steady publisher's next record is protected too.
//!
//! A single owner is never held back (the single-tenant hot path stays as
//! it was), and [`Owner::SHARED`] (the broker's own work) is neither held
//! back nor counted.

use crate::{Admission, Owner};
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// Owners are small numbers the caller picks: a multiplicative hash is
/// enough, and cheaper than SipHash on every append.
#[derive(Default)]
struct OwnerHasher(u64);

impl Hasher for OwnerHasher {
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

/// Bytes waiting for the writer above which owners are held to their
/// shares. A round this size is written in well under a millisecond; the
/// fsync dominates. Large enough that a busy owner's confirms still
/// pipeline several batches per round.
pub(crate) const ROUND_BUDGET: u64 = 256 << 10;

/// An owner counts as sharing the writer for this many rounds after its
/// last append: a steady publisher (one confirm per millisecond, say) has
/// nothing waiting between its appends, yet a flood must not build up a
/// backlog in front of its next one.
const PRESENT_ROUNDS: u64 = 64;

/// Bytes one owner has waiting for the writer.
#[derive(Default)]
struct Waiting {
    /// In `pending`.
    pending: u64,
    /// In the round being written.
    round: u64,
    /// The round its last append went to.
    seen: u64,
}

/// Per-owner bytes waiting for the writer.
#[derive(Default)]
pub(crate) struct Owners {
    /// Owners that appended within [`PRESENT_ROUNDS`]: its length is the
    /// number of owners sharing the writer.
    waiting: HashMap<Owner, Waiting, BuildHasherDefault<OwnerHasher>>,
    /// Bytes waiting, all owners.
    total: u64,
    /// Rounds taken so far.
    round: u64,
}

impl Owners {
    /// `bytes` were appended for `owner`. Returns what the owner is told.
    pub(crate) fn appended(&mut self, owner: Owner, bytes: u64) -> Admission {
        if owner == Owner::SHARED || bytes == 0 {
            return Admission::default();
        }
        let e = self.waiting.entry(owner).or_default();
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
    /// longer wait. Owners quiet for [`PRESENT_ROUNDS`] stop sharing.
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

    /// Bytes of `owner` waiting for the writer.
    #[cfg(test)]
    pub(crate) fn waiting(&self, owner: Owner) -> u64 {
        self.waiting.get(&owner).map_or(0, |e| e.pending + e.round)
    }

    /// Owners sharing the writer.
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
        let mut o = Owners::default();
        for _ in 0..100 {
            assert!(!o.appended(Owner(1), ROUND_BUDGET).over_share);
        }
        // The broker's own work does not make a second owner.
        assert!(!o.appended(Owner::SHARED, 1).over_share);
        assert!(!o.appended(Owner(1), 1).over_share);
    }

    #[test]
    fn a_flooding_owner_is_over_its_share_and_a_quiet_one_is_not() {
        let mut o = Owners::default();
        assert!(!o.appended(Owner(1), ROUND_BUDGET).over_share);
        assert!(!o.appended(Owner(2), 100).over_share);
        assert!(o.appended(Owner(1), 1).over_share);
        assert!(!o.appended(Owner(2), 100).over_share);
        // Taken into a round, the flood still waits for the writer.
        o.take_round();
        assert!(o.appended(Owner(1), 1).over_share);
        // Written: nothing waits but what came after.
        o.round_done();
        assert_eq!(o.waiting(Owner(1)), 1);
        assert_eq!(o.waiting(Owner(2)), 0);
        assert!(!o.appended(Owner(1), ROUND_BUDGET / 2).over_share);
        // A steady owner stays present between its appends; gone quiet, it
        // no longer shares the writer.
        for _ in 0..PRESENT_ROUNDS {
            o.take_round();
            o.round_done();
        }
        assert_eq!(o.present(), 0);
        assert!(!o.appended(Owner(1), 2 * ROUND_BUDGET).over_share);
    }
}
