//! What an attack is measured by, beside its own figures: the broker's resident memory (sampled from
//! `/proc/<pid>/status`) and how long a second, innocent client waits to be served.
//!
//! Both run on their own OS threads (the probe with its own runtime), so an attack that keeps the
//! tool's runtime busy cannot delay them and inflate the broker's figures.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use amq_protocol::uri::AMQPUri;

use crate::conn::{Conn, Result};
use crate::ops;

/// Queue the probe declares once and then passive-declares on every round.
pub const PROBE_QUEUE: &str = "abuse-probe";

/// A kB figure from `/proc/<pid>/status` (`VmRSS`, `VmHWM`).
pub fn status_kb(pid: u32, key: &str) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines()
        .find(|l| l.starts_with(key) && l[key.len()..].starts_with(':'))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
}

/// Whether `pid` is a live process (not a zombie).
pub fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // Field 3, after the parenthesised command name, is the state.
        Ok(s) => s
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|st| st != "Z" && st != "X"),
        Err(_) => false,
    }
}

/// Samples the broker's RSS every 50 ms until stopped.
pub struct RssSampler {
    stop: Arc<AtomicBool>,
    peak_kb: Arc<AtomicU64>,
    pid: u32,
    start_kb: u64,
    thread: Option<JoinHandle<()>>,
}

impl RssSampler {
    /// Start sampling `pid`.
    pub fn start(pid: u32) -> RssSampler {
        let stop = Arc::new(AtomicBool::new(false));
        let start_kb = status_kb(pid, "VmRSS").unwrap_or(0);
        let peak_kb = Arc::new(AtomicU64::new(start_kb));
        let thread = {
            let (stop, peak) = (stop.clone(), peak_kb.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    match status_kb(pid, "VmRSS") {
                        Some(kb) => {
                            peak.fetch_max(kb, Ordering::Relaxed);
                        }
                        None => break, // the broker is gone
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
            })
        };
        RssSampler {
            stop,
            peak_kb,
            pid,
            start_kb,
            thread: Some(thread),
        }
    }

    /// RSS when sampling started, in kB.
    pub fn start_kb(&self) -> u64 {
        self.start_kb
    }

    /// Current RSS in kB (0 if the broker is gone).
    pub fn now_kb(&self) -> u64 {
        status_kb(self.pid, "VmRSS").unwrap_or(0)
    }

    /// Highest RSS seen so far, VmHWM included (the kernel's own peak catches spikes between samples).
    pub fn peak_kb(&self) -> u64 {
        let hwm = status_kb(self.pid, "VmHWM").unwrap_or(0);
        self.peak_kb.load(Ordering::Relaxed).max(hwm)
    }

    /// Stop sampling; returns `rss_peak_mb=… rss_end_mb=…`.
    pub fn finish(mut self) -> String {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        format!(
            "rss_peak_mb={} rss_end_mb={}",
            self.peak_kb() / 1024,
            self.now_kb() / 1024
        )
    }
}

/// A client that, in a loop, connects, opens a channel and passive-declares a queue, and remembers
/// the longest round.
pub struct Probe {
    stop: Arc<AtomicBool>,
    /// Longest completed round, µs.
    max_us: Arc<AtomicU64>,
    /// Start of the round in progress, µs since `epoch` (0 = none).
    current_start_us: Arc<AtomicU64>,
    rounds: Arc<AtomicU64>,
    errors: Arc<AtomicU64>,
    timeouts: Arc<AtomicU64>,
    /// Text of the last failed round.
    last_error: Arc<Mutex<String>>,
    epoch: Instant,
    cap: Duration,
    thread: Option<JoinHandle<()>>,
}

/// Replace the text in `slot` (a poisoned lock only loses the text).
fn set(slot: &Mutex<String>, s: String) {
    if let Ok(mut g) = slot.lock() {
        *g = s;
    }
}

/// One probe round: connect, open a channel, passive-declare. The connection is dropped without a
/// close handshake: waiting for close-ok would only add to the measured time.
async fn probe_round(uri: &AMQPUri) -> Result<()> {
    let mut c = Conn::open(uri).await?;
    ops::count(&mut c, PROBE_QUEUE).await?;
    Ok(())
}

impl Probe {
    /// Declare the probe queue (so passive declares have something to find) and start probing.
    /// Each round is capped at `cap`; a capped round counts as a timeout.
    pub async fn start(uri: AMQPUri, cap: Duration) -> Result<Probe> {
        let mut c = Conn::open(&uri).await?;
        ops::declare_queue(&mut c, PROBE_QUEUE, false).await?;
        c.close().await;

        let stop = Arc::new(AtomicBool::new(false));
        let max_us = Arc::new(AtomicU64::new(0));
        let current_start_us = Arc::new(AtomicU64::new(0));
        let rounds = Arc::new(AtomicU64::new(0));
        let errors = Arc::new(AtomicU64::new(0));
        let timeouts = Arc::new(AtomicU64::new(0));
        let last_error = Arc::new(Mutex::new(String::new()));
        let epoch = Instant::now();
        let thread = {
            let (stop, max_us, cur, rounds, errors, timeouts, last_error) = (
                stop.clone(),
                max_us.clone(),
                current_start_us.clone(),
                rounds.clone(),
                errors.clone(),
                timeouts.clone(),
                last_error.clone(),
            );
            std::thread::spawn(move || {
                let rt = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => {
                        set(&last_error, format!("probe runtime: {e}"));
                        return;
                    }
                };
                rt.block_on(async move {
                    while !stop.load(Ordering::Relaxed) {
                        let t0 = Instant::now();
                        cur.store((t0 - epoch).as_micros().max(1) as u64, Ordering::Relaxed);
                        let r = tokio::time::timeout(cap, probe_round(&uri)).await;
                        let took = t0.elapsed();
                        cur.store(0, Ordering::Relaxed);
                        if stop.load(Ordering::Relaxed) && r.is_err() {
                            break; // cut short by the end of the attack, not by the broker
                        }
                        max_us.fetch_max(took.as_micros() as u64, Ordering::Relaxed);
                        rounds.fetch_add(1, Ordering::Relaxed);
                        match r {
                            Ok(Ok(())) => {}
                            Ok(Err(e)) => {
                                errors.fetch_add(1, Ordering::Relaxed);
                                set(&last_error, e.to_string());
                            }
                            Err(_) => {
                                timeouts.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                });
            })
        };
        Ok(Probe {
            stop,
            max_us,
            current_start_us,
            rounds,
            errors,
            timeouts,
            last_error,
            epoch,
            cap,
            thread: Some(thread),
        })
    }

    /// Longest wait so far, the round in progress included; `true` if that round is still running.
    pub fn max_wait(&self) -> (Duration, bool) {
        let done = self.max_us.load(Ordering::Relaxed);
        let cur = self.current_start_us.load(Ordering::Relaxed);
        let running = if cur == 0 {
            0
        } else {
            (self.epoch.elapsed().as_micros() as u64).saturating_sub(cur)
        };
        (Duration::from_micros(done.max(running)), running > done)
    }

    /// Stop probing; returns `probe_wait_ms=… probe_rounds=… [probe_err=… probe_last_err="…"]`.
    pub fn finish(mut self) -> String {
        let (wait, unfinished) = self.max_wait();
        self.stop.store(true, Ordering::Relaxed);
        // Do not join: a round may be stuck on a dead broker for up to `cap`; the thread ends on its
        // own (or with the process).
        drop(self.thread.take());
        let timeouts = self.timeouts.load(Ordering::Relaxed);
        let wait_s = if timeouts > 0 || wait >= self.cap {
            format!("probe_wait_ms=timeout(>{}s)", self.cap.as_secs())
        } else {
            // "+": the longest round had not finished when the attack ended.
            let plus = if unfinished { "+" } else { "" };
            format!("probe_wait_ms={}{plus}", wait.as_millis())
        };
        let mut s = format!(
            "{wait_s} probe_rounds={}",
            self.rounds.load(Ordering::Relaxed)
        );
        let errors = self.errors.load(Ordering::Relaxed);
        if errors > 0 {
            s.push_str(&format!(
                " probe_err={errors} probe_last_err=\"{}\"",
                self.last_error
                    .lock()
                    .map(|g| g.replace('"', "'"))
                    .unwrap_or_default()
            ));
        }
        s
    }
}
