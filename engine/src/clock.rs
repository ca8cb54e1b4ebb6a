//! Time as an input: the engine's one source of "now".
//!
//! Every deadline the engine computes (message TTL, `x-expires`, delayed
//! delivery and retries, idempotency windows, retained-message expiry,
//! dead-letter timestamps, oldest-message ages) starts from the [`Clock`]
//! given to [`crate::Engine::open`]. The broker passes [`SystemClock`];
//! tests pass a [`ManualClock`] and move time with
//! [`ManualClock::advance`], so expiry and windows are tested without
//! sleeping. Nothing else in the engine reads the clock: a test over the
//! sources (`engine/tests/no_clock_reads.rs`) fails on any read outside
//! this file.
//!
//! A clock has two faces: wall time in milliseconds since the Unix epoch
//! (deadlines that are stored or shown, such as a message's expiry) and a
//! monotonic [`Instant`] (lease ages, measured within one process). Reads
//! are cheap (one virtual call over `Arc<dyn Clock>`), and the hot paths
//! read once per batch where they always did.

use std::fmt::Debug;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// The source of time the engine computes every deadline from.
pub trait Clock: Send + Sync + Debug + 'static {
    /// Wall time: milliseconds since the Unix epoch.
    fn now_ms(&self) -> u64;
    /// Monotonic time, for durations measured within this process.
    fn now(&self) -> Instant;
}

/// A shared clock, as the engine holds it.
pub type SharedClock = Arc<dyn Clock>;

/// The operating system's clocks: what the broker runs on.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl SystemClock {
    /// A shared system clock, for [`crate::Engine::open`].
    pub fn shared() -> SharedClock {
        Arc::new(SystemClock)
    }
}

impl Clock for SystemClock {
    fn now_ms(&self) -> u64 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
            .unwrap_or(0)
    }

    fn now(&self) -> Instant {
        Instant::now()
    }
}

/// A clock that stands still until a test moves it ([`Self::advance`]):
/// both faces move together, and never backwards.
#[derive(Debug)]
pub struct ManualClock {
    /// Wall time at creation (ms since epoch).
    start_ms: u64,
    /// Monotonic time at creation: an `Instant` cannot be made from a
    /// number, so the monotonic face is this plus the offset.
    start: Instant,
    /// Time moved since creation, in ms.
    offset_ms: AtomicU64,
}

impl ManualClock {
    /// A manual clock whose wall time starts at the system's wall time now
    /// (read once), then moves only when told. Starting there keeps it in
    /// step with what still reads the system clock beside the engine: the
    /// stores drop idempotency receipts by their own wall time.
    pub fn new() -> Arc<Self> {
        Self::starting_at(SystemClock.now_ms())
    }

    /// A manual clock whose wall time starts at `start_ms`.
    pub fn starting_at(start_ms: u64) -> Arc<Self> {
        Arc::new(ManualClock {
            start_ms,
            start: Instant::now(),
            offset_ms: AtomicU64::new(0),
        })
    }

    /// Moves time forward by `by` (whole milliseconds: the engine's
    /// deadlines are in ms).
    pub fn advance(&self, by: Duration) {
        let ms = u64::try_from(by.as_millis()).unwrap_or(u64::MAX);
        self.offset_ms.fetch_add(ms, Ordering::SeqCst);
    }

    /// Moves time forward by `ms` milliseconds.
    pub fn advance_ms(&self, ms: u64) {
        self.offset_ms.fetch_add(ms, Ordering::SeqCst);
    }

    /// Moves wall time forward to `at_ms` (no-op if it is already there
    /// or past it: time never runs backwards).
    pub fn set_ms(&self, at_ms: u64) {
        self.offset_ms
            .fetch_max(at_ms.saturating_sub(self.start_ms), Ordering::SeqCst);
    }

    fn offset(&self) -> u64 {
        self.offset_ms.load(Ordering::SeqCst)
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> u64 {
        self.start_ms.saturating_add(self.offset())
    }

    fn now(&self) -> Instant {
        self.start + Duration::from_millis(self.offset())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manual_clock_moves_only_when_told_and_both_faces_together() {
        let c = ManualClock::starting_at(1_700_000_000_000);
        let (ms, at) = (c.now_ms(), c.now());
        assert_eq!(ms, 1_700_000_000_000);
        assert_eq!((c.now_ms(), c.now()), (ms, at));
        c.advance(Duration::from_millis(1500));
        assert_eq!(c.now_ms(), ms + 1500);
        assert_eq!(c.now() - at, Duration::from_millis(1500));
        c.set_ms(ms + 1000);
        assert_eq!(c.now_ms(), ms + 1500, "never backwards");
        c.set_ms(ms + 2000);
        assert_eq!(c.now_ms(), ms + 2000);
        assert_eq!(c.now() - at, Duration::from_secs(2));
    }

    #[test]
    fn system_clock_is_wall_time() {
        // 2023-11-14 or later: a real epoch time, not 0.
        assert!(SystemClock.now_ms() > 1_700_000_000_000);
    }
}
