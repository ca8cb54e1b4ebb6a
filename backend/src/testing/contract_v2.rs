//! The rules of store contract v2 (issue 21), run by
//! [`super::contract::run_all`]: durability per ticket and per partition,
//! waiters in order, several handles with fencing, recovery at any time,
//! conditional metadata and its change feed, batched reads.
//!
//! Each rule has a deliberately wrong store in this file's tests (a
//! wrapper over [`super::MemStore`] breaking just that rule) that fails it:
//! the rule is checked, not only exercised.

use super::contract::Harness;
use crate::{
    MessageAttrs, MessageData, MessageId, MessageRef, MetaChange, MetaEvent, MetaFeed, Op,
    PartitionId, Store, StoreError, Ticket,
};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;

const P1: PartitionId = PartitionId(11);
const P2: PartitionId = PartitionId(12);
const P3: PartitionId = PartitionId(13);

/// Runs every rule of this file.
pub fn run_all(h: &mut dyn Harness) {
    crash_keeps_a_prefix_per_partition(h);
    waiters_are_called_in_registration_order(h);
    a_deposed_handle_is_fenced(h);
    recovery_answers_at_any_time(h);
    conditional_puts_race_one_wins(h);
    the_change_feed_reaches_a_second_handle(h);
    batched_reads_answer_in_order(h);
}

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

fn wait(store: &dyn Store, ticket: Ticket) {
    let (tx, rx) = mpsc::channel();
    store.when_durable(
        ticket,
        Box::new(move |r| {
            let _ = tx.send(r);
        }),
    );
    rx.recv_timeout(Duration::from_secs(20))
        .expect("waiter called")
        .expect("durable");
}

fn publish(
    store: &dyn Store,
    parts: &[PartitionId],
    body: &[u8],
) -> (MessageId, crate::Location, Ticket) {
    let id = store.allocate_ids(1);
    let mut locs = Vec::new();
    let t = store
        .append(
            &[Op::Publish {
                id,
                partitions: parts,
                data: data(body),
            }],
            &mut locs,
        )
        .expect("publish");
    (id, locs[0], t)
}

fn recovered_ids(store: &dyn Store, p: PartitionId) -> Vec<MessageId> {
    store
        .recover_partition(p)
        .expect("recover")
        .into_iter()
        .map(|m| m.id)
        .collect()
}

/// One step of [`crash_keeps_a_prefix_per_partition`]'s sequence.
#[derive(Clone, Copy)]
enum Step {
    Publish(usize, &'static [PartitionId]),
    Settle(usize, PartitionId),
}

/// After a crash every partition holds a prefix of what was appended to
/// it, at least up to what a completed ticket covered: a settle is never
/// kept without its publish, a message published to two partitions is in
/// both or neither (unless settled), and an append is never kept while an
/// earlier one of the same partition is lost.
pub fn crash_keeps_a_prefix_per_partition(h: &mut dyn Harness) {
    let store = h.create();
    let held = h.hold(&store);
    const STEPS: [Step; 10] = [
        Step::Publish(0, &[P1]),
        Step::Publish(1, &[P2]),
        Step::Publish(2, &[P1, P2]),
        Step::Settle(0, P1),
        Step::Publish(3, &[P1]),
        Step::Settle(1, P2),
        Step::Publish(4, &[P3]),
        Step::Settle(2, P1),
        Step::Publish(5, &[P2]),
        Step::Publish(6, &[P1]),
    ];
    // The step whose ticket completes before the crash.
    const COVERED: usize = 4;
    let mut ids = [0; 7];
    let mut locs = [crate::testing::location(0); 7];
    let mut tickets = Vec::new();
    for step in STEPS {
        let t = match step {
            Step::Publish(m, parts) => {
                let (id, loc, t) = publish(&*store, parts, &[m as u8; 64]);
                (ids[m], locs[m]) = (id, loc);
                t
            }
            Step::Settle(m, p) => store
                .append(
                    &[Op::Settle {
                        partition: p,
                        id: ids[m],
                        location: locs[m],
                    }],
                    &mut Vec::new(),
                )
                .expect("settle"),
        };
        tickets.push(t);
    }
    if held {
        h.release(&store, tickets[COVERED]);
    }
    wait(&*store, tickets[COVERED]);
    let Some(store) = h.crash(store) else {
        return;
    };
    // The live set of `p` after each prefix of its steps.
    let prefixes = |p: PartitionId| -> Vec<(usize, BTreeSet<MessageId>)> {
        let mut live = BTreeSet::new();
        let mut out = vec![(0, live.clone())];
        for (i, step) in STEPS.iter().enumerate() {
            match *step {
                Step::Publish(m, parts) if parts.contains(&p) => {
                    live.insert(ids[m]);
                }
                Step::Settle(m, q) if q == p => {
                    live.remove(&ids[m]);
                }
                _ => continue,
            }
            out.push((i + 1, live.clone()));
        }
        out
    };
    // What the covered ticket forces: P1 up to step 4; step 2 is in it and
    // also in P2, whose prefix then reaches step 2 (and so step 1).
    let minimum = [(P1, COVERED + 1), (P2, 3), (P3, 0)];
    let mut kept_steps = BTreeMap::new();
    for (p, min) in minimum {
        store.acquire(p).expect("acquire");
        let got: BTreeSet<MessageId> = recovered_ids(&*store, p).into_iter().collect();
        let matching: Vec<usize> = prefixes(p)
            .into_iter()
            .filter(|(len, live)| *len >= min && *live == got)
            .map(|(len, _)| len)
            .collect();
        assert!(
            !matching.is_empty(),
            "partition {p:?} after the crash holds {got:?}: not a prefix of its appends reaching step {min}"
        );
        kept_steps.insert(p, matching);
    }
    // Message 2 is one record in P1 and P2: kept in both or settled.
    let p2_has_2 = kept_steps[&P2].iter().any(|&len| len > 2);
    assert!(p2_has_2, "message 2 survived in P1 but not in P2");
    let r = store.read(locs[3]).expect("a kept message is readable");
    assert_eq!(r.id, ids[3]);
    store.close().expect("close");
}

/// Waiters are called in the order they were registered, even when a
/// later one's ticket is durable first; a waiter of [`Ticket::NONE`]
/// registered behind a pending one waits for it too.
pub fn waiters_are_called_in_registration_order(h: &mut dyn Harness) {
    let store = h.create();
    let held = h.hold(&store);
    let (_, _, t1) = publish(&*store, &[P1], b"one");
    let (_, _, t2) = publish(&*store, &[P2], b"two");
    let order = Arc::new(parking_lot::Mutex::new(Vec::new()));
    let (tx, rx) = mpsc::channel();
    for (n, t) in [(1, t1), (2, t2), (3, Ticket::NONE)] {
        let (order, tx) = (order.clone(), tx.clone());
        store.when_durable(
            t,
            Box::new(move |r| {
                order.lock().push((n, r.is_ok()));
                let _ = tx.send(());
            }),
        );
    }
    if held {
        // Only the second: its waiter must still wait for the first's.
        h.release(&store, t2);
        assert!(
            rx.recv_timeout(Duration::from_millis(50)).is_err(),
            "a waiter overtook an earlier one: {:?}",
            order.lock()
        );
        h.release(&store, t1);
    }
    for _ in 0..3 {
        rx.recv_timeout(Duration::from_secs(20))
            .expect("waiter called");
    }
    assert_eq!(*order.lock(), vec![(1, true), (2, true), (3, true)]);
    store.close().expect("close");
}

/// Two handles on one store: the later acquire of a partition deposes the
/// earlier holder, whose appends (and recovery) for it then fail with
/// `Fenced`, whole batches included; the new holder recovers what the old
/// one appended; `try_acquire` never deposes anyone.
pub fn a_deposed_handle_is_fenced(h: &mut dyn Harness) {
    let a = h.create();
    let Some(b) = h.second_handle(&a) else {
        a.close().expect("close");
        return;
    };
    let e1 = a.acquire(P1).expect("acquire");
    let (m1, l1, t) = publish(&*a, &[P1], b"from a");
    wait(&*a, t);
    let e2 = b.acquire(P1).expect("acquire");
    assert!(e2 > e1, "epochs grow: {e1:?} then {e2:?}");
    let fenced = |r: Result<Ticket, StoreError>| matches!(r, Err(StoreError::Fenced(p)) if p == P1);
    // A batch naming the deposed partition fails whole: P2 gets nothing.
    let id = a.allocate_ids(1);
    let r = a.append(
        &[
            Op::Publish {
                id,
                partitions: &[P2],
                data: data(b"p2"),
            },
            Op::Publish {
                id: id + 1,
                partitions: &[P1],
                data: data(b"late"),
            },
        ],
        &mut Vec::new(),
    );
    assert!(fenced(r), "the deposed handle appended to P1");
    let r = a.append(
        &[Op::Settle {
            partition: P1,
            id: m1,
            location: l1,
        }],
        &mut Vec::new(),
    );
    assert!(fenced(r), "the deposed handle settled in P1");
    assert!(
        matches!(a.recover_partition(P1), Err(StoreError::Fenced(_))),
        "the deposed handle recovered P1"
    );
    assert_eq!(
        a.try_acquire(P1).expect("try"),
        None,
        "try_acquire deposed the holder"
    );
    assert_eq!(b.try_acquire(P1).expect("try"), Some(e2));
    // The new holder takes over what the old one left.
    assert_eq!(recovered_ids(&*b, P1), vec![m1]);
    b.acquire(P2).expect("acquire");
    assert!(
        recovered_ids(&*b, P2).is_empty(),
        "a fenced batch left a record in P2"
    );
    let (m2, _, t) = publish(&*b, &[P1], b"from b");
    wait(&*b, t);
    assert_eq!(recovered_ids(&*b, P1), vec![m1, m2]);
    // And the old one can take it back, fencing the new one.
    let e3 = a.acquire(P1).expect("acquire");
    assert!(e3 > e2);
    let id = b.allocate_ids(1);
    let r = b.append(
        &[Op::Publish {
            id,
            partitions: &[P1],
            data: data(b"x"),
        }],
        &mut Vec::new(),
    );
    assert!(
        fenced(r),
        "the second handle was not fenced after losing P1"
    );
    // A partition nobody holds is appended to freely.
    let (_, _, t) = publish(&*b, &[P3], b"free");
    wait(&*b, t);
    drop(b);
    a.close().expect("close");
}

/// Recovery is not a one-time hand-out: asked again, after more appends,
/// after compaction, after a restart, it answers with what is live now.
pub fn recovery_answers_at_any_time(h: &mut dyn Harness) {
    let store = h.create();
    store.acquire(P1).expect("acquire");
    assert!(recovered_ids(&*store, P1).is_empty());
    let (m1, _, t) = publish(&*store, &[P1], b"one");
    wait(&*store, t);
    assert_eq!(recovered_ids(&*store, P1), vec![m1]);
    assert_eq!(recovered_ids(&*store, P1), vec![m1], "asked twice");
    let (m2, l2, t) = publish(&*store, &[P1, P2], b"two");
    wait(&*store, t);
    let t = store
        .append(
            &[
                Op::Requeue {
                    partition: P1,
                    id: m2,
                    location: l2,
                    attempts: 3,
                    deliver_at_ms: 9,
                },
                Op::Receipt {
                    partition: P1,
                    key_hash: 77,
                    expires_at_ms: crate::log::now_ms() + 3_600_000,
                },
            ],
            &mut Vec::new(),
        )
        .expect("requeue");
    wait(&*store, t);
    let got = store.recover_partition(P1).expect("recover");
    assert_eq!(got.iter().map(|m| m.id).collect::<Vec<_>>(), vec![m1, m2]);
    assert_eq!((got[1].attempts, got[1].attrs.deliver_at_ms), (3, 9));
    assert_eq!(store.recover_receipts(P1).expect("receipts").len(), 1);
    let mut store = store;
    for round in 0..2 {
        struct Nothing;
        impl crate::LiveSet for Nothing {
            fn for_each_live(&self, _: &mut dyn FnMut(PartitionId, MessageId, crate::Location)) {}
            fn relocate(&self, moves: &[crate::Relocation]) -> Vec<bool> {
                vec![false; moves.len()]
            }
        }
        store.compact(&Nothing).expect("compact");
        assert_eq!(recovered_ids(&*store, P1), vec![m1, m2], "round {round}");
        assert_eq!(recovered_ids(&*store, P2), vec![m2], "round {round}");
        assert_eq!(
            store.recover_receipts(P1).expect("receipts").len(),
            1,
            "round {round}"
        );
        if !h.persists() {
            break;
        }
        store = h.reopen(store);
        store.acquire(P1).expect("acquire");
        store.acquire(P2).expect("acquire");
    }
    store.close().expect("close");
}

/// Conditional puts: of two writers expecting the same version, exactly
/// one wins and the other gets `Conflict` (nothing written); versions grow
/// per change and show in the map; a delete is conditional too.
pub fn conditional_puts_race_one_wins(h: &mut dyn Harness) {
    let a = h.create();
    let b = h.second_handle(&a).unwrap_or_else(|| a.clone());
    let (_, v1) = a.put_if(b"k", Some(b"a1"), 0).expect("put on absent");
    let conflict = |r: Result<(Ticket, u64), StoreError>, expected: u64, found: u64| {
        assert!(
            matches!(r, Err(StoreError::Conflict { expected: e, found: f }) if e == expected && f == found),
            "expected a conflict ({expected} vs {found}), got {r:?}"
        );
    };
    conflict(b.put_if(b"k", Some(b"b1"), 0), 0, v1);
    let (t, v2) = b.put_if(b"k", Some(b"b2"), v1).expect("put on v1");
    assert!(v2 > v1);
    wait(&*b, t);
    conflict(a.put_if(b"k", Some(b"a2"), v1), v1, v2);
    let m = a.recovered_meta().expect("meta");
    assert_eq!(m.meta.get(&b"k"[..]).map(Vec::as_slice), Some(&b"b2"[..]));
    assert_eq!(m.key_versions.get(&b"k"[..]), Some(&v2));
    // Racing threads, each expecting the version both read: one winner.
    for round in 0..20u8 {
        let key = [b'r', round];
        let base = a
            .recovered_meta()
            .expect("meta")
            .key_versions
            .get(&key[..])
            .copied()
            .unwrap_or(0);
        let wins = AtomicUsize::new(0);
        let conflicts = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for (n, st) in [(1u8, &a), (2, &b)] {
                let (wins, conflicts) = (&wins, &conflicts);
                s.spawn(move || match st.put_if(&key, Some(&[n]), base) {
                    Ok(_) => wins.fetch_add(1, Ordering::Relaxed),
                    Err(StoreError::Conflict { .. }) => conflicts.fetch_add(1, Ordering::Relaxed),
                    Err(e) => panic!("put_if: {e}"),
                });
            }
        });
        assert_eq!(
            (wins.into_inner(), conflicts.into_inner()),
            (1, 1),
            "round {round}: one winner, one conflict"
        );
    }
    // A conditional delete.
    let v = a.recovered_meta().expect("meta").key_versions[&b"k"[..]];
    conflict(a.put_if(b"k", None, v + 1000), v + 1000, v);
    let (t, _) = a.put_if(b"k", None, v).expect("delete");
    wait(&*a, t);
    assert!(!a
        .recovered_meta()
        .expect("meta")
        .meta
        .contains_key(&b"k"[..]));
    let (t, _) = a.put_if(b"k", Some(b"again"), 0).expect("absent again");
    wait(&*a, t);
    drop(b);
    // After a restart the version reported is what a put expects.
    let a = match h.persists() {
        true => h.reopen(a),
        false => a,
    };
    let m = a.recovered_meta().expect("meta");
    let v = m.key_versions[&b"k"[..]];
    assert!(v <= m.version);
    a.put_if(b"k", Some(b"after"), v)
        .expect("put on the reported version");
    a.close().expect("close");
}

/// A change made through one handle (plain metadata ops, a batch, a
/// conditional put) reaches a watcher on another: its wake is called, and
/// the feed lists every change after the version it watched from, in
/// version order, enough to rebuild the map.
pub fn the_change_feed_reaches_a_second_handle(h: &mut dyn Harness) {
    let a = h.create();
    let b = h.second_handle(&a).unwrap_or_else(|| a.clone());
    let t = a
        .append(
            &[Op::PutMeta {
                key: b"before",
                value: b"0",
            }],
            &mut Vec::new(),
        )
        .expect("put");
    wait(&*a, t);
    let snapshot = b.recovered_meta().expect("meta");
    let mut map = snapshot.meta.clone();
    let since = snapshot.version;
    let woken = Arc::new(AtomicUsize::new(0));
    let w = woken.clone();
    match b.watch(
        since,
        Box::new(move || {
            w.fetch_add(1, Ordering::SeqCst);
        }),
    ) {
        Ok(MetaFeed::Changes(c)) => assert!(c.is_empty(), "changes before any: {c:?}"),
        other => panic!("watch: {other:?}"),
    }
    let t = a
        .append(
            &[
                Op::PutMeta {
                    key: b"k1",
                    value: b"v1",
                },
                Op::MetaBatch {
                    changes: &[
                        MetaChange::Put {
                            key: b"k2",
                            value: b"v2",
                        },
                        MetaChange::Delete { key: b"before" },
                    ],
                },
            ],
            &mut Vec::new(),
        )
        .expect("append");
    wait(&*a, t);
    let (t, _) = a.put_if(b"k3", Some(b"v3"), 0).expect("put_if");
    wait(&*a, t);
    assert_eq!(
        woken.load(Ordering::SeqCst),
        1,
        "the watcher was woken once"
    );
    let events = match b.watch(since, Box::new(|| {})) {
        Ok(MetaFeed::Changes(c)) => c,
        other => panic!("watch: {other:?}"),
    };
    let versions: Vec<u64> = events.iter().map(|e| e.version).collect();
    assert!(
        versions.windows(2).all(|w| w[0] <= w[1]),
        "in order: {versions:?}"
    );
    assert!(versions.iter().all(|v| *v > since));
    assert_eq!(
        versions.iter().collect::<BTreeSet<_>>().len(),
        3,
        "three changes (a batch is one): {events:?}"
    );
    for MetaEvent { key, value, .. } in &events {
        match value {
            Some(v) => map.insert(key.clone(), v.clone()),
            None => map.remove(key),
        };
    }
    let now = a.recovered_meta().expect("meta");
    assert_eq!(map, now.meta, "the feed rebuilds the map");
    assert_eq!(versions.last().copied(), Some(now.version));
    match b.watch(now.version, Box::new(|| {})) {
        Ok(MetaFeed::Changes(c)) => assert!(c.is_empty()),
        other => panic!("watch at the head: {other:?}"),
    }
    drop(b);
    a.close().expect("close");
}

/// `read_many` answers one result per reference, in order, a missing one
/// as `NotFound`; `read_range` lists the live stored messages of a
/// partition from an id on, in id order, at most `max`, with positions
/// that read back.
pub fn batched_reads_answer_in_order(h: &mut dyn Harness) {
    let store = h.create();
    let mut refs = Vec::new();
    for i in 0..5u8 {
        let (id, loc, t) = publish(&*store, &[P1], &[i; 10]);
        wait(&*store, t);
        refs.push(MessageRef::new(P1, id, loc));
    }
    let t = store
        .append(
            &[Op::Settle {
                partition: P1,
                id: refs[1].id,
                location: refs[1].location,
            }],
            &mut Vec::new(),
        )
        .expect("settle");
    wait(&*store, t);
    let asked = [
        refs[4],
        refs[0],
        MessageRef::new(P1, 999_999, crate::testing::location(7)),
        refs[2],
    ];
    let got = crate::block_on(store.read_many(&asked));
    assert_eq!(got.len(), 4);
    for (i, r) in [(0, 4u8), (1, 0), (3, 2)] {
        let m = got[i].as_ref().expect("read");
        assert_eq!((m.id, m.body[0]), (asked[i].id, r), "result {i}");
    }
    assert!(
        matches!(got[2], Err(StoreError::NotFound(_))),
        "{:?}",
        got[2]
    );
    let range = crate::block_on(store.read_range(P1, refs[0].id, 10)).expect("range");
    let ids: Vec<MessageId> = range.iter().map(|m| m.at.id).collect();
    assert_eq!(
        ids,
        vec![refs[0].id, refs[2].id, refs[3].id, refs[4].id],
        "settled ones are gone"
    );
    for m in &range {
        assert_eq!(store.read(m.at.location).expect("read").id, m.at.id);
        assert_eq!(m.message.id, m.at.id);
    }
    let tail = crate::block_on(store.read_range(P1, refs[2].id + 1, 1)).expect("range");
    assert_eq!(
        tail.iter().map(|m| m.at.id).collect::<Vec<_>>(),
        vec![refs[3].id]
    );
    assert!(crate::block_on(store.read_range(P2, 0, 10))
        .expect("range")
        .is_empty());
    store.close().expect("close");
}

#[cfg(test)]
mod tests {
    //! Deliberately wrong stores: each breaks one rule of this file, and the
    //! rule must catch it.

    use super::*;
    use crate::testing::MemStore;
    use crate::{
        Epoch, LiveSet, Location, RangeMessage, ReadFuture, Receipt, RecoveredMessage,
        RecoveredMeta, StoreStats, StoredMessage, Waiter, Wake,
    };

    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    enum Flaw {
        /// Makes a ticket durable without the earlier appends of its
        /// partitions (a crash then keeps a settle without its publish).
        NoPrefix,
        /// Calls a waiter as soon as its ticket is durable, overtaking
        /// earlier ones.
        Overtaking,
        /// Acquire gives epochs but records no owner: nobody is fenced.
        NoFencing,
        /// Hands each partition's recovery out once, as v1 did.
        OnceRecovery,
        /// Conditional puts ignore the expected version.
        LastWriterWins,
        /// The change feed only shows nothing (a local-only cache).
        SilentFeed,
        /// Batched reads answer in reverse order.
        ReversedReads,
    }

    /// A [`MemStore`] handle with one flaw.
    struct Wrong {
        inner: Arc<MemStore>,
        flaw: Flaw,
        recovered: parking_lot::Mutex<BTreeSet<PartitionId>>,
    }

    impl Wrong {
        fn new(inner: Arc<MemStore>, flaw: Flaw) -> Arc<Wrong> {
            Arc::new(Wrong {
                inner,
                flaw,
                recovered: Default::default(),
            })
        }
    }

    impl Store for Wrong {
        fn allocate_ids(&self, n: u64) -> MessageId {
            self.inner.allocate_ids(n)
        }
        fn append(
            &self,
            ops: &[Op<'_>],
            locations: &mut Vec<Location>,
        ) -> Result<Ticket, StoreError> {
            self.inner.append(ops, locations)
        }
        fn when_durable(&self, ticket: Ticket, waiter: Waiter) {
            if self.flaw == Flaw::Overtaking && self.inner.ticket_durable(ticket) {
                return waiter(Ok(()));
            }
            self.inner.when_durable(ticket, waiter)
        }
        fn read_many(
            &self,
            refs: &[MessageRef],
        ) -> ReadFuture<Vec<Result<StoredMessage, StoreError>>> {
            let mut out = crate::block_on(self.inner.read_many(refs));
            if self.flaw == Flaw::ReversedReads {
                out.reverse();
            }
            crate::ready(out)
        }
        fn read_range(
            &self,
            partition: PartitionId,
            from: MessageId,
            max: usize,
        ) -> ReadFuture<Result<Vec<RangeMessage>, StoreError>> {
            self.inner.read_range(partition, from, max)
        }
        fn read(&self, location: Location) -> Result<StoredMessage, StoreError> {
            self.inner.read(location)
        }
        fn recovered_meta(&self) -> Result<RecoveredMeta, StoreError> {
            self.inner.recovered_meta()
        }
        fn put_if(
            &self,
            key: &[u8],
            value: Option<&[u8]>,
            expected: u64,
        ) -> Result<(Ticket, u64), StoreError> {
            if self.flaw == Flaw::LastWriterWins {
                let found = self
                    .inner
                    .recovered_meta()?
                    .key_versions
                    .get(key)
                    .copied()
                    .unwrap_or(0);
                return self.inner.put_if(key, value, found);
            }
            self.inner.put_if(key, value, expected)
        }
        fn watch(&self, since: u64, wake: Wake) -> Result<MetaFeed, StoreError> {
            if self.flaw == Flaw::SilentFeed {
                return Ok(MetaFeed::Changes(Vec::new()));
            }
            self.inner.watch(since, wake)
        }
        fn acquire(&self, partition: PartitionId) -> Result<Epoch, StoreError> {
            if self.flaw == Flaw::NoFencing {
                // Growing epochs, shared by every handle, but no owner kept.
                static EPOCHS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
                return Ok(Epoch(EPOCHS.fetch_add(1, Ordering::SeqCst) + 1));
            }
            self.inner.acquire(partition)
        }
        fn try_acquire(&self, partition: PartitionId) -> Result<Option<Epoch>, StoreError> {
            if self.flaw == Flaw::NoFencing {
                return self.acquire(partition).map(Some);
            }
            self.inner.try_acquire(partition)
        }
        fn recovered_partitions(&self) -> Result<Vec<PartitionId>, StoreError> {
            self.inner.recovered_partitions()
        }
        fn recover_partition(
            &self,
            partition: PartitionId,
        ) -> Result<Vec<RecoveredMessage>, StoreError> {
            if self.flaw == Flaw::OnceRecovery && !self.recovered.lock().insert(partition) {
                return Ok(Vec::new());
            }
            self.inner.recover_partition(partition)
        }
        fn recover_receipts(&self, partition: PartitionId) -> Result<Vec<Receipt>, StoreError> {
            self.inner.recover_receipts(partition)
        }
        fn compact(&self, live: &dyn LiveSet) -> Result<usize, StoreError> {
            self.inner.compact(live)
        }
        fn stats(&self) -> StoreStats {
            self.inner.stats()
        }
        fn close(&self) -> Result<(), StoreError> {
            self.inner.close()
        }
        fn scan_state(&self, prefix: &[u8]) -> Result<Vec<crate::StateEntry>, StoreError> {
            self.inner.scan_state(prefix)
        }
    }

    struct WrongHarness {
        flaw: Flaw,
        current: Option<Arc<MemStore>>,
    }

    impl Harness for WrongHarness {
        fn create(&mut self) -> Arc<dyn Store> {
            let s = MemStore::new();
            self.current = Some(s.clone());
            Wrong::new(s, self.flaw)
        }
        fn persists(&self) -> bool {
            true
        }
        fn reopen(&mut self, store: Arc<dyn Store>) -> Arc<dyn Store> {
            drop(store);
            let s = self.current.take().expect("created").reopen();
            self.current = Some(s.clone());
            Wrong::new(s, self.flaw)
        }
        fn second_handle(&mut self, _store: &Arc<dyn Store>) -> Option<Arc<dyn Store>> {
            let s = self.current.as_ref().expect("created").handle();
            Some(Wrong::new(s, self.flaw))
        }
        fn crash(&mut self, store: Arc<dyn Store>) -> Option<Arc<dyn Store>> {
            drop(store);
            let s = self.current.take().expect("created").crash();
            self.current = Some(s.clone());
            Some(Wrong::new(s, self.flaw))
        }
        fn hold(&mut self, _store: &Arc<dyn Store>) -> bool {
            self.current
                .as_ref()
                .expect("created")
                .hold_durability(true);
            true
        }
        fn release(&mut self, _store: &Arc<dyn Store>, ticket: Ticket) {
            let s = self.current.as_ref().expect("created");
            if self.flaw == Flaw::NoPrefix {
                s.release_only(ticket);
            } else {
                s.release_ticket(ticket);
            }
        }
    }

    /// Runs `rule` against a store with `flaw` and expects it to fail.
    fn fails(flaw: Flaw, rule: fn(&mut dyn Harness)) {
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            rule(&mut WrongHarness {
                flaw,
                current: None,
            })
        }));
        assert!(r.is_err(), "the rule passed a store with {flaw:?}");
    }

    #[test]
    fn a_crash_losing_an_earlier_append_of_a_partition_fails_the_prefix_rule() {
        fails(Flaw::NoPrefix, crash_keeps_a_prefix_per_partition);
    }

    #[test]
    fn an_overtaking_waiter_fails_the_order_rule() {
        fails(Flaw::Overtaking, waiters_are_called_in_registration_order);
    }

    #[test]
    fn a_store_without_fencing_fails_the_fencing_rule() {
        fails(Flaw::NoFencing, a_deposed_handle_is_fenced);
    }

    #[test]
    fn a_one_time_recovery_fails_the_recovery_rule() {
        fails(Flaw::OnceRecovery, recovery_answers_at_any_time);
    }

    #[test]
    fn last_writer_wins_fails_the_conditional_put_rule() {
        fails(Flaw::LastWriterWins, conditional_puts_race_one_wins);
    }

    #[test]
    fn a_silent_feed_fails_the_change_feed_rule() {
        fails(Flaw::SilentFeed, the_change_feed_reaches_a_second_handle);
    }

    #[test]
    fn reordered_reads_fail_the_read_rule() {
        fails(Flaw::ReversedReads, batched_reads_answer_in_order);
    }

    #[test]
    fn the_mem_store_passes_every_v2_rule_with_its_flaws_off() {
        // The same harness with a harmless flaw per rule: each rule passes
        // unless its own flaw is on (the wrapper itself is sound).
        type Rule = fn(&mut dyn Harness);
        let rules: [(Flaw, Rule); 7] = [
            (Flaw::ReversedReads, crash_keeps_a_prefix_per_partition),
            (
                Flaw::ReversedReads,
                waiters_are_called_in_registration_order,
            ),
            (Flaw::ReversedReads, a_deposed_handle_is_fenced),
            (Flaw::ReversedReads, recovery_answers_at_any_time),
            (Flaw::ReversedReads, conditional_puts_race_one_wins),
            (Flaw::ReversedReads, the_change_feed_reaches_a_second_handle),
            (Flaw::NoPrefix, batched_reads_answer_in_order),
        ];
        for (flaw, rule) in rules {
            rule(&mut WrongHarness {
                flaw,
                current: None,
            });
        }
    }
}
