//! kill -9 while publishers with confirms are running: every confirmed
//! persistent message survives every crash.

use lapin::options::*;
use lapin::types::FieldTable;
use lapin::{Connection, ConnectionProperties};
use rand::Rng;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::watch;
use weir_tests::*;

const QUEUE: &str = "crash-q";
const PUBLISHERS: u64 = 3;
const CYCLES: u64 = 6;
/// Publishes in flight per publisher before awaiting their confirms.
const WINDOW: usize = 16;
/// A dead broker must not hang a publisher for long.
const STEP_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Default, Debug)]
struct PublisherReport {
    confirmed: Vec<u64>,
    nacked: Vec<u64>,
    /// Sent but neither confirmed nor nacked (connection died first).
    unresolved: u64,
    sent: u64,
    connections: u64,
}

fn seq(publisher: u64, n: u64) -> u64 {
    (publisher << 32) | n
}

/// Publishes until `stop`; reconnects to every new broker generation.
async fn publisher(
    id: u64,
    mut gens: watch::Receiver<(u64, String)>,
    stop: Arc<AtomicBool>,
) -> PublisherReport {
    let mut r = PublisherReport::default();
    let mut n = 0u64;
    'outer: while !stop.load(Ordering::Relaxed) {
        let (gen, url) = gens.borrow_and_update().clone();
        let session = async {
            let conn = tokio::time::timeout(
                STEP_TIMEOUT,
                Connection::connect(&url, ConnectionProperties::default()),
            )
            .await
            .ok()?
            .ok()?;
            r.connections += 1;
            let ch = conn.create_channel().await.ok()?;
            ch.confirm_select(ConfirmSelectOptions::default())
                .await
                .ok()?;
            while !stop.load(Ordering::Relaxed) {
                let mut pending = Vec::with_capacity(WINDOW);
                for _ in 0..WINDOW {
                    let s = seq(id, n);
                    n += 1;
                    r.sent += 1;
                    match ch
                        .basic_publish(
                            "".into(),
                            QUEUE.into(),
                            BasicPublishOptions::default(),
                            &s.to_be_bytes(),
                            persistent(),
                        )
                        .await
                    {
                        Ok(c) => pending.push((s, c)),
                        Err(_) => {
                            r.unresolved += 1;
                            break;
                        }
                    }
                }
                let mut broken = pending.len() < WINDOW;
                for (s, c) in pending {
                    if broken {
                        r.unresolved += 1;
                        continue;
                    }
                    match tokio::time::timeout(STEP_TIMEOUT, c).await {
                        Ok(Ok(c)) if c.is_ack() => r.confirmed.push(s),
                        Ok(Ok(_)) => r.nacked.push(s),
                        _ => {
                            r.unresolved += 1;
                            broken = true;
                        }
                    }
                }
                if broken {
                    return None;
                }
            }
            let _ = conn.close(200, "done".into()).await;
            Some(())
        };
        if session.await.is_some() {
            break 'outer;
        }
        // The connection died (or never came up): wait for the next broker.
        if gens.wait_for(|(g, _)| *g > gen).await.is_err() {
            break;
        }
    }
    r
}

/// Consumes with acks until `stop`, reconnecting to every new broker;
/// returns the sequence numbers whose ack was sent, and why each session
/// ended.
async fn consumer(
    mut gens: watch::Receiver<(u64, String)>,
    stop: Arc<AtomicBool>,
) -> (Vec<u64>, Vec<String>) {
    let mut acked = Vec::new();
    let mut endings = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        let (gen, url) = gens.borrow_and_update().clone();
        let session = async {
            let step = |what: &'static str| move |e: lapin::Error| format!("{what}: {e}");
            let conn = tokio::time::timeout(
                STEP_TIMEOUT,
                Connection::connect(&url, ConnectionProperties::default()),
            )
            .await
            .map_err(|_| "connect timed out".to_string())?
            .map_err(step("connect"))?;
            let ch = conn.create_channel().await.map_err(step("channel.open"))?;
            ch.basic_qos(64, BasicQosOptions::default())
                .await
                .map_err(step("basic.qos"))?;
            let mut c = ch
                .basic_consume(
                    QUEUE.into(),
                    "acker".into(),
                    BasicConsumeOptions::default(),
                    FieldTable::default(),
                )
                .await
                .map_err(step("basic.consume"))?;
            while !stop.load(Ordering::Relaxed) {
                // Bounded so the stop flag is noticed when the queue is empty.
                let d = match tokio::time::timeout(Duration::from_millis(500), c.next()).await {
                    Err(_) => continue,
                    Ok(Some(Ok(d))) => d,
                    Ok(Some(Err(e))) => return Err(format!("delivery: {e}")),
                    Ok(None) => return Err("consumer stream ended".into()),
                };
                let s = u64::from_be_bytes(d.data.as_slice().try_into().expect("8-byte body"));
                tokio::time::timeout(STEP_TIMEOUT, d.ack(BasicAckOptions::default()))
                    .await
                    .map_err(|_| "ack timed out".to_string())?
                    .map_err(step("ack"))?;
                acked.push(s);
            }
            tokio::time::timeout(STEP_TIMEOUT, conn.close(200, "done".into()))
                .await
                .map_err(|_| "connection.close timed out".to_string())?
                .map_err(step("connection.close"))?;
            Ok::<(), String>(())
        };
        let r = session.await;
        endings.push(format!("gen {gen}: {r:?}"));
        if r.is_ok() {
            break;
        }
        // Wait for the next broker, or for the end of the test.
        if gens.wait_for(|(g, _)| *g > gen).await.is_err() {
            break;
        }
    }
    (acked, endings)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kill9_while_publishing_loses_no_confirmed_message() {
    crash_cycles(&[], false).await;
}

/// Small segments (rollover and reclamation happen under the crashes) and a
/// consumer acking concurrently.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kill9_with_small_segments_and_acking_consumer() {
    crash_cycles(&["--segment-mb", "1"], true).await;
}

async fn crash_cycles(args: &[&str], with_consumer: bool) {
    let started = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let mut broker = Broker::start_in_with(dir.path(), args);
    {
        let conn = connect(&broker.url()).await;
        let ch = conn.create_channel().await.unwrap();
        ch.queue_declare(
            QUEUE.into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
        conn.close(200, "bye".into()).await.unwrap();
    }

    let (gen_tx, gen_rx) = watch::channel((0u64, broker.url()));
    let stop = Arc::new(AtomicBool::new(false));
    let tasks: Vec<_> = (0..PUBLISHERS)
        .map(|id| tokio::spawn(publisher(id, gen_rx.clone(), stop.clone())))
        .collect();
    let consumer_task = with_consumer.then(|| tokio::spawn(consumer(gen_rx.clone(), stop.clone())));

    let mut torn_tails = 0;
    for gen in 1..=CYCLES {
        // Chaos, not synchronisation: crash at a random moment.
        let delay = rand::thread_rng().gen_range(200..=1500);
        tokio::time::sleep(Duration::from_millis(delay)).await;
        tokio::task::block_in_place(|| {
            broker.kill9();
            broker.restart();
        });
        if broker
            .run_logs()
            .contains("store dropped an unconfirmed torn tail")
        {
            torn_tails += 1;
        }
        eprintln!(
            "cycle {gen}: killed after {delay} ms, restarted on port {}",
            broker.port()
        );
        gen_tx.send((gen, broker.url())).unwrap();
    }
    // Let the publishers do some work on the last broker, then stop them.
    let delay = rand::thread_rng().gen_range(200..=1500);
    tokio::time::sleep(Duration::from_millis(delay)).await;
    stop.store(true, Ordering::Relaxed);
    // Wakes any client waiting for a next generation that will not come.
    gen_tx.send_modify(|(g, _)| *g += 1);
    let mut reports = Vec::new();
    for t in tasks {
        reports.push(within("publisher to finish", t).await.unwrap());
    }
    let acked: BTreeSet<u64> = match consumer_task {
        Some(t) => {
            let (acked, endings) = within("consumer to finish", t).await.unwrap();
            eprintln!("consumer sessions: {endings:#?}");
            // Sessions end with their broker's death (lapin sometimes
            // leaves an ack pending on a dead socket: "ack timed out"), but
            // a session on the final, never-killed broker must end cleanly.
            let last_gen = format!("gen {CYCLES}: ");
            assert!(
                endings
                    .iter()
                    .filter(|e| e.starts_with(&last_gen))
                    .all(|e| e.ends_with("Ok(())")),
                "the consumer's session on the live broker failed: {endings:#?}"
            );
            acked.into_iter().collect()
        }
        None => BTreeSet::new(),
    };
    drop(gen_tx);

    // One more crash with nothing in flight, then read everything back.
    tokio::task::block_in_place(|| {
        broker.kill9();
        broker.restart();
    });

    let conn = connect(&broker.url()).await;
    let ch = conn.create_channel().await.unwrap();
    let total = queue_len(&ch, QUEUE).await;
    ch.basic_qos(1000, BasicQosOptions::default())
        .await
        .unwrap();
    let mut consumer = ch
        .basic_consume(
            QUEUE.into(),
            "verify".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let mut counts: BTreeMap<u64, u32> = BTreeMap::new();
    for i in 0..total {
        let d = next_delivery(&mut consumer).await;
        let s = u64::from_be_bytes(d.data.as_slice().try_into().expect("8-byte body"));
        *counts.entry(s).or_default() += 1;
        if i % 500 == 499 || i + 1 == total {
            d.ack(BasicAckOptions { multiple: true }).await.unwrap();
        }
    }
    ch.basic_cancel("verify".into(), BasicCancelOptions::default())
        .await
        .unwrap();
    assert_eq!(queue_len(&ch, QUEUE).await, 0, "queue drained");
    conn.close(200, "bye".into()).await.unwrap();
    broker.stop();

    let confirmed: BTreeSet<u64> = reports
        .iter()
        .flat_map(|r| r.confirmed.iter().copied())
        .collect();
    let sent: BTreeMap<u64, u64> = reports
        .iter()
        .enumerate()
        .map(|(i, r)| (i as u64, r.sent))
        .collect();
    // Confirmed and not acked by our consumer: must be in the queue. (An ack
    // has no confirmation, so acked ones may or may not come back.)
    let missing: Vec<u64> = confirmed
        .iter()
        .copied()
        .filter(|s| !counts.contains_key(s) && !acked.contains(s))
        .collect();
    let duplicates: u32 = counts.values().map(|c| c - 1).sum();
    let unconfirmed_delivered = counts.keys().filter(|s| !confirmed.contains(s)).count();
    let bogus: Vec<u64> = counts
        .keys()
        .copied()
        .filter(|s| sent.get(&(s >> 32)).is_none_or(|&n| (s & 0xffff_ffff) >= n))
        .collect();
    eprintln!(
        "crash test: {CYCLES} kill -9 cycles (+1 idle), {torn_tails} restarts reported a torn tail; \
         sent {}, confirmed {}, nacked {}, unresolved {}, connections {}; \
         delivered {} ({} distinct), duplicates {duplicates}, unconfirmed-but-delivered {unconfirmed_delivered}, \
         consumer acked {}, missing confirmed {}, segments at end {}; took {:?}",
        reports.iter().map(|r| r.sent).sum::<u64>(),
        confirmed.len(),
        reports.iter().map(|r| r.nacked.len()).sum::<usize>(),
        reports.iter().map(|r| r.unresolved).sum::<u64>(),
        reports.iter().map(|r| r.connections).sum::<u64>(),
        total,
        counts.len(),
        acked.len(),
        missing.len(),
        std::fs::read_dir(dir.path().join("log")).map(|d| d.count()).unwrap_or(0),
        started.elapsed(),
    );
    assert!(!confirmed.is_empty(), "publishers never got a confirm");
    assert!(
        reports.iter().all(|r| r.connections >= 2),
        "every publisher should have reconnected at least once: {:?}",
        reports.iter().map(|r| r.connections).collect::<Vec<_>>()
    );
    assert!(
        bogus.is_empty(),
        "delivered messages nobody sent: {bogus:?}"
    );
    assert!(
        missing.is_empty(),
        "{} confirmed messages lost, first: {:?}",
        missing.len(),
        &missing[..missing.len().min(20)]
    );
}
