//! One scrape: the recorder's series, then the figures read at scrape time
//! (queues, tenants, store, alarms, process), written as Prometheus text
//! here rather than registered, so a queue costs nothing between scrapes and
//! 100,000 queues are one walk over the engine: each queue's
//! `Queue::stats` snapshot (every partition's lock taken once, briefly; no
//! walk over messages; see `weir_engine::stats`).

use std::fmt::Write as _;
use std::time::Instant;
use weir_engine::stats::{QueueStats, ATTEMPT_BUCKETS};

use crate::server::Services;

/// Per-queue figures, taken from the engine once per scrape.
#[derive(Default, Clone)]
struct QueueFigures {
    ready: u64,
    ready_bytes: u64,
    unacked: u64,
    unacked_bytes: u64,
    delayed: u64,
    oldest_age_ms: u64,
    consumers: u64,
    published: u64,
    delivered: u64,
    acked: u64,
    redelivered: u64,
    dead_lettered: u64,
    expired: u64,
    /// Ready messages by delivery attempts (buckets of
    /// `weir_engine::stats::ATTEMPT_BUCKETS`).
    attempts: [u64; ATTEMPT_BUCKETS.len()],
    /// Retention limits (per queue only; None when unset or aggregated).
    max_length: Option<u64>,
    max_length_bytes: Option<u64>,
    message_ttl_ms: Option<u64>,
}

impl QueueFigures {
    /// The figures of one queue's snapshot.
    fn of(s: &QueueStats, args: &weir_engine::args::QueueArgs, now_ms: u64) -> Self {
        QueueFigures {
            ready: s.ready,
            ready_bytes: s.ready_bytes,
            unacked: s.leased,
            unacked_bytes: s.leased_bytes,
            delayed: s.delayed,
            oldest_age_ms: s.oldest_age_ms(now_ms),
            consumers: u64::from(s.consumers),
            published: s.counters.published,
            delivered: s.counters.delivered,
            acked: s.counters.acked,
            redelivered: s.counters.redelivered,
            dead_lettered: s.counters.dead_lettered,
            expired: s.counters.expired,
            attempts: s.attempts,
            max_length: args.max_length,
            max_length_bytes: args.max_length_bytes,
            message_ttl_ms: args.message_ttl,
        }
    }

    /// The most attempts any ready message has had (the bucket's bound).
    fn attempts_max(&self) -> u64 {
        self.attempts
            .iter()
            .rposition(|&n| n > 0)
            .map_or(0, |i| u64::from(ATTEMPT_BUCKETS[i]))
    }

    /// Adds `o` (another partition, or another queue when aggregated).
    fn add(&mut self, o: &QueueFigures) {
        self.ready += o.ready;
        self.ready_bytes += o.ready_bytes;
        self.unacked += o.unacked;
        self.unacked_bytes += o.unacked_bytes;
        self.delayed += o.delayed;
        self.oldest_age_ms = self.oldest_age_ms.max(o.oldest_age_ms);
        self.consumers += o.consumers;
        self.published += o.published;
        self.delivered += o.delivered;
        self.acked += o.acked;
        self.redelivered += o.redelivered;
        self.dead_lettered += o.dead_lettered;
        self.expired += o.expired;
        for (a, b) in self.attempts.iter_mut().zip(o.attempts) {
            *a += b;
        }
    }
}

/// How a queue figure is written; `value` None: no sample for that queue
/// (a limit it does not have).
struct Family {
    name: &'static str,
    kind: &'static str,
    help: &'static str,
    value: fn(&QueueFigures) -> Option<f64>,
}

/// The per-queue series (docs/metrics.md maps them to RabbitMQ's).
const QUEUE_FAMILIES: &[Family] = &[
    Family {
        name: "rabbitmq_queue_messages_ready",
        kind: "gauge",
        help: "Messages ready to be delivered",
        value: |q| Some(q.ready as f64),
    },
    Family {
        name: "rabbitmq_queue_messages_unacked",
        kind: "gauge",
        help: "Messages delivered and not yet settled (leased)",
        value: |q| Some(q.unacked as f64),
    },
    Family {
        name: "weir_queue_messages_delayed",
        kind: "gauge",
        help: "Messages held back until a later time (delayed messages and retries)",
        value: |q| Some(q.delayed as f64),
    },
    Family {
        name: "rabbitmq_queue_messages",
        kind: "gauge",
        help: "Ready, unacknowledged and delayed messages",
        value: |q| Some((q.ready + q.unacked + q.delayed) as f64),
    },
    Family {
        name: "rabbitmq_queue_messages_ready_bytes",
        kind: "gauge",
        help: "Bytes of ready messages",
        value: |q| Some(q.ready_bytes as f64),
    },
    Family {
        name: "rabbitmq_queue_messages_unacked_bytes",
        kind: "gauge",
        help: "Bytes of leased messages",
        value: |q| Some(q.unacked_bytes as f64),
    },
    Family {
        name: "weir_queue_oldest_message_age_seconds",
        kind: "gauge",
        help: "Age of the oldest ready message (0 when none)",
        value: |q| Some(q.oldest_age_ms as f64 / 1000.0),
    },
    Family {
        name: "rabbitmq_queue_consumers",
        kind: "gauge",
        help: "Consumers attached",
        value: |q| Some(q.consumers as f64),
    },
    Family {
        name: "rabbitmq_queue_messages_published_total",
        kind: "counter",
        help: "Messages enqueued",
        value: |q| Some(q.published as f64),
    },
    Family {
        name: "rabbitmq_queue_messages_delivered_total",
        kind: "counter",
        help: "Deliveries (consumer deliveries and gets)",
        value: |q| Some(q.delivered as f64),
    },
    Family {
        name: "rabbitmq_queue_messages_acked_total",
        kind: "counter",
        help: "Messages settled by acknowledgement",
        value: |q| Some(q.acked as f64),
    },
    Family {
        name: "rabbitmq_queue_messages_redelivered_total",
        kind: "counter",
        help: "Deliveries that were redeliveries",
        value: |q| Some(q.redelivered as f64),
    },
    Family {
        name: "rabbitmq_queue_messages_dead_lettered_total",
        kind: "counter",
        help: "Messages that left the queue dead (rejected, expired, over a limit), dead-letter exchange or not",
        value: |q| Some(q.dead_lettered as f64),
    },
    Family {
        name: "rabbitmq_queue_messages_expired_total",
        kind: "counter",
        help: "Of the dead-lettered, those that expired (TTL)",
        value: |q| Some(q.expired as f64),
    },
    Family {
        name: "weir_queue_delivery_attempts_max",
        kind: "gauge",
        help: "Most delivery attempts of a ready message (exact to 3, then the bucket bound 5, 10, 20, 65535)",
        value: |q| Some(q.attempts_max() as f64),
    },
    Family {
        name: "weir_queue_max_length_messages",
        kind: "gauge",
        help: "Retention: the queue's x-max-length (policy merged), when set",
        value: |q| q.max_length.map(|v| v as f64),
    },
    Family {
        name: "weir_queue_max_length_bytes",
        kind: "gauge",
        help: "Retention: the queue's x-max-length-bytes (policy merged), when set",
        value: |q| q.max_length_bytes.map(|v| v as f64),
    },
    Family {
        name: "weir_queue_message_ttl_seconds",
        kind: "gauge",
        help: "Retention: the queue's x-message-ttl (policy merged), when set",
        value: |q| q.message_ttl_ms.map(|v| v as f64 / 1000.0),
    },
];

/// The whole `/metrics` text. `per_queue` false writes the queue series
/// summed per tenant (no `queue` label), for very large installations.
pub fn render(shared: &Services, started: Instant, per_queue: bool) -> String {
    let mut out = super::install().render();
    out.reserve(4096);
    latencies(&mut out);
    queues(&mut out, shared, per_queue);
    store(&mut out, shared);
    alarms(&mut out, shared);
    header(
        &mut out,
        "weir_uptime_seconds",
        "gauge",
        "Seconds since the broker started",
    );
    let _ = writeln!(
        out,
        "weir_uptime_seconds {}",
        started.elapsed().as_secs_f64()
    );
    if let Some(rss) = crate::server::resident_bytes() {
        header(
            &mut out,
            "weir_process_resident_memory_bytes",
            "gauge",
            "Resident memory of the broker",
        );
        let _ = writeln!(out, "weir_process_resident_memory_bytes {rss}");
    }
    out
}

/// The publish-to-confirm and publish-to-deliver histograms of every
/// tenant and protocol (`super::Latency`: bucket counts read here).
fn latencies(out: &mut String) {
    use std::sync::atomic::Ordering::Relaxed;
    let handles: Vec<_> = match super::HANDLES.get() {
        Some(m) => m.lock().values().cloned().collect(),
        None => return,
    };
    for (name, help, pick) in [
        (
            super::CONFIRM_SECONDS,
            "From the end of the batch a publish arrived in to its confirm",
            (|h: &super::Handles| &h.confirm) as fn(&super::Handles) -> &super::Latency,
        ),
        (
            super::DELIVER_SECONDS,
            "From enqueue to delivery (millisecond resolution)",
            |h: &super::Handles| &h.deliver,
        ),
    ] {
        header(out, name, "histogram", help);
        for h in &handles {
            let l = pick(h);
            let labels = format!(
                "vhost=\"{}\",protocol=\"{}\"",
                escaped(&h.vhost),
                h.protocol.label()
            );
            let mut cumulative = 0;
            for (i, n) in l.buckets.iter().enumerate() {
                cumulative += n.load(Relaxed);
                let le = match super::LATENCY_BUCKETS.get(i) {
                    Some(b) => b.to_string(),
                    None => "+Inf".to_string(),
                };
                let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{le}\"}} {cumulative}");
            }
            let sum = l.sum_nanos.load(Relaxed) as f64 / 1e9;
            let _ = writeln!(out, "{name}_sum{{{labels}}} {sum}");
            let _ = writeln!(out, "{name}_count{{{labels}}} {cumulative}");
        }
    }
}

/// `# HELP` and `# TYPE` lines.
fn header(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

/// A label value, escaped as the text format requires.
fn escaped(v: &str) -> std::borrow::Cow<'_, str> {
    if v.contains(['\\', '"', '\n']) {
        v.replace('\\', "\\\\")
            .replace('"', "\\\"")
            .replace('\n', "\\n")
            .into()
    } else {
        v.into()
    }
}

/// Queue series, per queue or per tenant, and per-tenant queued totals.
fn queues(out: &mut String, shared: &Services, per_queue: bool) {
    // (tenant, queue name or None when aggregated, figures)
    let mut rows: Vec<(String, Option<String>, QueueFigures)> = Vec::new();
    let tenants = shared.engine.tenants();
    let now_ms = shared.engine.clock().now_ms();
    let mut per_tenant: Vec<(String, u64, u64, u64)> = Vec::with_capacity(tenants.len());
    for t in &tenants {
        let vhost = escaped(&t.name).into_owned();
        let queues = t.queues();
        let mut total = QueueFigures::default();
        for q in &queues {
            let mut f = QueueFigures::of(&q.stats(), &q.args(), now_ms);
            if per_queue {
                rows.push((vhost.clone(), Some(escaped(q.name()).into_owned()), f));
            } else {
                // Limits differ per queue: not summed.
                f.max_length = None;
                f.max_length_bytes = None;
                f.message_ttl_ms = None;
                total.add(&f);
            }
        }
        if !per_queue {
            rows.push((vhost.clone(), None, total));
        }
        let quota = t.quota();
        per_tenant.push((
            vhost,
            queues.len() as u64,
            quota.queued_messages(),
            quota.queued_bytes(),
        ));
    }
    for fam in QUEUE_FAMILIES {
        header(out, fam.name, fam.kind, fam.help);
        for (vhost, queue, f) in &rows {
            let Some(v) = (fam.value)(f) else {
                continue;
            };
            let _ = match queue {
                Some(q) => writeln!(out, "{}{{vhost=\"{vhost}\",queue=\"{q}\"}} {v}", fam.name),
                None => writeln!(out, "{}{{vhost=\"{vhost}\"}} {v}", fam.name),
            };
        }
    }
    header(
        out,
        "weir_queue_ready_by_attempts",
        "gauge",
        "Ready messages with at most `le` delivery attempts so far (cumulative, as histogram buckets)",
    );
    for (vhost, queue, f) in &rows {
        // A queue none of whose ready messages was ever delivered has all of
        // them in the first bucket, which `messages_ready` already says:
        // its eight lines are left out (a third of a per-queue scrape at
        // 100,000 mostly idle queues).
        if queue.is_some() && f.attempts[1..].iter().all(|&n| n == 0) {
            continue;
        }
        let mut cumulative = 0;
        for (i, n) in f.attempts.iter().enumerate() {
            cumulative += n;
            let le = if i + 1 == ATTEMPT_BUCKETS.len() {
                "+Inf".to_string()
            } else {
                ATTEMPT_BUCKETS[i].to_string()
            };
            let _ = match queue {
                Some(q) => writeln!(
                    out,
                    "weir_queue_ready_by_attempts{{vhost=\"{vhost}\",queue=\"{q}\",le=\"{le}\"}} {cumulative}"
                ),
                None => writeln!(
                    out,
                    "weir_queue_ready_by_attempts{{vhost=\"{vhost}\",le=\"{le}\"}} {cumulative}"
                ),
            };
        }
    }
    header(out, "rabbitmq_queues", "gauge", "Queues declared");
    for (vhost, n, _, _) in &per_tenant {
        let _ = writeln!(out, "rabbitmq_queues{{vhost=\"{vhost}\"}} {n}");
    }
    header(
        out,
        "weir_tenant_queued_messages",
        "gauge",
        "Messages queued in the tenant, as its quota counts them",
    );
    for (vhost, _, m, _) in &per_tenant {
        let _ = writeln!(out, "weir_tenant_queued_messages{{vhost=\"{vhost}\"}} {m}");
    }
    header(
        out,
        "weir_tenant_queued_bytes",
        "gauge",
        "Bytes queued in the tenant, as its quota counts them",
    );
    for (vhost, _, _, b) in &per_tenant {
        let _ = writeln!(out, "weir_tenant_queued_bytes{{vhost=\"{vhost}\"}} {b}");
    }
}

/// The store's counters (`Store::stats`).
fn store(out: &mut String, shared: &Services) {
    let s = shared.engine.store().stats();
    for (name, kind, help, v) in [
        (
            "weir_store_segments",
            "gauge",
            "Segment files on disk",
            s.segments,
        ),
        (
            "weir_store_disk_bytes",
            "gauge",
            "Bytes of segment files on disk",
            s.disk_bytes,
        ),
        (
            "weir_store_appended_bytes_total",
            "counter",
            "Bytes appended since start",
            s.appended_bytes,
        ),
        (
            "weir_store_fsyncs_total",
            "counter",
            "fsyncs since start",
            s.syncs,
        ),
        (
            "weir_store_reclaimed_segments_total",
            "counter",
            "Segments deleted since start (nothing live in them)",
            s.reclaimed_segments,
        ),
    ] {
        header(out, name, kind, help);
        let _ = writeln!(out, "{name} {v}");
    }
}

/// Resource alarms, as RabbitMQ names them.
fn alarms(out: &mut String, shared: &Services) {
    let a = *shared.alarms.borrow();
    for (name, help, on) in [
        (
            "rabbitmq_alarms_memory_used_watermark",
            "1 while resident memory is above the memory limit (publishers blocked)",
            a.memory,
        ),
        (
            "rabbitmq_alarms_free_disk_space_watermark",
            "1 while free disk space is below the limit (publishers blocked)",
            a.disk,
        ),
    ] {
        header(out, name, "gauge", help);
        let _ = writeln!(out, "{name} {}", u8::from(on));
    }
}
