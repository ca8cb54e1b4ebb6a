//! Issue 20's attacks on MQTT retained messages (items 6 and 7), with a minimal MQTT 5 client
//! written here (CONNECT, PUBLISH, SUBSCRIBE with many filters; the answers' fixed headers):
//!
//! * `mqtt-sub-dup`: RETAINED retained messages, then one SUBSCRIBE with COPIES × `#`;
//!   how many publishes the subscriber gets (each retained message once, or once per copy).
//! * `mqtt-sub-wildcards`: RETAINED retained messages, then SUBSCRIBERS sessions send one
//!   SUBSCRIBE of FILTERS wildcard filters each (`+/<i>/#`, one match each): how long until each
//!   SUBACK, and how long fresh MQTT clients waited meanwhile.
//! * `retained-budget`: tenant `a` retains 600 KB messages until refused (0x97), then tenant `b`
//!   tries three: whether one tenant's retained messages lock the others out.
//!
//! Each attack also runs an MQTT probe (connect + CONNACK in a loop on its own thread):
//! `mqtt_probe_max_ms`.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Buf, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::conn::{err, Context, Result};
use crate::mqtt_wire::{put_len, put_str};

const CONNECT: u8 = 1;
const CONNACK: u8 = 2;
const PUBLISH: u8 = 3;
const PUBACK: u8 = 4;
const SUBSCRIBE: u8 = 8;
const SUBACK: u8 = 9;

fn packet(out: &mut Vec<u8>, first: u8, body: &[u8]) {
    out.push(first);
    put_len(out, body.len());
    out.extend_from_slice(body);
}

/// A PUBLISH (MQTT 5, no properties).
fn publish(out: &mut Vec<u8>, topic: &str, qos: u8, packet_id: u16, retain: bool, payload: &[u8]) {
    let mut body = Vec::with_capacity(topic.len() + payload.len() + 8);
    put_str(&mut body, topic.as_bytes());
    if qos > 0 {
        body.extend_from_slice(&packet_id.to_be_bytes());
    }
    body.push(0); // properties
    body.extend_from_slice(payload);
    packet(out, (PUBLISH << 4) | (qos << 1) | u8::from(retain), &body);
}

/// One packet from the broker: its type, flags and body.
struct Packet {
    kind: u8,
    body: BytesMut,
}

/// An MQTT 5 connection.
struct Mqtt {
    stream: TcpStream,
    buf: BytesMut,
}

impl Mqtt {
    /// Connects as `user` (password `guest`) with a clean start; Err unless CONNACK says success.
    async fn connect(addr: SocketAddr, client_id: &str, user: &str) -> Result<Mqtt> {
        let stream = TcpStream::connect(addr)
            .await
            .ctx(format!("MQTT connect to {addr}"))?;
        let _ = stream.set_nodelay(true);
        let mut m = Mqtt {
            stream,
            buf: BytesMut::with_capacity(64 * 1024),
        };
        let mut body = Vec::new();
        put_str(&mut body, b"MQTT");
        body.push(5);
        body.push(0x02 | 0x80 | 0x40); // clean start, user, password
        body.extend_from_slice(&60u16.to_be_bytes());
        body.push(0); // properties
        put_str(&mut body, client_id.as_bytes());
        put_str(&mut body, user.as_bytes());
        put_str(&mut body, b"guest");
        let mut out = Vec::new();
        packet(&mut out, CONNECT << 4, &body);
        m.send(&out).await?;
        let p = m.read().await?;
        if p.kind != CONNACK || p.body.len() < 2 || p.body[1] != 0 {
            return err(format!(
                "CONNACK refused: type {} code {:?}",
                p.kind,
                p.body.get(1)
            ));
        }
        Ok(m)
    }

    async fn send(&mut self, bytes: &[u8]) -> Result<()> {
        self.stream.write_all(bytes).await.ctx("MQTT write")
    }

    async fn read(&mut self) -> Result<Packet> {
        loop {
            if let Some(p) = self.parse()? {
                return Ok(p);
            }
            let n = self.stream.read_buf(&mut self.buf).await.ctx("MQTT read")?;
            if n == 0 {
                return err("MQTT connection closed by the broker");
            }
        }
    }

    fn parse(&mut self) -> Result<Option<Packet>> {
        let mut len = 0usize;
        let mut i = 1;
        loop {
            let Some(&b) = self.buf.get(i) else {
                return Ok(None);
            };
            len |= usize::from(b & 0x7f) << (7 * (i - 1));
            i += 1;
            if b & 0x80 == 0 {
                break;
            }
            if i > 4 {
                return err("malformed remaining length from the broker");
            }
        }
        if self.buf.len() < i + len {
            return Ok(None);
        }
        let kind = self.buf[0] >> 4;
        self.buf.advance(i);
        let body = self.buf.split_to(len);
        Ok(Some(Packet { kind, body }))
    }

    /// Sends one SUBSCRIBE with `filters` at QoS 0.
    async fn subscribe(&mut self, packet_id: u16, filters: &[String]) -> Result<()> {
        let mut body = packet_id.to_be_bytes().to_vec();
        body.push(0); // properties
        for f in filters {
            put_str(&mut body, f.as_bytes());
            body.push(0);
        }
        let mut out = Vec::new();
        packet(&mut out, (SUBSCRIBE << 4) | 0x02, &body);
        self.send(&out).await
    }

    /// A retained QoS 1 publish; the PUBACK's reason code.
    async fn retain_qos1(&mut self, packet_id: u16, topic: &str, payload: &[u8]) -> Result<u8> {
        let mut out = Vec::new();
        publish(&mut out, topic, 1, packet_id, true, payload);
        self.send(&out).await?;
        loop {
            let p = self.read().await?;
            if p.kind == PUBACK && p.body.len() >= 2 && p.body[..2] == packet_id.to_be_bytes() {
                return Ok(p.body.get(2).copied().unwrap_or(0));
            }
        }
    }
}

/// The topic of a PUBLISH body (MQTT 5).
fn topic_of(body: &[u8]) -> Option<&[u8]> {
    let n = usize::from(u16::from_be_bytes([*body.first()?, *body.get(1)?]));
    body.get(2..2 + n)
}

/// Retains `count` - 1 100-byte messages on `abuse/r/<i>` (QoS 0, pipelined), then `abuse-end`
/// with QoS 1: `count` in all (the default per-tenant bound is 100,000), and its PUBACK says every
/// one before it was handled.
async fn fill(addr: SocketAddr, count: u64) -> Result<Duration> {
    let t = Instant::now();
    let mut m = Mqtt::connect(addr, "abuse-filler", "guest").await?;
    let mut out = Vec::with_capacity(256 * 1024);
    for i in 0..count.saturating_sub(1) {
        publish(&mut out, &format!("abuse/r/{i}"), 0, 0, true, &[b'x'; 100]);
        if out.len() > 128 * 1024 {
            m.send(&out).await?;
            out.clear();
        }
    }
    m.send(&out).await?;
    let code = m.retain_qos1(1, "abuse-end", b"end").await?;
    if code >= 0x80 {
        return err(format!("retained fill refused: 0x{code:02x}"));
    }
    Ok(t.elapsed())
}

/// Fresh MQTT clients in a loop on their own thread: the longest connect + CONNACK, capped.
struct MqttProbe {
    stop: Arc<AtomicBool>,
    max_us: Arc<AtomicU64>,
    rounds: Arc<AtomicU64>,
    failures: Arc<AtomicU64>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl MqttProbe {
    fn start(addr: SocketAddr, cap: Duration) -> MqttProbe {
        let stop = Arc::new(AtomicBool::new(false));
        let max_us = Arc::new(AtomicU64::new(0));
        let rounds = Arc::new(AtomicU64::new(0));
        let failures = Arc::new(AtomicU64::new(0));
        let thread = {
            let (stop, max_us, rounds, failures) = (
                stop.clone(),
                max_us.clone(),
                rounds.clone(),
                failures.clone(),
            );
            std::thread::spawn(move || {
                let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                else {
                    return;
                };
                rt.block_on(async move {
                    let mut n = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        n += 1;
                        let t = Instant::now();
                        let id = format!("abuse-probe-{n}");
                        let r = tokio::time::timeout(cap, Mqtt::connect(addr, &id, "guest")).await;
                        let us = t.elapsed().as_micros() as u64;
                        max_us.fetch_max(us, Ordering::Relaxed);
                        rounds.fetch_add(1, Ordering::Relaxed);
                        if !matches!(r, Ok(Ok(_))) {
                            failures.fetch_add(1, Ordering::Relaxed);
                        }
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                });
            })
        };
        MqttProbe {
            stop,
            max_us,
            rounds,
            failures,
            thread: Some(thread),
        }
    }

    fn finish(mut self) -> String {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        format!(
            "mqtt_probe_max_ms={} mqtt_probe_rounds={} mqtt_probe_failed={}",
            self.max_us.load(Ordering::Relaxed) / 1000,
            self.rounds.load(Ordering::Relaxed),
            self.failures.load(Ordering::Relaxed)
        )
    }
}

/// `mqtt-sub-dup`: one SUBSCRIBE with `copies` × `#`, then one with `abuse-end` (whose retained
/// message comes after the first subscription's); counts what arrives before it, within `limit`.
pub async fn sub_dup(
    addr: SocketAddr,
    retained: u64,
    copies: usize,
    limit: Duration,
) -> Result<String> {
    let fill_time = fill(addr, retained).await?;
    let probe = MqttProbe::start(addr, Duration::from_secs(30));
    let mut m = Mqtt::connect(addr, "abuse-dup", "guest").await?;
    let t = Instant::now();
    m.subscribe(1, &vec!["abuse/#".to_string(); copies]).await?;
    m.subscribe(2, &["abuse-end".to_string()]).await?;
    let mut received = 0u64;
    let mut complete = false;
    let deadline = tokio::time::Instant::now() + limit;
    while let Ok(p) = tokio::time::timeout_at(deadline, m.read()).await {
        let p = p?;
        if p.kind != PUBLISH {
            continue;
        }
        if topic_of(&p.body) == Some(b"abuse-end") {
            complete = true;
            break;
        }
        received += 1;
    }
    Ok(format!(
        "retained={retained} fill_ms={} copies={copies} received={received} per_message={:.1} complete={} took_ms={} {}",
        fill_time.as_millis(),
        received as f64 / retained.saturating_sub(1).max(1) as f64,
        if complete { "yes" } else { "no" },
        t.elapsed().as_millis(),
        probe.finish()
    ))
}

/// `mqtt-sub-wildcards`: `subscribers` sessions each send one SUBSCRIBE of `filters` filters
/// `+/r/<i>`-style (`+/<level>/<i>`, one match each among `abuse/r/<i>`), without reading; the time
/// until each SUBACK.
pub async fn sub_wildcards(
    addr: SocketAddr,
    retained: u64,
    filters: usize,
    subscribers: usize,
    limit: Duration,
) -> Result<String> {
    let fill_time = fill(addr, retained).await?;
    let probe = MqttProbe::start(addr, Duration::from_secs(30));
    let t = Instant::now();
    let mut tasks = Vec::new();
    for s in 0..subscribers {
        let list: Vec<String> = (0..filters)
            .map(|i| {
                format!(
                    "+/r/{}",
                    (s * filters + i) as u64 % retained.saturating_sub(1).max(1)
                )
            })
            .collect();
        tasks.push(tokio::spawn(async move {
            let mut m = Mqtt::connect(addr, &format!("abuse-wild-{s}"), "guest").await?;
            let t = Instant::now();
            m.subscribe(1, &list).await?;
            let deadline = tokio::time::Instant::now() + limit;
            let mut received = 0u64;
            let mut suback = None;
            // Until the SUBACK and every filter's retained message, or the limit.
            while suback.is_none() || received < list.len() as u64 {
                match tokio::time::timeout_at(deadline, m.read()).await {
                    Ok(p) => {
                        let p = p?;
                        match p.kind {
                            SUBACK => suback = Some(t.elapsed()),
                            PUBLISH => received += 1,
                            _ => {}
                        }
                    }
                    Err(_) => break,
                }
            }
            Ok::<_, crate::conn::BenchError>((suback, received))
        }));
    }
    let mut parts = Vec::new();
    for (i, task) in tasks.into_iter().enumerate() {
        match task.await {
            Ok(Ok((suback, received))) => parts.push(format!(
                "suback{i}_ms={} received{i}={received}",
                suback.map_or_else(|| "none".to_string(), |d| d.as_millis().to_string())
            )),
            Ok(Err(e)) => parts.push(format!("sub{i}=error({})", e.0.replace(' ', "_"))),
            Err(e) => parts.push(format!("sub{i}=panic({e})")),
        }
    }
    Ok(format!(
        "retained={retained} fill_ms={} filters={subscribers}x{filters} {} took_ms={} {}",
        fill_time.as_millis(),
        parts.join(" "),
        t.elapsed().as_millis(),
        probe.finish()
    ))
}

/// `retained-budget`: tenant `a` (user `a:<user>`) retains `size`-byte messages until refused
/// (at most `max`), then tenant `b` retains three.
pub async fn budget(addr: SocketAddr, user: &str, size: usize, max: u16) -> Result<String> {
    let probe = MqttProbe::start(addr, Duration::from_secs(30));
    let payload = vec![b'x'; size];
    let mut a = Mqtt::connect(addr, "abuse-a", &format!("a:{user}")).await?;
    let mut a_accepted = 0u32;
    let mut a_refused = None;
    for i in 1..=max {
        let code = a.retain_qos1(i, &format!("big/{i}"), &payload).await?;
        if code >= 0x80 {
            a_refused = Some(code);
            break;
        }
        a_accepted += 1;
    }
    let mut b = Mqtt::connect(addr, "abuse-b", &format!("b:{user}")).await?;
    let mut b_accepted = 0u32;
    let mut b_code = 0;
    for i in 1..=3u16 {
        b_code = b.retain_qos1(i, &format!("big/{i}"), &payload).await?;
        if b_code < 0x80 {
            b_accepted += 1;
        }
    }
    Ok(format!(
        "size={size} a_accepted={a_accepted} a_refused={} a_mb={} b_accepted={b_accepted}/3 b_last=0x{b_code:02x} {}",
        a_refused.map_or_else(|| "never".into(), |c| format!("0x{c:02x}")),
        (a_accepted as usize * size) >> 20,
        probe.finish()
    ))
}
