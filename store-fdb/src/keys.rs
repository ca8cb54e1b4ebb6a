//! The keyspace, under one root prefix per store (a cluster's namespace:
//! `weir/<name>/`). One byte names each kind of key; numbers are
//! big-endian so keys sort by them.
//!
//! | key | value | written by |
//! |---|---|---|
//! | `I` | next id never leased (LE u64) | id leases (a range per lease), `max` by publishes of chosen ids |
//! | `C` chunk part | ≤ 90 KB of a chunk: many messages of one append | publishes, moves |
//! | `Z` chunk | the chunk's size in bytes | publishes, moves |
//! | `R` chunk | live (message, partition) pairs in it (LE i64, atomic add) | publishes, settles, reclamation |
//! | `Q` chunk | the chunk may have no live message left | settles; reclamation clears it |
//! | `L` partition gen id | a live message: chunk, offset, size, attempts, attributes | publishes, requeues, settles |
//! | `P` partition | its generation (bumped by a drop) and truncation point | drops, truncations |
//! | `D` partition | dead entries of it to reclaim | drops, truncations; reclamation clears it |
//! | `K` partition | it has held messages | publishes |
//! | `O` partition | owner: epoch and node name | acquire |
//! | `V` partition key-hash | receipt expiry (LE u64, atomic max) | receipts |
//! | `G` | metadata version | metadata changes |
//! | `M` key | key version + value | metadata changes |
//! | `F` version | the change (feed), the last [`FEED_KEPT`] kept | metadata changes |
//! | `S` key | state key: version, part count, first part | state puts |
//! | `T` key-length key part | further parts of a large state value | state puts |
//! | `X` node | the ticket of its last commit (commit_unknown_result check) | every append |
//! | `B` node | bytes of chunks it wrote minus those it reclaimed (LE i64) | publishes, reclamation |
//!
//! No key is written per message that writers of other partitions share:
//! `I` is touched once per lease, `G` only by metadata changes, `R`/`Z`
//! per chunk, the rest per partition.

/// Metadata changes kept for the change feed; older watchers reload.
pub const FEED_KEPT: u64 = 4096;

/// Largest value written (FoundationDB's limit is 100 KB).
pub const PART: usize = 90_000;

/// Builds keys under one root.
#[derive(Clone, Debug)]
pub struct Keys {
    root: Vec<u8>,
}

impl Keys {
    /// Keys under `root`.
    pub fn new(root: &[u8]) -> Self {
        Keys {
            root: root.to_vec(),
        }
    }

    /// The root prefix.
    pub fn root(&self) -> &[u8] {
        &self.root
    }

    /// `root tag parts…`.
    pub fn key(&self, tag: u8, parts: &[&[u8]]) -> Vec<u8> {
        let mut k =
            Vec::with_capacity(self.root.len() + 1 + parts.iter().map(|p| p.len()).sum::<usize>());
        k.extend_from_slice(&self.root);
        k.push(tag);
        for p in parts {
            k.extend_from_slice(p);
        }
        k
    }

    /// `root tag n`.
    pub fn num(&self, tag: u8, n: u64) -> Vec<u8> {
        self.key(tag, &[&n.to_be_bytes()])
    }

    /// `root tag a b`.
    pub fn num2(&self, tag: u8, a: u64, b: u64) -> Vec<u8> {
        self.key(tag, &[&a.to_be_bytes(), &b.to_be_bytes()])
    }

    /// A live entry's key.
    pub fn live(&self, partition: u64, gen: u64, id: u64) -> Vec<u8> {
        self.key(
            b'L',
            &[
                &partition.to_be_bytes(),
                &gen.to_be_bytes(),
                &id.to_be_bytes(),
            ],
        )
    }

    /// A chunk part's key.
    pub fn chunk_part(&self, chunk: u64, part: u32) -> Vec<u8> {
        self.key(b'C', &[&chunk.to_be_bytes(), &part.to_be_bytes()])
    }

    /// A further part of a large state value.
    pub fn state_part(&self, key: &[u8], part: u32) -> Vec<u8> {
        self.key(
            b'T',
            &[&(key.len() as u32).to_be_bytes(), key, &part.to_be_bytes()],
        )
    }

    /// The prefix of every further part of a state key.
    pub fn state_parts(&self, key: &[u8]) -> Vec<u8> {
        self.key(b'T', &[&(key.len() as u32).to_be_bytes(), key])
    }

    /// The big-endian u64 at `at` past the root and tag of `key`.
    pub fn field(&self, key: &[u8], at: usize) -> u64 {
        let s = self.root.len() + 1 + at;
        key.get(s..s + 8)
            .map_or(0, |b| u64::from_be_bytes(b.try_into().unwrap_or([0; 8])))
    }
}
