//! Rebuilding the store's state at open: checkpoint, then a scan of every
//! retained segment in order.

use super::checkpoint::{self, Checkpoint};
use super::error::{LogError, SegmentId};
use super::record::{self, MessageKind, Record};
use super::scan;
use super::segment::{self, SegmentInfo};
use crate::{Location, MessageId, PartitionId, RecoveredMessage, StoreError};
use std::collections::{BTreeMap, HashMap};
use std::fs::OpenOptions;
use std::path::Path;

/// The error for damage at `buf[off..end]` of segment `seg`.
fn damage(
    path: &Path,
    seg: SegmentId,
    buf: &[u8],
    off: usize,
    end: usize,
    recorded_end: u64,
) -> StoreError {
    let mut d = damage_info(path, seg, buf, off, end);
    extend_to_recorded_end(&mut d, buf.len(), recorded_end);
    LogError::Damaged(Box::new(d)).into()
}

/// A damaged range reaching the end of a file shorter than its recorded end
/// also covers the missing bytes: one damage, not two. Returns whether it
/// did.
pub(crate) fn extend_to_recorded_end(
    d: &mut super::error::Damage,
    file_len: usize,
    recorded_end: u64,
) -> bool {
    let (end, file_len) = (d.offset + d.len, file_len as u64);
    if end != file_len || recorded_end <= file_len {
        return false;
    }
    d.len = recorded_end - d.offset;
    d.lost.push(super::error::LostRecord::Unreadable {
        offset: file_len,
        len: recorded_end - file_len,
    });
    true
}

/// Describes the damage at `buf[off..end]` of segment `seg`.
pub(crate) fn damage_info(
    path: &Path,
    seg: SegmentId,
    buf: &[u8],
    off: usize,
    end: usize,
) -> super::error::Damage {
    super::error::Damage {
        file: path.to_path_buf(),
        segment: seg,
        offset: off as u64,
        len: (end - off) as u64,
        reason: scan::reason(&buf[off..end]),
        lost: scan::describe(&buf[off..end], off as u64),
    }
}

/// The damage of segment `seg` whose data ends at `end`, short of the
/// durable end its header records: fsynced bytes are missing (the file was
/// cut, or a flipped bit in the header misrecords its end). `None` when
/// nothing is missing.
pub(crate) fn missing_tail(
    path: &Path,
    seg: SegmentId,
    end: usize,
    recorded_end: u64,
) -> Option<super::error::Damage> {
    let end = end as u64;
    (end < recorded_end).then(|| super::error::Damage {
        file: path.to_path_buf(),
        segment: seg,
        offset: end,
        len: recorded_end - end,
        reason: format!(
            "the segment ends at byte {end}, before the durable end {recorded_end} its header records"
        ),
        lost: vec![super::error::LostRecord::Unreadable {
            offset: end,
            len: recorded_end - end,
        }],
    })
}

/// A live message during the scan.
struct Live {
    rm: RecoveredMessage,
    /// A requeue record changed its delivery state after its record.
    requeued: bool,
}

/// What open needs to continue where the previous run stopped.
pub(crate) struct RecoveryOutput {
    /// Live messages per partition, in id order (handed out per partition).
    pub partitions: HashMap<PartitionId, Vec<RecoveredMessage>>,
    /// Delivery state (attempts, deliver_at_ms) of the live messages whose
    /// state differs from what their current record says (a requeue record
    /// came after it): what a relocated copy must carry.
    pub requeued: HashMap<(PartitionId, MessageId), (u32, u64)>,
    /// The latest expiry of every (partition, key hash) with a receipt
    /// record in the log, if not expired at the start of the scan.
    pub receipts: HashMap<(PartitionId, u64), u64>,
    /// Bytes of a torn tail dropped.
    pub truncated_bytes: u64,
    /// The metadata map (the store's own copy, for checkpoints and the engine).
    pub meta: BTreeMap<Vec<u8>, Vec<u8>>,
    /// The version of `meta`.
    pub meta_version: u64,
    /// The state store: per key, its version and value.
    pub state: BTreeMap<Vec<u8>, (u64, Vec<u8>)>,
    /// The highest state sequence number seen (checkpoint or records).
    pub state_seq: u64,
    /// Accounting of every retained segment, all sealed.
    pub segments: BTreeMap<SegmentId, SegmentInfo>,
    /// The next id to allocate.
    pub next_id: MessageId,
    /// What the checkpoint on disk covers.
    pub checkpoint: Checkpoint,
    /// The last segment and its logical end, when its preallocated zero tail
    /// was kept (`keep_zero_tail`) so appends can continue in it.
    pub continued_head: Option<(SegmentId, u64)>,
}

/// Reads the checkpoint and scans `<dir>/log`. Truncates a torn tail of the
/// last segment (past its recorded end); fails on damage anywhere else.
pub(crate) fn recover(
    dir: &Path,
    log_dir: &Path,
    sync: bool,
    keep_zero_tail: bool,
) -> Result<RecoveryOutput, StoreError> {
    let mut ckpt = checkpoint::load(dir)?;
    let ids = segment::list_segments(log_dir)?;
    // Segments are only ever deleted oldest-first, so the retained ones are
    // contiguous. A gap means a file went missing and replay would be wrong
    // (a settle could be lost and its message resurrected, or worse).
    for w in ids.windows(2) {
        if w[1] != w[0] + 1 {
            return Err(super::error::corrupt(
                w[0] + 1,
                0,
                format!("segment file missing between {} and {}", w[0], w[1]),
            ));
        }
    }

    let mut meta = std::mem::take(&mut ckpt.meta);
    let mut meta_version = ckpt.version;
    let mut state = std::mem::take(&mut ckpt.state);
    let mut state_seq = ckpt.state_seq;
    let mut max_id: Option<MessageId> = None;
    let mut live: HashMap<PartitionId, BTreeMap<MessageId, Live>> = HashMap::new();
    let mut receipts: HashMap<(PartitionId, u64), u64> = HashMap::new();
    let now = super::now_ms();
    let mut segments = BTreeMap::new();
    let mut truncated_bytes = 0u64;
    let mut continued_head = None;

    for (i, &seg) in ids.iter().enumerate() {
        let last = i + 1 == ids.len();
        let path = segment::segment_path(log_dir, seg);
        let buf = std::fs::read(&path)
            .map_err(|e| StoreError::io(format!("reading {}", path.display()), e))?;
        let mut info = SegmentInfo::default();
        match segment::check_header(&buf) {
            segment::HeaderCheck::Valid => {}
            segment::HeaderCheck::Torn if last => {
                // Created, but its first write never completed: nothing in
                // it was durable. Give it a header and keep it, empty, so
                // segment ids stay contiguous.
                tracing::warn!(
                    segment = seg,
                    "rewriting the torn header of the last log segment"
                );
                write_empty_segment(&path, sync)?;
                info.size = segment::HEADER_LEN as u64;
                segments.insert(seg, info);
                continue;
            }
            check => return Err(format_error(dir, &path, seg, check)),
        }
        // Below it every byte was fsynced: damage there is never a torn tail.
        let recorded_end = segment::recorded_end(&buf);
        let mut off = segment::HEADER_LEN;
        let mut zero_tail = false;
        while off < buf.len() {
            // The common case, a valid record, is checked (CRC) and decoded
            // once; only what is not one is classified by the scan.
            let valid = record::split_frame(&buf[off..])
                .ok()
                .and_then(|(payload, len)| Some((record::decode_payload(payload).ok()?, len)));
            let (rec, len) = match valid {
                Some(ok) => ok,
                None => match scan::next_item(&buf, off, last, recorded_end) {
                    scan::Item::CleanEnd => {
                        // The preallocated, never-written rest of the head
                        // segment: a clean end, not a torn record.
                        zero_tail = true;
                        break;
                    }
                    // Unconfirmed: the last round was never fsynced.
                    scan::Item::TornTail => break,
                    scan::Item::Damaged { end } => {
                        return Err(damage(&path, seg, &buf, off, end, recorded_end));
                    }
                    // next_item applies the same check as above.
                    scan::Item::Record { len } => {
                        return Err(damage(&path, seg, &buf, off, off + len, recorded_end));
                    }
                },
            };
            let loc = Location::log(seg, off as u32, len as u32);
            match rec {
                Record::Message(m) if m.kind == MessageKind::Page => {
                    // Paged transient data dies with the process; only its
                    // id must never be handed out again.
                    max_id = Some(max_id.map_or(m.id, |x| x.max(m.id)));
                    info.max_id = info.max_id.max(m.id);
                    info.placed += m.partition_count() as u64;
                }
                Record::Message(m) => {
                    max_id = Some(max_id.map_or(m.id, |x| x.max(m.id)));
                    info.max_id = info.max_id.max(m.id);
                    info.placed += m.partition_count() as u64;
                    let rm = RecoveredMessage {
                        id: m.id,
                        location: loc,
                        size: m.body.len() as u32,
                        attempts: m.attempts,
                        attrs: m.attrs,
                    };
                    // A relocate record re-inserts even when the publish is
                    // gone: its original segment may already be reclaimed.
                    // It carries the delivery state as of its writing.
                    debug_assert!(m.kind != MessageKind::Relocate || m.partition_count() == 1);
                    for p in m.partitions() {
                        live.entry(p).or_default().insert(
                            m.id,
                            Live {
                                rm,
                                requeued: false,
                            },
                        );
                    }
                    // A move settles its source in the same record.
                    if let Some((from, from_id)) = m.moved_from {
                        if let Some(map) = live.get_mut(&from) {
                            map.remove(&from_id);
                        }
                    }
                }
                Record::Settle { partition, id } => {
                    if let Some(map) = live.get_mut(&partition) {
                        map.remove(&id);
                    }
                }
                Record::Requeue {
                    partition,
                    id,
                    attempts,
                    deliver_at_ms,
                } => {
                    // Ignored once settled: it must not resurrect anything.
                    if let Some(l) = live.get_mut(&partition).and_then(|m| m.get_mut(&id)) {
                        l.rm.attempts = attempts;
                        l.rm.attrs.deliver_at_ms = deliver_at_ms;
                        l.requeued = true;
                    }
                }
                Record::Receipt {
                    partition,
                    key_hash,
                    expires_at_ms,
                } => {
                    // The segment is kept until its receipts expire (or are
                    // copied to a receipts file by compaction).
                    info.receipts_until = info.receipts_until.max(expires_at_ms);
                    if expires_at_ms > now {
                        let e = receipts.entry((partition, key_hash)).or_default();
                        *e = (*e).max(expires_at_ms);
                    }
                }
                Record::PutMeta {
                    version,
                    key,
                    value,
                } => {
                    info.max_meta_version = info.max_meta_version.max(version);
                    if version > ckpt.version {
                        meta.insert(key.to_vec(), value.to_vec());
                        meta_version = meta_version.max(version);
                    }
                }
                Record::DeleteMeta { version, key } => {
                    info.max_meta_version = info.max_meta_version.max(version);
                    if version > ckpt.version {
                        meta.remove(key);
                        meta_version = meta_version.max(version);
                    }
                }
                Record::Cut { partition, before } => {
                    // Everything of the partition recorded before it, below
                    // `before`; later records of the partition stand.
                    if before == MessageId::MAX {
                        live.remove(&partition);
                    } else if let Some(map) = live.get_mut(&partition) {
                        let kept = map.split_off(&before);
                        *map = kept;
                    }
                }
                Record::State {
                    seq,
                    version,
                    key,
                    value,
                } => {
                    info.max_state_seq = info.max_state_seq.max(seq);
                    if seq > ckpt.state_seq {
                        match value {
                            Some(v) => state.insert(key.to_vec(), (version, v.to_vec())),
                            None => state.remove(key),
                        };
                        state_seq = state_seq.max(seq);
                    }
                }
                Record::MetaBatch { version, changes } => {
                    info.max_meta_version = info.max_meta_version.max(version);
                    if version > ckpt.version {
                        for (key, value) in changes {
                            match value {
                                Some(v) => meta.insert(key.to_vec(), v.to_vec()),
                                None => meta.remove(key),
                            };
                        }
                        meta_version = meta_version.max(version);
                    }
                }
            }
            off += len;
        }
        if let Some(d) = missing_tail(&path, seg, off, recorded_end) {
            return Err(LogError::Damaged(Box::new(d)).into());
        }
        if zero_tail && keep_zero_tail {
            // Disk full and no reserve: the preallocated rest of the last
            // segment is the only space we are sure to have, so appends
            // (settles, purges) continue in it instead of a new segment.
            continued_head = Some((seg, off as u64));
            if sync {
                let f = OpenOptions::new()
                    .write(true)
                    .open(&path)
                    .map_err(|e| StoreError::io(format!("opening {}", path.display()), e))?;
                f.sync_data()
                    .map_err(|e| StoreError::io(format!("fsync {}", path.display()), e))?;
            }
        } else if zero_tail {
            let f = OpenOptions::new()
                .write(true)
                .open(&path)
                .map_err(|e| StoreError::io(format!("opening {}", path.display()), e))?;
            f.set_len(off as u64)
                .map_err(|e| StoreError::io(format!("truncating {}", path.display()), e))?;
            if sync {
                f.sync_all()
                    .map_err(|e| StoreError::io(format!("fsync {}", path.display()), e))?;
            }
        } else if off < buf.len() {
            debug_assert!(last);
            let dropped = (buf.len() - off) as u64;
            tracing::warn!(
                segment = seg,
                offset = off,
                bytes = dropped,
                recorded_end,
                "truncating torn or corrupt tail of the last log segment"
            );
            let f = OpenOptions::new()
                .write(true)
                .open(&path)
                .map_err(|e| StoreError::io(format!("opening {}", path.display()), e))?;
            f.set_len(off as u64)
                .map_err(|e| StoreError::io(format!("truncating {}", path.display()), e))?;
            if sync {
                f.sync_all()
                    .map_err(|e| StoreError::io(format!("fsync {}", path.display()), e))?;
            }
            truncated_bytes += dropped;
        } else if last && sync {
            // After a process crash the tail may still sit only in the page
            // cache; make it durable before anything (reclamation) relies on it.
            let f = OpenOptions::new()
                .write(true)
                .open(&path)
                .map_err(|e| StoreError::io(format!("opening {}", path.display()), e))?;
            f.sync_data()
                .map_err(|e| StoreError::io(format!("fsync {}", path.display()), e))?;
        }
        if last && sync && off as u64 > recorded_end {
            // Everything up to `off` is now durable (synced above) and was
            // recovered: if the next run crashes before it starts a new
            // segment, damage below `off` must not pass for a torn tail.
            OpenOptions::new()
                .write(true)
                .open(&path)
                .and_then(|f| segment::record_end(&f, off as u64))
                .map_err(|e| StoreError::io(format!("writing {}", path.display()), e))?;
        }
        info.size = off as u64;
        segments.insert(seg, info);
    }

    // Live counts come from the final index, not from replaying decrements.
    let mut partitions = HashMap::with_capacity(live.len());
    let mut requeued = HashMap::new();
    for (p, map) in live {
        if map.is_empty() {
            continue;
        }
        for l in map.values() {
            if let Some(info) = segments.get_mut(&l.rm.location.segment()) {
                info.add_live(p, l.rm.id);
            }
            if l.requeued || l.rm.attempts != 0 {
                requeued.insert((p, l.rm.id), (l.rm.attempts, l.rm.attrs.deliver_at_ms));
            }
        }
        partitions.insert(p, map.into_values().map(|l| l.rm).collect::<Vec<_>>());
    }

    let next_id = ckpt.next_id.max(max_id.map_or(0, |m| m + 1)).max(1);
    ckpt.meta = BTreeMap::new();
    ckpt.state = BTreeMap::new();
    Ok(RecoveryOutput {
        partitions,
        requeued,
        receipts,
        truncated_bytes,
        meta,
        meta_version,
        state,
        state_seq,
        segments,
        next_id,
        checkpoint: ckpt,
        continued_head,
    })
}

/// Replaces the file at `path` with a segment holding only its header.
fn write_empty_segment(path: &Path, sync: bool) -> Result<(), StoreError> {
    use std::os::unix::fs::FileExt;
    let f = OpenOptions::new()
        .write(true)
        .open(path)
        .map_err(|e| StoreError::io(format!("opening {}", path.display()), e))?;
    f.set_len(segment::HEADER_LEN as u64)
        .and_then(|()| f.write_all_at(&segment::header(), 0))
        .map_err(|e| StoreError::io(format!("writing {}", path.display()), e))?;
    if sync {
        f.sync_all()
            .map_err(|e| StoreError::io(format!("fsync {}", path.display()), e))?;
    }
    Ok(())
}

/// The error for a segment whose header is not this build's format.
pub(crate) fn format_error(
    dir: &Path,
    path: &Path,
    seg: SegmentId,
    check: segment::HeaderCheck,
) -> StoreError {
    let expected = segment::FORMAT_VERSION;
    let e = match check {
        segment::HeaderCheck::Legacy => LogError::UnsupportedFormat {
            dir: dir.to_path_buf(),
            file: path.to_path_buf(),
            found: 0,
            expected,
            advice: "It was written by a Weir version from before versioned log segments, which this version does not migrate. \
                To upgrade: run the previous version on this directory until every queue is drained, stop it, start and stop it once more \
                (that start deletes the drained log), then start this version: exchanges, queues and bindings are kept. \
                Or move the directory aside (keep it as a backup) and start with an empty one."
                .into(),
        },
        segment::HeaderCheck::Version(found) => LogError::UnsupportedFormat {
            dir: dir.to_path_buf(),
            file: path.to_path_buf(),
            found,
            expected,
            advice: "It was written by a newer Weir version: run that version (downgrades are not supported).".into(),
        },
        segment::HeaderCheck::Torn => LogError::Corrupt {
            segment: seg,
            offset: 0,
            reason: format!(
                "{}: empty segment with a torn header before the last segment",
                path.display()
            ),
        },
        segment::HeaderCheck::Valid | segment::HeaderCheck::Bad => LogError::Corrupt {
            segment: seg,
            offset: 0,
            reason: format!("{}: not a Weir log segment (bad header)", path.display()),
        },
    };
    e.into()
}
