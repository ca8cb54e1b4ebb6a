//! What the store reports through the `metrics` facade: a few figures per
//! commit round (never per record), recorded into whatever recorder the
//! process installed (the gateway's Prometheus exporter; none in tests,
//! where each call is a no-op). The names are the store's contract with
//! dashboards (docs/metrics.md).

use std::time::Duration;

/// Histogram: seconds one `fdatasync` of the head segment took.
pub const FSYNC_SECONDS: &str = "weir_store_fsync_seconds";
/// Histogram: waiters (confirm barriers, declares) completed by one
/// synced commit round: how many commits one fsync served.
pub const COMMIT_BATCH_WAITERS: &str = "weir_store_group_commit_waiters";
/// Histogram: bytes written by one commit round.
pub const COMMIT_BATCH_BYTES: &str = "weir_store_group_commit_bytes";
/// Counter: compaction passes that moved records.
pub const COMPACTIONS: &str = "weir_store_compactions_total";
/// Counter: records moved by compaction.
pub const COMPACTED_RECORDS: &str = "weir_store_compacted_records_total";

/// One fsync took `took`.
pub(crate) fn fsync(took: Duration) {
    metrics::histogram!(FSYNC_SECONDS).record(took.as_secs_f64());
}

/// One commit round wrote `bytes` and completed `waiters`.
pub(crate) fn commit_round(waiters: usize, bytes: usize) {
    if waiters > 0 {
        metrics::histogram!(COMMIT_BATCH_WAITERS).record(waiters as f64);
    }
    metrics::histogram!(COMMIT_BATCH_BYTES).record(bytes as f64);
}

/// A compaction pass moved `records`.
pub(crate) fn compacted(records: usize) {
    if records > 0 {
        metrics::counter!(COMPACTIONS).increment(1);
        metrics::counter!(COMPACTED_RECORDS).increment(records as u64);
    }
}
