//! `weir-bench`: a lean AMQP 0-9-1 load generator.
//!
//! Publishers keep a window of unconfirmed persistent publishes; consumers ack with `multiple=true`.
//! The protocol is driven by hand over tokio sockets with `amq-protocol`'s frame codec, because a full
//! client library (lapin) spends ~50 µs of CPU per message, which on a 2-core machine shared with the
//! broker would mostly measure the client. See `docs/BENCHMARKS.md`.
//!
//! Runtime: current-thread by default (`--threads 1`). All connections are multiplexed on one thread
//! so the client uses at most one core and leaves the other to the broker, and so its CPU cost is
//! easy to read. The client reports its own CPU time per message; if it ever approaches a core, raise
//! `--threads` (multi-threaded runtime) — at that point the machine, not the broker, is the limit.

#![forbid(unsafe_code)]

mod conn;
mod consumer;
mod publisher;
mod stats;

use std::sync::Arc;
use std::time::Duration;

use amq_protocol::protocol::{exchange, queue, AMQPClass};
use amq_protocol::types::{AMQPValue, FieldTable, LongString};
use amq_protocol::uri::AMQPUri;
use clap::{ArgAction, Parser, ValueEnum};
use hdrhistogram::Histogram;
use tokio::sync::watch;

use conn::{err, BenchError, Conn, Context, Result};
use stats::{now_ns, Percentiles};

/// Lean AMQP 0-9-1 load generator: confirmed persistent publishes, acked consumes, latency percentiles.
#[derive(Parser, Debug, Clone)]
#[command(version)]
struct Args {
    /// Broker URL: amqp://user:pass@host:port/vhost (vhost "/" is written %2f).
    #[arg(long, default_value = "amqp://guest:guest@127.0.0.1:5672/%2f")]
    url: String,
    /// Publisher connections.
    #[arg(long, default_value_t = 2)]
    publishers: u32,
    /// Consumer connections.
    #[arg(long, default_value_t = 2)]
    consumers: u32,
    /// Message body size in bytes (at least 8: the body starts with the send timestamp).
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u32).range(8..=16_777_216))]
    size: u32,
    /// Unconfirmed publishes allowed in flight per publisher.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..))]
    window: u32,
    /// Consumer prefetch (basic.qos) per consumer.
    #[arg(long, default_value_t = 256)]
    prefetch: u16,
    /// Ack (multiple=true) after this many deliveries; default prefetch/4 so credit never runs dry.
    #[arg(long)]
    ack_every: Option<u32>,
    /// Also ack whatever is pending after this many milliseconds without deliveries.
    #[arg(long, default_value_t = 1)]
    ack_idle_ms: u64,
    /// Total publish rate in msg/s across all publishers; 0 = saturated (as fast as confirms allow).
    #[arg(long, default_value_t = 0)]
    rate: u32,
    /// Measured seconds (after warm-up).
    #[arg(long, default_value_t = 20.0)]
    duration: f64,
    /// Warm-up seconds, not counted.
    #[arg(long, default_value_t = 3.0)]
    warmup: f64,
    /// Queue name; deleted before and after the run so runs are independent.
    #[arg(long, default_value = "weir-bench")]
    queue: String,
    /// Queue type, sent as the `x-queue-type` argument.
    #[arg(long, value_enum, default_value_t = QueueType::Classic)]
    queue_type: QueueType,
    /// Declare the queue durable.
    #[arg(long, default_value_t = true, action = ArgAction::Set)]
    durable: bool,
    /// Publish with delivery_mode 2 (persistent).
    #[arg(long, default_value_t = true, action = ArgAction::Set)]
    persistent: bool,
    /// More queue.declare arguments, as a JSON object, e.g.
    /// '{"x-dead-letter-exchange":"weir-bench.dlx","x-message-ttl":3600000,"x-max-length":10000000}'.
    /// Strings are sent as longstr, integers as long (64-bit), booleans as bool. A named
    /// `x-dead-letter-exchange` is declared (fanout) with a queue `<queue>.dlq` bound to it, and the
    /// report counts what reached it.
    #[arg(long)]
    queue_args: Option<String>,
    /// Publish each message with a priority drawn uniformly from 0..N (0 = no priority property).
    /// Pair with `--queue-args '{"x-max-priority":N}'`.
    #[arg(long, default_value_t = 0)]
    priorities: u8,
    /// Runtime worker threads: 1 = current-thread runtime (default, see crate docs).
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// PID of the broker (same machine): its CPU time over the measured window is reported too.
    #[arg(long)]
    broker_pid: Option<u32>,
    /// Print one JSON object instead of the human-readable report.
    #[arg(long)]
    json: bool,
    /// Label copied into the report (e.g. "rabbitmq-classic").
    #[arg(long, default_value = "")]
    label: String,
}

#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
enum QueueType {
    Classic,
    Quorum,
}

impl QueueType {
    fn as_str(self) -> &'static str {
        match self {
            QueueType::Classic => "classic",
            QueueType::Quorum => "quorum",
        }
    }
}

/// Timeline of a run, in nanoseconds since the process epoch (see [`stats::now_ns`]).
#[derive(Debug, Clone, Copy)]
pub struct Plan {
    pub start_ns: u64,
    pub warmup_end_ns: u64,
    pub end_ns: u64,
}

fn main() {
    let args = Args::parse();
    let rt = if args.threads <= 1 {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
    } else {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(args.threads)
            .enable_all()
            .build()
    };
    let result = rt
        .ctx("building tokio runtime")
        .and_then(|rt| rt.block_on(run(args.clone())));
    match result {
        Ok(report) => {
            if args.json {
                let json = format!("{}\n", report.to_json());
                let _ = std::io::Write::write_all(&mut std::io::stdout(), json.as_bytes());
            } else {
                report.print();
            }
        }
        Err(e) => {
            eprintln!("weir-bench: {e}");
            std::process::exit(1);
        }
    }
}

/// Everything the run measured, merged over connections.
struct Report {
    args: Args,
    measured_s: f64,
    sent: u64,
    confirmed: u64,
    nacked: u64,
    consumed: u64,
    redelivered: u64,
    left_in_queue: Option<u32>,
    /// Messages found in the dead-letter queue at the end (with a named `x-dead-letter-exchange`).
    dead_lettered: Option<u32>,
    confirm: Percentiles,
    confirm_service: Percentiles,
    e2e: Percentiles,
    cpu_s: Option<f64>,
    /// CPU seconds the broker process used during the window (with `--broker-pid`).
    broker_cpu_s: Option<f64>,
    /// CPU seconds the whole machine spent busy (all processes) during the window.
    machine_busy_s: Option<f64>,
}

impl Report {
    fn publish_rate(&self) -> f64 {
        self.confirmed as f64 / self.measured_s
    }
    fn consume_rate(&self) -> f64 {
        self.consumed as f64 / self.measured_s
    }
    /// Client CPU per message moved (one publish + its consume counted once).
    fn cpu_us_per_msg(&self) -> Option<f64> {
        self.per_msg(self.cpu_s)
    }
    /// CPU seconds spread over the messages moved, in µs per message.
    fn per_msg(&self, cpu_s: Option<f64>) -> Option<f64> {
        let msgs = self.confirmed.max(self.consumed);
        cpu_s.filter(|_| msgs > 0).map(|s| s * 1e6 / msgs as f64)
    }
    /// CPU used by neither the client nor the broker: other work on the machine, i.e. noise.
    fn other_cores(&self) -> Option<f64> {
        let other = self.machine_busy_s? - self.cpu_s? - self.broker_cpu_s?;
        Some((other / self.measured_s).max(0.0))
    }

    /// The human-readable report. Written with one `write_all` whose error is ignored, so piping into
    /// `head` does not panic on a closed stdout.
    fn print(&self) {
        use std::fmt::Write as _;
        let mut o = String::new();
        macro_rules! out {
            ($($t:tt)*) => {{
                let _ = writeln!(o, $($t)*);
            }};
        }
        let a = &self.args;
        let mode = if a.rate == 0 {
            "saturated".to_string()
        } else {
            format!("{} msg/s", a.rate)
        };
        out!(
            "weir-bench{}: {} queue={} type={} publishers={} consumers={} size={} window={} prefetch={} mode={} measured={:.1}s",
            if a.label.is_empty() { String::new() } else { format!(" {}", a.label) }, redact(&a.url), a.queue, a.queue_type.as_str(), a.publishers, a.consumers,
            a.size, a.window, a.prefetch, mode, self.measured_s
        );
        if let Some(q) = &a.queue_args {
            out!("  queue arguments: {q}");
        }
        if a.priorities > 0 {
            out!("  priorities: uniform 0..={}", a.priorities - 1);
        }
        out!(
            "  published (confirmed): {:>10.0} msg/s   nacked: {}",
            self.publish_rate(),
            self.nacked
        );
        out!(
            "  consumed (acked):      {:>10.0} msg/s   redelivered: {}   left in queue: {}",
            self.consume_rate(),
            self.redelivered,
            self.left_in_queue
                .map_or("?".to_string(), |n| n.to_string())
        );
        if let Some(n) = self.dead_lettered {
            out!("  dead-lettered: {n}");
        }
        let mut line = |name: &str, p: &Percentiles| {
            out!(
                "  {name:<22} p50 {:>8.3} ms  p95 {:>8.3} ms  p99 {:>8.3} ms  max {:>8.3} ms  (n={})",
                p.p50, p.p95, p.p99, p.max, p.count
            )
        };
        line("confirm latency:", &self.confirm);
        if a.rate != 0 {
            line("  (from actual send):", &self.confirm_service);
        }
        line("end-to-end latency:", &self.e2e);
        match (self.cpu_s, self.cpu_us_per_msg()) {
            (Some(cpu), Some(per)) => out!(
                "  client CPU: {:.2} µs/msg, {:.2} cores",
                per,
                cpu / self.measured_s
            ),
            _ => out!("  client CPU: unavailable"),
        }
        if let (Some(cpu), Some(per)) = (self.broker_cpu_s, self.per_msg(self.broker_cpu_s)) {
            out!(
                "  broker CPU: {:.2} µs/msg, {:.2} cores",
                per,
                cpu / self.measured_s
            );
        }
        if let Some(other) = self.other_cores() {
            out!("  other CPU (noise): {other:.2} cores");
        }
        if let Some(busy) = self.machine_busy_s {
            // Broker + client + anything else: a busy figure well above broker + client flags noise.
            out!(
                "  machine busy: {:.2} cores (of {})",
                busy / self.measured_s,
                std::thread::available_parallelism().map_or(0, |n| n.get())
            );
        }
        let _ = std::io::Write::write_all(&mut std::io::stdout(), o.as_bytes());
    }

    fn to_json(&self) -> String {
        let a = &self.args;
        let p = |p: &Percentiles| serde_json::json!({"count": p.count, "p50_ms": p.p50, "p95_ms": p.p95, "p99_ms": p.p99, "max_ms": p.max});
        serde_json::json!({
            "label": a.label,
            "url": redact(&a.url),
            "queue": a.queue,
            "queue_type": a.queue_type.as_str(),
            "publishers": a.publishers,
            "consumers": a.consumers,
            "size": a.size,
            "window": a.window,
            "prefetch": a.prefetch,
            "rate": a.rate,
            "durable": a.durable,
            "persistent": a.persistent,
            "threads": a.threads,
            "queue_args": a.queue_args.as_deref().and_then(|q| serde_json::from_str::<serde_json::Value>(q).ok()),
            "priorities": a.priorities,
            "dead_lettered": self.dead_lettered,
            "measured_s": self.measured_s,
            "sent": self.sent,
            "confirmed": self.confirmed,
            "nacked": self.nacked,
            "consumed": self.consumed,
            "redelivered": self.redelivered,
            "left_in_queue": self.left_in_queue,
            "publish_rate": self.publish_rate(),
            "consume_rate": self.consume_rate(),
            "confirm_latency": p(&self.confirm),
            "confirm_service_latency": p(&self.confirm_service),
            "e2e_latency": p(&self.e2e),
            "client_cpu_s": self.cpu_s,
            "client_cpu_us_per_msg": self.cpu_us_per_msg(),
            "client_cpu_cores": self.cpu_s.map(|c| c / self.measured_s),
            "machine_busy_cores": self.machine_busy_s.map(|c| c / self.measured_s),
            "broker_cpu_cores": self.broker_cpu_s.map(|c| c / self.measured_s),
            "broker_cpu_us_per_msg": self.per_msg(self.broker_cpu_s),
            "other_cpu_cores": self.other_cores(),
            "cores": std::thread::available_parallelism().map(|n| n.get()).ok(),
        })
        .to_string()
    }
}

/// Hide the password in a URL before printing it.
fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s => {
            let creds = &url[s + 3..at];
            let user = creds.split(':').next().unwrap_or("");
            format!("{}{}:***{}", &url[..s + 3], user, &url[at..])
        }
        _ => url.to_string(),
    }
}

/// The `--queue-args` JSON object as an AMQP field table.
fn queue_args_table(json: &str) -> Result<FieldTable> {
    let v: serde_json::Value =
        serde_json::from_str(json).map_err(|e| BenchError(format!("bad --queue-args: {e}")))?;
    match to_amqp(&v)? {
        AMQPValue::FieldTable(t) => Ok(t),
        _ => err("bad --queue-args: expected a JSON object"),
    }
}

/// A JSON value as the AMQP field value RabbitMQ's clients send for it.
fn to_amqp(v: &serde_json::Value) -> Result<AMQPValue> {
    use serde_json::Value as J;
    Ok(match v {
        J::Null => AMQPValue::Void,
        J::Bool(b) => AMQPValue::Boolean(*b),
        J::Number(n) => match (n.as_i64(), n.as_f64()) {
            (Some(i), _) => AMQPValue::LongLongInt(i),
            (None, Some(f)) if n.is_f64() => AMQPValue::Double(f),
            _ => {
                return err(format!(
                    "bad --queue-args: {n} does not fit a signed 64-bit long"
                ))
            }
        },
        J::String(s) => AMQPValue::LongString(LongString::from(s.as_str())),
        J::Array(a) => {
            AMQPValue::FieldArray(a.iter().map(to_amqp).collect::<Result<Vec<_>>>()?.into())
        }
        J::Object(o) => {
            let mut t = FieldTable::default();
            for (k, v) in o {
                t.insert(k.as_str().into(), to_amqp(v)?);
            }
            AMQPValue::FieldTable(t)
        }
    })
}

/// The named dead-letter exchange in the queue arguments, if any (`""` is the default exchange,
/// which needs nothing declared).
fn named_dlx(args: &FieldTable) -> Option<String> {
    match args.inner().get("x-dead-letter-exchange") {
        Some(AMQPValue::LongString(s)) if !s.as_bytes().is_empty() => {
            Some(String::from_utf8_lossy(s.as_bytes()).into_owned())
        }
        _ => None,
    }
}

/// Declare the dead-letter exchange `dlx` (fanout, durable) and a durable queue `dlq` bound to it,
/// so what the benchmark queue dead-letters is kept and counted.
async fn declare_dlx(conn: &mut Conn, dlx: &str, dlq: &str) -> Result<()> {
    let reply = conn
        .call(AMQPClass::Exchange(exchange::AMQPMethod::Declare(
            exchange::Declare {
                exchange: dlx.into(),
                kind: "fanout".into(),
                passive: false,
                durable: true,
                auto_delete: false,
                internal: false,
                nowait: false,
                arguments: FieldTable::default(),
            },
        )))
        .await
        .ctx(format!("exchange.declare {dlx}"))?;
    if !matches!(
        reply,
        AMQPClass::Exchange(exchange::AMQPMethod::DeclareOk(_))
    ) {
        return err(format!("expected exchange.declare-ok, got {reply:?}"));
    }
    declare_queue(conn, dlq, true, FieldTable::default()).await?;
    let reply = conn
        .call(AMQPClass::Queue(queue::AMQPMethod::Bind(queue::Bind {
            queue: dlq.into(),
            exchange: dlx.into(),
            routing_key: "".into(),
            nowait: false,
            arguments: FieldTable::default(),
        })))
        .await
        .ctx(format!("queue.bind {dlq} to {dlx}"))?;
    match reply {
        AMQPClass::Queue(queue::AMQPMethod::BindOk(_)) => Ok(()),
        other => err(format!("expected queue.bind-ok, got {other:?}")),
    }
}

/// Declare queue `name` (not exclusive, not auto-delete).
async fn declare_queue(conn: &mut Conn, name: &str, durable: bool, args: FieldTable) -> Result<()> {
    let reply = conn
        .call(AMQPClass::Queue(queue::AMQPMethod::Declare(
            queue::Declare {
                queue: name.into(),
                passive: false,
                durable,
                exclusive: false,
                auto_delete: false,
                nowait: false,
                arguments: args,
            },
        )))
        .await
        .ctx(format!("queue.declare {name}"))?;
    match reply {
        AMQPClass::Queue(queue::AMQPMethod::DeclareOk(_)) => Ok(()),
        other => err(format!("expected queue.declare-ok, got {other:?}")),
    }
}

/// Delete exchange `name` (best effort: only used to clean up).
async fn delete_exchange(conn: &mut Conn, name: &str) -> Result<()> {
    conn.call(AMQPClass::Exchange(exchange::AMQPMethod::Delete(
        exchange::Delete {
            exchange: name.into(),
            if_unused: false,
            nowait: false,
        },
    )))
    .await
    .ctx(format!("exchange.delete {name}"))
    .map(drop)
}

/// Delete the queue, returning how many messages it still held.
async fn delete_queue(conn: &mut Conn, name: &str) -> Result<u32> {
    let reply = conn
        .call(AMQPClass::Queue(queue::AMQPMethod::Delete(queue::Delete {
            queue: name.into(),
            if_unused: false,
            if_empty: false,
            nowait: false,
        })))
        .await
        .ctx(format!("queue.delete {name}"))?;
    match reply {
        AMQPClass::Queue(queue::AMQPMethod::DeleteOk(ok)) => Ok(ok.message_count),
        other => err(format!("expected queue.delete-ok, got {other:?}")),
    }
}

async fn run(args: Args) -> Result<Report> {
    let uri: AMQPUri = args
        .url
        .parse()
        .map_err(|e| BenchError(format!("bad --url: {e}")))?;
    if args.publishers == 0 && args.consumers == 0 {
        return err("nothing to do: --publishers and --consumers are both 0");
    }
    if !(args.duration > 0.0 && args.warmup >= 0.0) {
        return err("--duration must be > 0 and --warmup >= 0");
    }
    let ack_every = args
        .ack_every
        .unwrap_or((u32::from(args.prefetch) / 4).max(1));
    if args.prefetch != 0 && ack_every > u32::from(args.prefetch) {
        // Never reached before credit runs out: only the idle timer would ack, throttling consumers.
        return err("--ack-every must not exceed --prefetch");
    }

    let mut qargs = FieldTable::default();
    qargs.insert(
        "x-queue-type".into(),
        AMQPValue::LongString(LongString::from(args.queue_type.as_str())),
    );
    if let Some(json) = &args.queue_args {
        // Given arguments win, x-queue-type included.
        for (k, v) in &queue_args_table(json)? {
            qargs.insert(k.clone(), v.clone());
        }
    }
    let dlx = named_dlx(&qargs);
    let dlq = format!("{}.dlq", args.queue);

    // Fresh queue: delete whatever a previous (possibly aborted) run left, then declare.
    // On a throwaway connection: per the spec, deleting a missing queue is a 404 channel error
    // (RabbitMQ answers delete-ok instead), which would leave the channel unusable.
    for q in std::iter::once(&args.queue).chain(dlx.as_ref().map(|_| &dlq)) {
        let mut c = Conn::open(&uri).await.ctx("setup connection")?;
        let _ = delete_queue(&mut c, q).await;
        c.close().await;
    }
    let mut admin = Conn::open(&uri).await.ctx("setup connection")?;
    if let Some(dlx) = &dlx {
        declare_dlx(&mut admin, dlx, &dlq).await?;
    }
    declare_queue(&mut admin, &args.queue, args.durable, qargs).await?;

    // Connect every role before the clock starts, so connection set-up is not measured.
    let mut consumers = Vec::new();
    for i in 0..args.consumers {
        let mut c = Conn::open(&uri).await.ctx(format!("consumer {i}"))?;
        consumer::setup(
            &mut c,
            &args.queue,
            args.prefetch,
            &format!("weir-bench-{i}"),
        )
        .await
        .ctx(format!("consumer {i}"))?;
        consumers.push(c);
    }
    let mut publishers = Vec::new();
    for i in 0..args.publishers {
        let mut c = Conn::open(&uri).await.ctx(format!("publisher {i}"))?;
        publisher::setup(&mut c)
            .await
            .ctx(format!("publisher {i}"))?;
        publishers.push(c);
    }
    let frame_max = publishers.first().map_or(131_072, |c| c.frame_max);
    let template = Arc::new(publisher::Template::new(
        frame_max,
        &args.queue,
        args.size as usize,
        args.persistent,
        args.priorities,
    )?);

    let start_ns = now_ns();
    let warmup_end_ns = start_ns + (args.warmup * 1e9) as u64;
    let plan = Plan {
        start_ns,
        warmup_end_ns,
        end_ns: warmup_end_ns + (args.duration * 1e9) as u64,
    };

    // Paced mode: a dedicated thread ticks at the message interval (at most every 200 µs) with
    // nanosleep precision. tokio's timer wheel has 1 ms granularity, which would add up to ~1 ms of
    // pacing error to every latency measured from the intended send time.
    let interval_ns = if args.rate > 0 {
        1e9 / f64::from(args.rate)
    } else {
        0.0
    };
    let (tick_txs, mut tick_rxs): (Vec<_>, Vec<_>) =
        (0..args.publishers).map(|_| watch::channel(0u64)).unzip();
    let pacer = (args.rate > 0 && args.publishers > 0).then(|| {
        let period_ns = interval_ns.max(200_000.0) as u64;
        // One message per tick: wake only the publisher that owns it (message j belongs to publisher
        // j % N), halving the cross-thread wake-ups. Several per tick: wake everyone.
        let one_per_tick = interval_ns >= 200_000.0;
        let end = plan.end_ns;
        std::thread::spawn(move || {
            let n = tick_txs.len() as u64;
            for k in 1u64.. {
                let t_ns = start_ns + period_ns.saturating_mul(k);
                if t_ns >= end {
                    break;
                }
                let now = now_ns();
                if t_ns > now {
                    std::thread::sleep(Duration::from_nanos(t_ns - now));
                }
                if one_per_tick {
                    // A publisher that already finished has dropped its receiver; nothing to wake.
                    let _ = tick_txs[(k % n) as usize].send(k);
                } else {
                    for tx in &tick_txs {
                        let _ = tx.send(k);
                    }
                }
            }
        })
    });

    let mut pub_tasks = Vec::new();
    for (i, c) in publishers.into_iter().enumerate() {
        let pace = if args.rate > 0 {
            publisher::Pace::Rate {
                interval_ns,
                index: i as u64,
                of: u64::from(args.publishers),
                ticks: tick_rxs.remove(0),
            }
        } else {
            publisher::Pace::Saturated
        };
        let template = template.clone();
        let window = args.window as usize;
        pub_tasks.push(tokio::spawn(async move {
            publisher::run(c, &template, window, pace, plan)
                .await
                .ctx(format!("publisher {i}"))
        }));
    }
    let mut cons_tasks = Vec::new();
    let idle = Duration::from_millis(args.ack_idle_ms.max(1));
    for (i, c) in consumers.into_iter().enumerate() {
        cons_tasks.push(tokio::spawn(async move {
            consumer::run(c, ack_every, idle, plan)
                .await
                .ctx(format!("consumer {i}"))
        }));
    }

    // Sample our own CPU time exactly over the measurement window.
    tokio::time::sleep_until(stats::deadline(plan.warmup_end_ns)).await;
    let broker_pid = args.broker_pid.map(|p| p.to_string());
    let broker_cpu = || broker_pid.as_deref().and_then(stats::cpu_time_of);
    let cpu0 = stats::process_cpu_time();
    let machine0 = stats::machine_cpu_ticks();
    let broker0 = broker_cpu();
    tokio::time::sleep_until(stats::deadline(plan.end_ns)).await;
    let cpu1 = stats::process_cpu_time();
    let machine1 = stats::machine_cpu_ticks();
    let broker1 = broker_cpu();

    let mut confirm = stats::new_histogram();
    let mut confirm_service = stats::new_histogram();
    let mut e2e = stats::new_histogram();
    let (mut sent, mut confirmed, mut nacked, mut consumed, mut redelivered) = (0, 0, 0, 0, 0);
    let merge = |into: &mut Histogram<u64>, from: &Histogram<u64>| {
        // Same bounds everywhere, so add cannot fail; ignore rather than panic if it ever did.
        let _ = into.add(from);
    };
    for t in pub_tasks {
        let s = t.await.ctx("publisher task panicked")??;
        sent += s.sent;
        confirmed += s.confirmed;
        nacked += s.nacked;
        merge(&mut confirm, &s.confirm);
        merge(&mut confirm_service, &s.confirm_service);
    }
    for t in cons_tasks {
        let s = t.await.ctx("consumer task panicked")??;
        consumed += s.consumed;
        redelivered += s.redelivered;
        merge(&mut e2e, &s.e2e);
    }
    if let Some(p) = pacer {
        let _ = p.join();
    }

    let left_in_queue = delete_queue(&mut admin, &args.queue).await.ok();
    let mut dead_lettered = None;
    if let Some(dlx) = &dlx {
        dead_lettered = delete_queue(&mut admin, &dlq).await.ok();
        let _ = delete_exchange(&mut admin, dlx).await;
    }
    admin.close().await;

    Ok(Report {
        measured_s: args.duration,
        sent,
        confirmed,
        nacked,
        consumed,
        redelivered,
        left_in_queue,
        dead_lettered,
        confirm: Percentiles::of(&confirm),
        confirm_service: Percentiles::of(&confirm_service),
        e2e: Percentiles::of(&e2e),
        cpu_s: match (cpu0, cpu1) {
            (Some(a), Some(b)) => Some(b.saturating_sub(a).as_secs_f64()),
            _ => None,
        },
        broker_cpu_s: match (broker0, broker1) {
            (Some(a), Some(b)) => Some(b.saturating_sub(a).as_secs_f64()),
            _ => None,
        },
        machine_busy_s: match (machine0, machine1) {
            (Some(a), Some(b)) => Some(b.saturating_sub(a) as f64 / 100.0),
            _ => None,
        },
        args,
    })
}

#[cfg(test)]
mod tests {
    use super::{named_dlx, queue_args_table, redact};
    use amq_protocol::types::AMQPValue;

    #[test]
    fn queue_args_become_a_field_table() {
        let t = queue_args_table(
            r#"{"x-dead-letter-exchange":"dlx","x-message-ttl":3600000,"x-max-priority":10,"x-single-active-consumer":true}"#,
        )
        .unwrap();
        let m = t.inner();
        assert_eq!(
            m.get("x-message-ttl"),
            Some(&AMQPValue::LongLongInt(3_600_000))
        );
        assert_eq!(m.get("x-max-priority"), Some(&AMQPValue::LongLongInt(10)));
        assert_eq!(
            m.get("x-single-active-consumer"),
            Some(&AMQPValue::Boolean(true))
        );
        assert_eq!(named_dlx(&t).as_deref(), Some("dlx"));
        assert!(queue_args_table("[1]").is_err());
        assert!(queue_args_table("{").is_err());
        assert!(queue_args_table(r#"{"x-max-length":18446744073709551615}"#).is_err());
        assert_eq!(
            named_dlx(&queue_args_table(r#"{"x-dead-letter-exchange":""}"#).unwrap()),
            None
        );
    }

    #[test]
    fn redact_hides_the_password_only() {
        assert_eq!(
            redact("amqp://guest:secret@127.0.0.1:5672/%2f"),
            "amqp://guest:***@127.0.0.1:5672/%2f"
        );
        assert_eq!(redact("amqp://localhost"), "amqp://localhost");
    }
}
