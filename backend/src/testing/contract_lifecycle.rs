//! The store contract's rules for the life of partitions and for the state
//! store (contract v2): [`Op::DropPartition`] and [`Op::Truncate`] are one
//! small record each, are honoured by recovery and give their space back;
//! a settle of a message a drop or truncation took is a no-op; the state
//! store ([`Op::PutState`], [`Store::scan_state`]) keeps a version per key,
//! scans by prefix and survives restarts and reclamation; a [`crate::Spill`]
//! is readable, gives its space back when released, keeps its copies
//! spilled through compaction, and is never recovered.
//!
//! [`run_all`] is called by [`super::contract::run_all`], so every store
//! that passes the contract passes these. The tests at the bottom keep one
//! deliberately wrong store per rule and show that the rule fails it.

use super::contract::Harness;
use crate::{
    LiveSet, Location, MessageAttrs, MessageData, MessageId, Op, PartitionId, Relocation,
    StateEntry, Store,
};
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::sync::Arc;

/// Runs every rule of this file.
pub fn run_all(h: &mut dyn Harness) {
    drop_partition_is_one_record_and_frees_space(h);
    settle_after_drop_is_a_no_op(h);
    truncate_keeps_the_rest_and_frees_space(h);
    state_keys_have_their_own_versions_and_survive_restart(h);
    state_scan_is_by_prefix(h);
    state_survives_reclamation(h);
    spill_is_released_and_never_recovered(h);
}

const P1: PartitionId = PartitionId(11);
const P2: PartitionId = PartitionId(12);
const P3: PartitionId = PartitionId(13);

/// Bodies of a few hundred bytes: the log store's contract runs use 4 KiB
/// segments, so a few hundred messages span dozens of them.
const BODY: [u8; 200] = [7; 200];

fn data(body: &[u8]) -> MessageData<'_> {
    MessageData {
        exchange: "ex",
        routing_key: "rk",
        header_format: 2,
        header: b"hdr",
        body,
        attrs: MessageAttrs::default(),
    }
}

/// Appends and waits until its ticket is durable. An empty batch covers
/// nothing: it gives the store's background work a round instead
/// ([`super::contract::nudge`]; the log store reclaims after a round).
fn append_wait(store: &dyn Store, ops: &[Op<'_>]) -> Vec<Location> {
    if ops.is_empty() {
        super::contract::nudge(store);
        return Vec::new();
    }
    let mut locs = Vec::new();
    let ticket = store.append(ops, &mut locs).expect("append");
    super::contract::wait_durable(store, ticket);
    locs
}

/// Publishes `n` messages with `body` to `parts`, 50 per append; returns
/// their ids and locations in order.
fn fill(
    store: &dyn Store,
    parts: &[PartitionId],
    n: usize,
    body: &[u8],
) -> Vec<(MessageId, Location)> {
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        let k = (n - out.len()).min(50);
        let first = store.allocate_ids(k as u64);
        let ops: Vec<Op<'_>> = (0..k as u64)
            .map(|i| Op::Publish {
                id: first + i,
                partitions: parts,
                data: data(body),
            })
            .collect();
        let locs = append_wait(store, &ops);
        assert_eq!(locs.len(), k);
        out.extend((0..k as u64).map(|i| first + i).zip(locs));
    }
    out
}

/// Traffic that comes and goes: `n` messages published to `P3` and settled,
/// so that the log rolls over segments that nothing keeps.
fn churn(store: &dyn Store, n: usize) {
    let msgs = fill(store, &[P3], n, &BODY);
    let settles: Vec<Op<'_>> = msgs
        .iter()
        .map(|&(id, location)| Op::Settle {
            partition: P3,
            id,
            location,
        })
        .collect();
    append_wait(store, &settles);
}

/// What a caller still holds, for compaction.
#[derive(Default)]
struct Held {
    live: RefCell<BTreeMap<(PartitionId, MessageId), Location>>,
}

impl Held {
    fn insert(&self, p: PartitionId, id: MessageId, loc: Location) {
        self.live.borrow_mut().insert((p, id), loc);
    }

    /// The ids held in `p`, in order.
    fn ids(&self, p: PartitionId) -> Vec<MessageId> {
        self.live
            .borrow()
            .keys()
            .filter(|(q, _)| *q == p)
            .map(|(_, id)| *id)
            .collect()
    }

    /// Every held message reads back where it is held now.
    fn check_readable(&self, store: &dyn Store) {
        for (&(_, id), &loc) in self.live.borrow().iter() {
            let m = store
                .read(loc)
                .unwrap_or_else(|e| panic!("held message {id} at {loc:?}: {e}"));
            assert_eq!(m.id, id, "read {loc:?}");
        }
    }

    /// After a restart: the positions recovery reports.
    fn take_recovered(&self, store: &dyn Store, parts: &[PartitionId]) {
        let mut live = self.live.borrow_mut();
        for &p in parts {
            for m in store.recover_partition(p).expect("recover") {
                live.insert((p, m.id), m.location);
            }
        }
    }
}

impl LiveSet for Held {
    fn for_each_live(&self, visit: &mut dyn FnMut(PartitionId, MessageId, Location)) {
        for (&(p, id), &loc) in self.live.borrow().iter() {
            visit(p, id, loc);
        }
    }

    fn relocate(&self, moves: &[Relocation]) -> Vec<bool> {
        let mut live = self.live.borrow_mut();
        moves
            .iter()
            .map(|m| match live.get_mut(&(m.partition, m.id)) {
                Some(loc) if *loc == m.old => {
                    *loc = m.new;
                    true
                }
                _ => false,
            })
            .collect()
    }
}

/// Lets the store give back what it can: compaction until it moves
/// nothing, and two durable rounds after it (the log store reclaims
/// segments after a round's waiters; the second round starts once that is
/// done).
fn reclaim(store: &dyn Store, held: &Held) {
    for _ in 0..64 {
        let moved = store.compact(held).expect("compact");
        append_wait(store, &[]);
        if moved == 0 {
            break;
        }
    }
    append_wait(store, &[]);
    append_wait(store, &[]);
}

fn recovered_ids(store: &dyn Store, p: PartitionId) -> Vec<MessageId> {
    store
        .recover_partition(p)
        .expect("recover")
        .into_iter()
        .map(|m| m.id)
        .collect()
}

/// Restarts when the harness can.
fn restart(h: &mut dyn Harness, store: Arc<dyn Store>) -> Result<Arc<dyn Store>, Arc<dyn Store>> {
    if h.persists() {
        Ok(h.reopen(store))
    } else {
        Err(store)
    }
}

/// A drop of a partition of 400 messages is one small append whatever
/// their number; recovery reports none of them (before or after the space
/// was reclaimed), keeps what other partitions hold and what the partition
/// got after the drop; and the store gives the space back.
pub fn drop_partition_is_one_record_and_frees_space(h: &mut dyn Harness) {
    for restart_first in [false, true] {
        if restart_first && !h.persists() {
            continue;
        }
        let store = h.create();
        let held = Held::default();
        // P1 fills many segments; P2 keeps one message in 20 among them,
        // and one message is in both.
        for _ in 0..20 {
            fill(&*store, &[P1], 19, &BODY);
            let (id, loc) = fill(&*store, &[P2], 1, b"keep")[0];
            held.insert(P2, id, loc);
        }
        let (both, both_loc) = fill(&*store, &[P1, P2], 1, b"both")[0];
        held.insert(P2, both, both_loc);
        let filled = store.stats().disk_bytes;
        let appended = store.stats().appended_bytes;
        append_wait(&*store, &[Op::DropPartition { partition: P1 }]);
        let cost = store.stats().appended_bytes - appended;
        assert!(
            cost <= 64,
            "dropping a partition of 381 messages appended {cost} bytes: it must be one small record"
        );
        // Published after the drop: not affected by it.
        let (late, late_loc) = fill(&*store, &[P1], 1, b"late")[0];
        held.insert(P1, late, late_loc);
        let store = if restart_first {
            let store = restart(h, store).unwrap_or_else(|_| unreachable!("persists"));
            let want = (held.ids(P1), held.ids(P2));
            held.live.borrow_mut().clear();
            held.take_recovered(&*store, &[P1, P2]);
            assert_eq!(held.ids(P1), vec![late], "dropped messages came back");
            assert_eq!((held.ids(P1), held.ids(P2)), want);
            store
        } else {
            store
        };
        reclaim(&*store, &held);
        held.check_readable(&*store);
        let after = store.stats().disk_bytes;
        assert!(
            after * 4 < filled,
            "the space of the dropped messages was not given back: {filled} bytes before the drop, {after} after compaction"
        );
        match restart(h, store) {
            Ok(store) => {
                assert_eq!(recovered_ids(&*store, P1), vec![late]);
                assert_eq!(recovered_ids(&*store, P2), held.ids(P2));
                let parts = store.recovered_partitions().expect("partitions");
                assert!(parts.contains(&P1) && parts.contains(&P2), "{parts:?}");
                store.close().expect("close");
            }
            Err(store) => store.close().expect("close"),
        }
    }
}

/// An ack racing a queue delete: a settle, requeue or move of a dropped
/// message after the drop changes nothing, in particular not the same
/// message live in another partition, nor another message's space.
pub fn settle_after_drop_is_a_no_op(h: &mut dyn Harness) {
    let store = h.create();
    let held = Held::default();
    let (m, loc) = fill(&*store, &[P1, P2], 1, b"shared")[0];
    held.insert(P2, m, loc);
    let (alone, alone_loc) = fill(&*store, &[P1], 1, b"alone")[0];
    append_wait(&*store, &[Op::DropPartition { partition: P1 }]);
    append_wait(
        &*store,
        &[
            Op::Settle {
                partition: P1,
                id: m,
                location: loc,
            },
            Op::Requeue {
                partition: P1,
                id: alone,
                location: alone_loc,
                attempts: 3,
                deliver_at_ms: 0,
            },
            Op::Settle {
                partition: P1,
                id: alone,
                location: alone_loc,
            },
        ],
    );
    // Roll the log past that segment, so that reclamation would take it
    // if the stale settle had counted.
    churn(&*store, 60);
    reclaim(&*store, &held);
    held.check_readable(&*store);
    match restart(h, store) {
        Ok(store) => {
            assert_eq!(recovered_ids(&*store, P2), vec![m]);
            assert!(recovered_ids(&*store, P1).is_empty());
            store.close().expect("close");
        }
        Err(store) => store.close().expect("close"),
    }
}

/// A truncation is one small append; it takes exactly the ids below
/// `before` from its partition (the one at `before` stays, as do other
/// partitions' copies), survives a restart, makes later settles of what it
/// took no-ops, and gives the space back.
pub fn truncate_keeps_the_rest_and_frees_space(h: &mut dyn Harness) {
    for restart_first in [false, true] {
        if restart_first && !h.persists() {
            continue;
        }
        let store = h.create();
        let held = Held::default();
        let mut msgs = fill(&*store, &[P1], 10, &BODY);
        let (both, both_loc) = fill(&*store, &[P1, P2], 1, b"both")[0];
        held.insert(P2, both, both_loc);
        msgs.push((both, both_loc));
        msgs.extend(fill(&*store, &[P1], 289, &BODY));
        let before = msgs[150].0;
        for &(id, loc) in &msgs[150..] {
            held.insert(P1, id, loc);
        }
        let filled = store.stats().disk_bytes;
        let appended = store.stats().appended_bytes;
        append_wait(
            &*store,
            &[Op::Truncate {
                partition: P1,
                before,
            }],
        );
        let cost = store.stats().appended_bytes - appended;
        assert!(
            cost <= 64,
            "truncating 150 messages appended {cost} bytes: it must be one small record"
        );
        // Stale: the truncation took it.
        let (stale, stale_loc) = msgs[149];
        append_wait(
            &*store,
            &[Op::Settle {
                partition: P1,
                id: stale,
                location: stale_loc,
            }],
        );
        let store = if restart_first {
            let store = restart(h, store).unwrap_or_else(|_| unreachable!("persists"));
            let want = (held.ids(P1), held.ids(P2));
            held.live.borrow_mut().clear();
            held.take_recovered(&*store, &[P1, P2]);
            assert_eq!(
                (held.ids(P1), held.ids(P2)),
                want,
                "after a truncation before {before}"
            );
            store
        } else {
            store
        };
        assert_eq!(held.ids(P2), vec![both]);
        reclaim(&*store, &held);
        held.check_readable(&*store);
        let after = store.stats().disk_bytes;
        assert!(
            after * 10 < filled * 7,
            "the space of half the messages truncated was not given back: {filled} bytes before, {after} after compaction"
        );
        match restart(h, store) {
            Ok(store) => {
                assert_eq!(recovered_ids(&*store, P1), held.ids(P1));
                assert_eq!(recovered_ids(&*store, P2), vec![both]);
                store.close().expect("close");
            }
            Err(store) => store.close().expect("close"),
        }
    }
}

fn entry(key: &[u8], value: &[u8], version: u64) -> StateEntry {
    StateEntry {
        key: key.to_vec(),
        value: value.to_vec(),
        version,
    }
}

fn put<'a>(key: &'a [u8], value: &'a [u8]) -> Op<'a> {
    Op::PutState { key, value }
}

/// Each key counts its own puts (1 for the first), unaffected by other
/// keys; a deleted key starts over; values and versions survive restarts,
/// and versions go on counting after one.
pub fn state_keys_have_their_own_versions_and_survive_restart(h: &mut dyn Harness) {
    let store = h.create();
    append_wait(&*store, &[put(b"a", b"1")]);
    append_wait(&*store, &[put(b"a", b"2"), put(b"b", b"x")]);
    append_wait(
        &*store,
        &[put(b"c", b"gone"), Op::DeleteState { key: b"c" }],
    );
    // Deleting an absent key is harmless.
    append_wait(&*store, &[Op::DeleteState { key: b"nothing" }]);
    let want = vec![entry(b"a", b"2", 2), entry(b"b", b"x", 1)];
    assert_eq!(store.scan_state(b"").expect("scan"), want);
    append_wait(&*store, &[put(b"c", b"again")]);
    let want = vec![
        entry(b"a", b"2", 2),
        entry(b"b", b"x", 1),
        entry(b"c", b"again", 1),
    ];
    assert_eq!(store.scan_state(b"").expect("scan"), want);
    let store = match restart(h, store) {
        Ok(store) => {
            assert_eq!(store.scan_state(b"").expect("scan"), want, "after restart");
            store
        }
        Err(store) => store,
    };
    append_wait(&*store, &[put(b"a", b"3"), Op::DeleteState { key: b"b" }]);
    let want = vec![entry(b"a", b"3", 3), entry(b"c", b"again", 1)];
    assert_eq!(store.scan_state(b"").expect("scan"), want);
    match restart(h, store) {
        Ok(store) => {
            assert_eq!(store.scan_state(b"").expect("scan"), want, "after restart");
            store.close().expect("close");
        }
        Err(store) => store.close().expect("close"),
    }
}

/// A scan returns exactly the keys starting with its prefix, in key order.
pub fn state_scan_is_by_prefix(h: &mut dyn Harness) {
    let store = h.create();
    let keys: [&[u8]; 7] = [
        b"s\0t\0k2",
        b"s\0t\0k1",
        b"s\0t\0",
        b"s\0t",
        b"s\0t\x01k",
        b"s\0u\0k1",
        b"r\0t\0a/b",
    ];
    let ops: Vec<Op<'_>> = keys.iter().map(|k| put(k, b"v")).collect();
    append_wait(&*store, &ops);
    let scan = |store: &dyn Store, prefix: &[u8]| -> Vec<Vec<u8>> {
        store
            .scan_state(prefix)
            .expect("scan")
            .into_iter()
            .map(|e| e.key)
            .collect()
    };
    let check = |store: &dyn Store| {
        assert_eq!(
            scan(store, b"s\0t\0"),
            vec![
                b"s\0t\0".to_vec(),
                b"s\0t\0k1".to_vec(),
                b"s\0t\0k2".to_vec()
            ]
        );
        assert_eq!(scan(store, b"s\0t\0k1"), vec![b"s\0t\0k1".to_vec()]);
        assert_eq!(scan(store, b"s\0").len(), 6);
        assert_eq!(scan(store, b"r\0"), vec![b"r\0t\0a/b".to_vec()]);
        assert!(scan(store, b"q").is_empty());
        assert!(scan(store, b"s\0t\0k3").is_empty());
        let mut all: Vec<Vec<u8>> = keys.iter().map(|k| k.to_vec()).collect();
        all.sort();
        assert_eq!(scan(store, b""), all);
    };
    check(&*store);
    match restart(h, store) {
        Ok(store) => {
            check(&*store);
            store.close().expect("close");
        }
        Err(store) => store.close().expect("close"),
    }
}

/// The state store is not pinned to where its records were written: after
/// the log rolled far past them and reclaimed the old space, every key is
/// there with its value and version, and a deleted key does not come back.
pub fn state_survives_reclamation(h: &mut dyn Harness) {
    let store = h.create();
    append_wait(
        &*store,
        &[put(b"k1", b"one"), put(b"k2", b"two"), put(b"k3", b"three")],
    );
    append_wait(
        &*store,
        &[put(b"k2", b"two again"), Op::DeleteState { key: b"k3" }],
    );
    churn(&*store, 100);
    reclaim(&*store, &Held::default());
    let stats = store.stats();
    if stats.segments > 0 {
        assert!(
            stats.reclaimed_segments > 0,
            "nothing was reclaimed: the rule is not exercised"
        );
    }
    let want = vec![entry(b"k1", b"one", 1), entry(b"k2", b"two again", 2)];
    assert_eq!(store.scan_state(b"k").expect("scan"), want);
    match restart(h, store) {
        Ok(store) => {
            assert_eq!(store.scan_state(b"k").expect("scan"), want, "after restart");
            store.close().expect("close");
        }
        Err(store) => store.close().expect("close"),
    }
}

/// The spill (a store without one skips this): its copies read back from
/// it (not from the store), stay spilled when compaction moves them, give
/// their space back once released, and are gone after a restart, while the
/// stored message beside them is recovered; a spilled id is never reused.
pub fn spill_is_released_and_never_recovered(h: &mut dyn Harness) {
    let store = h.create();
    let Some(spill) = store.spill() else {
        store.close().expect("close");
        return;
    };
    let held = Held::default();
    let (stored, stored_loc) = fill(&*store, &[P2], 1, b"stored")[0];
    held.insert(P2, stored, stored_loc);
    assert!(!spill.holds(stored_loc));
    let baseline = store.stats().disk_bytes;
    // 300 copies in P1, every tenth also in P3; the ones in P3 stay held.
    let mut copies = Vec::new();
    for i in 0..300u64 {
        let id = store.allocate_ids(1);
        let parts: &[PartitionId] = if i % 10 == 0 { &[P1, P3] } else { &[P1] };
        let (loc, _) = spill
            .spill(crate::ShareTag::BROKER, id, parts, data(&BODY))
            .expect("spill");
        assert!(spill.holds(loc), "a spill holds its own positions");
        assert!(
            store.read(loc).is_err(),
            "a spilled copy is not the store's"
        );
        assert_eq!(spill.read(loc).expect("read").id, id);
        if i % 10 == 0 {
            held.insert(P3, id, loc);
        }
        copies.push((id, loc));
    }
    append_wait(&*store, &[]);
    let filled = store.stats().disk_bytes;
    for &(id, loc) in &copies {
        spill.release(P1, id, loc);
    }
    // Released twice: harmless.
    spill.release(P1, copies[1].0, copies[1].1);
    churn(&*store, 30);
    for _ in 0..64 {
        if store.compact(&held).expect("compact") == 0 {
            break;
        }
        append_wait(&*store, &[]);
    }
    append_wait(&*store, &[]);
    append_wait(&*store, &[]);
    for (&(p, id), &loc) in held.live.borrow().iter() {
        if p == P3 {
            assert!(spill.holds(loc), "compaction made a spilled copy stored");
            assert_eq!(spill.read(loc).expect("read").id, id);
        }
    }
    let after = store.stats().disk_bytes;
    assert!(
        after.saturating_sub(baseline) * 3 < filled.saturating_sub(baseline),
        "released copies kept their space: {baseline} bytes before spilling, {filled} spilled, {after} after release and compaction"
    );
    let last = copies.last().map_or(0, |c| c.0);
    match restart(h, store) {
        Ok(store) => {
            assert!(
                recovered_ids(&*store, P3).is_empty(),
                "spilled copies came back after a restart"
            );
            assert!(recovered_ids(&*store, P1).is_empty());
            assert_eq!(recovered_ids(&*store, P2), vec![stored]);
            assert!(store.allocate_ids(1) > last, "a spilled id was reused");
            store.close().expect("close");
        }
        Err(store) => store.close().expect("close"),
    }
}

#[cfg(test)]
mod tests {
    //! One deliberately wrong store per rule, each a [`MemStore`] behind a
    //! wrapper that breaks the rule, and the proof that the rule fails it.

    use super::*;
    use crate::testing::MemStore;
    use crate::{
        LiveSet, Receipt, RecoveredMessage, RecoveredMeta, StoreError, StoreStats, StoredMessage,
        Waiter,
    };
    use parking_lot::Mutex;
    use std::collections::{BTreeMap, HashMap, HashSet};

    /// How a [`Faulty`] store breaks the contract.
    #[derive(Clone, Copy, PartialEq, Eq, Debug)]
    enum Fault {
        /// Drops are not recorded: the messages come back at restart.
        DropIgnored,
        /// Drops are remembered beside the store and hidden from recovery,
        /// but the messages' space is never given back.
        DropKeepsSpace,
        /// A drop is appended as a settle per message (what queue deletes
        /// did before this contract).
        DropAsSettles,
        /// A settle after a drop settles the message in every partition.
        StaleSettleSettlesEverywhere,
        /// Truncations are not recorded.
        TruncateIgnored,
        /// A truncation takes the message at `before` too.
        TruncateInclusive,
        /// Truncations are hidden from recovery but keep their space.
        TruncateKeepsSpace,
        /// The state store lives in the wrapper's memory only.
        StateNotDurable,
        /// State versions come from one counter shared by every key.
        StateGlobalVersion,
        /// A scan ignores its prefix's last byte.
        ScanSloppyPrefix,
        /// The spill is the durable store: its copies are recovered.
        SpillIsDurable,
        /// Releasing a spilled copy does nothing: its space is never
        /// given back.
        SpillLeaks,
    }

    /// What a wrapper keeps beside the store; `lasting` survives restarts.
    #[derive(Default)]
    struct Side {
        /// Cuts hidden from recovery: partition, first id kept.
        cuts: HashMap<PartitionId, MessageId>,
        /// Partitions of every message published.
        published: HashMap<MessageId, Vec<PartitionId>>,
        /// Messages published per partition, with their locations.
        by_partition: HashMap<PartitionId, BTreeMap<MessageId, Location>>,
        dropped: HashSet<PartitionId>,
    }

    type StateMap = BTreeMap<Vec<u8>, (u64, Vec<u8>)>;

    struct Faulty {
        inner: Arc<MemStore>,
        fault: Fault,
        lasting: Arc<Mutex<Side>>,
        /// Lost at restart: a counter of puts, and per key its version
        /// and value.
        state: Mutex<(u64, StateMap)>,
        /// [`Fault::SpillIsDurable`]: the stored positions its spill handed
        /// out (and compaction moved them to).
        spilled: Mutex<HashSet<Location>>,
    }

    impl Faulty {
        fn inner_spill(&self) -> &dyn crate::Spill {
            Store::spill(&*self.inner).expect("MemStore has a spill")
        }
    }

    /// Follows [`Fault::SpillIsDurable`]'s positions through compaction.
    struct Tracking<'a> {
        live: &'a dyn LiveSet,
        spilled: &'a Mutex<HashSet<Location>>,
    }

    impl LiveSet for Tracking<'_> {
        fn for_each_live(&self, visit: &mut dyn FnMut(PartitionId, MessageId, Location)) {
            self.live.for_each_live(visit);
        }
        fn relocate(&self, moves: &[Relocation]) -> Vec<bool> {
            let done = self.live.relocate(moves);
            let mut spilled = self.spilled.lock();
            for (m, ok) in moves.iter().zip(&done) {
                if *ok && spilled.remove(&m.old) {
                    spilled.insert(m.new);
                }
            }
            done
        }
    }

    impl crate::Spill for Faulty {
        fn spill(
            &self,
            owner: crate::ShareTag,
            id: MessageId,
            partitions: &[PartitionId],
            data: MessageData<'_>,
        ) -> Result<(Location, crate::Admission), StoreError> {
            if self.fault != Fault::SpillIsDurable {
                return self.inner_spill().spill(owner, id, partitions, data);
            }
            let mut locs = Vec::new();
            self.inner.append(
                &[Op::Publish {
                    id,
                    partitions,
                    data,
                }],
                &mut locs,
            )?;
            self.spilled.lock().insert(locs[0]);
            Ok((locs[0], crate::Admission::default()))
        }

        fn read(&self, location: Location) -> Result<StoredMessage, StoreError> {
            if self.fault == Fault::SpillIsDurable {
                return Store::read(&*self.inner, location);
            }
            self.inner_spill().read(location)
        }

        fn holds(&self, location: Location) -> bool {
            if self.fault == Fault::SpillIsDurable {
                return self.spilled.lock().contains(&location);
            }
            self.inner_spill().holds(location)
        }

        fn release(&self, partition: PartitionId, id: MessageId, location: Location) {
            match self.fault {
                Fault::SpillLeaks => {}
                Fault::SpillIsDurable => {
                    let _ = self.inner.append(
                        &[Op::Settle {
                            partition,
                            id,
                            location,
                        }],
                        &mut Vec::new(),
                    );
                }
                _ => self.inner_spill().release(partition, id, location),
            }
        }

        fn release_partition(&self, partition: PartitionId) {
            self.inner_spill().release_partition(partition);
        }
    }

    impl Store for Faulty {
        fn allocate_ids(&self, n: u64) -> MessageId {
            self.inner.allocate_ids(n)
        }

        fn append(
            &self,
            ops: &[Op<'_>],
            locations: &mut Vec<Location>,
        ) -> Result<crate::Ticket, StoreError> {
            let mut out: Vec<Op<'_>> = Vec::new();
            let mut side = self.lasting.lock();
            let mut state = self.state.lock();
            let mut extra: Vec<(PartitionId, MessageId, Location)> = Vec::new();
            for op in ops {
                match (op, self.fault) {
                    (Op::DropPartition { .. }, Fault::DropIgnored)
                    | (Op::Truncate { .. }, Fault::TruncateIgnored) => {}
                    (Op::DropPartition { partition }, Fault::DropKeepsSpace) => {
                        // Hidden from recovery exactly as a drop would be.
                        side.cuts.insert(*partition, self.inner.allocate_ids(0));
                    }
                    (Op::Truncate { partition, before }, Fault::TruncateKeepsSpace) => {
                        side.cuts.insert(*partition, *before);
                    }
                    (Op::DropPartition { partition }, Fault::DropAsSettles) => {
                        for (&id, &loc) in side.by_partition.get(partition).into_iter().flatten() {
                            extra.push((*partition, id, loc));
                        }
                    }
                    (Op::DropPartition { partition }, Fault::StaleSettleSettlesEverywhere) => {
                        side.dropped.insert(*partition);
                        out.push(op.clone());
                    }
                    (
                        Op::Settle {
                            partition,
                            id,
                            location,
                        },
                        Fault::StaleSettleSettlesEverywhere,
                    ) if side.dropped.contains(partition) => {
                        for p in side.published.get(id).into_iter().flatten() {
                            out.push(Op::Settle {
                                partition: *p,
                                id: *id,
                                location: *location,
                            });
                        }
                    }
                    (Op::Truncate { partition, before }, Fault::TruncateInclusive) => {
                        out.push(Op::Truncate {
                            partition: *partition,
                            before: before + 1,
                        });
                    }
                    (
                        Op::PutState { key, value },
                        Fault::StateNotDurable | Fault::StateGlobalVersion,
                    ) => {
                        state.0 += 1;
                        let version = if self.fault == Fault::StateGlobalVersion {
                            state.0
                        } else {
                            state.1.get(*key).map_or(1, |(v, _)| v + 1)
                        };
                        state.1.insert(key.to_vec(), (version, value.to_vec()));
                    }
                    (
                        Op::DeleteState { key },
                        Fault::StateNotDurable | Fault::StateGlobalVersion,
                    ) => {
                        state.1.remove(*key);
                    }
                    (Op::Publish { id, partitions, .. }, _) => {
                        side.published.insert(*id, partitions.to_vec());
                        out.push(op.clone());
                    }
                    _ => out.push(op.clone()),
                }
            }
            let settles: Vec<Op<'_>> = extra
                .iter()
                .map(|&(partition, id, location)| Op::Settle {
                    partition,
                    id,
                    location,
                })
                .collect();
            out.extend(settles);
            drop(state);
            // Publishes are tracked with the locations they got.
            let first = locations.len();
            let ticket = self.inner.append(&out, locations)?;
            let mut k = first;
            for op in &out {
                if let Op::Publish { id, partitions, .. } | Op::Move { id, partitions, .. } = op {
                    if let Some(loc) = locations.get(k) {
                        for p in partitions.iter() {
                            side.by_partition.entry(*p).or_default().insert(*id, *loc);
                        }
                    }
                    k += 1;
                }
            }
            Ok(ticket)
        }

        fn when_durable(&self, ticket: crate::Ticket, waiter: Waiter) {
            self.inner.when_durable(ticket, waiter)
        }

        fn read_many(
            &self,
            refs: &[crate::MessageRef],
        ) -> crate::ReadFuture<Vec<Result<StoredMessage, StoreError>>> {
            crate::ready(refs.iter().map(|r| Store::read(self, r.location)).collect())
        }

        fn read_range(
            &self,
            partition: PartitionId,
            from: MessageId,
            max: usize,
        ) -> crate::ReadFuture<Result<Vec<crate::RangeMessage>, StoreError>> {
            self.inner.read_range(partition, from, max)
        }

        fn put_if(
            &self,
            key: &[u8],
            value: Option<&[u8]>,
            expected: u64,
        ) -> Result<(crate::Ticket, u64), StoreError> {
            self.inner.put_if(key, value, expected)
        }

        fn watch(&self, since: u64, wake: crate::Wake) -> Result<crate::MetaFeed, StoreError> {
            self.inner.watch(since, wake)
        }

        fn acquire(&self, partition: PartitionId) -> Result<crate::Epoch, StoreError> {
            self.inner.acquire(partition)
        }

        fn try_acquire(&self, partition: PartitionId) -> Result<Option<crate::Epoch>, StoreError> {
            self.inner.try_acquire(partition)
        }

        fn read(&self, location: Location) -> Result<StoredMessage, StoreError> {
            if self.spilled.lock().contains(&location) {
                return Err(StoreError::NotFound(location));
            }
            Store::read(&*self.inner, location)
        }

        fn spill(&self) -> Option<&dyn crate::Spill> {
            Some(self)
        }

        fn recovered_meta(&self) -> Result<RecoveredMeta, StoreError> {
            self.inner.recovered_meta()
        }

        fn recovered_partitions(&self) -> Result<Vec<PartitionId>, StoreError> {
            self.inner.recovered_partitions()
        }

        fn recover_partition(
            &self,
            partition: PartitionId,
        ) -> Result<Vec<RecoveredMessage>, StoreError> {
            let mut msgs = self.inner.recover_partition(partition)?;
            if let Some(&before) = self.lasting.lock().cuts.get(&partition) {
                msgs.retain(|m| m.id >= before);
            }
            Ok(msgs)
        }

        fn recover_receipts(&self, partition: PartitionId) -> Result<Vec<Receipt>, StoreError> {
            self.inner.recover_receipts(partition)
        }

        fn compact(&self, live: &dyn LiveSet) -> Result<usize, StoreError> {
            self.inner.compact(&Tracking {
                live,
                spilled: &self.spilled,
            })
        }

        fn stats(&self) -> StoreStats {
            self.inner.stats()
        }

        fn close(&self) -> Result<(), StoreError> {
            self.inner.close()
        }

        fn scan_state(&self, prefix: &[u8]) -> Result<Vec<StateEntry>, StoreError> {
            match self.fault {
                Fault::StateNotDurable | Fault::StateGlobalVersion => Ok(self
                    .state
                    .lock()
                    .1
                    .iter()
                    .filter(|(k, _)| k.starts_with(prefix))
                    .map(|(k, (version, value))| StateEntry {
                        key: k.clone(),
                        value: value.clone(),
                        version: *version,
                    })
                    .collect()),
                Fault::ScanSloppyPrefix => {
                    let short = &prefix[..prefix.len().saturating_sub(1)];
                    self.inner.scan_state(short)
                }
                _ => self.inner.scan_state(prefix),
            }
        }
    }

    /// [`MemStore`]s behind a [`Faulty`] wrapper; restarts keep the
    /// wrapper's lasting side, not its state store.
    struct FaultyHarness {
        fault: Fault,
        current: Option<Arc<MemStore>>,
        lasting: Arc<Mutex<Side>>,
    }

    impl FaultyHarness {
        fn wrap(&mut self, inner: Arc<MemStore>) -> Arc<dyn Store> {
            self.current = Some(inner.clone());
            Arc::new(Faulty {
                inner,
                fault: self.fault,
                lasting: self.lasting.clone(),
                state: Mutex::default(),
                spilled: Mutex::default(),
            })
        }
    }

    impl Harness for FaultyHarness {
        fn create(&mut self) -> Arc<dyn Store> {
            self.lasting = Arc::default();
            self.wrap(MemStore::new())
        }
        fn persists(&self) -> bool {
            true
        }
        fn reopen(&mut self, store: Arc<dyn Store>) -> Arc<dyn Store> {
            drop(store);
            let next = self.current.take().expect("created first").reopen();
            self.wrap(next)
        }
    }

    /// `rule` fails the store that breaks it with `fault`.
    fn fails(rule: fn(&mut dyn Harness), fault: Fault) {
        let mut h = FaultyHarness {
            fault,
            current: None,
            lasting: Arc::default(),
        };
        let failed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| rule(&mut h)));
        assert!(failed.is_err(), "the rule passed a store with {fault:?}");
    }

    #[test]
    fn drop_rule_fails_a_store_that_ignores_drops() {
        fails(
            drop_partition_is_one_record_and_frees_space,
            Fault::DropIgnored,
        );
    }

    #[test]
    fn drop_rule_fails_a_store_that_keeps_the_space() {
        fails(
            drop_partition_is_one_record_and_frees_space,
            Fault::DropKeepsSpace,
        );
    }

    #[test]
    fn drop_rule_fails_a_store_that_settles_each_message() {
        fails(
            drop_partition_is_one_record_and_frees_space,
            Fault::DropAsSettles,
        );
    }

    #[test]
    fn stale_settle_rule_fails_a_store_that_settles_everywhere() {
        fails(
            settle_after_drop_is_a_no_op,
            Fault::StaleSettleSettlesEverywhere,
        );
    }

    #[test]
    fn truncate_rule_fails_a_store_that_ignores_truncations() {
        fails(
            truncate_keeps_the_rest_and_frees_space,
            Fault::TruncateIgnored,
        );
    }

    #[test]
    fn truncate_rule_fails_a_store_that_takes_one_too_many() {
        fails(
            truncate_keeps_the_rest_and_frees_space,
            Fault::TruncateInclusive,
        );
    }

    #[test]
    fn truncate_rule_fails_a_store_that_keeps_the_space() {
        fails(
            truncate_keeps_the_rest_and_frees_space,
            Fault::TruncateKeepsSpace,
        );
    }

    #[test]
    fn state_rule_fails_a_store_that_forgets_state_at_restart() {
        fails(
            state_keys_have_their_own_versions_and_survive_restart,
            Fault::StateNotDurable,
        );
        fails(state_survives_reclamation, Fault::StateNotDurable);
    }

    #[test]
    fn state_rule_fails_a_store_with_one_global_version() {
        fails(
            state_keys_have_their_own_versions_and_survive_restart,
            Fault::StateGlobalVersion,
        );
    }

    #[test]
    fn scan_rule_fails_a_store_with_a_sloppy_prefix() {
        fails(state_scan_is_by_prefix, Fault::ScanSloppyPrefix);
    }

    #[test]
    fn spill_rule_fails_a_spill_that_is_recovered() {
        fails(spill_is_released_and_never_recovered, Fault::SpillIsDurable);
    }

    #[test]
    fn spill_rule_fails_a_spill_that_keeps_released_space() {
        fails(spill_is_released_and_never_recovered, Fault::SpillLeaks);
    }
}
