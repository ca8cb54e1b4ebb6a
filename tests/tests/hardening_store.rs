//! Store hardening (issue 5): damage that is not a torn tail is refused and
//! repaired into quarantine, never silently truncated; one process per data
//! directory; a full disk nacks publishes but keeps settles, purges and
//! passive declares working and recovers without a restart; transient
//! messages page to the store instead of growing RAM with queue depth.

use lapin::options::*;
use lapin::types::FieldTable;
use lapin::BasicProperties;
use std::collections::BTreeSet;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use weir_tests::hardening::{declare_durable, rss_bytes, Tmpfs};
use weir_tests::*;

/// The `*.seg` files of a data directory, oldest first.
fn segments(data_dir: &Path) -> Vec<PathBuf> {
    let mut segs: Vec<PathBuf> = std::fs::read_dir(data_dir.join("log"))
        .expect("log dir")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "seg"))
        .collect();
    segs.sort();
    segs
}

/// Record boundaries `(offset, total_len)` of a segment: after the 16-byte
/// segment header (magic, format version), `[u32 LE len][u32 LE crc32c][payload]`.
fn records(buf: &[u8]) -> Vec<(usize, usize)> {
    assert_eq!(&buf[..8], b"WEIRSEG\0", "segment header");
    let mut out = Vec::new();
    let mut off = 16;
    while off + 8 <= buf.len() {
        let len = u32::from_le_bytes(buf[off..off + 4].try_into().unwrap()) as usize;
        if len == 0 || off + 8 + len > buf.len() {
            break;
        }
        out.push((off, 8 + len));
        off += 8 + len;
    }
    out
}

fn body(i: usize) -> Vec<u8> {
    // ~800 bytes: 60 of them make a ~50 KB head segment, as in the report.
    let mut b = format!("m{i:03}-").into_bytes();
    b.resize(800, b'a' + (i % 26) as u8);
    b
}

/// Declares durable `queue` and publishes `body(0..n)` to it, persistent
/// and each one confirmed, on a connection of its own.
async fn publish_bodies(url: &str, queue: &str, n: usize) {
    let conn = connect(url).await;
    let ch = confirm_channel(&conn).await;
    declare_durable(&ch, queue).await;
    for i in 0..n {
        publish_confirmed(&ch, "", queue, &body(i), persistent()).await;
    }
    conn.close(200, "bye".into()).await.unwrap();
}

/// The only file in the data directory's quarantine.
fn only_quarantined(data_dir: &Path) -> PathBuf {
    let files: Vec<PathBuf> = std::fs::read_dir(data_dir.join("quarantine"))
        .expect("quarantine dir")
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(files.len(), 1, "quarantine holds {files:?}");
    files.into_iter().next().unwrap()
}

/// Broker flags for a data directory on a [`Tmpfs`]: 1 MiB segments and,
/// where the binary has a free-disk watermark, none, so that the disk
/// really fills up.
fn full_disk_args() -> Vec<&'static str> {
    let mut args = vec!["--segment-mb", "1"];
    if binary_knows("--disk-free-limit") {
        args.extend(["--disk-free-limit", "0"]);
    }
    args
}

/// Takes every message of `queue` with basic.get + ack.
async fn drain(url: &str, queue: &str) -> Vec<Vec<u8>> {
    let conn = connect(url).await;
    let ch = conn.create_channel().await.unwrap();
    let mut out = Vec::new();
    while let Some(m) = within(
        "basic.get",
        ch.basic_get(queue.into(), BasicGetOptions::default()),
    )
    .await
    .unwrap()
    {
        out.push(m.delivery.data.clone());
        m.delivery.ack(BasicAckOptions::default()).await.unwrap();
    }
    assert_eq!(queue_len(&ch, queue).await, 0);
    conn.close(200, "bye".into()).await.unwrap();
    out
}

fn start_args(dir: &Path, extra: &[&str]) -> impl FnOnce(&mut std::process::Command) {
    let dir = dir.to_path_buf();
    let extra: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
    move |cmd| {
        cmd.arg("--data-dir")
            .arg(dir)
            .arg("--amqp-listen")
            .arg(format!("127.0.0.1:{}", free_port()))
            .args(extra);
    }
}

// ---------------------------------------------------------------------------
// Corruption vs torn tail

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flipped_bit_mid_head_segment_refuses_to_start_and_repair_keeps_the_rest() {
    const N: usize = 60;
    const VICTIM: usize = 7;
    let dir = tempfile::tempdir().unwrap();
    let mut broker = Broker::start_in(dir.path());
    publish_bodies(&broker.url(), "hs", N).await;
    broker.stop();

    // Flip one bit in the body of message VICTIM, with ~50 confirmed
    // messages after it in the same (last) segment.
    let seg = segments(dir.path()).pop().unwrap();
    let mut bytes = std::fs::read(&seg).unwrap();
    let needle = format!("m{VICTIM:03}-").into_bytes();
    let at = bytes
        .windows(needle.len())
        .position(|w| w == needle)
        .expect("victim body in the segment");
    let (rec_off, rec_len) = records(&bytes)
        .into_iter()
        .find(|(o, l)| *o <= at && at < o + l)
        .expect("victim record");
    assert!(
        bytes.len() - (rec_off + rec_len) > 40 * 800,
        "valid records must follow the damage"
    );
    bytes[at + 100] ^= 0x08;
    std::fs::write(&seg, &bytes).unwrap();
    let seg_name = seg.file_name().unwrap().to_str().unwrap().to_string();

    // Refuses to start, naming the file, the offset and the way forward.
    let (status, out) = run_weir_to_exit(start_args(dir.path(), &[]));
    assert!(!status.success(), "started on a corrupt log:\n{out}");
    assert!(out.contains(&seg_name), "segment file not named:\n{out}");
    assert!(
        out.contains(&format!("offset {rec_off}")),
        "offset {rec_off} not named:\n{out}"
    );
    assert!(
        out.contains("weir repair"),
        "no hint at weir repair:\n{out}"
    );
    assert_eq!(
        std::fs::read(&seg).unwrap(),
        bytes,
        "refusal changed the log"
    );

    // `weir repair` quarantines exactly the damaged record and reports it.
    let (status, out) = run_weir_to_exit(|cmd| {
        cmd.arg("repair").arg("--data-dir").arg(dir.path());
    });
    assert!(status.success(), "repair failed:\n{out}");
    assert!(
        out.contains(&format!("offset {rec_off}")) && out.contains("lost message ids"),
        "repair did not report the loss:\n{out}"
    );
    assert_eq!(
        std::fs::read(only_quarantined(dir.path())).unwrap(),
        bytes[rec_off..rec_off + rec_len],
        "the quarantine file holds the damaged bytes"
    );

    // Every confirmed message but the damaged one survives, in order.
    broker.restart();
    let got = drain(&broker.url(), "hs").await;
    let want: Vec<Vec<u8>> = (0..N).filter(|i| *i != VICTIM).map(body).collect();
    assert_eq!(got.len(), want.len(), "survivors");
    assert!(got == want, "survivors differ from all-but-the-victim");
    broker.stop();
}

/// In a segment without a recorded durable end (written before the header
/// carried one) a cut last record is still a torn tail. (After a clean stop
/// the header records the whole length, and the same cut is damage:
/// `hardening_torn.rs`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn torn_last_record_still_recovers_silently() {
    const N: usize = 10;
    let dir = tempfile::tempdir().unwrap();
    let mut broker = Broker::start_in(dir.path());
    publish_bodies(&broker.url(), "tt2", N).await;
    broker.stop();
    // Cut the last record in half, as a crash mid-write would.
    let seg = segments(dir.path()).pop().unwrap();
    let mut bytes = std::fs::read(&seg).unwrap();
    bytes[12..16].fill(0);
    let (off, len) = *records(&bytes).last().unwrap();
    std::fs::write(&seg, &bytes[..off + len / 2]).unwrap();
    broker.restart();
    assert!(
        broker
            .run_logs()
            .contains("truncating torn or corrupt tail of the last log segment"),
        "{}",
        broker.run_logs()
    );
    let got = drain(&broker.url(), "tt2").await;
    assert_eq!(got, (0..N - 1).map(body).collect::<Vec<_>>());
    broker.stop();
}

// ---------------------------------------------------------------------------
// Data directory lock

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn second_broker_on_the_same_data_dir_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut first = Broker::start_in(dir.path());
    let pid = first.pid().unwrap();
    let (status, out) = run_weir_to_exit(start_args(dir.path(), &[]));
    assert!(!status.success(), "a second weir started:\n{out}");
    assert!(
        out.contains(&format!("pid {pid}")),
        "the holder's pid {pid} is not named:\n{out}"
    );
    // `weir repair` must not touch a live store either.
    let (status, out) = run_weir_to_exit(|cmd| {
        cmd.arg("repair").arg("--data-dir").arg(dir.path());
    });
    assert!(!status.success(), "repair ran on a live store:\n{out}");

    // The first keeps working, durably.
    publish_bodies(&first.url(), "lk", 20).await;
    first.stop();
    first.restart();
    assert_eq!(
        drain(&first.url(), "lk").await,
        (0..20).map(body).collect::<Vec<_>>()
    );
    first.stop();
}

// ---------------------------------------------------------------------------
// Disk full

/// Fills the filesystem of `path` with a file until it is full.
fn fill(path: &Path) {
    let mut f = std::fs::File::create(path).unwrap();
    let chunk = vec![0x5au8; 64 << 10];
    loop {
        match f.write(&chunk) {
            Ok(0) => break,
            Ok(_) => {}
            Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => break,
            Err(e) => panic!("filling: {e}"),
        }
    }
    let _ = f.sync_all();
}

/// Publishes `body` and returns whether it was confirmed (ack) or nacked.
async fn try_publish(ch: &lapin::Channel, queue: &str, body: &[u8]) -> bool {
    let confirm = within(
        "publish",
        ch.basic_publish(
            "".into(),
            queue.into(),
            BasicPublishOptions::default(),
            body,
            persistent(),
        ),
    )
    .await
    .expect("basic.publish");
    within("confirm", confirm)
        .await
        .expect("publisher confirm (the connection must stay up)")
        .is_ack()
}

fn binary_knows(flag: &str) -> bool {
    let out = std::process::Command::new(weir_bin())
        .arg("--help")
        .output()
        .expect("weir --help");
    String::from_utf8_lossy(&out.stdout).contains(flag)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_disk_nacks_publishes_keeps_settles_working_and_recovers_without_restart() {
    let Some(fs) = Tmpfs::mount("64m") else {
        return;
    };
    let data = fs.path().join("data");
    std::fs::create_dir_all(&data).unwrap();
    let mut broker = Broker::start_in_with(&data, &full_disk_args());
    let conn = connect(&broker.url()).await;
    let ch = confirm_channel(&conn).await;
    declare_durable(&ch, "purged").await;
    declare_durable(&ch, "keep").await;
    for i in 0..100 {
        publish_confirmed(&ch, "", "purged", &body(i), persistent()).await;
    }

    fill(&fs.path().join("filler"));

    // Publishers fill what is left: nacked, not a connection close.
    let mut acked = BTreeSet::new();
    let mut nacked = BTreeSet::new();
    let mut i = 0usize;
    while nacked.len() < 20 {
        assert!(i < 20_000, "never nacked with the disk full");
        let b = format!("k{i:06}").into_bytes();
        let mut padded = b.clone();
        padded.resize(4000, b'k');
        if try_publish(&ch, "keep", &padded).await {
            acked.insert(b);
        } else {
            nacked.insert(b);
        }
        i += 1;
    }
    // The line may trail the nack that it explains: await it.
    assert!(
        broker.wait_for_log("disk full", OP_TIMEOUT),
        "{}",
        broker.run_logs()
    );

    // Passive declare, get + ack and purge all keep working.
    assert_eq!(queue_len(&ch, "purged").await, 100);
    for _ in 0..5 {
        let m = ch
            .basic_get("purged".into(), BasicGetOptions::default())
            .await
            .unwrap()
            .expect("a message");
        m.delivery.ack(BasicAckOptions::default()).await.unwrap();
    }
    let purged = ch
        .queue_purge("purged".into(), QueuePurgeOptions::default())
        .await
        .expect("purge with a full disk");
    assert_eq!(purged, 95);
    assert!(
        !try_publish(&ch, "keep", b"still full").await,
        "confirmed with the disk still full"
    );
    nacked.insert(b"still full".to_vec());

    // Space comes back: confirmed publishing resumes, no restart.
    std::fs::remove_file(fs.path().join("filler")).unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut j = 0;
    loop {
        let b = format!("after{j:04}").into_bytes();
        j += 1;
        if try_publish(&ch, "keep", &b).await {
            acked.insert(b);
            break;
        }
        nacked.insert(b);
        assert!(Instant::now() < deadline, "publishing did not recover");
        // Polling: the client has no event to wait for.
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for k in 0..50 {
        let b = format!("again{k:04}").into_bytes();
        publish_confirmed(&ch, "", "keep", &b, persistent()).await;
        acked.insert(b);
    }
    conn.close(200, "bye".into()).await.unwrap();

    // Across a restart: purged and acked messages stay gone, every
    // confirmed publish is there.
    broker.stop();
    broker.restart();
    assert!(drain(&broker.url(), "purged").await.is_empty());
    let kept: BTreeSet<Vec<u8>> = drain(&broker.url(), "keep")
        .await
        .into_iter()
        .map(|mut b| {
            if b.starts_with(b"k") {
                // Published padded to 4000 bytes with b'k': must come back
                // whole, not just recognisable by its prefix.
                assert!(
                    b.len() == 4000 && b[7..].iter().all(|&c| c == b'k'),
                    "a confirmed message came back damaged: {:?}",
                    String::from_utf8_lossy(&b[..b.len().min(16)])
                );
                b.truncate(7);
            }
            b
        })
        .collect();
    if std::env::var_os("HS_VERBOSE").is_some() {
        eprintln!(
            "acked {} nacked {} kept {}\n{}",
            acked.len(),
            nacked.len(),
            kept.len(),
            broker.logs()
        );
    }
    let missing: Vec<_> = acked.difference(&kept).collect();
    assert!(missing.is_empty(), "confirmed messages lost: {missing:?}");
    assert!(
        kept.iter().all(|b| acked.contains(b) || nacked.contains(b)),
        "unknown messages appeared"
    );
    broker.stop();
}

// ---------------------------------------------------------------------------
// Paging

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deep_transient_queues_page_to_the_store_and_vanish_at_restart() {
    const N: usize = 12_000;
    let dir = tempfile::tempdir().unwrap();
    let mut broker = Broker::start_in_with(dir.path(), &["--segment-mb", "1"]);
    let conn = connect(&broker.url()).await;
    let ch = confirm_channel(&conn).await;
    declare_queue(&ch, "tq").await; // non-durable
    declare_durable(&ch, "dq").await;
    let transient = BasicProperties::default();
    let body_of = |i: usize| {
        let mut b = format!("t{i:06}-").into_bytes();
        b.resize(1000, b'a' + (i % 26) as u8);
        b
    };
    for i in 0..N {
        // Persistent into a non-durable queue is transient too.
        let props = if i % 2 == 0 {
            transient.clone()
        } else {
            persistent()
        };
        let c = ch
            .basic_publish(
                "".into(),
                "tq".into(),
                BasicPublishOptions::default(),
                &body_of(i),
                props,
            )
            .await
            .unwrap();
        if i % 500 == 499 {
            assert!(c.await.unwrap().is_ack());
        }
    }
    for i in 0..3000 {
        let c = ch
            .basic_publish(
                "".into(),
                "dq".into(),
                BasicPublishOptions::default(),
                &body_of(i),
                transient.clone(),
            )
            .await
            .unwrap();
        if i == 2999 {
            assert!(c.await.unwrap().is_ack());
        }
    }
    // ~10 MB of transient data beyond the in-memory window went to the
    // store (1 MiB segments): the store holds more than meta.
    let segs = segments(dir.path()).len();
    assert!(
        segs >= 5,
        "transient messages were not paged ({segs} segments)"
    );

    // Consumed intact and in order, bodies read back from the store.
    let cch = conn.create_channel().await.unwrap();
    cch.basic_qos(500, BasicQosOptions::default())
        .await
        .unwrap();
    let mut consumer = cch
        .basic_consume(
            "tq".into(),
            "c".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    for i in 0..N {
        let d = next_delivery(&mut consumer).await;
        assert!(d.data == body_of(i), "message {i} differs");
        if i % 100 == 99 {
            d.ack(BasicAckOptions { multiple: true }).await.unwrap();
        }
    }
    assert_eq!(queue_len(&ch, "tq").await, 0);
    assert_eq!(queue_len(&ch, "dq").await, 3000);
    conn.close(200, "bye".into()).await.unwrap();
    drop(consumer);

    // A restart drops all of it: the non-durable queue is gone, the
    // durable one is empty.
    broker.stop();
    broker.restart();
    let conn = connect(&broker.url()).await;
    let ch = conn.create_channel().await.unwrap();
    assert_eq!(queue_len(&ch, "dq").await, 0);
    let r = ch
        .queue_declare(
            "tq".into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await;
    assert_code(r, 404);
    broker.stop();
}

/// The case: publishers themselves fill the disk, the broker is
/// restarted with the disk still full, and a purge must still be recorded,
/// free the space and let publishing resume, without another restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disk_filled_by_publishers_purge_after_restart_frees_it() {
    let Some(fs) = Tmpfs::mount("24m") else {
        return;
    };
    let data = fs.path().join("data");
    std::fs::create_dir_all(&data).unwrap();
    let mut broker = Broker::start_in_with(&data, &full_disk_args());
    let conn = connect(&broker.url()).await;
    let ch = confirm_channel(&conn).await;
    declare_durable(&ch, "big").await;
    let mut acked = 0u32;
    let mut nacks = 0;
    let mut i = 0;
    while nacks < 10 {
        assert!(i < 20_000, "never nacked with the disk full");
        let mut b = format!("b{i:06}").into_bytes();
        b.resize(8000, b'b');
        if try_publish(&ch, "big", &b).await {
            acked += 1;
        } else {
            nacks += 1;
        }
        i += 1;
    }
    assert!(
        acked > 1000,
        "only {acked} confirmed before the disk filled"
    );
    conn.close(200, "bye".into()).await.unwrap();
    broker.stop();

    // Restart with the disk still full: every confirmed message is there,
    // and the purge is recorded.
    broker.restart();
    let conn = connect(&broker.url()).await;
    let ch = confirm_channel(&conn).await;
    assert_eq!(queue_len(&ch, "big").await, acked);
    let purged = ch
        .queue_purge("big".into(), QueuePurgeOptions::default())
        .await
        .expect("purge with a full disk after restart");
    assert_eq!(purged, acked);

    // Reclaiming the purged segments frees the disk: publishing resumes.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if try_publish(&ch, "big", b"after").await {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "publishing did not recover after the purge\n{}",
            broker.run_logs()
        );
        // Polling: the client has no event to wait for.
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    conn.close(200, "bye".into()).await.unwrap();
    broker.stop();
    broker.restart();
    let left = drain(&broker.url(), "big").await;
    if std::env::var_os("HS_VERBOSE").is_some() {
        eprintln!("acked {acked}\n{}", broker.logs());
    }
    assert!(
        left.iter().all(|b| b == b"after") && !left.is_empty(),
        "purged messages came back: {} left",
        left.len()
    );
    broker.stop();
}

/// Measurement, not a check: resident memory per queued transient 1 KB
/// message in a deep non-durable queue. Run with `--ignored --no-capture`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore]
async fn measure_memory_per_paged_transient_message() {
    const N: usize = 100_000;
    let mut broker = Broker::start();
    let pid = broker.pid().unwrap();
    let conn = connect(&broker.url()).await;
    let ch = confirm_channel(&conn).await;
    declare_queue(&ch, "mem").await;
    let before = rss_bytes(pid);
    let body = vec![b'x'; 1000];
    for i in 0..N {
        let c = ch
            .basic_publish(
                "".into(),
                "mem".into(),
                BasicPublishOptions::default(),
                &body,
                BasicProperties::default(),
            )
            .await
            .unwrap();
        if i % 1000 == 999 {
            assert!(c.await.unwrap().is_ack());
        }
    }
    assert_eq!(queue_len(&ch, "mem").await, N as u32);
    let after = rss_bytes(pid);
    eprintln!(
        "MEASURE: {N} transient 1000-byte messages in a non-durable queue: RSS {} MiB -> {} MiB, {} bytes per message",
        before >> 20,
        after >> 20,
        (after.saturating_sub(before)) / N as u64
    );
    conn.close(200, "bye".into()).await.unwrap();
    broker.stop();
}

fn sealed_body(i: usize) -> Vec<u8> {
    let mut b = format!("s{i:05}-").into_bytes();
    b.resize(800, b's');
    b
}

/// Damage in a sealed (older) segment: refused the same way, and `--repair`
/// at startup quarantines it and starts with every other message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn damaged_sealed_segment_is_repaired_by_the_repair_flag() {
    const N: usize = 2000;
    const VICTIM: usize = 100;
    let dir = tempfile::tempdir().unwrap();
    let mut broker = Broker::start_in_with(dir.path(), &["--segment-mb", "1"]);
    {
        let conn = connect(&broker.url()).await;
        let ch = confirm_channel(&conn).await;
        declare_durable(&ch, "sealed").await;
        for i in 0..N {
            let b = sealed_body(i);
            let c = ch
                .basic_publish(
                    "".into(),
                    "sealed".into(),
                    BasicPublishOptions::default(),
                    &b,
                    persistent(),
                )
                .await
                .unwrap();
            if i % 200 == 199 || i == N - 1 {
                assert!(c.await.unwrap().is_ack());
            }
        }
        conn.close(200, "bye".into()).await.unwrap();
    }
    broker.stop();
    let segs = segments(dir.path());
    assert!(segs.len() >= 2);
    let first = &segs[0];
    let mut bytes = std::fs::read(first).unwrap();
    let needle = format!("s{VICTIM:05}-").into_bytes();
    let at = bytes
        .windows(needle.len())
        .position(|w| w == needle)
        .expect("victim in the first segment");
    bytes[at + 300] ^= 0x01;
    std::fs::write(first, &bytes).unwrap();

    let (status, out) = run_weir_to_exit(start_args(dir.path(), &["--segment-mb", "1"]));
    assert!(
        !status.success(),
        "started on a corrupt sealed segment:\n{out}"
    );
    let name = first.file_name().unwrap().to_str().unwrap();
    assert!(out.contains(name) && out.contains("weir repair"), "{out}");

    let mut broker = Broker::start_in_with(dir.path(), &["--segment-mb", "1", "--repair"]);
    assert!(
        broker.run_logs().contains("messages lost to damage"),
        "{}",
        broker.run_logs()
    );
    let got = drain(&broker.url(), "sealed").await;
    assert_eq!(got.len(), N - 1);
    assert!(got.iter().all(|b| !b.starts_with(&needle)));
    // Every other message, intact and in order.
    let want: Vec<Vec<u8>> = (0..N).filter(|i| *i != VICTIM).map(sealed_body).collect();
    assert!(got == want, "survivors differ from all-but-the-victim");
    // The quarantined record is the damaged one.
    let q = std::fs::read(only_quarantined(dir.path())).unwrap();
    assert!(
        q.windows(needle.len()).any(|w| w == needle),
        "the quarantine file does not hold message {VICTIM}"
    );
    broker.stop();
}
