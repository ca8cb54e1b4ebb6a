//! Resource monitors: two threads (not tasks, so a connection that keeps
//! the runtime's workers busy, a publisher flooding us, cannot delay the
//! alarm that stops it) sample resident memory and the data directory's
//! free space, and set or clear the [`Alarms`] every session watches; and
//! the heap trims that hand freed memory back to the system.

use super::{Alarms, Services};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The resource watermarks the monitors check.
#[derive(Clone, Debug)]
pub(super) struct Limits {
    pub(super) memory: u64,
    pub(super) disk_free: u64,
    pub(super) data_dir: PathBuf,
}

/// Starts the memory and disk monitors; they stop once `stop` is set.
pub(super) fn start(
    services: &Arc<Services>,
    limits: &Limits,
    stop: &Arc<AtomicBool>,
) -> [Option<JoinHandle<()>>; 2] {
    [
        spawn_monitor("weir-memory", stop.clone(), {
            let (services, limit) = (services.clone(), limits.memory);
            move |stop| monitor_memory(&services, limit, stop)
        }),
        spawn_monitor("weir-disk", stop.clone(), {
            let (services, limits) = (services.clone(), limits.clone());
            move |stop| monitor_disk(&services, &limits.data_dir, limits.disk_free, stop)
        }),
    ]
}

/// Recovery builds large temporary indexes (every live message of every
/// partition) out of many small allocations; once they are freed, glibc keeps
/// the fragmented heap, and a restarted broker would hold far more memory than
/// the same broker before the restart. Hand the free pages back.
pub(super) fn release_recovery_memory() {
    trim_heap();
}

/// How often resident memory is sampled.
const MEMORY_SAMPLE: Duration = Duration::from_millis(150);
/// How often free disk space is sampled.
const DISK_SAMPLE: Duration = Duration::from_secs(1);
/// While the memory alarm is set, the heap is trimmed at most this often.
const TRIM_IN_ALARM: Duration = Duration::from_secs(1);
/// Outside alarms, how often the heap's free memory is checked for a trim.
const TRIM_CHECK: Duration = Duration::from_secs(5);
/// Free heap memory worth handing back without being asked.
const TRIM_FREE_MIN: usize = 64 << 20;

/// Starts a monitor thread; `None` (logged) if the thread cannot be created.
fn spawn_monitor(
    name: &str,
    stop: Arc<AtomicBool>,
    f: impl FnOnce(&AtomicBool) + Send + 'static,
) -> Option<std::thread::JoinHandle<()>> {
    match std::thread::Builder::new()
        .name(name.into())
        .spawn(move || f(&stop))
    {
        Ok(h) => Some(h),
        Err(e) => {
            tracing::error!(error = %e, thread = name, "cannot start a resource monitor");
            None
        }
    }
}

/// Samples the process's resident memory and sets or clears the memory
/// alarm; hands freed heap memory back to the system after large frees.
fn monitor_memory(shared: &Services, limit: u64, stop: &AtomicBool) {
    tracing::info!(limit_bytes = limit, "memory watermark");
    let mut last_trim = Instant::now();
    let mut last_check = Instant::now();
    while !stop.load(Ordering::Relaxed) {
        let Some(mut rss) = resident_bytes() else {
            std::thread::sleep(MEMORY_SAMPLE);
            continue;
        };
        // glibc keeps freed memory: trim when someone freed a lot (purge,
        // delete), while over the watermark (so the alarm can clear once
        // consumers drained the queues), or when much of the heap is free.
        // At most once a second: a trim walks the whole heap.
        let may_trim = last_trim.elapsed() >= TRIM_IN_ALARM;
        let asked = may_trim && shared.trim_wanted.swap(false, Ordering::Relaxed);
        let due = (rss > limit && may_trim)
            || (last_check.elapsed() >= TRIM_CHECK && {
                last_check = Instant::now();
                heap_free_bytes() >= TRIM_FREE_MIN
            });
        if asked || due {
            last_trim = Instant::now();
            trim_heap();
            rss = resident_bytes().unwrap_or(rss);
        }
        set_alarm(shared, |a| &mut a.memory, rss > limit, "memory", rss, limit);
        std::thread::sleep(MEMORY_SAMPLE);
    }
}

/// Samples the free space of the data directory's filesystem and sets or
/// clears the disk alarm.
fn monitor_disk(shared: &Services, dir: &std::path::Path, limit: u64, stop: &AtomicBool) {
    tracing::info!(limit_bytes = limit, "free-disk watermark");
    let mut last = Instant::now()
        .checked_sub(DISK_SAMPLE)
        .unwrap_or_else(Instant::now);
    while !stop.load(Ordering::Relaxed) {
        // Short sleeps so shutdown does not wait a whole sample period.
        if last.elapsed() < DISK_SAMPLE {
            std::thread::sleep(MEMORY_SAMPLE);
            continue;
        }
        last = Instant::now();
        let Ok(free) = weir_backend::free_bytes(dir) else {
            continue;
        };
        set_alarm(shared, |a| &mut a.disk, free < limit, "disk", free, limit);
    }
}

/// Sets or clears one alarm (`field` of [`Alarms`]) and logs the change:
/// WARN when it is set, INFO when it clears. `reading` is the measured
/// value (resident or free bytes) and `limit` the watermark.
fn set_alarm(
    shared: &Services,
    field: fn(&mut Alarms) -> &mut bool,
    on: bool,
    what: &str,
    reading: u64,
    limit: u64,
) {
    let mut changed = false;
    shared.alarms.send_if_modified(|a| {
        let flag = field(a);
        changed = *flag != on;
        *flag = on;
        changed
    });
    if changed && on {
        tracing::warn!(
            reading_bytes = reading,
            limit_bytes = limit,
            "{what} alarm set: publishers blocked"
        );
    } else if changed {
        tracing::info!(
            reading_bytes = reading,
            limit_bytes = limit,
            "{what} alarm cleared: publishers unblocked"
        );
    }
}

/// Resident memory of this process (`/proc/self/statm`, second field, in pages).
pub(crate) fn resident_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = s.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * page_size())
}

fn page_size() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 {
        p as u64
    } else {
        4096
    }
}

/// Free bytes inside the heap's arenas (memory glibc holds but no one uses).
fn heap_free_bytes() -> usize {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallinfo2 only reads allocator statistics.
        let m = unsafe { libc::mallinfo2() };
        m.fordblks
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        0
    }
}

/// Pins glibc's mmap threshold at 1 MiB (unless `MALLOC_MMAP_THRESHOLD_`
/// is set). glibc raises the threshold to the size of any mmapped chunk that
/// is freed; one argon2 verification (19 MiB) at the first login would move
/// it to 19 MiB, and from then on a growing queue's ready list (a 15 MiB
/// buffer at 256k entries) comes from the heap and stays there once freed:
/// measured, 78 instead of 61 bytes of RSS per queued message at 1M. A
/// fixed threshold keeps buffers of 1 MiB and more in their own mappings,
/// returned to the system when freed. Call once at startup.
pub fn pin_mmap_threshold() {
    if std::env::var_os("MALLOC_MMAP_THRESHOLD_").is_some() {
        return;
    }
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes an allocator tunable; called before the
    // runtime starts, and glibc serialises it with allocations anyway.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 20);
    }
}

/// Returns free heap pages to the system.
fn trim_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only releases free heap memory; no pointers change.
    unsafe {
        libc::malloc_trim(0);
    }
}
