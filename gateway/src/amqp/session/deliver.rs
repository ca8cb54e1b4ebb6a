//! What goes to the client without being asked for in the same breath:
//! deliveries (encoded straight into the write buffer), consumer cancel
//! notices, and publisher confirms.

use super::{channel_of, Session};
use crate::engine::consumer::Notice;
use crate::session::durable::{Status, Ticket};
use crate::session::DELIVERY_HIGH_WATER;
use std::time::Instant;
use weir_protocols::amqp::codec;
use weir_protocols::amqp::methods::{basic, AMQPClass};

/// A confirm of a channel's publishes up to `tag`, waiting for its ticket.
pub(super) struct PendingConfirm {
    channel: u16,
    /// Which opening of the channel number the publishes belong to: a
    /// confirm for a closed channel must not reach a reopened one.
    epoch: u64,
    tag: u64,
    /// What it waits for.
    ticket: Ticket,
    /// Publishes it confirms, and when their batch ended (latency).
    count: u64,
    since: Instant,
}

impl Session {
    /// Encodes deliveries into the write buffer until it reaches
    /// [`DELIVERY_HIGH_WATER`]; the rest wait (bodies not read back, not
    /// encoded) for the socket to drain. What waits is bounded by the
    /// connection's unsent window: past it the messages stay in their queues.
    ///
    /// Returns whether it stopped at the high-water mark with deliveries
    /// (or replies) left: once the buffer drains below it, the driver must
    /// come back for them by itself. They were already taken from the
    /// outbox (no wake-up is pending for them), they hold their consumer's
    /// credit (the queue pushes nothing more), and a no-ack consumer sends
    /// nothing that would wake us.
    pub(super) fn write_deliveries(&mut self) -> bool {
        let Some(client) = self.client.as_mut() else {
            return false;
        };
        client.drain(&mut self.notices);
        for n in std::mem::take(&mut self.notices) {
            let Notice::ConsumerCancelled { consumer } = n;
            let channel = channel_of(consumer.scope());
            if self.conn.channel_is_usable(channel) {
                let tag = String::from_utf8_lossy(consumer.tag()).into_owned();
                self.reply(
                    channel,
                    AMQPClass::Basic(basic::AMQPMethod::Cancel(basic::Cancel {
                        consumer_tag: tag.as_str().into(),
                        nowait: true,
                    })),
                );
            }
        }
        let Some(client) = self.client.as_mut() else {
            return false;
        };
        let frame_max = self.conn.frame_max();
        // Converts headers of other protocols' messages (AMQP ones pass through).
        let codecs = self.engine.codecs();
        // One clock read per batch, not per delivery.
        let batch_time = Instant::now();
        let batch_ms = client.clock().now_ms();
        while self.conn.out().len() < DELIVERY_HIGH_WATER {
            let Some(d) = client.next_delivery() else {
                break;
            };
            let ch = channel_of(d.consumer.scope());
            let chan = if self.conn.channel_is_usable(ch) && !d.consumer.is_cancelled() {
                self.channels.get_mut(&ch).filter(|c| !c.failed)
            } else {
                None
            };
            let Some(c) = chan else {
                client.unsend(d);
                continue;
            };
            if !self.replies.is_empty() && self.replies.has_channel(ch) {
                // A reply of this channel (a consume-ok, a get-ok and its
                // delivery tag, a declare-ok) waits behind a durable one:
                // the channel's deliveries wait too, in order, so a tag is
                // never acked (say, `multiple`) before the client saw it;
                // other channels' deliveries go on.
                self.held.push(d);
                continue;
            }
            let Some(message) = client.message_of(&d) else {
                // Unreadable (the store reported why): dropped.
                client.discard(d);
                continue;
            };
            c.delivery_tag += 1;
            let tag = c.delivery_tag;
            let out = self.conn.out();
            codec::write_deliver(
                out,
                ch,
                d.consumer.tag(),
                tag,
                d.entry.redelivered,
                &message.exchange,
                &message.routing_key,
            );
            let properties = crate::amqp::headers::amqp_properties(&message, &codecs);
            codec::write_content(out, ch, &properties, &message.body, frame_max);
            if let Some(m) = self.metrics.as_mut() {
                m.delivered(d.entry.enqueued_ms, batch_ms);
            }
            client.lease(d.consumer.scope(), tag, d, batch_time, batch_ms);
        }
        // Stopped by the high-water mark with deliveries in hand (not the
        // held ones: their channel's reply wakes us): the driver comes
        // back for them once the buffer drains.
        let mut wait_room =
            client.pending_deliveries() > 0 && self.conn.out().len() >= DELIVERY_HIGH_WATER;
        // Held deliveries go back first in line, in their order.
        while let Some(d) = self.held.pop() {
            client.defer(d);
        }
        // Direct reply-to replies: no lease (their consumers never ack).
        // While any method reply waits, they wait in their boxes too, so a
        // reply never overtakes its consumer's consume-ok.
        while self.replies.is_empty() {
            if self.conn.out().len() >= DELIVERY_HIGH_WATER {
                // Replies may wait in their boxes, woken for already.
                wait_room |= client.has_reply_consumers();
                break;
            }
            let Some(r) = client.next_reply() else {
                break;
            };
            let ch = channel_of(r.scope);
            let Some(c) = self
                .channels
                .get_mut(&ch)
                .filter(|c| !c.failed && self.conn.channel_is_usable(ch))
            else {
                continue;
            };
            c.delivery_tag += 1;
            let out = self.conn.out();
            codec::write_deliver(
                out,
                ch,
                &r.consumer_tag,
                c.delivery_tag,
                false,
                b"",
                &r.routing_key,
            );
            let properties = crate::amqp::headers::amqp_properties(&r.message, &codecs);
            codec::write_content(out, ch, &properties, &r.message.body, frame_max);
        }
        client.finish_deliveries();
        if client.has_uncommitted() {
            self.close_batch();
        }
        wait_room
    }

    /// Sends the confirms whose tickets are settled: an ack once durable,
    /// a nack when the store failed. Tickets settle in order, so the queue
    /// (in ticket order) is taken from the front.
    pub(super) fn send_ready_confirms(&mut self) {
        while let Some(c) = self.confirms.front() {
            let ok = match self.durability.status(c.ticket) {
                Status::Pending => return,
                Status::Durable => true,
                Status::Failed => false,
            };
            let Some(c) = self.confirms.pop_front() else {
                return;
            };
            let Some(ch) = self.channels.get_mut(&c.channel) else {
                continue;
            };
            if ch.epoch != c.epoch {
                continue;
            }
            ch.confirms_queued -= 1;
            if let Some(m) = self.metrics.as_mut() {
                m.confirmed(c.count, c.since.elapsed());
            }
            if self.conn.channel_is_usable(c.channel) {
                self.write_confirm(c.channel, c.tag, true, !ok);
            }
        }
    }

    /// Confirms each channel's publishes of the batch with one `multiple`
    /// ack: at once when nothing in it was stored, else once the batch's
    /// ticket is durable. A channel whose earlier confirm still waits
    /// queues behind it (the latest ticket: no barrier of its own), so its
    /// confirms leave in order.
    pub(super) fn send_confirms(&mut self) {
        // Confirms that must queue behind a reply (rare: only while one
        // waits), written after the walk over the channels.
        let mut queued: Vec<(u16, u64, bool)> = Vec::new();
        let direct = self.replies.is_empty();
        let mut now: Option<Instant> = None;
        for (&id, c) in self.channels.iter_mut() {
            if c.batch_publishes == 0 {
                continue;
            }
            // One clock read per batch with publishes.
            let since = *now.get_or_insert_with(Instant::now);
            let count = c.batch_publishes;
            let tag = c.publish_tag;
            if c.batch_needs_store || c.confirms_queued > 0 {
                let ticket = if c.batch_needs_store {
                    self.durability.ticket()
                } else {
                    self.durability.latest()
                };
                c.confirms_queued += 1;
                self.confirms.push_back(PendingConfirm {
                    channel: id,
                    epoch: c.epoch,
                    tag,
                    ticket,
                    count,
                    since,
                });
            } else {
                if let Some(m) = self.metrics.as_mut() {
                    m.confirmed(count, since.elapsed());
                }
                if direct {
                    codec::write_confirm(self.conn.out(), id, tag, true, false);
                } else {
                    queued.push((id, tag, false));
                }
            }
            c.batch_publishes = 0;
            c.batch_needs_store = false;
        }
        for (ch, tag, nack) in queued {
            self.write_confirm(ch, tag, true, nack);
        }
    }
}
