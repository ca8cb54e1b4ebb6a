//! The contract every [`Store`] implementation must pass.
//!
//! An implementation's tests provide a [`Harness`] (how to create a fresh
//! store and, for stores that persist, how to restart one over the same
//! data) and call [`run_all`]. The parts that need a restart are skipped
//! when [`Harness::persists`] is false.
//!
//! The suite assumes records of a few KB fit (the embedded log's tests use
//! 4 KiB segments, small enough that compaction and reclamation take part).

use crate::{
    LiveSet, Location, MessageAttrs, MessageData, MessageId, Op, PartitionId, Receipt,
    RecoveredMessage, Relocation, Store, StoreError, Ticket,
};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

/// How the suite gets stores.
pub trait Harness {
    /// A new, empty store.
    fn create(&mut self) -> Arc<dyn Store>;

    /// Whether [`Harness::reopen`] is supported.
    fn persists(&self) -> bool;

    /// Closes `store` (the last one [`Harness::create`]d or reopened) and
    /// opens it again over the same data, as a restart does. Only called
    /// when [`Harness::persists`].
    fn reopen(&mut self, store: Arc<dyn Store>) -> Arc<dyn Store>;

    /// Another handle on the same data as `store` (the last one created or
    /// reopened), as a second process sharing the store would open. `None`
    /// skips the rules about several handles.
    fn second_handle(&mut self, store: &Arc<dyn Store>) -> Option<Arc<dyn Store>> {
        let _ = store;
        None
    }

    /// Loses power under `store`: a new store over what survives (only
    /// what completed tickets covered). `None` skips the crash rules.
    fn crash(&mut self, store: Arc<dyn Store>) -> Option<Arc<dyn Store>> {
        let _ = store;
        None
    }

    /// From now on `store`'s appends are durable only when
    /// [`Harness::release`] says so. `false` (the default) when the store
    /// cannot hold durability back; the rules then wait instead.
    fn hold(&mut self, store: &Arc<dyn Store>) -> bool {
        let _ = store;
        false
    }

    /// Under [`Harness::hold`]: makes `ticket` durable, with what it
    /// covers.
    fn release(&mut self, store: &Arc<dyn Store>, ticket: Ticket) {
        let _ = (store, ticket);
    }
}

/// Restarts `store` when the harness can; `Err` gives it back otherwise.
fn restart(h: &mut dyn Harness, store: Arc<dyn Store>) -> Result<Arc<dyn Store>, Arc<dyn Store>> {
    if h.persists() {
        Ok(h.reopen(store))
    } else {
        Err(store)
    }
}

/// Runs every contract test.
pub fn run_all(h: &mut dyn Harness) {
    ids_are_unique_and_increasing(h);
    append_read_roundtrip(h);
    invalid_publish_is_rejected_whole(h);
    metadata_is_versioned_and_survives_restart(h);
    meta_batch_is_one_version_and_survives_restart(h);
    recovery_is_per_partition(h);
    compaction_keeps_every_message_readable(h);
    closed_store_refuses_appends(h);
    delayed_publish_keeps_deliver_at(h);
    move_is_atomic_and_recovered_only_in_its_targets(h);
    requeue_state_survives_restart_and_compaction(h);
    settled_requeued_message_stays_settled(h);
    settles_during_compaction_win(h);
    receipts_survive_restart_and_compaction_until_they_expire(h);
    for seed in 0..4 {
        randomized_against_a_model(h, seed);
    }
    super::contract_lifecycle::run_all(h);
    super::contract_v2::run_all(h);
}

const P1: PartitionId = PartitionId(1);
const P2: PartitionId = PartitionId(2);
const P3: PartitionId = PartitionId(3);
const P4: PartitionId = PartitionId(4);

fn data(body: &[u8]) -> MessageData<'_> {
    MessageData {
        exchange: "ex",
        routing_key: "rk",
        header_format: 2,
        header: b"hdr",
        body,
        attrs: MessageAttrs {
            priority: 3,
            expires_at_ms: 77,
            deliver_at_ms: 0,
        },
    }
}

/// Appends and waits until its ticket is durable.
fn append_wait(store: &dyn Store, ops: &[Op<'_>]) -> Vec<Location> {
    let mut locs = Vec::new();
    let ticket = store.append(ops, &mut locs).expect("append");
    wait_durable(store, ticket);
    locs
}

/// Waits until `ticket` is durable; its waiter is called exactly once.
pub(crate) fn wait_durable(store: &dyn Store, ticket: Ticket) {
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
    assert!(
        rx.recv_timeout(Duration::from_millis(1)).is_err(),
        "waiter called once"
    );
}

/// A partition no rule uses: [`nudge`] writes there.
const SCRATCH: PartitionId = PartitionId(1 << 40);

/// Gives a store's background work rounds to run in (a log's writer
/// reclaims after a round): a message published and settled in a
/// partition of its own, each waited for.
pub(crate) fn nudge(store: &dyn Store) {
    let id = store.allocate_ids(1);
    let locs = append_wait(
        store,
        &[Op::Publish {
            id,
            partitions: &[SCRATCH],
            data: data(b""),
        }],
    );
    append_wait(
        store,
        &[Op::Settle {
            partition: SCRATCH,
            id,
            location: locs[0],
        }],
    );
}

fn publish(store: &dyn Store, parts: &[PartitionId], body: &[u8]) -> (MessageId, Location) {
    let id = store.allocate_ids(1);
    let locs = append_wait(
        store,
        &[Op::Publish {
            id,
            partitions: parts,
            data: data(body),
        }],
    );
    assert_eq!(locs.len(), 1);
    (id, locs[0])
}

fn settle(store: &dyn Store, partition: PartitionId, id: MessageId, location: Location) {
    append_wait(
        store,
        &[Op::Settle {
            partition,
            id,
            location,
        }],
    );
}

/// Pages `data` for `id` into the store's spill; None if it has none.
fn spill(
    store: &dyn Store,
    id: MessageId,
    partitions: &[PartitionId],
    data: MessageData<'_>,
) -> Option<Location> {
    let s = store.spill()?;
    let (loc, _) = s
        .spill(crate::ShareTag::BROKER, id, partitions, data)
        .expect("spill");
    assert!(s.holds(loc), "a spill holds its own positions");
    Some(loc)
}

/// Reads `loc` from the store, or from its spill if it is the spill's.
fn read_any(store: &dyn Store, loc: Location) -> Result<crate::StoredMessage, StoreError> {
    match store.spill() {
        Some(s) if s.holds(loc) => s.read(loc),
        _ => store.read(loc),
    }
}

fn check_read(store: &dyn Store, loc: Location, id: MessageId, body: &[u8]) {
    let m = read_any(store, loc).unwrap_or_else(|e| panic!("read {loc:?}: {e}"));
    assert_eq!((m.id, &m.body[..]), (id, body), "read {loc:?}");
}

/// Ids only grow, even past ids the caller chose itself, and across restarts.
pub fn ids_are_unique_and_increasing(h: &mut dyn Harness) {
    let store = h.create();
    let a = store.allocate_ids(1);
    let b = store.allocate_ids(5);
    let c = store.allocate_ids(1);
    assert!(b > a && c >= b + 5, "{a} {b} {c}");
    // A publish under an id the store never handed out.
    append_wait(
        &*store,
        &[Op::Publish {
            id: c + 100,
            partitions: &[P1],
            data: data(b"x"),
        }],
    );
    assert!(store.allocate_ids(1) > c + 100);
    if let Ok(store) = restart(h, store) {
        assert!(store.allocate_ids(1) > c + 100, "ids reused after restart");
        store.close().expect("close");
    }
}

/// Every field comes back as appended; one location per publish, none for
/// other ops, in order; a spilled copy reads back from the spill.
pub fn append_read_roundtrip(h: &mut dyn Harness) {
    let store = h.create();
    let id = store.allocate_ids(2);
    let mut locs = append_wait(
        &*store,
        &[
            Op::PutMeta {
                key: b"k",
                value: b"v",
            },
            Op::Publish {
                id,
                partitions: &[P1, P2],
                data: data(b"first"),
            },
        ],
    );
    assert_eq!(locs.len(), 1);
    let Some(paged) = spill(
        &*store,
        id + 1,
        &[P3],
        MessageData {
            header_format: 1,
            ..data(b"paged")
        },
    ) else {
        store.close().expect("close");
        return;
    };
    locs.push(paged);
    assert_ne!(locs[0], locs[1]);
    assert!(
        store.spill().is_some_and(|s| !s.holds(locs[0])),
        "a stored message's position is not the spill's"
    );
    let m = store.read(locs[0]).expect("read");
    assert_eq!(m.id, id);
    assert_eq!((m.exchange.as_str(), m.routing_key.as_str()), ("ex", "rk"));
    assert_eq!((m.header_format, &m.header[..]), (2, &b"hdr"[..]));
    assert_eq!(&m.body[..], b"first");
    assert_eq!(
        m.attrs,
        MessageAttrs {
            priority: 3,
            expires_at_ms: 77,
            deliver_at_ms: 0,
        }
    );
    let p = read_any(&*store, locs[1]).expect("read paged");
    assert_eq!(
        (p.id, p.header_format, &p.body[..]),
        (id + 1, 1, &b"paged"[..])
    );
    // An empty batch covers nothing: its ticket is durable at once.
    let none = store.append(&[], &mut Vec::new()).expect("empty append");
    assert_eq!(none, Ticket::NONE);
    wait_durable(&*store, none);
    store.close().expect("close");
}

/// A batch with an invalid op leaves nothing behind.
pub fn invalid_publish_is_rejected_whole(h: &mut dyn Harness) {
    let store = h.create();
    let mut locs = Vec::new();
    let r = store.append(
        &[
            Op::PutMeta {
                key: b"k",
                value: b"v",
            },
            Op::Publish {
                id: store.allocate_ids(1),
                partitions: &[],
                data: data(b"x"),
            },
        ],
        &mut locs,
    );
    assert!(r.is_err());
    assert!(locs.is_empty());
    let meta = store.recovered_meta().expect("meta");
    assert!(meta.meta.is_empty() && meta.version == 0);
    store.close().expect("close");
}

/// Every put and delete is one version; the map and version survive a restart.
pub fn metadata_is_versioned_and_survives_restart(h: &mut dyn Harness) {
    let store = h.create();
    append_wait(
        &*store,
        &[
            Op::PutMeta {
                key: b"q1",
                value: b"v1",
            },
            Op::PutMeta {
                key: b"q2",
                value: b"v2",
            },
            Op::DeleteMeta { key: b"q1" },
        ],
    );
    // Appended without a waiter: a clean close still makes it durable.
    store
        .append(
            &[Op::PutMeta {
                key: b"q3",
                value: b"v3",
            }],
            &mut Vec::new(),
        )
        .expect("append");
    let want: BTreeMap<Vec<u8>, Vec<u8>> = [
        (b"q2".to_vec(), b"v2".to_vec()),
        (b"q3".to_vec(), b"v3".to_vec()),
    ]
    .into_iter()
    .collect();
    let m = store.recovered_meta().expect("meta");
    assert_eq!((&m.meta, m.version), (&want, 4));
    if let Ok(store) = restart(h, store) {
        let m = store.recovered_meta().expect("meta");
        assert_eq!((&m.meta, m.version), (&want, 4));
        assert_eq!(m.truncated_bytes, 0);
        store.close().expect("close");
    }
}

/// A meta batch is applied in order as one version and survives a restart.
pub fn meta_batch_is_one_version_and_survives_restart(h: &mut dyn Harness) {
    use crate::MetaChange;
    let store = h.create();
    append_wait(
        &*store,
        &[Op::PutMeta {
            key: b"old",
            value: b"1",
        }],
    );
    append_wait(
        &*store,
        &[Op::MetaBatch {
            changes: &[
                MetaChange::Put {
                    key: b"a",
                    value: b"x",
                },
                MetaChange::Delete { key: b"old" },
                MetaChange::Put {
                    key: b"b",
                    value: b"y",
                },
                MetaChange::Put {
                    key: b"a",
                    value: b"z",
                },
            ],
        }],
    );
    let want: BTreeMap<Vec<u8>, Vec<u8>> = [
        (b"a".to_vec(), b"z".to_vec()),
        (b"b".to_vec(), b"y".to_vec()),
    ]
    .into_iter()
    .collect();
    let m = store.recovered_meta().expect("meta");
    assert_eq!((&m.meta, m.version), (&want, 2));
    if let Ok(store) = restart(h, store) {
        let m = store.recovered_meta().expect("meta");
        assert_eq!((&m.meta, m.version), (&want, 2));
        store.close().expect("close");
    }
}

/// After a restart each partition's live messages come back on their own,
/// in id order, with size and attributes; paged and settled ones do not.
pub fn recovery_is_per_partition(h: &mut dyn Harness) {
    let store = h.create();
    assert!(store.recovered_partitions().expect("list").is_empty());
    assert!(store.recover_partition(P1).expect("recover").is_empty());
    let a = publish(&*store, &[P1, P2], b"a");
    let b = publish(&*store, &[P1], b"bb");
    let c = publish(&*store, &[P2, P3], b"ccc");
    let d = store.allocate_ids(1);
    spill(&*store, d, &[P4], data(b"paged"));
    settle(&*store, P1, a.0, a.1);
    settle(&*store, P3, c.0, c.1);
    let store = match restart(h, store) {
        Ok(s) => s,
        Err(s) => {
            s.close().expect("close");
            return;
        }
    };
    let parts: BTreeSet<_> = store
        .recovered_partitions()
        .expect("list")
        .into_iter()
        .collect();
    assert_eq!(parts, [P1, P2].into_iter().collect());
    // Out of order on purpose: a gateway recovers only what it owns.
    let p2 = store.recover_partition(P2).expect("recover");
    assert_eq!(
        p2.iter().map(|m| (m.id, m.location)).collect::<Vec<_>>(),
        vec![(a.0, a.1), (c.0, c.1)]
    );
    assert_eq!(p2[0].size, 1, "size counts the body only");
    assert_eq!(
        p2[1].attrs,
        MessageAttrs {
            priority: 3,
            expires_at_ms: 77,
            deliver_at_ms: 0,
        }
    );
    let p1 = store.recover_partition(P1).expect("recover");
    assert_eq!(
        p1.iter().map(|m| m.id).collect::<Vec<_>>(),
        vec![b.0],
        "P1's settle of a is kept"
    );
    assert!(store.recover_partition(P3).expect("recover").is_empty());
    assert!(
        store.recover_partition(P4).expect("recover").is_empty(),
        "paged data survived a restart"
    );
    check_read(&*store, a.1, a.0, b"a");
    check_read(&*store, c.1, c.0, b"ccc");
    assert!(store.allocate_ids(1) > d, "paged ids are never reused");
    store.close().expect("close");
}

/// A caller's view of the live positions, as the engine keeps them.
#[derive(Default)]
struct Model {
    live: std::cell::RefCell<BTreeMap<(PartitionId, MessageId), Kept>>,
}

struct Kept {
    loc: Location,
    body: Vec<u8>,
    paged: bool,
    /// Last requeue's attempts.
    attempts: u32,
    /// Last requeue's deliver_at_ms (or the published one).
    deliver_at: u64,
}

impl Kept {
    fn new(loc: Location, body: Vec<u8>, paged: bool) -> Self {
        Kept {
            loc,
            body,
            paged,
            attempts: 0,
            deliver_at: 0,
        }
    }
}

impl LiveSet for Model {
    fn for_each_live(&self, visit: &mut dyn FnMut(PartitionId, MessageId, Location)) {
        for ((p, id), k) in self.live.borrow().iter() {
            visit(*p, *id, k.loc);
        }
    }

    fn relocate(&self, moves: &[Relocation]) -> Vec<bool> {
        let mut live = self.live.borrow_mut();
        moves
            .iter()
            .map(|m| match live.get_mut(&(m.partition, m.id)) {
                Some(k) if k.loc == m.old => {
                    k.loc = m.new;
                    true
                }
                _ => false,
            })
            .collect()
    }
}

/// Compaction moves positions only through the `&mut`; every message stays
/// readable where the caller now has it, settles at the new positions work,
/// and a restart finds the new positions.
pub fn compaction_keeps_every_message_readable(h: &mut dyn Harness) {
    let store = h.create();
    let model = Model::default();
    let mut settles = Vec::new();
    for i in 0..80u32 {
        let body = vec![i as u8; 200];
        let (id, loc) = publish(&*store, &[P1], &body);
        if i % 8 == 0 {
            model
                .live
                .borrow_mut()
                .insert((P1, id), Kept::new(loc, body, false));
        } else {
            settles.push(Op::Settle {
                partition: P1,
                id,
                location: loc,
            });
        }
    }
    append_wait(&*store, &settles);
    for _ in 0..10 {
        let before: BTreeMap<_, _> = model
            .live
            .borrow()
            .iter()
            .map(|(k, v)| (*k, v.loc))
            .collect();
        let moved = store.compact(&model).expect("compact");
        let changed = model
            .live
            .borrow()
            .iter()
            .filter(|(k, v)| before[k] != v.loc)
            .count();
        assert_eq!(moved, changed, "compact reports what it moved");
        nudge(&*store);
        for ((_, id), k) in model.live.borrow().iter() {
            check_read(&*store, k.loc, *id, &k.body);
        }
        if moved == 0 {
            break;
        }
    }
    let store = match restart(h, store) {
        Ok(s) => {
            let got: Vec<_> = s
                .recover_partition(P1)
                .expect("recover")
                .into_iter()
                .map(|m| (m.id, m.location))
                .collect();
            let want: Vec<_> = model
                .live
                .borrow()
                .iter()
                .map(|((_, id), k)| (*id, k.loc))
                .collect();
            assert_eq!(got, want);
            s
        }
        Err(s) => s,
    };
    // Settle the survivors where they are now: nothing is left.
    let ops: Vec<Op<'_>> = model
        .live
        .borrow()
        .iter()
        .map(|((p, id), k)| Op::Settle {
            partition: *p,
            id: *id,
            location: k.loc,
        })
        .collect();
    append_wait(&*store, &ops);
    match restart(h, store) {
        Ok(store) => {
            assert!(store.recover_partition(P1).expect("recover").is_empty());
            store.close().expect("close");
        }
        Err(store) => store.close().expect("close"),
    }
}

/// After close nothing is accepted.
pub fn closed_store_refuses_appends(h: &mut dyn Harness) {
    let store = h.create();
    publish(&*store, &[P1], b"x");
    store.close().expect("close");
    assert!(matches!(
        store.append(&[], &mut Vec::new()),
        Err(StoreError::Closed)
    ));
}

/// SplitMix64: a dependency-free generator for the randomized test.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// Random publishes, pages, settles, compactions, metadata changes and
/// restarts, checked against a plain model of what must be live.
pub fn randomized_against_a_model(h: &mut dyn Harness, seed: u64) {
    let mut rng = Rng(seed.wrapping_mul(0x1234_5678_9abc_def1) ^ 0x5eed);
    let parts = [P1, P2, P3, P4];
    let model = Model::default();
    let mut meta: BTreeMap<Vec<u8>, Vec<u8>> = BTreeMap::new();
    let mut meta_version = 0u64;
    let mut last_id = 0;
    let mut store = h.create();
    for step in 0..1500 {
        let r = rng.below(100);
        if r < 45 {
            let n = 1 + rng.below(3) as usize;
            let mut ps: Vec<PartitionId> = parts.to_vec();
            for i in (1..ps.len()).rev() {
                ps.swap(i, rng.below(i as u64 + 1) as usize);
            }
            ps.truncate(n);
            let len = rng.below(400) as usize;
            let body: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
            let id = store.allocate_ids(1 + rng.below(2));
            assert!(
                id > last_id,
                "seed {seed} step {step}: id {id} after {last_id}"
            );
            last_id = id;
            let paged_loc = if r < 5 {
                spill(&*store, id, &ps, data(&body))
            } else {
                None
            };
            let paged = paged_loc.is_some();
            let mut locs = Vec::new();
            match paged_loc {
                Some(loc) => locs.push(loc),
                None => {
                    store
                        .append(
                            &[Op::Publish {
                                id,
                                partitions: &ps,
                                data: data(&body),
                            }],
                            &mut locs,
                        )
                        .expect("append");
                }
            }
            assert_eq!(locs.len(), 1);
            for p in ps {
                model
                    .live
                    .borrow_mut()
                    .insert((p, id), Kept::new(locs[0], body.clone(), paged));
            }
        } else if (65..72).contains(&r) && model.live.borrow().values().any(|k| !k.paged) {
            // A move (dead-lettering) of a stored message, or a requeue.
            let mut live = model.live.borrow_mut();
            let stored: Vec<_> = live
                .iter()
                .filter(|(_, k)| !k.paged)
                .map(|(k, _)| *k)
                .collect();
            let (p, from_id) = stored[rng.below(stored.len() as u64) as usize];
            if r < 69 {
                let mut ps: Vec<PartitionId> = parts.to_vec();
                for i in (1..ps.len()).rev() {
                    ps.swap(i, rng.below(i as u64 + 1) as usize);
                }
                ps.truncate(1 + rng.below(3) as usize);
                let kept = live.remove(&(p, from_id)).expect("present");
                let body: Vec<u8> = (0..rng.below(300)).map(|_| rng.next() as u8).collect();
                let id = store.allocate_ids(1);
                assert!(id > last_id);
                last_id = id;
                let mut locs = Vec::new();
                store
                    .append(
                        &[Op::Move {
                            id,
                            partitions: &ps,
                            data: data(&body),
                            from: p,
                            from_id,
                            from_location: kept.loc,
                        }],
                        &mut locs,
                    )
                    .expect("move");
                assert_eq!(locs.len(), 1);
                for q in ps {
                    live.insert((q, id), Kept::new(locs[0], body.clone(), false));
                }
            } else {
                let k = live.get_mut(&(p, from_id)).expect("present");
                k.attempts += 1 + rng.below(3) as u32;
                k.deliver_at = if rng.below(2) == 0 {
                    0
                } else {
                    rng.next() >> 20
                };
                store
                    .append(
                        &[Op::Requeue {
                            partition: p,
                            id: from_id,
                            location: k.loc,
                            attempts: k.attempts,
                            deliver_at_ms: k.deliver_at,
                        }],
                        &mut Vec::new(),
                    )
                    .expect("requeue");
            }
        } else if r < 72 && !model.live.borrow().is_empty() {
            let mut live = model.live.borrow_mut();
            let k = *live
                .keys()
                .nth(rng.below(live.len() as u64) as usize)
                .expect("non-empty");
            let kept = live.remove(&k).expect("present");
            if kept.paged {
                store
                    .spill()
                    .expect("paged through it")
                    .release(k.0, k.1, kept.loc);
            } else {
                store
                    .append(
                        &[Op::Settle {
                            partition: k.0,
                            id: k.1,
                            location: kept.loc,
                        }],
                        &mut Vec::new(),
                    )
                    .expect("settle");
            }
        } else if r < 80 {
            let key = vec![rng.below(8) as u8];
            meta_version += 1;
            if rng.below(10) < 7 {
                let value = vec![rng.next() as u8; rng.below(20) as usize];
                store
                    .append(
                        &[Op::PutMeta {
                            key: &key,
                            value: &value,
                        }],
                        &mut Vec::new(),
                    )
                    .expect("put");
                meta.insert(key, value);
            } else {
                store
                    .append(&[Op::DeleteMeta { key: &key }], &mut Vec::new())
                    .expect("delete");
                meta.remove(&key);
            }
        } else if r < 90 {
            store.compact(&model).expect("compact");
        } else if r < 93 {
            store = match restart(h, store) {
                Ok(s) => {
                    // Paged data dies with the process.
                    model.live.borrow_mut().retain(|_, k| !k.paged);
                    check(&*s, &model, &meta, meta_version, seed, step);
                    s
                }
                Err(s) => s,
            };
        } else if let Some(((_, id), k)) = model.live.borrow().iter().next() {
            check_read(&*store, k.loc, *id, &k.body);
        }
    }
    for ((_, id), k) in model.live.borrow().iter() {
        check_read(&*store, k.loc, *id, &k.body);
    }
    match restart(h, store) {
        Ok(store) => {
            model.live.borrow_mut().retain(|_, k| !k.paged);
            check(&*store, &model, &meta, meta_version, seed, usize::MAX);
            assert!(store.allocate_ids(1) > last_id);
            store.close().expect("close");
        }
        Err(store) => store.close().expect("close"),
    }
}

/// Checks a restarted store against the model: metadata, and per partition
/// exactly the live messages, at the model's positions, readable.
fn check(
    store: &dyn Store,
    model: &Model,
    meta: &BTreeMap<Vec<u8>, Vec<u8>>,
    meta_version: u64,
    seed: u64,
    step: usize,
) {
    let m = store.recovered_meta().expect("meta");
    assert_eq!(&m.meta, meta, "seed {seed}: meta at step {step}");
    assert_eq!(
        m.version, meta_version,
        "seed {seed}: version at step {step}"
    );
    assert_eq!(m.truncated_bytes, 0);
    type Want = (MessageId, Location, u32, u64);
    let mut want: BTreeMap<PartitionId, Vec<Want>> = BTreeMap::new();
    for ((p, id), k) in model.live.borrow().iter() {
        want.entry(*p)
            .or_default()
            .push((*id, k.loc, k.attempts, k.deliver_at));
    }
    let listed: BTreeSet<PartitionId> = store
        .recovered_partitions()
        .expect("list")
        .into_iter()
        .collect();
    assert_eq!(
        listed,
        want.keys().copied().collect(),
        "seed {seed}: partitions at step {step}"
    );
    for (p, msgs) in &want {
        let got: Vec<_> = store
            .recover_partition(*p)
            .expect("recover")
            .into_iter()
            .map(|m| (m.id, m.location, m.attempts, m.attrs.deliver_at_ms))
            .collect();
        assert_eq!(&got, msgs, "seed {seed}: partition {p:?} at step {step}");
    }
    for ((_, id), k) in model.live.borrow().iter() {
        check_read(store, k.loc, *id, &k.body);
    }
}

fn delayed(body: &[u8], deliver_at_ms: u64) -> MessageData<'_> {
    let mut d = data(body);
    d.attrs.deliver_at_ms = deliver_at_ms;
    d
}

/// The recovered messages of `p` by id.
fn recovered(store: &dyn Store, p: PartitionId) -> BTreeMap<MessageId, RecoveredMessage> {
    store
        .recover_partition(p)
        .expect("recover")
        .into_iter()
        .map(|m| (m.id, m))
        .collect()
}

/// A delayed message's `deliver_at_ms` is stored with it: reads and
/// recovery return it; a plain one has 0.
pub fn delayed_publish_keeps_deliver_at(h: &mut dyn Harness) {
    let store = h.create();
    let id = store.allocate_ids(2);
    let locs = append_wait(
        &*store,
        &[
            Op::Publish {
                id,
                partitions: &[P1],
                data: delayed(b"later", 1_700_000_123_456),
            },
            Op::Publish {
                id: id + 1,
                partitions: &[P1],
                data: data(b"now"),
            },
        ],
    );
    let m = store.read(locs[0]).expect("read");
    assert_eq!(m.attrs.deliver_at_ms, 1_700_000_123_456);
    assert_eq!((m.attrs.priority, m.attrs.expires_at_ms), (3, 77));
    assert_eq!(store.read(locs[1]).expect("read").attrs.deliver_at_ms, 0);
    let store = match restart(h, store) {
        Ok(s) => s,
        Err(s) => return s.close().expect("close"),
    };
    let got = recovered(&*store, P1);
    assert_eq!(got[&id].attrs.deliver_at_ms, 1_700_000_123_456);
    assert_eq!(got[&id].attempts, 0);
    assert_eq!(got[&(id + 1)].attrs.deliver_at_ms, 0);
    check_read(&*store, locs[0], id, b"later");
    store.close().expect("close");
}

/// A move settles the source and publishes the new message in one step:
/// after a restart the message is only in the target partitions, readable
/// at the location the move returned, and other partitions of the source
/// keep their copy.
pub fn move_is_atomic_and_recovered_only_in_its_targets(h: &mut dyn Harness) {
    let store = h.create();
    let (old, old_loc) = publish(&*store, &[P1, P2], b"poison");
    // A move needs at least one target; a bad batch leaves nothing behind.
    let new = store.allocate_ids(1);
    let r = store.append(
        &[
            Op::Settle {
                partition: P2,
                id: old,
                location: old_loc,
            },
            Op::Move {
                id: new,
                partitions: &[],
                data: data(b"dead"),
                from: P1,
                from_id: old,
                from_location: old_loc,
            },
        ],
        &mut Vec::new(),
    );
    assert!(r.is_err());
    let locs = append_wait(
        &*store,
        &[Op::Move {
            id: new,
            partitions: &[P3, P4],
            data: delayed(b"dead", 42),
            from: P1,
            from_id: old,
            from_location: old_loc,
        }],
    );
    assert_eq!(locs.len(), 1, "a move returns the new record's location");
    let m = store.read(locs[0]).expect("read");
    assert_eq!(
        (m.id, &m.body[..], m.attrs.deliver_at_ms),
        (new, &b"dead"[..], 42)
    );
    // The source is still readable where P2 holds it.
    check_read(&*store, old_loc, old, b"poison");
    let store = match restart(h, store) {
        Ok(s) => s,
        Err(s) => return s.close().expect("close"),
    };
    let parts: BTreeSet<_> = store
        .recovered_partitions()
        .expect("list")
        .into_iter()
        .collect();
    assert_eq!(parts, [P2, P3, P4].into_iter().collect());
    assert!(recovered(&*store, P1).is_empty(), "the source came back");
    let p2 = recovered(&*store, P2);
    assert_eq!(p2.keys().copied().collect::<Vec<_>>(), vec![old]);
    for p in [P3, P4] {
        let got = recovered(&*store, p);
        assert_eq!(got.len(), 1);
        let m = got[&new];
        assert_eq!(
            (m.location, m.attempts, m.attrs.deliver_at_ms),
            (locs[0], 0, 42)
        );
    }
    check_read(&*store, locs[0], new, b"dead");
    assert!(store.allocate_ids(1) > new);
    // Settle everything: nothing comes back.
    append_wait(
        &*store,
        &[
            Op::Settle {
                partition: P2,
                id: old,
                location: old_loc,
            },
            Op::Settle {
                partition: P3,
                id: new,
                location: locs[0],
            },
            Op::Settle {
                partition: P4,
                id: new,
                location: locs[0],
            },
        ],
    );
    let store = h.reopen(store);
    assert!(store.recovered_partitions().expect("list").is_empty());
    store.close().expect("close");
}

/// The last requeue's attempts and deliver_at survive restarts and
/// compaction (whatever the store does with the records), per partition.
pub fn requeue_state_survives_restart_and_compaction(h: &mut dyn Harness) {
    let store = h.create();
    let model = Model::default();
    let mut settles = Vec::new();
    let mut requeues = Vec::new();
    for i in 0..80u32 {
        let body = vec![i as u8; 200];
        let parts: &[PartitionId] = if i % 16 == 0 { &[P1, P2] } else { &[P1] };
        let (id, loc) = publish(&*store, parts, &body);
        // Every message is requeued; the survivors twice.
        requeues.push(Op::Requeue {
            partition: P1,
            id,
            location: loc,
            attempts: 1,
            deliver_at_ms: 500,
        });
        if i % 8 == 0 {
            let mut k = Kept::new(loc, body.clone(), false);
            (k.attempts, k.deliver_at) = (2 + i, 1000 + u64::from(i));
            requeues.push(Op::Requeue {
                partition: P1,
                id,
                location: loc,
                attempts: k.attempts,
                deliver_at_ms: k.deliver_at,
            });
            model.live.borrow_mut().insert((P1, id), k);
        } else {
            settles.push(Op::Settle {
                partition: P1,
                id,
                location: loc,
            });
        }
        if parts.len() == 2 {
            // Never requeued in P2: its state there stays 0.
            model
                .live
                .borrow_mut()
                .insert((P2, id), Kept::new(loc, body, false));
        }
    }
    append_wait(&*store, &requeues);
    append_wait(&*store, &settles);
    for _ in 0..10 {
        let moved = store.compact(&model).expect("compact");
        nudge(&*store);
        nudge(&*store);
        if moved == 0 {
            break;
        }
    }
    // One more requeue after compaction: the newest wins.
    let (p, id, loc) = model
        .live
        .borrow()
        .iter()
        .next()
        .map(|((p, id), k)| (*p, *id, k.loc))
        .expect("live");
    append_wait(
        &*store,
        &[Op::Requeue {
            partition: p,
            id,
            location: loc,
            attempts: 99,
            deliver_at_ms: 0,
        }],
    );
    if let Some(kept) = model.live.borrow_mut().get_mut(&(p, id)) {
        (kept.attempts, kept.deliver_at) = (99, 0);
    }
    let mut store = store;
    for round in 0..2 {
        store = match restart(h, store) {
            Ok(s) => s,
            Err(s) => return s.close().expect("close"),
        };
        for part in [P1, P2] {
            let got: Vec<_> = recovered(&*store, part)
                .into_values()
                .map(|m| (m.id, m.location, m.attempts, m.attrs.deliver_at_ms))
                .collect();
            let want: Vec<_> = model
                .live
                .borrow()
                .iter()
                .filter(|((q, _), _)| *q == part)
                .map(|((_, id), k)| (*id, k.loc, k.attempts, k.deliver_at))
                .collect();
            assert_eq!(got, want, "partition {part:?} after restart {round}");
        }
        // Compact again after the restart: the state is carried from there too.
        for _ in 0..10 {
            let moved = store.compact(&model).expect("compact");
            nudge(&*store);
            if moved == 0 {
                break;
            }
        }
    }
    store.close().expect("close");
}

/// Requeue records of a settled message do not bring it back.
pub fn settled_requeued_message_stays_settled(h: &mut dyn Harness) {
    let store = h.create();
    let (a, a_loc) = publish(&*store, &[P1], b"a");
    let (b, b_loc) = publish(&*store, &[P1], b"b");
    let requeue = |id, location, attempts| Op::Requeue {
        partition: P1,
        id,
        location,
        attempts,
        deliver_at_ms: 7,
    };
    append_wait(&*store, &[requeue(a, a_loc, 1), requeue(b, b_loc, 1)]);
    settle(&*store, P1, a, a_loc);
    append_wait(&*store, &[requeue(b, b_loc, 2)]);
    let store = match restart(h, store) {
        Ok(s) => s,
        Err(s) => return s.close().expect("close"),
    };
    let got = recovered(&*store, P1);
    assert_eq!(got.keys().copied().collect::<Vec<_>>(), vec![b]);
    assert_eq!((got[&b].attempts, got[&b].attrs.deliver_at_ms), (2, 7));
    store.close().expect("close");
}

/// A [`Model`] that settles one message right after compaction collected
/// the positions, and another just before the swap: both settles win, their
/// copies are refused, and neither message comes back after a restart.
struct SettlingModel<'a> {
    model: Model,
    store: &'a dyn Store,
    victims: [(PartitionId, MessageId); 2],
}

impl SettlingModel<'_> {
    fn settle_victim(&self, i: usize) {
        let key = self.victims[i];
        let Some(k) = self.model.live.borrow_mut().remove(&key) else {
            return;
        };
        append_wait(
            self.store,
            &[Op::Settle {
                partition: key.0,
                id: key.1,
                location: k.loc,
            }],
        );
    }
}

impl LiveSet for SettlingModel<'_> {
    fn for_each_live(&self, visit: &mut dyn FnMut(PartitionId, MessageId, Location)) {
        self.model.for_each_live(visit);
        self.settle_victim(0);
    }

    fn relocate(&self, moves: &[Relocation]) -> Vec<bool> {
        self.settle_victim(1);
        let swapped = self.model.relocate(moves);
        for (m, s) in moves.iter().zip(&swapped) {
            if self.victims.contains(&(m.partition, m.id)) {
                assert!(!s, "a settled message's copy was swapped in");
            }
        }
        swapped
    }
}

/// Settles racing a compaction win over it (see [`SettlingModel`]).
pub fn settles_during_compaction_win(h: &mut dyn Harness) {
    let store = h.create();
    let model = Model::default();
    let mut settles = Vec::new();
    for i in 0..80u32 {
        let body = vec![i as u8; 200];
        let (id, loc) = publish(&*store, &[P1], &body);
        if i % 8 == 0 {
            model
                .live
                .borrow_mut()
                .insert((P1, id), Kept::new(loc, body, false));
        } else {
            settles.push(Op::Settle {
                partition: P1,
                id,
                location: loc,
            });
        }
    }
    append_wait(&*store, &settles);
    let victims = {
        let live = model.live.borrow();
        let mut keys = live.keys();
        [*keys.next().expect("live"), *keys.next().expect("live")]
    };
    let racing = SettlingModel {
        model,
        store: &*store,
        victims,
    };
    store.compact(&racing).expect("compact");
    nudge(&*store);
    let model = racing.model;
    for ((_, id), k) in model.live.borrow().iter() {
        check_read(&*store, k.loc, *id, &k.body);
    }
    let store = match restart(h, store) {
        Ok(s) => s,
        Err(s) => return s.close().expect("close"),
    };
    let got: Vec<_> = store
        .recover_partition(P1)
        .expect("recover")
        .into_iter()
        .map(|m| (m.id, m.location))
        .collect();
    let want: Vec<_> = model
        .live
        .borrow()
        .iter()
        .map(|((_, id), k)| (*id, k.loc))
        .collect();
    assert_eq!(got, want, "a message settled during compaction came back");
    store.close().expect("close");
}

/// The receipts of `p`, sorted.
fn receipts_of(store: &dyn Store, p: PartitionId) -> Vec<Receipt> {
    let mut r = store.recover_receipts(p).expect("recover receipts");
    r.sort_unstable();
    r
}

/// Idempotency receipts outlive their messages: they are recovered after
/// the messages they came with were settled and their segments compacted,
/// the latest expiry per key wins, expired ones are never recovered, and
/// recovery answers whenever it is asked.
pub fn receipts_survive_restart_and_compaction_until_they_expire(h: &mut dyn Harness) {
    let store = h.create();
    let now = crate::log::now_ms();
    let far = now + 3_600_000;
    let receipt = |partition, key_hash, expires_at_ms| Op::Receipt {
        partition,
        key_hash,
        expires_at_ms,
    };
    // A message and its receipt in one batch.
    let id = store.allocate_ids(1);
    let mut locs = append_wait(
        &*store,
        &[
            Op::Publish {
                id,
                partitions: &[P1],
                data: data(b"first"),
            },
            receipt(P1, 1, far),
        ],
    );
    assert_eq!(locs.len(), 1, "a receipt has no location");
    let mut settles = vec![Op::Settle {
        partition: P1,
        id,
        location: locs.remove(0),
    }];
    // Enough settled messages, each with its receipt, for compaction and
    // reclamation of the log store's small segments to take part.
    let mut want_p2 = Vec::new();
    for i in 0..60u64 {
        let (id, loc) = publish(&*store, &[P2], &[i as u8; 200]);
        append_wait(&*store, &[receipt(P2, 100 + i, far + i)]);
        want_p2.push(Receipt {
            key_hash: 100 + i,
            expires_at_ms: far + i,
        });
        settles.push(Op::Settle {
            partition: P2,
            id,
            location: loc,
        });
    }
    append_wait(&*store, &settles);
    // A later receipt for the same key extends it; an expired one is never
    // recovered.
    append_wait(
        &*store,
        &[
            receipt(P1, 1, far + 10),
            receipt(P3, 7, now.saturating_sub(1)),
        ],
    );
    let nothing_live = Model::default();
    for _ in 0..4 {
        store.compact(&nothing_live).expect("compact");
        nudge(&*store);
        nudge(&*store);
    }
    let want_p1 = vec![Receipt {
        key_hash: 1,
        expires_at_ms: far + 10,
    }];
    let mut store = store;
    for round in 0..2 {
        store = match restart(h, store) {
            Ok(s) => s,
            Err(s) => return s.close().expect("close"),
        };
        assert_eq!(receipts_of(&*store, P1), want_p1, "restart {round}");
        assert_eq!(receipts_of(&*store, P2), want_p2, "restart {round}");
        assert!(
            receipts_of(&*store, P3).is_empty(),
            "expired receipt recovered"
        );
        assert_eq!(
            receipts_of(&*store, P1),
            want_p1,
            "recovery may be asked again at any time"
        );
        assert!(store.recover_partition(P2).expect("recover").is_empty());
        // Compaction after the restart keeps them too, and recovery after
        // it still finds them.
        for _ in 0..4 {
            store.compact(&nothing_live).expect("compact");
            nudge(&*store);
            nudge(&*store);
        }
        assert_eq!(
            receipts_of(&*store, P2),
            want_p2,
            "after compaction {round}"
        );
    }
    store.close().expect("close");
}
