//! Message rates: a task samples every queue's monotonic counters
//! ([`weir_engine::stats::QueueCounters`], atomics only) every
//! [`INTERVAL`] and keeps the last two samples per queue and per vhost; a
//! rate is their difference over the time between them. The same two
//! samples give the change of depth per second (RabbitMQ's
//! `messages_details`) and the mean enqueue-to-delivery latency of the
//! messages delivered between them. Memory is bounded by the queues (two
//! samples each; deleted queues drop out at the next sample).
//!
//! One sampler per HTTP listener ([`crate::http::HttpState::rates`]),
//! started by the first request that reports rates; its task holds the
//! engine and the sampler weakly and stops with them.

use std::collections::HashMap;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::RwLock;
use weir_engine::stats::QueueCounters;
use weir_engine::Engine;

/// How often counters are sampled (RabbitMQ's default sample interval).
pub const INTERVAL: Duration = Duration::from_secs(5);

/// Per-second rates of a queue (or of a vhost, or of several), and the
/// mean latency between the last two samples.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Rates {
    /// Messages enqueued.
    pub publish: f64,
    /// Deliveries and gets.
    pub deliver_get: f64,
    /// Acknowledgements.
    pub ack: f64,
    /// Redeliveries.
    pub redeliver: f64,
    /// Messages dead-lettered.
    pub dead_lettered: f64,
    /// Messages expired.
    pub expired: f64,
    /// Change of ready messages (negative while a queue drains).
    pub messages_ready: f64,
    /// Change of delivered, unsettled messages.
    pub messages_unacknowledged: f64,
    /// Mean time the messages delivered between the samples had waited
    /// in their queue, ms; `None` when nothing was delivered.
    pub latency_ms: Option<f64>,
}

impl Rates {
    /// Change of all messages (ready and unacknowledged) per second.
    pub fn messages(&self) -> f64 {
        self.messages_ready + self.messages_unacknowledged
    }
}

#[derive(Clone, Copy)]
struct Sample {
    at: Instant,
    c: QueueCounters,
}

/// The previous and the latest sample of something.
type Pair = (Sample, Sample);

#[derive(Default)]
struct Samples {
    /// Per queue, keyed by its first partition's id (unique, never reused).
    queues: HashMap<u64, Pair>,
    /// Sums over each vhost's queues.
    vhosts: HashMap<String, Pair>,
}

/// The sampler.
pub struct Sampler {
    samples: RwLock<Samples>,
}

impl Sampler {
    /// A sampler of `engine` with its first sample taken, and its task
    /// started on the current runtime.
    pub fn start(engine: &Arc<Engine>) -> Arc<Sampler> {
        let s = Arc::new(Sampler {
            samples: RwLock::new(Samples::default()),
        });
        s.sample(engine);
        let (weak_engine, weak_s): (Weak<Engine>, Weak<Sampler>) =
            (Arc::downgrade(engine), Arc::downgrade(&s));
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(INTERVAL);
            tick.tick().await;
            loop {
                tick.tick().await;
                let (Some(e), Some(s)) = (weak_engine.upgrade(), weak_s.upgrade()) else {
                    return;
                };
                // Reads atomics of every queue: off the async workers.
                let _ = tokio::task::spawn_blocking(move || s.sample(&e)).await;
            }
        });
        s
    }

    /// Takes one sample of every queue.
    fn sample(&self, engine: &Engine) {
        let at = Instant::now();
        let mut latest = Vec::new();
        let mut vhosts = Vec::new();
        for t in engine.tenants() {
            let mut total = QueueCounters::default();
            for q in t.queues() {
                let c = q.counters();
                add(&mut total, &c);
                latest.push((q.dedup_id().0, Sample { at, c }));
            }
            vhosts.push((t.name.to_string(), Sample { at, c: total }));
        }
        let mut s = self.samples.write();
        s.queues = pair_up(&s.queues, latest);
        s.vhosts = pair_up(&s.vhosts, vhosts);
    }

    /// A queue's rates (zero until it has two samples).
    pub fn queue(&self, id: u64) -> Rates {
        self.samples
            .read()
            .queues
            .get(&id)
            .map(|(a, b)| rates(a, b))
            .unwrap_or_default()
    }

    /// The rates of the queues of `vhosts`, together.
    pub fn vhosts<'a>(&self, vhosts: impl IntoIterator<Item = &'a str>) -> Rates {
        let s = self.samples.read();
        let (mut a, mut b) = (QueueCounters::default(), QueueCounters::default());
        let mut span = None;
        for v in vhosts {
            if let Some((x, y)) = s.vhosts.get(v) {
                add(&mut a, &x.c);
                add(&mut b, &y.c);
                span = Some((x.at, y.at));
            }
        }
        let Some((from, to)) = span else {
            return Rates::default();
        };
        rates(&Sample { at: from, c: a }, &Sample { at: to, c: b })
    }
}

/// The new samples, each paired with the latest of the old ones (or with
/// itself when new); what is not sampled again is dropped.
fn pair_up<K: std::hash::Hash + Eq>(
    old: &HashMap<K, Pair>,
    latest: Vec<(K, Sample)>,
) -> HashMap<K, Pair> {
    let mut out = HashMap::with_capacity(latest.len());
    for (k, now) in latest {
        let prev = old.get(&k).map_or(now, |(_, last)| *last);
        out.insert(k, (prev, now));
    }
    out
}

fn rates(a: &Sample, b: &Sample) -> Rates {
    let dt = b.at.duration_since(a.at).as_secs_f64();
    if dt <= 0.0 {
        return Rates::default();
    }
    let r = |x: u64, y: u64| (y.saturating_sub(x)) as f64 / dt;
    let change = |x: u64, y: u64| (y as f64 - x as f64) / dt;
    let delivered = b.c.delivered.saturating_sub(a.c.delivered);
    Rates {
        publish: r(a.c.published, b.c.published),
        deliver_get: r(a.c.delivered, b.c.delivered),
        ack: r(a.c.acked, b.c.acked),
        redeliver: r(a.c.redelivered, b.c.redelivered),
        dead_lettered: r(a.c.dead_lettered, b.c.dead_lettered),
        expired: r(a.c.expired, b.c.expired),
        messages_ready: change(a.c.ready, b.c.ready),
        messages_unacknowledged: change(a.c.leased, b.c.leased),
        latency_ms: (delivered > 0)
            .then(|| b.c.waited_ms.saturating_sub(a.c.waited_ms) as f64 / delivered as f64),
    }
}

fn add(into: &mut QueueCounters, c: &QueueCounters) {
    into.published += c.published;
    into.delivered += c.delivered;
    into.acked += c.acked;
    into.redelivered += c.redelivered;
    into.dead_lettered += c.dead_lettered;
    into.expired += c.expired;
    into.waited_ms += c.waited_ms;
    into.ready += c.ready;
    into.leased += c.leased;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(at: Instant, c: QueueCounters) -> Sample {
        Sample { at, c }
    }

    #[test]
    fn rates_depth_change_and_mean_latency_between_two_samples() {
        let t0 = Instant::now();
        let a = QueueCounters {
            published: 100,
            delivered: 40,
            waited_ms: 400,
            ready: 60,
            ..Default::default()
        };
        let b = QueueCounters {
            published: 200,
            delivered: 60,
            waited_ms: 1_400,
            ready: 40,
            leased: 10,
            ..Default::default()
        };
        let r = rates(&sample(t0, a), &sample(t0 + Duration::from_secs(2), b));
        assert_eq!(r.publish, 50.0);
        assert_eq!(r.deliver_get, 10.0);
        assert_eq!(r.messages_ready, -10.0);
        assert_eq!(r.messages_unacknowledged, 5.0);
        assert_eq!(r.messages(), -5.0);
        // 20 deliveries waited 1,000 ms in all.
        assert_eq!(r.latency_ms, Some(50.0));
        let idle = rates(&sample(t0, b), &sample(t0 + Duration::from_secs(2), b));
        assert_eq!(idle.latency_ms, None);
    }
}
