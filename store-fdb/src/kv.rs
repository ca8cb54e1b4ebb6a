//! The small transactional key/value seam the store is written against.
//!
//! FoundationDB's model, reduced to what the store uses: serializable
//! transactions with reads, range reads, writes, clears, two atomic
//! mutations (add, max) that never conflict, and watches. Two
//! implementations: [`crate::MemKv`] (in memory, for tests without a
//! cluster) and `FdbKv` (cargo feature `fdb`). The store's logic is the same
//! over both, so the contract suite over `MemKv` checks it everywhere and
//! the same suite over `FdbKv` checks it against a real cluster.

/// What went wrong in a transaction, in the kinds the store acts on.
#[derive(Debug, thiserror::Error)]
#[error("{kind:?}: {message}")]
pub struct KvError {
    /// How to react.
    pub kind: KvErrorKind,
    /// The backend's text.
    pub message: String,
}

/// How the store reacts to a [`KvError`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvErrorKind {
    /// Nothing was committed; run the transaction again (a conflict, a
    /// recovery of the cluster, a too-old read version).
    Retryable,
    /// The commit may or may not have been applied
    /// (`commit_unknown_result`): check before running it again.
    MaybeCommitted,
    /// Anything else: give up.
    Fatal,
}

impl KvError {
    /// A retryable failure (a conflict).
    pub fn retryable(message: impl Into<String>) -> Self {
        KvError {
            kind: KvErrorKind::Retryable,
            message: message.into(),
        }
    }

    /// A failure not worth retrying.
    pub fn fatal(message: impl Into<String>) -> Self {
        KvError {
            kind: KvErrorKind::Fatal,
            message: message.into(),
        }
    }
}

/// Key/value pairs, in key order.
pub type Pairs = Vec<(Vec<u8>, Vec<u8>)>;

/// Called once when a watched key changes.
pub type KvWake = Box<dyn FnOnce() + Send + 'static>;

/// A transactional key/value store.
pub trait Kv: Send + Sync + 'static {
    /// Starts a transaction.
    fn begin(&self) -> Result<Box<dyn KvTxn>, KvError>;

    /// Starts a transaction that may read at a recent version this
    /// handle already saw (its own commits and reads included) instead of
    /// asking the cluster for a new one: for keys that never change once
    /// written (chunks), read right after what named them. The default is
    /// [`Kv::begin`].
    fn begin_recent(&self) -> Result<Box<dyn KvTxn>, KvError> {
        self.begin()
    }
}

/// One transaction: reads see its own writes; [`KvTxn::commit`] applies all
/// of its writes or none, and fails ([`KvErrorKind::Retryable`]) when a
/// key or range it read was written by another transaction meanwhile.
pub trait KvTxn: Send {
    /// The value of `key`.
    fn get(&mut self, key: &[u8]) -> Result<Option<Vec<u8>>, KvError>;

    /// The values of `keys`, in order (a backend may read them concurrently).
    fn get_many(&mut self, keys: &[Vec<u8>]) -> Result<Vec<Option<Vec<u8>>>, KvError> {
        keys.iter().map(|k| self.get(k)).collect()
    }

    /// Up to `limit` pairs with `begin <= key < end`, in key order.
    fn range(&mut self, begin: &[u8], end: &[u8], limit: usize) -> Result<Pairs, KvError>;

    /// Sets `key` to `value`.
    fn set(&mut self, key: &[u8], value: &[u8]);

    /// Removes `key`.
    fn clear(&mut self, key: &[u8]);

    /// Removes every key in `begin..end`.
    fn clear_range(&mut self, begin: &[u8], end: &[u8]);

    /// Adds `delta` to the little-endian 64-bit integer at `key` (absent:
    /// 0) without reading it: concurrent adds never conflict.
    fn add(&mut self, key: &[u8], delta: i64);

    /// Sets the little-endian 64-bit unsigned integer at `key` to the
    /// larger of it and `value`, without reading it.
    fn max(&mut self, key: &[u8], value: u64);

    /// Calls `wake` once `key` changes after this transaction's reads
    /// (armed when the transaction commits).
    fn watch(&mut self, key: &[u8], wake: KvWake) -> Result<(), KvError>;

    /// Commits.
    fn commit(self: Box<Self>) -> Result<(), KvError>;
}

/// The first key after every key that starts with `prefix`.
pub fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0xff]
}

/// Decodes a little-endian 64-bit integer as [`KvTxn::add`] and
/// [`KvTxn::max`] write it (shorter values are zero-extended).
pub fn le_u64(value: &[u8]) -> u64 {
    let mut b = [0u8; 8];
    let n = value.len().min(8);
    b[..n].copy_from_slice(&value[..n]);
    u64::from_le_bytes(b)
}
