//! Consumers, their credit, and the outbox through which a queue hands
//! deliveries to the connection that owns the consumer.

use super::message::Entry;
use super::queue::Partition;
use bytes::Bytes;
use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use tokio::sync::Notify;
pub use weir_quota::Credit;

/// A delivery on its way from a partition to a connection.
pub struct Delivery {
    /// Who receives it.
    pub consumer: Arc<Consumer>,
    /// Where it came from (for the lease).
    pub partition: Arc<Partition>,
    /// The entry.
    pub entry: Entry,
}

/// Something the engine tells a connection asynchronously.
pub enum Notice {
    /// The consumer's queue was deleted: send basic.cancel.
    ConsumerCancelled {
        /// The consumer (compared by identity: its channel may since have
        /// reused the tag for another consumer).
        consumer: Arc<Consumer>,
    },
}

/// The engine's handle on one client connection: deliveries and notices are
/// pushed here by whichever task routed the message, and the connection's task
/// drains them all at once on one wake-up.
pub struct ConnHandle {
    /// Unique connection id (exclusive-queue ownership).
    pub id: u64,
    /// Set when the connection is gone: its consumers take no more deliveries.
    closed: AtomicBool,
    outbox: Mutex<Outbox>,
    notify: Notify,
}

#[derive(Default)]
struct Outbox {
    deliveries: Vec<Delivery>,
    notices: Vec<Notice>,
}

impl ConnHandle {
    /// A handle for connection `id`.
    pub fn new(id: u64) -> Arc<Self> {
        Arc::new(ConnHandle {
            id,
            closed: AtomicBool::new(false),
            outbox: Mutex::new(Outbox::default()),
            notify: Notify::new(),
        })
    }

    /// Marks the connection gone.
    pub fn close(&self) {
        self.closed.store(true, Ordering::Release);
    }

    /// Whether the connection is gone.
    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// Queues a delivery; the caller wakes the connection with [`Self::wake`]
    /// once it has pushed everything (one wake-up per batch).
    pub fn push(&self, d: Delivery) {
        self.outbox.lock().deliveries.push(d);
    }

    /// Queues a notice and wakes the connection.
    pub fn notice(&self, n: Notice) {
        self.outbox.lock().notices.push(n);
        self.notify.notify_one();
    }

    /// Wakes the connection's task.
    pub fn wake(&self) {
        self.notify.notify_one();
    }

    /// Resolves when something was pushed since the last drain.
    pub async fn notified(&self) {
        self.notify.notified().await
    }

    /// Takes everything queued.
    pub fn drain(&self, deliveries: &mut Vec<Delivery>, notices: &mut Vec<Notice>) {
        let mut o = self.outbox.lock();
        deliveries.append(&mut o.deliveries);
        notices.append(&mut o.notices);
    }
}

/// Deliveries an auto-ack consumer may have queued but not yet written, so a
/// fast queue cannot fill a slow connection's memory.
pub const NO_ACK_WINDOW: u32 = 2000;

/// A subscription of one channel to one queue.
pub struct Consumer {
    /// The tag the client knows it by.
    pub tag: Bytes,
    /// The channel it lives on.
    pub channel: u16,
    /// Auto-ack: deliveries are settled when written.
    pub no_ack: bool,
    /// Exclusive consumer.
    pub exclusive: bool,
    /// The owning connection.
    pub conn: Arc<ConnHandle>,
    /// Per-consumer window (for no-ack consumers: the write window).
    pub credit: Arc<Credit>,
    /// Channel-wide window (global qos), if any.
    pub channel_credit: Option<Arc<Credit>>,
    /// channel.flow(active=false) pauses deliveries.
    pub flow_active: Arc<AtomicBool>,
    /// Set once cancelled: deliveries still in the outbox go back to the queue.
    pub cancelled: AtomicBool,
}

impl Consumer {
    /// Takes credit for a message of `size` bytes from every window that applies.
    pub fn try_acquire(&self, size: u32) -> bool {
        if self.is_dead() || !self.flow_active.load(Ordering::Relaxed) {
            return false;
        }
        if !self.credit.try_acquire(size) {
            return false;
        }
        if let Some(cc) = &self.channel_credit {
            if !cc.try_acquire(size) {
                self.credit.release(size);
                return false;
            }
        }
        true
    }

    /// Cancelled, or its connection is gone: detach it.
    pub fn is_dead(&self) -> bool {
        self.cancelled.load(Ordering::Acquire) || self.conn.is_closed()
    }

    /// Gives back the credit of one settled (or returned) delivery.
    pub fn release(&self, size: u32) {
        self.credit.release(size);
        if let Some(cc) = &self.channel_credit {
            cc.release(size);
        }
    }
}
