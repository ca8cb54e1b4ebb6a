//! A stream partition's sparse index, hot tail and retention.

use super::offset::OffsetSpec;
use crate::args::QueueArgs;
use crate::consumer::Consumer;
use crate::message::Message;
use parking_lot::Mutex;
use std::collections::VecDeque;
use std::sync::Arc;
use weir_backend::{MessageId, MessageRef, PartitionId, RecoveredMessage};

/// Events per chunk of the sparse index: what the process keeps per stored
/// event is one [`Chunk`] (72 bytes) per this many, so well under a byte.
pub const CHUNK_EVENTS: u32 = 256;
/// A chunk also closes at this many bytes of bodies (or at the stream's
/// `x-stream-max-segment-size-bytes`, or a quarter of its
/// `x-max-length-bytes`, if lower): retention drops whole chunks, so they
/// must be small beside the limit.
const CHUNK_BYTES: u64 = 1 << 20;
/// The newest events of a partition stay in memory for consumers at the
/// head: at most this many ...
const TAIL_EVENTS: usize = 512;
/// ... and this many bytes of bodies.
const TAIL_BYTES: u64 = 4 << 20;

/// One entry of the sparse index: a run of consecutive events.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Chunk {
    /// Offset of its first event.
    pub(crate) first_offset: u64,
    /// Where its first event is stored: readers seek here.
    pub(crate) first: MessageRef,
    /// Publish time of its first and newest events (ms since the epoch).
    pub(crate) first_ms: u64,
    pub(crate) last_ms: u64,
    /// Events in it.
    pub(crate) count: u32,
    /// Bytes of their bodies.
    pub(crate) bytes: u64,
}

/// An event kept in memory (the hot tail) or read back.
#[derive(Debug, Clone)]
pub(crate) struct Event {
    pub(crate) offset: u64,
    pub(crate) at: MessageRef,
    pub(crate) ms: u64,
    pub(crate) message: Arc<Message>,
}

/// A consume refused because what it asks for was dropped by retention:
/// never a silent skip.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("offset out of range: {}the oldest available offset is {first}; {lost} events were lost to retention", match .requested { Some(r) => format!("requested offset {r} is no longer retained; "), None => "events from the requested time on are no longer retained; ".to_string() })]
pub struct Refusal {
    /// The offset asked for (None: a timestamp or interval).
    pub requested: Option<u64>,
    /// The oldest offset still available.
    pub first: u64,
    /// Events lost to retention between what was asked for and `first`
    /// (for a time: every event dropped so far).
    pub lost: u64,
}

/// What a reader at an offset does next.
pub(crate) enum Plan {
    /// Events from the hot tail, in order from the offset asked for.
    Tail(Vec<Event>),
    /// Read the store from this chunk's first event (its offset given).
    Store { from: MessageRef, from_offset: u64 },
    /// Nothing to read: the consumer is woken by the next append.
    AtHead,
    /// Retention overtook the reader.
    Lost(Refusal),
}

/// What retention dropped: append `PutState` of [`Truncation::state_value`]
/// under the partition's key, then `Op::Truncate { before }`, in one batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Truncation {
    /// The first id kept.
    pub before: MessageId,
    /// The first offset kept.
    pub first_offset: u64,
    /// Publish time of the newest event dropped.
    pub lost_last_ms: u64,
}

impl Truncation {
    /// The state-store value: first offset, first id, newest lost time.
    pub fn state_value(&self) -> [u8; 24] {
        let mut v = [0u8; 24];
        v[..8].copy_from_slice(&self.first_offset.to_le_bytes());
        v[8..16].copy_from_slice(&self.before.to_le_bytes());
        v[16..].copy_from_slice(&self.lost_last_ms.to_le_bytes());
        v
    }

    /// Reads [`Truncation::state_value`] back.
    pub fn from_state(v: &[u8]) -> Option<Truncation> {
        if v.len() != 24 {
            return None;
        }
        let word = |i: usize| u64::from_le_bytes(v[i..i + 8].try_into().unwrap_or([0; 8]));
        Some(Truncation {
            first_offset: word(0),
            before: word(8),
            lost_last_ms: word(16),
        })
    }
}

/// Figures of a stream partition for the management API and metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StreamStats {
    /// Oldest offset retained.
    pub first: u64,
    /// Next offset to be written (events ever appended).
    pub head: u64,
    /// Bytes of bodies retained.
    pub bytes: u64,
    /// Publish time of the oldest retained event (0: none).
    pub oldest_ms: u64,
    /// Chunks in the sparse index.
    pub chunks: u64,
}

/// One partition of a stream queue.
pub struct StreamLog {
    id: PartitionId,
    inner: Mutex<Inner>,
}

struct Inner {
    chunks: VecDeque<Chunk>,
    head: u64,
    first: u64,
    bytes: u64,
    lost_last_ms: u64,
    tail: VecDeque<Event>,
    tail_bytes: u64,
    /// Consumers at the head, woken by the next append.
    waiting: Vec<Arc<Consumer>>,
    max_age_ms: Option<u64>,
    max_bytes: Option<u64>,
    chunk_bytes: u64,
    /// A chunk closes once it spans this long (a quarter of `x-max-age`),
    /// so age retention can drop old events of a slow stream.
    chunk_span_ms: u64,
}

impl StreamLog {
    /// An empty partition `id` of a stream declared with `args`.
    pub fn new(id: PartitionId, args: &QueueArgs) -> StreamLog {
        let log = StreamLog {
            id,
            inner: Mutex::new(Inner {
                chunks: VecDeque::new(),
                head: 0,
                first: 0,
                bytes: 0,
                lost_last_ms: 0,
                tail: VecDeque::new(),
                tail_bytes: 0,
                waiting: Vec::new(),
                max_age_ms: None,
                max_bytes: None,
                chunk_bytes: CHUNK_BYTES,
                chunk_span_ms: u64::MAX,
            }),
        };
        log.set_args(args);
        log
    }

    /// Its partition.
    pub fn partition(&self) -> PartitionId {
        self.id
    }

    /// Applies the queue's (possibly new) retention arguments.
    pub fn set_args(&self, args: &QueueArgs) {
        let mut st = self.inner.lock();
        st.max_age_ms = args.max_age_ms;
        st.max_bytes = args.max_length_bytes;
        let mut chunk = CHUNK_BYTES;
        if let Some(s) = args.stream_segment_bytes {
            chunk = chunk.min(s.max(1));
        }
        if let Some(m) = args.max_length_bytes {
            chunk = chunk.min((m / 4).max(1));
        }
        st.chunk_bytes = chunk;
        st.chunk_span_ms = args.max_age_ms.map_or(u64::MAX, |a| (a / 4).max(1));
    }

    /// Appends the event stored at `at`, published at `ms`; returns its
    /// offset and what retention dropped (the caller appends it). Wakes
    /// the consumers waiting at the head.
    pub(crate) fn append(
        &self,
        at: MessageRef,
        ms: u64,
        message: &Arc<Message>,
    ) -> (u64, Option<Truncation>) {
        let size = u64::from(message.size());
        let mut st = self.inner.lock();
        let offset = st.head;
        st.head += 1;
        st.push_indexed(offset, at, ms, size);
        st.tail.push_back(Event {
            offset,
            at,
            ms,
            message: message.clone(),
        });
        st.tail_bytes += size;
        while st.tail.len() > TAIL_EVENTS || (st.tail_bytes > TAIL_BYTES && st.tail.len() > 1) {
            if let Some(e) = st.tail.pop_front() {
                st.tail_bytes -= u64::from(e.message.size());
            }
        }
        let cut = st.retain(ms);
        let waiting = std::mem::take(&mut st.waiting);
        drop(st);
        for c in waiting {
            c.conn.wake();
        }
        (offset, cut)
    }

    /// Applies `x-max-age` at `now_ms` (also done at every append).
    pub(crate) fn enforce(&self, now_ms: u64) -> Option<Truncation> {
        self.inner.lock().retain(now_ms)
    }

    /// Rebuilds the index from the partition's stored events (id order)
    /// and the retention point the state store kept. Returns an id to
    /// truncate before again when the last truncation's record was lost
    /// after its state was written.
    pub(crate) fn recover(
        &self,
        msgs: Vec<RecoveredMessage>,
        saved: Option<Truncation>,
    ) -> Option<MessageId> {
        let mut st = self.inner.lock();
        let (first, min_id) = saved.map_or((0, 0), |t| (t.first_offset, t.before));
        st.first = first;
        st.head = first;
        st.lost_last_ms = saved.map_or(0, |t| t.lost_last_ms);
        let mut stale = false;
        for m in msgs {
            if m.id < min_id {
                stale = true;
                continue;
            }
            let offset = st.head;
            st.head += 1;
            let at = MessageRef::new(self.id, m.id, m.location);
            st.push_indexed(offset, at, m.attrs.deliver_at_ms, u64::from(m.size));
        }
        stale.then_some(min_id)
    }

    /// The offset a consumer starting at `spec` reads first, with the
    /// earliest publish time it delivers (events before it in that chunk
    /// are skipped), at `now_ms`. Refused when retention dropped what it
    /// asks for.
    pub fn start(&self, spec: OffsetSpec, now_ms: u64) -> Result<(u64, u64), Refusal> {
        let st = self.inner.lock();
        let at_ms = match spec {
            OffsetSpec::First => return Ok((st.first, 0)),
            OffsetSpec::Last => return Ok((st.head.saturating_sub(1).max(st.first), 0)),
            OffsetSpec::Next => return Ok((st.head, 0)),
            OffsetSpec::Offset(n) if n < st.first => {
                return Err(Refusal {
                    requested: Some(n),
                    first: st.first,
                    lost: st.first - n,
                })
            }
            OffsetSpec::Offset(n) => return Ok((n.min(st.head), 0)),
            OffsetSpec::Timestamp(ms) => ms,
            OffsetSpec::Ago(ago) => now_ms.saturating_sub(ago),
        };
        if st.first > 0 && st.lost_last_ms >= at_ms {
            return Err(Refusal {
                requested: None,
                first: st.first,
                lost: st.first,
            });
        }
        let offset = st
            .chunks
            .iter()
            .find(|c| c.last_ms >= at_ms)
            .map_or(st.head, |c| c.first_offset);
        Ok((offset, at_ms))
    }

    /// What a reader of `consumer` at `next` does; at the head it is
    /// registered to be woken by the next append.
    pub(crate) fn plan(&self, next: u64, max: usize, consumer: &Arc<Consumer>) -> Plan {
        let mut st = self.inner.lock();
        if next < st.first {
            return Plan::Lost(Refusal {
                requested: Some(next),
                first: st.first,
                lost: st.first - next,
            });
        }
        if next >= st.head {
            if !st.waiting.iter().any(|c| Arc::ptr_eq(c, consumer)) {
                st.waiting.retain(|c| !c.is_dead());
                st.waiting.push(consumer.clone());
            }
            return Plan::AtHead;
        }
        if let Some(front) = st.tail.front() {
            if front.offset <= next {
                let skip = (next - front.offset) as usize;
                return Plan::Tail(st.tail.iter().skip(skip).take(max).cloned().collect());
            }
        }
        let i = st.chunks.partition_point(|c| c.first_offset <= next);
        match i.checked_sub(1).and_then(|i| st.chunks.get(i)) {
            Some(c) => Plan::Store {
                from: c.first,
                from_offset: c.first_offset,
            },
            None => Plan::AtHead,
        }
    }

    /// Figures for the management API.
    pub fn stats(&self) -> StreamStats {
        let st = self.inner.lock();
        StreamStats {
            first: st.first,
            head: st.head,
            bytes: st.bytes,
            oldest_ms: st.chunks.front().map_or(0, |c| c.first_ms),
            chunks: st.chunks.len() as u64,
        }
    }

    /// Forgets the consumers waiting at the head (the queue was deleted).
    pub(crate) fn close(&self) {
        let mut st = self.inner.lock();
        st.waiting.clear();
        st.tail.clear();
        st.tail_bytes = 0;
    }
}

impl Inner {
    fn push_indexed(&mut self, offset: u64, at: MessageRef, ms: u64, size: u64) {
        self.bytes += size;
        let (chunk_bytes, span) = (self.chunk_bytes, self.chunk_span_ms);
        match self.chunks.back_mut() {
            Some(c)
                if c.count < CHUNK_EVENTS
                    && c.bytes < chunk_bytes
                    && ms.saturating_sub(c.first_ms) < span =>
            {
                c.count += 1;
                c.bytes += size;
                c.last_ms = c.last_ms.max(ms);
            }
            _ => self.chunks.push_back(Chunk {
                first_offset: offset,
                first: at,
                first_ms: ms,
                last_ms: ms,
                count: 1,
                bytes: size,
            }),
        }
    }

    /// Drops whole chunks, oldest first, while the stream is over its
    /// byte limit or their newest event is older than its age limit;
    /// never the newest chunk.
    fn retain(&mut self, now_ms: u64) -> Option<Truncation> {
        let mut cut = None;
        while self.chunks.len() > 1 {
            let c = self.chunks[0];
            let over_bytes = self.max_bytes.is_some_and(|m| self.bytes > m);
            let too_old = self
                .max_age_ms
                .is_some_and(|a| c.last_ms.saturating_add(a) < now_ms);
            if !over_bytes && !too_old {
                break;
            }
            self.chunks.pop_front();
            self.bytes -= c.bytes;
            self.lost_last_ms = self.lost_last_ms.max(c.last_ms);
            let next = self.chunks[0];
            self.first = next.first_offset;
            cut = Some(Truncation {
                before: next.first.id,
                first_offset: next.first_offset,
                lost_last_ms: self.lost_last_ms,
            });
        }
        if cut.is_some() {
            while self.tail.front().is_some_and(|e| e.offset < self.first) {
                if let Some(e) = self.tail.pop_front() {
                    self.tail_bytes -= u64::from(e.message.size());
                }
            }
        }
        cut
    }
}
