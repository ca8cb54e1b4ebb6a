//! Per-queue figures for the management API and metrics, read at request
//! time from what the partitions already keep: counts and bytes (kept with
//! the ready lists), the head's enqueue time, the ready messages' delivery
//! attempts by bucket, and monotonic counters (relaxed atomics).
//!
//! Two reads, by cost:
//! * [`crate::queue::Queue::counters`]: atomics only, no lock. What a
//!   sampler computing rates (and mean latency: the wait summed over
//!   deliveries), or a scrape over 100,000 queues, reads.
//! * [`crate::queue::Queue::stats`]: counters plus each partition's lock
//!   taken once, briefly (no walk over messages): depth, bytes, oldest
//!   message, attempts histogram, delayed messages, consumers.
//!
//! Rates are not kept here: a reader takes two [`QueueCounters`] samples
//! over time and divides (the gateway's sampler does).

/// Upper bounds (inclusive) of the delivery-attempt buckets: a message
/// delivered `n` times so far falls in the first bucket whose bound is
/// ≥ `n`. 0 is "never delivered"; the last bucket takes everything above
/// 20.
pub const ATTEMPT_BUCKETS: [u16; 8] = [0, 1, 2, 3, 5, 10, 20, u16::MAX];

/// The bucket of [`ATTEMPT_BUCKETS`] a count of attempts falls in.
pub fn attempt_bucket(attempts: u16) -> usize {
    ATTEMPT_BUCKETS
        .iter()
        .position(|&b| attempts <= b)
        .unwrap_or(ATTEMPT_BUCKETS.len() - 1)
}

/// A queue's monotonic counters since the broker started (or since the
/// queue was declared), summed over its partitions. Cheap: atomics only.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct QueueCounters {
    /// Messages enqueued (published or dead-lettered into it, requeues not
    /// counted).
    pub published: u64,
    /// Deliveries to consumers and `basic.get`s.
    pub delivered: u64,
    /// Deliveries acknowledged.
    pub acked: u64,
    /// Deliveries that were redeliveries.
    pub redelivered: u64,
    /// Messages that left it dead (rejected without requeue with a
    /// dead-letter exchange, expired, over a length or delivery limit),
    /// whether or not a dead-letter exchange took them.
    pub dead_lettered: u64,
    /// Of `dead_lettered`, those that expired (TTL).
    pub expired: u64,
    /// Sum over deliveries (consumers' and `basic.get`s) of the time each
    /// message had waited in the queue, ms: the difference of two samples
    /// over the difference of `delivered` is the mean enqueue-to-delivery
    /// latency between them.
    pub waited_ms: u64,
    /// Ready messages now (a gauge, read with the counters: its change
    /// between samples is RabbitMQ's `messages_ready_details` rate).
    pub ready: u64,
    /// Delivered, unsettled messages now (a gauge, as `ready`).
    pub leased: u64,
}

/// A snapshot of one queue, as the management API and metrics report it.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct QueueStats {
    /// Ready messages.
    pub ready: u64,
    /// Bytes of ready messages (bodies and properties as stored).
    pub ready_bytes: u64,
    /// Delivered, unsettled messages.
    pub leased: u64,
    /// Bytes of delivered, unsettled messages.
    pub leased_bytes: u64,
    /// Messages held back until a later time (delayed messages and delayed
    /// retries); not ready.
    pub delayed: u64,
    /// Consumers attached.
    pub consumers: u32,
    /// When the oldest ready message (over all partitions) was enqueued,
    /// ms since the epoch. After a restart, recovered messages count from
    /// the recovery.
    pub oldest_enqueued_ms: Option<u64>,
    /// Ready messages by delivery attempts so far, one count per bucket of
    /// [`ATTEMPT_BUCKETS`].
    pub attempts: [u64; ATTEMPT_BUCKETS.len()],
    /// Monotonic counters.
    pub counters: QueueCounters,
}

impl QueueStats {
    /// Total messages: ready and unacknowledged (RabbitMQ's `messages`).
    pub fn messages(&self) -> u64 {
        self.ready + self.leased
    }

    /// Age of the oldest ready message at `now_ms`, in ms (0 if none).
    pub fn oldest_age_ms(&self, now_ms: u64) -> u64 {
        self.oldest_enqueued_ms
            .map_or(0, |t| now_ms.saturating_sub(t))
    }

    /// The upper bound of the highest non-empty attempts bucket: the most
    /// attempts any ready message has had (exact up to 3; "at most" above).
    /// 0 when nothing is ready or nothing was delivered before.
    pub fn attempts_max(&self) -> u16 {
        self.attempts
            .iter()
            .rposition(|&n| n > 0)
            .map_or(0, |i| ATTEMPT_BUCKETS[i])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets() {
        assert_eq!(attempt_bucket(0), 0);
        assert_eq!(attempt_bucket(1), 1);
        assert_eq!(attempt_bucket(4), 4);
        assert_eq!(attempt_bucket(5), 4);
        assert_eq!(attempt_bucket(6), 5);
        assert_eq!(attempt_bucket(21), 7);
        assert_eq!(attempt_bucket(u16::MAX), 7);
    }
}
