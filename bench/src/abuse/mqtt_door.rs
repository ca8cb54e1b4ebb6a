//! Issue 20, item 2 and part of item 6: MQTT clients that never log in but
//! send a 16 MiB CONNECT (over TCP and WebSocket) while a confirmed AMQP
//! publisher counts its confirms; a CONNECT whose will carries millions of
//! empty user properties; a WebSocket client that pings and never reads.
//! Each also runs an MQTT probe: a fresh 3.1.1 client logging in every
//! 200 ms (`mqtt_probe_ms`: its slowest login; AMQP's is `probe_wait_ms`).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::attacks::Target;
use crate::conn::{Context, Result};
use crate::ops;

/// The configured maximum packet size (Weir's default).
const SIXTEEN_MIB: usize = 16 << 20;

fn varint(v: usize) -> Vec<u8> {
    let mut out = Vec::new();
    crate::mqtt_wire::put_len(&mut out, v);
    out
}

fn string(s: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    crate::mqtt_wire::put_str(&mut out, s);
    out
}

/// A 3.1.1 CONNECT, guest/guest, clean session, keep-alive `keep_alive`
/// seconds (0: none).
fn connect311(client_id: &str, keep_alive: u16) -> Vec<u8> {
    let mut body = [&string(b"MQTT")[..], &[4, 0xC2], &keep_alive.to_be_bytes()].concat();
    body.extend(string(client_id.as_bytes()));
    body.extend(string(b"guest"));
    body.extend(string(b"guest"));
    [&[0x10][..], &varint(body.len()), &body].concat()
}

/// Reads one MQTT packet's first byte and body.
async fn read_packet(s: &mut TcpStream) -> Option<(u8, Vec<u8>)> {
    let b1 = s.read_u8().await.ok()?;
    let mut len = 0usize;
    for i in 0..4 {
        let b = s.read_u8().await.ok()?;
        len |= usize::from(b & 0x7F) << (7 * i);
        if b & 0x80 == 0 {
            break;
        }
    }
    let mut body = vec![0; len];
    s.read_exact(&mut body).await.ok()?;
    Some((b1, body))
}

/// A fresh MQTT client logging in every 200 ms; the slowest login.
pub struct MqttProbe {
    stop: Arc<AtomicBool>,
    max_ms: Arc<AtomicU64>,
    failed: Arc<AtomicU64>,
    rounds: Arc<AtomicU64>,
}

impl MqttProbe {
    pub fn start(addr: SocketAddr) -> MqttProbe {
        let p = MqttProbe {
            stop: Arc::default(),
            max_ms: Arc::default(),
            failed: Arc::default(),
            rounds: Arc::default(),
        };
        let (stop, max_ms, failed, rounds) = (
            p.stop.clone(),
            p.max_ms.clone(),
            p.failed.clone(),
            p.rounds.clone(),
        );
        tokio::spawn(async move {
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                n += 1;
                let t0 = Instant::now();
                let round = tokio::time::timeout(Duration::from_secs(30), async {
                    let mut s = TcpStream::connect(addr).await.ok()?;
                    s.write_all(&connect311(&format!("probe-{n}"), 30))
                        .await
                        .ok()?;
                    read_packet(&mut s).await
                })
                .await;
                let ok = matches!(&round, Ok(Some((0x20, b))) if b.get(1) == Some(&0));
                max_ms.fetch_max(t0.elapsed().as_millis() as u64, Ordering::Relaxed);
                rounds.fetch_add(1, Ordering::Relaxed);
                if !ok {
                    failed.fetch_add(1, Ordering::Relaxed);
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        });
        p
    }

    pub fn finish(self) -> String {
        self.stop.store(true, Ordering::Relaxed);
        format!(
            "mqtt_probe_ms={} mqtt_probe_failed={}/{}",
            self.max_ms.load(Ordering::Relaxed),
            self.failed.load(Ordering::Relaxed),
            self.rounds.load(Ordering::Relaxed)
        )
    }
}

/// The HTTP upgrade to MQTT over WebSocket on `addr`.
async fn ws_upgrade(addr: SocketAddr) -> Result<TcpStream> {
    let mut s = TcpStream::connect(addr).await.ctx("WebSocket connect")?;
    let req = format!(
        "GET /mqtt HTTP/1.1\r\nHost: {addr}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
         Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\
         Sec-WebSocket-Protocol: mqtt\r\n\r\n"
    );
    s.write_all(req.as_bytes()).await.ctx("upgrade request")?;
    let mut resp = Vec::new();
    while !resp.ends_with(b"\r\n\r\n") {
        resp.push(s.read_u8().await.ctx("upgrade answer")?);
    }
    if !resp.starts_with(b"HTTP/1.1 101") {
        return Err(crate::conn::BenchError(format!(
            "upgrade refused: {}",
            String::from_utf8_lossy(&resp).lines().next().unwrap_or("")
        )));
    }
    Ok(s)
}

/// A client frame header: FIN, `opcode`, masked with a zero key (the
/// payload goes as is).
fn ws_header(opcode: u8, len: usize) -> Vec<u8> {
    let mut h = vec![0x80 | opcode];
    if len < 126 {
        h.push(0x80 | len as u8);
    } else if len <= 0xFFFF {
        h.push(0x80 | 126);
        h.extend((len as u16).to_be_bytes());
    } else {
        h.push(0x80 | 127);
        h.extend((len as u64).to_be_bytes());
    }
    h.extend([0, 0, 0, 0]);
    h
}

/// What one pre-login client saw over its rounds.
#[derive(Debug, Default)]
struct Outcome {
    sent: usize,
    rounds: u64,
    /// Rounds the broker ended (answer or close) before `end`.
    closed: u64,
    /// First bytes the broker sent (0x20 CONNACK, 0x88 WebSocket close).
    answers: Vec<u8>,
}

/// One client, until `end`: announces a 16 MiB CONNECT (over WebSocket: in
/// a 16 MiB binary message), sends all of it but the last byte and holds;
/// when the broker closes the connection, it comes back 1 s later (so
/// what it holds stays held, as an attacker would).
async fn prelogin_client(addr: SocketAddr, ws: bool, end: Instant) -> Outcome {
    let mut out = Outcome::default();
    while Instant::now() < end {
        let s = if ws {
            ws_upgrade(addr).await.ok()
        } else {
            TcpStream::connect(addr).await.ok()
        };
        let Some(s) = s else {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        out.rounds += 1;
        let (mut rd, mut wr) = s.into_split();
        let mut head = Vec::new();
        if ws {
            head.extend(ws_header(2, SIXTEEN_MIB));
        }
        let total = head.len() + SIXTEEN_MIB - 1;
        head.extend(
            [
                &[0x10][..],
                &varint(SIXTEEN_MIB - 5),
                &string(b"MQTT"),
                &[5],
            ]
            .concat(),
        );
        let chunk = vec![0u8; 64 * 1024];
        let mut sent = 0;
        let writer = async {
            if wr.write_all(&head).await.is_err() {
                return std::future::pending().await;
            }
            sent = head.len();
            while sent < total {
                let n = chunk.len().min(total - sent);
                if wr.write_all(&chunk[..n]).await.is_err() {
                    break;
                }
                sent += n;
            }
            // All sent: hold until the broker answers or `end`.
            std::future::pending::<()>().await
        };
        let reader = async {
            let mut b = [0u8; 64];
            match rd.read(&mut b).await {
                Ok(0) | Err(_) => None,
                Ok(_) => Some(b[0]),
            }
        };
        let ended = tokio::time::timeout_at(end.into(), async {
            tokio::select! {
                a = reader => a,
                () = writer => None,
            }
        })
        .await;
        out.sent += sent;
        if let Ok(answer) = ended {
            out.closed += 1;
            if let Some(a) = answer {
                if !out.answers.contains(&a) {
                    out.answers.push(a);
                }
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }
    out
}

/// `clients` clients that never log in, half over TCP (`mqtt`), half over
/// WebSocket (`ws`), each sending a 16 MiB CONNECT but its last byte and
/// holding, again and again for `secs` (`tcp_closed=A/B`: of B rounds
/// the broker ended A), while a confirmed AMQP publisher (one message in
/// flight) counts its confirms.
pub async fn prelogin(
    t: &Target,
    mqtt: SocketAddr,
    ws: SocketAddr,
    clients: usize,
    secs: u64,
) -> Result<String> {
    let probe = MqttProbe::start(mqtt);
    let end = Instant::now() + Duration::from_secs(secs);
    let tasks: Vec<_> = (0..clients)
        .map(|i| {
            let ws_client = i % 2 == 1;
            let addr = if ws_client { ws } else { mqtt };
            tokio::spawn(async move { (ws_client, prelogin_client(addr, ws_client, end).await) })
        })
        .collect();
    let mut c = t.conn().await?;
    ops::declare_queue(&mut c, "abuse.prelogin", true).await?;
    c.confirm_select().await?;
    let frames = ops::encode_publish(c.frame_max, "", "abuse.prelogin", 1000, true)?;
    let publish = ops::publish_confirmed(
        &mut c,
        &frames,
        1,
        10_000_000,
        1,
        end,
        Duration::from_secs(secs),
    )
    .await;
    let mut line = format!("clients={clients} confirms_in_{secs}s={}", publish.acked);
    let (mut sent, mut answers) = (0usize, Vec::new());
    let (mut tcp, mut ws) = ((0u64, 0u64), (0u64, 0u64));
    for task in tasks {
        let (ws_client, o) = task.await.ctx("client task")?;
        sent += o.sent;
        let r = if ws_client { &mut ws } else { &mut tcp };
        r.0 += o.closed;
        r.1 += o.rounds;
        answers.extend(o.answers);
    }
    answers.sort_unstable();
    answers.dedup();
    let answers: Vec<String> = answers.iter().map(|a| format!("{a:#04x}")).collect();
    line.push_str(&format!(
        " sent_mb={} tcp_closed={}/{} ws_closed={}/{} answers={}",
        sent >> 20,
        tcp.0,
        tcp.1,
        ws.0,
        ws.1,
        if answers.is_empty() {
            "none".to_string()
        } else {
            answers.join(",")
        }
    ));
    line.push(' ');
    line.push_str(&probe.finish());
    Ok(line)
}

/// One MQTT 5 CONNECT whose will carries `props` empty user properties.
pub async fn will_props(mqtt: SocketAddr, props: usize) -> Result<String> {
    let probe = MqttProbe::start(mqtt);
    let will_props = [38u8, 0, 0, 0, 0].repeat(props);
    // Clean start, will QoS 0, user name and password.
    let mut body = [
        &string(b"MQTT")[..],
        &[5, 0x02 | 0x04 | 0x80 | 0x40, 0, 30, 0],
    ]
    .concat();
    body.extend(string(b"will-props"));
    body.extend(varint(will_props.len()));
    body.extend(will_props);
    body.extend(string(b"w"));
    body.extend(string(b"gone"));
    body.extend(string(b"guest"));
    body.extend(string(b"guest"));
    let packet = [&[0x10][..], &varint(body.len()), &body].concat();
    let t0 = Instant::now();
    let mut s = TcpStream::connect(mqtt).await.ctx("MQTT connect")?;
    let (mut rd, mut wr) = s.split();
    let (_, answer) = tokio::join!(wr.write_all(&packet), async {
        tokio::time::timeout(Duration::from_secs(60), async {
            let mut b = [0u8; 4];
            match rd.read(&mut b).await {
                Ok(n) if n >= 4 && b[0] == 0x20 => format!("connack:{:#04x}", b[3]),
                Ok(0) | Err(_) => "closed".to_string(),
                Ok(_) => format!("{:#04x}", b[0]),
            }
        })
        .await
        .unwrap_or_else(|_| "timeout".into())
    });
    let ms = t0.elapsed().as_millis();
    drop(s);
    Ok(format!(
        "props={props} connect_mb={:.1} answer={answer} answer_ms={ms} {}",
        packet.len() as f64 / 1e6,
        probe.finish()
    ))
}

/// A WebSocket client logs in, then sends `pings` pings of 125 bytes (for
/// at most `secs`), never reading a pong.
pub async fn ping_flood(mqtt: SocketAddr, ws: SocketAddr, pings: u64, secs: u64) -> Result<String> {
    let probe = MqttProbe::start(mqtt);
    let mut s = ws_upgrade(ws).await?;
    // No keep-alive: only the pings are measured, not an MQTT timeout.
    let connect = connect311("pinger", 0);
    s.write_all(&[ws_header(2, connect.len()), connect].concat())
        .await
        .ctx("CONNECT")?;
    // The CONNACK's frame (4 bytes of payload), then never read again.
    let mut connack = [0u8; 6];
    tokio::time::timeout(Duration::from_secs(10), s.read_exact(&mut connack))
        .await
        .ctx("CONNACK in time")?
        .ctx("CONNACK")?;
    let batch = [ws_header(9, 125), vec![b'p'; 125]].concat().repeat(1000);
    let t0 = Instant::now();
    let end = t0 + Duration::from_secs(secs);
    let mut sent = 0u64;
    let mut closed = false;
    while sent < pings && Instant::now() < end {
        match tokio::time::timeout_at(end.into(), s.write_all(&batch)).await {
            Ok(Ok(())) => sent += 1000,
            Ok(Err(_)) => {
                closed = true;
                break;
            }
            Err(_) => break,
        }
    }
    let took = t0.elapsed();
    // Still served a while later?
    tokio::time::sleep(Duration::from_secs(2)).await;
    let still_open = !closed && s.write_all(&ws_header(9, 0)).await.is_ok();
    Ok(format!(
        "pings={sent} in_ms={} closed={} {}",
        took.as_millis(),
        if still_open { "no" } else { "yes" },
        probe.finish()
    ))
}
