//! Spare segments: reclaimed segment files zeroed and kept for reuse.
//!
//! Deleting a segment frees its blocks, and freeing blocks is slow where it
//! is a journal transaction that also discards them (ext4 mounted with
//! `discard`, as on this project's machines): every fdatasync of the head
//! segment issued meanwhile waits for it. Measured here, deleting one 64 MiB
//! segment stalled concurrent commits by 12-24 ms, truncating it gradually
//! still by 18 ms (docs/BENCHMARKS.md, issue 7). A reclaimed segment is
//! therefore zeroed in place instead (`FALLOC_FL_ZERO_RANGE`: its extents
//! become unwritten, nothing is freed or discarded), synced, and renamed into
//! this pool; the writer renames a spare into its next segment instead of
//! allocating one, as databases recycle their write-ahead logs. A zeroed
//! spare reads as zeros like a freshly allocated segment, so recovery cannot
//! mistake old records in it for new ones.
//!
//! At most [`MAX_SPARES`] are kept; beyond that (the log shrank) segments are
//! deleted, gradually ([`segment::delete_gradually`]).

use super::segment;
use parking_lot::{Condvar, Mutex};
use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Spare segments kept at most: what a broker churning through its log at a
/// steady size reuses, without holding much disk after the log shrank.
pub(crate) const MAX_SPARES: usize = 2;

/// Suffix of a spare segment file (`log/00000007.spare`).
const SUFFIX: &str = ".spare";

/// The pool of spare segment files of one log directory.
pub(crate) struct Spares {
    log_dir: PathBuf,
    /// Size a spare is zeroed to: the segment size.
    size: u64,
    sync: bool,
    inner: Mutex<Pool>,
    /// Signalled when `Pool::outstanding` drops to zero.
    idle: Condvar,
}

#[derive(Default)]
struct Pool {
    /// Ready to use.
    ready: Vec<PathBuf>,
    /// Being zeroed: count against [`MAX_SPARES`] already.
    preparing: usize,
    /// Number of the next spare's file name.
    next: u64,
    /// Reclaimed files handed over and not yet recycled or deleted.
    outstanding: usize,
}

impl Spares {
    /// The pool of `log_dir`, with the spares a previous run left (they were
    /// zeroed and synced before they got their name). Spares of another
    /// size (left by a run with other segments) and those beyond
    /// [`MAX_SPARES`] are deleted.
    pub(crate) fn open(log_dir: &Path, size: u64, sync: bool) -> Spares {
        let mut pool = Pool::default();
        let mut found: Vec<(u64, PathBuf, u64)> = Vec::new();
        if let Ok(rd) = std::fs::read_dir(log_dir) {
            for entry in rd.flatten() {
                let name = entry.file_name();
                let Some(n) = name
                    .to_str()
                    .and_then(|n| n.strip_suffix(SUFFIX))
                    .and_then(|n| n.parse::<u64>().ok())
                else {
                    continue;
                };
                let len = entry.metadata().map_or(0, |m| m.len());
                found.push((n, entry.path(), len));
            }
        }
        found.sort_unstable();
        pool.next = found.last().map_or(1, |(n, _, _)| n + 1);
        for (_, path, len) in found {
            if len == size && pool.ready.len() < MAX_SPARES {
                pool.ready.push(path);
            } else if let Err(e) = std::fs::remove_file(&path) {
                tracing::warn!(error = %e, file = %path.display(), "deleting a spare segment failed");
            }
        }
        Spares {
            log_dir: log_dir.to_path_buf(),
            size,
            sync,
            inner: Mutex::new(pool),
            idle: Condvar::new(),
        }
    }

    /// Moves a spare to `path` (a new segment) and opens it for writing.
    /// `None` when there is no spare (or it could not be used): the caller
    /// allocates a new file.
    pub(crate) fn take(&self, path: &Path) -> Option<File> {
        loop {
            let spare = self.inner.lock().ready.pop()?;
            let file = std::fs::rename(&spare, path)
                .and_then(|()| OpenOptions::new().write(true).open(path));
            match file {
                Ok(f) => return Some(f),
                Err(e) => {
                    tracing::warn!(error = %e, file = %spare.display(), "cannot reuse a spare segment");
                    let _ = std::fs::remove_file(&spare);
                }
            }
        }
    }

    /// Recycles reclaimed segment files (renamed out of the log) on a
    /// thread of their own: zeroing and syncing takes milliseconds the
    /// writer's commits must not wait for. A crash meanwhile leaves them to
    /// [`segment::remove_trash`].
    pub(crate) fn recycle_in_background(self: &Arc<Self>, files: Vec<PathBuf>) {
        if files.is_empty() {
            return;
        }
        self.inner.lock().outstanding += files.len();
        let spares = self.clone();
        let n = files.len();
        let work = move || {
            for file in files {
                let started = std::time::Instant::now();
                spares.recycle(&file);
                tracing::debug!(
                    ms = started.elapsed().as_secs_f64() * 1e3,
                    file = %file.display(),
                    "recycled a reclaimed segment"
                );
                let mut pool = spares.inner.lock();
                pool.outstanding -= 1;
                if pool.outstanding == 0 {
                    spares.idle.notify_all();
                }
            }
        };
        if let Err(e) = std::thread::Builder::new()
            .name("weir-recycle".into())
            .spawn(work)
        {
            tracing::warn!(error = %e, "no thread to recycle reclaimed segments; left for the next start");
            let mut pool = self.inner.lock();
            pool.outstanding -= n;
            if pool.outstanding == 0 {
                self.idle.notify_all();
            }
        }
    }

    /// Waits until every handed-over file is recycled or deleted; returns
    /// how many spares are ready (tests).
    #[cfg(test)]
    pub(crate) fn wait_idle(&self) -> usize {
        let mut pool = self.inner.lock();
        while pool.outstanding > 0 {
            self.idle.wait(&mut pool);
        }
        pool.ready.len()
    }

    /// Turns `file` (a reclaimed segment, renamed out of the log) into a
    /// spare, or deletes it when the pool is full or zeroing is not
    /// supported.
    fn recycle(&self, file: &Path) {
        let name = {
            let mut pool = self.inner.lock();
            if pool.ready.len() + pool.preparing >= MAX_SPARES {
                None
            } else {
                pool.preparing += 1;
                pool.next += 1;
                Some(self.log_dir.join(format!("{:08}{SUFFIX}", pool.next - 1)))
            }
        };
        let Some(name) = name else {
            return delete(file);
        };
        let zeroed = zero(file, self.size, self.sync).and_then(|()| std::fs::rename(file, &name));
        let mut pool = self.inner.lock();
        pool.preparing -= 1;
        match zeroed {
            Ok(()) => pool.ready.push(name),
            Err(e) => {
                drop(pool);
                tracing::debug!(error = %e, file = %file.display(), "cannot zero a reclaimed segment for reuse; deleting it");
                delete(file);
            }
        }
    }
}

fn delete(file: &Path) {
    if let Err(e) = segment::delete_gradually(file) {
        if e.kind() != std::io::ErrorKind::NotFound {
            tracing::warn!(error = %e, file = %file.display(), "deleting a reclaimed segment failed");
        }
    }
}

/// Zeroes `path` over `size` bytes (extending it to `size`) without freeing
/// its blocks, and makes that durable: a spare must never show old records
/// after a crash.
fn zero(path: &Path, size: u64, sync: bool) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let file = OpenOptions::new().write(true).open(path)?;
    if file.metadata()?.len() > size {
        // From a run with larger segments: nothing past `size` may remain.
        file.set_len(size)?;
    }
    let len =
        libc::off_t::try_from(size).map_err(|_| std::io::Error::other("segment too large"))?;
    // SAFETY: fd is a valid open file for the duration of the call.
    let rc = unsafe { libc::fallocate(file.as_raw_fd(), libc::FALLOC_FL_ZERO_RANGE, 0, len) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    if sync {
        file.sync_all()?;
    }
    Ok(())
}
