//! Helpers shared by the `hardening_*` tests: process memory, a small
//! tmpfs for disk-full cases, durable queues, bounded polling and the raw
//! frames those tests pipeline.

use std::future::Future;
use std::path::Path;
use std::time::{Duration, Instant};

use lapin::options::QueueDeclareOptions;
use lapin::types::FieldTable;

use crate::raw::{self, Frame};
use crate::Broker;

/// Resident memory of a process, from /proc/<pid>/status (VmRSS).
pub fn rss_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .expect("VmRSS line");
    kb * 1024
}

/// Resident memory of a running broker.
pub fn broker_rss(b: &Broker) -> u64 {
    rss_bytes(b.pid().expect("broker running"))
}

/// A small tmpfs, unmounted on drop.
pub struct Tmpfs {
    dir: tempfile::TempDir,
}

impl Tmpfs {
    /// Mounts a tmpfs of `size` (e.g. "64m"); `None`, with a SKIPPED line,
    /// where it cannot be mounted (needs root): the caller skips the test.
    pub fn mount(size: &str) -> Option<Tmpfs> {
        let dir = tempfile::tempdir().expect("tempdir");
        let out = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir.path())
            .output()
            .ok()?;
        if !out.status.success() {
            eprintln!(
                "SKIPPED: cannot mount a tmpfs (needs root): {}",
                String::from_utf8_lossy(&out.stderr)
            );
            return None;
        }
        Some(Tmpfs { dir })
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(self.dir.path())
            .status();
    }
}

/// Declares a durable queue.
pub async fn declare_durable(ch: &lapin::Channel, name: &str) {
    ch.queue_declare(
        name.into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .unwrap_or_else(|e| panic!("declaring {name}: {e}"));
}

/// Waits (bounded) until `probe` returns true, polling every 50 ms; panics
/// with `what` after `timeout`.
pub async fn wait_until<F, Fut>(what: &str, timeout: Duration, mut probe: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    while !probe().await {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Splits one whole frame off the front of `buf`: the frame and its length
/// on the wire, `None` while it is incomplete. Panics on a missing
/// frame-end octet.
pub fn split_frame(buf: &[u8]) -> Option<(Frame, usize)> {
    if buf.len() < 7 {
        return None;
    }
    let size = u32::from_be_bytes([buf[3], buf[4], buf[5], buf[6]]) as usize;
    if buf.len() < 8 + size {
        return None;
    }
    assert_eq!(
        buf[7 + size],
        raw::FRAME_END,
        "server frame lacks frame-end"
    );
    let f = Frame {
        kind: buf[0],
        channel: u16::from_be_bytes([buf[1], buf[2]]),
        payload: buf[7..7 + size].to_vec(),
    };
    Some((f, 8 + size))
}

/// basic.publish + content header + one body frame of `body` on `ch`.
pub fn publish_frames(ch: u16, exchange: &str, key: &str, body: &[u8]) -> Vec<u8> {
    let mut v = raw::basic_publish(ch, exchange, key);
    v.extend(raw::content_header(ch, body.len() as u64));
    v.extend(raw::body(ch, body));
    v
}

/// The delivery tag of a basic.ack frame.
pub fn ack_tag(f: &Frame) -> u64 {
    assert_eq!(f.method(), Some((60, 80)), "not a basic.ack: {f:?}");
    u64::from_be_bytes(f.payload[4..12].try_into().expect("8 bytes"))
}

/// The message count of a queue.declare-ok frame.
pub fn declare_ok_count(f: &Frame) -> u32 {
    assert_eq!(f.method(), Some((50, 11)), "not a queue.declare-ok: {f:?}");
    let name_len = f.payload[4] as usize;
    let at = 5 + name_len;
    u32::from_be_bytes(f.payload[at..at + 4].try_into().expect("4 bytes"))
}
