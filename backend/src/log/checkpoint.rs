//! The metadata checkpoint: `<dir>/meta.checkpoint`.
//!
//! Holds the whole metadata map, its version and the next message id, and the
//! whole state store with its sequence number, so that segments holding old
//! metadata or state records (and the highest ids) can be deleted and
//! restart does not need the full history.
//!
//! Format (little-endian):
//!
//! ```text
//! "WEIRCKP2" | version u64 | next_id u64 | count u64 |
//! count × ([u32 klen][key][u32 vlen][value]) |
//! state_seq u64 | state_count u64 |
//! state_count × ([u32 klen][key][version u64][u32 vlen][value]) |
//! crc32c u32 over everything before
//! ```
//!
//! A `WEIRCKP1` file (before the state store) is the same without the state
//! part, and is still read.
//!
//! Written atomically: tmp file, fsync, rename, fsync directory.

use crate::StoreError;
use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;

const MAGIC: &[u8; 8] = b"WEIRCKP2";
/// The format before the state store: no state part.
const MAGIC_V1: &[u8; 8] = b"WEIRCKP1";
const FILE: &str = "meta.checkpoint";
const TMP: &str = "meta.checkpoint.tmp";

/// The content of a checkpoint.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct Checkpoint {
    /// Metadata version covered: records with a version at or below it are
    /// already in `meta`.
    pub version: u64,
    /// Every id below this was (possibly) allocated.
    pub next_id: u64,
    /// The metadata map.
    pub meta: BTreeMap<Vec<u8>, Vec<u8>>,
    /// State sequence covered: state records at or below it are in `state`.
    pub state_seq: u64,
    /// The state store: per key, its version and value.
    pub state: BTreeMap<Vec<u8>, (u64, Vec<u8>)>,
}

fn corrupt(reason: impl Into<String>) -> StoreError {
    // Segment 0 never exists; the checkpoint is reported there.
    super::error::corrupt(0, 0, format!("meta.checkpoint: {}", reason.into()))
}

/// Encodes a checkpoint.
pub(crate) fn encode<'a>(
    version: u64,
    next_id: u64,
    meta: impl Iterator<Item = (&'a [u8], &'a [u8])> + Clone,
    state_seq: u64,
    state: &BTreeMap<Vec<u8>, (u64, Vec<u8>)>,
) -> Vec<u8> {
    let (count, meta_size) = meta.clone().fold((0u64, 0usize), |(n, b), (k, v)| {
        (n + 1, b + 8 + k.len() + v.len())
    });
    let size: usize = meta_size
        + state
            .iter()
            .map(|(k, (_, v))| 16 + k.len() + v.len())
            .sum::<usize>();
    let mut buf = Vec::with_capacity(8 + 40 + size + 4);
    buf.extend_from_slice(MAGIC);
    buf.extend_from_slice(&version.to_le_bytes());
    buf.extend_from_slice(&next_id.to_le_bytes());
    buf.extend_from_slice(&count.to_le_bytes());
    for (k, v) in meta {
        buf.extend_from_slice(&(k.len() as u32).to_le_bytes());
        buf.extend_from_slice(k);
        buf.extend_from_slice(&(v.len() as u32).to_le_bytes());
        buf.extend_from_slice(v);
    }
    buf.extend_from_slice(&state_seq.to_le_bytes());
    buf.extend_from_slice(&(state.len() as u64).to_le_bytes());
    for (k, (version, v)) in state {
        buf.extend_from_slice(&(k.len() as u32).to_le_bytes());
        buf.extend_from_slice(k);
        buf.extend_from_slice(&version.to_le_bytes());
        buf.extend_from_slice(&(v.len() as u32).to_le_bytes());
        buf.extend_from_slice(v);
    }
    let crc = crc32c::crc32c(&buf);
    buf.extend_from_slice(&crc.to_le_bytes());
    buf
}

/// Decodes a checkpoint, verifying magic and checksum.
pub(crate) fn decode(buf: &[u8]) -> Result<Checkpoint, StoreError> {
    if buf.len() < MAGIC.len() + 24 + 4 || (&buf[..8] != MAGIC && &buf[..8] != MAGIC_V1) {
        return Err(corrupt("bad magic or too short"));
    }
    let with_state = &buf[..8] == MAGIC;
    let (body, crc) = buf.split_at(buf.len() - 4);
    let stored = u32::from_le_bytes([crc[0], crc[1], crc[2], crc[3]]);
    if crc32c::crc32c(body) != stored {
        return Err(corrupt("checksum mismatch"));
    }
    let mut pos = 8usize;
    let mut take = |n: usize| -> Result<&[u8], StoreError> {
        let end = pos.checked_add(n).filter(|&e| e <= body.len());
        let end = end.ok_or_else(|| corrupt("truncated"))?;
        let s = &body[pos..end];
        pos = end;
        Ok(s)
    };
    let u64_of = |b: &[u8]| {
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        u64::from_le_bytes(a)
    };
    let u32_of = |b: &[u8]| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize;
    let version = u64_of(take(8)?);
    let next_id = u64_of(take(8)?);
    let count = u64_of(take(8)?);
    let mut meta = BTreeMap::new();
    for _ in 0..count {
        let kl = u32_of(take(4)?);
        let k = take(kl)?.to_vec();
        let vl = u32_of(take(4)?);
        let v = take(vl)?.to_vec();
        meta.insert(k, v);
    }
    let (mut state_seq, mut state) = (0, BTreeMap::new());
    if with_state {
        state_seq = u64_of(take(8)?);
        let count = u64_of(take(8)?);
        for _ in 0..count {
            let kl = u32_of(take(4)?);
            let k = take(kl)?.to_vec();
            let version = u64_of(take(8)?);
            let vl = u32_of(take(4)?);
            let v = take(vl)?.to_vec();
            state.insert(k, (version, v));
        }
    }
    if pos != body.len() {
        return Err(corrupt("trailing bytes"));
    }
    Ok(Checkpoint {
        version,
        next_id,
        meta,
        state_seq,
        state,
    })
}

/// Loads `<dir>/meta.checkpoint`, or an empty checkpoint if there is none.
pub(crate) fn load(dir: &Path) -> Result<Checkpoint, StoreError> {
    // A leftover tmp file is an interrupted write: the rename never happened,
    // so the previous checkpoint (if any) is still the valid one.
    let _ = std::fs::remove_file(dir.join(TMP));
    match std::fs::read(dir.join(FILE)) {
        Ok(buf) => decode(&buf),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Checkpoint::default()),
        Err(e) => Err(StoreError::io("reading meta.checkpoint", e)),
    }
}

/// Atomically replaces `<dir>/meta.checkpoint`.
pub(crate) fn store(dir: &Path, encoded: &[u8], sync: bool) -> Result<(), StoreError> {
    let tmp = dir.join(TMP);
    let mut f = std::fs::File::create(&tmp)
        .map_err(|e| StoreError::io("creating meta.checkpoint.tmp", e))?;
    f.write_all(encoded)
        .map_err(|e| StoreError::io("writing meta.checkpoint.tmp", e))?;
    if sync {
        f.sync_all()
            .map_err(|e| StoreError::io("fsync meta.checkpoint.tmp", e))?;
    }
    drop(f);
    std::fs::rename(&tmp, dir.join(FILE))
        .map_err(|e| StoreError::io("renaming meta.checkpoint", e))?;
    if sync {
        super::segment::sync_dir(dir)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip_and_corruption() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(load(dir.path()).unwrap(), Checkpoint::default());
        let mut meta = BTreeMap::new();
        meta.insert(b"a".to_vec(), b"1".to_vec());
        meta.insert(b"bb".to_vec(), Vec::new());
        let mut state = BTreeMap::new();
        state.insert(b"s1".to_vec(), (3, b"x".to_vec()));
        state.insert(b"s2".to_vec(), (1, Vec::new()));
        let enc = encode(
            9,
            1234,
            meta.iter().map(|(k, v)| (&k[..], &v[..])),
            17,
            &state,
        );
        store(dir.path(), &enc, true).unwrap();
        let c = load(dir.path()).unwrap();
        assert_eq!(
            c,
            Checkpoint {
                version: 9,
                next_id: 1234,
                meta: meta.clone(),
                state_seq: 17,
                state,
            }
        );
        // A checkpoint from before the state store still reads.
        let mut v1 = Vec::new();
        v1.extend_from_slice(MAGIC_V1);
        v1.extend_from_slice(&9u64.to_le_bytes());
        v1.extend_from_slice(&1234u64.to_le_bytes());
        v1.extend_from_slice(&2u64.to_le_bytes());
        for (k, v) in &meta {
            v1.extend_from_slice(&(k.len() as u32).to_le_bytes());
            v1.extend_from_slice(k);
            v1.extend_from_slice(&(v.len() as u32).to_le_bytes());
            v1.extend_from_slice(v);
        }
        let crc = crc32c::crc32c(&v1);
        v1.extend_from_slice(&crc.to_le_bytes());
        assert_eq!(
            decode(&v1).unwrap(),
            Checkpoint {
                version: 9,
                next_id: 1234,
                meta,
                ..Checkpoint::default()
            }
        );
        for i in 0..enc.len() {
            let mut bad = enc.clone();
            bad[i] ^= 1;
            assert!(decode(&bad).is_err());
        }
        for cut in 0..enc.len() {
            assert!(decode(&enc[..cut]).is_err());
        }
    }
}
