//! Message rates: a task samples every queue's monotonic counters
//! ([`weir_engine::stats::QueueCounters`], atomics only) every
//! [`INTERVAL`] and keeps the last two samples per queue; a rate is their
//! difference over the time between them. Memory is bounded by the queues
//! (two samples each; deleted queues drop out at the next sample).
//!
//! Started by the first API request that reports rates, it holds the
//! engine weakly and stops with it.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock, Weak};
use std::time::{Duration, Instant};

use parking_lot::RwLock;
use weir_engine::stats::QueueCounters;
use weir_engine::Engine;

/// How often counters are sampled.
pub const INTERVAL: Duration = Duration::from_secs(5);

/// Per-second rates of a queue (or of the broker).
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
}

#[derive(Clone, Copy)]
struct Sample {
    at: Instant,
    c: QueueCounters,
}

#[derive(Default)]
struct Samples {
    /// Per queue (keyed by its first partition's id: unique, never reused):
    /// the previous and the latest sample.
    queues: HashMap<u64, (Sample, Sample)>,
    /// Sums over every queue.
    total: Option<(Sample, Sample)>,
}

/// The sampler.
pub struct Sampler {
    samples: RwLock<Samples>,
}

static SAMPLER: OnceLock<Arc<Sampler>> = OnceLock::new();

/// The sampler, started on first use.
pub fn sampler(engine: &Arc<Engine>) -> Arc<Sampler> {
    SAMPLER
        .get_or_init(|| {
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
        })
        .clone()
}

fn rates(a: &Sample, b: &Sample) -> Rates {
    let dt = b.at.duration_since(a.at).as_secs_f64();
    if dt <= 0.0 {
        return Rates::default();
    }
    let r = |x: u64, y: u64| (y.saturating_sub(x)) as f64 / dt;
    Rates {
        publish: r(a.c.published, b.c.published),
        deliver_get: r(a.c.delivered, b.c.delivered),
        ack: r(a.c.acked, b.c.acked),
        redeliver: r(a.c.redelivered, b.c.redelivered),
        dead_lettered: r(a.c.dead_lettered, b.c.dead_lettered),
        expired: r(a.c.expired, b.c.expired),
    }
}

fn add(into: &mut QueueCounters, c: &QueueCounters) {
    into.published += c.published;
    into.delivered += c.delivered;
    into.acked += c.acked;
    into.redelivered += c.redelivered;
    into.dead_lettered += c.dead_lettered;
    into.expired += c.expired;
}

impl Sampler {
    /// Takes one sample of every queue.
    fn sample(&self, engine: &Engine) {
        let at = Instant::now();
        let mut total = QueueCounters::default();
        let mut latest = Vec::new();
        for t in engine.tenants() {
            for q in t.queues() {
                let c = q.counters();
                add(&mut total, &c);
                latest.push((q.dedup_id().0, Sample { at, c }));
            }
        }
        let mut s = self.samples.write();
        let mut queues = HashMap::with_capacity(latest.len());
        for (id, now) in latest {
            let prev = s.queues.get(&id).map_or(now, |(_, last)| *last);
            queues.insert(id, (prev, now));
        }
        s.queues = queues;
        let now = Sample { at, c: total };
        let prev = s.total.map_or(now, |(_, last)| last);
        s.total = Some((prev, now));
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

    /// The broker's rates.
    pub fn total(&self) -> Rates {
        self.samples
            .read()
            .total
            .map(|(a, b)| rates(&a, &b))
            .unwrap_or_default()
    }
}
