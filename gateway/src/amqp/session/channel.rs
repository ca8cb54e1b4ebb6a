//! Per-channel state of an AMQP session, and opening and releasing
//! channels. Consumers and leases are the engine client's, by scope (the
//! channel number); what is here is AMQP's own: tags, confirms, qos
//! defaults, the last declared queue.

use super::{scope, Session};

/// One open channel.
#[derive(Default)]
pub(super) struct Channel {
    /// Distinguishes this opening of the channel number from earlier ones.
    pub(super) epoch: u64,
    /// Publisher confirms are on.
    pub(super) confirm: bool,
    /// The channel is transacted (tx.select): its uncommitted work.
    pub(super) tx: Option<super::tx::Tx>,
    /// Tag of the last publish (confirm mode).
    pub(super) publish_tag: u64,
    /// A publish in the current input batch needs the store's confirmation.
    pub(super) batch_needs_store: bool,
    /// Publishes in the current input batch (confirm mode).
    pub(super) batch_publishes: u64,
    /// Confirms of this channel waiting for their ticket (in
    /// `Session::confirms`).
    pub(super) confirms_queued: u64,
    /// Tag of the last delivery.
    pub(super) delivery_tag: u64,
    /// Per-consumer prefetch for consumers created from now on.
    pub(super) prefetch_count: u16,
    /// Per-consumer prefetch bytes for consumers created from now on.
    pub(super) prefetch_size: u32,
    /// The last queue declared on this channel (what an empty name means).
    pub(super) last_queue: Option<String>,
    /// A method failed while earlier replies were queued: the channel is
    /// closed once they are sent, and takes no events meanwhile.
    pub(super) failed: bool,
}

impl Session {
    pub(super) fn on_channel_opened(&mut self, ch: u16) {
        if let Some(m) = self.metrics.as_mut() {
            m.channel_opened();
        }
        self.next_epoch += 1;
        self.channels.insert(
            ch,
            Channel {
                epoch: self.next_epoch,
                ..Channel::default()
            },
        );
    }

    /// The channel is gone: its consumers are cancelled and its leases
    /// return to their queues; its queued replies and confirms are dropped
    /// (the epoch no longer matches).
    pub(super) fn release_channel(&mut self, ch: u16) {
        let Some(c) = self.channels.remove(&ch) else {
            return;
        };
        if let Some(m) = self.metrics.as_mut() {
            m.channels_closed(1);
        }
        // Its uncommitted transaction is dropped (its acks' leases return
        // to their queues below, as every lease of the channel does).
        if let Some(t) = c.tx {
            self.tx_bytes -= t.bytes();
        }
        if let Some(c) = self.client.as_mut() {
            c.release_scope(scope(ch));
        }
    }

    /// The connection is gone (or going): every channel is released and
    /// the engine client closed.
    pub(super) fn release_all(&mut self) {
        self.replies.clear();
        self.confirms.clear();
        // The connection counts as closed from here (before close-ok leaves).
        self.metrics = None;
        self.channels.clear();
        self.tx_bytes = 0;
        debug_assert!(
            self.held.is_empty(),
            "held deliveries live within one batch"
        );
        if let Some(mut c) = self.client.take() {
            c.close();
        }
    }
}
