//! `qos1`: N publishers, each with a window of unacknowledged QoS 1 publishes to one topic; M
//! persistent-session subscribers (clean session off) on that topic at QoS 1, acking every
//! delivery at once.

use hdrhistogram::Histogram;
use serde_json::json;
use tokio::time::sleep_until;

use crate::client::{MqttConn, Target};
use crate::conn::{err, Context, Result};
use crate::stats::{self, new_histogram, now_ns, record_ns, Percentiles};
use crate::wire::{self, Packet, PublishTemplate};
use crate::{merge, pct, Common, CpuWindow, Plan};

/// `qos1` options.
#[derive(clap::Args, Debug, Clone)]
pub struct Args {
    /// Publisher connections.
    #[arg(long, default_value_t = 2)]
    publishers: u32,
    /// Persistent-session subscriber connections (each receives every message).
    #[arg(long, default_value_t = 1)]
    subscribers: u32,
    /// Unacknowledged QoS 1 publishes in flight per publisher (at most 65,535: packet ids).
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..=65_535))]
    window: u32,
    /// Payload bytes (at least 16: send time and sequence number).
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u32).range(16..=1_000_000))]
    size: u32,
    /// Topic published to and subscribed to.
    #[arg(long, default_value = "weir-bench/qos1")]
    topic: String,
    /// Client id prefix of the subscribers (their sessions are wiped before and after the run).
    #[arg(long, default_value = "weir-mqtt-bench-sub")]
    sub_id: String,
}

/// What one publisher measured.
struct PubStats {
    sent: u64,
    /// PUBACKs received inside the measurement window.
    acked: u64,
    /// PUBACKs over the whole run.
    acked_total: u64,
    /// Publish (handed to the socket) → PUBACK, for publishes sent after warm-up.
    puback: Histogram<u64>,
}

/// What one subscriber measured.
struct SubStats {
    /// Deliveries inside the measurement window.
    delivered: u64,
    /// Deliveries over the whole run.
    delivered_total: u64,
    /// Deliveries with DUP set.
    dups: u64,
    /// Publish → deliver, for messages published after warm-up.
    e2e: Histogram<u64>,
}

pub async fn run(c: &Common, a: Args) -> Result<serde_json::Value> {
    let t = c.target();
    let sub_ids: Vec<String> = (0..a.subscribers)
        .map(|i| format!("{}-{i}", a.sub_id))
        .collect();
    // A clean-session connect wipes whatever session an earlier (aborted) run left.
    for id in &sub_ids {
        wipe_session(&t, id).await?;
    }
    let mut subs = Vec::new();
    for (i, id) in sub_ids.iter().enumerate() {
        let (mut s, present) = MqttConn::open(&t, i, id, false, 60, 256 * 1024)
            .await
            .ctx(format!("subscriber {i}"))?;
        if present {
            return err(format!(
                "subscriber {i}: session {id} still present after a wipe"
            ));
        }
        let granted = s
            .subscribe(&a.topic, 1)
            .await
            .ctx(format!("subscriber {i}"))?;
        if granted != 1 {
            return err(format!("subscriber {i}: granted QoS {granted}, not 1"));
        }
        subs.push(s);
    }
    let mut pubs = Vec::new();
    for i in 0..a.publishers {
        let id = format!("weir-mqtt-bench-pub-{i}-{}", std::process::id());
        let (p, _) = MqttConn::open(&t, 100 + i as usize, &id, true, 60, 64 * 1024)
            .await
            .ctx(format!("publisher {i}"))?;
        pubs.push(p);
    }
    let template = std::sync::Arc::new(PublishTemplate::new(&a.topic, 1, a.size as usize)?);

    let plan = c.plan()?;
    let mut sub_tasks = Vec::new();
    for (i, s) in subs.into_iter().enumerate() {
        sub_tasks.push(tokio::spawn(async move {
            subscriber(s, plan).await.ctx(format!("subscriber {i}"))
        }));
    }
    let mut pub_tasks = Vec::new();
    for (i, p) in pubs.into_iter().enumerate() {
        let template = template.clone();
        let window = a.window as usize;
        pub_tasks.push(tokio::spawn(async move {
            publisher(p, &template, window, plan)
                .await
                .ctx(format!("publisher {i}"))
        }));
    }

    sleep_until(stats::deadline(plan.warmup_end_ns)).await;
    let cpu = CpuWindow::start(c.broker_pid);
    sleep_until(stats::deadline(plan.end_ns)).await;
    let cpu = cpu.stop();

    let mut puback = new_histogram();
    let mut e2e = new_histogram();
    let (mut sent, mut acked, mut acked_total) = (0, 0, 0);
    let (mut delivered, mut delivered_total, mut dups) = (0, 0, 0);
    for t in pub_tasks {
        let s = t.await.ctx("publisher task panicked")??;
        sent += s.sent;
        acked += s.acked;
        acked_total += s.acked_total;
        let _ = puback.add(&s.puback);
    }
    for t in sub_tasks {
        let s = t.await.ctx("subscriber task panicked")??;
        delivered += s.delivered;
        delivered_total += s.delivered_total;
        dups += s.dups;
        let _ = e2e.add(&s.e2e);
    }
    for id in &sub_ids {
        // Drop the session and whatever it still holds, so the next run starts from nothing.
        let _ = wipe_session(&t, id).await;
    }

    let secs = c.duration;
    let subs_n = u64::from(a.subscribers.max(1));
    let mut report = json!({
        "workload": "qos1",
        "publishers": a.publishers,
        "subscribers": a.subscribers,
        "window": a.window,
        "size": a.size,
        "measured_s": secs,
        "sent": sent,
        "acked": acked,
        "acked_total": acked_total,
        "publish_rate": acked as f64 / secs,
        "delivered": delivered,
        "delivered_total": delivered_total,
        "dups": dups,
        "deliver_rate": delivered as f64 / secs,
        // Acknowledged but not (yet) delivered to the subscribers when the run ended.
        "backlog_at_end": (acked_total * subs_n).saturating_sub(delivered_total),
        "puback_latency": pct(&Percentiles::of(&puback)),
        "e2e_latency": pct(&Percentiles::of(&e2e)),
    });
    merge(&mut report, cpu.json(secs, acked));
    Ok(report)
}

/// Connect with a clean session and disconnect: the broker drops the session of `id`.
async fn wipe_session(t: &Target, id: &str) -> Result<()> {
    let (c, _) = MqttConn::open(t, 0, id, true, 60, 4096)
        .await
        .ctx(format!("wiping session {id}"))?;
    c.close().await;
    Ok(())
}

/// Packet id slots of a publisher: the send time (+1, so 0 means free) of each id in flight.
struct InFlight {
    sent_at: Vec<u64>,
    next: u16,
    count: usize,
}

impl InFlight {
    fn new() -> InFlight {
        InFlight {
            sent_at: vec![0; 65_536],
            next: 0,
            count: 0,
        }
    }

    /// A free packet id, marked as sent at `now`. The caller keeps `count` under 65,535.
    fn take(&mut self, now: u64) -> u16 {
        loop {
            self.next = self.next.checked_add(1).unwrap_or(1);
            let slot = &mut self.sent_at[usize::from(self.next)];
            if *slot == 0 {
                *slot = now + 1;
                self.count += 1;
                return self.next;
            }
        }
    }

    /// Release `id`; its send time, or an error for an id not in flight.
    fn settle(&mut self, id: u16) -> Result<u64> {
        let slot = &mut self.sent_at[usize::from(id)];
        if *slot == 0 {
            return err(format!("PUBACK for packet id {id}, which is not in flight"));
        }
        let sent = *slot - 1;
        *slot = 0;
        self.count -= 1;
        Ok(sent)
    }
}

/// Keep `window` QoS 1 publishes unacknowledged until `plan.end_ns`.
async fn publisher(
    mut conn: MqttConn,
    template: &PublishTemplate,
    window: usize,
    plan: Plan,
) -> Result<PubStats> {
    let mut st = PubStats {
        sent: 0,
        acked: 0,
        acked_total: 0,
        puback: new_histogram(),
    };
    let mut inflight = InFlight::new();
    let end = stats::deadline(plan.end_ns);
    loop {
        let now = now_ns();
        if now >= plan.end_ns {
            break;
        }
        while inflight.count < window {
            let id = inflight.take(now);
            template.append(&mut conn.wbuf, id, now, st.sent);
            st.sent += 1;
        }
        conn.flush().await?;
        tokio::select! {
            r = conn.fill() => r?,
            _ = sleep_until(end) => {}
        }
        // One clock reading per read: every PUBACK in it arrived at the same time.
        let now = now_ns();
        while let Some(p) = conn.next()? {
            match p {
                Packet::PubAck { packet_id } => {
                    let sent = inflight.settle(packet_id)?;
                    st.acked_total += 1;
                    if now >= plan.warmup_end_ns && now < plan.end_ns {
                        st.acked += 1;
                    }
                    if sent >= plan.warmup_end_ns {
                        record_ns(&mut st.puback, now.saturating_sub(sent));
                    }
                }
                Packet::PingResp => {}
                other => return err(format!("publisher got {other:?}")),
            }
        }
    }
    conn.close().await;
    Ok(st)
}

/// Receive and PUBACK every delivery until `plan.end_ns`.
async fn subscriber(mut conn: MqttConn, plan: Plan) -> Result<SubStats> {
    let mut st = SubStats {
        delivered: 0,
        delivered_total: 0,
        dups: 0,
        e2e: new_histogram(),
    };
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
        let in_window = now >= plan.warmup_end_ns;
        while let Some(p) = conn.next()? {
            match p {
                Packet::Publish {
                    qos,
                    dup,
                    packet_id,
                    ts,
                    ..
                } => {
                    if qos > 0 {
                        wire::puback(&mut conn.wbuf, packet_id);
                    }
                    st.delivered_total += 1;
                    st.dups += u64::from(dup);
                    if in_window {
                        st.delivered += 1;
                    }
                    if ts >= plan.warmup_end_ns {
                        record_ns(&mut st.e2e, now.saturating_sub(ts));
                    }
                }
                Packet::PingResp => {}
                other => return err(format!("subscriber got {other:?}")),
            }
        }
        conn.flush().await?;
    }
    // DISCONNECT keeps the persistent session; the run wipes it afterwards.
    conn.close().await;
    Ok(st)
}

#[cfg(test)]
mod tests {
    use super::InFlight;

    #[test]
    fn packet_ids_skip_zero_and_busy_slots() {
        let mut f = InFlight::new();
        assert_eq!(f.take(5), 1);
        assert_eq!(f.take(6), 2);
        assert_eq!(f.settle(1).unwrap(), 5);
        assert!(f.settle(1).is_err());
        // Wrap around: 65535 then 1 (free again), skipping 0; 2 is still busy.
        f.next = 65_534;
        assert_eq!(f.take(7), 65_535);
        assert_eq!(f.take(8), 1);
        assert_eq!(f.take(9), 3);
        assert_eq!(f.count, 4);
    }
}
