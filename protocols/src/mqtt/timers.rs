//! The CONNECT timeout and keep-alive, on the caller's clock.

use super::connection::{Connection, Phase};
use super::reason;
use super::wire::Fault;
use std::fmt;
use std::time::{Duration, Instant};

/// Why [`Connection::handle_timeout`] ended a connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Timeout {
    /// No complete CONNECT within [`super::ServerConfig::connect_timeout`].
    Connect,
    /// Nothing read for 1.5 times the keep-alive.
    KeepAlive,
}

impl fmt::Display for Timeout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Timeout::Connect => "no CONNECT in time",
            Timeout::KeepAlive => "keep-alive timeout",
        })
    }
}

/// The times the deadlines are computed from.
pub(super) struct Timers {
    /// When the connection was accepted.
    started: Instant,
    /// The last read that brought bytes.
    last_read: Instant,
    /// Set once a timeout ended the connection.
    expired: Option<Timeout>,
}

impl Timers {
    pub(super) fn new(now: Instant) -> Timers {
        Timers {
            started: now,
            last_read: now,
            expired: None,
        }
    }
}

impl Connection {
    /// Bytes were read at `now` (keep-alive counts from here).
    pub fn on_read(&mut self, now: Instant) {
        self.timers.last_read = self.timers.last_read.max(now);
    }

    /// When [`Connection::handle_timeout`] must be called next.
    pub fn poll_timeout(&self) -> Option<Instant> {
        match self.phase {
            // A timeout too large for the clock is no timeout.
            Phase::AwaitingConnect => self.timers.started.checked_add(self.config.connect_timeout),
            Phase::Open => self
                .keep_alive_limit()
                .and_then(|d| self.timers.last_read.checked_add(d)),
            Phase::Connecting | Phase::Finished => None,
        }
    }

    /// Keep-alive (1.5× the negotiated value without a packet: the
    /// connection ends with [`super::Event::Closed`] on the next poll,
    /// MQTT 5 after a DISCONNECT 0x8D) and the CONNECT timeout (nothing
    /// written). Calling it early is harmless.
    pub fn handle_timeout(&mut self, now: Instant) {
        let Some(deadline) = self.poll_timeout() else {
            return;
        };
        if now < deadline {
            return;
        }
        match self.phase {
            Phase::AwaitingConnect => {
                self.timers.expired = Some(Timeout::Connect);
                self.end(Fault::new(
                    reason::UNSPECIFIED_ERROR,
                    format!(
                        "no CONNECT within {} ms",
                        self.config.connect_timeout.as_millis()
                    ),
                ));
            }
            Phase::Open => {
                self.timers.expired = Some(Timeout::KeepAlive);
                self.fail(Fault::new(
                    reason::KEEP_ALIVE_TIMEOUT,
                    format!(
                        "nothing received for 1.5 times the keep-alive of {} s",
                        self.keep_alive
                    ),
                ));
            }
            Phase::Connecting | Phase::Finished => {}
        }
    }

    /// Which timeout ended the connection, if one did (for the log).
    pub fn timed_out(&self) -> Option<Timeout> {
        self.timers.expired
    }

    /// 1.5 times the keep-alive in force, if there is one.
    fn keep_alive_limit(&self) -> Option<Duration> {
        (self.keep_alive > 0).then(|| Duration::from_millis(u64::from(self.keep_alive) * 1500))
    }
}
