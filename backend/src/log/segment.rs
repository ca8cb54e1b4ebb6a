//! Segment files: naming, listing, the format header, per-segment accounting
//! and cached read handles.
//!
//! Every segment starts with a 16-byte header, then framed records
//! (`record.rs`):
//!
//! ```text
//! "WEIRSEG\0" | format version u32 LE | recorded end u32 LE
//! ```
//!
//! The *recorded end* (written as 0, once reserved) is a lower bound of the
//! segment's durable data: the writer stores an end there only after an
//! fsync covered every byte below it (at roll, at close, and about once a
//! second while it appends; see [`record_end`]). Recovery treats a bad record
//! below it as damage, never as a torn tail. 0 means nothing was recorded
//! (segments written before the field existed, with fsync off, or a crash
//! before the first record): such a segment recovers as before. Builds that
//! predate the field ignore it, so the format version is unchanged.
//!
//! Format 0 (before versions) had no header: its first record started at
//! offset 0. Recovery refuses segments in any format but [`FORMAT_VERSION`].

use super::SegmentId;
use crate::{Location, MessageId, PartitionId, StoreError};
use parking_lot::RwLock;
use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

const SUFFIX: &str = ".seg";

/// The log format this build reads and writes.
pub(crate) const FORMAT_VERSION: u32 = 1;
const MAGIC: [u8; 8] = *b"WEIRSEG\0";
/// Length of the header at the start of every segment.
pub(crate) const HEADER_LEN: usize = 16;

/// The header of a segment in [`FORMAT_VERSION`].
pub(crate) fn header() -> [u8; HEADER_LEN] {
    let mut h = [0u8; HEADER_LEN];
    h[..8].copy_from_slice(&MAGIC);
    h[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
    h
}

/// Where the recorded end sits in the header.
const END_FIELD: usize = 12;

/// The durable end recorded in the header of a segment whose bytes start
/// with `buf` (0: none recorded).
pub(crate) fn recorded_end(buf: &[u8]) -> u64 {
    match buf.get(END_FIELD..HEADER_LEN) {
        Some(&[a, b, c, d]) => u64::from(u32::from_le_bytes([a, b, c, d])),
        _ => 0,
    }
}

/// Sets the recorded end in a segment's bytes (a segment rewritten by
/// `weir repair`).
pub(crate) fn set_recorded_end(buf: &mut [u8], end: u64) {
    if let (Some(field), Ok(end)) = (buf.get_mut(END_FIELD..HEADER_LEN), u32::try_from(end)) {
        field.copy_from_slice(&end.to_le_bytes());
    }
}

/// Records `end` in the header of the open segment `file`.
///
/// Call it only after an fsync that covered every byte below `end`: a crash
/// can then leave the field old or new, and either is true. (Written before
/// that fsync, the field could reach the disk while the data did not, and
/// an unconfirmed torn write would be reported as damage.) The field itself
/// becomes durable with the file's next fsync; until then a crash simply
/// leaves the older, smaller end.
pub(crate) fn record_end(file: &File, end: u64) -> std::io::Result<()> {
    let Ok(end) = u32::try_from(end) else {
        return Ok(());
    };
    file.write_all_at(&end.to_le_bytes(), END_FIELD as u64)
}

/// What the first bytes of a segment file say about its format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum HeaderCheck {
    /// A header of this build's format.
    Valid,
    /// A prefix of the header followed only by zeros (or nothing): the
    /// segment was created but its first write never completed. Acceptable
    /// only in the last segment, where nothing was ever made durable.
    Torn,
    /// No header, but a valid record at offset 0: log format 0.
    Legacy,
    /// Weir's magic with another format version.
    Version(u32),
    /// Not a Weir segment header.
    Bad,
}

/// Classifies the start of a segment's bytes.
pub(crate) fn check_header(buf: &[u8]) -> HeaderCheck {
    let want = header();
    if buf.len() >= HEADER_LEN && buf[..8] == MAGIC {
        let version = u32::from_le_bytes([buf[8], buf[9], buf[10], buf[11]]);
        if version == FORMAT_VERSION {
            return HeaderCheck::Valid;
        }
        if version != 0 {
            return HeaderCheck::Version(version);
        }
    }
    let prefix = buf
        .iter()
        .zip(want.iter())
        .take_while(|(a, b)| a == b)
        .count();
    if buf[prefix..].iter().all(|b| *b == 0) {
        return HeaderCheck::Torn;
    }
    if super::record::split_frame(buf).is_ok() {
        return HeaderCheck::Legacy;
    }
    HeaderCheck::Bad
}

/// `<log_dir>/00000001.seg`.
pub(crate) fn segment_path(log_dir: &Path, id: SegmentId) -> PathBuf {
    log_dir.join(format!("{id:08}{SUFFIX}"))
}

/// Suffix of a segment renamed for deletion: its unlink (tens of ms for a
/// large file) runs off the writer thread.
const TRASH_SUFFIX: &str = ".seg.del";

/// `<log_dir>/00000001.seg.del`: where a reclaimed segment waits for its unlink.
pub(crate) fn trash_path(log_dir: &Path, id: SegmentId) -> PathBuf {
    log_dir.join(format!("{id:08}{TRASH_SUFFIX}"))
}

/// How much of a reclaimed segment one truncation step frees.
const TRUNCATE_STEP: u64 = 4 << 20;
/// Pause between truncation steps.
const TRUNCATE_PAUSE: std::time::Duration = std::time::Duration::from_millis(1);

/// Deletes a reclaimed segment without stalling concurrent commits.
///
/// Freeing a file's blocks is journalled (and, on a filesystem mounted with
/// online `discard`, discarded when the journal commits), and every
/// fdatasync of the head segment waits for that commit: deleting a 64 MiB
/// segment at once stalled concurrent commits by 12-24 ms (docs/BENCHMARKS.md,
/// issue 7). Truncating from the end in [`TRUNCATE_STEP`]s with a pause
/// between them spreads the work over many small commits (measured: no stall
/// at the deletion; it takes ~45 ms instead of ~25), as RocksDB's delete
/// scheduler does. Only segments beyond the spare pool (`spares.rs`) are
/// deleted.
pub(crate) fn delete_gradually(path: &Path) -> std::io::Result<()> {
    match OpenOptions::new().write(true).open(path) {
        Ok(file) => {
            let mut len = file.metadata()?.len();
            while len > TRUNCATE_STEP {
                len -= TRUNCATE_STEP;
                file.set_len(len)?;
                std::thread::sleep(TRUNCATE_PAUSE);
            }
        }
        // Deleted already; remove_file below says so.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    std::fs::remove_file(path)
}

/// Deletes segments renamed for deletion whose unlink a crash interrupted.
pub(crate) fn remove_trash(log_dir: &Path) {
    let Ok(rd) = std::fs::read_dir(log_dir) else {
        return;
    };
    for entry in rd.flatten() {
        if entry
            .file_name()
            .to_str()
            .is_some_and(|n| n.ends_with(TRASH_SUFFIX))
        {
            if let Err(e) = std::fs::remove_file(entry.path()) {
                tracing::warn!(error = %e, file = %entry.path().display(), "deleting a reclaimed segment failed");
            }
        }
    }
}

/// Ids of every segment file in `log_dir`, ascending. Other files are ignored.
pub(crate) fn list_segments(log_dir: &Path) -> Result<Vec<SegmentId>, StoreError> {
    let mut ids = Vec::new();
    let rd = std::fs::read_dir(log_dir)
        .map_err(|e| StoreError::io(format!("listing {}", log_dir.display()), e))?;
    for entry in rd {
        let entry =
            entry.map_err(|e| StoreError::io(format!("listing {}", log_dir.display()), e))?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        let Some(stem) = name.strip_suffix(SUFFIX) else {
            continue;
        };
        if stem.is_empty() || !stem.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        if let Ok(id) = stem.parse::<SegmentId>() {
            ids.push(id);
        }
    }
    ids.sort_unstable();
    Ok(ids)
}

/// Fsyncs a directory so that file creations, renames and removals in it are
/// durable.
pub(crate) fn sync_dir(dir: &Path) -> Result<(), StoreError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| StoreError::io(format!("fsync directory {}", dir.display()), e))
}

/// Live pairs of one partition in one segment ([`SegmentInfo::parts`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct PartLive {
    /// (partition, id) pairs of the partition whose current location is here.
    pub live: u64,
    /// The highest id ever counted here for the partition since the entry
    /// was made: every live pair's id is at most this.
    pub max_id: MessageId,
}

/// A hasher for the integer keys of the accounting maps (partition ids): a
/// multiply-rotate mix, much cheaper per settle than SipHash, and these
/// keys are not chosen by clients.
#[derive(Default, Clone, Copy)]
pub(crate) struct IdHasher(u64);

impl std::hash::Hasher for IdHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x517c_c1b7_2722_0a95);
    }
    fn finish(&self) -> u64 {
        self.0
    }
}

/// Live pairs per partition of one segment.
pub(crate) type PartMap = HashMap<PartitionId, PartLive, std::hash::BuildHasherDefault<IdHasher>>;

/// Space accounting for one segment.
#[derive(Clone, Debug, Default)]
pub(crate) struct SegmentInfo {
    /// Bytes assigned to the segment (written or pending).
    pub size: u64,
    /// (partition, id) pairs whose current location is in this segment.
    pub live: u64,
    /// (partition, id) pairs ever placed in this segment (publish partitions
    /// plus relocations); the denominator of the live fraction.
    pub placed: u64,
    /// Highest metadata version recorded in the segment (0 = none).
    pub max_meta_version: u64,
    /// Highest message id recorded in the segment (0 = none).
    pub max_id: u64,
    /// Latest expiry (ms since the Unix epoch) of the idempotency receipts
    /// recorded in the segment and not yet copied to a receipts file
    /// (0 = none): the segment is not reclaimed before then.
    pub receipts_until: u64,
    /// Highest state-store sequence number recorded in the segment (0 =
    /// none): like `max_meta_version`, a checkpoint must cover it before
    /// the segment is deleted.
    pub max_state_seq: u64,
    /// `live` by partition, so that a partition drop or truncation (one
    /// record, no location per message) frees exactly what it settles.
    /// Partitions with nothing live here have no entry.
    pub parts: PartMap,
}

impl SegmentInfo {
    /// The message `id` of `partition` now lives here.
    pub fn add_live(&mut self, partition: PartitionId, id: MessageId) {
        self.live += 1;
        let p = self.parts.entry(partition).or_default();
        p.live += 1;
        p.max_id = p.max_id.max(id);
    }

    /// One message of `partition` no longer lives here. Nothing is counted
    /// (false) when none of the partition is: its messages here were
    /// dropped already (a settle racing a queue delete must not take the
    /// count of another partition's message).
    pub fn remove_live(&mut self, partition: PartitionId) -> bool {
        let Some(p) = self.parts.get_mut(&partition) else {
            return false;
        };
        debug_assert!(p.live > 0 && self.live > 0);
        p.live = p.live.saturating_sub(1);
        self.live = self.live.saturating_sub(1);
        if p.live == 0 {
            self.parts.remove(&partition);
        }
        true
    }

    /// Settles the messages of `partition` with an id below `before` that
    /// live here, when that is all of them (`before` = `MessageId::MAX`:
    /// a drop); returns how many. When some of them have higher ids, which
    /// ones are below is not known here, so none is freed: the segment
    /// then waits for a later truncation past them, or for a restart
    /// (recovery counts exactly).
    pub fn cut(&mut self, partition: PartitionId, before: MessageId) -> u64 {
        match self.parts.get(&partition) {
            Some(p) if before == MessageId::MAX || p.max_id < before => {
                let n = p.live;
                self.parts.remove(&partition);
                self.live = self.live.saturating_sub(n);
                n
            }
            _ => 0,
        }
    }

    /// Live fraction by (partition, id) pairs; 1.0 for a segment that never
    /// held a message.
    pub fn live_fraction(&self) -> f64 {
        if self.placed == 0 {
            1.0
        } else {
            self.live as f64 / self.placed as f64
        }
    }
}

/// Read-only file handles per segment, opened on first use and shared by all
/// readers (`pread` needs no seek, so one handle serves concurrent reads).
pub(crate) struct ReadCache {
    log_dir: PathBuf,
    files: RwLock<HashMap<SegmentId, Arc<File>>>,
}

impl ReadCache {
    pub fn new(log_dir: PathBuf) -> Self {
        ReadCache {
            log_dir,
            files: RwLock::new(HashMap::new()),
        }
    }

    fn handle(&self, loc: Location) -> Result<Arc<File>, StoreError> {
        if let Some(f) = self.files.read().get(&loc.segment()) {
            return Ok(f.clone());
        }
        let path = segment_path(&self.log_dir, loc.segment());
        let f = match File::open(&path) {
            Ok(f) => Arc::new(f),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(StoreError::NotFound(loc))
            }
            Err(e) => return Err(StoreError::io(format!("open {}", path.display()), e)),
        };
        Ok(self.files.write().entry(loc.segment()).or_insert(f).clone())
    }

    /// Reads the `loc.len()` bytes at `loc` from disk.
    pub fn read(&self, loc: Location) -> Result<Vec<u8>, StoreError> {
        let f = self.handle(loc)?;
        let mut buf = vec![0u8; loc.len() as usize];
        match f.read_exact_at(&mut buf, u64::from(loc.offset())) {
            Ok(()) => Ok(buf),
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                Err(StoreError::NotFound(loc))
            }
            Err(e) => Err(StoreError::io(
                format!("read segment {} at {}", loc.segment(), loc.offset()),
                e,
            )),
        }
    }

    /// Drops the handle of a deleted segment.
    pub fn forget(&self, id: SegmentId) {
        self.files.write().remove(&id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_sort_and_parse() {
        let dir = tempfile::tempdir().unwrap();
        for id in [3u32, 1, 120] {
            File::create(segment_path(dir.path(), id)).unwrap();
        }
        File::create(dir.path().join("junk.seg")).unwrap();
        File::create(dir.path().join("00000009.tmp")).unwrap();
        assert_eq!(list_segments(dir.path()).unwrap(), vec![1, 3, 120]);
        assert!(segment_path(dir.path(), 1).ends_with("00000001.seg"));
    }

    #[test]
    fn header_classification() {
        let h = header();
        let mut seg = h.to_vec();
        seg.extend_from_slice(&[0u8; 100]);
        assert_eq!(check_header(&seg), HeaderCheck::Valid);
        // Torn at creation: any prefix of the header, then zeros.
        for cut in 0..HEADER_LEN {
            let mut t = h[..cut].to_vec();
            assert_eq!(check_header(&t), HeaderCheck::Torn, "cut {cut}");
            t.resize(4096, 0);
            // Past the version's first byte the zeros complete the header.
            let want = if cut > 8 {
                HeaderCheck::Valid
            } else {
                HeaderCheck::Torn
            };
            assert_eq!(check_header(&t), want, "cut {cut}");
        }
        // The recorded end does not change the classification.
        assert_eq!(recorded_end(&seg), 0);
        set_recorded_end(&mut seg, 0x0102_0304);
        assert_eq!(recorded_end(&seg), 0x0102_0304);
        assert_eq!(check_header(&seg), HeaderCheck::Valid);
        assert_eq!(recorded_end(&h[..13]), 0, "short buffer");
        let mut newer = h.to_vec();
        newer[8] = 7;
        assert_eq!(check_header(&newer), HeaderCheck::Version(7));
        // Format 0: a record right at offset 0.
        let mut old = Vec::new();
        super::super::record::encode_settle(&mut old, crate::PartitionId(1), 2);
        assert_eq!(check_header(&old), HeaderCheck::Legacy);
        assert_eq!(
            check_header(b"garbage that is not a segment"),
            HeaderCheck::Bad
        );
    }
}
