//! `idle`: open thousands of MQTT connections that then do nothing, and measure what they cost
//! the broker: its `VmRSS` (from `/proc/PID/status`) before the first and after the last, divided
//! by the number of connections. RSS is also sampled after every step of `connections / steps`
//! connections, which shows whether the growth is linear (a per-connection cost) or a one-off.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;

use crate::client::{open_many, MqttConn};
use crate::conn::{err, BenchError, Result};
use crate::{rss_of, Common};

/// `idle` options.
#[derive(clap::Args, Debug, Clone)]
pub struct Args {
    /// Connections to open and hold.
    #[arg(long, default_value_t = 10_000)]
    connections: u32,
    /// Keep-alive announced in CONNECT, seconds. The broker may close a connection after 1.5x
    /// this without a packet, so `--hold` must stay below it.
    #[arg(long, default_value_t = 60)]
    keep_alive: u16,
    /// Seconds to hold every connection open after the last one is up, before the final RSS.
    #[arg(long, default_value_t = 10.0)]
    hold: f64,
    /// RSS samples while connecting: one after every connections/steps connections.
    #[arg(long, default_value_t = 10)]
    steps: u32,
    /// Also subscribe each connection to a topic of its own (QoS 1), as a device listening for
    /// commands would.
    #[arg(long)]
    subscribe: bool,
    /// Connection handshakes in progress at once.
    #[arg(long, default_value_t = 64)]
    connect_concurrency: usize,
}

pub async fn run(c: &Common, a: Args) -> Result<serde_json::Value> {
    let Some(pid) = c.broker_pid else {
        return err("idle needs --broker-pid (its RSS is the result)");
    };
    if a.hold >= f64::from(a.keep_alive) {
        return err("--hold must be shorter than --keep-alive");
    }
    let rss = || rss_of(pid).ok_or_else(|| BenchError(format!("cannot read /proc/{pid}/status")));
    let t = Arc::new(c.target());
    let n = a.connections as usize;
    let steps = a.steps.max(1) as usize;
    let client_pid = std::process::id();

    // Before: the median of a few samples over a second (a broker just started may still settle).
    let mut before = Vec::new();
    for _ in 0..5 {
        before.push(rss()?);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    before.sort_unstable();
    let rss_before = before[before.len() / 2];

    let started = Instant::now();
    let mut conns: Vec<MqttConn> = Vec::with_capacity(n);
    let mut samples = vec![json!({"connections": 0, "rss_bytes": rss_before})];
    let mut done = 0;
    for k in 1..=steps {
        let upto = n * k / steps;
        let (t, keep_alive, subscribe) = (t.clone(), a.keep_alive, a.subscribe);
        let offset = done;
        let more = open_many(upto - done, a.connect_concurrency, move |j| {
            let t = t.clone();
            let i = offset + j;
            async move {
                let id = format!("wmb-i-{client_pid}-{i}");
                let (mut s, _) = MqttConn::open(&t, i, &id, true, keep_alive, 256).await?;
                if subscribe {
                    s.subscribe(&format!("weir-bench/idle/{i}"), 1).await?;
                }
                Ok(s)
            }
        })
        .await?;
        conns.extend(more);
        done = upto;
        samples.push(json!({"connections": done, "rss_bytes": rss()?}));
    }
    let connect_s = started.elapsed().as_secs_f64();

    // Hold: the broker may allocate lazily (timers, first keep-alive checks); the last sample counts.
    let hold_end = Instant::now() + Duration::from_secs_f64(a.hold);
    let mut rss_max = 0;
    let mut rss_after = 0;
    while Instant::now() < hold_end {
        tokio::time::sleep(Duration::from_millis(250)).await;
        rss_after = rss()?;
        rss_max = rss_max.max(rss_after);
    }
    let alive = conns.iter().filter(|c| c.alive()).count();
    let growth = rss_after.saturating_sub(rss_before);
    let per_conn = growth as f64 / n.max(1) as f64;

    for c in conns {
        c.close_now();
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let rss_closed = rss()?;

    Ok(json!({
        "workload": "idle",
        "connections": n,
        "subscribe": a.subscribe,
        "keep_alive": a.keep_alive,
        "hold_s": a.hold,
        "connect_s": connect_s,
        "alive_at_end": alive,
        "rss_before_bytes": rss_before,
        "rss_after_bytes": rss_after,
        "rss_max_bytes": rss_max,
        "rss_after_close_bytes": rss_closed,
        "rss_growth_bytes": growth,
        "rss_per_conn_bytes": per_conn,
        "samples": samples,
    }))
}
