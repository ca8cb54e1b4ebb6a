//! `storm`: a reconnect storm of persistent sessions. `--sessions` clients each open a persistent
//! session (clean session off), subscribe to a topic of their own (QoS 1) and disconnect, so the
//! broker keeps every session with its subscription; then all of them reconnect at once (at most
//! `--storm-concurrency` handshakes in flight) and the run reports how long until the last
//! CONNACK, the broker's CPU over that window and the handshake latencies. Every CONNACK must say
//! the session was present: a broker that lost one fails the run.
//!
//! Resuming a session costs the broker its own subscriptions if it looks them up through the
//! session queue's bindings, and every session's subscriptions if it walks the whole topic
//! exchange: the ratio of 10,000 sessions to 1,000 tells which (about 10x against about 100x).

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;

use crate::client::{open_many, MqttConn};
use crate::conn::{err, Result};
use crate::stats::{self, new_histogram, record_ns, Percentiles};
use crate::{pct, Common, CpuWindow};

/// `storm` options.
#[derive(clap::Args, Debug, Clone)]
pub struct Args {
    /// Persistent sessions, each with one subscription.
    #[arg(long, default_value_t = 10_000)]
    sessions: u32,
    /// Handshakes in flight at once while the sessions are made (not measured).
    #[arg(long, default_value_t = 64)]
    setup_concurrency: usize,
    /// Handshakes in flight at once during the storm: "all at once", bounded by the broker's
    /// listen backlog (std's 128): past it, SYNs are dropped and retried after TCP's 1 s timeout,
    /// and the run measures that timer instead of the broker (at 512, a third of the CONNACKs of
    /// 1,000 sessions come after 1 s on either build).
    #[arg(long, default_value_t = 128)]
    storm_concurrency: usize,
    /// Keep-alive announced in CONNECT, seconds.
    #[arg(long, default_value_t = 300)]
    keep_alive: u16,
    /// Longest wait for the broker to go quiet between setup and storm, seconds.
    #[arg(long, default_value_t = 60.0)]
    settle: f64,
    /// After the storm, end every session (reconnect with clean session on), leaving the broker
    /// as it was.
    #[arg(long)]
    cleanup: bool,
}

pub async fn run(c: &Common, a: Args) -> Result<serde_json::Value> {
    let t = Arc::new(c.target());
    let n = a.sessions as usize;
    let pid = std::process::id();
    let keep_alive = a.keep_alive;
    let id_of = move |i: usize| format!("wmb-s-{pid}-{i}");

    // Setup: every session made, subscribed, and left (DISCONNECT keeps a persistent session).
    let started = Instant::now();
    let tt = t.clone();
    open_many(n, a.setup_concurrency, move |i| {
        let t = tt.clone();
        async move {
            let (mut s, present) = MqttConn::open(&t, i, &id_of(i), false, keep_alive, 256).await?;
            if present {
                return err("a fresh client id found a session: use a fresh broker");
            }
            s.subscribe(&format!("weir-bench/storm/{i}"), 1).await?;
            s.close().await;
            Ok(())
        }
    })
    .await?;
    let setup_s = started.elapsed().as_secs_f64();
    let quiet = settle(c.broker_pid, Duration::from_secs_f64(a.settle)).await;

    // The storm: every session comes back at once.
    let cpu = CpuWindow::start(c.broker_pid);
    let started = Instant::now();
    let tt = t.clone();
    let conns = open_many(n, a.storm_concurrency, move |i| {
        let t = tt.clone();
        async move {
            let at = stats::now_ns();
            let (s, present) = MqttConn::open(&t, i, &id_of(i), false, keep_alive, 256).await?;
            let took = stats::now_ns().saturating_sub(at);
            if !present {
                return err(format!("session {} was not present", id_of(i)));
            }
            Ok((s, took))
        }
    })
    .await?;
    let storm_s = started.elapsed().as_secs_f64();
    let used = cpu.stop();
    let mut lat = new_histogram();
    for (_, took) in &conns {
        record_ns(&mut lat, *took);
    }
    for (s, _) in conns {
        s.close_now();
    }

    if a.cleanup {
        let tt = t.clone();
        open_many(n, a.setup_concurrency, move |i| {
            let t = tt.clone();
            async move {
                let (s, _) = MqttConn::open(&t, i, &id_of(i), true, keep_alive, 256).await?;
                s.close().await;
                Ok(())
            }
        })
        .await?;
    }

    let mut report = json!({
        "workload": "storm",
        "sessions": n,
        "storm_concurrency": a.storm_concurrency,
        "setup_s": setup_s,
        "broker_quiet_before_storm": quiet,
        "storm_s": storm_s,
        "sessions_per_s": n as f64 / storm_s.max(1e-9),
        "connack_latency": pct(&Percentiles::of(&lat)),
    });
    let cpu = used.json(storm_s, n as u64);
    report["broker_cpu_s"] = json!(cpu["broker_cpu_cores"].as_f64().map(|c| c * storm_s));
    report["broker_cpu_us_per_session"] = cpu["broker_cpu_us_per_msg"].clone();
    report["client_cpu_s"] = json!(cpu["client_cpu_cores"].as_f64().map(|c| c * storm_s));
    crate::merge(&mut report, cpu);
    Ok(report)
}

/// Waits (at most `limit`) until the broker uses under 5% of a core over half a second: the
/// sessions just left are being released (and their records written), which must not be counted
/// in the storm. Without a broker PID, waits two seconds. Whether it went quiet.
async fn settle(broker_pid: Option<u32>, limit: Duration) -> bool {
    let Some(pid) = broker_pid.map(|p| p.to_string()) else {
        tokio::time::sleep(Duration::from_secs(2)).await;
        return false;
    };
    let end = Instant::now() + limit;
    let step = Duration::from_millis(500);
    while Instant::now() < end {
        let Some(a) = stats::cpu_time_of(&pid) else {
            return false;
        };
        tokio::time::sleep(step).await;
        let Some(b) = stats::cpu_time_of(&pid) else {
            return false;
        };
        if b.saturating_sub(a).as_secs_f64() < 0.05 * step.as_secs_f64() {
            return true;
        }
    }
    false
}
