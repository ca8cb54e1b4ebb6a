//! Damage at the end of the newest log segment (what a crash mid-write
//! leaves): the broker truncates it, says so, and keeps every confirmed
//! message.

use lapin::options::*;
use lapin::types::FieldTable;
use std::fs::OpenOptions;
use std::io::Write;
use std::path::{Path, PathBuf};
use weir_tests::*;

const TRUNCATION_WARNING: &str = "truncating torn or corrupt tail of the last log segment";
const ENGINE_WARNING: &str = "store dropped an unconfirmed torn tail at recovery";
const N: usize = 20;

/// The newest `*.seg` file.
fn newest_segment(data_dir: &Path) -> PathBuf {
    let mut segs: Vec<PathBuf> = std::fs::read_dir(data_dir.join("log"))
        .expect("log dir")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "seg"))
        .collect();
    segs.sort();
    segs.pop().expect("no segment files")
}

/// Record boundaries `(offset, total_len)` of a segment: after the 16-byte
/// segment header (magic, format version), `[u32 LE len][u32 LE crc32c][payload]`.
fn records(buf: &[u8]) -> Vec<(usize, usize)> {
    assert_eq!(&buf[..8], b"WEIRSEG\0", "segment header");
    let mut out = Vec::new();
    let mut off = 16;
    while off + 8 <= buf.len() {
        let len = u32::from_le_bytes(buf[off..off + 4].try_into().unwrap()) as usize;
        if off + 8 + len > buf.len() {
            break;
        }
        out.push((off, 8 + len));
        off += 8 + len;
    }
    assert_eq!(off, buf.len(), "segment does not end on a record boundary");
    out
}

/// Runs a broker on `dir`, publishes N persistent confirmed messages to a
/// durable queue and stops it cleanly.
async fn publish_and_stop(broker: &mut Broker) {
    let conn = connect(&broker.url()).await;
    let ch = confirm_channel(&conn).await;
    ch.queue_declare(
        "tt".into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .unwrap();
    for i in 0..N {
        publish_confirmed(&ch, "", "tt", format!("m{i:03}").as_bytes(), persistent()).await;
    }
    conn.close(200, "bye".into()).await.unwrap();
    broker.stop();
}

async fn bodies(broker: &Broker) -> Vec<String> {
    let conn = connect(&broker.url()).await;
    let ch = conn.create_channel().await.unwrap();
    let mut out = Vec::new();
    while let Some(m) = ch
        .basic_get("tt".into(), BasicGetOptions::default())
        .await
        .unwrap()
    {
        out.push(String::from_utf8(m.delivery.data.clone()).unwrap());
        m.delivery.ack(BasicAckOptions::default()).await.unwrap();
    }
    // Round trip on the channel so the acks are in before we return.
    assert_eq!(queue_len(&ch, "tt").await, 0);
    conn.close(200, "bye".into()).await.unwrap();
    out
}

fn expected(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("m{i:03}")).collect()
}

/// Appends `tail` to the newest segment, restarts, and checks recovery.
async fn appended_tail_is_truncated(tail: &[u8]) {
    let dir = tempfile::tempdir().unwrap();
    let mut broker = Broker::start_in(dir.path());
    publish_and_stop(&mut broker).await;

    let seg = newest_segment(dir.path());
    let clean_len = std::fs::metadata(&seg).unwrap().len();
    OpenOptions::new()
        .append(true)
        .open(&seg)
        .unwrap()
        .write_all(tail)
        .unwrap();

    broker.restart();
    let log = broker.run_logs();
    assert!(
        log.contains(TRUNCATION_WARNING),
        "no truncation warning:\n{log}"
    );
    assert!(log.contains(ENGINE_WARNING), "no engine warning:\n{log}");
    assert_eq!(
        std::fs::metadata(&seg).unwrap().len(),
        clean_len,
        "the damaged tail of {} was not cut back to the last good record",
        seg.display()
    );
    assert_eq!(
        bodies(&broker).await,
        expected(N),
        "every confirmed message, in order"
    );

    // The store keeps working after the repair, across another restart.
    let conn = connect(&broker.url()).await;
    let ch = confirm_channel(&conn).await;
    publish_confirmed(&ch, "", "tt", b"after", persistent()).await;
    conn.close(200, "bye".into()).await.unwrap();
    broker.stop();
    broker.restart();
    assert!(
        !broker.run_logs().contains(TRUNCATION_WARNING),
        "clean restart reported damage"
    );
    assert_eq!(bodies(&broker).await, ["after"]);
    broker.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partial_record_header_is_truncated() {
    // Half a frame header.
    appended_tail_is_truncated(&[0x10, 0x00, 0x00]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partial_record_payload_is_truncated() {
    // A header announcing 200 bytes, and only 50 of them.
    let mut tail = 200u32.to_le_bytes().to_vec();
    tail.extend_from_slice(&0xdead_beefu32.to_le_bytes());
    tail.extend_from_slice(&[0xab; 50]);
    appended_tail_is_truncated(&tail).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn complete_record_with_bad_checksum_is_truncated() {
    // Fully written, wrong crc32c.
    let payload = [0x5a_u8; 64];
    let mut tail = (payload.len() as u32).to_le_bytes().to_vec();
    tail.extend_from_slice(&0x0bad_c0deu32.to_le_bytes());
    tail.extend_from_slice(&payload);
    appended_tail_is_truncated(&tail).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_garbage_tail_is_truncated() {
    use rand::RngCore;
    let mut tail = vec![0u8; 4096];
    rand::thread_rng().fill_bytes(&mut tail);
    appended_tail_is_truncated(&tail).await;
}

/// Zeroes the durable end a segment header records (bytes 12..16): a
/// segment written before the field existed.
fn forget_recorded_end(buf: &mut [u8]) {
    buf[12..16].fill(0);
}

/// In a segment without a recorded end (older data directories) a bad last
/// record is still taken for a torn tail, as before. (With one, after a
/// clean stop, it is damage: `hardening_torn.rs`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flipped_byte_in_last_record_of_an_older_segment_is_truncated() {
    let dir = tempfile::tempdir().unwrap();
    let mut broker = Broker::start_in(dir.path());
    publish_and_stop(&mut broker).await;

    let seg = newest_segment(dir.path());
    let mut buf = std::fs::read(&seg).unwrap();
    let recs = records(&buf);
    let &(off, len) = recs.last().expect("newest segment has no records");
    // Flip a byte in the middle of the last record's payload.
    let at = off + 8 + (len - 8) / 2;
    eprintln!(
        "{}: {} records, damaging the last ({len} bytes at offset {off})",
        seg.display(),
        recs.len()
    );
    buf[at] ^= 0xff;
    assert_ne!(&buf[12..16], [0; 4], "a clean stop records the end");
    forget_recorded_end(&mut buf);
    std::fs::write(&seg, &buf).unwrap();

    broker.restart();
    let log = broker.run_logs();
    assert!(
        log.contains(TRUNCATION_WARNING),
        "no truncation warning:\n{log}"
    );
    assert_eq!(
        std::fs::metadata(&seg).unwrap().len(),
        off as u64,
        "cut at the damaged record"
    );
    let got = bodies(&broker).await;
    // The damaged record may have been the last publish; everything before
    // it is intact, in order, and nothing else appears.
    eprintln!("{} of {N} messages recovered", got.len());
    assert!(
        got.len() >= N - 1,
        "lost more than the damaged record: {got:?}"
    );
    assert_eq!(got, expected(got.len()));
    broker.stop();
}
