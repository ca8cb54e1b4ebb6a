//! `fanout`: thousands of subscriber connections on one topic, one publisher.
//!
//! The publisher keeps `--window` publishes "in fan-out": sent and not yet received by every
//! subscriber (or given up on after `--fanout-timeout`, e.g. a QoS 0 message the broker dropped).
//! That keeps the broker busy without letting an unbounded backlog build up in it (a fixed rate
//! would have to be tuned per broker), and it gives two latencies: publish → deliver for every
//! delivery, and publish → the last subscriber for every publish.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use hdrhistogram::Histogram;
use serde_json::json;
use tokio::sync::Notify;
use tokio::time::sleep_until;

use crate::client::{open_many, MqttConn};
use crate::conn::{err, Context, Result};
use crate::stats::{self, new_histogram, now_ns, record_ns, Percentiles};
use crate::wire::{self, Packet, PublishTemplate};
use crate::{merge, pct, Common, CpuWindow, Plan};

/// `fanout` options.
#[derive(clap::Args, Debug, Clone)]
pub struct Args {
    /// Subscriber connections.
    #[arg(long, default_value_t = 10_000)]
    subscribers: u32,
    /// QoS of the publishes and of the subscriptions (0 or 1).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=1))]
    qos: u8,
    /// Publishes in fan-out at once (sent, not yet received by every subscriber).
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=1024))]
    window: u32,
    /// Seconds after which a publish not received by every subscriber stops counting against the
    /// window (reported as incomplete).
    #[arg(long, default_value_t = 10.0)]
    fanout_timeout: f64,
    /// Payload bytes (at least 16: send time and sequence number).
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(16..=1_000_000))]
    size: u32,
    /// Topic.
    #[arg(long, default_value = "weir-bench/fanout")]
    topic: String,
    /// Connection handshakes (CONNECT + SUBSCRIBE) in progress at once while setting up.
    #[arg(long, default_value_t = 64)]
    connect_concurrency: usize,
}

/// Slots of the publishes in fan-out, by sequence number modulo the ring size.
const RING: usize = 4096;

/// What the subscribers share with the publisher.
struct Shared {
    subscribers: u32,
    /// Sequence number each slot currently tracks.
    seq: Vec<AtomicU64>,
    /// Subscribers that received the slot's publish.
    count: Vec<AtomicU32>,
    /// When the last subscriber received it (ns since the epoch).
    done_at: Vec<AtomicU64>,
    /// Woken when a publish reached every subscriber.
    done: Notify,
    /// Latency and counters, sharded so thousands of tasks rarely meet on one lock.
    shards: Vec<Mutex<Shard>>,
}

struct Shard {
    /// Publish → deliver, for messages published after warm-up.
    e2e: Histogram<u64>,
    /// Deliveries inside the measurement window.
    delivered: u64,
    delivered_total: u64,
    dups: u64,
}

const SHARDS: usize = 16;

pub async fn run(c: &Common, a: Args) -> Result<serde_json::Value> {
    let t = Arc::new(c.target());
    let n = a.subscribers as usize;
    let pid = std::process::id();

    // Set up every subscriber before the clock starts.
    let setup = Instant::now();
    let topic = Arc::new(a.topic.clone());
    let qos = a.qos;
    let subs = open_many(n, a.connect_concurrency, |i| {
        let (t, topic) = (t.clone(), topic.clone());
        async move {
            let id = format!("wmb-f-{pid}-{i}");
            let (mut s, _) = MqttConn::open(&t, i, &id, true, 60, 2048).await?;
            let granted = s.subscribe(&topic, qos).await?;
            if granted != qos {
                return err(format!("granted QoS {granted}, not {qos}"));
            }
            Ok(s)
        }
    })
    .await?;
    let setup_s = setup.elapsed().as_secs_f64();
    let (mut publisher, _) =
        MqttConn::open(&t, n, &format!("wmb-f-{pid}-pub"), true, 60, 64 * 1024)
            .await
            .ctx("publisher")?;
    let template = PublishTemplate::new(&a.topic, a.qos, a.size as usize)?;

    let shared = Arc::new(Shared {
        subscribers: a.subscribers,
        seq: (0..RING).map(|_| AtomicU64::new(u64::MAX)).collect(),
        count: (0..RING).map(|_| AtomicU32::new(0)).collect(),
        done_at: (0..RING).map(|_| AtomicU64::new(0)).collect(),
        done: Notify::new(),
        shards: (0..SHARDS)
            .map(|_| {
                Mutex::new(Shard {
                    e2e: new_histogram(),
                    delivered: 0,
                    delivered_total: 0,
                    dups: 0,
                })
            })
            .collect(),
    });

    let plan = c.plan()?;
    let mut tasks = Vec::with_capacity(n);
    for (i, s) in subs.into_iter().enumerate() {
        let shared = shared.clone();
        tasks.push(tokio::spawn(async move {
            subscriber(s, &shared, i % SHARDS, plan).await
        }));
    }

    // The publisher runs here, on the main task.
    let mut fan_lat = new_histogram();
    let mut puback = new_histogram();
    let (mut published, mut complete, mut incomplete) = (0u64, 0u64, 0u64);
    let timeout_ns = (a.fanout_timeout * 1e9) as u64;
    let mut outstanding: std::collections::VecDeque<(u64, u64)> = Default::default();
    let mut seq = 0u64;
    let mut sent_at = vec![0u64; 65_536];
    let mut cpu = None;
    let cpu_used = loop {
        let now = now_ns();
        if now >= plan.warmup_end_ns && cpu.is_none() {
            cpu = Some(CpuWindow::start(c.broker_pid));
        }
        if now >= plan.end_ns {
            break cpu.as_ref().map(CpuWindow::stop);
        }
        while outstanding.len() < a.window as usize {
            let slot = (seq % RING as u64) as usize;
            shared.count[slot].store(0, Ordering::SeqCst);
            shared.done_at[slot].store(0, Ordering::SeqCst);
            shared.seq[slot].store(seq, Ordering::SeqCst);
            let id = (seq % 65_535) as u16 + 1;
            sent_at[usize::from(id)] = now;
            template.append(&mut publisher.wbuf, id, now, seq);
            outstanding.push_back((seq, now));
            seq += 1;
            published += 1;
        }
        publisher.flush().await.ctx("publisher")?;
        // Wake for the front publish's timeout and the window's start and end.
        let mut wake = plan.end_ns;
        if let Some(&(_, at)) = outstanding.front() {
            wake = wake.min(at + timeout_ns);
        }
        if cpu.is_none() {
            wake = wake.min(plan.warmup_end_ns);
        }
        tokio::select! {
            _ = shared.done.notified() => {}
            r = publisher.fill() => r.ctx("publisher")?,
            _ = sleep_until(stats::deadline(wake)) => {}
        }
        let now = now_ns();
        while let Some(p) = publisher.next().ctx("publisher")? {
            match p {
                Packet::PubAck { packet_id } => {
                    let at = sent_at[usize::from(packet_id)];
                    if at >= plan.warmup_end_ns {
                        record_ns(&mut puback, now.saturating_sub(at));
                    }
                }
                Packet::PingResp => {}
                other => return err(format!("publisher got {other:?}")),
            }
        }
        // Retire the publishes at the front that every subscriber has, or that timed out.
        while let Some(&(s, at)) = outstanding.front() {
            let slot = (s % RING as u64) as usize;
            if shared.count[slot].load(Ordering::SeqCst) >= shared.subscribers {
                if at >= plan.warmup_end_ns {
                    let done = shared.done_at[slot].load(Ordering::SeqCst);
                    record_ns(&mut fan_lat, done.saturating_sub(at));
                    complete += 1;
                }
            } else if now.saturating_sub(at) >= timeout_ns {
                if at >= plan.warmup_end_ns {
                    incomplete += 1;
                }
            } else {
                break;
            }
            outstanding.pop_front();
        }
    };
    publisher.close().await;

    let mut e2e = new_histogram();
    let (mut delivered, mut delivered_total, mut dups) = (0u64, 0u64, 0u64);
    for t in tasks {
        t.await.ctx("subscriber task panicked")?.ctx("subscriber")?;
    }
    for s in &shared.shards {
        let s = s
            .lock()
            .map_err(|_| crate::conn::BenchError("poisoned".into()))?;
        let _ = e2e.add(&s.e2e);
        delivered += s.delivered;
        delivered_total += s.delivered_total;
        dups += s.dups;
    }
    let secs = c.duration;
    let mut report = json!({
        "workload": "fanout",
        "subscribers": a.subscribers,
        "qos": a.qos,
        "window": a.window,
        "size": a.size,
        "measured_s": secs,
        "setup_s": setup_s,
        "published": published,
        "fanouts_complete": complete,
        "fanouts_incomplete": incomplete,
        "delivered": delivered,
        "delivered_total": delivered_total,
        "dups": dups,
        "deliver_rate": delivered as f64 / secs,
        "fanout_rate": complete as f64 / secs,
        "e2e_latency": pct(&Percentiles::of(&e2e)),
        "fanout_latency": pct(&Percentiles::of(&fan_lat)),
        "puback_latency": pct(&Percentiles::of(&puback)),
    });
    if let Some(u) = cpu_used {
        merge(&mut report, u.json(secs, delivered));
    }
    Ok(report)
}

/// Receive (and at QoS 1 acknowledge) deliveries until `plan.end_ns`, then disconnect.
async fn subscriber(mut conn: MqttConn, shared: &Shared, shard: usize, plan: Plan) -> Result<()> {
    let end = stats::deadline(plan.end_ns);
    loop {
        tokio::select! {
            r = conn.fill() => r?,
            _ = sleep_until(end) => break,
        }
        let now = now_ns();
        if now >= plan.end_ns {
            break;
        }
        deliveries(&mut conn, shared, shard, now, plan)?;
        conn.flush().await?;
    }
    conn.close_now();
    Ok(())
}

/// Count and time the deliveries in `conn`'s read buffer (received at `now`), queueing PUBACKs.
fn deliveries(
    conn: &mut MqttConn,
    shared: &Shared,
    shard: usize,
    now: u64,
    plan: Plan,
) -> Result<()> {
    let mut sh = shared
        .shards
        .get(shard)
        .and_then(|s| s.lock().ok())
        .ok_or_else(|| crate::conn::BenchError("stats shard".into()))?;
    while let Some(p) = conn.next()? {
        match p {
            Packet::Publish {
                qos,
                dup,
                packet_id,
                ts,
                seq,
            } => {
                if qos > 0 {
                    wire::puback(&mut conn.wbuf, packet_id);
                }
                sh.delivered_total += 1;
                sh.dups += u64::from(dup);
                if now >= plan.warmup_end_ns {
                    sh.delivered += 1;
                }
                if ts >= plan.warmup_end_ns {
                    record_ns(&mut sh.e2e, now.saturating_sub(ts));
                }
                let slot = (seq % RING as u64) as usize;
                if shared.seq[slot].load(Ordering::SeqCst) == seq {
                    let got = shared.count[slot].fetch_add(1, Ordering::SeqCst) + 1;
                    if got == shared.subscribers {
                        shared.done_at[slot].store(now, Ordering::SeqCst);
                        shared.done.notify_one();
                    }
                }
            }
            Packet::PingResp => {}
            other => return err(format!("subscriber got {other:?}")),
        }
    }
    Ok(())
}
