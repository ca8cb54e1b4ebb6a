//! Segment files: naming, listing, per-segment accounting and cached read
//! handles.

use crate::{Location, SegmentId, StoreError};
use parking_lot::RwLock;
use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

const SUFFIX: &str = ".seg";

/// `<log_dir>/00000001.seg`.
pub(crate) fn segment_path(log_dir: &Path, id: SegmentId) -> PathBuf {
    log_dir.join(format!("{id:08}{SUFFIX}"))
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

/// Space accounting for one segment.
#[derive(Clone, Copy, Debug, Default)]
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
}

impl SegmentInfo {
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
        if let Some(f) = self.files.read().get(&loc.segment) {
            return Ok(f.clone());
        }
        let path = segment_path(&self.log_dir, loc.segment);
        let f = match File::open(&path) {
            Ok(f) => Arc::new(f),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(StoreError::NotFound(loc))
            }
            Err(e) => return Err(StoreError::io(format!("open {}", path.display()), e)),
        };
        Ok(self.files.write().entry(loc.segment).or_insert(f).clone())
    }

    /// Reads the `loc.len` bytes at `loc` from disk.
    pub fn read(&self, loc: Location) -> Result<Vec<u8>, StoreError> {
        let f = self.handle(loc)?;
        let mut buf = vec![0u8; loc.len as usize];
        match f.read_exact_at(&mut buf, u64::from(loc.offset)) {
            Ok(()) => Ok(buf),
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                Err(StoreError::NotFound(loc))
            }
            Err(e) => Err(StoreError::io(
                format!("read segment {} at {}", loc.segment, loc.offset),
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
}
