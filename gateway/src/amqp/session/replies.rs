//! Method replies that wait for the store, and those queued behind them.
//!
//! A declare (bind, delete…) of something durable is answered once the
//! store has made it durable. Instead of awaiting that inside event
//! handling (which stalled the whole connection: deliveries, heartbeats,
//! shutdown), the reply is queued with its [`Ticket`] and sent by the turn
//! that finds it durable. While anything is queued, every later method reply of the
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
use crate::engine::DurableWait;
use crate::session::durable::{NotDurable, Status, Ticket};
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
    /// What it waits for ([`Ticket::NONE`]: only for the replies before it).
    ticket: Ticket,
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
            ticket: Ticket::NONE,
            what: Deferred::Close {
                code,
                text,
                class_id,
                method_id,
            },
        });
    }

    fn push(&mut self, channel: u16, epoch: u64, ticket: Ticket, what: Deferred) {
        self.bytes += what.size();
        self.queue.push_back(Pending {
            channel,
            epoch,
            class_id: 0,
            method_id: 0,
            ticket,
            what,
        });
    }

    /// Drops everything (the connection is closing).
    pub(super) fn clear(&mut self) {
        self.queue.clear();
        self.bytes = 0;
    }
}

/// The failure of a reply the store could not make durable.
fn not_durable() -> Failure {
    hard(reply::INTERNAL_ERROR, NotDurable.to_string())
}

impl Session {
    /// Sends a method reply on `ch`, after the queued ones if any.
    pub(super) fn reply(&mut self, ch: u16, method: AMQPClass) {
        self.defer(ch, Deferred::Method(method));
    }

    /// Answers a definition change once it is durable (`wait`: what the
    /// engine reported for it). With `nowait` the client asked for no
    /// answer: the change becomes durable with the next fsync without
    /// holding anything up.
    pub(super) fn reply_when_durable(
        &mut self,
        ch: u16,
        nowait: bool,
        wait: Option<DurableWait>,
        method: AMQPClass,
        ids: (u16, u16),
    ) {
        if nowait {
            return;
        }
        let ticket = self.durability.after(wait);
        self.reply_after(ch, ticket, method, ids);
    }

    /// Answers once `ticket` is durable (and after the queued replies).
    pub(super) fn reply_after(
        &mut self,
        ch: u16,
        ticket: Ticket,
        method: AMQPClass,
        (class_id, method_id): (u16, u16),
    ) {
        if ticket.is_none() {
            return self.reply(ch, method);
        }
        let Some(epoch) = self.channels.get(&ch).map(|c| c.epoch) else {
            return;
        };
        self.replies
            .push(ch, epoch, ticket, Deferred::Method(method));
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
        self.defer(ch, Deferred::Frames(buf));
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
        self.defer(ch, Deferred::Frames(buf));
    }

    /// Sends at once, or behind the queued replies.
    fn defer(&mut self, ch: u16, what: Deferred) {
        if self.replies.is_empty() {
            self.emit(ch, what);
            return;
        }
        let Some(epoch) = self.channels.get(&ch).map(|c| c.epoch) else {
            return;
        };
        self.replies.push(ch, epoch, Ticket::NONE, what);
    }

    /// Sends every reply at the head of the queue whose ticket is settled.
    pub(super) fn send_ready_replies(&mut self) {
        while let Some(head) = self.replies.queue.front() {
            let failed = match self.durability.status(head.ticket) {
                Status::Pending => return,
                Status::Durable => false,
                Status::Failed => true,
            };
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
            if failed {
                self.fail(p.channel, not_durable(), p.class_id, p.method_id);
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
