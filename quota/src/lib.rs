//! Weir's tenant limits and credit (flow-control) primitives.
//!
//! * [`Credit`]: a prefetch window in messages and bytes, shared lock-free
//!   between the tasks that take credit (queues delivering) and the task that
//!   gives it back (the consumer's connection acknowledging).
//!
//! * [`limits`]: a tenant's limits ([`Limits`]) and the counters they are
//!   checked against ([`TenantQuota`]), with the tenant's block signal.
//! * [`rate`]: publish rate limits (messages/s, bytes/s) with `governor`.
//! * [`connections`]: per-connection overrides (`[[quota.connections]]`).

#![forbid(unsafe_code)]

pub mod connections;
pub mod limits;
pub mod rate;

pub use connections::{ConnectionQuotas, ConnectionRule};
pub use limits::{Limits, QuotaError, TenantQuota, UserQuotas};
pub use rate::{Debt, Rate};

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

/// A prefetch window: how many messages and bytes may be delivered and not yet
/// acknowledged. Shared by a consumer (per-consumer qos) or a whole channel
/// (global qos). Updated with atomics because partitions on other tasks
/// acquire it while the owning connection releases it.
#[derive(Default)]
pub struct Credit {
    /// Message limit; 0 = unlimited.
    pub max_count: AtomicU32,
    /// Byte limit; 0 = unlimited.
    pub max_bytes: AtomicU32,
    count: AtomicU32,
    bytes: AtomicU64,
}

impl Credit {
    /// A window with the given limits.
    pub fn new(max_count: u32, max_bytes: u32) -> Arc<Self> {
        let c = Credit::default();
        c.max_count.store(max_count, Ordering::Relaxed);
        c.max_bytes.store(max_bytes, Ordering::Relaxed);
        Arc::new(c)
    }

    /// Takes room for one message of `size` bytes, or returns false when the
    /// window is full. As in RabbitMQ, a byte limit never blocks the first
    /// message in flight.
    pub fn try_acquire(&self, size: u32) -> bool {
        let max_count = self.max_count.load(Ordering::Relaxed);
        let prev = self.count.fetch_add(1, Ordering::AcqRel);
        if max_count != 0 && prev >= max_count {
            self.count.fetch_sub(1, Ordering::AcqRel);
            return false;
        }
        let max_bytes = self.max_bytes.load(Ordering::Relaxed) as u64;
        let prev_bytes = self.bytes.fetch_add(size as u64, Ordering::AcqRel);
        if max_bytes != 0 && prev > 0 && prev_bytes + size as u64 > max_bytes {
            self.bytes.fetch_sub(size as u64, Ordering::AcqRel);
            self.count.fetch_sub(1, Ordering::AcqRel);
            return false;
        }
        true
    }

    /// Returns room for one message of `size` bytes.
    pub fn release(&self, size: u32) {
        let prev = self.count.fetch_sub(1, Ordering::AcqRel);
        debug_assert!(prev > 0, "credit released more than acquired");
        self.bytes.fetch_sub(size as u64, Ordering::AcqRel);
    }

    /// Messages in flight.
    pub fn in_flight(&self) -> u32 {
        self.count.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn count_limit() {
        let c = Credit::new(2, 0);
        assert!(c.try_acquire(10));
        assert!(c.try_acquire(10));
        assert!(!c.try_acquire(10));
        c.release(10);
        assert!(c.try_acquire(10));
        assert_eq!(c.in_flight(), 2);
    }

    #[test]
    fn byte_limit_never_blocks_the_first_message() {
        let c = Credit::new(0, 100);
        assert!(
            c.try_acquire(500),
            "first message goes through whatever its size"
        );
        assert!(!c.try_acquire(1));
        c.release(500);
        assert!(c.try_acquire(60));
        assert!(c.try_acquire(40));
        assert!(!c.try_acquire(1));
    }

    #[test]
    fn unlimited() {
        let c = Credit::new(0, 0);
        for _ in 0..10_000 {
            assert!(c.try_acquire(1 << 20));
        }
    }
}
