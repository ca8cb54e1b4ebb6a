//! `weir-expiry`: issue 7's expiry benchmark. Publishes N persistent messages with random per-message
//! TTLs (`expiration`) into a durable queue nobody consumes, lets them all expire, and measures
//!
//! - the broker's memory per queued message: peak RSS (sampled `VmRSS` and the kernel's `VmHWM`,
//!   reset before the run through `/proc/PID/clear_refs`) minus the RSS just before publishing,
//!   divided by N;
//! - whether every message expired: the queue's depth (passive `queue.declare`) polled until 0;
//! - stalls of a concurrent publisher: a probe connection publishes confirmed messages to another
//!   queue at a steady rate throughout (a consumer drains it), and the report gives, per phase
//!   (baseline, fill, waiting, expiry, after), its confirm latency from the *intended* send time and
//!   the longest gap between two confirms. The baseline phase, before anything is published, shows
//!   what the disk alone does to the probe.
//!
//! The broker's lifecycle (fresh data dir, start, stop) is `scripts/bench-expiry.sh`'s job.

#![forbid(unsafe_code)]

#[allow(dead_code)] // shared with weir-bench; not every helper is used here
#[path = "../conn.rs"]
mod conn;
#[allow(dead_code)]
#[path = "../stats.rs"]
mod stats;

use std::collections::VecDeque;
use std::time::Duration;

use amq_protocol::frame::AMQPFrame;
use amq_protocol::protocol::{basic, queue, AMQPClass, BasicProperties};
use amq_protocol::types::{FieldTable, ShortString};
use amq_protocol::uri::AMQPUri;
use clap::Parser;
use tokio::sync::watch;

use conn::{encode_publish_with, err, BenchError, Conn, Context, Result};
use stats::now_ns;

/// Publish N messages with random TTLs into an unconsumed durable queue, let them expire, and
/// measure the broker's RSS per message and the stalls of a concurrent confirmed publisher.
#[derive(Parser, Debug, Clone)]
#[command(version)]
struct Args {
    /// Broker URL: amqp://user:pass@host:port/vhost (vhost "/" is written %2f).
    #[arg(long, default_value = "amqp://guest:guest@127.0.0.1:5672/%2f")]
    url: String,
    /// Broker process id, for its RSS (`/proc/PID/status`).
    #[arg(long)]
    pid: u32,
    /// Messages to publish (and see expire).
    #[arg(long, default_value_t = 1_000_000)]
    messages: u64,
    /// Body size in bytes.
    #[arg(long, default_value_t = 16)]
    size: u32,
    /// Shortest per-message TTL, ms. The default leaves time to publish every message before the
    /// first one expires, so the peak holds all of them.
    #[arg(long, default_value_t = 10_000)]
    ttl_min_ms: u64,
    /// Longest per-message TTL, ms (TTLs are uniform between the two).
    #[arg(long, default_value_t = 30_000)]
    ttl_max_ms: u64,
    /// Publisher connections for the bulk publish.
    #[arg(long, default_value_t = 2)]
    publishers: u32,
    /// Unconfirmed publishes in flight per bulk publisher.
    #[arg(long, default_value_t = 512)]
    window: u32,
    /// Probe publisher rate, msg/s (confirmed, persistent, to its own queue).
    #[arg(long, default_value_t = 1000)]
    probe_rate: u32,
    /// Seconds of probing before the bulk publish (the baseline phase).
    #[arg(long, default_value_t = 5.0)]
    baseline: f64,
    /// Seconds of probing after the queue is empty.
    #[arg(long, default_value_t = 5.0)]
    after: f64,
    /// Give up if the queue is not empty this many seconds after the longest TTL has passed.
    #[arg(long, default_value_t = 120.0)]
    timeout: f64,
    /// Queue that receives the messages that expire.
    #[arg(long, default_value = "weir-expiry")]
    queue: String,
    /// Queue the probe publishes to.
    #[arg(long, default_value = "weir-expiry-probe")]
    probe_queue: String,
    /// Print one JSON object instead of the human-readable report.
    #[arg(long)]
    json: bool,
}

fn main() {
    let args = Args::parse();
    let result = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .ctx("building tokio runtime")
        .and_then(|rt| rt.block_on(run(args.clone())));
    match result {
        Ok(report) => {
            let text = if args.json {
                format!("{}\n", report)
            } else {
                human(&report)
            };
            let _ = std::io::Write::write_all(&mut std::io::stdout(), text.as_bytes());
        }
        Err(e) => {
            eprintln!("weir-expiry: {e}");
            std::process::exit(1);
        }
    }
}

// ------------------------------------------------------------------------------------------ memory

/// `VmRSS` and `VmHWM` of `pid`, in bytes.
fn rss_of(pid: u32) -> Option<(u64, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kb = |key: &str| -> Option<u64> {
        let line = status.lines().find(|l| l.starts_with(key))?;
        line[key.len()..]
            .trim()
            .trim_end_matches("kB")
            .trim()
            .parse::<u64>()
            .ok()
            .map(|k| k * 1024)
    };
    Some((kb("VmRSS:")?, kb("VmHWM:")?))
}

/// Reset the kernel's peak RSS (`VmHWM`) of `pid` to its current RSS (Linux ≥ 4.0; needs the right
/// to write the file, i.e. the same user or root). Returns whether it worked.
fn reset_hwm(pid: u32) -> bool {
    std::fs::write(format!("/proc/{pid}/clear_refs"), "5").is_ok()
}

// ------------------------------------------------------------------------------------------ admin

/// Delete `name` on a throwaway connection (a 404 on a missing queue would close the channel).
async fn delete_queue(uri: &AMQPUri, name: &str) -> Result<()> {
    let mut c = Conn::open(uri).await.ctx("setup connection")?;
    let _ = c
        .call(AMQPClass::Queue(queue::AMQPMethod::Delete(queue::Delete {
            queue: name.into(),
            if_unused: false,
            if_empty: false,
            nowait: false,
        })))
        .await;
    c.close().await;
    Ok(())
}

/// Declare (or, `passive`, look up) durable queue `name`; returns its message count.
async fn declare(conn: &mut Conn, name: &str, passive: bool) -> Result<u32> {
    let reply = conn
        .call(AMQPClass::Queue(queue::AMQPMethod::Declare(
            queue::Declare {
                queue: name.into(),
                passive,
                durable: true,
                exclusive: false,
                auto_delete: false,
                nowait: false,
                arguments: FieldTable::default(),
            },
        )))
        .await
        .ctx(format!("queue.declare {name}"))?;
    match reply {
        AMQPClass::Queue(queue::AMQPMethod::DeclareOk(ok)) => Ok(ok.message_count),
        other => err(format!("expected queue.declare-ok, got {other:?}")),
    }
}

// ------------------------------------------------------------------------------------------ bulk

/// xorshift64 (state never 0).
fn xorshift(state: &mut u64) -> u64 {
    let mut x = *state;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    *state = x;
    x
}

/// 4,096 pre-encoded persistent publishes to `queue`, each with an `expiration` drawn uniformly
/// from `ttl_min..=ttl_max` ms: a message picks one at random, so the TTLs are spread at ~ms
/// resolution without encoding frames per message.
fn ttl_variants(
    frame_max: u32,
    queue: &str,
    size: usize,
    ttl_min: u64,
    ttl_max: u64,
) -> Result<Vec<Vec<u8>>> {
    let mut rng = 0x2545_F491_4F6C_DD1D;
    (0..4096)
        .map(|_| {
            let ttl = ttl_min + xorshift(&mut rng) % (ttl_max - ttl_min + 1);
            let props = BasicProperties::default()
                .with_delivery_mode(2)
                .with_expiration(ShortString::from(ttl.to_string()));
            encode_publish_with(frame_max, "", queue, size, props).map(|(b, _)| b)
        })
        .collect()
}

/// What a bulk publisher saw.
#[derive(Default)]
struct BulkStats {
    confirmed: u64,
    nacked: u64,
}

/// Publish `count` messages drawn from `variants`, at most `window` unconfirmed, until all are
/// confirmed.
async fn bulk(
    mut conn: Conn,
    variants: &[Vec<u8>],
    count: u64,
    window: usize,
    seed: u64,
) -> Result<BulkStats> {
    conn.confirm_select().await?;
    let mut st = BulkStats::default();
    // Settled flags by delivery tag, from `first_tag`.
    let (mut first_tag, mut slots, mut inflight) = (1u64, VecDeque::<bool>::new(), 0usize);
    let (mut sent, mut rng) = (0u64, seed | 1);
    while st.confirmed + st.nacked < count {
        while inflight < window && sent < count {
            let v = &variants[(xorshift(&mut rng) % variants.len() as u64) as usize];
            conn.wbuf.extend_from_slice(v);
            slots.push_back(false);
            inflight += 1;
            sent += 1;
        }
        conn.flush().await?;
        conn.fill().await?;
        while let Some(frame) = conn.next_frame()? {
            let (tag, multiple, nack) = match frame {
                AMQPFrame::Method(_, AMQPClass::Basic(basic::AMQPMethod::Ack(a))) => {
                    (a.delivery_tag, a.multiple, false)
                }
                AMQPFrame::Method(_, AMQPClass::Basic(basic::AMQPMethod::Nack(n))) => {
                    (n.delivery_tag, n.multiple, true)
                }
                AMQPFrame::Heartbeat => continue,
                AMQPFrame::Method(_, AMQPClass::Connection(m)) => {
                    use amq_protocol::protocol::connection::AMQPMethod as C;
                    match m {
                        C::Blocked(_) | C::Unblocked(_) => continue,
                        other => return err(format!("bulk publisher: connection {other:?}")),
                    }
                }
                other => return err(format!("bulk publisher: unexpected frame {other}")),
            };
            let mut settle = |slot: &mut bool| {
                if !*slot {
                    *slot = true;
                    inflight -= 1;
                    if nack {
                        st.nacked += 1;
                    } else {
                        st.confirmed += 1;
                    }
                }
            };
            if tag < first_tag || tag >= first_tag + slots.len() as u64 {
                if multiple && tag < first_tag {
                    continue;
                }
                return err(format!("confirm for unknown delivery tag {tag}"));
            }
            let idx = (tag - first_tag) as usize;
            if multiple {
                slots.iter_mut().take(idx + 1).for_each(&mut settle);
            } else {
                settle(&mut slots[idx]);
            }
            while slots.front() == Some(&true) {
                slots.pop_front();
                first_tag += 1;
            }
        }
    }
    conn.close().await;
    Ok(st)
}

// ------------------------------------------------------------------------------------------ probe

/// One probe publish: when it was due, when it was written, when its confirm arrived (ns).
#[derive(Clone, Copy)]
struct ProbeEvent {
    intended: u64,
    confirmed: u64,
}

/// Publish one confirmed persistent message every `1/rate` s to `queue` until `stop` turns true,
/// then wait (≤ 5 s) for the outstanding confirms. Latency counts from the intended send time, so a
/// stalled broker shows up as latency, not as a lower send rate.
async fn probe(
    mut conn: Conn,
    queue: &str,
    rate: u32,
    mut stop: watch::Receiver<bool>,
) -> Result<(Vec<ProbeEvent>, u64)> {
    conn.confirm_select().await?;
    let (frame, _) = encode_publish_with(
        conn.frame_max,
        "",
        queue,
        16,
        BasicProperties::default().with_delivery_mode(2),
    )?;
    let period = Duration::from_nanos(1_000_000_000 / u64::from(rate.max(1)));
    let mut ticker = tokio::time::interval(period);
    // After a stall, send the backlog at once: every due message is published, late.
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let epoch = stats::deadline(0);
    let (mut first_tag, mut pending) = (1u64, VecDeque::<Option<u64>>::new());
    let mut events = Vec::with_capacity(1 << 17);
    let mut nacked = 0u64;
    let mut stopping = false;
    let mut drain_deadline = tokio::time::Instant::now();
    loop {
        if stopping && pending.iter().all(Option::is_none) {
            break;
        }
        tokio::select! {
            t = ticker.tick(), if !stopping => {
                let intended = t.saturating_duration_since(epoch).as_nanos() as u64;
                conn.wbuf.extend_from_slice(&frame);
                pending.push_back(Some(intended));
                conn.flush().await?;
            }
            r = conn.fill() => r?,
            _ = stop.changed(), if !stopping => {
                stopping = true;
                drain_deadline = tokio::time::Instant::now() + Duration::from_secs(5);
            }
            _ = tokio::time::sleep_until(drain_deadline), if stopping => break,
        }
        let now = now_ns();
        while let Some(f) = conn.next_frame()? {
            let (tag, multiple, nack) = match f {
                AMQPFrame::Method(_, AMQPClass::Basic(basic::AMQPMethod::Ack(a))) => {
                    (a.delivery_tag, a.multiple, false)
                }
                AMQPFrame::Method(_, AMQPClass::Basic(basic::AMQPMethod::Nack(n))) => {
                    (n.delivery_tag, n.multiple, true)
                }
                AMQPFrame::Heartbeat => continue,
                other => return err(format!("probe: unexpected frame {other}")),
            };
            let end = (tag + 1).saturating_sub(first_tag) as usize;
            let range = if multiple {
                0..end.min(pending.len())
            } else {
                end.saturating_sub(1)..end.min(pending.len())
            };
            for slot in pending.range_mut(range) {
                if let Some(intended) = slot.take() {
                    if nack {
                        nacked += 1;
                    } else {
                        events.push(ProbeEvent {
                            intended,
                            confirmed: now,
                        });
                    }
                }
            }
            while pending.front() == Some(&None) {
                pending.pop_front();
                first_tag += 1;
            }
        }
    }
    conn.close().await;
    Ok((events, nacked))
}

/// Drain `queue` with an auto-ack consumer until `stop`, so the probe queue stays empty and its
/// messages do not count in the broker's memory.
async fn drain(mut conn: Conn, queue: &str, mut stop: watch::Receiver<bool>) -> Result<u64> {
    let reply = conn
        .call(AMQPClass::Basic(basic::AMQPMethod::Consume(
            basic::Consume {
                queue: queue.into(),
                consumer_tag: "weir-expiry-drain".into(),
                no_local: false,
                no_ack: true,
                exclusive: false,
                nowait: false,
                arguments: FieldTable::default(),
            },
        )))
        .await
        .ctx("basic.consume")?;
    if !matches!(reply, AMQPClass::Basic(basic::AMQPMethod::ConsumeOk(_))) {
        return err(format!("expected basic.consume-ok, got {reply:?}"));
    }
    let mut delivered = 0u64;
    loop {
        tokio::select! {
            r = conn.fill() => r?,
            _ = stop.changed() => break,
        }
        while let Some(f) = conn.next_frame()? {
            if let AMQPFrame::Method(_, AMQPClass::Basic(basic::AMQPMethod::Deliver(_))) = f {
                delivered += 1;
            }
        }
    }
    conn.close().await;
    Ok(delivered)
}

// ------------------------------------------------------------------------------------------ report

/// One sample of the machine, every 20 ms: time (ns), broker RSS (bytes), and CPU seconds so far
/// of the broker, of the whole machine (busy) and of this process.
#[derive(Clone, Copy)]
struct Sample {
    t: u64,
    rss: u64,
    broker_cpu: f64,
    machine_busy: f64,
    own_cpu: f64,
}

fn sample(pid: u32) -> Option<Sample> {
    let secs = |d: Duration| d.as_secs_f64();
    Some(Sample {
        t: now_ns(),
        rss: rss_of(pid)?.0,
        broker_cpu: secs(stats::cpu_time_of(&pid.to_string())?),
        machine_busy: stats::machine_cpu_ticks()? as f64 / 100.0,
        own_cpu: secs(stats::process_cpu_time()?),
    })
}

/// Broker cores and other cores (machine busy minus broker minus this client: other work on the
/// machine, i.e. noise) over `[from, to)`, from the samples closest inside it.
fn cpu_between(samples: &[Sample], from: u64, to: u64) -> (Option<f64>, Option<f64>) {
    let a = samples.iter().find(|s| s.t >= from);
    let b = samples.iter().rev().find(|s| s.t <= to);
    match (a, b) {
        (Some(a), Some(b)) if b.t > a.t => {
            let dt = (b.t - a.t) as f64 / 1e9;
            let broker = (b.broker_cpu - a.broker_cpu) / dt;
            let own = (b.own_cpu - a.own_cpu) / dt;
            let other = ((b.machine_busy - a.machine_busy) / dt - broker - own).max(0.0);
            (Some(broker), Some(other))
        }
        _ => (None, None),
    }
}

/// Probe figures over `[from, to)` (by intended send time; confirm gaps by confirm time), as JSON.
fn phase(events: &[ProbeEvent], samples: &[Sample], from: u64, to: u64) -> serde_json::Value {
    let mut h = stats::new_histogram();
    let mut confirms: Vec<u64> = Vec::new();
    for e in events {
        if e.intended >= from && e.intended < to {
            stats::record_ns(&mut h, e.confirmed.saturating_sub(e.intended));
        }
        if e.confirmed >= from && e.confirmed < to {
            confirms.push(e.confirmed);
        }
    }
    confirms.sort_unstable();
    let max_gap = confirms.windows(2).map(|w| w[1] - w[0]).max().unwrap_or(0);
    let ms = |us: u64| us as f64 / 1000.0;
    let q = |x: f64| {
        if h.is_empty() {
            0.0
        } else {
            ms(h.value_at_quantile(x))
        }
    };
    let (broker_cores, other_cores) = cpu_between(samples, from, to);
    serde_json::json!({
        "seconds": (to.saturating_sub(from)) as f64 / 1e9,
        "broker_cores": broker_cores,
        "other_cores": other_cores,
        "count": h.len(),
        "p50_ms": q(0.5),
        "p99_ms": q(0.99),
        "p999_ms": q(0.999),
        "max_ms": if h.is_empty() { 0.0 } else { ms(h.max()) },
        "max_confirm_gap_ms": max_gap as f64 / 1e6,
    })
}

/// Per second of the run: the probe's worst confirm latency (ms), the broker's RSS (MB) and the
/// other work on the machine (cores), so a stall can be placed against the expiry and the noise.
fn timeline(events: &[ProbeEvent], samples: &[Sample], start: u64) -> Vec<serde_json::Value> {
    let secs = events
        .iter()
        .map(|e| e.intended)
        .chain(samples.iter().map(|r| r.t))
        .max()
        .unwrap_or(start)
        .saturating_sub(start)
        / 1_000_000_000
        + 1;
    let mut worst = vec![0u64; secs as usize];
    let mut mem = vec![0u64; secs as usize];
    for e in events.iter().filter(|e| e.intended >= start) {
        let s = ((e.intended - start) / 1_000_000_000) as usize;
        worst[s] = worst[s].max(e.confirmed.saturating_sub(e.intended));
    }
    for x in samples.iter().filter(|x| x.t >= start) {
        let s = ((x.t - start) / 1_000_000_000) as usize;
        mem[s] = mem[s].max(x.rss);
    }
    (0..secs as usize)
        .map(|s| {
            let from = start + s as u64 * 1_000_000_000;
            let (broker, other) = cpu_between(samples, from, from + 1_000_000_000);
            serde_json::json!({
                "t": s,
                "probe_max_ms": worst[s] as f64 / 1e6,
                "rss_mb": mem[s] as f64 / 1e6,
                "broker_cores": broker,
                "other_cores": other,
            })
        })
        .collect()
}

async fn run(args: Args) -> Result<serde_json::Value> {
    let uri: AMQPUri = args
        .url
        .parse()
        .map_err(|e| BenchError(format!("bad --url: {e}")))?;
    if args.ttl_min_ms > args.ttl_max_ms || args.messages == 0 || args.publishers == 0 {
        return err("need --ttl-min-ms <= --ttl-max-ms, --messages > 0 and --publishers > 0");
    }
    rss_of(args.pid).ok_or_else(|| BenchError(format!("cannot read /proc/{}/status", args.pid)))?;

    for q in [&args.queue, &args.probe_queue] {
        delete_queue(&uri, q).await?;
    }
    let mut admin = Conn::open(&uri).await.ctx("admin connection")?;
    declare(&mut admin, &args.queue, false).await?;
    declare(&mut admin, &args.probe_queue, false).await?;

    let (stop_tx, stop_rx) = watch::channel(false);
    let drainer = {
        let c = Conn::open(&uri).await.ctx("probe consumer")?;
        let (q, s) = (args.probe_queue.clone(), stop_rx.clone());
        tokio::spawn(async move { drain(c, &q, s).await })
    };
    let prober = {
        let c = Conn::open(&uri).await.ctx("probe publisher")?;
        let (q, s, r) = (args.probe_queue.clone(), stop_rx.clone(), args.probe_rate);
        tokio::spawn(async move { probe(c, &q, r, s).await })
    };
    // RSS every 20 ms until the end; VmHWM catches what falls between samples.
    let hwm_reset = reset_hwm(args.pid);
    let sampler = {
        let (pid, mut s) = (args.pid, stop_rx.clone());
        tokio::spawn(async move {
            let mut samples = Vec::new();
            let mut tick = tokio::time::interval(Duration::from_millis(20));
            loop {
                tokio::select! {
                    _ = tick.tick() => {}
                    _ = s.changed() => break,
                }
                if let Some(x) = sample(pid) {
                    samples.push(x);
                }
            }
            samples
        })
    };
    let t_start = now_ns();
    // Wall clock of t = 0, to line the timeline up with the broker's log.
    let started_at_unix_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let started_at_uptime_s = std::fs::read_to_string("/proc/uptime")
        .ok()
        .and_then(|u| u.split_whitespace().next()?.parse::<f64>().ok());

    // Baseline: only the probe runs.
    tokio::time::sleep(Duration::from_secs_f64(args.baseline)).await;
    let (rss_before, _) = rss_of(args.pid).ok_or_else(|| BenchError("broker exited".into()))?;

    // Fill.
    let mut conns = Vec::new();
    for i in 0..args.publishers {
        conns.push(Conn::open(&uri).await.ctx(format!("bulk publisher {i}"))?);
    }
    let variants = ttl_variants(
        conns[0].frame_max,
        &args.queue,
        args.size as usize,
        args.ttl_min_ms,
        args.ttl_max_ms,
    )?;
    let variants = std::sync::Arc::new(variants);
    let t_fill = now_ns();
    let mut tasks = Vec::new();
    for (i, c) in conns.into_iter().enumerate() {
        let n = args.messages / u64::from(args.publishers)
            + u64::from((i as u64) < args.messages % u64::from(args.publishers));
        let (v, w) = (variants.clone(), args.window as usize);
        let seed = 0x9E37_79B9_7F4A_7C15u64.wrapping_mul(i as u64 + 1);
        tasks.push(tokio::spawn(async move { bulk(c, &v, n, w, seed).await }));
    }
    let mut bulk_st = BulkStats::default();
    for (i, t) in tasks.into_iter().enumerate() {
        let s = t
            .await
            .ctx("bulk publisher panicked")?
            .ctx(format!("bulk publisher {i}"))?;
        bulk_st.confirmed += s.confirmed;
        bulk_st.nacked += s.nacked;
    }
    let t_filled = now_ns();
    let depth_filled = declare(&mut admin, &args.queue, true).await?;
    let (rss_filled, _) = rss_of(args.pid).ok_or_else(|| BenchError("broker exited".into()))?;

    // Wait for the queue to empty: every message expired.
    let first_expiry = t_fill + args.ttl_min_ms * 1_000_000;
    let give_up = t_filled + args.ttl_max_ms * 1_000_000 + (args.timeout * 1e9) as u64;
    let mut max_depth = depth_filled;
    let (mut depth, mut t_empty) = (depth_filled, None);
    while now_ns() < give_up {
        depth = declare(&mut admin, &args.queue, true).await?;
        max_depth = max_depth.max(depth);
        if depth == 0 {
            t_empty = Some(now_ns());
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let t_end_expiry = t_empty.unwrap_or_else(now_ns);
    tokio::time::sleep(Duration::from_secs_f64(args.after)).await;
    let t_stop = now_ns();
    let _ = stop_tx.send(true);
    let (events, probe_nacked) = prober.await.ctx("probe panicked")??;
    let drained = drainer.await.ctx("probe consumer panicked")??;
    let samples = sampler.await.ctx("sampler panicked")?;
    let depth_end = declare(&mut admin, &args.queue, true).await?;
    let (rss_end, hwm) = rss_of(args.pid).ok_or_else(|| BenchError("broker exited".into()))?;
    for q in [&args.queue, &args.probe_queue] {
        let _ = admin
            .call(AMQPClass::Queue(queue::AMQPMethod::Delete(queue::Delete {
                queue: q.as_str().into(),
                if_unused: false,
                if_empty: false,
                nowait: false,
            })))
            .await;
    }
    admin.close().await;

    let sampled_peak = samples.iter().map(|s| s.rss).max().unwrap_or(0);
    // VmHWM is exact only if it was reset at the start (otherwise start-up may have set it).
    let peak = if hwm_reset {
        sampled_peak.max(hwm)
    } else {
        sampled_peak
    };
    let growth = peak.saturating_sub(rss_before);
    let per_msg = growth as f64 / args.messages as f64;
    let expiry_phase_start = first_expiry.max(t_filled);
    let probe_expiry = phase(&events, &samples, expiry_phase_start, t_end_expiry);
    let probe_base = phase(&events, &samples, t_start, t_fill);
    let s = |ns: u64| ns as f64 / 1e9;
    Ok(serde_json::json!({
        "messages": args.messages,
        "size": args.size,
        "ttl_ms": [args.ttl_min_ms, args.ttl_max_ms],
        "publishers": args.publishers,
        "window": args.window,
        "probe_rate": args.probe_rate,
        "fill_s": s(t_filled - t_fill),
        "fill_rate": args.messages as f64 / s(t_filled - t_fill).max(1e-9),
        "confirmed": bulk_st.confirmed,
        "nacked": bulk_st.nacked,
        "depth_after_fill": depth_filled,
        "max_depth_seen": max_depth,
        "emptied": t_empty.is_some(),
        "depth_at_end": depth_end,
        "depth_when_gave_up": if t_empty.is_some() { None } else { Some(depth) },
        // Time from the end of the fill to an empty queue; the last deadline is at most
        // fill end + ttl_max, so lateness above that is expiry lagging behind its deadlines.
        "empty_after_fill_s": t_empty.map(|t| s(t - t_filled)),
        "empty_after_last_deadline_s": t_empty.map(|t| (t as f64 - (t_filled + args.ttl_max_ms * 1_000_000) as f64) / 1e9),
        "rss_before_mb": rss_before as f64 / 1e6,
        "rss_filled_mb": rss_filled as f64 / 1e6,
        "rss_peak_mb": peak as f64 / 1e6,
        "rss_end_mb": rss_end as f64 / 1e6,
        "hwm_reset": hwm_reset,
        "rss_growth_bytes_per_msg": per_msg,
        "probe": {
            "baseline": probe_base,
            "fill": phase(&events, &samples, t_fill, t_filled),
            "waiting": phase(&events, &samples, t_filled, expiry_phase_start.max(t_filled)),
            "expiry": probe_expiry,
            "after": phase(&events, &samples, t_end_expiry, t_stop),
            "nacked": probe_nacked,
            "drained": drained,
        },
        "started_at_unix_ms": started_at_unix_ms,
        // And in seconds since boot (/proc/uptime, 10 ms resolution): `perf trace` timestamps.
        "started_at_uptime_s": started_at_uptime_s,
        // The probe messages confirmed more than 10 ms after they were due (at most 200), as
        // [due, latency] in ms since t = 0 / ms: where the stalls were, to line up with the log.
        "slow_probes": events
            .iter()
            .filter(|e| e.confirmed.saturating_sub(e.intended) > 10_000_000)
            .take(200)
            .map(|e| serde_json::json!([
                (e.intended.saturating_sub(t_start)) as f64 / 1e6,
                (e.confirmed - e.intended) as f64 / 1e6
            ]))
            .collect::<Vec<_>>(),
        "timeline": timeline(&events, &samples, t_start),
        "phases_s": {
            "fill": s(t_fill - t_start),
            "filled": s(t_filled - t_start),
            "first_expiry": s(expiry_phase_start - t_start),
            "empty": s(t_end_expiry - t_start),
            "stop": s(t_stop - t_start),
        },
    }))
}

/// The human-readable report.
fn human(r: &serde_json::Value) -> String {
    use std::fmt::Write as _;
    let mut o = String::new();
    let f = |v: &serde_json::Value| v.as_f64().unwrap_or(f64::NAN);
    let _ = writeln!(
        o,
        "weir-expiry: {} messages of {} B, TTL {}..{} ms, persistent, durable queue, no consumer",
        r["messages"], r["size"], r["ttl_ms"][0], r["ttl_ms"][1]
    );
    let _ = writeln!(
        o,
        "  fill: {:.2} s ({:.0} msg/s), confirmed {}, nacked {}, depth after fill {}",
        f(&r["fill_s"]),
        f(&r["fill_rate"]),
        r["confirmed"],
        r["nacked"],
        r["depth_after_fill"]
    );
    let _ = writeln!(
        o,
        "  expired: {} (depth at end {}); empty {:.2} s after the fill, {:.2} s after the last deadline",
        if r["emptied"] == true { "all" } else { "NOT ALL" },
        r["depth_at_end"],
        f(&r["empty_after_fill_s"]),
        f(&r["empty_after_last_deadline_s"])
    );
    let _ = writeln!(
        o,
        "  RSS: before {:.1} MB, filled {:.1} MB, peak {:.1} MB, end {:.1} MB -> {:.1} B per message (VmHWM reset: {})",
        f(&r["rss_before_mb"]),
        f(&r["rss_filled_mb"]),
        f(&r["rss_peak_mb"]),
        f(&r["rss_end_mb"]),
        f(&r["rss_growth_bytes_per_msg"]),
        r["hwm_reset"]
    );
    let _ = writeln!(
        o,
        "  probe ({} msg/s, confirmed, to another queue): confirm latency from intended send",
        r["probe_rate"]
    );
    for p in ["baseline", "fill", "waiting", "expiry", "after"] {
        let x = &r["probe"][p];
        let _ = writeln!(
            o,
            "    {p:<9} {:>6.1} s  n={:<6} p50 {:>7.3}  p99 {:>7.3}  p99.9 {:>7.3}  max {:>7.3} ms  max gap {:>7.3} ms  broker {:.2} / other {:.2} cores",
            f(&x["seconds"]),
            x["count"],
            f(&x["p50_ms"]),
            f(&x["p99_ms"]),
            f(&x["p999_ms"]),
            f(&x["max_ms"]),
            f(&x["max_confirm_gap_ms"]),
            f(&x["broker_cores"]),
            f(&x["other_cores"])
        );
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_its_own_rss() {
        let (rss, hwm) = rss_of(std::process::id()).unwrap();
        assert!(rss > 0 && hwm >= rss);
    }

    /// Latency counts from the intended send time of the messages sent in the phase; the longest
    /// gap is between consecutive confirms inside it.
    #[test]
    fn phase_reports_latency_and_the_longest_gap() {
        let ms = 1_000_000;
        let ev = |intended: u64, confirmed: u64| ProbeEvent {
            intended: intended * ms,
            confirmed: confirmed * ms,
        };
        // Sent every ms; the broker stalls from 3 to 20 ms, then confirms the backlog at once.
        let events = [
            ev(1, 2),
            ev(2, 3),
            ev(3, 20),
            ev(4, 20),
            ev(5, 21),
            ev(50, 51),
        ];
        let p = phase(&events, &[], 0, 30 * ms);
        assert_eq!(p["count"], 5);
        // hdrhistogram keeps 3 significant digits.
        assert!((p["max_ms"].as_f64().unwrap() - 17.0).abs() < 0.02, "{p}");
        assert_eq!(p["max_confirm_gap_ms"], 17.0);
        assert_eq!(p["other_cores"], serde_json::Value::Null);
    }

    #[test]
    fn ttl_variants_stay_in_range() {
        for v in ttl_variants(4096, "q", 16, 1000, 1002).unwrap() {
            let (rest, _) = amq_protocol::frame::parse_frame(&v[..]).unwrap();
            match amq_protocol::frame::parse_frame(rest).unwrap().1 {
                AMQPFrame::Header(_, h) => {
                    let ttl: u64 = h
                        .properties
                        .expiration()
                        .as_ref()
                        .unwrap()
                        .as_str()
                        .parse()
                        .unwrap();
                    assert!((1000..=1002).contains(&ttl));
                    assert_eq!(h.properties.delivery_mode(), &Some(2));
                }
                other => panic!("expected header, got {other:?}"),
            }
        }
    }
}
