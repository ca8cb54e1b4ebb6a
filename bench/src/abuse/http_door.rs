//! Issue 20 item 3: attacks on the HTTP listener (management API, `/metrics`): slow-loris
//! connections, idle connections by the thousand, `/metrics` scrapes that are never read, and
//! scrapers of unpaged `GET /api/queues` while an AMQP publisher measures its confirm latency.
//! HTTP/1.1 is written by hand (a few requests on plain sockets; no client stack needed).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use amq_protocol::frame::AMQPFrame;
use amq_protocol::protocol::{basic, AMQPClass};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::attacks::Target;
use crate::conn::{Context, Result, CHANNEL};
use crate::monitor::RssSampler;
use crate::ops;

/// `Authorization: Basic …` of the broker URL's user.
fn basic_auth(t: &Target) -> String {
    const T: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let creds = format!(
        "{}:{}",
        t.uri.authority.userinfo.username, t.uri.authority.userinfo.password
    );
    let mut out = String::new();
    for c in creds.as_bytes().chunks(3) {
        let n = (u32::from(c[0]) << 16)
            | (u32::from(*c.get(1).unwrap_or(&0)) << 8)
            | u32::from(*c.get(2).unwrap_or(&0));
        for i in 0..4 {
            out.push(if i <= c.len() {
                T[((n >> (18 - 6 * i)) & 63) as usize] as char
            } else {
                '='
            });
        }
    }
    format!("Authorization: Basic {out}\r\n")
}

/// One `GET path` (Connection: close), read to the end: status and body bytes.
async fn get(http: SocketAddr, path: &str, auth: &str) -> Result<(u16, usize)> {
    let mut s = TcpStream::connect(http).await.ctx("HTTP connect")?;
    let req = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{auth}\r\n");
    s.write_all(req.as_bytes()).await.ctx("HTTP send")?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).await.ctx("HTTP read")?;
    let head_end = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map_or(raw.len(), |p| p + 4);
    let status = std::str::from_utf8(&raw[..head_end.min(raw.len())])
        .ok()
        .and_then(|h| h.split(' ').nth(1))
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    Ok((status, raw.len() - head_end))
}

/// Declares `n` transient queues named `prefix.N`, 500 pipelined at a time.
async fn declare_queues(t: &Target, prefix: &str, n: usize) -> Result<()> {
    let mut c = t.conn().await?;
    let mut have = 0;
    while have < n {
        let batch = (n - have).min(500);
        for i in have..have + batch {
            c.push_method(CHANNEL, ops::declare_method(&format!("{prefix}.{i:06}")))?;
        }
        c.flush().await?;
        for _ in 0..batch {
            c.recv_method(CHANNEL).await?;
        }
        have += batch;
    }
    c.close().await;
    Ok(())
}

/// How one held connection ended.
#[derive(Default)]
struct Held {
    open: AtomicUsize,
    refused_503: AtomicUsize,
    failed: AtomicUsize,
}

/// Holds one connection until `until`: sends `head` and then, if `trickle`, one header line a
/// second; never reads more than it must to see the server's answer or close.
async fn hold(mut s: TcpStream, head: String, trickle: bool, until: Instant, held: Arc<Held>) {
    let _ = s.write_all(head.as_bytes()).await;
    let mut buf = [0u8; 16];
    let mut first = true;
    // Off once a /metrics answer starts: the rest is left unread.
    let mut reading = true;
    loop {
        let tick = tokio::time::sleep(Duration::from_secs(1));
        tokio::select! {
            _ = tokio::time::sleep_until(until.into()) => return,
            r = s.read(&mut buf), if reading && (!trickle || first) => {
                match r {
                    Ok(n) if n > 0 && first && buf[..n].starts_with(b"HTTP/1.1 503") => {
                        held.refused_503.fetch_add(1, Ordering::Relaxed);
                        break;
                    }
                    // The start of an answer: a slow loris's 408 (closed next), or the
                    // /metrics answer that is then left unread.
                    Ok(n) if n > 0 => {
                        first = false;
                        reading = trickle || head.is_empty();
                    }
                    _ => break,
                }
            }
            _ = tick, if trickle => {
                if s.write_all(b"X-Slow: loris\r\n").await.is_err() {
                    break;
                }
            }
        }
    }
    held.open.fetch_sub(1, Ordering::Relaxed);
}

/// Opens `conns` connections one after another (a loopback connect completes in the kernel's
/// backlog); each then runs [`hold`] in its own task.
async fn open_many(
    http: SocketAddr,
    conns: usize,
    head: &str,
    trickle: bool,
    until: Instant,
) -> Arc<Held> {
    let held = Arc::new(Held::default());
    let mut failed_in_a_row = 0;
    for _ in 0..conns {
        match tokio::time::timeout(Duration::from_secs(1), TcpStream::connect(http)).await {
            Ok(Ok(s)) => {
                failed_in_a_row = 0;
                held.open.fetch_add(1, Ordering::Relaxed);
                tokio::spawn(hold(s, head.to_string(), trickle, until, held.clone()));
            }
            _ => {
                held.failed.fetch_add(1, Ordering::Relaxed);
                // The listener's backlog is full: it no longer accepts.
                failed_in_a_row += 1;
                if failed_in_a_row == 10 {
                    break;
                }
            }
        }
    }
    held
}

/// `http-slowloris`: `conns` connections each send a request head one header line a second,
/// never finishing it; how many are still open after `secs`.
pub async fn slowloris(http: SocketAddr, conns: usize, secs: u64) -> Result<String> {
    let start = Instant::now();
    let until = start + Duration::from_secs(secs);
    let held = open_many(
        http,
        conns,
        "GET / HTTP/1.1\r\nHost: x\r\n",
        true,
        until + Duration::from_secs(1),
    )
    .await;
    tokio::time::sleep_until(until.into()).await;
    Ok(format!(
        "conns={conns} open_after_{secs}s={} refused_503={} connect_failed={}",
        held.open.load(Ordering::Relaxed),
        held.refused_503.load(Ordering::Relaxed),
        held.failed.load(Ordering::Relaxed)
    ))
}

/// A fresh MQTT 3.1.1 client as the URL's user: CONNECT → CONNACK; its time and return code.
async fn mqtt_connect(t: &Target, mqtt: SocketAddr) -> Result<(Duration, u8)> {
    let start = Instant::now();
    let mut s = TcpStream::connect(mqtt).await.ctx("MQTT connect")?;
    let (u, p) = (
        t.uri.authority.userinfo.username.as_bytes(),
        t.uri.authority.userinfo.password.as_bytes(),
    );
    let id = b"abuse-probe";
    let mut var = vec![0, 4, b'M', b'Q', b'T', b'T', 4, 0xC2, 0, 60];
    for f in [&id[..], u, p] {
        var.extend_from_slice(&(f.len() as u16).to_be_bytes());
        var.extend_from_slice(f);
    }
    let mut pkt = vec![0x10, var.len() as u8];
    pkt.extend_from_slice(&var);
    s.write_all(&pkt).await.ctx("MQTT send")?;
    let mut ack = [0u8; 4];
    s.read_exact(&mut ack).await.ctx("MQTT CONNACK")?;
    Ok((start.elapsed(), ack[3]))
}

/// `http-idle-fds`: `conns` idle connections (nothing sent), then a fresh AMQP client, MQTT client
/// and HTTP request: do they get through, how fast.
pub async fn idle_fds(
    t: &Target,
    http: SocketAddr,
    mqtt: Option<SocketAddr>,
    conns: usize,
    secs: u64,
) -> Result<String> {
    // Held until the process ends.
    let until = Instant::now() + Duration::from_secs(3600);
    let held = open_many(http, conns, "", false, until).await;
    // Let the broker accept what it will.
    tokio::time::sleep(Duration::from_secs(secs)).await;
    let mut out = format!(
        "conns={conns} open={} refused_503={} connect_failed={}",
        held.open.load(Ordering::Relaxed),
        held.refused_503.load(Ordering::Relaxed),
        held.failed.load(Ordering::Relaxed)
    );
    // Five rounds of each fresh client: the slowest (or the first failure) counts.
    let limit = Duration::from_secs(10);
    let mut amqp = Duration::ZERO;
    let mut failed = None;
    for _ in 0..5 {
        let a = Instant::now();
        match tokio::time::timeout(limit, t.conn()).await {
            Ok(Ok(c)) => {
                amqp = amqp.max(a.elapsed());
                c.close().await;
            }
            Ok(Err(e)) => failed = Some(format!("failed({})", crate::attacks::short_err(&e.0))),
            Err(_) => failed = Some("timeout(10s)".into()),
        }
        if failed.is_some() {
            break;
        }
    }
    out += &match failed {
        Some(f) => format!(" amqp={f}"),
        None => format!(" amqp_max_ms={}", amqp.as_millis()),
    };
    if let Some(m) = mqtt {
        let mut worst = Duration::ZERO;
        let mut failed = None;
        for _ in 0..5 {
            match tokio::time::timeout(limit, mqtt_connect(t, m)).await {
                Ok(Ok((d, 0))) => worst = worst.max(d),
                Ok(Ok((_, rc))) => failed = Some(format!("rc{rc}")),
                Ok(Err(e)) => failed = Some(format!("failed({})", crate::attacks::short_err(&e.0))),
                Err(_) => failed = Some("timeout(10s)".into()),
            }
            if failed.is_some() {
                break;
            }
        }
        out += &match failed {
            Some(f) => format!(" mqtt={f}"),
            None => format!(" mqtt_max_ms={}", worst.as_millis()),
        };
    }
    let h = Instant::now();
    match tokio::time::timeout(limit, get(http, "/api/overview", &basic_auth(t))).await {
        Ok(Ok((status, _))) => {
            out += &format!(" http={status} http_ms={}", h.elapsed().as_millis())
        }
        Ok(Err(e)) => out += &format!(" http=failed({})", crate::attacks::short_err(&e.0)),
        Err(_) => out += " http=timeout(10s)",
    }
    Ok(out)
}

/// `http-metrics-unread`: with `queues` queues, `conns` clients ask for `/metrics` (anonymously
/// unless `auth`) and never read the answer; the broker's memory after `secs`.
pub async fn metrics_unread(
    t: &Target,
    http: SocketAddr,
    queues: usize,
    conns: usize,
    auth: bool,
    secs: u64,
    rss: Option<&RssSampler>,
) -> Result<String> {
    declare_queues(t, "abuse.metrics.a-queue-name-of-some-length", queues).await?;
    let auth = if auth { basic_auth(t) } else { String::new() };
    let (status, size) = get(http, "/metrics", &auth).await?;
    let before = rss.map_or(0, |r| r.now_kb() / 1024);
    let until = Instant::now() + Duration::from_secs(secs);
    let head = format!("GET /metrics HTTP/1.1\r\nHost: x\r\n{auth}\r\n");
    let held = open_many(http, conns, &head, false, until + Duration::from_secs(1)).await;
    tokio::time::sleep_until(until.into()).await;
    let after = rss.map_or(0, |r| r.now_kb() / 1024);
    Ok(format!(
        "queues={queues} scrape_status={status} scrape_kb={} unread={conns} still_open={} \
         rss_before_mb={before} rss_held_mb={after}",
        size / 1024,
        held.open.load(Ordering::Relaxed)
    ))
}

/// `http-list-scrapers`: with `queues` queues, for each count of scrapers (looping unpaged
/// `GET /api/queues`), one AMQP publisher sends one persistent message at a time for `secs` and
/// reports its slowest confirm.
pub async fn list_scrapers(
    t: &Target,
    http: SocketAddr,
    queues: usize,
    scrapers: &[usize],
    secs: u64,
) -> Result<String> {
    declare_queues(t, "abuse.list", queues).await?;
    let auth = basic_auth(t);
    let mut out = vec![format!("queues={queues}")];
    for &n in scrapers {
        // The publisher connects before the scrapers start.
        let mut c = t.conn().await?;
        ops::declare_queue(&mut c, "abuse.list.confirms", true).await?;
        c.confirm_select().await?;
        let frames = ops::encode_publish(c.frame_max, "", "abuse.list.confirms", 100, true)?;
        let stop = Arc::new(AtomicBool::new(false));
        let scrapes = Arc::new(AtomicU64::new(0));
        let mut tasks = Vec::new();
        for _ in 0..n {
            let (stop, scrapes, auth) = (stop.clone(), scrapes.clone(), auth.clone());
            tasks.push(tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    if matches!(get(http, "/api/queues", &auth).await, Ok((200, _))) {
                        scrapes.fetch_add(1, Ordering::Relaxed);
                    } else {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
            }));
        }
        let end = Instant::now() + Duration::from_secs(secs);
        let (mut max, mut sent) = (Duration::ZERO, 0u64);
        let mut lat = Vec::new();
        let mut failure = None;
        'publish: while Instant::now() < end {
            let t0 = Instant::now();
            c.wbuf.extend_from_slice(&frames);
            if let Err(e) = c.flush().await {
                failure = Some(crate::attacks::short_err(&e.0));
                break;
            }
            sent += 1;
            loop {
                match tokio::time::timeout(Duration::from_secs(120), c.recv_frame()).await {
                    Ok(Ok(AMQPFrame::Method(_, AMQPClass::Basic(basic::AMQPMethod::Ack(_))))) => {
                        break
                    }
                    Ok(Ok(_)) => {}
                    Ok(Err(e)) => {
                        failure = Some(crate::attacks::short_err(&e.0));
                        break 'publish;
                    }
                    Err(_) => {
                        failure = Some("timeout(120s)".into());
                        break 'publish;
                    }
                }
            }
            let d = t0.elapsed();
            max = max.max(d);
            lat.push(d);
        }
        c.close().await;
        stop.store(true, Ordering::Relaxed);
        for task in tasks {
            let _ = tokio::time::timeout(Duration::from_secs(60), task).await;
        }
        lat.sort();
        let p50 = lat.get(lat.len() / 2).copied().unwrap_or_default();
        let mut line = format!(
            "scrapers={n}: confirms={sent} confirm_p50_ms={:.1} confirm_max_ms={:.1} scrapes={}",
            p50.as_secs_f64() * 1e3,
            max.as_secs_f64() * 1e3,
            scrapes.load(Ordering::Relaxed)
        );
        if let Some(f) = failure {
            line += &format!(" publisher={f}");
        }
        out.push(line);
    }
    Ok(out.join(" "))
}
