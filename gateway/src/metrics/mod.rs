//! Prometheus metrics (issue 10): the recorder, the names, and the few
//! handles the sessions touch.
//!
//! Two kinds of figures, so a scrape stays cheap at 100,000 queues and the
//! hot path pays almost nothing:
//!
//! * **Read at scrape time** ([`render`]): per-queue depth, bytes, oldest
//!   age, consumers and the publish/deliver/ack/redeliver counters are the
//!   engine's own atomics and partition snapshots; store figures are
//!   `Store::stats`; alarms are the broker's watch. Nothing is registered
//!   per queue, so a queue costs the recorder nothing between scrapes.
//! * **Recorded as they happen** through the `metrics` facade into
//!   `metrics-exporter-prometheus`: per tenant and protocol connection,
//!   channel, message, byte and error counters (a session counts a batch in
//!   locals and adds it once, [`ConnMetrics::flush`]); publish-to-confirm and
//!   publish-to-deliver latency histograms (one clock read per batch); the
//!   store's fsync latency and group-commit sizes (`weir_backend::metrics`,
//!   once per commit round); quota and backpressure events.
//!
//! Names follow Prometheus conventions, and RabbitMQ's `rabbitmq_*` names
//! where an equivalent exists (docs/metrics.md has the mapping).

pub mod render;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use metrics::{Counter, Gauge};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

/// Connections open (gauge; `vhost`, `protocol`).
pub const CONNECTIONS: &str = "rabbitmq_connections";
/// Connections opened (counter; `vhost`, `protocol`).
pub const CONNECTIONS_OPENED: &str = "rabbitmq_connections_opened_total";
/// Connections closed (counter; `vhost`, `protocol`).
pub const CONNECTIONS_CLOSED: &str = "rabbitmq_connections_closed_total";
/// Channels open (gauge; AMQP channels, one per MQTT session).
pub const CHANNELS: &str = "rabbitmq_channels";
/// Channels opened (counter).
pub const CHANNELS_OPENED: &str = "rabbitmq_channels_opened_total";
/// Channels closed (counter).
pub const CHANNELS_CLOSED: &str = "rabbitmq_channels_closed_total";
/// Messages received from publishers (counter).
pub const MESSAGES_RECEIVED: &str = "rabbitmq_global_messages_received_total";
/// Messages confirmed to publishers (AMQP confirms, MQTT PUBACK/PUBREC).
pub const MESSAGES_CONFIRMED: &str = "rabbitmq_global_messages_confirmed_total";
/// Messages delivered to consumers (counter).
pub const MESSAGES_DELIVERED: &str = "rabbitmq_global_messages_delivered_total";
/// Bytes read from clients (counter).
pub const BYTES_RECEIVED: &str = "rabbitmq_connection_incoming_bytes_total";
/// Bytes written to clients (counter).
pub const BYTES_SENT: &str = "rabbitmq_connection_outgoing_bytes_total";
/// Protocol errors: channel and connection closes caused by the client or
/// a refusal (counter; `kind` = `channel` | `connection`).
pub const ERRORS: &str = "weir_protocol_errors_total";
/// Logins refused (counter; `protocol`).
pub const AUTH_FAILURES: &str = "weir_auth_failures_total";
/// Publish to confirm, seconds (histogram).
pub const CONFIRM_SECONDS: &str = "weir_publish_to_confirm_seconds";
/// Publish (enqueue) to delivery, seconds (histogram).
pub const DELIVER_SECONDS: &str = "weir_publish_to_deliver_seconds";
/// A connection was blocked by its tenant's queued limit (counter; `vhost`).
pub const QUOTA_BLOCKS: &str = "weir_quota_blocks_total";
/// A connection's reads paused for a publish rate (counter; `vhost`).
pub const RATE_PAUSES: &str = "weir_quota_rate_pauses_total";
/// Operations refused for a tenant or user limit (counter; `protocol`).
pub const QUOTA_REFUSALS: &str = "weir_quota_refusals_total";
/// A publishing connection blocked by a resource alarm (counter; `protocol`).
pub const ALARM_BLOCKS: &str = "weir_alarm_blocks_total";

/// Latency buckets, seconds: 50 µs to 10 s.
const LATENCY_BUCKETS: &[f64] = &[
    0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0,
];
/// [`LATENCY_BUCKETS`] in microseconds, for integer comparisons.
const LATENCY_BUCKETS_US: [u64; LATENCY_BUCKETS.len()] = {
    let mut us = [0u64; LATENCY_BUCKETS.len()];
    let mut i = 0;
    while i < us.len() {
        us[i] = (LATENCY_BUCKETS[i] * 1e6) as u64;
        i += 1;
    }
    us
};
/// Group-commit waiters per round.
const COUNT_BUCKETS: &[f64] = &[
    1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 4096.0,
];
/// Bytes per commit round: 1 KiB to 16 MiB.
const BYTES_BUCKETS: &[f64] = &[
    1024.0,
    4096.0,
    16384.0,
    65536.0,
    262_144.0,
    1_048_576.0,
    4_194_304.0,
    16_777_216.0,
];
/// Histograms keep their samples until drained: drained this often even
/// when nobody scrapes, so memory does not grow with traffic.
const UPKEEP: Duration = Duration::from_secs(5);

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

/// Installs the Prometheus recorder as the process's global recorder (once;
/// later calls, say a second broker in a test process, share it) and returns
/// its handle. Call before any session or store records anything: handles
/// taken before it are no-ops.
pub fn install() -> &'static PrometheusHandle {
    HANDLE.get_or_init(|| {
        let builder = PrometheusBuilder::new()
            .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), LATENCY_BUCKETS)
            .and_then(|b| {
                b.set_buckets_for_metric(
                    Matcher::Full(weir_backend::metrics::COMMIT_BATCH_WAITERS.into()),
                    COUNT_BUCKETS,
                )
            })
            .and_then(|b| {
                b.set_buckets_for_metric(
                    Matcher::Full(weir_backend::metrics::COMMIT_BATCH_BYTES.into()),
                    BYTES_BUCKETS,
                )
            })
            .expect("bucket lists are not empty");
        let recorder = builder.build_recorder();
        let handle = recorder.handle();
        if metrics::set_global_recorder(recorder).is_err() {
            tracing::warn!(
                "a metrics recorder was already installed; /metrics shows only scrape-time figures"
            );
        }
        let h = handle.clone();
        let _ = std::thread::Builder::new()
            .name("weir-metrics".into())
            .spawn(move || loop {
                std::thread::sleep(UPKEEP);
                h.run_upkeep();
            });
        describe();
        handle
    })
}

/// HELP texts of the recorded series.
fn describe() {
    use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
    describe_gauge!(CONNECTIONS, "Open connections");
    describe_counter!(CONNECTIONS_OPENED, "Connections opened");
    describe_counter!(CONNECTIONS_CLOSED, "Connections closed");
    describe_gauge!(
        CHANNELS,
        "Open channels (AMQP channels; one per MQTT connection)"
    );
    describe_counter!(CHANNELS_OPENED, "Channels opened");
    describe_counter!(CHANNELS_CLOSED, "Channels closed");
    describe_counter!(MESSAGES_RECEIVED, "Messages received from publishers");
    describe_counter!(MESSAGES_CONFIRMED, "Messages confirmed to publishers");
    describe_counter!(MESSAGES_DELIVERED, "Messages delivered to consumers");
    describe_counter!(BYTES_RECEIVED, Unit::Bytes, "Bytes read from clients");
    describe_counter!(BYTES_SENT, Unit::Bytes, "Bytes written to clients");
    describe_counter!(ERRORS, "Channel and connection closes for an error");
    describe_counter!(AUTH_FAILURES, "Logins refused");
    describe_counter!(
        QUOTA_BLOCKS,
        "Connections blocked by their tenant's queued limit"
    );
    describe_counter!(
        RATE_PAUSES,
        "Times a connection's reads paused for a publish rate"
    );
    describe_counter!(
        QUOTA_REFUSALS,
        "Operations refused for a tenant or user limit"
    );
    describe_counter!(
        ALARM_BLOCKS,
        "Publishing connections blocked by a resource alarm"
    );
    describe_histogram!(
        weir_backend::metrics::FSYNC_SECONDS,
        Unit::Seconds,
        "One fdatasync of the store's head segment"
    );
    describe_histogram!(
        weir_backend::metrics::COMMIT_BATCH_WAITERS,
        "Waiters (confirm barriers, declares) completed by one synced commit round"
    );
    describe_histogram!(
        weir_backend::metrics::COMMIT_BATCH_BYTES,
        Unit::Bytes,
        "Bytes written by one commit round"
    );
    describe_counter!(
        weir_backend::metrics::COMPACTIONS,
        "Compaction passes that moved records"
    );
    describe_counter!(
        weir_backend::metrics::COMPACTED_RECORDS,
        "Records moved by compaction"
    );
}

/// A protocol's label value.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Protocol {
    /// AMQP 0-9-1 (plain or TLS).
    Amqp,
    /// MQTT 3.1.1 and 5 (TCP, TLS, WebSocket).
    Mqtt,
}

impl Protocol {
    /// The `protocol` label.
    pub fn label(self) -> &'static str {
        match self {
            Protocol::Amqp => "amqp091",
            Protocol::Mqtt => "mqtt",
        }
    }
}

/// A refused login of `protocol`.
pub fn auth_failure(protocol: Protocol) {
    metrics::counter!(AUTH_FAILURES, "protocol" => protocol.label()).increment(1);
}

/// A publishing connection of `protocol` was blocked by a resource alarm.
pub fn alarm_block(protocol: Protocol) {
    metrics::counter!(ALARM_BLOCKS, "protocol" => protocol.label()).increment(1);
}

/// The handles of one tenant and protocol, shared by its connections (an
/// idle MQTT connection carries one pointer to them, not a dozen).
struct Handles {
    protocol: Protocol,
    vhost: String,
    received: Counter,
    confirmed: Counter,
    delivered: Counter,
    bytes_in: Counter,
    bytes_out: Counter,
    channels: Gauge,
    channels_opened: Counter,
    channels_closed: Counter,
    connections: Gauge,
    connections_opened: Counter,
    connections_closed: Counter,
    confirm: Latency,
    deliver: Latency,
}

/// A latency histogram kept as Prometheus keeps one, counts per bucket of
/// [`LATENCY_BUCKETS`] (then +Inf) and a sum, written at scrape time
/// (`render.rs`). Not the exporter's histogram: that keeps every sample
/// (a timestamped push per message, drained later), which cost about a
/// tenth of the saturated workload's throughput.
#[derive(Default)]
struct Latency {
    /// Samples per bucket (not cumulative); the last is +Inf.
    buckets: [AtomicU64; LATENCY_BUCKETS.len() + 1],
    /// Sum of the samples, nanoseconds.
    sum_nanos: AtomicU64,
}

/// A connection's samples of one [`Latency`] not yet added to it.
#[derive(Default)]
struct PendingLatency {
    buckets: [u64; LATENCY_BUCKETS.len() + 1],
    sum_nanos: u64,
}

impl PendingLatency {
    /// `n` samples of `secs`.
    #[inline]
    fn record(&mut self, secs: f64, n: u64) {
        // Prometheus buckets are "less than or equal to".
        let i = LATENCY_BUCKETS.partition_point(|&b| b < secs);
        self.buckets[i] += n;
        self.sum_nanos += (secs * 1e9) as u64 * n;
    }

    /// One sample of `ms` whole milliseconds (a wait measured with a
    /// millisecond clock): integer work only, it runs per delivery.
    #[inline]
    fn record_ms(&mut self, ms: u64) {
        let i = if ms == 0 {
            0
        } else {
            LATENCY_BUCKETS_US.partition_point(|&b| b < ms * 1000)
        };
        self.buckets[i] += 1;
        self.sum_nanos += ms * 1_000_000;
    }

    fn flush(&mut self, into: &Latency) {
        for (p, a) in self.buckets.iter_mut().zip(&into.buckets) {
            if *p > 0 {
                a.fetch_add(std::mem::take(p), Ordering::Relaxed);
            }
        }
        into.sum_nanos
            .fetch_add(std::mem::take(&mut self.sum_nanos), Ordering::Relaxed);
    }
}

/// The handles of each (tenant, protocol).
type HandleMap = HashMap<(String, Protocol), Arc<Handles>>;

/// Every tenant's and protocol's [`Handles`], made at its first connection
/// (bounded by the tenants ever logged into, times two protocols).
static HANDLES: OnceLock<parking_lot::Mutex<HandleMap>> = OnceLock::new();

impl Handles {
    /// The shared handles of `vhost` and `protocol`.
    fn of(protocol: Protocol, vhost: &str) -> Arc<Handles> {
        let mut map = HANDLES.get_or_init(Default::default).lock();
        if let Some(h) = map.get(&(vhost.to_string(), protocol)) {
            return h.clone();
        }
        let labels = [
            ("vhost", vhost.to_string()),
            ("protocol", protocol.label().to_string()),
        ];
        let h = Arc::new(Handles {
            protocol,
            vhost: vhost.to_string(),
            received: metrics::counter!(MESSAGES_RECEIVED, &labels),
            confirmed: metrics::counter!(MESSAGES_CONFIRMED, &labels),
            delivered: metrics::counter!(MESSAGES_DELIVERED, &labels),
            bytes_in: metrics::counter!(BYTES_RECEIVED, &labels),
            bytes_out: metrics::counter!(BYTES_SENT, &labels),
            channels: metrics::gauge!(CHANNELS, &labels),
            channels_opened: metrics::counter!(CHANNELS_OPENED, &labels),
            channels_closed: metrics::counter!(CHANNELS_CLOSED, &labels),
            connections: metrics::gauge!(CONNECTIONS, &labels),
            connections_opened: metrics::counter!(CONNECTIONS_OPENED, &labels),
            connections_closed: metrics::counter!(CONNECTIONS_CLOSED, &labels),
            confirm: Latency::default(),
            deliver: Latency::default(),
        });
        map.insert((vhost.to_string(), protocol), h.clone());
        h
    }
}

/// One logged-in connection's figures, labelled with its tenant and
/// protocol. Counts of a batch are kept in plain fields and added to the
/// shared counters once per batch ([`ConnMetrics::flush`]), so connections
/// of one tenant on different cores do not contend on a counter per
/// message.
pub struct ConnMetrics {
    h: Arc<Handles>,
    /// Channels open now (given back to the gauge when dropped).
    open_channels: u64,
    pending_received: u64,
    pending_delivered: u64,
    pending_in: u64,
    pending_out: u64,
    /// Socket reads and writes not yet flushed (the registry's `recv_cnt`,
    /// `send_cnt`); 32-bit, as a batch is a few reads, to keep an idle
    /// connection small.
    pending_reads: u32,
    pending_writes: u32,
    /// The connection's own entry in the registry of live connections,
    /// whose [`crate::connections::Traffic`] gets the batch's bytes too.
    listed: Option<Arc<crate::connections::ConnInfo>>,
    /// Confirm and deliver latencies not yet flushed; boxed on first use
    /// so an idle connection carries one pointer.
    pending_latency: Option<Box<[PendingLatency; 2]>>,
}

impl ConnMetrics {
    /// A connection of `protocol` opened on `vhost`.
    pub fn open(protocol: Protocol, vhost: &str) -> Self {
        let h = Handles::of(protocol, vhost);
        h.connections.increment(1.0);
        h.connections_opened.increment(1);
        ConnMetrics {
            h,
            open_channels: 0,
            pending_received: 0,
            pending_delivered: 0,
            pending_in: 0,
            pending_out: 0,
            pending_reads: 0,
            pending_writes: 0,
            listed: None,
            pending_latency: None,
        }
    }

    fn latency(&mut self) -> &mut [PendingLatency; 2] {
        self.pending_latency.get_or_insert_with(Default::default)
    }

    /// A message was received from the client.
    #[inline]
    pub fn received(&mut self) {
        self.pending_received += 1;
    }

    /// `n` bytes were read from the client (one socket read).
    #[inline]
    pub fn bytes_in(&mut self, n: usize) {
        self.pending_in += n as u64;
        self.pending_reads += 1;
    }

    /// `n` bytes were written to the client (one socket write).
    #[inline]
    pub fn bytes_out(&mut self, n: usize) {
        self.pending_out += n as u64;
        self.pending_writes += 1;
    }

    /// Traffic of the handshake, before this connection had a tenant and
    /// these metrics.
    pub fn before_open(&mut self, t: &PreOpen) {
        self.pending_in += u64::from(t.bytes_in);
        self.pending_reads += t.reads;
        self.pending_out += u64::from(t.bytes_out);
        self.pending_writes += t.writes;
    }

    /// From now on, flushes also add the connection's bytes, reads and
    /// writes to its registry entry (`/api/connections`).
    pub fn report_to(&mut self, info: Arc<crate::connections::ConnInfo>) {
        self.listed = Some(info);
    }

    /// A message enqueued at `enqueued_ms` (Unix ms) was delivered at
    /// `now_ms`.
    #[inline]
    pub fn delivered(&mut self, enqueued_ms: u64, now_ms: u64) {
        self.pending_delivered += 1;
        self.latency()[1].record_ms(now_ms.saturating_sub(enqueued_ms));
    }

    /// `n` publishes were confirmed, `waited` after their batch ended.
    pub fn confirmed(&mut self, n: u64, waited: Duration) {
        if n == 0 {
            return;
        }
        self.h.confirmed.increment(n);
        self.latency()[0].record(waited.as_secs_f64(), n);
    }

    /// `n` publishes were confirmed; their latency is not known (MQTT
    /// keeps no time per pending acknowledgement).
    pub fn confirmed_count(&mut self, n: u64) {
        self.h.confirmed.increment(n);
    }

    /// A channel opened.
    pub fn channel_opened(&mut self) {
        self.open_channels += 1;
        self.h.channels.increment(1.0);
        self.h.channels_opened.increment(1);
    }

    /// `n` channels closed.
    pub fn channels_closed(&mut self, n: u64) {
        let n = n.min(self.open_channels);
        if n == 0 {
            return;
        }
        self.open_channels -= n;
        self.h.channels.decrement(n as f64);
        self.h.channels_closed.increment(n);
    }

    /// A channel or the connection was closed for an error
    /// (`kind`: `channel` or `connection`).
    pub fn error(&self, kind: &'static str) {
        metrics::counter!(ERRORS, "vhost" => self.h.vhost.clone(), "protocol" => self.h.protocol.label(), "kind" => kind)
            .increment(1);
    }

    /// Adds the batch's counts to the shared counters (and the
    /// connection's traffic to its registry entry).
    pub fn flush(&mut self) {
        if (self.pending_reads | self.pending_writes) > 0 {
            if let Some(l) = &self.listed {
                l.traffic.add(
                    self.pending_in,
                    u64::from(self.pending_reads),
                    self.pending_out,
                    u64::from(self.pending_writes),
                );
            }
            self.pending_reads = 0;
            self.pending_writes = 0;
        }
        let h = &self.h;
        for (pending, counter) in [
            (&mut self.pending_received, &h.received),
            (&mut self.pending_delivered, &h.delivered),
            (&mut self.pending_in, &h.bytes_in),
            (&mut self.pending_out, &h.bytes_out),
        ] {
            if *pending > 0 {
                counter.increment(std::mem::take(pending));
            }
        }
        if let Some(p) = self.pending_latency.as_deref_mut() {
            p[0].flush(&h.confirm);
            p[1].flush(&h.deliver);
        }
    }
}

impl Drop for ConnMetrics {
    fn drop(&mut self) {
        self.flush();
        self.channels_closed(self.open_channels);
        self.h.connections.decrement(1.0);
        self.h.connections_closed.increment(1);
    }
}

/// A connection's traffic before it opened a tenant (and its
/// [`ConnMetrics`]): the handshake, counted by the session and handed over
/// with [`ConnMetrics::before_open`].
#[derive(Clone, Copy, Debug, Default)]
///
/// 32-bit (saturating): a handshake is small and bounded by its timeout,
/// and every idle connection carries this.
pub struct PreOpen {
    /// Bytes read.
    pub bytes_in: u32,
    /// Socket reads.
    pub reads: u32,
    /// Bytes written.
    pub bytes_out: u32,
    /// Socket writes.
    pub writes: u32,
}

impl PreOpen {
    /// One read of `n` bytes.
    pub fn read(&mut self, n: usize) {
        self.bytes_in = self
            .bytes_in
            .saturating_add(u32::try_from(n).unwrap_or(u32::MAX));
        self.reads = self.reads.saturating_add(1);
    }

    /// One write of `n` bytes.
    pub fn wrote(&mut self, n: usize) {
        self.bytes_out = self
            .bytes_out
            .saturating_add(u32::try_from(n).unwrap_or(u32::MAX));
        self.writes = self.writes.saturating_add(1);
    }
}

/// An operation (connection, declare, consume, publish) of `protocol` was
/// refused for a tenant or user limit.
pub fn quota_refused(protocol: Protocol) {
    metrics::counter!(QUOTA_REFUSALS, "protocol" => protocol.label()).increment(1);
}

/// A connection was blocked by its tenant's queued limit (see `tenant_gate`).
pub fn quota_block(vhost: &str) {
    metrics::counter!(QUOTA_BLOCKS, "vhost" => vhost.to_string()).increment(1);
}

/// A connection of `vhost` paused for a publish rate.
pub fn rate_pause(vhost: &str) {
    metrics::counter!(RATE_PAUSES, "vhost" => vhost.to_string()).increment(1);
}

#[cfg(test)]
mod latency_tests {
    use super::*;

    #[test]
    fn whole_milliseconds_fall_in_the_buckets_seconds_would() {
        for ms in [0u64, 1, 2, 3, 7, 10, 11, 999, 1000, 20_000] {
            let (mut a, mut b) = (PendingLatency::default(), PendingLatency::default());
            a.record_ms(ms);
            b.record(ms as f64 / 1000.0, 1);
            assert_eq!(a.buckets, b.buckets, "{ms} ms");
            assert_eq!(a.sum_nanos, b.sum_nanos, "{ms} ms");
        }
    }
}
