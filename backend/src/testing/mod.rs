//! Test support (cargo feature `testing`): [`MemStore`], an in-memory
//! [`crate::Store`] for in-process engine tests, and [`contract`], the suite
//! every `Store` implementation must pass.

pub mod contract;
pub mod contract_lifecycle;
pub mod contract_v2;
mod mem;

pub use mem::MemStore;

use crate::Location;

/// A position for tests of code that only keeps and compares positions
/// (distinct `n` give distinct positions). No store can read it.
pub fn location(n: u64) -> Location {
    Location::from_words([(n >> 32) as u32, n as u32, u32::MAX])
}
