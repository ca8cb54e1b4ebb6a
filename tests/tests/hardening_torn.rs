//! A flipped bit in the last record is damage, not a torn tail (issue 20,
//! item 8). Every segment header records the segment's fsynced end (its
//! whole length at a clean stop, and about once a second while the writer
//! appends); a bad record below it is refused at start, naming segment and
//! offset, and `weir repair` quarantines it and names the lost message. Only
//! a bad tail past the recorded end, which no confirm can have covered, is
//! still truncated as torn.

use lapin::options::*;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};
use weir_tests::hardening::declare_durable;
use weir_tests::*;

const QUEUE: &str = "torn";
const N: usize = 30;
/// What the pre-fix broker logged while dropping the confirmed record.
const TORN_WARNING: &str = "unconfirmed torn tail";
const TRUNCATION_WARNING: &str = "truncating torn or corrupt tail";

/// The newest `*.seg` file of a data directory.
fn newest_segment(data_dir: &Path) -> PathBuf {
    let mut segs: Vec<PathBuf> = std::fs::read_dir(data_dir.join("log"))
        .expect("log dir")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "seg"))
        .collect();
    segs.sort();
    segs.pop().expect("no segment file")
}

/// Record boundaries `(offset, total_len)` of a segment: after the 16-byte
/// header, `[u32 LE len][u32 LE crc32c][payload]`, up to the first zero
/// length (the preallocated rest of a crashed head) or the end.
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

/// The durable end the segment's header records (bytes 12..16).
fn recorded_end(path: &Path) -> u64 {
    let mut h = [0u8; 16];
    std::fs::File::open(path)
        .unwrap()
        .read_exact(&mut h)
        .unwrap();
    u64::from(u32::from_le_bytes(h[12..16].try_into().unwrap()))
}

/// The message id in a publish record (payload: type byte, then id u64).
fn message_id(record: &[u8]) -> u64 {
    assert!(matches!(record[8], 1 | 7), "not a publish record");
    u64::from_le_bytes(record[9..17].try_into().unwrap())
}

fn body(i: usize) -> Vec<u8> {
    let mut b = format!("m{i:03}-").into_bytes();
    b.resize(600, b'a' + (i % 26) as u8);
    b
}

/// Declares the durable queue and publishes `body(0..N)`, persistent and
/// each one confirmed.
async fn publish_all(url: &str) {
    let conn = connect(url).await;
    let ch = confirm_channel(&conn).await;
    declare_durable(&ch, QUEUE).await;
    for i in 0..N {
        publish_confirmed(&ch, "", QUEUE, &body(i), persistent()).await;
    }
    conn.close(200, "bye".into()).await.unwrap();
}

/// Every message of the queue, taken with basic.get + ack.
async fn drain(url: &str) -> Vec<Vec<u8>> {
    let conn = connect(url).await;
    let ch = conn.create_channel().await.unwrap();
    let mut out = Vec::new();
    while let Some(m) = within(
        "basic.get",
        ch.basic_get(QUEUE.into(), BasicGetOptions::default()),
    )
    .await
    .unwrap()
    {
        out.push(m.delivery.data.clone());
        m.delivery.ack(BasicAckOptions::default()).await.unwrap();
    }
    assert_eq!(queue_len(&ch, QUEUE).await, 0);
    conn.close(200, "bye".into()).await.unwrap();
    out
}

/// Starts `weir` on `dir` and expects it to refuse: returns its output. If
/// it becomes ready instead (the bug: the damage passed for a torn tail),
/// it is killed and the test fails quoting its log.
fn start_expecting_refusal(dir: &Path) -> String {
    let log_path = dir.join("refusal.log");
    let log = std::fs::File::create(&log_path).unwrap();
    let mut cmd = weir_command();
    cmd.arg("--data-dir")
        .arg(dir)
        .arg("--amqp-listen")
        .arg(format!("127.0.0.1:{}", free_port()))
        .args(["--mqtt-listen", "127.0.0.1:0"])
        .args(["--mqtt-ws-listen", "127.0.0.1:0"])
        .args(["--http-listen", "127.0.0.1:0"])
        .stdout(Stdio::from(log.try_clone().unwrap()))
        .stderr(Stdio::from(log));
    let mut child = cmd.spawn().expect("spawning weir");
    let deadline = Instant::now() + START_TIMEOUT;
    // Whichever comes first: the process exits, or it says it is ready.
    loop {
        let out = std::fs::read_to_string(&log_path).unwrap_or_default();
        if let Some(status) = child.try_wait().unwrap() {
            let out = std::fs::read_to_string(&log_path).unwrap_or_default();
            assert!(!status.success(), "weir exited 0 on a damaged log:\n{out}");
            return out;
        }
        if out.contains("AMQP listener ready") || Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("weir started on a damaged log instead of refusing:\n{out}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Asserts the refusal names the segment and offset, calls it damage and
/// points at `weir repair`, and did not touch the log.
fn assert_refused(out: &str, seg: &Path, offset: usize, bytes: &[u8]) {
    let name = seg.file_name().unwrap().to_str().unwrap();
    assert!(out.contains(name), "segment file not named:\n{out}");
    assert!(
        out.contains(&format!("offset {offset}")),
        "offset {offset} not named:\n{out}"
    );
    assert!(out.contains("not a torn tail"), "not called damage:\n{out}");
    assert!(
        out.contains("weir repair"),
        "no hint at weir repair:\n{out}"
    );
    assert!(
        !out.contains(TORN_WARNING) && !out.contains(TRUNCATION_WARNING),
        "damage passed for a torn tail:\n{out}"
    );
    assert_eq!(
        std::fs::read(seg).unwrap(),
        bytes,
        "refusing changed the log"
    );
}

/// Runs `weir repair` and asserts it quarantined exactly `bytes[off..off +
/// len]` and named `lost` as the one lost message.
fn repair_names(dir: &Path, bytes: &[u8], off: usize, len: usize, lost: u64) {
    let (status, out) = run_weir_to_exit(|cmd| {
        cmd.arg("repair").arg("--data-dir").arg(dir);
    });
    assert!(status.success(), "repair failed:\n{out}");
    assert!(
        out.contains(&format!("offset {off}")),
        "repair did not report offset {off}:\n{out}"
    );
    assert!(
        out.contains(&format!("lost message ids: [{lost}]")),
        "repair did not name message {lost} as lost:\n{out}"
    );
    let q: Vec<PathBuf> = std::fs::read_dir(dir.join("quarantine"))
        .expect("quarantine dir")
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(q.len(), 1, "quarantine holds {q:?}");
    assert_eq!(std::fs::read(&q[0]).unwrap(), bytes[off..off + len]);
}

/// The case: N confirmed messages, a clean stop (SIGTERM), one bit
/// flipped inside the head segment's last record. The broker refuses to
/// start naming the damage; `weir repair` quarantines that record and names
/// its message; the other N−1 come back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flipped_bit_in_last_record_after_clean_stop_is_refused_and_repaired() {
    let dir = tempfile::tempdir().unwrap();
    let mut broker = Broker::start_in(dir.path());
    publish_all(&broker.url()).await;
    broker.stop();

    let seg = newest_segment(dir.path());
    let mut bytes = std::fs::read(&seg).unwrap();
    let &(off, len) = records(&bytes).last().expect("records");
    assert_eq!(
        off + len,
        bytes.len(),
        "a clean stop seals at the last record"
    );
    let last = &bytes[off..off + len];
    let needle = format!("m{:03}-", N - 1).into_bytes();
    assert!(
        last.windows(needle.len()).any(|w| w == needle),
        "the last record is the last publish"
    );
    let id = message_id(last);
    // One bit in the body, well inside the record.
    bytes[off + len - 100] ^= 0x04;
    std::fs::write(&seg, &bytes).unwrap();

    let out = start_expecting_refusal(dir.path());
    assert_refused(&out, &seg, off, &bytes);

    repair_names(dir.path(), &bytes, off, len, id);

    broker.restart();
    assert!(
        !broker.run_logs().contains(TRUNCATION_WARNING),
        "{}",
        broker.run_logs()
    );
    let got = drain(&broker.url()).await;
    let want: Vec<Vec<u8>> = (0..N - 1).map(body).collect();
    assert_eq!(got.len(), N - 1, "N-1 recovered");
    assert!(got == want, "survivors differ from all but the last");
    broker.stop();
}

/// After a crash (kill -9) the writer's recorded end still protects what it
/// knew to be fsynced: a flipped bit in the last confirmed record is damage
/// once the end covering it was recorded, while a torn write past it is
/// still truncated silently.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_kill9_recorded_records_are_damage_and_a_torn_write_past_them_is_not() {
    let dir = tempfile::tempdir().unwrap();
    let mut broker = Broker::start_in(dir.path());
    publish_all(&broker.url()).await;
    let seg = newest_segment(dir.path());
    let end = {
        let bytes = std::fs::read(&seg).unwrap();
        let &(off, len) = records(&bytes).last().expect("records");
        (off + len) as u64
    };
    // An idle writer records its fsynced end within about a second.
    let deadline = Instant::now() + OP_TIMEOUT;
    while recorded_end(&seg) < end {
        assert!(
            Instant::now() < deadline,
            "the head's fsynced end {end} was never recorded (header says {})",
            recorded_end(&seg)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    broker.kill9();
    let image = std::fs::read(&seg).unwrap();
    let recs = records(&image);
    let &(off, len) = recs.last().unwrap();
    assert_eq!(
        (off + len) as u64,
        end,
        "nothing written after the publishes"
    );
    // The crash as it is, for the second case.
    let crashed = tempfile::tempdir().unwrap();
    copy_dir(dir.path(), crashed.path());

    // A torn write past the recorded end (half a copy of a record): the
    // usual silent truncation, all N back.
    let mut torn = image.clone();
    let (o1, l1) = recs[1];
    torn[end as usize..end as usize + l1 / 2].copy_from_slice(&image[o1..o1 + l1 / 2]);
    std::fs::write(&seg, &torn).unwrap();
    broker.restart();
    assert!(
        broker.run_logs().contains(TRUNCATION_WARNING),
        "{}",
        broker.run_logs()
    );
    assert_eq!(drain(&broker.url()).await.len(), N, "all N back");
    broker.kill9();

    // The same crash with a bit flipped in the last confirmed record
    // instead: below the recorded end, so damage.
    let seg = crashed.path().join("log").join(seg.file_name().unwrap());
    let mut flipped = image;
    flipped[off + len - 100] ^= 0x10;
    std::fs::write(&seg, &flipped).unwrap();
    let out = start_expecting_refusal(crashed.path());
    assert_refused(&out, &seg, off, &flipped);
}

/// Copies a (stopped broker's) data directory.
fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let dest = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &dest);
        } else {
            std::fs::copy(e.path(), dest).unwrap();
        }
    }
}
