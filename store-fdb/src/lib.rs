//! Weir's FoundationDB store: the [`weir_backend::Store`] contract v2 over
//! a small transactional key/value seam ([`kv::Kv`]), so that several
//! stateless gateways can share one replicated store.
//!
//! * [`kv`]: the seam (transactions, range reads, atomic add/max, watches);
//! * [`MemKv`]: the seam in memory, with optimistic conflicts, for tests;
//! * `FdbKv` (cargo feature `fdb`): the seam over a FoundationDB cluster;
//! * [`FdbStore`]: the store over any seam (keyspace in [`keys`]).
//!
//! The default build does not link `libfdb_c`: without the `fdb` feature
//! only the in-memory seam exists, and the contract suite runs over it.

mod codec;
#[cfg(feature = "fdb")]
mod fdb_kv;
pub mod keys;
pub mod kv;
mod mem_kv;
mod reader;
mod store;

#[cfg(feature = "fdb")]
pub use fdb_kv::FdbKv;
pub use mem_kv::MemKv;
pub use store::{FdbStore, FdbStoreConfig, MAX_TXN_BYTES};

/// Opens the store on the FoundationDB cluster named by `cluster_file`
/// (cargo feature `fdb`).
#[cfg(feature = "fdb")]
pub fn open_cluster(
    cluster_file: &str,
    config: FdbStoreConfig,
) -> Result<std::sync::Arc<FdbStore>, weir_backend::StoreError> {
    let kv =
        FdbKv::open(cluster_file).map_err(|e| weir_backend::StoreError::Backend(Box::new(e)))?;
    FdbStore::open(std::sync::Arc::new(kv), config)
}
