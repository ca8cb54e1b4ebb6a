//! Receipts files: `<dir>/receipts/NNNNNNNN.rcp`.
//!
//! An idempotency receipt ([`crate::Op::Receipt`]) is written into the log
//! next to its message and must outlive the message (a duplicate published
//! after the original was consumed is still dropped), so a receipt pins its
//! segment until it expires. To reclaim a segment whose messages are all
//! settled but whose receipts still have long to live, compaction copies
//! those receipts into a receipts file first. A receipts file is written
//! once and never changed; it is deleted whole once its last receipt has
//! expired. So a receipt is copied at most once, and what a busy log keeps
//! for its receipts is about 24 bytes per receipt, not the segments they
//! were written in.
//!
//! Format (little-endian):
//!
//! ```text
//! "WEIRRCP1" | until u64 | count u64 |
//! count × (partition u64, key_hash u64, expires_at_ms u64) | crc32c u32 over everything before
//! ```
//!
//! `until` is the latest expiry in the file. Written atomically: tmp file,
//! fsync, rename, fsync directory. A file that fails its checksum (it was
//! damaged after it was written) is renamed to `*.rcp.damaged` and ignored
//! with an error in the log: losing receipts can only let a duplicate in,
//! never lose a message.

use crate::{PartitionId, StoreError};
use std::io::Write;
use std::path::{Path, PathBuf};

const MAGIC: &[u8; 8] = b"WEIRRCP1";
const SUFFIX: &str = ".rcp";
/// The directory under the store's directory.
pub(crate) const DIR: &str = "receipts";
/// Bytes per receipt in a file.
const ENTRY: usize = 24;

/// One receipt: (partition, key hash, expiry).
pub(crate) type Entry = (PartitionId, u64, u64);

/// A receipts file on disk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ReceiptFile {
    /// Its number (the file name).
    pub seq: u64,
    /// The latest expiry in it: it is deleted once this has passed.
    pub until: u64,
}

/// `<dir>/receipts/00000001.rcp`.
pub(crate) fn path(dir: &Path, seq: u64) -> PathBuf {
    dir.join(DIR).join(format!("{seq:08}{SUFFIX}"))
}

/// Encodes a file holding `entries`.
pub(crate) fn encode(entries: &[Entry]) -> Vec<u8> {
    let until = entries.iter().map(|e| e.2).max().unwrap_or(0);
    let mut buf = Vec::with_capacity(8 + 16 + ENTRY * entries.len() + 4);
    buf.extend_from_slice(MAGIC);
    buf.extend_from_slice(&until.to_le_bytes());
    buf.extend_from_slice(&(entries.len() as u64).to_le_bytes());
    for (p, h, e) in entries {
        buf.extend_from_slice(&p.0.to_le_bytes());
        buf.extend_from_slice(&h.to_le_bytes());
        buf.extend_from_slice(&e.to_le_bytes());
    }
    let crc = crc32c::crc32c(&buf);
    buf.extend_from_slice(&crc.to_le_bytes());
    buf
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

/// Decodes a file: its `until` and its entries.
pub(crate) fn decode(buf: &[u8]) -> Result<(u64, Vec<Entry>), String> {
    if buf.len() < 8 + 16 + 4 || &buf[..8] != MAGIC {
        return Err("bad magic or too short".into());
    }
    let (body, crc) = buf.split_at(buf.len() - 4);
    let stored = u32::from_le_bytes([crc[0], crc[1], crc[2], crc[3]]);
    if crc32c::crc32c(body) != stored {
        return Err("checksum mismatch".into());
    }
    let until = u64_at(body, 8);
    let count = u64_at(body, 16);
    let rest = &body[24..];
    if count.checked_mul(ENTRY as u64) != Some(rest.len() as u64) {
        return Err(format!(
            "{count} receipts announced, {} bytes present",
            rest.len()
        ));
    }
    let entries = rest
        .chunks_exact(ENTRY)
        .map(|c| (PartitionId(u64_at(c, 0)), u64_at(c, 8), u64_at(c, 16)))
        .collect();
    Ok((until, entries))
}

/// What [`load`] found.
pub(crate) struct Loaded {
    /// The files kept (not yet expired), by number.
    pub files: Vec<ReceiptFile>,
    /// Their receipts not yet expired at `now`.
    pub entries: Vec<Entry>,
    /// The number for the next file.
    pub next_seq: u64,
}

/// Reads every receipts file under `dir`, deleting those expired at `now`
/// and setting damaged ones aside. Creates the directory if needed.
pub(crate) fn load(dir: &Path, now: u64, sync: bool) -> Result<Loaded, StoreError> {
    let rdir = dir.join(DIR);
    std::fs::create_dir_all(&rdir)
        .map_err(|e| StoreError::io(format!("creating {}", rdir.display()), e))?;
    let mut out = Loaded {
        files: Vec::new(),
        entries: Vec::new(),
        next_seq: 1,
    };
    let rd = std::fs::read_dir(&rdir)
        .map_err(|e| StoreError::io(format!("listing {}", rdir.display()), e))?;
    let mut changed = false;
    for entry in rd {
        let entry = entry.map_err(|e| StoreError::io(format!("listing {}", rdir.display()), e))?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        let file = entry.path();
        if name.ends_with(".tmp") {
            // An interrupted write: never renamed, so never relied on (its
            // segments were not deleted).
            let _ = std::fs::remove_file(&file);
            changed = true;
            continue;
        }
        let Some(seq) = name
            .strip_suffix(SUFFIX)
            .filter(|s| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|s| s.parse::<u64>().ok())
        else {
            continue;
        };
        out.next_seq = out.next_seq.max(seq + 1);
        let buf = std::fs::read(&file)
            .map_err(|e| StoreError::io(format!("reading {}", file.display()), e))?;
        match decode(&buf) {
            Ok((until, _)) if until <= now => {
                std::fs::remove_file(&file)
                    .map_err(|e| StoreError::io(format!("removing {}", file.display()), e))?;
                changed = true;
            }
            Ok((until, entries)) => {
                out.files.push(ReceiptFile { seq, until });
                out.entries
                    .extend(entries.into_iter().filter(|e| e.2 > now));
            }
            Err(reason) => {
                let aside = file.with_extension("rcp.damaged");
                tracing::error!(
                    file = %file.display(),
                    %reason,
                    "damaged idempotency receipts file set aside: duplicates of the messages it covered may be accepted until their windows end"
                );
                std::fs::rename(&file, &aside)
                    .map_err(|e| StoreError::io(format!("renaming {}", file.display()), e))?;
                changed = true;
            }
        }
    }
    if changed && sync {
        super::segment::sync_dir(&rdir)?;
    }
    out.files.sort_by_key(|f| f.seq);
    Ok(out)
}

/// Writes a new receipts file numbered `seq` durably (when `sync`).
pub(crate) fn write(
    dir: &Path,
    seq: u64,
    entries: &[Entry],
    sync: bool,
) -> Result<ReceiptFile, StoreError> {
    let target = path(dir, seq);
    let tmp = target.with_extension("tmp");
    let encoded = encode(entries);
    let res = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(&encoded)?;
        if sync {
            f.sync_all()?;
        }
        drop(f);
        std::fs::rename(&tmp, &target)
    })();
    if let Err(e) = res {
        let _ = std::fs::remove_file(&tmp);
        return Err(StoreError::io(format!("writing {}", target.display()), e));
    }
    if sync {
        super::segment::sync_dir(&dir.join(DIR))?;
    }
    Ok(ReceiptFile {
        seq,
        until: entries.iter().map(|e| e.2).max().unwrap_or(0),
    })
}

/// Deletes the files whose receipts have all expired at `now`; keeps the
/// others (and those it could not delete) in `files`.
pub(crate) fn remove_expired(dir: &Path, files: &mut Vec<ReceiptFile>, now: u64) {
    files.retain(|f| {
        if f.until > now {
            return true;
        }
        match std::fs::remove_file(path(dir, f.seq)) {
            Ok(()) => false,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => false,
            Err(e) => {
                tracing::warn!(error = %e, file = f.seq, "deleting an expired receipts file failed");
                true
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip_corruption_and_expiry() {
        let dir = tempfile::tempdir().unwrap();
        let entries = vec![(PartitionId(1), 7, 1_000), (PartitionId(2), 8, 3_000)];
        let enc = encode(&entries);
        assert_eq!(decode(&enc).unwrap(), (3_000, entries.clone()));
        for i in 0..enc.len() {
            let mut bad = enc.clone();
            bad[i] ^= 1;
            assert!(decode(&bad).is_err(), "flip {i}");
        }
        for cut in 0..enc.len() {
            assert!(decode(&enc[..cut]).is_err(), "cut {cut}");
        }

        std::fs::create_dir_all(dir.path().join(DIR)).unwrap();
        let a = write(dir.path(), 1, &entries, true).unwrap();
        assert_eq!(
            a,
            ReceiptFile {
                seq: 1,
                until: 3_000
            }
        );
        write(dir.path(), 4, &[(PartitionId(3), 9, 500)], true).unwrap();
        // A damaged file is set aside, a leftover tmp removed.
        std::fs::write(path(dir.path(), 2), b"WEIRRCP1 but not really").unwrap();
        std::fs::write(dir.path().join(DIR).join("00000005.tmp"), b"x").unwrap();

        let l = load(dir.path(), 2_000, true).unwrap();
        assert_eq!(
            l.files,
            vec![ReceiptFile {
                seq: 1,
                until: 3_000
            }]
        );
        assert_eq!(l.entries, vec![(PartitionId(2), 8, 3_000)]);
        assert_eq!(l.next_seq, 5);
        assert!(!path(dir.path(), 4).exists(), "expired file deleted");
        assert!(dir.path().join(DIR).join("00000002.rcp.damaged").exists());
        assert!(!dir.path().join(DIR).join("00000005.tmp").exists());

        let mut files = l.files;
        remove_expired(dir.path(), &mut files, 2_999);
        assert_eq!(files.len(), 1);
        remove_expired(dir.path(), &mut files, 3_000);
        assert!(files.is_empty());
        assert!(!path(dir.path(), 1).exists());
    }
}
