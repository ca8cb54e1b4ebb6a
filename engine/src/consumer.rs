//! Consumers, their credit, and the outbox through which a queue hands
//! deliveries to the connection that owns the consumer.

use super::message::Entry;
use super::queue::Partition;
use bytes::Bytes;
use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
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
    /// Deliveries handed to this connection and not yet encoded for its
    /// socket (in the outbox or drained and waiting for room). Bounded so
    /// that a client that stops reading holds at most this many: whatever
    /// the consumers' prefetch, the rest stays in the queues (for other
    /// consumers), not with this connection. A count suffices: a waiting
    /// delivery's body is the queue's (or still in the store, read back
    /// only when encoded), and encoding stops at the write buffer's high
    /// water mark.
    unsent: AtomicU32,
    /// A consumer of this connection was refused a delivery because
    /// `unsent` was full: the connection redispatches its consumers' queues
    /// once it has written some.
    starved: AtomicBool,
}

/// Deliveries a connection may have handed to it and not yet encoded.
pub const UNSENT_MAX_COUNT: u32 = 2048;

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
            unsent: AtomicU32::new(0),
            starved: AtomicBool::new(false),
        })
    }

    /// Takes room for one delivery on the way to this connection; false
    /// (and the connection will redispatch) when full.
    fn reserve_unsent(&self) -> bool {
        // Optimistic: one atomic on the hot path, undone when over.
        if self.unsent.fetch_add(1, Ordering::AcqRel) < UNSENT_MAX_COUNT {
            return true;
        }
        self.unsent.fetch_sub(1, Ordering::AcqRel);
        // The connection may have freed room and checked `starved` between
        // our increment and this store: wake it to look again. Once per
        // starvation, not per refused message (a stalled consumer's queue
        // may refuse it on every publish).
        if !self.starved.swap(true, Ordering::SeqCst) {
            self.notify.notify_one();
        }
        false
    }

    /// `n` deliveries handed to this connection were encoded for the socket
    /// (or given back): their room is free again.
    pub(crate) fn unsent_done(&self, n: u32) {
        if n > 0 {
            let prev = self.unsent.fetch_sub(n, Ordering::AcqRel);
            debug_assert!(prev >= n, "unsent room released more than taken");
        }
    }

    /// Whether a consumer was refused for lack of room since the last call:
    /// the connection then redispatches its consumers' partitions. Call after
    /// [`Self::unsent_done`], so a refusal is either seen here or happens
    /// after the room was freed.
    pub(crate) fn take_starved(&self) -> bool {
        self.starved.swap(false, Ordering::SeqCst)
    }

    /// Deliveries handed to this connection and not yet encoded.
    pub fn unsent(&self) -> u32 {
        self.unsent.load(Ordering::Relaxed)
    }

    /// Marks the connection gone.
    pub(crate) fn close(&self) {
        self.closed.store(true, Ordering::Release);
    }

    /// Whether the connection is gone.
    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// Queues a delivery; the caller wakes the connection with [`Self::wake`]
    /// once it has pushed everything (one wake-up per batch).
    pub(crate) fn push(&self, d: Delivery) {
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

    /// Takes everything queued, deliveries onto the back of `deliveries`.
    pub(crate) fn drain_into(
        &self,
        deliveries: &mut std::collections::VecDeque<Delivery>,
        notices: &mut Vec<Notice>,
    ) {
        let mut o = self.outbox.lock();
        deliveries.extend(o.deliveries.drain(..));
        notices.append(&mut o.notices);
    }

    /// Takes everything queued.
    #[cfg(test)]
    pub(crate) fn drain(&self, deliveries: &mut Vec<Delivery>, notices: &mut Vec<Notice>) {
        let mut o = self.outbox.lock();
        deliveries.append(&mut o.deliveries);
        notices.append(&mut o.notices);
    }
}

/// Deliveries an auto-ack consumer may have queued but not yet written, so a
/// fast queue cannot fill a slow connection's memory.
pub const NO_ACK_WINDOW: u32 = 2000;

/// A subscription of one client scope (an AMQP channel) to one queue.
///
/// Created by [`crate::client::Client::subscribe`]; its fields are set once
/// and read by any partition's dispatch. The only state that changes is the
/// cancelled flag, set through [`Consumer::cancel`].
pub struct Consumer {
    /// The tag the client knows it by.
    tag: Bytes,
    /// The client scope it lives in (an AMQP channel number).
    scope: Scope,
    /// Auto-ack: deliveries are settled when written.
    no_ack: bool,
    /// Exclusive consumer.
    exclusive: bool,
    /// Consumer priority (AMQP `x-priority`; default 0): a queue offers a
    /// message to its highest-priority consumers that can take it.
    priority: i32,
    /// The owning connection.
    pub(crate) conn: Arc<ConnHandle>,
    /// Per-consumer window (for no-ack consumers: the write window).
    credit: Arc<Credit>,
    /// Scope-wide window (AMQP's global qos), if any.
    scope_credit: Option<Arc<Credit>>,
    /// The scope's flow flag: false pauses deliveries (channel.flow).
    flow_active: Arc<AtomicBool>,
    /// Set once cancelled: deliveries still in the outbox go back to the queue.
    cancelled: AtomicBool,
}

/// Which client scope a consumer or lease belongs to: an AMQP channel number
/// today; one per session for MQTT.
pub type Scope = u32;

impl Consumer {
    /// A live consumer. `scope_credit` and `flow_active` are shared by the
    /// consumers of one scope.
    #[allow(clippy::too_many_arguments)] // one constructor, called from one place
    pub(crate) fn new(
        tag: Bytes,
        scope: Scope,
        no_ack: bool,
        exclusive: bool,
        priority: i32,
        conn: Arc<ConnHandle>,
        credit: Arc<Credit>,
        scope_credit: Option<Arc<Credit>>,
        flow_active: Arc<AtomicBool>,
    ) -> Arc<Self> {
        Arc::new(Consumer {
            tag,
            scope,
            no_ack,
            exclusive,
            priority,
            conn,
            credit,
            scope_credit,
            flow_active,
            cancelled: AtomicBool::new(false),
        })
    }

    /// The engine client (connection) it belongs to.
    pub fn connection_id(&self) -> u64 {
        self.conn.id
    }

    /// Its prefetch count (0 = none).
    pub fn prefetch_count(&self) -> u32 {
        self.credit.max_count.load(Ordering::Relaxed)
    }

    /// The tag the client knows it by.
    pub fn tag(&self) -> &Bytes {
        &self.tag
    }

    /// The client scope it lives in.
    pub fn scope(&self) -> Scope {
        self.scope
    }

    /// Auto-ack: its deliveries are settled when written.
    pub fn no_ack(&self) -> bool {
        self.no_ack
    }

    /// Exclusive consumer.
    pub fn exclusive(&self) -> bool {
        self.exclusive
    }

    /// Consumer priority (higher first; 0 by default).
    pub fn priority(&self) -> i32 {
        self.priority
    }

    /// Marks it cancelled; partitions drop it at their next dispatch and its
    /// undelivered deliveries go back. Returns whether it was live before.
    pub(crate) fn cancel(&self) -> bool {
        !self.cancelled.swap(true, Ordering::AcqRel)
    }

    /// Whether it was cancelled (by its client or by its queue's deletion).
    pub fn is_cancelled(&self) -> bool {
        self.cancelled.load(Ordering::Acquire)
    }

    /// Takes credit for a message of `size` bytes from every window that
    /// applies, and room on the way to the connection. The connection's room
    /// is given back with [`ConnHandle::unsent_done`] when the delivery is
    /// encoded; the credit with [`Self::release`] when it is settled.
    pub fn try_acquire(&self, size: u32) -> bool {
        if self.is_dead() || !self.flow_active.load(Ordering::Relaxed) {
            return false;
        }
        if !self.credit.try_acquire(size) {
            return false;
        }
        if let Some(cc) = &self.scope_credit {
            if !cc.try_acquire(size) {
                self.credit.release(size);
                return false;
            }
        }
        if !self.conn.reserve_unsent() {
            self.release(size);
            return false;
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
        if let Some(cc) = &self.scope_credit {
            cc.release(size);
        }
    }
}
