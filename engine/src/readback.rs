//! Reading queued messages back from the store: the one path every
//! read-back of the engine takes (deliveries, pulls, dead-lettering).
//!
//! A queue keeps the bodies of its first messages in memory; deeper ones,
//! and every message recovered at startup, are read back from the store
//! when delivered. Deliveries read in batches, asynchronously
//! ([`Reads`]): [`crate::Client::drain`] starts the reads of the cold
//! deliveries it takes (spilled copies of transient messages are read from
//! the store's local spill at once) and polls them with a waker that wakes the
//! connection's task, so a session never waits on the store on a runtime
//! worker (a store that answers at once, such as the embedded log, has the
//! messages by the time `drain` returns). What was not read that way (a
//! read that failed, a pull, dead-lettering on the timer task) is read one
//! at a time with [`read_blocking`].

use crate::consumer::ConnHandle;
use crate::message::{Entry, Message};
use crate::properties::HeaderFormat;
use crate::queue::Partition;
use bytes::Bytes;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use weir_backend::{
    Location, MessageId, MessageRef, PartitionId, ReadFuture, Store, StoreError, StoredMessage,
};

/// A message read back, as the engine holds messages. Header format 0 is
/// no format (a damaged record): refused like an unreadable one. Any other
/// number reads back, with or without a codec here: only a conversion
/// needs one, and fails clearly.
pub(crate) fn to_message(m: StoredMessage) -> Result<Arc<Message>, String> {
    let header_format = HeaderFormat::from_u8(m.header_format).map_err(|e| e.to_string())?;
    Ok(Arc::new(Message {
        id: m.id,
        exchange: Bytes::from(m.exchange.into_bytes()),
        routing_key: Bytes::from(m.routing_key.into_bytes()),
        properties: m.header,
        body: m.body,
        header_format,
        persistent: true,
        priority: m.attrs.priority,
        // A read-back only serves a delivery: its expiry is the entry's
        // (`expires_at_ms`), fixed at enqueue.
        ttl_ms: None,
    }))
}

/// Reads one message: a spilled copy from the store's local spill, else
/// from the store.
fn read_one(
    store: &dyn Store,
    p: PartitionId,
    id: MessageId,
    at: Location,
) -> Result<StoredMessage, StoreError> {
    if let Some(spill) = store.spill().filter(|s| s.holds(at)) {
        return spill.read(at);
    }
    weir_backend::block_on(store.read_many(&[MessageRef::new(p, id, at)]))
        .pop()
        .unwrap_or(Err(StoreError::NotFound(at)))
}

/// Reads a spilled copy at once (the spill is local: no round trip to
/// overlap), or `None` when `at` is not the spill's.
pub(crate) fn read_spilled(store: &dyn Store, at: Location) -> Option<Arc<Message>> {
    let spill = store.spill().filter(|s| s.holds(at))?;
    match spill
        .read(at)
        .map_err(|e| e.to_string())
        .and_then(to_message)
    {
        Ok(m) => Some(m),
        Err(err) => {
            tracing::debug!(error = %err, "spilled read-back failed; reading it again when delivered");
            None
        }
    }
}

/// Reads the message of leased entry `e` of `p`, on this thread (see
/// [`read_located`]).
pub(crate) fn read_blocking(store: &dyn Store, p: &Partition, e: &Entry) -> Option<Arc<Message>> {
    read_located(store, p.id, e.id, || p.leased_location(e))
}

/// Reads message `id` of partition `p` wherever `locate` says it is now,
/// on this thread. Compaction may have moved the record since the entry was
/// handed out, and may move it again (and reclaim the old segment) between
/// the lookup and the read: retried while the location keeps changing.
/// `None` when unreadable (the error is logged).
pub(crate) fn read_located(
    store: &dyn Store,
    p: PartitionId,
    id: MessageId,
    locate: impl Fn() -> Option<Location>,
) -> Option<Arc<Message>> {
    let mut loc = locate()?;
    let mut read = read_one(store, p, id, loc);
    for _ in 0..3 {
        if read.is_ok() {
            break;
        }
        match locate() {
            Some(now) if now != loc => {
                loc = now;
                read = read_one(store, p, id, loc);
            }
            _ => break,
        }
    }
    match read.map_err(|err| err.to_string()).and_then(to_message) {
        Ok(m) => Some(m),
        Err(err) => {
            tracing::error!(error = %err, id, "cannot read a queued message back from the store");
            None
        }
    }
}

/// The key of a cold delivery's read.
pub(crate) type ReadKey = (PartitionId, MessageId);

/// The reads of one batch of cold deliveries, in flight.
pub(crate) struct Reads {
    keys: Vec<ReadKey>,
    /// In a mutex only so that a client holding it stays `Sync` (a store's
    /// future need only be `Send`); polled by its client alone.
    future: parking_lot::Mutex<ReadFuture<Vec<Result<StoredMessage, StoreError>>>>,
}

impl Reads {
    /// Starts reading `items` (partition, id, current location).
    pub(crate) fn start(
        store: &dyn Store,
        items: Vec<(PartitionId, MessageId, Location)>,
    ) -> Reads {
        let refs: Vec<MessageRef> = items
            .iter()
            .map(|&(p, id, at)| MessageRef::new(p, id, at))
            .collect();
        Reads {
            keys: items.into_iter().map(|(p, id, _)| (p, id)).collect(),
            future: parking_lot::Mutex::new(store.read_many(&refs)),
        }
    }

    /// Whether the read of `key` is in this batch.
    pub(crate) fn covers(&self, key: ReadKey) -> bool {
        self.keys.contains(&key)
    }

    /// Polls the batch; once complete, the messages read (a failed read
    /// is left out: it is read again, one at a time, when delivered).
    pub(crate) fn poll(&mut self, waker: &Waker) -> Option<Vec<(ReadKey, Arc<Message>)>> {
        let mut cx = Context::from_waker(waker);
        let Poll::Ready(results) = self.future.get_mut().as_mut().poll(&mut cx) else {
            return None;
        };
        let mut out = Vec::with_capacity(results.len());
        for (key, r) in self.keys.iter().zip(results) {
            match r.map_err(|e| e.to_string()).and_then(to_message) {
                Ok(m) => out.push((*key, m)),
                Err(err) => {
                    tracing::debug!(error = %err, id = key.1, "batched read-back failed; reading it again when delivered");
                }
            }
        }
        Some(out)
    }
}

/// Wakes a connection's task when its reads complete.
pub(crate) struct WakeConn(pub Arc<ConnHandle>);

impl std::task::Wake for WakeConn {
    fn wake(self: Arc<Self>) {
        self.0.wake();
    }
    fn wake_by_ref(self: &Arc<Self>) {
        self.0.wake();
    }
}
