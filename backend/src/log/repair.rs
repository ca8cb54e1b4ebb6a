//! `weir repair`: moves damaged byte ranges of the log into `quarantine/` and
//! keeps every valid record before and after them.
//!
//! Records are found by scanning, never by stored offset (settles name
//! (partition, id), checkpoints hold no locations), so cutting a range out of
//! a segment and shifting what follows is safe.

use super::scan::{self, Item};
use super::segment::{self, sync_dir};
use super::Damage;
use crate::lock::DirLock;
use crate::StoreError;
use std::io::Write;
use std::path::{Path, PathBuf};

/// Directory (inside the data directory) receiving the damaged bytes.
pub const QUARANTINE_DIR: &str = "quarantine";

/// What [`repair`] found and did.
#[derive(Debug, Default)]
pub struct RepairReport {
    /// Every damaged range, in log order. Empty when the log was intact.
    pub damages: Vec<Damage>,
    /// The quarantine file of each damage, in the same order.
    pub quarantined: Vec<PathBuf>,
}

impl RepairReport {
    /// Ids of the messages whose records were in a damaged range (as far as
    /// their headers were readable).
    pub fn lost_message_ids(&self) -> Vec<crate::MessageId> {
        self.damages
            .iter()
            .flat_map(|d| scan::lost_message_ids(&d.lost))
            .collect()
    }
}

/// Repairs the store in `dir` (which no process may have open: the directory
/// lock is taken). Torn tails are left to the next open, which truncates them
/// as usual.
pub fn repair(dir: &Path) -> Result<RepairReport, StoreError> {
    let _lock = DirLock::acquire(dir)?;
    let log_dir = dir.join("log");
    let ids = segment::list_segments(&log_dir)?;
    let mut report = RepairReport::default();
    for (i, &seg) in ids.iter().enumerate() {
        let head = i + 1 == ids.len();
        let path = segment::segment_path(&log_dir, seg);
        let buf = std::fs::read(&path)
            .map_err(|e| StoreError::io(format!("reading {}", path.display()), e))?;
        match segment::check_header(&buf) {
            segment::HeaderCheck::Valid => {}
            // Left to the next open, which rewrites it (nothing in it was durable).
            segment::HeaderCheck::Torn if head => continue,
            // Repair cuts damaged records, never a header: a segment in
            // another format or without a valid header is not repaired.
            check => return Err(super::recovery::format_error(dir, &path, seg, check)),
        }
        let recorded_end = segment::recorded_end(&buf);
        let mut keep: Vec<u8> = buf[..segment::HEADER_LEN].to_vec();
        let mut damaged = false;
        // Bytes cut below the recorded end: it moves down by as much.
        let mut cut_below_end = 0u64;
        let mut missing_reported = false;
        let mut off = segment::HEADER_LEN;
        while off < buf.len() {
            match scan::next_item(&buf, off, head, recorded_end) {
                Item::Record { len } => {
                    keep.extend_from_slice(&buf[off..off + len]);
                    off += len;
                }
                Item::Damaged { end } => {
                    let mut d = super::recovery::damage_info(&path, seg, &buf, off, end);
                    if super::recovery::extend_to_recorded_end(&mut d, buf.len(), recorded_end) {
                        // The missing bytes are part of this damage.
                        missing_reported = true;
                    }
                    let (from, to) = (off as u64, off as u64 + d.len);
                    cut_below_end += to.min(recorded_end) - from.min(recorded_end);
                    note(dir, &mut report, d, &buf[off..end])?;
                    damaged = true;
                    off = end;
                }
                Item::TornTail | Item::CleanEnd => {
                    keep.extend_from_slice(&buf[off..]);
                    off = buf.len();
                    break;
                }
            }
        }
        let missing = super::recovery::missing_tail(&path, seg, off, recorded_end);
        if let Some(d) = missing.filter(|_| !missing_reported) {
            // Nothing left to quarantine: the record of the loss is the report.
            cut_below_end += d.len;
            note(dir, &mut report, d, &[])?;
            damaged = true;
        }
        if damaged {
            if recorded_end != 0 {
                segment::set_recorded_end(&mut keep, recorded_end - cut_below_end);
            }
            replace_file(&log_dir, &path, &keep)?;
        }
    }
    Ok(report)
}

/// Quarantines the damaged `bytes` and adds `d` to the report.
fn note(dir: &Path, report: &mut RepairReport, d: Damage, bytes: &[u8]) -> Result<(), StoreError> {
    let qfile = quarantine(dir, d.segment, d.offset as usize, bytes)?;
    tracing::warn!(damage = %d, quarantine = %qfile.display(), "quarantined");
    report.damages.push(d);
    report.quarantined.push(qfile);
    Ok(())
}

/// Copies a damaged range into `quarantine/<segment>-<offset>-<len>.bin`,
/// durably, before anything is cut.
fn quarantine(dir: &Path, seg: u32, off: usize, bytes: &[u8]) -> Result<PathBuf, StoreError> {
    let qdir = dir.join(QUARANTINE_DIR);
    std::fs::create_dir_all(&qdir)
        .map_err(|e| StoreError::io(format!("creating {}", qdir.display()), e))?;
    // Never overwrite an earlier quarantine (a later repair can find damage
    // at the same offset once the first range was cut out).
    let mut path = qdir.join(format!("{seg:08}-{off}-{}.bin", bytes.len()));
    let mut n = 1;
    while path.exists() {
        path = qdir.join(format!("{seg:08}-{off}-{}.{n}.bin", bytes.len()));
        n += 1;
    }
    write_durably(&path, bytes)?;
    sync_dir(&qdir)?;
    sync_dir(dir)?;
    Ok(path)
}

fn write_durably(path: &Path, bytes: &[u8]) -> Result<(), StoreError> {
    let mut f = std::fs::File::create(path)
        .map_err(|e| StoreError::io(format!("creating {}", path.display()), e))?;
    f.write_all(bytes)
        .and_then(|()| f.sync_all())
        .map_err(|e| StoreError::io(format!("writing {}", path.display()), e))
}

/// Atomically replaces a segment file: tmp file, fsync, rename, fsync dir.
fn replace_file(log_dir: &Path, path: &Path, bytes: &[u8]) -> Result<(), StoreError> {
    let tmp = path.with_extension("repair");
    write_durably(&tmp, bytes)?;
    std::fs::rename(&tmp, path)
        .map_err(|e| StoreError::io(format!("renaming {}", tmp.display()), e))?;
    sync_dir(log_dir)
}
