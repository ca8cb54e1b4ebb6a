//! Per-channel state of an AMQP session: consumers, leases, confirms, qos.

use crate::engine::consumer::{Consumer, Credit};
use crate::engine::message::Entry;
use crate::engine::queue::{Partition, Queue};
use bytes::Bytes;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Instant;

/// A delivered, unacknowledged message: the lease the channel holds until the
/// client acks, nacks or rejects it, or the channel goes away.
pub struct Lease {
    /// The partition it came from.
    pub partition: Arc<Partition>,
    /// The consumer whose credit it holds (None for basic.get).
    pub consumer: Option<Arc<Consumer>>,
    /// The entry.
    pub entry: Entry,
    /// When it was delivered: a lease older than the consumer timeout closes
    /// its channel and returns to the queue (the visibility timeout).
    pub since: Instant,
}

/// A consumer as its channel knows it.
pub struct ChannelConsumer {
    /// The engine's consumer.
    pub consumer: Arc<Consumer>,
    /// Its queue.
    pub queue: Arc<Queue>,
}

/// One open channel.
pub struct Channel {
    /// Distinguishes this opening of the channel number from earlier ones.
    pub epoch: u64,
    /// Publisher confirms are on.
    pub confirm: bool,
    /// Tag of the last publish (confirm mode).
    pub publish_tag: u64,
    /// A publish in the current input batch needs the store's confirmation.
    pub batch_needs_store: bool,
    /// Publishes in the current input batch (confirm mode).
    pub batch_publishes: u64,
    /// Store confirmations requested and not yet received.
    pub store_confirms_pending: u64,
    /// Tag of the last delivery.
    pub delivery_tag: u64,
    /// Unacknowledged deliveries by tag.
    pub leases: BTreeMap<u64, Lease>,
    /// Consumers by tag.
    pub consumers: HashMap<Bytes, ChannelConsumer>,
    /// Per-consumer prefetch for consumers created from now on.
    pub prefetch_count: u16,
    /// Per-consumer prefetch bytes for consumers created from now on.
    pub prefetch_size: u32,
    /// Channel-wide window (basic.qos global).
    pub channel_credit: Option<Arc<Credit>>,
    /// channel.flow state.
    pub flow_active: Arc<AtomicBool>,
    /// The last queue declared on this channel (what an empty name means).
    pub last_queue: Option<String>,
}

impl Default for Channel {
    fn default() -> Self {
        Channel {
            epoch: 0,
            confirm: false,
            publish_tag: 0,
            batch_needs_store: false,
            batch_publishes: 0,
            store_confirms_pending: 0,
            delivery_tag: 0,
            leases: BTreeMap::new(),
            consumers: HashMap::new(),
            prefetch_count: 0,
            prefetch_size: 0,
            // Unlimited until basic.qos(global) sets it.
            channel_credit: Some(Credit::new(0, 0)),
            flow_active: Arc::new(AtomicBool::new(true)),
            last_queue: None,
        }
    }
}

impl Channel {
    /// Removes the leases an ack/nack/reject names: exactly `tag`, or with
    /// `multiple` every tag up to it (0 = all). As in RabbitMQ, `tag` itself
    /// must be outstanding (unless it is 0 with `multiple`); `None` otherwise.
    pub fn take_leases(&mut self, tag: u64, multiple: bool) -> Option<Vec<Lease>> {
        if multiple && tag == 0 {
            return Some(std::mem::take(&mut self.leases).into_values().collect());
        }
        if !self.leases.contains_key(&tag) {
            return None;
        }
        if !multiple {
            return self.leases.remove(&tag).map(|l| vec![l]);
        }
        let rest = self.leases.split_off(&(tag + 1));
        let taken = std::mem::replace(&mut self.leases, rest);
        Some(taken.into_values().collect())
    }
}
