//! Login admission, shared by every protocol: a failure budget per source
//! address, and fair turns at the few slots that run slow password
//! verifications ([`crate::auth::Authenticator::authenticate`]).
//!
//! An argon2 verification costs tens of milliseconds and ~19 MiB, so only a
//! few run at once. Before this gate they were taken first come, first
//! served: 400 wrong passwords from one address made everyone else's first
//! login wait behind all 400. Now:
//!
//! * A **source** is an IPv4 address or an IPv6 /64 (one client usually owns
//!   a whole /64). It has at most [`PER_SOURCE_RUNNING`] verification
//!   running; its other logins wait in its own queue, at most
//!   [`PER_SOURCE_WAITING`] of them (more are refused: [`Entry::Busy`]).
//! * A freed slot goes to the sources with waiting logins in turn (round
//!   robin), so a new source's one login waits for at most one verification
//!   per other source, never for another source's whole queue.
//! * Each refused login counts against its source: the answer is delayed
//!   100 ms, doubling per recent failure up to 3.2 s (served in the
//!   connection's own task), and one failure is forgotten per [`DECAY`]
//!   without failures. A source with [`BUDGET`] recent failures is **over
//!   budget**: its logins are refused before anything is checked, no hash
//!   and no cache lookup (a cached password would otherwise answer guesses
//!   at no cost), until it has been quiet for [`DECAY`].
//! * The table of sources is bounded ([`TABLE_MAX`]): sources that are idle
//!   and whose failures have decayed are dropped first, then the idle ones
//!   that failed longest ago. Sources with logins running or waiting are
//!   bounded by the connections that carry them.
//!
//! Time is an input (`now`), as elsewhere in the engine; the gate never
//! reads a clock. Waiting uses tokio's runtime-free `oneshot` channel: a
//! [`Waiter`] can be awaited, or polled with [`Waiter::try_take`].

use parking_lot::Mutex;
use std::collections::{HashMap, VecDeque};
use std::net::{IpAddr, Ipv6Addr};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

/// Verifications one source may have running at once.
pub const PER_SOURCE_RUNNING: u32 = 1;
/// Logins one source may have waiting for a slot; more are refused
/// ([`Entry::Busy`]). Generous: a client opening a pool of connections with
/// one password waits once, then the rest are answered from the cache as
/// they get their turn (microseconds each).
pub const PER_SOURCE_WAITING: usize = 256;
/// Recent failures after which a source is refused without any check.
pub const BUDGET: u32 = 10;
/// One remembered failure is forgotten per this much time without failures.
pub const DECAY: Duration = Duration::from_secs(10);
/// Sources remembered at most (bounded against many or spoofed sources).
pub const TABLE_MAX: usize = 16_384;
/// Delay before the first refusal from a source.
pub const DELAY_BASE: Duration = Duration::from_millis(100);
/// Longest delay: the doubling stops here.
pub const DELAY_MAX: Duration = Duration::from_millis(3200);

/// Why a login was refused, and how long to wait before answering.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LoginRefused {
    /// Wrong password, unknown user, or a user not allowed from there (no
    /// reason is given: a client must not learn whether the user exists).
    #[error("authentication failed")]
    Failed {
        /// Wait this long before answering.
        delay: Duration,
    },
    /// The source has used up its failure budget: refused without a check.
    #[error("too many failed logins from this address")]
    OverBudget {
        /// Wait this long before answering.
        delay: Duration,
    },
    /// The source already has [`PER_SOURCE_WAITING`] logins waiting.
    #[error("too many logins waiting from this address")]
    Busy,
}

impl LoginRefused {
    /// How long to wait before answering.
    pub fn delay(&self) -> Duration {
        match *self {
            LoginRefused::Failed { delay } | LoginRefused::OverBudget { delay } => delay,
            LoginRefused::Busy => Duration::ZERO,
        }
    }

    /// Refused because of the source's behaviour rather than these
    /// credentials (over budget or busy): HTTP answers 429, not 401.
    pub fn is_throttled(&self) -> bool {
        !matches!(self, LoginRefused::Failed { .. })
    }
}

/// The answer to [`LoginGate::enter`].
#[derive(Debug)]
pub enum Entry {
    /// A slot is free: verify now, holding it.
    Run(Slot),
    /// Wait for a turn.
    Wait(Waiter),
    /// The source has too many logins waiting already: refuse.
    Busy,
}

/// Figures of the gate, for tests and metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GateStats {
    /// Sources remembered.
    pub sources: usize,
    /// Verifications holding a slot.
    pub running: usize,
    /// Logins waiting for a slot (including ones whose connection is gone
    /// and that will be skipped).
    pub waiting: usize,
}

/// The login gate (see the module documentation). Cheap to clone: clones
/// share one state.
#[derive(Clone)]
pub struct LoginGate {
    inner: Arc<Mutex<State>>,
}

impl std::fmt::Debug for LoginGate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoginGate")
            .field("stats", &self.stats())
            .finish()
    }
}

struct State {
    slots: usize,
    free: usize,
    sources: HashMap<IpAddr, Source>,
    /// Sources with a waiting login and a free per-source turn, in the
    /// order they get the next free slots.
    ready: VecDeque<IpAddr>,
}

struct Source {
    failures: u32,
    /// When the last failure was recorded (decay counts from here).
    failed_at: Option<Instant>,
    running: u32,
    waiting: VecDeque<oneshot::Sender<()>>,
    /// In `ready`.
    scheduled: bool,
}

impl Source {
    fn new() -> Self {
        Source {
            failures: 0,
            failed_at: None,
            running: 0,
            waiting: VecDeque::new(),
            scheduled: false,
        }
    }

    fn failures_at(&self, now: Instant) -> u32 {
        match self.failed_at {
            Some(at) => decayed(self.failures, at, now),
            None => 0,
        }
    }

    fn idle(&self) -> bool {
        self.running == 0 && self.waiting.is_empty()
    }
}

/// Failures left after decay.
fn decayed(n: u32, at: Instant, now: Instant) -> u32 {
    let periods = now.saturating_duration_since(at).as_nanos() / DECAY.as_nanos();
    n.saturating_sub(u32::try_from(periods).unwrap_or(u32::MAX))
}

/// The source an address belongs to: itself for IPv4 (IPv4-mapped IPv6
/// included), its /64 for IPv6, so one client cannot step around its
/// budget (or flood the table) by changing address within its network.
pub fn source_of(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(_) => ip,
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => {
                let s = v6.segments();
                IpAddr::V6(Ipv6Addr::new(s[0], s[1], s[2], s[3], 0, 0, 0, 0))
            }
        },
    }
}

impl LoginGate {
    /// A gate with `slots` verifications running at once (at least one).
    pub fn new(slots: usize) -> Self {
        let slots = slots.max(1);
        LoginGate {
            inner: Arc::new(Mutex::new(State {
                slots,
                free: slots,
                sources: HashMap::new(),
                ready: VecDeque::new(),
            })),
        }
    }

    /// Whether `ip`'s source is over its failure budget at `now`: refuse
    /// its logins before any check.
    pub fn over_budget(&self, ip: IpAddr, now: Instant) -> bool {
        let st = self.inner.lock();
        st.sources
            .get(&source_of(ip))
            .is_some_and(|s| s.failures_at(now) >= BUDGET)
    }

    /// Records a refused login from `ip` at `now` and returns how long to
    /// wait before answering it: 100 ms doubling per recent failure, at
    /// most 3.2 s. The count stops at [`BUDGET`], so a source that stops
    /// failing is let back in after [`DECAY`].
    pub fn failed(&self, ip: IpAddr, now: Instant) -> Duration {
        let key = source_of(ip);
        let mut st = self.inner.lock();
        st.make_room(key, now);
        let s = st.sources.entry(key).or_insert_with(Source::new);
        let n = (s.failures_at(now) + 1).min(BUDGET);
        s.failures = n;
        s.failed_at = Some(now);
        let shift = (n - 1).min(16);
        (DELAY_BASE * (1u32 << shift)).min(DELAY_MAX)
    }

    /// Asks for a verification slot for a login from `ip`. Does not check
    /// the budget: call [`Self::over_budget`] before and again once the
    /// slot is held (failures may have been recorded while it waited).
    pub fn enter(&self, ip: IpAddr, now: Instant) -> Entry {
        let key = source_of(ip);
        let mut guard = self.inner.lock();
        guard.make_room(key, now);
        let st = &mut *guard;
        let s = st.sources.entry(key).or_insert_with(Source::new);
        // A free slot means nobody runnable is waiting (every release hands
        // free slots out at once), so taking it jumps no queue.
        if st.free > 0 && s.running < PER_SOURCE_RUNNING && s.waiting.is_empty() {
            s.running += 1;
            st.free -= 1;
            return Entry::Run(Slot {
                gate: self.inner.clone(),
                key,
            });
        }
        if s.waiting.len() >= PER_SOURCE_WAITING {
            s.waiting.retain(|w| !w.is_closed());
            if s.waiting.len() >= PER_SOURCE_WAITING {
                return Entry::Busy;
            }
        }
        let (tx, rx) = oneshot::channel();
        s.waiting.push_back(tx);
        if !s.scheduled && s.running < PER_SOURCE_RUNNING {
            s.scheduled = true;
            st.ready.push_back(key);
        }
        st.dispatch();
        Entry::Wait(Waiter {
            rx: Some(rx),
            gate: self.inner.clone(),
            key,
        })
    }

    /// Current figures.
    pub fn stats(&self) -> GateStats {
        let st = self.inner.lock();
        GateStats {
            sources: st.sources.len(),
            running: st.slots - st.free,
            waiting: st.sources.values().map(|s| s.waiting.len()).sum(),
        }
    }
}

impl State {
    /// Gives free slots to waiting logins, one source at a time in turn.
    fn dispatch(&mut self) {
        while self.free > 0 {
            let Some(key) = self.ready.pop_front() else {
                return;
            };
            let Some(s) = self.sources.get_mut(&key) else {
                continue;
            };
            let mut granted = false;
            while let Some(tx) = s.waiting.pop_front() {
                // Err: that login's connection went away; try the next.
                if tx.send(()).is_ok() {
                    granted = true;
                    break;
                }
            }
            if granted {
                s.running += 1;
                self.free -= 1;
            }
            if !s.waiting.is_empty() && s.running < PER_SOURCE_RUNNING {
                self.ready.push_back(key);
            } else {
                s.scheduled = false;
            }
        }
    }

    /// A slot of `key` came back.
    fn release(&mut self, key: IpAddr) {
        self.free += 1;
        if let Some(s) = self.sources.get_mut(&key) {
            s.running = s.running.saturating_sub(1);
            if !s.waiting.is_empty() && !s.scheduled {
                s.scheduled = true;
                self.ready.push_back(key);
            }
            if s.idle() && s.failed_at.is_none() {
                self.sources.remove(&key);
            }
        }
        self.dispatch();
    }

    /// Before adding `key`: keeps the table within [`TABLE_MAX`] by
    /// dropping idle sources, those with no failures left first, then the
    /// half that failed longest ago.
    fn make_room(&mut self, key: IpAddr, now: Instant) {
        if self.sources.len() < TABLE_MAX || self.sources.contains_key(&key) {
            return;
        }
        self.sources
            .retain(|_, s| !s.idle() || s.failures_at(now) > 0);
        if self.sources.len() < TABLE_MAX {
            return;
        }
        let mut ats: Vec<Instant> = self
            .sources
            .values()
            .filter(|s| s.idle())
            .filter_map(|s| s.failed_at)
            .collect();
        if ats.is_empty() {
            // Every source has a login running or waiting: those are
            // bounded by connections, not by this table.
            return;
        }
        ats.sort_unstable();
        let cut = ats[ats.len() / 2];
        self.sources
            .retain(|_, s| !s.idle() || s.failed_at.is_some_and(|at| at > cut));
    }
}

/// A verification slot, held while the hash runs; given back (to the next
/// source in turn) when dropped.
pub struct Slot {
    gate: Arc<Mutex<State>>,
    key: IpAddr,
}

impl std::fmt::Debug for Slot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Slot").field("source", &self.key).finish()
    }
}

impl std::fmt::Debug for Waiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Waiter")
            .field("source", &self.key)
            .field("taken", &self.rx.is_none())
            .finish()
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.gate.lock().release(self.key);
    }
}

/// A login waiting for its turn. Dropping it (the connection went away)
/// gives up the turn, or the slot if it was already granted.
pub struct Waiter {
    rx: Option<oneshot::Receiver<()>>,
    gate: Arc<Mutex<State>>,
    key: IpAddr,
}

impl Waiter {
    fn slot(&self) -> Slot {
        Slot {
            gate: self.gate.clone(),
            key: self.key,
        }
    }

    /// The slot, if this login's turn has come; never waits.
    pub fn try_take(&mut self) -> Option<Slot> {
        let rx = self.rx.as_mut()?;
        rx.try_recv().ok()?;
        self.rx = None;
        Some(self.slot())
    }

    /// Waits for this login's turn. `None` only if the gate is gone.
    pub async fn wait(mut self) -> Option<Slot> {
        let rx = self.rx.as_mut()?;
        rx.await.ok()?;
        self.rx = None;
        Some(self.slot())
    }
}

impl Drop for Waiter {
    fn drop(&mut self) {
        let Some(mut rx) = self.rx.take() else {
            return;
        };
        // After close, a turn can no longer be granted; one granted before
        // is still in the channel and must be given back.
        rx.close();
        if rx.try_recv().is_ok() {
            drop(self.slot());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delay_grows_and_is_capped_per_source() {
        let g = LoginGate::new(2);
        let now = Instant::now();
        let ip: IpAddr = "10.0.0.1".parse().expect("ip");
        let delays: Vec<u64> = (0..8)
            .map(|_| g.failed(ip, now).as_millis() as u64)
            .collect();
        assert_eq!(delays, vec![100, 200, 400, 800, 1600, 3200, 3200, 3200]);
        let other: IpAddr = "10.0.0.2".parse().expect("ip");
        assert_eq!(g.failed(other, now), DELAY_BASE);
    }

    #[test]
    fn ipv6_clients_are_one_source_per_64() {
        let a: IpAddr = "2001:db8:1:2::1".parse().expect("ip");
        let b: IpAddr = "2001:db8:1:2::ffff".parse().expect("ip");
        assert_eq!(source_of(a), source_of(b));
        let mapped: IpAddr = "::ffff:10.1.2.3".parse().expect("ip");
        assert_eq!(source_of(mapped), "10.1.2.3".parse::<IpAddr>().expect("ip"));
    }
}
