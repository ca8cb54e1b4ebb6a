//! Weir's storage layer: the persisted types, the [`Store`] trait, and its
//! implementations.
//!
//! The store never sees a wire protocol. A message is opaque bytes (`header`,
//! `body`) plus the few attributes the engine needs without reading the body
//! back (size, priority, expiry). Metadata (exchanges, queues, bindings) is an
//! opaque, versioned key/value map that the engine encodes.
//!
//! * [`log`]: the embedded, segmented, group-committed log store (default).

pub mod lock;
pub mod log;
mod types;

pub use types::*;

/// Called once when everything appended before (and with) it is durable, or
/// when the store failed to make it durable.
pub type Waiter = Box<dyn FnOnce(Result<(), StoreError>) + Send + 'static>;

/// A durable message store.
///
/// Shaped so that an implementation over a transactional key/value store
/// (FoundationDB) fits as well as the embedded log: appends are batched and
/// return a position per published message synchronously; durability is
/// reported asynchronously through a [`Waiter`]; reads are by position;
/// metadata is a versioned key/value map.
pub trait Store: Send + Sync + 'static {
    /// Allocates `n` consecutive message ids and returns the first. Ids are
    /// unique for the life of the store (they survive restarts) and increase
    /// in allocation order.
    fn allocate_ids(&self, n: u64) -> MessageId;

    /// Appends `ops` in order. For every [`Op::Publish`] and [`Op::Relocate`]
    /// one [`Location`] is pushed onto `locations`, in order. When `waiter` is
    /// given it is called once all of `ops` (and everything appended before
    /// them) is durable: fsynced on the embedded store.
    ///
    /// Appends from different callers are ordered: if `append` A returns
    /// before `append` B starts, A's records precede B's in the store.
    ///
    /// While the disk is full, batches holding a publish, relocate or page
    /// fail with [`StoreError::NoSpace`] (nothing of them is appended);
    /// settles and metadata are still accepted. A waiter may be called with
    /// an error without the store failing for good (a write that ran out of
    /// space): its appends were not made durable yet.
    fn append(
        &self,
        ops: &[Op<'_>],
        locations: &mut Vec<Location>,
        waiter: Option<Waiter>,
    ) -> Result<(), StoreError>;

    /// Reads back a published message.
    fn read(&self, location: Location) -> Result<StoredMessage, StoreError>;

    /// The state found when the store was opened: metadata and every live
    /// message per partition. Called once, before the first append; the
    /// embedded store computes it during `open`.
    fn take_recovered(&self) -> Recovered;

    /// Sealed segments whose live data is sparse enough that the engine should
    /// relocate their survivors ([`Op::Relocate`]) so the segment can be
    /// reclaimed. Empty when there is nothing worth compacting.
    fn compaction_candidates(&self) -> Vec<SegmentId>;

    /// Counters for metrics and benchmarks.
    fn stats(&self) -> StoreStats;

    /// Makes everything appended so far durable and stops background work.
    /// Further appends fail with [`StoreError::Closed`].
    fn close(&self) -> Result<(), StoreError>;
}

/// Bytes available to an unprivileged user on the filesystem holding `path`
/// (`statvfs`: `f_bavail × f_frsize`). For disk watermarks.
pub fn free_bytes(path: &std::path::Path) -> std::io::Result<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    // SAFETY: statvfs is plain old data; zeroed is a valid value.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: c is a valid NUL-terminated path and st a valid out pointer.
    let rc = unsafe { libc::statvfs(c.as_ptr(), &mut st) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    #[allow(clippy::unnecessary_cast)] // the field types differ between targets
    Ok((st.f_bavail as u64).saturating_mul(st.f_frsize as u64))
}
