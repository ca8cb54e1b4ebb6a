//! A stream consumer's cursor, kept by the engine client that subscribed:
//! it turns the partition's events into deliveries as far as the
//! consumer's credit allows, reading the hot tail or the store.

use super::log::{Event, Plan, Refusal};
use crate::consumer::{Consumer, Delivery};
use crate::message::{Entry, Message};
use crate::properties::{HeaderCodecs, Value};
use crate::queue::Partition;
use bytes::Bytes;
use std::collections::VecDeque;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use weir_backend::{RangeMessage, ReadFuture, Store, StoreError};

type RangeRead = ReadFuture<Result<Vec<RangeMessage>, StoreError>>;

/// Events read from the store per read.
const READ_BATCH: usize = 256;

/// Where a consumer starts in one partition: (offset, earliest publish time
/// delivered in ms; 0 = any).
pub(crate) type Start = (Arc<Partition>, (u64, u64));

/// One stream subscription: a cursor per partition of its queue.
pub(crate) struct StreamSub {
    pub(crate) consumer: Arc<Consumer>,
    parts: Vec<Cursor>,
    /// The partition served first next time (round robin).
    turn: usize,
}

struct Cursor {
    partition: Arc<Partition>,
    /// The next offset to deliver.
    next: u64,
    /// Events published before this time (ms) are skipped (a timestamp
    /// start inside a chunk).
    min_ms: u64,
    /// Events read ahead, from `next` on, in order.
    buf: VecDeque<Event>,
    /// A store read in flight, and the offset of its first event (in a
    /// mutex only so the client stays `Sync`; polled through `get_mut`).
    read: Option<(u64, parking_lot::Mutex<RangeRead>)>,
}

/// How a pump ended for a subscription.
pub(crate) enum Pumped {
    /// Delivered what it could; it waits for credit, the store or appends.
    Idle,
    /// Retention overtook it: the caller cancels the consumer.
    Lost(Refusal),
}

impl StreamSub {
    /// A subscription of `consumer` reading each partition from its
    /// `(offset, min_ms)` start.
    pub(crate) fn new(consumer: Arc<Consumer>, starts: Vec<Start>) -> Self {
        StreamSub {
            consumer,
            parts: starts
                .into_iter()
                .map(|(partition, (next, min_ms))| Cursor {
                    partition,
                    next,
                    min_ms,
                    buf: VecDeque::new(),
                    read: None,
                })
                .collect(),
            turn: 0,
        }
    }

    /// Pushes deliveries onto `out` while the consumer has credit.
    pub(crate) fn pump(
        &mut self,
        store: &dyn Store,
        codecs: &HeaderCodecs,
        waker: &Waker,
        out: &mut VecDeque<Delivery>,
    ) -> Pumped {
        let n = self.parts.len();
        for k in 0..n {
            let i = (self.turn + k) % n;
            let c = &mut self.parts[i];
            loop {
                if c.buf.is_empty() {
                    match c.fill(store, waker, &self.consumer) {
                        Ok(true) => {}
                        Ok(false) => break,
                        Err(r) => return Pumped::Lost(r),
                    }
                }
                let Some(ev) = c.buf.front() else { break };
                if ev.ms < c.min_ms {
                    c.next = ev.offset + 1;
                    c.buf.pop_front();
                    continue;
                }
                c.min_ms = 0;
                if !self.consumer.try_acquire(ev.message.size()) {
                    self.turn = i;
                    return Pumped::Idle;
                }
                let Some(ev) = c.buf.pop_front() else { break };
                c.next = ev.offset + 1;
                let message = with_offset(codecs, &ev.message, ev.offset);
                out.push_back(Delivery {
                    consumer: self.consumer.clone(),
                    partition: c.partition.clone(),
                    entry: Entry {
                        seq: ev.offset,
                        id: ev.at.id,
                        location: Some(ev.at.location),
                        size: message.size(),
                        redelivered: false,
                        attempts: 0,
                        priority: message.priority,
                        enqueued_ms: ev.ms,
                        expires_at_ms: 0,
                        message: Some(message),
                    },
                });
            }
        }
        self.turn = (self.turn + 1) % n.max(1);
        Pumped::Idle
    }
}

impl Cursor {
    /// Fills `buf` from the hot tail or the store. Ok(false): nothing to
    /// deliver now (at the head, or a read in flight).
    fn fill(
        &mut self,
        store: &dyn Store,
        waker: &Waker,
        consumer: &Arc<Consumer>,
    ) -> Result<bool, Refusal> {
        let Some(log) = self.partition.stream.as_deref() else {
            return Ok(false);
        };
        if self.read.is_none() {
            match log.plan(self.next, READ_BATCH, consumer) {
                Plan::Tail(events) => {
                    self.buf.extend(events);
                    return Ok(!self.buf.is_empty());
                }
                Plan::AtHead => return Ok(false),
                Plan::Lost(r) => return Err(r),
                Plan::Store { from, from_offset } => {
                    let skip = (self.next - from_offset) as usize;
                    self.read = Some((
                        from_offset,
                        parking_lot::Mutex::new(store.read_from(from, skip + READ_BATCH)),
                    ));
                }
            }
        }
        let Some((from_offset, fut)) = self.read.as_mut() else {
            return Ok(false);
        };
        let mut cx = Context::from_waker(waker);
        let Poll::Ready(res) = fut.get_mut().as_mut().poll(&mut cx) else {
            return Ok(false);
        };
        let from_offset = *from_offset;
        self.read = None;
        match res {
            Ok(msgs) => {
                for (k, m) in msgs.into_iter().enumerate() {
                    let offset = from_offset + k as u64;
                    if offset < self.next {
                        continue;
                    }
                    let ms = m.message.attrs.deliver_at_ms;
                    match crate::readback::to_message(m.message) {
                        Ok(message) => self.buf.push_back(Event {
                            offset,
                            at: m.at,
                            ms,
                            message,
                        }),
                        Err(e) => {
                            tracing::warn!(partition = m.at.partition.0, offset, error = %e, "unreadable stream event");
                            break;
                        }
                    }
                }
            }
            Err(e) => {
                tracing::warn!(partition = self.partition.id.0, offset = self.next, error = %e, "stream read failed");
            }
        }
        Ok(!self.buf.is_empty())
    }
}

/// The delivered copy: the message with `x-stream-offset` set to its
/// offset, through its own codec (any protocol's message shows it its way).
fn with_offset(codecs: &HeaderCodecs, m: &Arc<Message>, offset: u64) -> Arc<Message> {
    let rewritten = codecs
        .decode(m.header_format, &m.properties)
        .and_then(|mut props| {
            let headers = props.headers.get_or_insert_with(Default::default);
            let v = Value::I64(i64::try_from(offset).unwrap_or(i64::MAX));
            match headers
                .0
                .iter_mut()
                .find(|(k, _)| k == super::OFFSET_HEADER)
            {
                Some((_, old)) => *old = v,
                None => headers.push(super::OFFSET_HEADER, v),
            }
            let mut raw = Vec::with_capacity(m.properties.len() + 32);
            codecs.get(m.header_format)?.encode(&props, &mut raw)?;
            Ok(raw)
        });
    match rewritten {
        Ok(raw) => Arc::new(Message {
            id: m.id,
            exchange: m.exchange.clone(),
            routing_key: m.routing_key.clone(),
            properties: Bytes::from(raw),
            body: m.body.clone(),
            header_format: m.header_format,
            persistent: m.persistent,
            priority: m.priority,
            ttl_ms: None,
        }),
        Err(err) => {
            tracing::debug!(error = %err, "x-stream-offset not added: headers undecodable");
            m.clone()
        }
    }
}
