//! `weir-abuse`: replays the attacks of issue 5 ("no client can stall Weir, exhaust its memory or
//! disk, or make it lose a confirmed message") against a running broker and prints one line of
//! `key=value` figures.
//!
//! The broker's lifecycle (fresh data dir, `kill -9`, restarts, a small tmpfs, a second process) is
//! `scripts/abuse.sh`'s job; this tool is the client side. With `--pid` it also samples the broker's
//! RSS (`rss_peak_mb`, VmHWM included) and runs a probe client that keeps connecting, opening a
//! channel and passive-declaring a queue (`probe_wait_ms`: the longest round, capped).

#![forbid(unsafe_code)]

#[allow(dead_code)] // shared with weir-bench; not every helper is used here
#[path = "../conn.rs"]
mod conn;

mod attacks;
mod http_door;
mod monitor;
mod mqtt_door;
mod noack;
mod ops;
mod raw;
mod retained;

// weir-mqtt-bench's hand-written MQTT encoders; the attacks use a few of them.
#[path = "../mqtt/wire.rs"]
#[allow(dead_code)]
mod mqtt_wire;

use std::io::{Read, Seek, SeekFrom, Write};
use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use amq_protocol::uri::AMQPUri;
use clap::{ArgAction, Parser, Subcommand};

use attacks::{PublishOpts, Target};
use conn::{BenchError, Context, Result};
use monitor::{Probe, RssSampler};

/// Replay one attack of issue 5 against a running broker; print its figures on one line.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// Broker URL: amqp://user:pass@host:port/vhost (vhost "/" is written %2f).
    #[arg(long, default_value = "amqp://guest:guest@127.0.0.1:5672/%2f")]
    url: String,
    /// Broker process id: sample its RSS during the attack.
    #[arg(long)]
    pid: Option<u32>,
    /// Run the probe client during the attack.
    #[arg(long, default_value_t = true, action = ArgAction::Set)]
    probe: bool,
    /// Longest probe round before it counts as a timeout, seconds.
    #[arg(long, default_value_t = 30)]
    probe_cap: u64,
    /// Give up on the whole attack after this many seconds.
    #[arg(long, default_value_t = 180)]
    timeout: u64,
    #[command(subcommand)]
    attack: Attack,
}

#[derive(Subcommand, Debug)]
enum Attack {
    /// 0: a connection.start-ok with an AMQPLAIN response nested DEPTH deep.
    LoginNesting {
        #[arg(long, value_enum)]
        kind: raw::Nesting,
        #[arg(long)]
        depth: usize,
    },
    /// 1: a 49-byte `#.a.#.a.…b` binding, then one publish per routing-key length (words).
    TopicBacktrack {
        #[arg(long, value_delimiter = ',', default_value = "30,32")]
        words: Vec<usize>,
        /// Seconds to wait for each publish's confirm.
        #[arg(long, default_value_t = 20)]
        limit: u64,
    },
    /// 2: COUNT queue.bind frames in one write.
    BindBurst {
        #[arg(long, default_value_t = 20_000)]
        count: usize,
        /// Seconds to wait for all bind-oks.
        #[arg(long, default_value_t = 45)]
        limit: u64,
    },
    /// Confirmed publishes to a queue (setup for 3 and 4, the attack itself for 5 and 6).
    Publish {
        #[arg(long)]
        queue: String,
        #[arg(long, default_value_t = 1000)]
        count: u64,
        #[arg(long, default_value_t = 1000)]
        size: usize,
        #[arg(long, default_value_t = true, action = ArgAction::Set)]
        durable: bool,
        #[arg(long, default_value_t = true, action = ArgAction::Set)]
        persistent: bool,
        #[arg(long, default_value_t = 256)]
        window: u64,
        /// Give up after this many seconds.
        #[arg(long, default_value_t = 60)]
        limit: u64,
        /// Give up when nothing is confirmed for this many seconds.
        #[arg(long, default_value_t = 10)]
        stall: u64,
    },
    /// Messages in a queue (passive declare).
    Count {
        #[arg(long)]
        queue: String,
    },
    /// Flip one bit of a file (no broker involved).
    Flip {
        #[arg(long)]
        file: std::path::PathBuf,
        #[arg(long)]
        offset: u64,
    },
    /// 5: passive declare, get + ack, purge on QUEUE, each on its own connection.
    DiskOps {
        #[arg(long)]
        queue: String,
    },
    /// 7: COUNT one-byte messages, each followed by a BIG-byte unroutable one.
    Amplify {
        #[arg(long, default_value_t = 10_000)]
        count: u64,
        #[arg(long, default_value_t = 122_880)]
        big: usize,
    },
    /// 8: COUNT persistent messages in a durable queue, then a prefetch-0 consumer that never reads.
    StalledConsumer {
        #[arg(long, default_value_t = 1_000_000)]
        count: u64,
        #[arg(long, default_value_t = 1000)]
        size: usize,
        /// Seconds to hold the stalled consumer.
        #[arg(long, default_value_t = 15)]
        hold: u64,
    },
    /// 9: CONNS connections each send SEND_MB of a BODY_MB message, then stall.
    Partial {
        #[arg(long, default_value_t = 20)]
        conns: usize,
        #[arg(long, default_value_t = 60)]
        body_mb: u64,
        #[arg(long, default_value_t = 59)]
        send_mb: u64,
        /// Seconds to stay stalled (is the connection cut off meanwhile?).
        #[arg(long, default_value_t = 45)]
        hold: u64,
    },
    /// 10: confirmed publishes to a fanout exchange with each number of bound queues.
    Fanout {
        #[arg(long, value_delimiter = ',', default_value = "1000,4000,8000")]
        queues: Vec<usize>,
        #[arg(long, default_value_t = 200)]
        publishes: u64,
    },
    /// 11a: wrong-password logins back to back for SECS seconds.
    LoginRate {
        #[arg(long, default_value_t = 5)]
        secs: u64,
    },
    /// Issue 20/1: COUNT persistent SIZE-byte messages, then one no-ack consumer for at most SECS
    /// seconds, reading at most READ_MBPS MB/s of bodies (0: as fast as it can).
    NoackDrain {
        #[arg(long, default_value_t = 100_000)]
        count: u64,
        #[arg(long, default_value_t = 300)]
        size: usize,
        #[arg(long, default_value_t = 60)]
        secs: u64,
        #[arg(long, default_value_t = 0)]
        read_mbps: u64,
    },
    /// 11b: fill a queue with COUNT transient SIZE-byte messages, purge, delete; RSS before and after.
    Trim {
        #[arg(long, default_value_t = 2_100_000)]
        count: u64,
        #[arg(long, default_value_t = 256)]
        size: usize,
    },
    /// Issue 20, 2: CLIENTS MQTT clients (half TCP, half WebSocket) each send a 16 MiB CONNECT
    /// but its last byte, for SECS seconds, while a confirmed AMQP publisher counts confirms.
    MqttPrelogin {
        /// The MQTT listener.
        #[arg(long)]
        mqtt: SocketAddr,
        /// The MQTT WebSocket listener.
        #[arg(long)]
        ws: SocketAddr,
        #[arg(long, default_value_t = 80)]
        clients: usize,
        #[arg(long, default_value_t = 40)]
        secs: u64,
    },
    /// Issue 20, 2: an MQTT 5 CONNECT whose will carries PROPS empty user properties.
    MqttWillProps {
        #[arg(long)]
        mqtt: SocketAddr,
        #[arg(long, default_value_t = 3_300_000)]
        props: usize,
    },
    /// Issue 20, 6: a logged-in MQTT WebSocket client sends PINGS pings and never reads.
    WsPingFlood {
        #[arg(long)]
        mqtt: SocketAddr,
        #[arg(long)]
        ws: SocketAddr,
        #[arg(long, default_value_t = 16_000_000)]
        pings: u64,
        /// Stop sending after this many seconds.
        #[arg(long, default_value_t = 60)]
        secs: u64,
    },
    /// Issue 20 #6: RETAINED retained messages, then one MQTT SUBSCRIBE with COPIES × the same `#`.
    MqttSubDup {
        /// The broker's MQTT listener.
        #[arg(long)]
        mqtt: SocketAddr,
        #[arg(long, default_value_t = 100_000)]
        retained: u64,
        #[arg(long, default_value_t = 60)]
        copies: usize,
        /// Seconds to read the retained messages for.
        #[arg(long, default_value_t = 60)]
        limit: u64,
    },
    /// Issue 20 #6: RETAINED retained messages, then SUBSCRIBERS MQTT SUBSCRIBEs of FILTERS
    /// wildcard filters each.
    MqttSubWildcards {
        #[arg(long)]
        mqtt: SocketAddr,
        #[arg(long, default_value_t = 100_000)]
        retained: u64,
        #[arg(long, default_value_t = 1000)]
        filters: usize,
        #[arg(long, default_value_t = 2)]
        subscribers: usize,
        /// Seconds to wait for each SUBACK and its retained messages.
        #[arg(long, default_value_t = 90)]
        limit: u64,
    },
    /// Issue 20 #7: tenant `a` retains SIZE-byte messages until refused, then tenant `b` tries.
    RetainedBudget {
        #[arg(long)]
        mqtt: SocketAddr,
        /// A user with every permission on tenants `a` and `b` (password `guest`).
        #[arg(long, default_value = "u")]
        user: String,
        #[arg(long, default_value_t = 600_000)]
        size: usize,
        #[arg(long, default_value_t = 200)]
        max: u16,
    },
    /// 20.3: CONNS HTTP connections trickle a request head forever; how many are open after SECS.
    HttpSlowloris {
        #[arg(long)]
        http: SocketAddr,
        #[arg(long, default_value_t = 2000)]
        conns: usize,
        #[arg(long, default_value_t = 30)]
        secs: u64,
    },
    /// 20.3: CONNS idle HTTP connections; then can AMQP, MQTT and HTTP clients connect?
    HttpIdleFds {
        #[arg(long)]
        http: SocketAddr,
        #[arg(long)]
        mqtt: Option<SocketAddr>,
        #[arg(long, default_value_t = 20_000)]
        conns: usize,
        /// Seconds to wait after opening them.
        #[arg(long, default_value_t = 5)]
        secs: u64,
    },
    /// 20.3: CONNS clients ask for /metrics over QUEUES queues and never read; RSS after SECS.
    HttpMetricsUnread {
        #[arg(long)]
        http: SocketAddr,
        #[arg(long, default_value_t = 12_000)]
        queues: usize,
        #[arg(long, default_value_t = 150)]
        conns: usize,
        /// Log in (as the URL's user) instead of scraping anonymously.
        #[arg(long, default_value_t = false, action = ArgAction::Set)]
        auth: bool,
        #[arg(long, default_value_t = 20)]
        secs: u64,
    },
    /// 20.3: scrapers of unpaged GET /api/queues over QUEUES queues; AMQP confirm latency.
    HttpListScrapers {
        #[arg(long)]
        http: SocketAddr,
        #[arg(long, default_value_t = 12_000)]
        queues: usize,
        #[arg(long, value_delimiter = ',', default_value = "0,4,32")]
        scrapers: Vec<usize>,
        /// Seconds of publishing per scraper count.
        #[arg(long, default_value_t = 20)]
        secs: u64,
    },
}

fn flip(file: &std::path::Path, offset: u64) -> Result<String> {
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(file)
        .ctx(format!("open {}", file.display()))?;
    let mut b = [0u8; 1];
    f.seek(SeekFrom::Start(offset)).ctx("seek")?;
    f.read_exact(&mut b).ctx("read")?;
    let flipped = b[0] ^ 0x10;
    f.seek(SeekFrom::Start(offset)).ctx("seek")?;
    f.write_all(&[flipped]).ctx("write")?;
    f.sync_all().ctx("fsync")?;
    Ok(format!(
        "flipped={}@{offset} byte=0x{:02x}->0x{flipped:02x}",
        file.display(),
        b[0]
    ))
}

async fn run(args: Args) -> Result<String> {
    if let Attack::Flip { file, offset } = &args.attack {
        return flip(file, *offset);
    }
    let uri: AMQPUri = args
        .url
        .parse()
        .map_err(|e| BenchError(format!("--url: {e}")))?;
    let addr: SocketAddr =
        tokio::net::lookup_host((uri.authority.host.as_str(), uri.authority.port))
            .await
            .ctx("resolving the broker")?
            .next()
            .ok_or_else(|| BenchError("broker address resolved to nothing".into()))?;
    let target = Target { uri, addr };
    let rss = args.pid.map(RssSampler::start);
    let probe = match (args.pid, args.probe) {
        (Some(_), true) => Some(
            Probe::start(target.uri.clone(), Duration::from_secs(args.probe_cap))
                .await
                .ctx("starting the probe")?,
        ),
        _ => None,
    };
    let attack = async {
        match &args.attack {
            Attack::LoginNesting { kind, depth } => {
                attacks::login_nesting(&target, *kind, *depth).await
            }
            Attack::TopicBacktrack { words, limit } => {
                attacks::topic_backtrack(&target, words, Duration::from_secs(*limit)).await
            }
            Attack::BindBurst { count, limit } => {
                attacks::bind_burst(&target, *count, Duration::from_secs(*limit)).await
            }
            Attack::Publish {
                queue,
                count,
                size,
                durable,
                persistent,
                window,
                limit,
                stall,
            } => {
                let o = PublishOpts {
                    queue: queue.clone(),
                    durable: *durable,
                    persistent: *persistent,
                    count: *count,
                    size: *size,
                    window: *window,
                    limit: Duration::from_secs(*limit),
                    stall: Duration::from_secs(*stall),
                };
                attacks::publish(&target, &o, rss.as_ref()).await
            }
            Attack::Count { queue } => attacks::count(&target, queue).await,
            Attack::DiskOps { queue } => attacks::disk_ops(&target, queue).await,
            Attack::Amplify { count, big } => {
                attacks::amplify(&target, *count, *big, rss.as_ref()).await
            }
            Attack::StalledConsumer { count, size, hold } => {
                attacks::stalled_consumer(
                    &target,
                    *count,
                    *size,
                    Duration::from_secs(*hold),
                    rss.as_ref(),
                )
                .await
            }
            Attack::Partial {
                conns,
                body_mb,
                send_mb,
                hold,
            } => {
                attacks::partial(
                    &target,
                    *conns,
                    *body_mb,
                    *send_mb,
                    Duration::from_secs(*hold),
                )
                .await
            }
            Attack::Fanout { queues, publishes } => {
                attacks::fanout(&target, queues, *publishes).await
            }
            Attack::LoginRate { secs } => attacks::login_rate(&target, *secs).await,
            Attack::Trim { count, size } => {
                attacks::trim(&target, *count, *size, rss.as_ref()).await
            }
            Attack::MqttPrelogin {
                mqtt,
                ws,
                clients,
                secs,
            } => mqtt_door::prelogin(&target, *mqtt, *ws, *clients, *secs).await,
            Attack::MqttWillProps { mqtt, props } => mqtt_door::will_props(*mqtt, *props).await,
            Attack::WsPingFlood {
                mqtt,
                ws,
                pings,
                secs,
            } => mqtt_door::ping_flood(*mqtt, *ws, *pings, *secs).await,
            Attack::MqttSubDup {
                mqtt,
                retained,
                copies,
                limit,
            } => retained::sub_dup(*mqtt, *retained, *copies, Duration::from_secs(*limit)).await,
            Attack::MqttSubWildcards {
                mqtt,
                retained,
                filters,
                subscribers,
                limit,
            } => {
                retained::sub_wildcards(
                    *mqtt,
                    *retained,
                    *filters,
                    *subscribers,
                    Duration::from_secs(*limit),
                )
                .await
            }
            Attack::RetainedBudget {
                mqtt,
                user,
                size,
                max,
            } => retained::budget(*mqtt, user, *size, *max).await,
            Attack::NoackDrain {
                count,
                size,
                secs,
                read_mbps,
            } => noack::noack_drain(&target, *count, *size, *secs, *read_mbps).await,
            Attack::HttpSlowloris { http, conns, secs } => {
                http_door::slowloris(*http, *conns, *secs).await
            }
            Attack::HttpIdleFds {
                http,
                mqtt,
                conns,
                secs,
            } => http_door::idle_fds(&target, *http, *mqtt, *conns, *secs).await,
            Attack::HttpMetricsUnread {
                http,
                queues,
                conns,
                auth,
                secs,
            } => {
                http_door::metrics_unread(
                    &target,
                    *http,
                    *queues,
                    *conns,
                    *auth,
                    *secs,
                    rss.as_ref(),
                )
                .await
            }
            Attack::HttpListScrapers {
                http,
                queues,
                scrapers,
                secs,
            } => http_door::list_scrapers(&target, *http, *queues, scrapers, *secs).await,
            Attack::Flip { .. } => unreachable!("handled above"),
        }
    };
    let result = match tokio::time::timeout(Duration::from_secs(args.timeout), attack).await {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => format!(
            "error={} error_text=\"{}\"",
            attacks::short_err(&e.0),
            e.0.replace('"', "'")
        ),
        Err(_) => format!("error=timeout(>{}s)", args.timeout),
    };
    let mut line = result;
    if let Some(p) = probe {
        line.push(' ');
        line.push_str(&p.finish());
    }
    if let Some(r) = rss {
        line.push(' ');
        line.push_str(&r.finish());
    }
    if let Some(pid) = args.pid {
        line.push_str(if monitor::alive(pid) {
            " broker=alive"
        } else {
            " broker=dead"
        });
    }
    Ok(line)
}

fn main() -> ExitCode {
    let args = Args::parse();
    // Two workers: the 20 partial-content connections and the publishers share them; the probe and
    // the RSS sampler have their own threads.
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("weir-abuse: runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let r: Result<String> = rt.block_on(run(args));
    // Stuck probe rounds or attack tasks must not keep the process alive.
    rt.shutdown_timeout(Duration::from_millis(100));
    match r {
        Ok(line) => {
            println!("{line}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            println!(
                "error={} error_text=\"{}\"",
                attacks::short_err(&e.0),
                e.0.replace('"', "'")
            );
            ExitCode::FAILURE
        }
    }
}
