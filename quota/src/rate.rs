//! Publish rate limits (messages/s and bytes/s) of a tenant, with
//! `governor`'s GCRA: one lock-free limiter per limit, shared by all the
//! tenant's connections.
//!
//! A session reads a batch from its socket, handles it, then hands what it
//! published to [`Rate::take`] through a [`Debt`]. Over the rate, `take`
//! says how long to wait; the session stops reading its socket for that
//! long (TCP pushes back on the producer) and then takes the rest. Nothing
//! is refused and nothing is allocated per message.

use governor::clock::{Clock, DefaultClock};
use governor::middleware::NoOpMiddleware;
use governor::state::{InMemoryState, NotKeyed};
use governor::{Quota, RateLimiter};
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

type Limiter<C> = RateLimiter<NotKeyed, InMemoryState, C, NoOpMiddleware<<C as Clock>::Instant>>;

/// What a connection published and has not yet been allowed by the rate.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Debt {
    /// Messages.
    pub messages: u32,
    /// Bytes.
    pub bytes: u64,
}

impl Debt {
    /// Nothing owed.
    pub fn is_empty(&self) -> bool {
        self.messages == 0 && self.bytes == 0
    }
}

/// A tenant's publish rate limits.
pub struct Rate<C: Clock = DefaultClock> {
    messages: Option<(Limiter<C>, NonZeroU32)>,
    bytes: Option<(Limiter<C>, NonZeroU32)>,
    clock: C,
    /// Times a connection of the tenant was told to pause (observable
    /// backpressure, for tests and metrics).
    pauses: AtomicU64,
}

impl<C: Clock> std::fmt::Debug for Rate<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rate")
            .field("messages", &self.messages.as_ref().map(|m| m.1))
            .field("bytes", &self.bytes.as_ref().map(|b| b.1))
            .finish()
    }
}

impl Rate<DefaultClock> {
    /// Limits of `messages` and `bytes` per second (`None`: that one is
    /// unlimited; a zero is taken as one).
    pub fn new(messages: Option<u32>, bytes: Option<u32>) -> Self {
        Self::with_clock(messages, bytes, DefaultClock::default())
    }
}

impl<C: Clock + Clone> Rate<C> {
    /// As [`Rate::new`], on `clock`.
    pub fn with_clock(messages: Option<u32>, bytes: Option<u32>, clock: C) -> Self {
        // A burst of one second's worth: a producer at its rate never
        // waits, one above it is held to the rate within a second.
        let limiter = |per_s: u32| {
            let n = NonZeroU32::new(per_s).unwrap_or(NonZeroU32::MIN);
            (
                RateLimiter::direct_with_clock(Quota::per_second(n), clock.clone()),
                n,
            )
        };
        Rate {
            messages: messages.map(limiter),
            bytes: bytes.map(limiter),
            clock,
            pauses: AtomicU64::new(0),
        }
    }

    /// Takes what `debt` owes from the limiters, as far as they allow. An
    /// empty debt afterwards means go on; otherwise wait the returned time
    /// (without reading) and call again.
    pub fn take(&self, debt: &mut Debt) -> Option<Duration> {
        let mut wait = None;
        if let Some((l, burst)) = &self.messages {
            let mut owed = u64::from(debt.messages);
            wait = self.take_from(l, *burst, &mut owed);
            debt.messages = owed as u32;
        }
        if let Some((l, burst)) = &self.bytes {
            let w = self.take_from(l, *burst, &mut debt.bytes);
            wait = wait.max(w);
        } else {
            debt.bytes = 0;
        }
        if self.messages.is_none() {
            debt.messages = 0;
        }
        if wait.is_some() {
            self.pauses.fetch_add(1, Ordering::Relaxed);
        }
        wait
    }

    /// One message of `bytes` from a publisher that cannot pause (a request
    /// that is answered now, e.g. an HTTP publish): taken if the rate has
    /// room for it, else the time until it would. A message larger than a
    /// second's byte allowance needs room for one second's worth, and the
    /// rest is taken as far as the limiter allows (never refused for good).
    pub fn admit(&self, bytes: u64) -> Result<(), Duration> {
        let now = self.clock.now();
        if let Some((l, _)) = &self.messages {
            if let Err(not_until) = l.check() {
                self.pauses.fetch_add(1, Ordering::Relaxed);
                return Err(not_until.wait_time_from(now).max(Duration::from_millis(1)));
            }
        }
        if let Some((l, burst)) = &self.bytes {
            let first = bytes.min(u64::from(burst.get()));
            if let Some(n) = NonZeroU32::new(first as u32) {
                if let Ok(Err(not_until)) = l.check_n(n) {
                    self.pauses.fetch_add(1, Ordering::Relaxed);
                    return Err(not_until.wait_time_from(now).max(Duration::from_millis(1)));
                }
            }
            let mut rest = bytes - first;
            let _ = self.take_from(l, *burst, &mut rest);
        }
        Ok(())
    }

    /// Takes `owed` cells from `l` in chunks of at most its burst; the wait
    /// for the next chunk when it does not fit now.
    fn take_from(&self, l: &Limiter<C>, burst: NonZeroU32, owed: &mut u64) -> Option<Duration> {
        while *owed > 0 {
            let chunk = (*owed).min(u64::from(burst.get())) as u32;
            let n = NonZeroU32::new(chunk)?;
            match l.check_n(n) {
                Ok(Ok(())) => *owed -= u64::from(chunk),
                Ok(Err(not_until)) => {
                    // At least a millisecond: no busy loop on rounding.
                    let w = not_until.wait_time_from(self.clock.now());
                    return Some(w.max(Duration::from_millis(1)));
                }
                // A chunk never exceeds the burst.
                Err(_) => return Some(Duration::from_millis(1)),
            }
        }
        None
    }

    /// How many times a connection was told to pause since start.
    pub fn pauses(&self) -> u64 {
        self.pauses.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use governor::clock::FakeRelativeClock;

    #[test]
    fn within_the_rate_nothing_waits() {
        let clock = FakeRelativeClock::default();
        let r = Rate::with_clock(Some(100), None, clock.clone());
        let mut d = Debt {
            messages: 100,
            bytes: 1 << 30,
        };
        assert_eq!(r.take(&mut d), None);
        assert!(d.is_empty(), "an unlimited byte rate owes nothing");
        assert_eq!(r.pauses(), 0);
    }

    #[test]
    fn over_the_message_rate_waits_then_goes_on() {
        let clock = FakeRelativeClock::default();
        let r = Rate::with_clock(Some(10), None, clock.clone());
        let mut d = Debt {
            messages: 25,
            bytes: 0,
        };
        // The burst (10) goes at once, the rest waits.
        let w = r.take(&mut d).expect("over the rate");
        assert_eq!(d.messages, 15);
        assert!(w > Duration::ZERO && w <= Duration::from_secs(1), "{w:?}");
        assert_eq!(r.pauses(), 1);
        clock.advance(Duration::from_secs(1));
        assert!(r.take(&mut d).is_some(), "10 more went, 5 wait");
        assert_eq!(d.messages, 5);
        clock.advance(Duration::from_secs(1));
        assert_eq!(r.take(&mut d), None);
        assert!(d.is_empty());
    }

    #[test]
    fn admit_refuses_over_the_rate_and_names_the_wait() {
        let clock = FakeRelativeClock::default();
        let r = Rate::with_clock(Some(10), Some(1000), clock.clone());
        for _ in 0..10 {
            assert_eq!(r.admit(10), Ok(()));
        }
        let w = r
            .admit(10)
            .expect_err("the 11th in a second is over the rate");
        assert!(w > Duration::ZERO && w <= Duration::from_secs(1), "{w:?}");
        clock.advance(Duration::from_secs(1));
        // Larger than a second of bytes: admitted once a second's room is there.
        assert_eq!(r.admit(5000), Ok(()));
        assert!(r.admit(1).is_err(), "the byte burst is spent");
    }

    #[test]
    fn a_batch_larger_than_the_byte_burst_is_taken_in_chunks() {
        let clock = FakeRelativeClock::default();
        let r = Rate::with_clock(None, Some(1000), clock.clone());
        let mut d = Debt {
            messages: 1,
            bytes: 2500,
        };
        assert!(r.take(&mut d).is_some());
        assert_eq!((d.messages, d.bytes), (0, 1500));
        for _ in 0..2 {
            clock.advance(Duration::from_secs(1));
            r.take(&mut d);
        }
        assert!(d.is_empty());
    }
}
