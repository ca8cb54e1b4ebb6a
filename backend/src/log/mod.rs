//! The embedded log store: one shared append-only log in segment files, group
//! committed by a single writer thread.
//!
//! Layout under the store directory:
//!
//! * `log/00000001.seg`, `log/00000002.seg`, …: segments, each a sequence of
//!   framed records (format described in `record.rs`);
//! * `meta.checkpoint`: the metadata map, its version and the next message id,
//!   written before a segment holding metadata records is deleted;
//! * `receipts/00000001.rcp`, …: idempotency receipts copied out of segments
//!   that compaction reclaims before the receipts expire (`receipts.rs`).
//!
//! Appends encode records into an in-memory pending buffer under one mutex and
//! get their [`Location`]s immediately; the writer thread drains the buffer,
//! writes and fsyncs it once per round and completes the round's waiters.
//! Reads are served from the pending buffer until the data reaches the kernel,
//! then with `pread` through a cached handle per segment.
//!
//! Space is reclaimed by deleting the *oldest* segments once nothing in them is
//! live; [`Store::compact`] relocates the survivors of sparse old segments so
//! that can happen.
//!
//! A [`Location`] here is (segment, offset of the record's first byte, length
//! of the whole record).

mod checkpoint;
mod error;
mod fair;
mod feed;
mod handle;
mod partitions;
mod receipts;
mod record;
mod recovery;
mod repair;
mod scan;
mod segment;
mod spares;
mod stream_read;
mod writer;

pub use error::{Damage, LogError, LostRecord, SegmentId};
pub use handle::LogHandle;
pub use repair::{repair, RepairReport, QUARANTINE_DIR};

/// Entry points for the fuzz targets (`fuzz/fuzz_targets/store_*.rs`): they
/// run the decoders on arbitrary bytes and must never panic.
#[doc(hidden)]
pub mod fuzzing {
    /// Frames and decodes one record from the start of `data`.
    pub fn decode_record(data: &[u8]) {
        if let Ok((payload, _)) = super::record::split_frame(data) {
            let _ = super::record::decode_payload(payload);
        }
        let _ = super::scan::describe(data, 0);
    }

    /// Walks `data` as a head segment and as a sealed one the way recovery
    /// does, describing every damaged range. Records start after the
    /// segment header when `data` has one, else at offset 0 (so mutated
    /// records are reached either way).
    pub fn recover_tail(data: &[u8]) {
        let (start, recorded_end) = match super::segment::check_header(data) {
            super::segment::HeaderCheck::Valid => (
                super::segment::HEADER_LEN,
                super::segment::recorded_end(data),
            ),
            _ => (0, 0),
        };
        for head in [true, false] {
            let mut off = start;
            while off < data.len() {
                match super::scan::next_item(data, off, head, recorded_end) {
                    super::scan::Item::Record { len } => {
                        assert!(len > 0 && off + len <= data.len());
                        off += len;
                    }
                    super::scan::Item::Damaged { end } => {
                        assert!(end > off && end <= data.len());
                        let _ = super::scan::describe(&data[off..end], off as u64);
                        off = end;
                    }
                    super::scan::Item::TornTail | super::scan::Item::CleanEnd => break,
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;

use crate::{
    Admission, Epoch, LiveSet, Location, MessageData, MessageId, MessageRef, MetaChange, MetaFeed,
    Op, PartitionId, RangeMessage, ReadFuture, Receipt, RecoveredMessage, RecoveredMeta,
    Relocation, ShareTag, StateEntry, Store, StoreError, StoreStats, StoredMessage, Ticket, Waiter,
    Wake,
};
use bytes::Bytes;
use parking_lot::{Condvar, Mutex};
use record::{MessageKind, Record, FRAME_HEADER};
use segment::{ReadCache, SegmentInfo};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

/// Pending (unwritten) bytes that wake the writer even with no waiter.
const WAKE_PENDING_BYTES: usize = 1 << 20;

/// How many sealed segments one [`Store::compact`] empties at most.
const MAX_COMPACTION_CANDIDATES: usize = 4;
/// How many of the oldest sealed segments it looks at.
const COMPACTION_WINDOW: usize = 16;
/// How many records one [`Store::compact`] copies at most (bounds the
/// memory of its candidate list and the time of its location swaps; the
/// next call continues). 32,768: a round of 131,072 cost ~18 MB of working
/// set and a 17-27 ms stall of concurrent commits (docs/BENCHMARKS.md,
/// issue 7); the gateway calls again soon while rounds find work.
const MAX_RELOCATIONS: usize = 1 << 15;

/// A segment whose idempotency receipts all expire within this many ms is
/// left to them rather than read to copy its receipts out: waiting that
/// long costs less than the read.
const RECEIPT_HORIZON_MS: u64 = 10_000;
/// Segment bytes one [`Store::compact`] reads at most to copy receipts
/// out (at least one segment); bounds the memory of the copy.
const MAX_RECEIPT_EXTRACTION_BYTES: u64 = 128 << 20;

/// Milliseconds since the Unix epoch: receipts expire by the wall clock.
pub(crate) fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Options of [`LogStore::open`].
#[derive(Clone, Debug)]
pub struct LogOptions {
    /// A segment is sealed and a new one started when the next record would
    /// make it larger than this. Also the largest record accepted. At most
    /// `u32::MAX` (locations hold 32-bit offsets). Default 64 MiB.
    pub segment_size: u64,
    /// Fsync (fdatasync) every commit round, and directories after creating,
    /// renaming or deleting files. Default `true`; `false` is for tests and
    /// benchmarks that measure everything but the disk.
    pub sync: bool,
    /// A sealed segment whose live fraction ((partition, id) pairs still live
    /// over pairs ever placed in it) is below this is a compaction candidate.
    /// Default 0.5.
    pub compact_below: f64,
    /// Keep a preallocated reserve segment (`log/reserve`) that only the
    /// records freeing space may use once the disk is full. Default `true`.
    pub reserve: bool,
}

impl Default for LogOptions {
    fn default() -> Self {
        LogOptions {
            segment_size: 64 << 20,
            sync: true,
            compact_below: 0.5,
            reserve: true,
        }
    }
}

/// A run of encoded records bound for one segment, starting at `offset`.
pub(crate) struct Chunk {
    segment: SegmentId,
    offset: u32,
    buf: Vec<u8>,
}

/// State guarded by the append mutex.
pub(crate) struct State {
    /// Encoded, not yet taken by the writer. Contiguous, in log order.
    pending: Vec<Chunk>,
    /// Waiters of tickets not yet durable, in order; the next round takes
    /// them all (every ticket handed out is covered by it).
    waiters: Vec<Waiter>,
    /// The last ticket handed out: tickets number the non-empty appends
    /// (the log is one sequence, so a ticket covers every earlier append,
    /// more than the contract asks).
    next_ticket: u64,
    /// Taken by the writer, not yet handed to the kernel.
    inflight: Option<Arc<Vec<Chunk>>>,
    /// The segment appends go to.
    head: SegmentId,
    /// Bytes assigned in `head`.
    head_size: u64,
    /// Every retained segment, the head included.
    segments: BTreeMap<SegmentId, SegmentInfo>,
    /// Metadata as of the last append: each key's version (`feed.rs`) and
    /// value, in one map (a second map of versions cost a copy of every key:
    /// ~100 B per queue).
    meta: BTreeMap<Vec<u8>, (u64, Vec<u8>)>,
    meta_version: u64,
    /// Recent metadata changes and their watchers (`feed.rs`).
    feed: feed::Feed,
    /// What the durable checkpoint covers.
    ckpt_version: u64,
    ckpt_next_id: u64,
    /// The writer should look for reclaimable segments even with no data.
    reclaim_hint: bool,
    closing: bool,
    failed: bool,
    /// The disk is full (no reserve segment could be allocated): only records
    /// that free space are accepted. Cleared by the writer once a reserve
    /// could be allocated again.
    no_space: bool,
    /// Recycled chunk buffers.
    spare: Vec<Vec<u8>>,
    /// Delivery state (attempts, deliver_at_ms) of every live (partition,
    /// id) whose last requeue record is newer than its message record: what
    /// a relocated copy must carry, since requeue records are not kept
    /// alive. Only requeued messages have an entry.
    requeued: HashMap<(PartitionId, MessageId), (u32, u64)>,
    /// While a compaction runs: what left its partitions since it started
    /// collecting. Its copy of such a message is not written: a copy after
    /// the settle would bring the message back at recovery.
    compacting: Option<Compacting>,
    /// Per truncated partition, the highest `before` of its truncations
    /// since open: a settle naming a message below it is a no-op (the
    /// truncation settled it; counting it again could free another
    /// message's segment). Dropped with the partition.
    truncated: HashMap<PartitionId, MessageId>,
    /// The state store as of the last append: per key, its version and
    /// value. Kept whole in memory and written into every checkpoint, like
    /// the metadata map.
    state_map: BTreeMap<Vec<u8>, (u64, Vec<u8>)>,
    /// The store's own count of state changes (not shown to callers): the
    /// checkpoint covers the records up to `ckpt_state_seq`.
    state_seq: u64,
    ckpt_state_seq: u64,
    /// Bytes each share tag has waiting for the writer (`fair.rs`).
    shares: fair::Shares,
    /// Which handle holds which partition (`partitions.rs`).
    owners: partitions::Owners,
    /// What open found that is still exact: the partitions whose live
    /// messages (receipts) open listed, not handed out and not appended to
    /// since (`partitions.rs`).
    fresh: partitions::Fresh,
    /// The writer thread is gone: no ticket becomes durable any more.
    writer_done: bool,
    /// The writer took waiters and has not finished calling them: a new
    /// waiter must not overtake them.
    calling: bool,
}

/// What left its partitions while a compaction runs (see `State::compacting`).
#[derive(Default)]
pub(crate) struct Compacting {
    /// Settled or moved away.
    settled: HashSet<(PartitionId, MessageId)>,
    /// Dropped (`MessageId::MAX`) or truncated partitions: every id below
    /// the second field left.
    cuts: Vec<(PartitionId, MessageId)>,
}

impl Compacting {
    fn contains(&self, partition: PartitionId, id: MessageId) -> bool {
        self.settled.contains(&(partition, id))
            || self
                .cuts
                .iter()
                .any(|&(p, before)| p == partition && id < before)
    }
}

#[derive(Default)]
pub(crate) struct Stats {
    appended_bytes: AtomicU64,
    syncs: AtomicU64,
    segments: AtomicU64,
    disk_bytes: AtomicU64,
    reclaimed: AtomicU64,
}

/// Everything the store and its writer thread share.
pub(crate) struct Shared {
    dir: PathBuf,
    log_dir: PathBuf,
    opts: LogOptions,
    state: Mutex<State>,
    /// Wakes the writer.
    wake: Condvar,
    next_id: AtomicU64,
    /// `pack_pos(segment, end)` of the last byte handed to the kernel: every
    /// record before it can be read from disk.
    written: AtomicU64,
    /// The last durable ticket: every append up to it is fsynced.
    durable: AtomicU64,
    reads: ReadCache,
    /// Zeroed reclaimed segments the writer reuses.
    spares: Arc<spares::Spares>,
    stats: Stats,
    /// The last segment when open continued appending into it (disk full):
    /// the only segment the writer opens instead of creating.
    continued_head: Option<SegmentId>,
    #[cfg(test)]
    fail_next_write: std::sync::atomic::AtomicBool,
}

impl Location {
    /// The log's position: `len` bytes at `offset` of `segment`.
    pub(crate) const fn log(segment: SegmentId, offset: u32, len: u32) -> Location {
        Location::from_words([segment, offset, len])
    }

    /// The segment holding the record.
    pub(crate) const fn segment(self) -> SegmentId {
        self.words()[0]
    }

    /// Byte offset of the record within its segment.
    pub(crate) const fn offset(self) -> u32 {
        self.words()[1]
    }

    /// Length of the whole record (framing included).
    pub(crate) const fn len(self) -> u32 {
        self.words()[2]
    }

    /// Whether this is a [`Spill`] position: a page record, named with the
    /// segment word's top bit set so that it is never mistaken for a
    /// stored message (segment ids stay below it).
    pub(crate) const fn is_spilled(self) -> bool {
        self.words()[0] & SPILL_TAG != 0
    }

    /// The [`Spill`] position of the page record at `self`.
    pub(crate) const fn spilled(self) -> Location {
        let [s, o, l] = self.words();
        Location::from_words([s | SPILL_TAG, o, l])
    }

    /// Where the record is in the log, spilled or not.
    pub(crate) const fn in_log(self) -> Location {
        let [s, o, l] = self.words();
        Location::from_words([s & !SPILL_TAG, o, l])
    }
}

/// Marks [`Spill`] positions (see [`Location::is_spilled`]).
const SPILL_TAG: u32 = 1 << 31;

pub(crate) fn pack_pos(segment: SegmentId, end: u64) -> u64 {
    debug_assert!(end <= u64::from(u32::MAX));
    (u64::from(segment) << 32) | end
}

/// The embedded, segmented, group-committed log store.
pub struct LogStore {
    shared: Arc<Shared>,
    writer: Mutex<Option<JoinHandle<()>>>,
    /// Live messages and unexpired receipts per partition found at open,
    /// handed out during the startup window (`partitions.rs`).
    open_lists: Mutex<partitions::OpenLists>,
    /// Every partition with live messages at open.
    recovered_partitions: Vec<PartitionId>,
    /// The receipts files kept, and the number of the next one. Only
    /// compaction (one at a time) writes and deletes them.
    receipt_files: Mutex<(Vec<receipts::ReceiptFile>, u64)>,
    truncated_bytes: u64,
    /// The data directory lock, released by `close`.
    lock: Mutex<Option<crate::lock::DirLock>>,
    /// Held by a running [`Store::compact`]: one at a time.
    compaction: Mutex<()>,
}

impl std::fmt::Debug for LogStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LogStore")
            .field("dir", &self.shared.dir)
            .finish_non_exhaustive()
    }
}

impl LogStore {
    /// Opens (creating if needed) the store in `dir`, recovers its state and
    /// starts the writer thread. The recovered messages are handed out per
    /// partition by [`Store::recover_partition`].
    ///
    /// Refuses a directory in another on-disk format
    /// ([`LogError::UnsupportedFormat`]) without changing it.
    pub fn open(dir: &Path, opts: LogOptions) -> Result<Arc<LogStore>, StoreError> {
        let invalid = |msg: &str| {
            StoreError::io(
                "invalid LogOptions",
                std::io::Error::new(std::io::ErrorKind::InvalidInput, msg.to_string()),
            )
        };
        if opts.segment_size < 4096 || opts.segment_size > u64::from(u32::MAX) {
            return Err(invalid("segment_size must be in 4096..=u32::MAX"));
        }
        if !(0.0..=1.0).contains(&opts.compact_below) {
            return Err(invalid("compact_below must be in 0..=1"));
        }
        let log_dir = dir.join("log");
        std::fs::create_dir_all(&log_dir)
            .map_err(|e| StoreError::io(format!("creating {}", log_dir.display()), e))?;
        // Before reading anything: a second process must not even truncate a
        // "torn" tail that is really the first one's append in flight.
        let lock = crate::lock::DirLock::acquire(dir)?;
        segment::remove_trash(&log_dir);

        // A spare segment's worth of disk, so that acks, purges and deletes
        // can still be recorded (and space reclaimed) once publishers filled
        // the disk. Without it, new messages are refused from the start.
        let no_space = opts.reserve
            && match writer::ensure_reserve(&log_dir, opts.segment_size, opts.sync) {
                Ok(()) => false,
                Err(e) if writer::is_no_space(&e) => {
                    tracing::warn!(error = %e, "disk full: cannot allocate the reserve segment; new messages are refused until space is freed");
                    true
                }
                Err(e) => {
                    // Not a space problem: run without the reserve rather
                    // than refuse every publish.
                    tracing::warn!(error = %e, "cannot create the reserve segment; running without one");
                    false
                }
            };
        if opts.reserve {
            writer::ensure_meta_reserve(&log_dir);
        }
        let rec = recovery::recover(dir, &log_dir, opts.sync, no_space)?;
        let loaded = receipts::load(dir, now_ms(), opts.sync)?;
        let mut receipt_keys = rec.receipts;
        for (p, h, e) in loaded.entries {
            let x = receipt_keys.entry((p, h)).or_default();
            *x = (*x).max(e);
        }
        let mut recovered_receipts: HashMap<PartitionId, Vec<Receipt>> = HashMap::new();
        for ((p, key_hash), expires_at_ms) in receipt_keys {
            recovered_receipts.entry(p).or_default().push(Receipt {
                key_hash,
                expires_at_ms,
            });
        }
        let (head, head_size) = match rec.continued_head {
            Some((seg, end)) => (seg, end),
            None => (
                rec.segments.keys().next_back().map_or(1, |last| last + 1),
                0,
            ),
        };
        let mut segments = rec.segments;
        let stats = Stats::default();
        stats
            .segments
            .store(segments.len() as u64, Ordering::Relaxed);
        stats
            .disk_bytes
            .store(segments.values().map(|s| s.size).sum(), Ordering::Relaxed);
        // Anything already reclaimable (everything settled before the last
        // shutdown) goes on the writer's first round.
        let reclaim_hint = segments.values().next().is_some_and(|s| s.live == 0);
        // Normally start a fresh head segment: the old last segment may just
        // have been truncated, and sealing it keeps the writer simple. With
        // the disk full, continue the last one in its preallocated space.
        if rec.continued_head.is_none() {
            segments.insert(head, SegmentInfo::default());
        }

        let (opts_segment_size, opts_sync) = (opts.segment_size, opts.sync);
        let shared = Arc::new(Shared {
            dir: dir.to_path_buf(),
            log_dir: log_dir.clone(),
            opts,
            state: Mutex::new(State {
                pending: Vec::new(),
                waiters: Vec::new(),
                next_ticket: 0,
                inflight: None,
                head,
                head_size,
                segments,
                feed: feed::Feed::new(rec.meta_version),
                meta: rec
                    .meta
                    .into_iter()
                    .map(|(k, v)| (k, (rec.meta_version, v)))
                    .collect(),
                meta_version: rec.meta_version,
                ckpt_version: rec.checkpoint.version,
                ckpt_next_id: rec.checkpoint.next_id,
                truncated: HashMap::new(),
                state_map: rec.state,
                state_seq: rec.state_seq,
                ckpt_state_seq: rec.checkpoint.state_seq,
                reclaim_hint,
                closing: false,
                failed: false,
                no_space,
                spare: Vec::new(),
                requeued: rec.requeued,
                compacting: None,
                shares: fair::Shares::default(),
                owners: partitions::Owners::default(),
                fresh: partitions::Fresh::new(
                    rec.partitions.keys().copied(),
                    recovered_receipts.keys().copied(),
                ),
                writer_done: false,
                calling: false,
            }),
            wake: Condvar::new(),
            next_id: AtomicU64::new(rec.next_id),
            written: AtomicU64::new(pack_pos(head, head_size)),
            durable: AtomicU64::new(0),
            reads: ReadCache::new(log_dir.clone()),
            spares: Arc::new(spares::Spares::open(&log_dir, opts_segment_size, opts_sync)),
            stats,
            continued_head: rec.continued_head.map(|(seg, _)| seg),
            #[cfg(test)]
            fail_next_write: std::sync::atomic::AtomicBool::new(false),
        });
        let w = shared.clone();
        let handle = std::thread::Builder::new()
            .name("weir-log-writer".into())
            .spawn(move || writer::run(w))
            .map_err(|e| StoreError::io("spawning the log writer thread", e))?;
        let mut recovered_partitions: Vec<PartitionId> = rec.partitions.keys().copied().collect();
        recovered_partitions.sort_unstable();
        Ok(Arc::new(LogStore {
            shared,
            writer: Mutex::new(Some(handle)),
            open_lists: Mutex::new(partitions::OpenLists {
                messages: rec.partitions,
                receipts: recovered_receipts,
                ..Default::default()
            }),
            recovered_partitions,
            receipt_files: Mutex::new((loaded.files, loaded.next_seq)),
            truncated_bytes: rec.truncated_bytes,
            lock: Mutex::new(Some(lock)),
            compaction: Mutex::new(()),
        }))
    }

    /// The largest record (framing included) an append accepts: a segment
    /// minus its header.
    fn max_record(&self) -> usize {
        self.shared.opts.segment_size as usize - segment::HEADER_LEN
    }

    /// Calls `waiter` after the next writer round, which writes (and
    /// fsyncs) everything appended so far and then reclaims: for tests that
    /// wait for a round, not for a ticket.
    #[cfg(test)]
    pub(crate) fn round_barrier(&self, waiter: Waiter) {
        let mut st = self.shared.state.lock();
        st.waiters.push(waiter);
        drop(st);
        self.shared.wake.notify_one();
    }

    /// Makes the next write round fail, to test the failure path.
    #[cfg(test)]
    pub(crate) fn inject_write_failure(&self) {
        self.shared.fail_next_write.store(true, Ordering::SeqCst);
    }

    fn is_written(&self, loc: Location) -> bool {
        let w = self.shared.written.load(Ordering::Acquire);
        let (seg, end) = ((w >> 32) as SegmentId, w & u64::from(u32::MAX));
        loc.segment() < seg
            || (loc.segment() == seg && u64::from(loc.offset()) + u64::from(loc.len()) <= end)
    }

    /// The raw bytes (framing included) of the record at `loc`.
    fn read_raw(&self, loc: Location) -> Result<Vec<u8>, StoreError> {
        if (loc.len() as usize) <= FRAME_HEADER || loc.len() as usize > self.max_record() {
            return Err(StoreError::NotFound(loc));
        }
        if !self.is_written(loc) {
            let st = self.shared.state.lock();
            let found = st
                .pending
                .iter()
                .chain(st.inflight.iter().flat_map(|c| c.iter()))
                .find_map(|c| {
                    if c.segment != loc.segment() || loc.offset() < c.offset {
                        return None;
                    }
                    let start = (loc.offset() - c.offset) as usize;
                    c.buf.get(start..start + loc.len() as usize)
                });
            if let Some(b) = found {
                return Ok(b.to_vec());
            }
            // Not in memory: the writer handed it to the kernel meanwhile
            // (it clears `inflight` only after advancing `written`), or the
            // location is bogus and the disk read will say so.
        }
        self.shared.reads.read(loc)
    }

    /// Reads and decodes the message record at `loc`.
    fn read_message(&self, loc: Location) -> Result<(Bytes, MessageIndex), StoreError> {
        let raw = Bytes::from(self.read_raw(loc)?);
        let corrupt =
            |reason: String| error::corrupt(loc.segment(), u64::from(loc.offset()), reason);
        let (payload, total) = record::split_frame(&raw).map_err(|e| match e {
            record::FrameError::Truncated => StoreError::NotFound(loc),
            record::FrameError::Corrupt(r) => corrupt(r),
        })?;
        if total != loc.len() as usize {
            return Err(corrupt(format!(
                "record length {total} does not match location length {}",
                loc.len()
            )));
        }
        match record::decode_payload(payload).map_err(corrupt)? {
            Record::Message(m) => {
                let d = m.data().map_err(|r| corrupt(r.to_string()))?;
                let idx = MessageIndex {
                    kind: m.kind,
                    id: m.id,
                    attempts: m.attempts,
                    exchange: range_of(&raw, d.exchange.as_bytes()),
                    routing_key: range_of(&raw, d.routing_key.as_bytes()),
                    header_format: d.header_format,
                    header: range_of(&raw, d.header),
                    body: range_of(&raw, d.body),
                    attrs: d.attrs,
                };
                Ok((raw, idx))
            }
            _ => Err(StoreError::NotFound(loc)),
        }
    }

    fn stop_writer(&self) {
        self.shared.state.lock().closing = true;
        self.shared.wake.notify_one();
        let handle = self.writer.lock().take();
        if let Some(h) = handle {
            // Called from a waiter on the writer thread itself: it exits on its
            // own after this round; joining would deadlock.
            if h.thread().id() != std::thread::current().id() {
                let _ = h.join();
            }
        }
    }
}

/// Where the fields of a decoded message record sit in its buffer.
struct MessageIndex {
    kind: MessageKind,
    id: MessageId,
    attempts: u32,
    exchange: std::ops::Range<usize>,
    routing_key: std::ops::Range<usize>,
    header_format: u8,
    header: std::ops::Range<usize>,
    body: std::ops::Range<usize>,
    attrs: crate::MessageAttrs,
}

fn range_of(whole: &[u8], part: &[u8]) -> std::ops::Range<usize> {
    let start = part.as_ptr() as usize - whole.as_ptr() as usize;
    debug_assert!(start + part.len() <= whole.len());
    start..start + part.len()
}

impl MessageIndex {
    fn data<'a>(&self, raw: &'a [u8]) -> MessageData<'a> {
        // Both were validated as UTF-8 when the index was built.
        MessageData {
            exchange: std::str::from_utf8(&raw[self.exchange.clone()]).unwrap_or_default(),
            routing_key: std::str::from_utf8(&raw[self.routing_key.clone()]).unwrap_or_default(),
            header_format: self.header_format,
            header: &raw[self.header.clone()],
            body: &raw[self.body.clone()],
            attrs: self.attrs,
        }
    }
}

/// Encoded size (framing included) of one op.
fn encoded_len(op: &Op<'_>) -> usize {
    FRAME_HEADER
        + match op {
            Op::Publish {
                partitions, data, ..
            } => record::message_payload_len(MessageKind::Publish, partitions.len(), data, 0),
            Op::Move {
                partitions, data, ..
            } => record::message_payload_len(MessageKind::Move, partitions.len(), data, 0),
            Op::Settle { .. } => record::SETTLE_PAYLOAD_LEN,
            Op::Requeue { .. } => record::REQUEUE_PAYLOAD_LEN,
            Op::Receipt { .. } => record::RECEIPT_PAYLOAD_LEN,
            Op::PutMeta { key, value } => record::put_meta_payload_len(key, value),
            Op::DeleteMeta { key } => record::del_meta_payload_len(key),
            Op::MetaBatch { changes } => record::meta_batch_payload_len(changes),
            Op::DropPartition { .. } => record::cut_payload_len(MessageId::MAX),
            Op::Truncate { before, .. } => record::cut_payload_len(*before),
            Op::PutState { key, value } => record::put_state_payload_len(key, value),
            Op::DeleteState { key } => record::del_state_payload_len(key),
        }
}

impl State {
    /// Assigns the next `len` bytes of the log, rolling to a new segment when
    /// the head would outgrow `segment_size`, and returns the buffer to encode
    /// into. A segment's first bytes are its header.
    fn place(&mut self, len: usize, segment_size: u64) -> (Location, &mut Vec<u8>) {
        let len64 = len as u64;
        let header = segment::HEADER_LEN as u64;
        if self.head_size > header && self.head_size + len64 > segment_size {
            self.head += 1;
            assert!(self.head < SPILL_TAG, "segment ids exhausted");
            self.head_size = 0;
            let prev = self.segments.insert(self.head, SegmentInfo::default());
            assert!(prev.is_none(), "segment {} assigned twice", self.head);
        }
        if self.head_size == 0 {
            // A fresh segment: its header goes out with its first records.
            self.chunk_at(self.head, 0)
                .extend_from_slice(&segment::header());
            self.head_size = header;
            if let Some(info) = self.segments.get_mut(&self.head) {
                info.size += header;
            }
        }
        assert!(
            self.head_size + len64 <= u64::from(u32::MAX),
            "segment offset overflows a location"
        );
        let loc = Location::log(self.head, self.head_size as u32, len as u32);
        self.head_size += len64;
        if let Some(info) = self.segments.get_mut(&self.head) {
            info.size += len64;
        }
        let buf = self.chunk_at(loc.segment(), loc.offset());
        (loc, buf)
    }

    /// The pending chunk that continues at `offset` of `segment`, started if
    /// the last one is for another segment.
    fn chunk_at(&mut self, segment: SegmentId, offset: u32) -> &mut Vec<u8> {
        let reuse = matches!(self.pending.last(), Some(c) if c.segment == segment);
        if !reuse {
            let buf = self.spare.pop().unwrap_or_default();
            self.pending.push(Chunk {
                segment,
                offset,
                buf,
            });
        }
        let chunk = self.pending.last_mut().expect("a chunk was just ensured");
        debug_assert_eq!(chunk.offset as usize + chunk.buf.len(), offset as usize);
        &mut chunk.buf
    }

    fn head_info(&mut self) -> &mut SegmentInfo {
        self.segments
            .get_mut(&self.head)
            .expect("the head segment is always tracked")
    }

    /// Accounts that the pair (`partition`, `id`) no longer lives at `loc`.
    /// A pair a drop or truncation settled already is not counted again.
    fn unlive(&mut self, partition: PartitionId, id: MessageId, loc: Location) {
        if !self.truncated.is_empty() && self.truncated.get(&partition).is_some_and(|&b| id < b) {
            return;
        }
        if let Some(info) = self.segments.get_mut(&loc.segment()) {
            info.remove_live(partition);
        }
    }

    /// The message `id` leaves `partition` (settled or moved away): its
    /// delivery state is dropped, and a running compaction must not copy it.
    fn forget(&mut self, partition: PartitionId, id: MessageId) {
        if !self.requeued.is_empty() {
            self.requeued.remove(&(partition, id));
        }
        if let Some(c) = self.compacting.as_mut() {
            c.settled.insert((partition, id));
        }
    }

    /// Every message of `partition` below `before` leaves it (a drop when
    /// `before` is `MessageId::MAX`): the segments holding only such
    /// messages of it are freed of them, their delivery state is dropped,
    /// and a running compaction must not copy them.
    fn cut(&mut self, partition: PartitionId, before: MessageId) {
        let mut freed = 0;
        for info in self.segments.values_mut() {
            freed += info.cut(partition, before);
        }
        if freed > 0 {
            // Emptied segments may be reclaimable without any other append.
            self.reclaim_hint = true;
        }
        if !self.requeued.is_empty() {
            self.requeued
                .retain(|&(p, id), _| p != partition || id >= before);
        }
        if before == MessageId::MAX {
            self.truncated.remove(&partition);
        } else {
            let b = self.truncated.entry(partition).or_default();
            *b = (*b).max(before);
        }
        if let Some(c) = self.compacting.as_mut() {
            c.cuts.push((partition, before));
        }
    }

    /// Sealed segments whose survivors are worth relocating so the segment
    /// can be reclaimed. Empty when there is nothing worth compacting.
    fn compaction_candidates(&self, threshold: f64) -> Vec<SegmentId> {
        if self.no_space {
            // Relocations are refused while the disk is full.
            return Vec::new();
        }
        let sealed = || self.segments.iter().filter(|(&id, _)| id < self.head);
        let mut out = Vec::new();
        // Head-of-line rule: only the oldest segments can be deleted, so a
        // dense old segment holding back a mostly dead log is worth moving
        // even though its own live fraction is high.
        let (live, placed) =
            sealed().fold((0u64, 0u64), |(l, p), (_, s)| (l + s.live, p + s.placed));
        if let Some((&oldest, info)) = sealed().next() {
            if info.live > 0 && placed > 0 && (live as f64) < threshold * placed as f64 {
                out.push(oldest);
            }
        }
        for (&id, info) in sealed().take(COMPACTION_WINDOW) {
            if out.len() >= MAX_COMPACTION_CANDIDATES {
                break;
            }
            if info.live > 0 && info.live_fraction() < threshold && !out.contains(&id) {
                out.push(id);
            }
        }
        out
    }
}

impl LogStore {
    /// Copies the live message `id` of `partition` from `from` to the head of
    /// the log, with its current delivery state, and returns the copy's
    /// location; `None` when the message was settled or moved away since the
    /// running compaction started (then nothing is written). The copy counts
    /// as live; the caller accounts either `from` or the copy as freed once
    /// it knows which one the engine keeps. A paged record stays paged:
    /// relocation must not make transient data survive a restart.
    fn copy_for_compaction(
        &self,
        partition: PartitionId,
        id: MessageId,
        from: Location,
    ) -> Result<Option<Location>, StoreError> {
        let gone = |st: &State| {
            st.compacting
                .as_ref()
                .is_some_and(|c| c.contains(partition, id))
        };
        // A spilled copy is relocated as one and keeps its spill position.
        let spilled = from.is_spilled();
        let from = from.in_log();
        // Read the source with no lock held: that may mean disk I/O.
        let (raw, idx) = match self.read_message(from) {
            Ok(found) => found,
            // Settled meanwhile and its segment reclaimed already.
            Err(_) if gone(&self.shared.state.lock()) => return Ok(None),
            Err(e) => return Err(e),
        };
        if idx.id != id {
            return Err(error::corrupt(
                from.segment(),
                u64::from(from.offset()),
                format!("relocate of {id} found message {}", idx.id),
            ));
        }
        let mut data = idx.data(&raw);
        let kind = match idx.kind {
            MessageKind::Page => MessageKind::Page,
            _ => MessageKind::Relocate,
        };
        let mut st = self.shared.state.lock();
        if st.closing || st.failed {
            return Err(StoreError::Closed);
        }
        if st.no_space {
            return Err(StoreError::NoSpace);
        }
        if gone(&st) {
            return Ok(None);
        }
        // Under the append lock, so no requeue can slip between reading the
        // state and writing the copy that carries it.
        let attempts = match st.requeued.get(&(partition, id)) {
            Some(&(attempts, deliver_at_ms)) if kind != MessageKind::Page => {
                data.attrs.deliver_at_ms = deliver_at_ms;
                attempts
            }
            _ => idx.attempts,
        };
        let len = FRAME_HEADER + record::message_payload_len(kind, 1, &data, attempts);
        let (loc, buf) = st.place(len, self.shared.opts.segment_size);
        let n = record::encode_message(buf, kind, id, &[partition], &data, attempts);
        debug_assert_eq!(n, len);
        let info = st.head_info();
        info.add_live(partition, id);
        info.placed += 1;
        info.max_id = info.max_id.max(id);
        let pending_bytes: usize = st.pending.iter().map(|c| c.buf.len()).sum();
        drop(st);
        self.shared
            .stats
            .appended_bytes
            .fetch_add(len as u64, Ordering::Relaxed);
        if pending_bytes >= WAKE_PENDING_BYTES {
            self.shared.wake.notify_one();
        }
        Ok(Some(if spilled { loc.spilled() } else { loc }))
    }

    /// Copies one partition's message and frees the source at once, as if
    /// the engine took the copy: for tests of the record paths.
    #[cfg(test)]
    pub(crate) fn relocate(
        &self,
        partition: PartitionId,
        id: MessageId,
        from: Location,
    ) -> Result<Location, StoreError> {
        let loc = self
            .copy_for_compaction(partition, id, from)?
            .expect("no compaction is running");
        self.shared
            .state
            .lock()
            .unlive(partition, id, from.in_log());
        Ok(loc)
    }
}

/// Stops tracking settles for a compaction when it ends, however it ends.
struct CompactionDone<'a>(&'a Shared);

impl Drop for CompactionDone<'_> {
    fn drop(&mut self) {
        self.0.state.lock().compacting = None;
    }
}

/// What an append under the lock leaves to do once the lock is released.
struct Appended {
    ticket: Ticket,
    admission: Admission,
    wakes: Vec<Wake>,
    wake_writer: bool,
}

impl LogStore {
    /// Checks a batch before anything of it is appended; returns its
    /// encoded size.
    fn validate(&self, ops: &[Op<'_>]) -> Result<usize, StoreError> {
        let mut total = 0usize;
        for op in ops {
            if let Op::Publish { partitions, .. } | Op::Move { partitions, .. } = op {
                if partitions.is_empty() || partitions.len() > u32::MAX as usize {
                    return Err(StoreError::Invalid(
                        "a publish needs 1..=u32::MAX partitions".into(),
                    ));
                }
            }
            let len = encoded_len(op);
            // A stored message leaves room for a relocated copy that carries
            // a delivery state (relocate-ext), so that copy always fits.
            let room = match op {
                Op::Publish { .. } | Op::Move { .. } => record::EXT_LEN,
                _ => 0,
            };
            if len + room > self.max_record() {
                return Err(StoreError::TooLarge(len));
            }
            total += len;
        }
        Ok(total)
    }

    /// Appends a validated batch of `total` encoded bytes for `handle`,
    /// with the append lock held.
    fn append_locked(
        &self,
        st: &mut State,
        handle: u64,
        tag: ShareTag,
        ops: &[Op<'_>],
        locations: &mut Vec<Location>,
        total: usize,
    ) -> Result<Appended, StoreError> {
        if st.closing || st.failed {
            return Err(StoreError::Closed);
        }
        if st.no_space
            && ops
                .iter()
                .any(|op| matches!(op, Op::Publish { .. } | Op::Move { .. }))
        {
            return Err(StoreError::NoSpace);
        }
        // Ownership, and what open found: both skipped on the hot path
        // (one handle; recovery done).
        if st.owners.multi {
            for op in ops {
                for_each_partition(op, |p| st.owners.check(handle, p))?;
            }
        }
        if st.fresh.watching() {
            for op in ops {
                let _ = for_each_partition(op, |p| {
                    st.fresh.appended(p);
                    Ok(())
                });
            }
        }
        let segment_size = self.shared.opts.segment_size;
        let mut meta_changed = false;
        for op in ops {
            match op {
                Op::Publish {
                    id,
                    partitions,
                    data,
                } => {
                    let len = encoded_len(op);
                    let (loc, buf) = st.place(len, segment_size);
                    let n =
                        record::encode_message(buf, MessageKind::Publish, *id, partitions, data, 0);
                    debug_assert_eq!(n, len);
                    let info = st.head_info();
                    for p in partitions.iter() {
                        info.add_live(*p, *id);
                    }
                    info.placed += partitions.len() as u64;
                    info.max_id = info.max_id.max(*id);
                    // Ids the engine did not get from us must still never be
                    // handed out again.
                    self.shared.next_id.fetch_max(id + 1, Ordering::SeqCst);
                    locations.push(loc);
                }
                Op::Move {
                    id,
                    partitions,
                    data,
                    from,
                    from_id,
                    from_location,
                } => {
                    let len = encoded_len(op);
                    let (loc, buf) = st.place(len, segment_size);
                    let n = record::encode_move(buf, *from, *from_id, *id, partitions, data);
                    debug_assert_eq!(n, len);
                    let info = st.head_info();
                    for p in partitions.iter() {
                        info.add_live(*p, *id);
                    }
                    info.placed += partitions.len() as u64;
                    info.max_id = info.max_id.max(*id);
                    self.shared.next_id.fetch_max(id + 1, Ordering::SeqCst);
                    // The source is settled by the same record.
                    st.unlive(*from, *from_id, *from_location);
                    st.forget(*from, *from_id);
                    locations.push(loc);
                }
                Op::Settle {
                    partition,
                    id,
                    location,
                } => {
                    let (_, buf) = st.place(encoded_len(op), segment_size);
                    record::encode_settle(buf, *partition, *id);
                    st.unlive(*partition, *id, *location);
                    st.forget(*partition, *id);
                }
                Op::Requeue {
                    partition,
                    id,
                    attempts,
                    deliver_at_ms,
                    ..
                } => {
                    let (_, buf) = st.place(encoded_len(op), segment_size);
                    record::encode_requeue(buf, *partition, *id, *attempts, *deliver_at_ms);
                    // Never live itself: the next relocated copy carries it.
                    st.requeued
                        .insert((*partition, *id), (*attempts, *deliver_at_ms));
                }
                Op::Receipt {
                    partition,
                    key_hash,
                    expires_at_ms,
                } => {
                    let (_, buf) = st.place(encoded_len(op), segment_size);
                    record::encode_receipt(buf, *partition, *key_hash, *expires_at_ms);
                    // Not live, but the segment is kept until it expires
                    // (or compaction copies it to a receipts file).
                    let info = st.head_info();
                    info.receipts_until = info.receipts_until.max(*expires_at_ms);
                }
                Op::PutMeta { key, value } => {
                    let version = st.meta_version + 1;
                    let (_, buf) = st.place(encoded_len(op), segment_size);
                    record::encode_put_meta(buf, version, key, value);
                    st.meta_version = version;
                    st.apply_meta(version, key, Some(value));
                    st.head_info().max_meta_version = version;
                    meta_changed = true;
                }
                Op::DeleteMeta { key } => {
                    let version = st.meta_version + 1;
                    let (_, buf) = st.place(encoded_len(op), segment_size);
                    record::encode_del_meta(buf, version, key);
                    st.meta_version = version;
                    st.apply_meta(version, key, None);
                    st.head_info().max_meta_version = version;
                    meta_changed = true;
                }
                Op::MetaBatch { changes } => {
                    // One version for the whole batch: recovery applies it
                    // whole, before or after a checkpoint.
                    let version = st.meta_version + 1;
                    let (_, buf) = st.place(encoded_len(op), segment_size);
                    record::encode_meta_batch(buf, version, changes);
                    st.meta_version = version;
                    for c in changes.iter() {
                        match c {
                            MetaChange::Put { key, value } => {
                                st.apply_meta(version, key, Some(value))
                            }
                            MetaChange::Delete { key } => st.apply_meta(version, key, None),
                        }
                    }
                    st.head_info().max_meta_version = version;
                    meta_changed = true;
                }
                Op::DropPartition { partition } => {
                    let (_, buf) = st.place(encoded_len(op), segment_size);
                    record::encode_cut(buf, *partition, MessageId::MAX);
                    st.cut(*partition, MessageId::MAX);
                }
                Op::Truncate { partition, before } => {
                    let (_, buf) = st.place(encoded_len(op), segment_size);
                    record::encode_cut(buf, *partition, *before);
                    st.cut(*partition, *before);
                }
                Op::PutState { key, value } => {
                    st.state_seq += 1;
                    let seq = st.state_seq;
                    let version = st.state_map.get(*key).map_or(1, |(v, _)| v + 1);
                    let (_, buf) = st.place(encoded_len(op), segment_size);
                    record::encode_state(buf, seq, version, key, Some(value));
                    st.state_map.insert(key.to_vec(), (version, value.to_vec()));
                    st.head_info().max_state_seq = seq;
                }
                Op::DeleteState { key } => {
                    st.state_seq += 1;
                    let seq = st.state_seq;
                    let (_, buf) = st.place(encoded_len(op), segment_size);
                    record::encode_state(buf, seq, 0, key, None);
                    st.state_map.remove(*key);
                    st.head_info().max_state_seq = seq;
                }
            }
        }
        let admission = st.shares.appended(tag, total as u64);
        let ticket = if ops.is_empty() {
            Ticket::NONE
        } else {
            st.next_ticket += 1;
            Ticket::new(st.next_ticket)
        };
        // Appends do not wake the writer: they ride with the next round
        // someone waits on ([`Store::when_durable`]), or the writer's idle
        // timer writes them. A large backlog wakes it, so pending memory
        // stays bounded.
        let pending_bytes: usize = st.pending.iter().map(|c| c.buf.len()).sum();
        Ok(Appended {
            ticket,
            admission,
            wakes: if meta_changed {
                st.feed.take_wakes()
            } else {
                Vec::new()
            },
            wake_writer: pending_bytes >= WAKE_PENDING_BYTES,
        })
    }

    /// Finishes an append once the lock is released.
    fn appended(&self, a: Appended, total: usize) -> (Ticket, Admission) {
        self.shared
            .stats
            .appended_bytes
            .fetch_add(total as u64, Ordering::Relaxed);
        if a.wake_writer {
            self.shared.wake.notify_one();
        }
        for w in a.wakes {
            w();
        }
        (a.ticket, a.admission)
    }

    pub(crate) fn append_as(
        &self,
        handle: u64,
        tag: ShareTag,
        ops: &[Op<'_>],
        locations: &mut Vec<Location>,
    ) -> Result<(Ticket, Admission), StoreError> {
        // Validate the whole batch first so a rejected op leaves nothing behind.
        let total = self.validate(ops)?;
        let mut st = self.shared.state.lock();
        let a = self.append_locked(&mut st, handle, tag, ops, locations, total)?;
        drop(st);
        Ok(self.appended(a, total))
    }

    pub(crate) fn when_durable_now(&self, ticket: Ticket, waiter: Waiter) {
        let mut st = self.shared.state.lock();
        let durable = ticket.get() <= self.shared.durable.load(Ordering::Acquire);
        // At once only when no earlier waiter is pending or being called:
        // waiters are called in the order they were registered.
        if durable && st.waiters.is_empty() && !st.calling {
            drop(st);
            writer::call_waiter(waiter, Ok(()));
            return;
        }
        if st.failed || st.writer_done {
            // No round will come: the writer's last one covered everything
            // it could.
            drop(st);
            writer::call_waiter(
                waiter,
                if durable {
                    Ok(())
                } else {
                    Err(StoreError::Closed)
                },
            );
            return;
        }
        let first = st.waiters.is_empty();
        st.waiters.push(waiter);
        drop(st);
        // Once per round: the writer takes every waiter when it wakes.
        if first {
            self.shared.wake.notify_one();
        }
    }

    pub(crate) fn meta_now(&self) -> RecoveredMeta {
        let st = self.shared.state.lock();
        RecoveredMeta {
            meta: st
                .meta
                .iter()
                .map(|(k, (_, v))| (k.clone(), v.clone()))
                .collect(),
            version: st.meta_version,
            key_versions: st
                .meta
                .iter()
                .map(|(k, (ver, _))| (k.clone(), *ver))
                .collect(),
            truncated_bytes: self.truncated_bytes,
        }
    }

    pub(crate) fn put_if_as(
        &self,
        handle: u64,
        key: &[u8],
        value: Option<&[u8]>,
        expected: u64,
    ) -> Result<(Ticket, u64), StoreError> {
        let op = match value {
            Some(value) => Op::PutMeta { key, value },
            None => Op::DeleteMeta { key },
        };
        let ops = [op];
        let total = self.validate(&ops)?;
        let mut st = self.shared.state.lock();
        let found = st.key_version(key);
        if found != expected {
            return Err(StoreError::Conflict { expected, found });
        }
        let a = self.append_locked(
            &mut st,
            handle,
            ShareTag::BROKER,
            &ops,
            &mut Vec::new(),
            total,
        )?;
        let version = st.meta_version;
        drop(st);
        let (ticket, _) = self.appended(a, total);
        Ok((ticket, version))
    }

    pub(crate) fn watch_now(&self, since: u64, wake: Wake) -> Result<MetaFeed, StoreError> {
        let mut st = self.shared.state.lock();
        if st.closing || st.failed {
            return Err(StoreError::Closed);
        }
        let current = st.meta_version;
        Ok(st.feed.watch(since, current, wake))
    }

    pub(crate) fn compact_now(&self, live: &dyn LiveSet) -> Result<usize, StoreError> {
        let _one = self.compaction.lock();
        // Startup is over: what open found for partitions nobody
        // recovered (their queues were deleted) is not kept in memory any
        // longer, and appends stop noting the partitions they touch.
        self.end_startup_window();
        let moved = self.compact_messages(live);
        if let Ok(n) = &moved {
            crate::metrics::compacted(*n);
        }
        // Then the receipts of segments emptied of messages (some maybe by
        // the moves just made). A failure there only delays reclamation.
        let now = now_ms();
        if let Err(e) = self.extract_receipts(now) {
            tracing::warn!(error = %e, "copying idempotency receipts out of old segments failed; their segments stay until the receipts expire");
        }
        {
            let mut files = self.receipt_files.lock();
            receipts::remove_expired(&self.shared.dir, &mut files.0, now);
        }
        // Receipts expire without any append: make sure the writer looks
        // at the oldest segment again when nothing else would wake it.
        let mut st = self.shared.state.lock();
        let reclaimable = st.segments.iter().next().is_some_and(|(&id, info)| {
            id < st.head && info.live == 0 && info.receipts_until <= now
        });
        if reclaimable && !st.reclaim_hint {
            st.reclaim_hint = true;
            drop(st);
            self.shared.wake.notify_one();
        }
        moved
    }
    pub(crate) fn stats_now(&self) -> StoreStats {
        let s = &self.shared.stats;
        StoreStats {
            appended_bytes: s.appended_bytes.load(Ordering::Relaxed),
            syncs: s.syncs.load(Ordering::Relaxed),
            segments: s.segments.load(Ordering::Relaxed),
            disk_bytes: s.disk_bytes.load(Ordering::Relaxed),
            reclaimed_segments: s.reclaimed.load(Ordering::Relaxed),
        }
    }

    pub(crate) fn close_now(&self) -> Result<(), StoreError> {
        self.stop_writer();
        // The writer is gone: nothing of ours touches the directory any more.
        self.lock.lock().take();
        if self.shared.state.lock().failed {
            Err(StoreError::Closed)
        } else {
            Ok(())
        }
    }
}

/// Calls `f` for every partition `op` names (its targets, and the source of
/// a move), stopping at the first error.
fn for_each_partition(
    op: &Op<'_>,
    mut f: impl FnMut(PartitionId) -> Result<(), StoreError>,
) -> Result<(), StoreError> {
    match op {
        Op::Publish { partitions, .. } => partitions.iter().try_for_each(|p| f(*p)),
        Op::Move {
            partitions, from, ..
        } => {
            partitions.iter().try_for_each(|p| f(*p))?;
            f(*from)
        }
        Op::Settle { partition, .. }
        | Op::Requeue { partition, .. }
        | Op::Receipt { partition, .. }
        | Op::DropPartition { partition }
        | Op::Truncate { partition, .. } => f(*partition),
        Op::PutMeta { .. }
        | Op::DeleteMeta { .. }
        | Op::MetaBatch { .. }
        | Op::PutState { .. }
        | Op::DeleteState { .. } => Ok(()),
    }
}

/// The store's trait, for its first handle (`handle.rs` for the others).
impl Store for LogStore {
    fn allocate_ids(&self, n: u64) -> MessageId {
        self.shared.next_id.fetch_add(n, Ordering::SeqCst)
    }

    fn append(&self, ops: &[Op<'_>], locations: &mut Vec<Location>) -> Result<Ticket, StoreError> {
        self.append_as(partitions::FIRST_HANDLE, ShareTag::BROKER, ops, locations)
            .map(|(t, _)| t)
    }

    fn append_for(
        &self,
        tag: ShareTag,
        ops: &[Op<'_>],
        locations: &mut Vec<Location>,
    ) -> Result<(Ticket, Admission), StoreError> {
        self.append_as(partitions::FIRST_HANDLE, tag, ops, locations)
    }

    fn when_durable(&self, ticket: Ticket, waiter: Waiter) {
        self.when_durable_now(ticket, waiter)
    }

    fn read_many(&self, refs: &[MessageRef]) -> ReadFuture<Vec<Result<StoredMessage, StoreError>>> {
        // From the page cache or disk while building: the log has no
        // network round trip to overlap.
        crate::ready(refs.iter().map(|r| self.read_now(r.location)).collect())
    }

    fn read_range(
        &self,
        partition: PartitionId,
        from: MessageId,
        max: usize,
    ) -> ReadFuture<Result<Vec<RangeMessage>, StoreError>> {
        crate::ready(self.read_range_now(partition, from, max))
    }

    fn read_from(
        &self,
        first: crate::MessageRef,
        max: usize,
    ) -> ReadFuture<Result<Vec<RangeMessage>, StoreError>> {
        crate::ready(self.read_from_now(first, max))
    }

    fn read(&self, location: Location) -> Result<StoredMessage, StoreError> {
        self.read_now(location)
    }

    fn recovered_meta(&self) -> Result<RecoveredMeta, StoreError> {
        Ok(self.meta_now())
    }

    fn put_if(
        &self,
        key: &[u8],
        value: Option<&[u8]>,
        expected: u64,
    ) -> Result<(Ticket, u64), StoreError> {
        self.put_if_as(partitions::FIRST_HANDLE, key, value, expected)
    }

    fn watch(&self, since: u64, wake: Wake) -> Result<MetaFeed, StoreError> {
        self.watch_now(since, wake)
    }

    fn acquire(&self, partition: PartitionId) -> Result<Epoch, StoreError> {
        self.acquire_as(partitions::FIRST_HANDLE, partition)
    }

    fn try_acquire(&self, partition: PartitionId) -> Result<Option<Epoch>, StoreError> {
        self.try_acquire_as(partitions::FIRST_HANDLE, partition)
    }

    fn recovered_partitions(&self) -> Result<Vec<PartitionId>, StoreError> {
        Ok(self.recovered_partitions.clone())
    }

    fn recover_partition(
        &self,
        partition: PartitionId,
    ) -> Result<Vec<RecoveredMessage>, StoreError> {
        self.recover_partition_as(partitions::FIRST_HANDLE, partition)
    }

    fn recover_receipts(&self, partition: PartitionId) -> Result<Vec<Receipt>, StoreError> {
        self.recover_receipts_as(partitions::FIRST_HANDLE, partition)
    }

    fn compact(&self, live: &dyn LiveSet) -> Result<usize, StoreError> {
        self.compact_now(live)
    }

    fn stats(&self) -> StoreStats {
        self.stats_now()
    }

    fn close(&self) -> Result<(), StoreError> {
        self.close_now()
    }

    fn scan_state(&self, prefix: &[u8]) -> Result<Vec<StateEntry>, StoreError> {
        Ok(self.scan_state_now(prefix))
    }

    fn spill(&self) -> Option<&dyn crate::Spill> {
        Some(self)
    }
}

impl LogStore {
    /// The message part of [`Store::compact`]: relocates the survivors of
    /// sparse old segments.
    fn compact_messages(&self, live: &dyn LiveSet) -> Result<usize, StoreError> {
        let candidates = {
            let mut st = self.shared.state.lock();
            let c = st.compaction_candidates(self.shared.opts.compact_below);
            if c.is_empty() {
                return Ok(0);
            }
            // From now on settles are noted, before anything is collected:
            // a settle appended after the engine showed us the message must
            // stop its copy.
            st.compacting = Some(Compacting::default());
            c
        };
        let _done = CompactionDone(&self.shared);
        // Phase 1, under the engine's locks: only collect.
        let started = std::time::Instant::now();
        let mut todo = Vec::new();
        live.for_each_live(&mut |partition, id, location| {
            if todo.len() < MAX_RELOCATIONS && candidates.contains(&location.in_log().segment()) {
                todo.push((partition, id, location));
            }
        });
        let collected = started.elapsed();
        // Phase 2, no engine lock held: read and copy.
        let mut copies = Vec::with_capacity(todo.len());
        let mut err = None;
        for (partition, id, old) in todo {
            match self.copy_for_compaction(partition, id, old) {
                Ok(Some(new)) => copies.push(Relocation {
                    partition,
                    id,
                    old,
                    new,
                }),
                Ok(None) => {}
                Err(e) => {
                    err = Some(e);
                    break;
                }
            }
        }
        // Phase 3, under the engine's locks again: swap in what is still
        // where it was. Also after an error: the copies made are accounted.
        let copied = started.elapsed();
        let swapped = if copies.is_empty() {
            Vec::new()
        } else {
            live.relocate(&copies)
        };
        tracing::debug!(
            collect_ms = collected.as_secs_f64() * 1e3,
            copy_ms = (copied - collected).as_secs_f64() * 1e3,
            swap_ms = (started.elapsed() - copied).as_secs_f64() * 1e3,
            records = copies.len(),
            "compaction round"
        );
        debug_assert_eq!(swapped.len(), copies.len());
        let mut moved = 0;
        let mut st = self.shared.state.lock();
        for (i, c) in copies.iter().enumerate() {
            if swapped.get(i).copied().unwrap_or(false) {
                // The engine names the copy from now on.
                st.unlive(c.partition, c.id, c.old.in_log());
                moved += 1;
            } else {
                // Settled or moved meanwhile: the settle (naming `old`)
                // frees the source, and the copy is garbage.
                st.unlive(c.partition, c.id, c.new.in_log());
            }
        }
        drop(st);
        match err {
            Some(e) => Err(e),
            None => Ok(moved),
        }
    }

    /// Copies the unexpired receipts of the oldest segments into a receipts
    /// file, so those segments can be reclaimed before their receipts
    /// expire. Only segments that nothing else keeps (no live message) are
    /// read, oldest first (only a prefix of the log can be deleted), and
    /// only when their receipts live on for more than
    /// [`RECEIPT_HORIZON_MS`]. Returns how many segments were released.
    fn extract_receipts(&self, now: u64) -> Result<usize, StoreError> {
        let candidates = {
            let st = self.shared.state.lock();
            // Only segments whose every byte reached the kernel can be read
            // from their file.
            let written = (self.shared.written.load(Ordering::Acquire) >> 32) as SegmentId;
            let mut out = Vec::new();
            let mut bytes = 0u64;
            for (&id, info) in st.segments.iter() {
                if id >= st.head || id >= written || info.live > 0 {
                    break;
                }
                if info.receipts_until > now.saturating_add(RECEIPT_HORIZON_MS) {
                    if !out.is_empty() && bytes + info.size > MAX_RECEIPT_EXTRACTION_BYTES {
                        break;
                    }
                    bytes += info.size;
                    out.push(id);
                }
            }
            out
        };
        if candidates.is_empty() {
            return Ok(0);
        }
        // No lock held: reading sealed segments, writing the file.
        let mut entries = Vec::new();
        let mut done = Vec::new();
        for &seg in &candidates {
            let path = segment::segment_path(&self.shared.log_dir, seg);
            let buf = match std::fs::read(&path) {
                Ok(b) => b,
                // Reclaimed meanwhile: its receipts expired.
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(StoreError::io(format!("reading {}", path.display()), e)),
            };
            let mut off = segment::HEADER_LEN;
            let mut intact = true;
            while off < buf.len() {
                let rec = record::split_frame(&buf[off..])
                    .ok()
                    .and_then(|(payload, len)| Some((record::decode_payload(payload).ok()?, len)));
                let Some((rec, len)) = rec else {
                    // Sealed segments were checked at open and are never
                    // rewritten: damage here is new. Keep the segment.
                    tracing::error!(
                        segment = seg,
                        offset = off,
                        "undecodable record in a sealed segment; keeping it"
                    );
                    intact = false;
                    break;
                };
                if let Record::Receipt {
                    partition,
                    key_hash,
                    expires_at_ms,
                } = rec
                {
                    if expires_at_ms > now {
                        entries.push((partition, key_hash, expires_at_ms));
                    }
                }
                off += len;
            }
            if intact {
                done.push(seg);
            }
        }
        if done.is_empty() {
            return Ok(0);
        }
        if !entries.is_empty() {
            // The same key may repeat (a later receipt extends it).
            entries.sort_unstable();
            entries.dedup_by(|b, a| {
                if (a.0, a.1) == (b.0, b.1) {
                    a.2 = a.2.max(b.2);
                    true
                } else {
                    false
                }
            });
            let mut files = self.receipt_files.lock();
            let seq = files.1;
            files.1 += 1;
            let file = receipts::write(&self.shared.dir, seq, &entries, self.shared.opts.sync)?;
            files.0.push(file);
        }
        // The receipts are durable in the file: the segments no longer
        // need to wait for them. (Sealed: nothing is appended to them.)
        let mut st = self.shared.state.lock();
        for seg in &done {
            if let Some(info) = st.segments.get_mut(seg) {
                info.receipts_until = 0;
            }
        }
        Ok(done.len())
    }
}

impl LogStore {
    /// [`Store::read`]: a stored message (a spilled copy is the spill's).
    pub(crate) fn read_now(&self, location: Location) -> Result<StoredMessage, StoreError> {
        if location.is_spilled() {
            return Err(StoreError::NotFound(location));
        }
        self.read_stored(location)
    }

    /// The state store's keys under `prefix`.
    pub(crate) fn scan_state_now(&self, prefix: &[u8]) -> Vec<StateEntry> {
        let st = self.shared.state.lock();
        st.state_map
            .range(prefix.to_vec()..)
            .take_while(|(k, _)| k.starts_with(prefix))
            .map(|(k, (version, value))| StateEntry {
                key: k.clone(),
                value: value.clone(),
                version: *version,
            })
            .collect()
    }

    /// Reads the message record at `location` (a spilled one at its log
    /// position) and copies out its fields.
    pub(crate) fn read_stored(&self, location: Location) -> Result<StoredMessage, StoreError> {
        let (raw, idx) = self.read_message(location)?;
        let text = |r: std::ops::Range<usize>| String::from_utf8_lossy(&raw[r]).into_owned();
        Ok(StoredMessage {
            id: idx.id,
            exchange: text(idx.exchange.clone()),
            routing_key: text(idx.routing_key.clone()),
            header_format: idx.header_format,
            header: raw.slice(idx.header.clone()),
            body: raw.slice(idx.body.clone()),
            attrs: idx.attrs,
        })
    }
}

/// The log's spill: page records in the same segments as everything else
/// (record types 6 and 9), accounted like messages, never fsynced for
/// their own sake and skipped by recovery. A release writes nothing: the
/// page is simply no longer counted, and its segment is reclaimed with the
/// rest once nothing in it is live.
impl crate::Spill for LogStore {
    fn spill(
        &self,
        tag: ShareTag,
        id: MessageId,
        partitions: &[PartitionId],
        data: MessageData<'_>,
    ) -> Result<(Location, Admission), StoreError> {
        if partitions.is_empty() || partitions.len() > u32::MAX as usize {
            return Err(StoreError::Invalid(
                "a spilled message needs 1..=u32::MAX partitions".into(),
            ));
        }
        let len = FRAME_HEADER
            + record::message_payload_len(MessageKind::Page, partitions.len(), &data, 0);
        if len + record::EXT_LEN > self.max_record() {
            return Err(StoreError::TooLarge(len));
        }
        let mut st = self.shared.state.lock();
        if st.closing || st.failed {
            return Err(StoreError::Closed);
        }
        if st.no_space {
            return Err(StoreError::NoSpace);
        }
        let (loc, buf) = st.place(len, self.shared.opts.segment_size);
        let n = record::encode_message(buf, MessageKind::Page, id, partitions, &data, 0);
        debug_assert_eq!(n, len);
        let info = st.head_info();
        for p in partitions {
            info.add_live(*p, id);
        }
        info.placed += partitions.len() as u64;
        info.max_id = info.max_id.max(id);
        // Its id must never be handed out again, even across a restart.
        self.shared.next_id.fetch_max(id + 1, Ordering::SeqCst);
        let admission = st.shares.appended(tag, len as u64);
        let pending_bytes: usize = st.pending.iter().map(|c| c.buf.len()).sum();
        drop(st);
        self.shared
            .stats
            .appended_bytes
            .fetch_add(len as u64, Ordering::Relaxed);
        // Never waited on: only a backlog wakes the writer.
        if pending_bytes >= WAKE_PENDING_BYTES {
            self.shared.wake.notify_one();
        }
        Ok((loc.spilled(), admission))
    }

    fn read(&self, location: Location) -> Result<StoredMessage, StoreError> {
        if !location.is_spilled() {
            return Err(StoreError::NotFound(location));
        }
        self.read_stored(location.in_log())
    }

    fn holds(&self, location: Location) -> bool {
        location.is_spilled()
    }

    fn release(&self, partition: PartitionId, id: MessageId, location: Location) {
        if !location.is_spilled() {
            return;
        }
        let mut st = self.shared.state.lock();
        st.unlive(partition, id, location.in_log());
        st.forget(partition, id);
    }

    fn release_partition(&self, partition: PartitionId) {
        self.shared.state.lock().cut(partition, MessageId::MAX);
    }
}

impl Drop for LogStore {
    fn drop(&mut self) {
        self.stop_writer();
    }
}
