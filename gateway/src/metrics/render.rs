//! One scrape: the recorder's series, then the figures read at scrape time
//! (queues, tenants, store, alarms, process), written as Prometheus text
//! here rather than registered, so a queue costs nothing between scrapes and
//! 100,000 queues are one walk over the engine (a partition's lock taken
//! twice per partition: depth and delayed count).

use std::fmt::Write as _;
use std::sync::atomic::Ordering;
use std::time::Instant;

use crate::server::Shared;

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
}

impl QueueFigures {
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
    }
}

/// How a queue figure is written.
struct Family {
    name: &'static str,
    kind: &'static str,
    help: &'static str,
    value: fn(&QueueFigures) -> f64,
}

/// The per-queue series (docs/metrics.md maps them to RabbitMQ's).
const QUEUE_FAMILIES: &[Family] = &[
    Family {
        name: "rabbitmq_queue_messages_ready",
        kind: "gauge",
        help: "Messages ready to be delivered",
        value: |q| q.ready as f64,
    },
    Family {
        name: "rabbitmq_queue_messages_unacked",
        kind: "gauge",
        help: "Messages delivered and not yet settled (leased)",
        value: |q| q.unacked as f64,
    },
    Family {
        name: "weir_queue_messages_delayed",
        kind: "gauge",
        help: "Messages held back until a later time (delayed messages and retries)",
        value: |q| q.delayed as f64,
    },
    Family {
        name: "rabbitmq_queue_messages",
        kind: "gauge",
        help: "Ready, unacknowledged and delayed messages",
        value: |q| (q.ready + q.unacked + q.delayed) as f64,
    },
    Family {
        name: "rabbitmq_queue_messages_ready_bytes",
        kind: "gauge",
        help: "Bytes of ready messages",
        value: |q| q.ready_bytes as f64,
    },
    Family {
        name: "rabbitmq_queue_messages_unacked_bytes",
        kind: "gauge",
        help: "Bytes of leased messages",
        value: |q| q.unacked_bytes as f64,
    },
    Family {
        name: "weir_queue_oldest_message_age_seconds",
        kind: "gauge",
        help: "Age of the oldest ready message (0 when none)",
        value: |q| q.oldest_age_ms as f64 / 1000.0,
    },
    Family {
        name: "rabbitmq_queue_consumers",
        kind: "gauge",
        help: "Consumers attached",
        value: |q| q.consumers as f64,
    },
    Family {
        name: "rabbitmq_queue_messages_published_total",
        kind: "counter",
        help: "Messages enqueued",
        value: |q| q.published as f64,
    },
    Family {
        name: "rabbitmq_queue_messages_delivered_total",
        kind: "counter",
        help: "Deliveries (consumer deliveries and gets)",
        value: |q| q.delivered as f64,
    },
    Family {
        name: "rabbitmq_queue_messages_acked_total",
        kind: "counter",
        help: "Messages settled by acknowledgement",
        value: |q| q.acked as f64,
    },
    Family {
        name: "rabbitmq_queue_messages_redelivered_total",
        kind: "counter",
        help: "Deliveries that were redeliveries",
        value: |q| q.redelivered as f64,
    },
];

/// The whole `/metrics` text. `per_queue` false writes the queue series
/// summed per tenant (no `queue` label), for very large installations.
pub fn render(shared: &Shared, started: Instant, per_queue: bool) -> String {
    let mut out = super::install().render();
    out.reserve(4096);
    queues(&mut out, shared, per_queue);
    store(&mut out, shared);
    alarms(&mut out, shared);
    header(&mut out, "weir_uptime_seconds", "gauge", "Seconds since the broker started");
    let _ = writeln!(out, "weir_uptime_seconds {}", started.elapsed().as_secs_f64());
    if let Some(rss) = crate::server::resident_bytes() {
        header(&mut out, "weir_process_resident_memory_bytes", "gauge", "Resident memory of the broker");
        let _ = writeln!(out, "weir_process_resident_memory_bytes {rss}");
    }
    out
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
fn queues(out: &mut String, shared: &Shared, per_queue: bool) {
    // (tenant, queue name or None when aggregated, figures)
    let mut rows: Vec<(String, Option<String>, QueueFigures)> = Vec::new();
    let tenants = shared.engine.tenants();
    let mut per_tenant: Vec<(String, u64, u64, u64)> = Vec::with_capacity(tenants.len());
    for t in &tenants {
        let vhost = escaped(&t.name).into_owned();
        let queues = t.queues();
        let mut total = QueueFigures::default();
        for q in &queues {
            let mut f = QueueFigures::default();
            for p in &q.partitions {
                let d = p.depth();
                let c = &p.counters;
                f.add(&QueueFigures {
                    ready: d.ready,
                    ready_bytes: d.ready_bytes,
                    unacked: d.leased,
                    unacked_bytes: c.leased_bytes.load(Ordering::Relaxed),
                    delayed: p.delayed_len(),
                    oldest_age_ms: d.oldest_age_ms,
                    // Every partition has the queue's consumers attached.
                    consumers: 0,
                    published: c.published.load(Ordering::Relaxed),
                    delivered: c.delivered.load(Ordering::Relaxed),
                    acked: c.acked.load(Ordering::Relaxed),
                    redelivered: c.redelivered.load(Ordering::Relaxed),
                });
            }
            f.consumers = u64::from(q.consumer_count());
            if per_queue {
                rows.push((vhost.clone(), Some(escaped(q.name()).into_owned()), f));
            } else {
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
            let v = (fam.value)(f);
            let _ = match queue {
                Some(q) => writeln!(out, "{}{{vhost=\"{vhost}\",queue=\"{q}\"}} {v}", fam.name),
                None => writeln!(out, "{}{{vhost=\"{vhost}\"}} {v}", fam.name),
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
fn store(out: &mut String, shared: &Shared) {
    let s = shared.engine.store().stats();
    for (name, kind, help, v) in [
        ("weir_store_segments", "gauge", "Segment files on disk", s.segments),
        ("weir_store_disk_bytes", "gauge", "Bytes of segment files on disk", s.disk_bytes),
        ("weir_store_appended_bytes_total", "counter", "Bytes appended since start", s.appended_bytes),
        ("weir_store_fsyncs_total", "counter", "fsyncs since start", s.syncs),
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
fn alarms(out: &mut String, shared: &Shared) {
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
