//! Method replies that wait for the store, and those queued behind them.
//!
//! A declare (bind, delete…) of something durable is answered once the
//! store has made it durable. Instead of awaiting that inside event
//! handling (which stalled the whole connection: deliveries, heartbeats,
//! shutdown), the reply is queued with its [`DurableWait`] and sent when
//! durable. While anything is queued, every later method reply of the
//! connection queues behind it, so replies leave in the order the methods
//! came (a client never sees a consume-ok before the declare-ok it
//! pipelined first), and so does a channel close caused by a later method.
//! A channel's deliveries wait while any reply of that channel is queued
//! (its consume-ok; a get-ok whose delivery tag a later `multiple` ack must
//! not cover before the client saw it). While too much is queued the
//! client is not read ([`Replies::is_full`]). Replies of a channel
//! closed meanwhile are dropped: each carries its channel's epoch.

use super::failure::{hard, Failure};
use super::Session;
use crate::engine::{DurableWait, EngineError};
use bytes::BytesMut;
use std::collections::VecDeque;
use weir_protocols::amqp::methods::AMQPClass;
use weir_protocols::amqp::{codec, reply};

/// What is sent when a queued reply's turn comes.
enum Deferred {
    /// A method frame.
    Method(AMQPClass),
    /// Frames already encoded (a get-ok with its content).
    Frames(BytesMut),
    /// A channel close for a method that failed after the queued ones.
    Close {
        code: u16,
        text: String,
        class_id: u16,
        method_id: u16,
    },
}

/// One queued reply.
struct Pending {
    channel: u16,
    /// The opening of the channel it belongs to.
    epoch: u64,
    /// The method it answers (for the failure if the store fails).
    class_id: u16,
    method_id: u16,
    /// Still waiting for the store; None once durable (or never needed).
    wait: Option<DurableWait>,
    /// Set when the store could not make it durable.
    failed: Option<Failure>,
    what: Deferred,
}

/// While this many replies are queued, the connection's input is not read:
/// a client pipelining methods behind a reply that waits for the disk is
/// pushed back like one whose output is backed up.
const MAX_QUEUED_REPLIES: usize = 4096;
/// The same for the bytes of queued frames (get-oks carry their message).
const MAX_QUEUED_BYTES: usize = 4 << 20;

impl Deferred {
    /// Bytes it holds, roughly (a method frame counts as 64).
    fn size(&self) -> usize {
        match self {
            Deferred::Frames(b) => b.len(),
            _ => 64,
        }
    }
}

/// The queue of replies.
#[derive(Default)]
pub(super) struct Replies {
    queue: VecDeque<Pending>,
    /// [`Deferred::size`] of everything queued.
    bytes: usize,
}

impl Replies {
    /// Nothing queued: replies go out at once.
    pub(super) fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    /// The first reply waits for the store.
    pub(super) fn is_waiting(&self) -> bool {
        self.queue.front().is_some_and(|p| p.wait.is_some())
    }

    /// Resolves when the first reply's wait is over (cancel safe: the wait
    /// stays in place if this future is dropped).
    pub(super) async fn durable(&mut self) {
        let Some(head) = self.queue.front_mut() else {
            return std::future::pending().await;
        };
        let Some(wait) = head.wait.as_mut() else {
            return;
        };
        let r = wait.await;
        head.wait = None;
        head.failed = match r {
            Ok(r) => store_outcome(r),
            Err(_) => Some(store_stopped()),
        };
    }

    /// Too much is queued: stop reading the client until it drains.
    pub(super) fn is_full(&self) -> bool {
        self.queue.len() >= MAX_QUEUED_REPLIES || self.bytes >= MAX_QUEUED_BYTES
    }

    fn pop_front(&mut self) -> Option<Pending> {
        let p = self.queue.pop_front()?;
        self.bytes -= p.what.size();
        Some(p)
    }

    /// Whether a reply of channel `ch` is queued.
    pub(super) fn has_channel(&self, ch: u16) -> bool {
        self.queue.iter().any(|p| p.channel == ch)
    }

    pub(super) fn push_close(
        &mut self,
        channel: u16,
        epoch: u64,
        code: u16,
        text: String,
        class_id: u16,
        method_id: u16,
    ) {
        self.bytes += 64;
        self.queue.push_back(Pending {
            channel,
            epoch,
            class_id,
            method_id,
            wait: None,
            failed: None,
            what: Deferred::Close {
                code,
                text,
                class_id,
                method_id,
            },
        });
    }

    fn push(&mut self, channel: u16, epoch: u64, wait: Option<DurableWait>, what: Deferred) {
        self.bytes += what.size();
        self.queue.push_back(Pending {
            channel,
            epoch,
            class_id: 0,
            method_id: 0,
            wait,
            failed: None,
            what,
        });
    }

    /// Drops everything (the connection is closing).
    pub(super) fn clear(&mut self) {
        self.queue.clear();
        self.bytes = 0;
    }
}

/// The failure a store error makes of a queued reply.
fn store_outcome(r: Result<(), weir_backend::StoreError>) -> Option<Failure> {
    r.err().map(|e| EngineError::Store(e).into())
}

/// The store dropped the waiter without an answer.
fn store_stopped() -> Failure {
    hard(
        reply::INTERNAL_ERROR,
        "store stopped before the change was durable".into(),
    )
}

impl Session {
    /// Sends a method reply on `ch`, after the queued ones if any.
    pub(super) fn reply(&mut self, ch: u16, method: AMQPClass) {
        self.defer(ch, None, Deferred::Method(method));
    }

    /// Answers a definition change once it is durable. With `nowait` the
    /// client asked for no answer: the change becomes durable with the next
    /// fsync without holding anything up.
    pub(super) fn reply_when_durable(
        &mut self,
        ch: u16,
        nowait: bool,
        wait: Option<DurableWait>,
        method: AMQPClass,
        (class_id, method_id): (u16, u16),
    ) {
        if nowait {
            return;
        }
        if wait.is_none() {
            return self.reply(ch, method);
        }
        let Some(epoch) = self.channels.get(&ch).map(|c| c.epoch) else {
            return;
        };
        self.replies.push(ch, epoch, wait, Deferred::Method(method));
        if let Some(p) = self.replies.queue.back_mut() {
            p.class_id = class_id;
            p.method_id = method_id;
        }
    }

    /// Sends encoded frames on `ch` (a get-ok), after the queued replies.
    /// `encode` writes them into the buffer it is given.
    pub(super) fn reply_frames(&mut self, ch: u16, encode: impl FnOnce(&mut BytesMut)) {
        if self.replies.is_empty() {
            encode(self.conn.out());
            return;
        }
        let mut buf = BytesMut::new();
        encode(&mut buf);
        self.defer(ch, None, Deferred::Frames(buf));
    }

    /// Writes a publisher confirm (basic.ack or basic.nack). Behind a
    /// queued reply of its channel (a confirm.select-ok, say) it queues too.
    pub(super) fn write_confirm(&mut self, ch: u16, tag: u64, multiple: bool, nack: bool) {
        if !self.replies.has_channel(ch) {
            codec::write_confirm(self.conn.out(), ch, tag, multiple, nack);
            return;
        }
        let mut buf = BytesMut::new();
        codec::write_confirm(&mut buf, ch, tag, multiple, nack);
        self.defer(ch, None, Deferred::Frames(buf));
    }

    fn defer(&mut self, ch: u16, wait: Option<DurableWait>, what: Deferred) {
        if self.replies.is_empty() && wait.is_none() {
            self.emit(ch, what);
            return;
        }
        let Some(epoch) = self.channels.get(&ch).map(|c| c.epoch) else {
            return;
        };
        self.replies.push(ch, epoch, wait, what);
    }

    /// Sends every reply at the head of the queue whose wait is over.
    pub(super) fn send_ready_replies(&mut self) {
        while let Some(head) = self.replies.queue.front_mut() {
            if let Some(w) = head.wait.as_mut() {
                use tokio::sync::oneshot::error::TryRecvError;
                head.failed = match w.try_recv() {
                    Ok(r) => store_outcome(r),
                    Err(TryRecvError::Empty) => return,
                    Err(TryRecvError::Closed) => Some(store_stopped()),
                };
                head.wait = None;
            }
            let Some(p) = self.replies.pop_front() else {
                return;
            };
            // A reply of a channel closed (or reopened) since is dropped.
            let current = self
                .channels
                .get(&p.channel)
                .is_some_and(|c| c.epoch == p.epoch);
            if !current {
                continue;
            }
            if let Some(f) = p.failed {
                self.fail(p.channel, f, p.class_id, p.method_id);
                continue;
            }
            self.emit(p.channel, p.what);
        }
    }

    fn emit(&mut self, ch: u16, what: Deferred) {
        if let Deferred::Close {
            code,
            text,
            class_id,
            method_id,
        } = what
        {
            if self.conn.channel_is_usable(ch) {
                self.close_channel_now(ch, code, &text, class_id, method_id);
            } else {
                self.release_channel(ch);
            }
            return;
        }
        if !self.conn.channel_is_usable(ch) {
            return;
        }
        match what {
            Deferred::Method(m) => self.conn.send_method(ch, m),
            Deferred::Frames(b) => self.conn.out().extend_from_slice(&b),
            Deferred::Close { .. } => {}
        }
    }
}
