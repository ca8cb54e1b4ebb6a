//! `weir-mqtt-bench`: a lean MQTT 3.1.1 load generator, the same client for Weir and Mosquitto.
//!
//! Four workloads (issue 8's benchmarks, and issue 21's reconnect storm), one per subcommand:
//!
//! - `qos1`: N publishers keep a window of unacknowledged QoS 1 publishes to one topic; a
//!   persistent-session subscriber (clean session off) at QoS 1 acks every delivery. Reports
//!   publish msg/s, PUBACK latency (publish → PUBACK) and publish → deliver latency.
//! - `fanout`: thousands of subscriber connections on one topic (QoS 0 or 1), one publisher that
//!   keeps a few publishes "in fan-out" (not yet received by every subscriber). Reports delivered
//!   msg/s, publish → deliver latency per delivery and the time until the last subscriber has it.
//! - `idle`: thousands of connections that connect and then do nothing (keep-alive 60 s); reports
//!   the broker's RSS growth per connection (`VmRSS` of `--broker-pid` before and after).
//! - `storm` (issue 21): thousands of persistent sessions with a subscription each, made and left,
//!   then all reconnecting at once; reports the time to the last CONNACK and the broker's CPU.
//!
//! The packets are written and read by hand (`wire.rs`), as weir-bench does for AMQP, and every
//! connection is multiplexed on one thread by default (`--threads 1`), so the client uses at most
//! one core of the two and its CPU cost is easy to read. docs/BENCHMARKS.md has the figures and
//! why rumqttc was not used.

#![forbid(unsafe_code)]

#[allow(dead_code)] // shared with weir-bench: only the error helpers are used here
#[path = "../conn.rs"]
mod conn;
#[allow(dead_code)]
#[path = "../stats.rs"]
mod stats;

mod client;
mod fanout;
mod idle;
mod qos1;
mod storm;
mod wire;

use std::net::SocketAddr;

use clap::{Args as ClapArgs, Parser, Subcommand};
use serde_json::{json, Value};

use client::Target;
use conn::{err, Context, Result};
use stats::Percentiles;

/// Lean MQTT 3.1.1 load generator: QoS 1 to a persistent subscriber, fan-out, idle connections.
#[derive(Parser, Debug, Clone)]
#[command(version)]
struct Cli {
    #[command(flatten)]
    common: Common,
    #[command(subcommand)]
    workload: Workload,
}

/// Options of every workload.
#[derive(ClapArgs, Debug, Clone)]
pub struct Common {
    /// Broker address.
    #[arg(long, global = true, default_value = "127.0.0.1:1883")]
    addr: SocketAddr,
    /// Username ("" = none).
    #[arg(long, global = true, default_value = "guest")]
    user: String,
    /// Password ("" = none).
    #[arg(long, global = true, default_value = "guest")]
    pass: String,
    /// Do not spread connections over source addresses 127.0.0.2-251 (loopback brokers only).
    #[arg(long, global = true)]
    no_spread: bool,
    /// Measured seconds (after warm-up); qos1 and fanout.
    #[arg(long, global = true, default_value_t = 20.0)]
    duration: f64,
    /// Warm-up seconds, not counted; qos1 and fanout.
    #[arg(long, global = true, default_value_t = 3.0)]
    warmup: f64,
    /// Runtime worker threads: 1 = current-thread runtime (default, see crate docs).
    #[arg(long, global = true, default_value_t = 1)]
    threads: usize,
    /// PID of the broker (same machine): its CPU time over the measured window, and for `idle`
    /// its RSS, are reported.
    #[arg(long, global = true)]
    broker_pid: Option<u32>,
    /// Print one JSON object instead of the human-readable report.
    #[arg(long, global = true)]
    json: bool,
    /// Label copied into the report (e.g. "mosquitto").
    #[arg(long, global = true, default_value = "")]
    label: String,
}

#[derive(Subcommand, Debug, Clone)]
enum Workload {
    /// QoS 1 publishers with a window of unacknowledged publishes, one persistent QoS 1 subscriber.
    Qos1(qos1::Args),
    /// One publisher, thousands of subscribers on its topic.
    Fanout(fanout::Args),
    /// Thousands of idle connections; the broker's RSS per connection.
    Idle(idle::Args),
    /// Thousands of persistent sessions reconnecting at once; time and broker CPU.
    Storm(storm::Args),
}

impl Common {
    fn target(&self) -> Target {
        let opt = |s: &str| (!s.is_empty()).then(|| s.to_string());
        Target {
            addr: self.addr,
            user: opt(&self.user),
            pass: opt(&self.pass),
            spread: !self.no_spread,
        }
    }

    fn plan(&self) -> Result<Plan> {
        if !(self.duration > 0.0 && self.warmup >= 0.0) {
            return err("--duration must be > 0 and --warmup >= 0");
        }
        let start_ns = stats::now_ns();
        let warmup_end_ns = start_ns + (self.warmup * 1e9) as u64;
        Ok(Plan {
            start_ns,
            warmup_end_ns,
            end_ns: warmup_end_ns + (self.duration * 1e9) as u64,
        })
    }
}

/// Timeline of a run, in nanoseconds since the process epoch (see [`stats::now_ns`]).
#[derive(Debug, Clone, Copy)]
pub struct Plan {
    pub start_ns: u64,
    pub warmup_end_ns: u64,
    pub end_ns: u64,
}

fn main() {
    let cli = Cli::parse();
    let rt = if cli.common.threads <= 1 {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
    } else {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(cli.common.threads)
            .enable_all()
            .build()
    };
    let c = cli.common.clone();
    let result = rt.ctx("building tokio runtime").and_then(|rt| {
        rt.block_on(async {
            match cli.workload {
                Workload::Qos1(a) => qos1::run(&c, a).await,
                Workload::Fanout(a) => fanout::run(&c, a).await,
                Workload::Idle(a) => idle::run(&c, a).await,
                Workload::Storm(a) => storm::run(&c, a).await,
            }
        })
    });
    match result {
        Ok(mut report) => {
            report["label"] = json!(c.label);
            report["addr"] = json!(c.addr.to_string());
            report["threads"] = json!(c.threads);
            report["cores"] = json!(std::thread::available_parallelism().map(|n| n.get()).ok());
            let text = if c.json {
                format!("{report}\n")
            } else {
                human(&report)
            };
            // One write whose error is ignored, so piping into `head` does not panic.
            let _ = std::io::Write::write_all(&mut std::io::stdout(), text.as_bytes());
        }
        Err(e) => {
            eprintln!("weir-mqtt-bench: {e}");
            #[allow(clippy::exit)] // the error is printed; nothing is left to clean up
            std::process::exit(1);
        }
    }
}

/// The report as indented `key: value` lines.
fn human(v: &Value) -> String {
    fn walk(v: &Value, indent: usize, out: &mut String) {
        if let Value::Object(m) = v {
            for (k, x) in m {
                match x {
                    Value::Object(_) => {
                        out.push_str(&format!("{:indent$}{k}:\n", ""));
                        walk(x, indent + 2, out);
                    }
                    Value::Array(a) if a.len() > 6 => {
                        out.push_str(&format!("{:indent$}{k}: [{} items]\n", "", a.len()))
                    }
                    Value::Number(n) if n.is_f64() => out.push_str(&format!(
                        "{:indent$}{k}: {:.3}\n",
                        "",
                        n.as_f64().unwrap_or(0.0)
                    )),
                    _ => out.push_str(&format!("{:indent$}{k}: {x}\n", "")),
                }
            }
        }
    }
    let mut out = String::new();
    walk(v, 0, &mut out);
    out
}

/// Percentiles as the JSON object weir-bench writes.
pub fn pct(p: &Percentiles) -> Value {
    json!({"count": p.count, "p50_ms": p.p50, "p95_ms": p.p95, "p99_ms": p.p99, "max_ms": p.max})
}

/// CPU time of this process, the broker and the whole machine over the measured window.
pub struct CpuWindow {
    broker_pid: Option<String>,
    start: (
        Option<std::time::Duration>,
        Option<std::time::Duration>,
        Option<u64>,
    ),
}

impl CpuWindow {
    /// Start sampling now.
    pub fn start(broker_pid: Option<u32>) -> CpuWindow {
        let broker_pid = broker_pid.map(|p| p.to_string());
        let start = Self::sample(broker_pid.as_deref());
        CpuWindow { broker_pid, start }
    }

    fn sample(
        pid: Option<&str>,
    ) -> (
        Option<std::time::Duration>,
        Option<std::time::Duration>,
        Option<u64>,
    ) {
        (
            stats::process_cpu_time(),
            pid.and_then(stats::cpu_time_of),
            stats::machine_cpu_ticks(),
        )
    }

    /// Stop now; [`CpuUsed::json`] turns the result into the report's fields.
    pub fn stop(&self) -> CpuUsed {
        let end = Self::sample(self.broker_pid.as_deref());
        let d = |a: Option<std::time::Duration>, b: Option<std::time::Duration>| match (a, b) {
            (Some(a), Some(b)) => Some(b.saturating_sub(a).as_secs_f64()),
            _ => None,
        };
        CpuUsed {
            client: d(self.start.0, end.0),
            broker: d(self.start.1, end.1),
            machine: match (self.start.2, end.2) {
                (Some(a), Some(b)) => Some(b.saturating_sub(a) as f64 / 100.0),
                _ => None,
            },
        }
    }
}

/// CPU seconds used over a window: this process, the broker, the whole machine.
#[derive(Debug, Clone, Copy)]
pub struct CpuUsed {
    client: Option<f64>,
    broker: Option<f64>,
    machine: Option<f64>,
}

impl CpuUsed {
    /// The JSON fields weir-bench reports (`client_cpu_cores`, `broker_cpu_cores`,
    /// `broker_cpu_us_per_msg`, `other_cpu_cores`, ...), per `msgs` messages over `secs`.
    pub fn json(&self, secs: f64, msgs: u64) -> Value {
        let per = |s: Option<f64>| s.filter(|_| msgs > 0).map(|s| s * 1e6 / msgs as f64);
        let other = match (self.machine, self.client, self.broker) {
            (Some(m), Some(c), Some(b)) => Some(((m - c - b) / secs).max(0.0)),
            _ => None,
        };
        json!({
            "client_cpu_cores": self.client.map(|c| c / secs),
            "client_cpu_us_per_msg": per(self.client),
            "broker_cpu_cores": self.broker.map(|c| c / secs),
            "broker_cpu_us_per_msg": per(self.broker),
            "machine_busy_cores": self.machine.map(|c| c / secs),
            "other_cpu_cores": other,
        })
    }
}

/// Merge `extra`'s fields into the object `into`.
pub fn merge(into: &mut Value, extra: Value) {
    if let (Value::Object(a), Value::Object(b)) = (into, extra) {
        a.extend(b);
    }
}

/// `VmRSS` of `pid`, bytes.
pub fn rss_of(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_its_own_rss() {
        assert!(rss_of(std::process::id()).unwrap() > 0);
    }

    #[test]
    fn cpu_window_reports_the_client() {
        let w = CpuWindow::start(Some(std::process::id()));
        let v = w.stop().json(1.0, 10);
        assert!(v["client_cpu_cores"].is_number());
        assert!(v["broker_cpu_us_per_msg"].is_number());
    }
}
