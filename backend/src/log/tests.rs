//! Tests of the log store as a whole: append, read, durability callbacks,
//! recovery, torn tails, reclamation and a randomized model check.

use super::*;
use crate::{MessageAttrs, PartitionId, RecoveredMessage};

/// Appends as before tickets: with an optional waiter, called once the
/// batch is durable; an empty batch with a waiter waits for the next
/// writer round (everything appended before it is then durable).
trait AppendCb {
    fn append_cb(
        &self,
        ops: &[Op<'_>],
        locations: &mut Vec<Location>,
        waiter: Option<Waiter>,
    ) -> Result<(), StoreError>;
}

impl AppendCb for LogStore {
    fn append_cb(
        &self,
        ops: &[Op<'_>],
        locations: &mut Vec<Location>,
        waiter: Option<Waiter>,
    ) -> Result<(), StoreError> {
        let t = self.append(ops, locations)?;
        match waiter {
            Some(w) if ops.is_empty() => self.round_barrier(w),
            Some(w) => self.when_durable(t, w),
            None => {}
        }
        Ok(())
    }
}

/// What a restart found, gathered through the per-partition API.
#[derive(Debug, Default)]
struct Recovered {
    meta: BTreeMap<Vec<u8>, Vec<u8>>,
    meta_version: u64,
    partitions: HashMap<PartitionId, Vec<RecoveredMessage>>,
    truncated_bytes: u64,
}

fn take_recovered(store: &LogStore) -> Recovered {
    let m = store.recovered_meta().unwrap();
    let mut partitions = HashMap::new();
    for p in store.recovered_partitions().unwrap() {
        let msgs = store.recover_partition(p).unwrap();
        if !msgs.is_empty() {
            partitions.insert(p, msgs);
        }
    }
    Recovered {
        meta: m.meta,
        meta_version: m.version,
        partitions,
        truncated_bytes: m.truncated_bytes,
    }
}
use std::collections::{BTreeMap, HashMap};
use std::sync::mpsc;
use std::time::Duration;

const P1: PartitionId = PartitionId(1);
const P2: PartitionId = PartitionId(2);
const P3: PartitionId = PartitionId(3);

fn small() -> LogOptions {
    LogOptions {
        segment_size: 4096,
        ..LogOptions::default()
    }
}

fn data(body: &[u8]) -> MessageData<'_> {
    MessageData {
        exchange: "ex",
        routing_key: "rk",
        header_format: 1,
        header: b"h",
        body,
        attrs: MessageAttrs {
            priority: 1,
            expires_at_ms: 7,
            deliver_at_ms: 0,
        },
    }
}

/// The damage a refused open reports, or what it did instead.
fn damaged<T: std::fmt::Debug>(r: Result<T, StoreError>) -> Result<Box<Damage>, String> {
    match r {
        Err(e) => match LogError::of(&e) {
            Some(LogError::Damaged(d)) => Ok(d.clone()),
            _ => Err(format!("{e:?}")),
        },
        Ok(v) => Err(format!("opened: {v:?}")),
    }
}

/// Appends and waits until durable.
fn append_sync(store: &LogStore, ops: &[Op<'_>]) -> Vec<Location> {
    let (tx, rx) = mpsc::channel();
    let mut locs = Vec::new();
    store
        .append_cb(
            ops,
            &mut locs,
            Some(Box::new(move |r| {
                let _ = tx.send(r);
            })),
        )
        .unwrap();
    rx.recv_timeout(Duration::from_secs(20))
        .expect("waiter called")
        .expect("durable");
    locs
}

/// Waits until everything before is durable and the reclamation planned by
/// earlier rounds has run (a round reclaims after completing its waiters).
fn barrier(store: &LogStore) {
    append_sync(store, &[]);
    append_sync(store, &[]);
}

fn publish(store: &LogStore, parts: &[PartitionId], body: &[u8]) -> (MessageId, Location) {
    let id = store.allocate_ids(1);
    let locs = append_sync(
        store,
        &[Op::Publish {
            id,
            partitions: parts,
            data: data(body),
        }],
    );
    (id, locs[0])
}

fn settle(store: &LogStore, p: PartitionId, id: MessageId, location: Location) {
    append_sync(
        store,
        &[Op::Settle {
            partition: p,
            id,
            location,
        }],
    );
}

fn ids_of(rec: &Recovered, p: PartitionId) -> Vec<MessageId> {
    rec.partitions
        .get(&p)
        .map(|v| v.iter().map(|m| m.id).collect())
        .unwrap_or_default()
}

fn seg_files(dir: &Path) -> Vec<SegmentId> {
    segment::list_segments(&dir.join("log")).unwrap()
}

#[test]
fn append_read_roundtrip_pending_and_on_disk() {
    let dir = tempfile::tempdir().unwrap();
    let store = LogStore::open(dir.path(), LogOptions::default()).unwrap();
    assert!(take_recovered(&store).partitions.is_empty());

    // Park the writer inside a waiter so the next append stays pending.
    let (entered_tx, entered_rx) = mpsc::channel();
    let (release_tx, release_rx) = mpsc::channel::<()>();
    let id1 = store.allocate_ids(1);
    let mut locs = Vec::new();
    store
        .append_cb(
            &[Op::Publish {
                id: id1,
                partitions: &[P1],
                data: data(b"first"),
            }],
            &mut locs,
            Some(Box::new(move |r| {
                r.unwrap();
                entered_tx.send(()).unwrap();
                let _ = release_rx.recv();
            })),
        )
        .unwrap();
    entered_rx.recv().unwrap();
    let id2 = store.allocate_ids(1);
    assert!(id2 > id1);
    store
        .append_cb(
            &[Op::Publish {
                id: id2,
                partitions: &[P1, P2],
                data: data(b"second"),
            }],
            &mut locs,
            None,
        )
        .unwrap();
    assert!(
        !store.is_written(locs[1]),
        "second record must still be pending"
    );
    let m = store.read(locs[1]).unwrap();
    assert_eq!(
        (m.id, &m.body[..], &m.header[..]),
        (id2, &b"second"[..], &b"h"[..])
    );
    assert_eq!((m.exchange.as_str(), m.routing_key.as_str()), ("ex", "rk"));
    assert_eq!(m.attrs.expires_at_ms, 7);
    release_tx.send(()).unwrap();
    barrier(&store);

    // Both on disk now.
    assert!(store.is_written(locs[1]));
    assert_eq!(&store.read(locs[0]).unwrap().body[..], b"first");
    assert_eq!(&store.read(locs[1]).unwrap().body[..], b"second");
    // A bogus location is an error, not a panic.
    let bogus = Location::log(99, 0, 40);
    assert!(matches!(store.read(bogus), Err(StoreError::NotFound(_))));
    let misaligned = Location::log(locs[0].segment(), locs[0].offset() + 1, locs[0].len());
    assert!(store.read(misaligned).is_err());
    store.close().unwrap();
    assert!(matches!(
        store.append_cb(&[], &mut Vec::new(), None),
        Err(StoreError::Closed)
    ));
}

#[test]
fn waiter_fires_only_after_sync() {
    let dir = tempfile::tempdir().unwrap();
    let store = LogStore::open(dir.path(), LogOptions::default()).unwrap();
    let (tx, rx) = mpsc::channel();
    let id = store.allocate_ids(1);
    let mut locs = Vec::new();
    let s2 = store.clone();
    let seg_path = segment::segment_path(&dir.path().join("log"), 1);
    store
        .append_cb(
            &[Op::Publish {
                id,
                partitions: &[P1],
                data: data(&[7u8; 300]),
            }],
            &mut locs,
            Some(Box::new(move |r| {
                // Observed from inside the callback: the fsync already happened
                // and the bytes are in the file.
                let syncs = s2.stats().syncs;
                let len = std::fs::metadata(&seg_path).map(|m| m.len()).unwrap_or(0);
                tx.send((r.is_ok(), syncs, len)).unwrap();
            })),
        )
        .unwrap();
    let (ok, syncs, len) = rx.recv_timeout(Duration::from_secs(20)).unwrap();
    assert!(ok);
    assert!(syncs >= 1);
    assert!(len >= u64::from(locs[0].offset() + locs[0].len()));
}

#[test]
fn failed_write_fails_waiters_and_closes_the_store() {
    let dir = tempfile::tempdir().unwrap();
    let store = LogStore::open(dir.path(), LogOptions::default()).unwrap();
    publish(&store, &[P1], b"ok");
    store.inject_write_failure();
    let (tx, rx) = mpsc::channel();
    let id = store.allocate_ids(1);
    store
        .append_cb(
            &[Op::Publish {
                id,
                partitions: &[P1],
                data: data(b"lost"),
            }],
            &mut Vec::new(),
            Some(Box::new(move |r| tx.send(r.is_ok()).unwrap())),
        )
        .unwrap();
    assert!(!rx.recv_timeout(Duration::from_secs(20)).unwrap());
    assert!(matches!(
        store.append_cb(&[], &mut Vec::new(), None),
        Err(StoreError::Closed)
    ));
    assert!(store.close().is_err());
}

#[test]
fn restart_recovers_meta_and_live_messages() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b, c);
    {
        let store = LogStore::open(dir.path(), small()).unwrap();
        append_sync(
            &store,
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
        a = publish(&store, &[P1, P2], b"a");
        b = publish(&store, &[P1], b"b");
        c = publish(&store, &[P2, P3], b"c");
        settle(&store, P1, a.0, a.1);
        settle(&store, P3, c.0, c.1);
        // Appended without a waiter: close must still make it durable.
        store
            .append_cb(
                &[Op::PutMeta {
                    key: b"q3",
                    value: b"v3",
                }],
                &mut Vec::new(),
                None,
            )
            .unwrap();
        store.close().unwrap();
    }
    let store = LogStore::open(dir.path(), small()).unwrap();
    let rec = take_recovered(&store);
    assert_eq!(rec.meta_version, 4);
    let meta: Vec<_> = rec.meta.iter().map(|(k, v)| (&k[..], &v[..])).collect();
    assert_eq!(
        meta,
        vec![(&b"q2"[..], &b"v2"[..]), (&b"q3"[..], &b"v3"[..])]
    );
    assert_eq!(ids_of(&rec, P1), vec![b.0]);
    assert_eq!(ids_of(&rec, P2), vec![a.0, c.0]);
    assert!(!rec.partitions.contains_key(&P3));
    let rm = rec.partitions[&P2][0];
    assert_eq!(
        rm,
        RecoveredMessage {
            id: a.0,
            location: a.1,
            size: 1,
            attempts: 0,
            attrs: MessageAttrs {
                priority: 1,
                expires_at_ms: 7,
                deliver_at_ms: 0,
            }
        }
    );
    assert_eq!(&store.read(c.1).unwrap().body[..], b"c");
    assert_eq!(rec.truncated_bytes, 0);
    // Asked again (after the startup window: by a scan), the same.
    let again = take_recovered(&store);
    assert_eq!(again.partitions, rec.partitions);
    // Compaction ends the startup window; nothing is worth moving here
    // (and the live set shown is empty, so nothing could be).
    store.compact(&Live(Default::default())).unwrap();
    assert_eq!(take_recovered(&store).partitions, rec.partitions);
    assert!(store.allocate_ids(1) > c.0);
}

#[test]
fn relocation_moves_one_partition() {
    let dir = tempfile::tempdir().unwrap();
    let (id, old, new);
    {
        let store = LogStore::open(dir.path(), small()).unwrap();
        (id, old) = publish(&store, &[P1, P2], b"payload");
        new = store.relocate(P1, id, old).unwrap();
        assert_ne!(new, old);
        let m = store.read(new).unwrap();
        assert_eq!((m.id, &m.body[..]), (id, &b"payload"[..]));
        assert_eq!(m.attrs.priority, 1);
        // A relocate of a relocated copy works too (the source is a relocate record).
        let again = store.relocate(P1, id, new).unwrap();
        barrier(&store);
        assert_eq!(&store.read(again).unwrap().body[..], b"payload");
        // The engine must name the right message.
        assert!(store.relocate(P1, id + 1, old).is_err());
        settle(&store, P2, id, old);
        store.close().unwrap();
        let rec_loc = again;
        let store = LogStore::open(dir.path(), small()).unwrap();
        let rec = take_recovered(&store);
        assert_eq!(rec.partitions[&P1].len(), 1);
        assert_eq!(rec.partitions[&P1][0].location, rec_loc);
        assert!(!rec.partitions.contains_key(&P2));
    }
}

/// A move cut anywhere at the tail (a crash mid-write) is not applied at
/// all: the message is still in its source partition and not in the
/// targets. Whole, it is applied entirely.
#[test]
fn torn_move_leaves_the_message_in_its_source() {
    let dir = tempfile::tempdir().unwrap();
    let (old, old_loc, new, move_loc);
    {
        let store = LogStore::open(dir.path(), LogOptions::default()).unwrap();
        (old, old_loc) = publish(&store, &[P1], b"poison");
        new = store.allocate_ids(1);
        move_loc = append_sync(
            &store,
            &[Op::Move {
                id: new,
                partitions: &[P2, P3],
                data: data(b"dead-lettered"),
                from: P1,
                from_id: old,
                from_location: old_loc,
            }],
        )[0];
        store.close().unwrap();
    }
    let path = segment::segment_path(&dir.path().join("log"), move_loc.segment());
    // A clean close recorded the move as durable; a crash mid-write would
    // not have.
    forget_recorded_end(&path);
    let whole = std::fs::read(&path).unwrap();
    let end = move_loc.offset() as usize + move_loc.len() as usize;
    assert_eq!(whole.len(), end, "the move is the last record");
    for cut in [
        1,
        FRAME_HEADER,
        move_loc.len() as usize / 2,
        move_loc.len() as usize - 1,
    ] {
        let at = move_loc.offset() as usize + cut;
        std::fs::write(&path, &whole[..at]).unwrap();
        let store = LogStore::open(dir.path(), LogOptions::default()).unwrap();
        let rec = take_recovered(&store);
        assert_eq!(rec.truncated_bytes, cut as u64, "cut {cut}");
        assert_eq!(ids_of(&rec, P1), vec![old], "cut {cut}: source lost");
        assert!(ids_of(&rec, P2).is_empty(), "cut {cut}: in the target");
        assert!(ids_of(&rec, P3).is_empty(), "cut {cut}: in the target");
        assert_eq!(&store.read(old_loc).unwrap().body[..], b"poison");
        store.close().unwrap();
    }
    // Whole again: applied entirely.
    std::fs::write(&path, &whole).unwrap();
    let store = LogStore::open(dir.path(), LogOptions::default()).unwrap();
    let rec = take_recovered(&store);
    assert!(ids_of(&rec, P1).is_empty());
    assert_eq!(ids_of(&rec, P2), vec![new]);
    assert_eq!(ids_of(&rec, P3), vec![new]);
    assert_eq!(rec.partitions[&P2][0].location, move_loc);
}

/// A meta batch cut anywhere at the tail (a crash mid-write) leaves none of
/// its changes; whole, all of them.
#[test]
fn torn_meta_batch_applies_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let keys: Vec<Vec<u8>> = (0..50u32).map(|i| format!("q{i}").into_bytes()).collect();
    let changes: Vec<MetaChange<'_>> = keys
        .iter()
        .map(|k| MetaChange::Put {
            key: k,
            value: b"def",
        })
        .chain([MetaChange::Delete { key: b"before" }])
        .collect();
    let path;
    let start;
    {
        let store = LogStore::open(dir.path(), LogOptions::default()).unwrap();
        append_sync(
            &store,
            &[Op::PutMeta {
                key: b"before",
                value: b"1",
            }],
        );
        let st = store.shared.state.lock();
        (path, start) = (st.head, st.head_size as usize);
        drop(st);
        append_sync(&store, &[Op::MetaBatch { changes: &changes }]);
        store.close().unwrap();
    }
    let path = segment::segment_path(&dir.path().join("log"), path);
    let whole = std::fs::read(&path).unwrap();
    let len = whole.len() - start;
    for cut in [1, FRAME_HEADER, len / 2, len - 1] {
        // A crash mid-write: the batch was never fsynced, so the header's
        // recorded end (the clean close put the whole segment there) could
        // at most cover what came before it.
        let mut torn = whole[..start + cut].to_vec();
        segment::set_recorded_end(&mut torn, start as u64);
        std::fs::write(&path, &torn).unwrap();
        let store = LogStore::open(dir.path(), LogOptions::default()).unwrap();
        let rec = take_recovered(&store);
        assert_eq!(rec.truncated_bytes, cut as u64, "cut {cut}");
        let want: BTreeMap<Vec<u8>, Vec<u8>> = [(b"before".to_vec(), b"1".to_vec())].into();
        assert_eq!(rec.meta, want, "cut {cut}: part of the batch applied");
        store.close().unwrap();
    }
    std::fs::write(&path, &whole).unwrap();
    let store = LogStore::open(dir.path(), LogOptions::default()).unwrap();
    let rec = take_recovered(&store);
    assert_eq!(rec.meta.len(), 50);
    assert!(!rec.meta.contains_key(&b"before"[..]));
    assert_eq!(rec.meta_version, 2);
}

/// Requeue records pin nothing: once the messages they name are settled
/// (or relocated) their segments are reclaimed like any other, and the
/// relocated copies carry the state.
#[test]
fn requeue_records_do_not_pin_segments() {
    let dir = tempfile::tempdir().unwrap();
    let store = LogStore::open(dir.path(), small()).unwrap();
    let mut msgs = Vec::new();
    for i in 0..40u32 {
        msgs.push(publish(&store, &[P1], &[i as u8; 200]));
    }
    // Requeue all of them repeatedly, spreading requeue records over the log.
    for round in 1..=3u32 {
        let ops: Vec<_> = msgs
            .iter()
            .map(|(id, loc)| Op::Requeue {
                partition: P1,
                id: *id,
                location: *loc,
                attempts: round,
                deliver_at_ms: u64::from(round) * 1000 + id,
            })
            .collect();
        append_sync(&store, &ops);
    }
    // Keep one message, settle the others, then compact until quiet.
    let (kept, kept_loc) = msgs[0];
    let ops: Vec<_> = msgs[1..]
        .iter()
        .map(|(id, loc)| Op::Settle {
            partition: P1,
            id: *id,
            location: *loc,
        })
        .collect();
    append_sync(&store, &ops);
    let live = Live(std::cell::RefCell::new(
        [(kept, kept_loc)].into_iter().collect(),
    ));
    for _ in 0..20 {
        let moved = store.compact(&live).unwrap();
        barrier(&store);
        if moved == 0 {
            break;
        }
    }
    let now = live.0.borrow()[&kept];
    assert_ne!(now, kept_loc, "the survivor was relocated");
    // Everything before the copy's segment went, requeue records included.
    let files = seg_files(dir.path());
    assert_eq!(files[0], now.segment(), "{files:?}");
    store.close().unwrap();
    let store = LogStore::open(dir.path(), small()).unwrap();
    let rec = take_recovered(&store);
    assert_eq!(rec.partitions.len(), 1);
    let m = rec.partitions[&P1][0];
    assert_eq!((m.id, m.location), (kept, now));
    assert_eq!((m.attempts, m.attrs.deliver_at_ms), (3, 3000 + kept));
    // Settle it: the rest of the log goes too.
    settle(&store, P1, kept, now);
    barrier(&store);
    store.close().unwrap();
    let store = LogStore::open(dir.path(), small()).unwrap();
    assert!(take_recovered(&store).partitions.is_empty());
    barrier(&store);
    assert!(seg_files(dir.path()).is_empty());
}

fn receipts_of(store: &LogStore, p: PartitionId) -> Vec<crate::Receipt> {
    let mut r = store.recover_receipts(p).unwrap();
    r.sort_unstable();
    r
}

fn receipt_files(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir.join(receipts::DIR))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// Idempotency receipts outlive their messages: segments whose messages
/// are all settled stay while their receipts have not expired; compaction
/// copies long-lived receipts into a receipts file, after which the
/// segments go and a restart still finds the receipts.
#[test]
fn receipts_pin_segments_until_compaction_copies_them_out() {
    let dir = tempfile::tempdir().unwrap();
    let store = LogStore::open(dir.path(), small()).unwrap();
    let far = now_ms() + 3_600_000;
    let mut settles = Vec::new();
    let mut want = Vec::new();
    for i in 0..40u64 {
        let (id, loc) = publish(&store, &[P1], &[i as u8; 200]);
        append_sync(
            &store,
            &[Op::Receipt {
                partition: P2,
                key_hash: i,
                expires_at_ms: far + i,
            }],
        );
        want.push(crate::Receipt {
            key_hash: i,
            expires_at_ms: far + i,
        });
        settles.push(Op::Settle {
            partition: P1,
            id,
            location: loc,
        });
    }
    append_sync(&store, &settles);
    barrier(&store);
    let before = seg_files(dir.path());
    assert!(before.len() >= 3, "{before:?}");
    assert_eq!(
        before[0], 1,
        "nothing live, but the receipts keep every segment"
    );
    let nothing = Live(Default::default());
    assert_eq!(store.compact(&nothing).unwrap(), 0, "no message to move");
    barrier(&store);
    // Every sealed segment went; only the head (receipts in it stay where
    // they are) is left.
    assert_eq!(seg_files(dir.path()), vec![*before.last().unwrap()]);
    assert_eq!(receipt_files(dir.path()), vec!["00000001.rcp".to_string()]);
    // One more in the head, and a later expiry for an earlier key.
    append_sync(
        &store,
        &[
            Op::Receipt {
                partition: P2,
                key_hash: 1000,
                expires_at_ms: far,
            },
            Op::Receipt {
                partition: P2,
                key_hash: 3,
                expires_at_ms: far + 500,
            },
        ],
    );
    want[3].expires_at_ms = far + 500;
    want.push(crate::Receipt {
        key_hash: 1000,
        expires_at_ms: far,
    });
    store.close().unwrap();
    let store = LogStore::open(dir.path(), small()).unwrap();
    assert_eq!(receipts_of(&store, P2), want);
    assert_eq!(
        receipts_of(&store, P2),
        want,
        "asked again, the same (by a scan of segments and receipts files)"
    );
    // The old head is sealed now: the next compaction copies its receipts
    // out too, into a second file; both are read at the next open.
    store.compact(&nothing).unwrap();
    barrier(&store);
    assert_eq!(receipt_files(dir.path()).len(), 2);
    assert!(seg_files(dir.path())
        .iter()
        .all(|s| s > before.last().unwrap()));
    store.close().unwrap();
    let store = LogStore::open(dir.path(), small()).unwrap();
    assert_eq!(receipts_of(&store, P2), want);
    store.close().unwrap();
}

/// Receipts about to expire are not worth copying: they keep their segment
/// until they expire, then it is reclaimed (compaction wakes the writer for
/// it) and a restart does not bring them back.
#[test]
fn receipts_near_expiry_pin_their_segment_until_they_expire() {
    let dir = tempfile::tempdir().unwrap();
    let store = LogStore::open(dir.path(), small()).unwrap();
    let soon = now_ms() + 800;
    let (id, loc) = publish(&store, &[P1], &[1; 200]);
    append_sync(
        &store,
        &[
            Op::Receipt {
                partition: P3,
                key_hash: 9,
                expires_at_ms: soon,
            },
            Op::Settle {
                partition: P1,
                id,
                location: loc,
            },
        ],
    );
    // Fill a few more segments with settled messages.
    for i in 0..40u8 {
        let (id, loc) = publish(&store, &[P1], &[i; 200]);
        settle(&store, P1, id, loc);
    }
    let nothing = Live(Default::default());
    store.compact(&nothing).unwrap();
    barrier(&store);
    assert_eq!(seg_files(dir.path())[0], 1, "the receipt keeps its segment");
    assert!(receipt_files(dir.path()).is_empty(), "not worth copying");
    // The receipt's own deadline: nothing to await but the clock.
    std::thread::sleep(Duration::from_millis(soon.saturating_sub(now_ms()) + 50));
    store.compact(&nothing).unwrap();
    barrier(&store);
    let files = seg_files(dir.path());
    assert!(
        files.len() <= 1 && files.first().is_none_or(|s| *s > 1),
        "{files:?}"
    );
    store.close().unwrap();
    let store = LogStore::open(dir.path(), small()).unwrap();
    assert!(store.recover_receipts(P3).unwrap().is_empty());
    store.close().unwrap();
}

/// Settles that race a compaction (between collecting and swapping) leave
/// the accounting exact: once everything is settled every segment goes.
#[test]
fn settles_racing_compaction_keep_accounting_exact() {
    struct Racing<'a> {
        live: Live,
        store: &'a LogStore,
    }
    impl Racing<'_> {
        fn settle_first(&self) {
            let first = self.live.0.borrow().iter().next().map(|(i, l)| (*i, *l));
            if let Some((id, loc)) = first {
                self.live.0.borrow_mut().remove(&id);
                settle(self.store, P1, id, loc);
            }
        }
    }
    impl crate::LiveSet for Racing<'_> {
        fn for_each_live(&self, visit: &mut dyn FnMut(PartitionId, MessageId, Location)) {
            self.live.for_each_live(visit);
            self.settle_first();
        }
        fn relocate(&self, moves: &[crate::Relocation]) -> Vec<bool> {
            self.settle_first();
            self.live.relocate(moves)
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let store = LogStore::open(dir.path(), small()).unwrap();
    let mut live = BTreeMap::new();
    let mut ops = Vec::new();
    for i in 0..80u32 {
        let (id, loc) = publish(&store, &[P1], &[i as u8; 200]);
        if i % 4 == 0 {
            live.insert(id, loc);
        } else {
            ops.push(Op::Settle {
                partition: P1,
                id,
                location: loc,
            });
        }
    }
    append_sync(&store, &ops);
    let racing = Racing {
        live: Live(std::cell::RefCell::new(live)),
        store: &store,
    };
    let mut moved_total = 0;
    for _ in 0..20 {
        let moved = store.compact(&racing).unwrap();
        barrier(&store);
        moved_total += moved;
        if moved == 0 {
            break;
        }
    }
    assert!(moved_total > 0, "nothing was compacted");
    let left = racing.live.0.into_inner();
    for (id, loc) in &left {
        assert_eq!(store.read(*loc).unwrap().id, *id);
    }
    store.close().unwrap();
    let store = LogStore::open(dir.path(), small()).unwrap();
    let rec = take_recovered(&store);
    assert_eq!(
        ids_of(&rec, P1),
        left.keys().copied().collect::<Vec<_>>(),
        "a settled message came back"
    );
    let ops: Vec<_> = left
        .iter()
        .map(|(id, loc)| Op::Settle {
            partition: P1,
            id: *id,
            location: *loc,
        })
        .collect();
    append_sync(&store, &ops);
    barrier(&store);
    store.close().unwrap();
    let store = LogStore::open(dir.path(), small()).unwrap();
    barrier(&store);
    assert!(
        seg_files(dir.path()).is_empty(),
        "a live count leaked: {:?}",
        seg_files(dir.path())
    );
}

/// Writes three messages, closes, and returns the last record's location.
fn three_messages(dir: &Path) -> Vec<Location> {
    let store = LogStore::open(dir, LogOptions::default()).unwrap();
    let mut locs = Vec::new();
    for body in [&b"one"[..], b"two", b"three"] {
        locs.push(publish(&store, &[P1], body).1);
    }
    store.close().unwrap();
    locs
}

/// Zeroes the durable end recorded in a segment's header: what a segment
/// written before the field existed (or with fsync off) looks like.
fn forget_recorded_end(path: &Path) {
    let mut bytes = std::fs::read(path).unwrap();
    segment::set_recorded_end(&mut bytes, 0);
    std::fs::write(path, &bytes).unwrap();
}

fn recorded_end_of(path: &Path) -> u64 {
    use std::io::Read;
    let mut h = [0u8; segment::HEADER_LEN];
    std::fs::File::open(path)
        .unwrap()
        .read_exact(&mut h)
        .unwrap();
    segment::recorded_end(&h)
}

/// A segment without a recorded end (older data directories) recovers as
/// before: a partial last record is a torn tail.
#[test]
fn torn_tail_is_truncated() {
    let dir = tempfile::tempdir().unwrap();
    let locs = three_messages(dir.path());
    let path = segment::segment_path(&dir.path().join("log"), locs[2].segment());
    forget_recorded_end(&path);
    let full = std::fs::metadata(&path).unwrap().len();
    let keep = u64::from(locs[2].offset()) + 5;
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(keep)
        .unwrap();
    let store = LogStore::open(dir.path(), LogOptions::default()).unwrap();
    let rec = take_recovered(&store);
    assert_eq!(rec.truncated_bytes, 5);
    assert_eq!(rec.partitions[&P1].len(), 2);
    assert_eq!(
        std::fs::metadata(&path).unwrap().len(),
        u64::from(locs[2].offset())
    );
    assert!(full > keep);
    // The store keeps working after the truncation.
    let (id, loc) = publish(&store, &[P1], b"four");
    store.close().unwrap();
    let store = LogStore::open(dir.path(), LogOptions::default()).unwrap();
    let rec = take_recovered(&store);
    assert_eq!(rec.truncated_bytes, 0);
    assert_eq!(rec.partitions[&P1].last().unwrap().id, id);
    assert_eq!(&store.read(loc).unwrap().body[..], b"four");
}

/// Without a recorded end (older data directories) a bad last record is
/// still taken for a torn tail, as before.
#[test]
fn corrupt_last_record_without_a_recorded_end_is_truncated() {
    let dir = tempfile::tempdir().unwrap();
    let locs = three_messages(dir.path());
    let path = segment::segment_path(&dir.path().join("log"), locs[2].segment());
    forget_recorded_end(&path);
    let mut bytes = std::fs::read(&path).unwrap();
    let i = locs[2].offset() as usize + locs[2].len() as usize - 2;
    bytes[i] ^= 0xff;
    std::fs::write(&path, &bytes).unwrap();
    let store = LogStore::open(dir.path(), LogOptions::default()).unwrap();
    let rec = take_recovered(&store);
    assert_eq!(rec.truncated_bytes, u64::from(locs[2].len()));
    assert_eq!(rec.partitions[&P1].len(), 2);
    assert_eq!(&store.read(locs[1]).unwrap().body[..], b"two");
}

#[test]
fn corruption_in_an_older_segment_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let mut first = None;
    {
        let store = LogStore::open(dir.path(), small()).unwrap();
        for _ in 0..40 {
            let (_, loc) = publish(&store, &[P1], &[1u8; 300]);
            first.get_or_insert(loc);
        }
        store.close().unwrap();
    }
    assert!(seg_files(dir.path()).len() >= 3);
    let first = first.unwrap();
    let path = segment::segment_path(&dir.path().join("log"), first.segment());
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[first.offset() as usize + 20] ^= 1;
    std::fs::write(&path, &bytes).unwrap();
    match LogStore::open(dir.path(), small()) {
        Err(e) => match LogError::of(&e) {
            Some(LogError::Damaged(d)) => {
                assert_eq!(d.segment, first.segment());
                assert_eq!(d.offset, u64::from(first.offset()));
            }
            _ => panic!("expected corruption, got {e:?}"),
        },
        Ok(_) => panic!("expected corruption"),
    }
    // A missing middle segment is refused as well.
    std::fs::write(&path, std::fs::read(&path).unwrap()).unwrap();
    std::fs::remove_file(segment::segment_path(&dir.path().join("log"), 2)).unwrap();
    assert!(matches!(
        LogStore::open(dir.path(), small())
            .map_err(|e| LogError::of(&e).map(|l| matches!(l, LogError::Corrupt { .. }))),
        Err(Some(true))
    ));
}

#[test]
fn reclamation_deletes_oldest_settled_segments() {
    let dir = tempfile::tempdir().unwrap();
    let mut survivors = Vec::new();
    {
        let store = LogStore::open(dir.path(), small()).unwrap();
        append_sync(
            &store,
            &[Op::PutMeta {
                key: b"queue",
                value: b"declared",
            }],
        );
        let mut msgs = Vec::new();
        for i in 0..60u32 {
            let p = if i >= 30 && i % 10 == 9 { P2 } else { P1 };
            msgs.push((p, publish(&store, &[p], &[i as u8; 200])));
        }
        let before = seg_files(dir.path());
        assert!(before.len() >= 4, "{before:?}");
        // Settle everything in P1; P2 keeps a few messages spread over the log.
        let mut ops = Vec::new();
        for (p, (id, loc)) in &msgs {
            if *p == P1 {
                ops.push(Op::Settle {
                    partition: *p,
                    id: *id,
                    location: *loc,
                });
            } else {
                survivors.push((*id, *loc));
            }
        }
        append_sync(&store, &ops);
        barrier(&store);
        // Only the prefix before the first survivor's segment can go.
        let after = seg_files(dir.path());
        assert_eq!(
            after[0],
            survivors[0].1.segment(),
            "{before:?} -> {after:?}"
        );
        assert!(store.stats().reclaimed_segments >= 1);
        assert!(dir.path().join("meta.checkpoint").exists());

        // Settle the oldest survivors: more segments become reclaimable, and
        // none is deleted out of order.
        for (id, loc) in survivors.drain(..2) {
            settle(&store, P2, id, loc);
        }
        barrier(&store);
        assert_eq!(seg_files(dir.path())[0], survivors[0].1.segment());
        store.close().unwrap();
    }
    let store = LogStore::open(dir.path(), small()).unwrap();
    let rec = take_recovered(&store);
    assert_eq!(
        ids_of(&rec, P2),
        survivors.iter().map(|s| s.0).collect::<Vec<_>>()
    );
    assert!(!rec.partitions.contains_key(&P1));
    assert_eq!(
        rec.meta.get(&b"queue"[..]).map(|v| &v[..]),
        Some(&b"declared"[..])
    );
    assert_eq!(rec.meta_version, 1);
    for (id, loc) in &survivors {
        assert_eq!(store.read(*loc).unwrap().id, *id);
    }
}

#[test]
fn ids_keep_increasing_after_everything_is_reclaimed() {
    let dir = tempfile::tempdir().unwrap();
    let mut last = 0;
    for round in 0..3 {
        let store = LogStore::open(dir.path(), small()).unwrap();
        let rec = take_recovered(&store);
        assert!(rec.partitions.is_empty());
        assert_eq!(rec.meta.len(), usize::from(round > 0));
        if round == 0 {
            append_sync(
                &store,
                &[Op::PutMeta {
                    key: b"k",
                    value: b"v",
                }],
            );
        }
        for _ in 0..30 {
            let (id, loc) = publish(&store, &[P1], &[0u8; 300]);
            assert!(id > last, "id {id} after {last}");
            last = id;
            settle(&store, P1, id, loc);
        }
        barrier(&store);
        store.close().unwrap();
        // Reopening reclaims whatever the last round left behind.
        let store = LogStore::open(dir.path(), small()).unwrap();
        barrier(&store);
        // Everything was settled: no segment survives (the new head has no
        // file until something is written to it).
        assert!(seg_files(dir.path()).is_empty());
        store.close().unwrap();
    }
}

/// One partition's live positions, as the engine would keep them.
struct Live(std::cell::RefCell<BTreeMap<MessageId, Location>>);

impl crate::LiveSet for Live {
    fn for_each_live(&self, visit: &mut dyn FnMut(PartitionId, MessageId, Location)) {
        for (id, loc) in self.0.borrow().iter() {
            visit(P1, *id, *loc);
        }
    }

    fn relocate(&self, moves: &[crate::Relocation]) -> Vec<bool> {
        let mut live = self.0.borrow_mut();
        moves
            .iter()
            .map(|m| match live.get_mut(&m.id) {
                Some(l) if m.partition == P1 && *l == m.old => {
                    *l = m.new;
                    true
                }
                _ => false,
            })
            .collect()
    }
}

#[test]
fn compaction_moves_survivors_of_sparse_segments_and_frees_them() {
    let dir = tempfile::tempdir().unwrap();
    let store = LogStore::open(dir.path(), small()).unwrap();
    let mut msgs = Vec::new();
    for i in 0..80u32 {
        msgs.push(publish(&store, &[P1], &[i as u8; 200]));
    }
    let all = Live(std::cell::RefCell::new(msgs.iter().copied().collect()));
    assert_eq!(store.compact(&all).unwrap(), 0, "nothing sparse yet");
    // Settle all but every 8th message.
    let mut live = BTreeMap::new();
    let mut ops = Vec::new();
    for (i, (id, loc)) in msgs.iter().enumerate() {
        if i % 8 == 0 {
            live.insert(*id, *loc);
        } else {
            ops.push(Op::Settle {
                partition: P1,
                id: *id,
                location: *loc,
            });
        }
    }
    append_sync(&store, &ops);
    let live = Live(std::cell::RefCell::new(live));
    let before = seg_files(dir.path()).len();
    // Compact like the engine's tick, until nothing is left to do.
    let mut rounds = 0;
    loop {
        let head = store.shared.state.lock().head;
        let snapshot = live.0.borrow().clone();
        let moved = store.compact(&live).unwrap();
        if moved == 0 {
            break;
        }
        // Only positions in sealed segments move, into the head.
        for (id, loc) in live.0.borrow().iter() {
            if *loc != snapshot[id] {
                assert!(snapshot[id].segment() < head && loc.segment() >= head);
            }
        }
        barrier(&store);
        rounds += 1;
        assert!(rounds < 20, "compaction never settles");
    }
    let after = seg_files(dir.path()).len();
    assert!(after < before, "{before} -> {after}");
    let live = live.0.into_inner();
    for (id, loc) in &live {
        assert_eq!(store.read(*loc).unwrap().id, *id);
    }
    store.close().unwrap();
    let store = LogStore::open(dir.path(), small()).unwrap();
    let rec = take_recovered(&store);
    let got: Vec<_> = rec.partitions[&P1]
        .iter()
        .map(|m| (m.id, m.location))
        .collect();
    assert_eq!(got, live.into_iter().collect::<Vec<_>>());
}

#[test]
fn oversized_and_invalid_ops_are_rejected_whole() {
    let dir = tempfile::tempdir().unwrap();
    let store = LogStore::open(dir.path(), small()).unwrap();
    let big = vec![0u8; 5000];
    let mut locs = Vec::new();
    let r = store.append_cb(
        &[
            Op::PutMeta {
                key: b"k",
                value: b"v",
            },
            Op::Publish {
                id: 1,
                partitions: &[P1],
                data: data(&big),
            },
        ],
        &mut locs,
        None,
    );
    assert!(matches!(r, Err(StoreError::TooLarge(_))));
    let r = store.append_cb(
        &[Op::Publish {
            id: 1,
            partitions: &[],
            data: data(b"x"),
        }],
        &mut locs,
        None,
    );
    assert!(r.is_err());
    assert!(locs.is_empty());
    store.close().unwrap();
    let store = LogStore::open(dir.path(), small()).unwrap();
    assert!(take_recovered(&store).meta.is_empty());
}

/// The Store contract suite (randomized model test included), on 4 KiB
/// segments so that compaction and reclamation take part.
#[test]
fn log_store_passes_the_store_contract() {
    struct LogHarness {
        dirs: Vec<tempfile::TempDir>,
        current: Option<Arc<LogStore>>,
    }
    impl crate::testing::contract::Harness for LogHarness {
        fn create(&mut self) -> Arc<dyn Store> {
            let dir = tempfile::tempdir().unwrap();
            let store = LogStore::open(dir.path(), contract_opts()).unwrap();
            self.dirs.push(dir);
            self.current = Some(store.clone());
            store
        }
        fn persists(&self) -> bool {
            true
        }
        fn reopen(&mut self, store: Arc<dyn Store>) -> Arc<dyn Store> {
            let _no_spawn = SPAWNING.lock();
            store.close().unwrap();
            drop(store);
            self.current = None;
            let dir = self.dirs.last().expect("created first").path();
            let store = LogStore::open(dir, contract_opts()).unwrap();
            self.current = Some(store.clone());
            store
        }
        fn second_handle(&mut self, _store: &Arc<dyn Store>) -> Option<Arc<dyn Store>> {
            Some(self.current.as_ref().expect("created first").handle())
        }
        /// A process crash: what the writer handed to the kernel survives
        /// (everything appended so far, once flushed), copied as the files
        /// are while the store is still open, then opened without a clean
        /// close.
        fn crash(&mut self, store: Arc<dyn Store>) -> Option<Arc<dyn Store>> {
            let _no_spawn = SPAWNING.lock();
            let current = self.current.take().expect("created first");
            current.flush().unwrap();
            let from = self
                .dirs
                .last()
                .expect("created first")
                .path()
                .to_path_buf();
            let to = tempfile::tempdir().unwrap();
            copy_dir(&from, to.path());
            store.close().unwrap();
            drop((store, current));
            let store = LogStore::open(to.path(), contract_opts()).unwrap();
            self.dirs.push(to);
            self.current = Some(store.clone());
            Some(store)
        }
    }
    fn copy_dir(from: &Path, to: &Path) {
        std::fs::create_dir_all(to).unwrap();
        for e in std::fs::read_dir(from).unwrap() {
            let e = e.unwrap();
            let target = to.join(e.file_name());
            if e.file_type().unwrap().is_dir() {
                copy_dir(&e.path(), &target);
            } else if e.file_name() != crate::lock::LOCK_FILE {
                std::fs::copy(e.path(), &target).unwrap();
            }
        }
    }
    let mut h = LogHarness {
        dirs: Vec::new(),
        current: None,
    };
    crate::testing::contract::run_all(&mut h);
    // The randomized runs were long enough that reclamation took part.
    let reclaimed = h
        .dirs
        .iter()
        .filter(|d| seg_files(d.path()).first().is_some_and(|s| *s > 1))
        .count();
    assert!(reclaimed >= 1, "nothing was ever reclaimed");
}

fn contract_opts() -> LogOptions {
    LogOptions {
        segment_size: 4096,
        sync: false,
        compact_below: 0.5,
        reserve: true,
    }
}

/// Append throughput with 256-byte bodies and concurrent appenders, each
/// waiting for durability before its next publish (like a confirming
/// publisher), to show group commit at work. Run with
/// `cargo test --release -p weir-backend -- --ignored --nocapture bench_`.
#[test]
#[ignore]
fn bench_group_commit_throughput() {
    for sync in [true, false] {
        for appenders in [1usize, 4, 16, 64] {
            let dir = tempfile::tempdir().unwrap();
            let store = LogStore::open(
                dir.path(),
                LogOptions {
                    sync,
                    ..LogOptions::default()
                },
            )
            .unwrap();
            let per = if appenders == 1 {
                2000
            } else {
                20_000 / appenders
            };
            let body = [42u8; 256];
            let start = std::time::Instant::now();
            std::thread::scope(|s| {
                for t in 0..appenders {
                    let store = &store;
                    s.spawn(move || {
                        let parts = [PartitionId(t as u64)];
                        for _ in 0..per {
                            let id = store.allocate_ids(1);
                            append_sync(
                                store,
                                &[Op::Publish {
                                    id,
                                    partitions: &parts,
                                    data: data(&body),
                                }],
                            );
                        }
                    });
                }
            });
            let secs = start.elapsed().as_secs_f64();
            let total = appenders * per;
            let st = store.stats();
            println!(
                "sync={sync} appenders={appenders:3} msgs={total:6} {:10.0} msgs/s syncs={:6} msgs/sync={:6.1}",
                total as f64 / secs,
                st.syncs,
                total as f64 / st.syncs.max(1) as f64
            );
            store.close().unwrap();
        }
    }
    // One pipelining appender that does not wait per message: the cost of the
    // append path itself (encode under the lock, no syscalls).
    let dir = tempfile::tempdir().unwrap();
    let store = LogStore::open(dir.path(), LogOptions::default()).unwrap();
    let body = [42u8; 256];
    let total = 200_000;
    let start = std::time::Instant::now();
    for _ in 0..total {
        let id = store.allocate_ids(1);
        store
            .append_cb(
                &[Op::Publish {
                    id,
                    partitions: &[P1],
                    data: data(&body),
                }],
                &mut Vec::new(),
                None,
            )
            .unwrap();
    }
    let appended = start.elapsed().as_secs_f64();
    barrier(&store);
    let durable = start.elapsed().as_secs_f64();
    println!(
        "pipelined: {:.0} appends/s, {:.0} msgs/s durable, syncs={}",
        total as f64 / appended,
        total as f64 / durable,
        store.stats().syncs
    );
}

/// A crash leaves the head segment preallocated: zeros after the last record.
/// That is a clean end, not a torn tail, and nothing is reported truncated.
#[test]
fn preallocated_head_after_a_crash_is_a_clean_end() {
    let dir = tempfile::tempdir().unwrap();
    let crashed = tempfile::tempdir().unwrap();
    let opts = LogOptions {
        segment_size: 1 << 20,
        ..LogOptions::default()
    };
    let store = LogStore::open(dir.path(), opts.clone()).unwrap();
    let (a, _) = publish(&store, &[P1], b"one");
    let (b, _) = publish(&store, &[P1], b"two");
    // Copy the files while the store is still running: what a kill -9 leaves.
    std::fs::create_dir_all(crashed.path().join("log")).unwrap();
    let mut head_len = 0;
    for seg in seg_files(dir.path()) {
        let from = segment::segment_path(&dir.path().join("log"), seg);
        let to = segment::segment_path(&crashed.path().join("log"), seg);
        std::fs::copy(&from, &to).unwrap();
        head_len = std::fs::metadata(&to).unwrap().len();
    }
    assert_eq!(head_len, 1 << 20, "head segment is preallocated");
    store.close().unwrap();

    let reopened = LogStore::open(crashed.path(), opts).unwrap();
    let rec = take_recovered(&reopened);
    assert_eq!(rec.truncated_bytes, 0);
    assert_eq!(ids_of(&rec, P1), vec![a, b]);
    let last = *seg_files(crashed.path()).first().unwrap();
    let len = std::fs::metadata(segment::segment_path(&crashed.path().join("log"), last))
        .unwrap()
        .len();
    assert!(len < 1 << 20, "the zero tail was cut at recovery");
}

/// A clean close cuts the head segment to its last record.
#[test]
fn close_cuts_the_preallocated_tail() {
    let dir = tempfile::tempdir().unwrap();
    let opts = LogOptions {
        segment_size: 1 << 20,
        ..LogOptions::default()
    };
    let store = LogStore::open(dir.path(), opts).unwrap();
    let (_, loc) = publish(&store, &[P1], b"one");
    store.close().unwrap();
    let seg = seg_files(dir.path())[0];
    let len = std::fs::metadata(segment::segment_path(&dir.path().join("log"), seg))
        .unwrap()
        .len();
    assert_eq!(len, u64::from(loc.offset() + loc.len()));
}

/// Appends nobody waits on (acks, unconfirmed publishes) are written without
/// an fsync of their own, but an idle store still syncs them soon after.
#[test]
fn unwaited_appends_are_synced_when_idle() {
    let dir = tempfile::tempdir().unwrap();
    let store = LogStore::open(dir.path(), LogOptions::default()).unwrap();
    publish(&store, &[P1], b"one");
    let before = store.stats().syncs;
    let id = store.allocate_ids(1);
    store
        .append_cb(
            &[Op::Publish {
                id,
                partitions: &[P1],
                data: data(b"two"),
            }],
            &mut Vec::new(),
            None,
        )
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while store.stats().syncs == before {
        assert!(std::time::Instant::now() < deadline, "never synced");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn flipped_bit_mid_head_segment_refuses_then_repair_keeps_the_rest() {
    let dir = tempfile::tempdir().unwrap();
    let mut locs = Vec::new();
    let mut ids = Vec::new();
    {
        let store = LogStore::open(dir.path(), LogOptions::default()).unwrap();
        for i in 0..50u32 {
            let (id, loc) = publish(&store, &[P1], format!("body-{i}").as_bytes());
            ids.push(id);
            locs.push(loc);
        }
        store.close().unwrap();
    }
    // All in one (the last) segment; damage the 10th record's body.
    assert!(locs.iter().all(|l| l.segment() == locs[0].segment()));
    let path = segment::segment_path(&dir.path().join("log"), locs[0].segment());
    let mut bytes = std::fs::read(&path).unwrap();
    let victim = locs[9];
    bytes[victim.offset() as usize + victim.len() as usize - 3] ^= 0x04;
    std::fs::write(&path, &bytes).unwrap();

    let err = LogStore::open(dir.path(), LogOptions::default()).unwrap_err();
    let text = err.to_string();
    match LogError::of(&err) {
        Some(LogError::Damaged(d)) => {
            assert_eq!(d.offset, u64::from(victim.offset()));
            assert_eq!(d.len, u64::from(victim.len()));
            assert_eq!(
                d.lost,
                vec![super::LostRecord::Message {
                    id: ids[9],
                    partitions: vec![P1]
                }]
            );
        }
        other => panic!("expected damage, got {other:?}"),
    }
    assert!(
        text.contains("00000001.seg") && text.contains("weir repair"),
        "{text}"
    );
    // Refusing did not touch the file.
    assert_eq!(std::fs::read(&path).unwrap(), bytes);

    let report = super::repair(dir.path()).unwrap();
    assert_eq!(report.lost_message_ids(), vec![ids[9]]);
    let q = std::fs::read(&report.quarantined[0]).unwrap();
    let (o, l) = (victim.offset() as usize, victim.len() as usize);
    assert_eq!(q, bytes[o..o + l]);

    let store = LogStore::open(dir.path(), LogOptions::default()).unwrap();
    let rec = take_recovered(&store);
    let mut want = ids.clone();
    want.remove(9);
    assert_eq!(ids_of(&rec, P1), want);
    assert_eq!(rec.truncated_bytes, 0);
    // A second repair finds nothing.
    store.close().unwrap();
    drop(store);
    assert!(super::repair(dir.path()).unwrap().damages.is_empty());
}

#[test]
fn second_open_of_a_directory_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let store = LogStore::open(dir.path(), small()).unwrap();
    match LogStore::open(dir.path(), small()) {
        Err(e) => match LogError::of(&e) {
            Some(LogError::Locked { holder, .. }) => {
                assert_eq!(*holder, Some(std::process::id()))
            }
            _ => panic!("expected the lock to be refused, got {e:?}"),
        },
        Ok(_) => panic!("expected the lock to be refused"),
    }
    assert!(matches!(
        super::repair(dir.path())
            .map_err(|e| matches!(LogError::of(&e), Some(LogError::Locked { .. }))),
        Err(true)
    ));
    store.close().unwrap();
    LogStore::open(dir.path(), small()).unwrap();
}

#[test]
fn paged_messages_are_readable_settleable_and_dropped_at_restart() {
    use crate::Spill;
    let dir = tempfile::tempdir().unwrap();
    let (paged, kept);
    {
        let store = LogStore::open(dir.path(), small()).unwrap();
        let id = store.allocate_ids(1);
        let (loc, _) =
            Spill::spill(&*store, ShareTag::BROKER, id, &[P2], data(b"transient")).unwrap();
        paged = (id, loc);
        assert!(Spill::holds(&*store, loc));
        assert_eq!(
            &Spill::read(&*store, paged.1).unwrap().body[..],
            b"transient"
        );
        assert!(
            Store::read(&*store, paged.1).is_err(),
            "a spilled copy is not the store's"
        );
        kept = publish(&store, &[P1], b"durable");
        assert!(!Spill::holds(&*store, kept.1));
        // Compaction of a paged record keeps it paged.
        let moved = store.relocate(P2, id, paged.1).unwrap();
        assert!(Spill::holds(&*store, moved));
        assert_eq!(&Spill::read(&*store, moved).unwrap().body[..], b"transient");
        let id2 = store.allocate_ids(1);
        let (loc2, _) =
            Spill::spill(&*store, ShareTag::BROKER, id2, &[P3], data(b"settled")).unwrap();
        Spill::release(&*store, P3, id2, loc2);
        store.close().unwrap();
    }
    let store = LogStore::open(dir.path(), small()).unwrap();
    let rec = take_recovered(&store);
    assert_eq!(ids_of(&rec, P1), vec![kept.0]);
    assert!(
        !rec.partitions.contains_key(&P2),
        "paged data survived a restart"
    );
    assert!(!rec.partitions.contains_key(&P3));
    assert!(
        store.allocate_ids(1) > paged.0 + 1,
        "paged ids are never reused"
    );
}

/// Held while a test spawns a process, and by tests that close and reopen a
/// store in a loop: a child briefly inherits (until its exec) the open file
/// that holds a store's directory lock, and a reopen in that window would be
/// refused as if another process held the directory.
static SPAWNING: parking_lot::Mutex<()> = parking_lot::Mutex::new(());

/// A small tmpfs for out-of-space tests; `None` (test skipped) when it
/// cannot be mounted (not root).
struct Tmpfs(tempfile::TempDir);

impl Tmpfs {
    fn mount(size: &str) -> Option<Tmpfs> {
        let dir = tempfile::tempdir().unwrap();
        let _spawning = SPAWNING.lock();
        let ok = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir.path())
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            eprintln!("SKIPPED: cannot mount a tmpfs");
            return None;
        }
        Some(Tmpfs(dir))
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _spawning = SPAWNING.lock();
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(self.0.path())
            .status();
    }
}

fn fill_fs(path: &Path) {
    use std::io::Write;
    let mut f = std::fs::File::create(path).unwrap();
    let chunk = vec![1u8; 16 << 10];
    while f.write(&chunk).is_ok_and(|n| n > 0) {}
}

/// Publishes with a waiter; returns the location and whether it became durable.
fn try_publish(store: &LogStore, body: &[u8]) -> Result<(MessageId, bool), StoreError> {
    let id = store.allocate_ids(1);
    let (tx, rx) = mpsc::channel();
    store.append_cb(
        &[Op::Publish {
            id,
            partitions: &[P1],
            data: data(body),
        }],
        &mut Vec::new(),
        Some(Box::new(move |r| {
            let _ = tx.send(r.is_ok());
        })),
    )?;
    Ok((id, rx.recv_timeout(Duration::from_secs(20)).unwrap()))
}

#[test]
fn out_of_space_write_fails_waiters_without_failing_the_store_and_recovers() {
    let Some(fs) = Tmpfs::mount("3m") else { return };
    let dir = fs.0.path().join("store");
    let opts = LogOptions {
        segment_size: 256 << 10,
        reserve: false,
        ..LogOptions::default()
    };
    let store = LogStore::open(&dir, opts.clone()).unwrap();
    let mut durable = Vec::new();
    let (first, ok) = try_publish(&store, &[7u8; 1000]).unwrap();
    assert!(ok);
    durable.push(first);
    fill_fs(&fs.0.path().join("filler"));
    // Fill the preallocated head; the roll then finds no space.
    let mut failed = 0;
    for _ in 0..2000 {
        match try_publish(&store, &[7u8; 1000]) {
            Ok((id, true)) => durable.push(id),
            Ok((_, false)) => failed += 1,
            Err(StoreError::NoSpace) => break,
            Err(e) => panic!("unexpected {e}"),
        }
    }
    assert_eq!(failed, 1, "exactly the round that hit the full disk fails");
    // Settles are still accepted (kept in memory until there is room).
    store
        .append_cb(
            &[Op::Settle {
                partition: P1,
                id: first,
                location: Location::log(1, 0, 1),
            }],
            &mut Vec::new(),
            None,
        )
        .unwrap();
    std::fs::remove_file(fs.0.path().join("filler")).unwrap();
    // Space is back: publishes become durable again, no reopen.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        match try_publish(&store, b"after") {
            Ok((id, true)) => {
                durable.push(id);
                break;
            }
            Ok((_, false)) | Err(StoreError::NoSpace) => {}
            Err(e) => panic!("unexpected {e}"),
        }
        assert!(std::time::Instant::now() < deadline, "never recovered");
        std::thread::sleep(Duration::from_millis(50));
    }
    store.close().unwrap();
    drop(store);
    let store = LogStore::open(&dir, opts).unwrap();
    let rec = take_recovered(&store);
    let got: std::collections::BTreeSet<_> = ids_of(&rec, P1).into_iter().collect();
    // The settle written from memory after the space came back is durable.
    assert!(!got.contains(&first));
    for id in &durable[1..] {
        assert!(got.contains(id), "durable publish {id} lost");
    }
}

/// A data directory from before versioned segments (format 0: records from
/// offset 0, no header) is refused, untouched, with an error naming the
/// directory, both formats and the way forward.
#[test]
fn directory_in_format_0_is_refused_untouched() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("log");
    std::fs::create_dir_all(&log).unwrap();
    // A settle record has the same layout in formats 0 and 1.
    let mut old = Vec::new();
    record::encode_settle(&mut old, P1, 7);
    let path = segment::segment_path(&log, 1);
    std::fs::write(&path, &old).unwrap();
    let err = LogStore::open(dir.path(), small()).unwrap_err();
    match LogError::of(&err) {
        Some(LogError::UnsupportedFormat {
            found, expected, ..
        }) => assert_eq!((*found, *expected), (0, segment::FORMAT_VERSION)),
        other => panic!("expected a format refusal, got {other:?}"),
    }
    let text = err.to_string();
    for needle in [
        dir.path().to_str().unwrap(),
        "format 0",
        "log format 1",
        "00000001.seg",
        "drained",
    ] {
        assert!(text.contains(needle), "{needle:?} missing from: {text}");
    }
    assert_eq!(
        std::fs::read(&path).unwrap(),
        old,
        "refusal changed the log"
    );
    assert!(matches!(
        super::repair(dir.path())
            .map_err(|e| matches!(LogError::of(&e), Some(LogError::UnsupportedFormat { .. }))),
        Err(true)
    ));

    // A newer format is refused the same way.
    let mut newer = segment::header().to_vec();
    newer[8] = 9;
    std::fs::write(&path, &newer).unwrap();
    match LogStore::open(dir.path(), small()) {
        Err(e)
            if matches!(
                LogError::of(&e),
                Some(LogError::UnsupportedFormat { found: 9, .. })
            ) => {}
        other => panic!("expected a format refusal, got {other:?}"),
    }
}

/// Segments start with the header; a head segment whose header write was
/// torn (created, nothing durable) is rewritten empty, and the store opens.
#[test]
fn segments_carry_a_header_and_a_torn_one_is_rewritten() {
    let dir = tempfile::tempdir().unwrap();
    let (a, loc);
    {
        let store = LogStore::open(dir.path(), small()).unwrap();
        (a, loc) = publish(&store, &[P1], b"one");
        store.close().unwrap();
    }
    assert_eq!(loc.offset() as usize, segment::HEADER_LEN);
    let log = dir.path().join("log");
    let bytes = std::fs::read(segment::segment_path(&log, loc.segment())).unwrap();
    assert_eq!(segment::check_header(&bytes), segment::HeaderCheck::Valid);
    // A crash right after creating the next segment: 5 header bytes, zeros.
    let torn = segment::segment_path(&log, loc.segment() + 1);
    let mut t = segment::header()[..5].to_vec();
    t.resize(4096, 0);
    std::fs::write(&torn, &t).unwrap();
    let store = LogStore::open(dir.path(), small()).unwrap();
    assert_eq!(ids_of(&take_recovered(&store), P1), vec![a]);
    assert_eq!(std::fs::read(&torn).unwrap(), segment::header());
    let (b, _) = publish(&store, &[P1], b"two");
    store.close().unwrap();
    let store = LogStore::open(dir.path(), small()).unwrap();
    assert_eq!(ids_of(&take_recovered(&store), P1), vec![a, b]);
}

/// The `.spare` files in `<dir>/log`, sorted.
fn spare_files(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir.join("log"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "spare"))
        .collect();
    v.sort();
    v
}

#[test]
fn reclaimed_segments_are_zeroed_and_reused_without_resurrecting_old_records() {
    let dir = tempfile::tempdir().unwrap();
    let log_dir = dir.path().join("log");
    let mut fresh = Vec::new();
    {
        let store = LogStore::open(dir.path(), small()).unwrap();
        // Fill several segments, then settle everything: all are reclaimed.
        let msgs: Vec<_> = (0..60u32)
            .map(|i| publish(&store, &[P1], &[i as u8; 200]))
            .collect();
        for (id, loc) in msgs {
            settle(&store, P1, id, loc);
        }
        barrier(&store);
        let ready = store.shared.spares.wait_idle();
        assert_eq!(ready, spares::MAX_SPARES);
        let spares_now = spare_files(dir.path());
        assert_eq!(spares_now.len(), spares::MAX_SPARES, "{spares_now:?}");
        for p in &spares_now {
            let bytes = std::fs::read(p).unwrap();
            // Zeroed to a whole segment: reads like a fresh allocation.
            assert_eq!(bytes.len() as u64, small().segment_size);
            assert!(bytes.iter().all(|&b| b == 0), "{} not zeroed", p.display());
        }
        // Beyond the pool, reclaimed segments are deleted.
        let leftovers: Vec<_> = std::fs::read_dir(&log_dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n.ends_with(".del"))
            .collect();
        assert!(leftovers.is_empty(), "{leftovers:?}");

        // New segments come from the pool; a few records each, so most of
        // each reused file lies past the last record.
        let before = store.stats().segments;
        for i in 0..12u32 {
            fresh.push(publish(&store, &[P2], &[i as u8; 900]).0);
        }
        barrier(&store);
        assert!(store.stats().segments >= before + 2);
        assert!(spare_files(dir.path()).is_empty());
        store.close().unwrap();
    }
    // Nothing of the old records comes back from the reused files.
    let store = LogStore::open(dir.path(), small()).unwrap();
    let rec = take_recovered(&store);
    assert!(!rec.partitions.contains_key(&P1));
    assert_eq!(ids_of(&rec, P2), fresh);
}

#[test]
fn spares_of_another_size_are_deleted_at_open() {
    let dir = tempfile::tempdir().unwrap();
    let log_dir = dir.path().join("log");
    std::fs::create_dir_all(&log_dir).unwrap();
    std::fs::write(log_dir.join("00000001.spare"), vec![0u8; 100]).unwrap();
    std::fs::write(log_dir.join("00000002.spare"), vec![0u8; 4096]).unwrap();
    let store = LogStore::open(dir.path(), small()).unwrap();
    assert_eq!(
        spare_files(dir.path()),
        vec![log_dir.join("00000002.spare")]
    );
    store.close().unwrap();
}

/// Appends one unwaited publish of `body` for `owner`.
fn publish_for(store: &LogStore, owner: ShareTag, body: &[u8]) -> Admission {
    let id = store.allocate_ids(1);
    let ops = [Op::Publish {
        id,
        partitions: &[P1],
        data: data(body),
    }];
    store.append_for(owner, &ops, &mut Vec::new()).unwrap().1
}

/// Bytes appended and not yet taken by the writer.
fn pending_bytes(store: &LogStore) -> usize {
    let st = store.shared.state.lock();
    st.pending.iter().map(|c| c.buf.len()).sum()
}

#[test]
fn a_flooding_owner_is_held_to_its_share_so_a_quiet_owners_record_is_not_behind_its_backlog() {
    let dir = tempfile::tempdir().unwrap();
    let store = LogStore::open(dir.path(), LogOptions::default()).unwrap();
    let (hot, quiet) = (ShareTag(1), ShareTag(2));
    let body = vec![7u8; 16 << 10];

    // Alone, an owner is never held back, however much it has waiting.
    let mut alone = 0;
    while alone < 2 * fair::ROUND_BUDGET as usize {
        assert!(!publish_for(&store, hot, &body).over_share);
        alone += body.len();
    }
    barrier(&store);

    // A second owner shares the writer: the flood is told it is over its
    // share once about half the budget of it waits, never the quiet one.
    assert!(!publish_for(&store, quiet, b"q").over_share);
    let mut flagged = false;
    for _ in 0..(4 * fair::ROUND_BUDGET as usize / body.len()) {
        if publish_for(&store, hot, &body).over_share {
            flagged = true;
            break;
        }
    }
    assert!(flagged, "the flooding owner was never held back");
    let waiting = store.shared.state.lock().shares.waiting(hot);
    assert!(
        waiting <= fair::ROUND_BUDGET + body.len() as u64,
        "{waiting} bytes of the flood wait"
    );
    assert!(!publish_for(&store, quiet, b"q").over_share);

    // Its producer stops there: the quiet owner's next confirmed record is
    // behind at most a budget of the flood, and is durable with the next
    // round.
    let ahead = pending_bytes(&store);
    assert!(
        ahead <= fair::ROUND_BUDGET as usize + 2 * body.len(),
        "{ahead}"
    );
    let (tx, rx) = mpsc::channel();
    let id = store.allocate_ids(1);
    store
        .append_for(
            quiet,
            &[Op::Publish {
                id,
                partitions: &[P2],
                data: data(b"quiet"),
            }],
            &mut Vec::new(),
        )
        .map(|(t, _)| {
            store.when_durable(
                t,
                Box::new(move |r| {
                    let _ = tx.send(r);
                }),
            )
        })
        .unwrap();
    rx.recv_timeout(Duration::from_secs(20))
        .expect("waiter called")
        .expect("durable");

    // Once its appends are durable (the barrier its producer waits on), the
    // flooding owner is admitted again.
    assert_eq!(store.shared.state.lock().shares.waiting(hot), 0);
    assert!(!publish_for(&store, hot, &body).over_share);
    // Broker work is never held back.
    for _ in 0..(2 * fair::ROUND_BUDGET as usize / body.len()) {
        assert!(!publish_for(&store, ShareTag::BROKER, &body).over_share);
    }
    store.close().unwrap();
}

// ---------------------------------------------------------------------------
// The recorded end: damage below it is never a torn tail (issue 20, item 8)

/// A clean close records the head segment's whole length in its header, so a
/// flipped bit in its last record is damage: open refuses naming segment and
/// offset, repair quarantines the record and names the lost message, and the
/// rest comes back.
#[test]
fn clean_close_then_flipped_bit_in_last_record_is_damage() {
    let dir = tempfile::tempdir().unwrap();
    let locs = three_messages(dir.path());
    let last = locs[2];
    let path = segment::segment_path(&dir.path().join("log"), last.segment());
    let mut bytes = std::fs::read(&path).unwrap();
    let end = u64::from(last.offset() + last.len());
    assert_eq!(bytes.len() as u64, end, "sealed at its last record");
    assert_eq!(recorded_end_of(&path), end, "the clean close recorded it");
    let id = {
        // Which id the last publish got: the first recovery tells.
        let store = LogStore::open(dir.path(), LogOptions::default()).unwrap();
        let rec = take_recovered(&store);
        store.close().unwrap();
        rec.partitions[&P1][2].id
    };
    assert_eq!(
        std::fs::read(&path).unwrap(),
        bytes,
        "a clean reopen wrote nothing"
    );
    bytes[last.offset() as usize + last.len() as usize - 2] ^= 0x01;
    std::fs::write(&path, &bytes).unwrap();

    match damaged(LogStore::open(dir.path(), LogOptions::default())) {
        Ok(d) => {
            assert_eq!(d.segment, last.segment());
            assert_eq!(d.offset, u64::from(last.offset()));
            assert_eq!(d.len, u64::from(last.len()));
            assert_eq!(
                d.lost,
                vec![super::LostRecord::Message {
                    id,
                    partitions: vec![P1]
                }]
            );
            let text = LogError::Damaged(d).to_string();
            assert!(text.contains("not a torn tail"), "{text}");
        }
        other => panic!("expected damage, got {other:?}"),
    }
    assert_eq!(
        std::fs::read(&path).unwrap(),
        bytes,
        "refusing changed the log"
    );

    let report = super::repair(dir.path()).unwrap();
    assert_eq!(report.lost_message_ids(), vec![id]);
    let (o, l) = (last.offset() as usize, last.len() as usize);
    assert_eq!(
        std::fs::read(&report.quarantined[0]).unwrap(),
        bytes[o..o + l]
    );
    // The repaired segment records its new end.
    assert_eq!(recorded_end_of(&path), u64::from(last.offset()));

    let store = LogStore::open(dir.path(), LogOptions::default()).unwrap();
    let rec = take_recovered(&store);
    assert_eq!(rec.truncated_bytes, 0);
    assert_eq!(rec.partitions[&P1].len(), 2);
    assert_eq!(&store.read(locs[1]).unwrap().body[..], b"two");
    store.close().unwrap();
    assert!(super::repair(dir.path()).unwrap().damages.is_empty());
}

/// A cleanly closed segment cut short (inside its last record, or at a
/// record boundary) lost durable bytes: damage, and repair fixes the header.
#[test]
fn segment_shorter_than_its_recorded_end_is_damage() {
    for inside in [true, false] {
        let dir = tempfile::tempdir().unwrap();
        let locs = three_messages(dir.path());
        let last = locs[2];
        let path = segment::segment_path(&dir.path().join("log"), last.segment());
        let cut = u64::from(last.offset()) + if inside { 7 } else { 0 };
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(cut)
            .unwrap();
        match damaged(LogStore::open(dir.path(), LogOptions::default())) {
            Ok(d) => {
                assert_eq!(d.offset, u64::from(last.offset()), "inside {inside}");
                // The cut-off part of the record included.
                assert_eq!(d.len, u64::from(last.len()), "inside {inside}");
                if !inside {
                    assert!(d.reason.contains("records"), "{}", d.reason);
                }
            }
            other => panic!("inside {inside}: expected damage, got {other:?}"),
        }
        let report = super::repair(dir.path()).unwrap();
        assert_eq!(report.damages.len(), 1, "inside {inside}");
        assert_eq!(recorded_end_of(&path), u64::from(last.offset()));
        let store = LogStore::open(dir.path(), LogOptions::default()).unwrap();
        let rec = take_recovered(&store);
        assert_eq!(rec.partitions[&P1].len(), 2, "inside {inside}");
        assert_eq!(rec.truncated_bytes, 0);
    }
}

/// After a crash (files copied from a running store), what the writer had
/// recorded as fsynced is protected, and only a torn write past it is a torn
/// tail.
#[test]
fn after_a_crash_only_a_tail_past_the_recorded_end_is_torn() {
    let dir = tempfile::tempdir().unwrap();
    let opts = LogOptions {
        segment_size: 1 << 20,
        ..LogOptions::default()
    };
    let store = LogStore::open(dir.path(), opts.clone()).unwrap();
    let mut locs = Vec::new();
    for body in [&b"one"[..], b"two", b"three"] {
        locs.push(publish(&store, &[P1], body).1);
    }
    let last = locs[2];
    let end = u64::from(last.offset() + last.len());
    let path = segment::segment_path(&dir.path().join("log"), last.segment());
    // The writer records the fsynced end once idle (within about a second).
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while recorded_end_of(&path) < end {
        assert!(std::time::Instant::now() < deadline, "end never recorded");
        std::thread::sleep(Duration::from_millis(20));
    }
    // What a kill -9 leaves: the preallocated head, as it is now.
    let image = std::fs::read(&path).unwrap();
    assert!(image.len() as u64 > end, "head segment is preallocated");
    store.close().unwrap();
    drop(store);

    let crashed = |bytes: &[u8]| {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(d.path().join("log")).unwrap();
        std::fs::write(
            segment::segment_path(&d.path().join("log"), last.segment()),
            bytes,
        )
        .unwrap();
        d
    };

    // A torn write after the recorded end: truncated, all three kept.
    let mut torn = image.clone();
    let e = end as usize;
    torn[e..e + 20].copy_from_slice(&image[locs[1].offset() as usize..][..20]);
    let d = crashed(&torn);
    let store = LogStore::open(d.path(), opts.clone()).unwrap();
    let rec = take_recovered(&store);
    assert_eq!(rec.partitions[&P1].len(), 3);
    assert!(rec.truncated_bytes > 0);
    store.close().unwrap();

    // A flipped bit in the last (fsynced, recorded) record: damage.
    let mut flipped = image.clone();
    flipped[last.offset() as usize + 12] ^= 0x40;
    let d = crashed(&flipped);
    match damaged(LogStore::open(d.path(), opts.clone())) {
        Ok(dmg) => assert_eq!(dmg.offset, u64::from(last.offset())),
        other => panic!("expected damage, got {other:?}"),
    }
    // The same flip when the crash came before the end was recorded: an
    // unconfirmed torn tail, as before.
    segment::set_recorded_end(&mut flipped, u64::from(last.offset()));
    let d = crashed(&flipped);
    let store = LogStore::open(d.path(), opts.clone()).unwrap();
    let rec = take_recovered(&store);
    assert_eq!(rec.partitions[&P1].len(), 2);
    // The record and the preallocated zeros after it.
    assert_eq!(
        rec.truncated_bytes,
        flipped.len() as u64 - u64::from(last.offset())
    );
}

/// Rolling to a new segment records the sealed one's whole length, and a
/// store with fsync off records nothing (nothing is known durable).
#[test]
fn rolls_record_the_sealed_end_and_fsync_off_records_nothing() {
    for sync in [true, false] {
        let dir = tempfile::tempdir().unwrap();
        let opts = LogOptions { sync, ..small() };
        let store = LogStore::open(dir.path(), opts).unwrap();
        for _ in 0..40 {
            publish(&store, &[P1], &[7u8; 300]);
        }
        let segs = seg_files(dir.path());
        assert!(segs.len() >= 3);
        for &seg in &segs[..segs.len() - 1] {
            let path = segment::segment_path(&dir.path().join("log"), seg);
            let want = if sync {
                std::fs::metadata(&path).unwrap().len()
            } else {
                0
            };
            assert_eq!(recorded_end_of(&path), want, "sync {sync} segment {seg}");
        }
        store.close().unwrap();
    }
}

/// `read_from` (a stream reader's seek): from a known position on, only
/// that partition's records, in order, across segment rolls, and records
/// the writer has not written yet (appended without waiting).
#[test]
fn read_from_reads_one_partition_forward_across_segments_and_unwritten_records() {
    let dir = tempfile::tempdir().unwrap();
    let store = LogStore::open(dir.path(), small()).unwrap();
    let mut ours = Vec::new();
    for i in 0..60u32 {
        let body = format!("p1-{i}").into_bytes();
        ours.push(publish(&store, &[P1], &body));
        // Other partitions' records in between (and a shared one).
        publish(&store, &[P2], &[b'z'; 300]);
        if i % 7 == 0 {
            ours.push(publish(&store, &[P1, P3], b"shared"));
        }
    }
    // And some not waited for: still in the writer's buffers.
    for i in 0..5u32 {
        let id = store.allocate_ids(1);
        let body = format!("late-{i}").into_bytes();
        let mut locs = Vec::new();
        store
            .append(
                &[Op::Publish {
                    id,
                    partitions: &[P1],
                    data: data(&body),
                }],
                &mut locs,
            )
            .unwrap();
        ours.push((id, locs[0]));
    }
    assert!(seg_files(dir.path()).len() > 3, "the test spans segments");
    for start in [0, 1, 17, ours.len() - 3] {
        let (id, at) = ours[start];
        let got = crate::block_on(store.read_from(MessageRef::new(P1, id, at), 1000)).unwrap();
        let want: Vec<MessageId> = ours[start..].iter().map(|(id, _)| *id).collect();
        assert_eq!(
            got.iter().map(|m| m.at.id).collect::<Vec<_>>(),
            want,
            "from {start}"
        );
        for (m, (id, loc)) in got.iter().zip(&ours[start..]) {
            assert_eq!((m.at.id, m.at.location), (*id, *loc));
            assert_eq!(m.message.id, *id);
        }
    }
    // `max` bounds it.
    let (id, at) = ours[0];
    let got = crate::block_on(store.read_from(MessageRef::new(P1, id, at), 4)).unwrap();
    assert_eq!(got.len(), 4);
    assert_eq!(&got[3].message.body[..], b"p1-2");
}
