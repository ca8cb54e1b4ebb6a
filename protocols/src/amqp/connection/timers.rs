//! Heartbeat, handshake and close timeouts, on the caller's clock.
//!
//! The connection keeps the times the session reported (reads, writes,
//! pauses) and turns them into one deadline, [`Connection::poll_timeout`];
//! [`Connection::handle_timeout`] acts on whatever is due. Nothing here
//! reads a clock, so tests drive it with plain `Instant` values.

use super::{codec, Connection, Phase};
use std::fmt;
use std::time::{Duration, Instant};

/// How long a client gets from connecting to connection.open-ok (RabbitMQ:
/// 10 s).
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a peer gets to answer our connection.close (or to read the last
/// bytes of a connection that is finished) before we hang up.
pub const CLOSE_TIMEOUT: Duration = Duration::from_secs(5);

/// Why [`Connection::handle_timeout`] ended a connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Timeout {
    /// connection.open-ok was not reached within [`HANDSHAKE_TIMEOUT`].
    Handshake,
    /// Nothing was read for two heartbeat intervals (time the session did
    /// not read, see [`Connection::pause_reads`], excluded).
    Heartbeat,
    /// The close was not completed within [`CLOSE_TIMEOUT`]: the peer did
    /// not answer our connection.close, or did not take the last bytes of
    /// a finished connection.
    Close,
}

impl fmt::Display for Timeout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Timeout::Handshake => "handshake not completed in time",
            Timeout::Heartbeat => "missed heartbeats from client",
            Timeout::Close => "close not completed in time",
        })
    }
}

/// The times the timers are computed from.
pub(super) struct Timers {
    /// The latest time the caller reported.
    now: Instant,
    /// When the connection was accepted.
    started: Instant,
    /// Last read that returned bytes (or the end of a read pause).
    last_read: Instant,
    /// Last write that sent bytes, or the last heartbeat queued.
    last_write: Instant,
    /// The session is not reading: peer silence is not measured.
    reads_paused: bool,
    /// When the close started; `None` before, and also right after a close
    /// began without a time (say [`Connection::fail`]): the next call that
    /// brings a time arms it, and until then the deadline is "now".
    closing_since: Option<Instant>,
    /// Set once a timeout ended the connection.
    expired: Option<Timeout>,
}

impl Timers {
    pub(super) fn new(now: Instant) -> Self {
        Timers {
            now,
            started: now,
            last_read: now,
            last_write: now,
            reads_paused: false,
            closing_since: None,
            expired: None,
        }
    }
}

impl Connection {
    /// Bytes were read from the peer at `now`.
    pub fn on_read(&mut self, now: Instant) {
        self.observe(now);
        self.timers.last_read = now;
    }

    /// Bytes of [`Self::out`] were written to the peer at `now`.
    pub fn on_write(&mut self, now: Instant) {
        self.observe(now);
        self.timers.last_write = now;
    }

    /// The session stopped reading (output backed up, publisher blocked):
    /// the peer's heartbeats wait in the socket, so silence from now on is
    /// not counted against it. Idempotent.
    pub fn pause_reads(&mut self, now: Instant) {
        self.observe(now);
        self.timers.reads_paused = true;
    }

    /// The session reads again: peer silence is measured from `now`. A call
    /// while reads are not paused changes nothing (so calling it on every
    /// loop does not hide a silent peer).
    pub fn resume_reads(&mut self, now: Instant) {
        self.observe(now);
        if self.timers.reads_paused {
            self.timers.reads_paused = false;
            self.timers.last_read = now;
        }
    }

    /// The next time [`Self::handle_timeout`] has something to do, if any.
    /// A deadline in the past means "now": call it right away.
    pub fn poll_timeout(&self) -> Option<Instant> {
        let t = &self.timers;
        if t.expired.is_some() {
            return None;
        }
        match self.phase {
            Phase::AwaitingHeader
            | Phase::AwaitingStartOk
            | Phase::Authenticating
            | Phase::AwaitingTuneOk
            | Phase::AwaitingOpen
            | Phase::Opening => Some(t.started + HANDSHAKE_TIMEOUT),
            Phase::Open => {
                let (send_after, dead_after) = self.heartbeat_intervals()?;
                let send = t.last_write + send_after;
                if t.reads_paused {
                    Some(send)
                } else {
                    Some(send.min(t.last_read + dead_after))
                }
            }
            // Finished and flushed: nothing left to wait for.
            Phase::Finished if self.out.is_empty() => None,
            Phase::Closing | Phase::Finished => {
                Some(t.closing_since.map_or(t.now, |since| since + CLOSE_TIMEOUT))
            }
        }
    }

    /// Acts on the timers due at `now`: queues a heartbeat frame after half
    /// the heartbeat interval without writing, or ends the connection
    /// ([`Self::is_finished`], [`Self::out`] emptied, [`Self::timed_out`]
    /// set) when the handshake, the peer's heartbeats or the close took too
    /// long. Calling it early is harmless.
    pub fn handle_timeout(&mut self, now: Instant) {
        self.observe(now);
        if self.timers.expired.is_some() {
            return;
        }
        match self.phase {
            Phase::AwaitingHeader
            | Phase::AwaitingStartOk
            | Phase::Authenticating
            | Phase::AwaitingTuneOk
            | Phase::AwaitingOpen
            | Phase::Opening => {
                if now >= self.timers.started + HANDSHAKE_TIMEOUT {
                    self.expire(Timeout::Handshake);
                }
            }
            Phase::Open => {
                let Some((send_after, dead_after)) = self.heartbeat_intervals() else {
                    return;
                };
                if !self.timers.reads_paused && now >= self.timers.last_read + dead_after {
                    return self.expire(Timeout::Heartbeat);
                }
                if now >= self.timers.last_write + send_after {
                    self.send_heartbeat();
                    // Counted as a write, so the next one is due half an
                    // interval later even if the socket is slow to take it.
                    self.timers.last_write = now;
                }
            }
            Phase::Finished if self.out.is_empty() => {}
            Phase::Closing | Phase::Finished => {
                if self
                    .timers
                    .closing_since
                    .is_some_and(|since| now >= since + CLOSE_TIMEOUT)
                {
                    self.expire(Timeout::Close);
                }
            }
        }
    }

    /// Which timeout ended the connection, if one did (for the log).
    pub fn timed_out(&self) -> Option<Timeout> {
        self.timers.expired
    }

    /// Writes a heartbeat frame.
    pub fn send_heartbeat(&mut self) {
        codec::write_heartbeat(&mut self.out);
    }

    /// (send a heartbeat after, the peer is dead after), when heartbeats
    /// were negotiated.
    fn heartbeat_intervals(&self) -> Option<(Duration, Duration)> {
        let hb = u64::from(self.heartbeat);
        (hb > 0).then(|| (Duration::from_millis(hb * 500), Duration::from_secs(hb * 2)))
    }

    /// Records the caller's time; arms the close timer of a close that
    /// began without one.
    fn observe(&mut self, now: Instant) {
        self.timers.now = self.timers.now.max(now);
        if self.is_closing() && self.timers.closing_since.is_none() {
            self.timers.closing_since = Some(now);
        }
    }

    /// Ends the connection for a timeout: nothing more is read or written
    /// (the peer is gone or too slow to be worth a close handshake).
    fn expire(&mut self, why: Timeout) {
        self.timers.expired = Some(why);
        self.out.clear();
        self.clear_channels();
        self.phase = Phase::Finished;
    }
}
