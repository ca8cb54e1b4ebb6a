//! Clock, latency histograms and the client's own CPU accounting.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;

static EPOCH: OnceLock<Instant> = OnceLock::new();

/// Nanoseconds since a process-wide epoch. Publishers write this into the first 8 bytes of each body
/// and consumers subtract it from their own reading, which is valid because both run in this process.
pub fn now_ns() -> u64 {
    EPOCH.get_or_init(Instant::now).elapsed().as_nanos() as u64
}

/// A latency histogram in microseconds, 1 µs .. 10 min, 3 significant digits.
pub fn new_histogram() -> Histogram<u64> {
    // The bounds are constants that hdrhistogram accepts, so this cannot fail at run time.
    Histogram::new_with_bounds(1, 600_000_000, 3).expect("static histogram bounds are valid")
}

/// Record a latency given in nanoseconds (clamped into the histogram's range).
#[inline]
pub fn record_ns(h: &mut Histogram<u64>, ns: u64) {
    h.saturating_record((ns / 1_000).max(1));
}

/// Percentiles of a histogram, in milliseconds.
#[derive(Debug, Clone, Copy, Default)]
pub struct Percentiles {
    pub count: u64,
    pub p50: f64,
    pub p95: f64,
    pub p99: f64,
    pub max: f64,
}

impl Percentiles {
    /// Summarise `h` (values in µs) as milliseconds.
    pub fn of(h: &Histogram<u64>) -> Percentiles {
        if h.is_empty() {
            return Percentiles::default();
        }
        let ms = |us: u64| us as f64 / 1_000.0;
        Percentiles {
            count: h.len(),
            p50: ms(h.value_at_quantile(0.50)),
            p95: ms(h.value_at_quantile(0.95)),
            p99: ms(h.value_at_quantile(0.99)),
            max: ms(h.max()),
        }
    }
}

/// User + system CPU time consumed by this whole process so far (all threads).
///
/// Read from `/proc/self/stat` (fields 14 and 15, in clock ticks). Linux reports them in USER_HZ,
/// which is 100 on every mainstream architecture; resolution is therefore 10 ms, plenty over a run of
/// several seconds. Returns `None` off Linux or if the file cannot be parsed.
pub fn process_cpu_time() -> Option<Duration> {
    cpu_time_of("self")
}

/// Like [`process_cpu_time`] for another process (`pid` as a string, or "self").
pub fn cpu_time_of(pid: &str) -> Option<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is parenthesised and may contain spaces: split after the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace();
    // `rest` starts at field 3 (state); utime is field 14, stime field 15.
    let utime: u64 = fields.nth(11)?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    const USER_HZ: u64 = 100;
    Some(Duration::from_millis((utime + stime) * 1_000 / USER_HZ))
}

/// The tokio instant corresponding to `ns` nanoseconds after the epoch.
pub fn deadline(ns: u64) -> tokio::time::Instant {
    let epoch = *EPOCH.get_or_init(Instant::now);
    tokio::time::Instant::from_std(epoch + Duration::from_nanos(ns))
}

/// Busy CPU time of the whole machine in USER_HZ ticks (every CPU, every process): the first line of
/// `/proc/stat` minus idle and iowait. Used to show how much of the machine the broker (and anything
/// else running, such as a concurrent build) took during the run.
pub fn machine_cpu_ticks() -> Option<u64> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let line = stat.lines().next()?.strip_prefix("cpu ")?;
    let v: Vec<u64> = line
        .split_whitespace()
        .map(|f| f.parse().ok())
        .collect::<Option<_>>()?;
    // user nice system idle iowait irq softirq steal [guest guest_nice, already inside user/nice]
    let total: u64 = v.iter().take(8).sum();
    Some(total.saturating_sub(v.get(3)? + v.get(4).copied().unwrap_or(0)))
}
