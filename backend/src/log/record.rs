//! Record framing and payload encoding.
//!
//! Every record on disk is framed as
//!
//! ```text
//! [u32 LE payload_len][u32 LE crc32c(payload)][payload: payload_len bytes]
//! ```
//!
//! and every payload starts with a one-byte record type. All integers are
//! little-endian; variable-length fields are `[u32 LE len][bytes]`.
//!
//! | type | payload after the type byte |
//! |---|---|
//! | 1 publish  | id u64, priority u8, expires_at_ms u64, header_format u8, n u32, n × partition u64, exchange, routing key, header, body |
//! | 2 settle   | partition u64, id u64 |
//! | 3 relocate | same layout as publish, with exactly one partition |
//! | 4 put-meta | version u64, key, value |
//! | 5 del-meta | version u64, key |
//! | 6 page     | same layout as publish; ignored by recovery (paged transient data) |
//! | 7 publish-ext  | id u64, priority u8, expires_at_ms u64, deliver_at_ms u64, attempts u32, header_format u8, n u32, n × partition u64, exchange, routing key, header, body |
//! | 8 relocate-ext | same layout as publish-ext, with exactly one partition |
//! | 9 page-ext     | same layout as publish-ext; ignored by recovery |
//! | 10 move    | from partition u64, from id u64, then the publish-ext layout (n ≥ 1) |
//! | 11 requeue | partition u64, id u64, attempts u32, deliver_at_ms u64 |
//! | 12 receipt | partition u64, key_hash u64, expires_at_ms u64 |
//! | 13 meta-batch | version u64, n u32, n × (present u8, key, value if present = 1) |
//! | 14 drop    | partition u64 |
//! | 15 truncate | partition u64, before u64 |
//! | 16 put-state | seq u64, version u64, key, value |
//! | 17 del-state | seq u64, key |
//!
//! `header_format` tags the encoding of `header` (opaque to the store, defined
//! by the engine). This is log format 1 (see `segment.rs` for the segment
//! header that carries the format version); format 0 had no `header_format`
//! and no segment header.
//!
//! Types 7 to 12 were added within format 1 without changing types 1 to 6:
//! the `-ext` variants are written only when `deliver_at_ms` or `attempts` is
//! not 0, so a plain publish is byte-identical to before, and a log written
//! by an older build reads the same. (An older build refuses a log holding
//! the new types as damaged rather than misreading it.)
//!
//! * A *move* (dead-lettering) is one record with one checksum: recovery
//!   applies it as a publish of the new message to its partitions plus a
//!   settle of `from id` in `from partition`, or (torn) not at all.
//! * A *requeue* sets the delivery count (`attempts`) and `deliver_at_ms` of
//!   a live message; recovery keeps the last one per (partition, id) and
//!   ignores it once the message is settled. Requeue records are never live
//!   (they pin nothing): the store keeps the current values of every
//!   requeued live message in memory, and a relocated copy carries them (a
//!   relocate-ext record; a plain relocate means 0 and 0). A requeue record
//!   is only reclaimed once every segment before it is, so by then the
//!   message's record (if live) is a copy written after it, carrying its
//!   values or newer ones. A message record resets the values to its own.
//! * A *receipt* (idempotent publish) says a message with that key was
//!   enqueued in that partition's queue and duplicates are dropped until
//!   `expires_at_ms`. Recovery keeps the latest expiry per (partition,
//!   key_hash) and drops expired ones. A receipt pins its segment until it
//!   expires, unless compaction first copies it into a receipts file
//!   (`receipts.rs`).
//!
//! * A *meta-batch* is several metadata changes under one version and one
//!   checksum: recovery applies all of them, or (torn) none.
//! * A *drop* settles every message live in its partition at that point of
//!   the log; a *truncate* those with an id below `before`. Neither is ever
//!   live: each is only read by recovery, and is reclaimed after the
//!   segments holding the messages it settled (deletion is a prefix).
//! * *put-state* and *del-state* change one key of the state store. `seq`
//!   is the store's own sequence of state changes, only used to tell which
//!   records a checkpoint already covers (like a metadata version);
//!   `version` is the key's own version, returned to callers.
//!
//! Decoding is bounds-checked everywhere and never panics on bad input: a
//! torn or corrupt record must be reported, not crash recovery.

use crate::{MessageAttrs, MessageData, MessageId, PartitionId};

/// Bytes of framing in front of every payload.
pub(crate) const FRAME_HEADER: usize = 8;

const T_PUBLISH: u8 = 1;
const T_SETTLE: u8 = 2;
const T_RELOCATE: u8 = 3;
const T_PUT_META: u8 = 4;
const T_DEL_META: u8 = 5;
const T_PAGE: u8 = 6;
const T_PUBLISH_EXT: u8 = 7;
const T_RELOCATE_EXT: u8 = 8;
const T_PAGE_EXT: u8 = 9;
const T_MOVE: u8 = 10;
const T_REQUEUE: u8 = 11;
const T_RECEIPT: u8 = 12;
const T_META_BATCH: u8 = 13;
const T_DROP: u8 = 14;
const T_TRUNCATE: u8 = 15;
const T_PUT_STATE: u8 = 16;
const T_DEL_STATE: u8 = 17;

/// Whether a message record is the original publish or a relocated copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum MessageKind {
    Publish,
    Relocate,
    /// Paged transient data: readable, never recovered.
    Page,
    /// The new message of a move (see [`MessageRecord::moved_from`]).
    Move,
}

/// A decoded payload, borrowing from the buffer it was decoded from.
#[derive(Debug)]
pub(crate) enum Record<'a> {
    /// A publish or relocate record.
    Message(MessageRecord<'a>),
    Settle {
        partition: PartitionId,
        id: MessageId,
    },
    PutMeta {
        version: u64,
        key: &'a [u8],
        value: &'a [u8],
    },
    DeleteMeta {
        version: u64,
        key: &'a [u8],
    },
    Requeue {
        partition: PartitionId,
        id: MessageId,
        attempts: u32,
        deliver_at_ms: u64,
    },
    Receipt {
        partition: PartitionId,
        key_hash: u64,
        expires_at_ms: u64,
    },
    /// Metadata changes made together (`None`: the key is removed).
    MetaBatch {
        version: u64,
        changes: Vec<(&'a [u8], Option<&'a [u8]>)>,
    },
    /// A drop (`before` = `MessageId::MAX`) or truncate of a partition.
    Cut {
        partition: PartitionId,
        before: MessageId,
    },
    /// A state-store change (`value` None: the key is removed).
    State {
        seq: u64,
        version: u64,
        key: &'a [u8],
        value: Option<&'a [u8]>,
    },
}

/// The fields of a publish or relocate record.
#[derive(Debug, Clone, Copy)]
pub(crate) struct MessageRecord<'a> {
    pub kind: MessageKind,
    pub id: MessageId,
    /// `n × u64 LE`, already length-checked to be a multiple of 8.
    partitions_raw: &'a [u8],
    pub exchange: &'a [u8],
    pub routing_key: &'a [u8],
    pub header_format: u8,
    pub header: &'a [u8],
    pub body: &'a [u8],
    pub attrs: MessageAttrs,
    /// Deliveries so far (a relocated copy of a requeued message); else 0.
    pub attempts: u32,
    /// For a move: the (partition, id) it settles.
    pub moved_from: Option<(PartitionId, MessageId)>,
}

impl<'a> MessageRecord<'a> {
    /// The partitions this record is live in.
    pub fn partitions(&self) -> impl Iterator<Item = PartitionId> + 'a {
        self.partitions_raw.chunks_exact(8).map(|c| {
            let mut b = [0u8; 8];
            b.copy_from_slice(c);
            PartitionId(u64::from_le_bytes(b))
        })
    }

    /// Number of partitions listed.
    pub fn partition_count(&self) -> usize {
        self.partitions_raw.len() / 8
    }

    /// The message content as the engine handed it over. Fails (returns the
    /// reason) if exchange or routing key are not UTF-8.
    pub fn data(&self) -> Result<MessageData<'a>, &'static str> {
        Ok(MessageData {
            exchange: std::str::from_utf8(self.exchange).map_err(|_| "exchange is not utf-8")?,
            routing_key: std::str::from_utf8(self.routing_key)
                .map_err(|_| "routing key is not utf-8")?,
            header_format: self.header_format,
            header: self.header,
            body: self.body,
            attrs: self.attrs,
        })
    }
}

// ---------------------------------------------------------------------------
// Encoding

fn var_len(b: &[u8]) -> usize {
    4 + b.len()
}

/// Bytes the `-ext` layout adds (deliver_at_ms u64, attempts u32).
pub(crate) const EXT_LEN: usize = 8 + 4;

/// Whether a message record needs the `-ext` layout.
fn is_ext(kind: MessageKind, data: &MessageData<'_>, attempts: u32) -> bool {
    kind == MessageKind::Move || data.attrs.deliver_at_ms != 0 || attempts != 0
}

/// Payload length of a message record of `kind` with `n` partitions.
pub(crate) fn message_payload_len(
    kind: MessageKind,
    n: usize,
    data: &MessageData<'_>,
    attempts: u32,
) -> usize {
    let ext = if is_ext(kind, data, attempts) {
        8 + 4
    } else {
        0
    };
    let moved = if kind == MessageKind::Move { 8 + 8 } else { 0 };
    1 + moved
        + 8
        + 1
        + 8
        + ext
        + 1
        + 4
        + 8 * n
        + var_len(data.exchange.as_bytes())
        + var_len(data.routing_key.as_bytes())
        + var_len(data.header)
        + var_len(data.body)
}

/// Payload length of a settle record.
pub(crate) const SETTLE_PAYLOAD_LEN: usize = 1 + 8 + 8;

/// Payload length of a requeue record.
pub(crate) const REQUEUE_PAYLOAD_LEN: usize = 1 + 8 + 8 + 4 + 8;

/// Payload length of a receipt record.
pub(crate) const RECEIPT_PAYLOAD_LEN: usize = 1 + 8 + 8 + 8;

/// Payload length of a drop (`before` = `MessageId::MAX`) or truncate record.
pub(crate) fn cut_payload_len(before: MessageId) -> usize {
    if before == MessageId::MAX {
        1 + 8
    } else {
        1 + 8 + 8
    }
}

/// Payload length of a put-state record.
pub(crate) fn put_state_payload_len(key: &[u8], value: &[u8]) -> usize {
    1 + 8 + 8 + var_len(key) + var_len(value)
}

/// Payload length of a del-state record.
pub(crate) fn del_state_payload_len(key: &[u8]) -> usize {
    1 + 8 + var_len(key)
}

/// Payload length of a put-meta record.
pub(crate) fn put_meta_payload_len(key: &[u8], value: &[u8]) -> usize {
    1 + 8 + var_len(key) + var_len(value)
}

/// Payload length of a delete-meta record.
pub(crate) fn del_meta_payload_len(key: &[u8]) -> usize {
    1 + 8 + var_len(key)
}

/// Payload length of a meta-batch record.
pub(crate) fn meta_batch_payload_len(changes: &[crate::MetaChange<'_>]) -> usize {
    1 + 8
        + 4
        + changes
            .iter()
            .map(|c| match c {
                crate::MetaChange::Put { key, value } => 1 + var_len(key) + var_len(value),
                crate::MetaChange::Delete { key } => 1 + var_len(key),
            })
            .sum::<usize>()
}

fn put_var(buf: &mut Vec<u8>, b: &[u8]) {
    // Lengths were checked against the record limit (< u32::MAX) before encoding.
    debug_assert!(b.len() <= u32::MAX as usize);
    buf.extend_from_slice(&(b.len() as u32).to_le_bytes());
    buf.extend_from_slice(b);
}

/// Reserves the frame header, runs `f` to write the payload, then patches
/// length and checksum in. Returns the total record length (framing included).
fn framed(buf: &mut Vec<u8>, expected_payload: usize, f: impl FnOnce(&mut Vec<u8>)) -> usize {
    let start = buf.len();
    buf.reserve(FRAME_HEADER + expected_payload);
    buf.extend_from_slice(&[0u8; FRAME_HEADER]);
    f(buf);
    let payload_len = buf.len() - start - FRAME_HEADER;
    debug_assert_eq!(
        payload_len, expected_payload,
        "payload length precomputation is wrong"
    );
    let crc = crc32c::crc32c(&buf[start + FRAME_HEADER..]);
    buf[start..start + 4].copy_from_slice(&(payload_len as u32).to_le_bytes());
    buf[start + 4..start + 8].copy_from_slice(&crc.to_le_bytes());
    FRAME_HEADER + payload_len
}

/// Appends a framed publish, relocate or page record to `buf`. `attempts`
/// is a relocated copy's delivery count (0 otherwise).
pub(crate) fn encode_message(
    buf: &mut Vec<u8>,
    kind: MessageKind,
    id: MessageId,
    partitions: &[PartitionId],
    data: &MessageData<'_>,
    attempts: u32,
) -> usize {
    debug_assert!(
        kind != MessageKind::Move,
        "moves are encoded by encode_move"
    );
    encode_any(buf, kind, None, id, partitions, data, attempts)
}

/// Appends a framed move record to `buf`: `from_id` leaves `from`, and `id`
/// is published to `partitions`.
pub(crate) fn encode_move(
    buf: &mut Vec<u8>,
    from: PartitionId,
    from_id: MessageId,
    id: MessageId,
    partitions: &[PartitionId],
    data: &MessageData<'_>,
) -> usize {
    debug_assert!(!partitions.is_empty());
    encode_any(
        buf,
        MessageKind::Move,
        Some((from, from_id)),
        id,
        partitions,
        data,
        0,
    )
}

fn encode_any(
    buf: &mut Vec<u8>,
    kind: MessageKind,
    moved_from: Option<(PartitionId, MessageId)>,
    id: MessageId,
    partitions: &[PartitionId],
    data: &MessageData<'_>,
    attempts: u32,
) -> usize {
    debug_assert!(kind != MessageKind::Relocate || partitions.len() == 1);
    let ext = is_ext(kind, data, attempts);
    let expected = message_payload_len(kind, partitions.len(), data, attempts);
    framed(buf, expected, |buf| {
        buf.push(match (kind, ext) {
            (MessageKind::Publish, false) => T_PUBLISH,
            (MessageKind::Relocate, false) => T_RELOCATE,
            (MessageKind::Page, false) => T_PAGE,
            (MessageKind::Publish, true) => T_PUBLISH_EXT,
            (MessageKind::Relocate, true) => T_RELOCATE_EXT,
            (MessageKind::Page, true) => T_PAGE_EXT,
            (MessageKind::Move, _) => T_MOVE,
        });
        if let Some((from, from_id)) = moved_from {
            buf.extend_from_slice(&from.0.to_le_bytes());
            buf.extend_from_slice(&from_id.to_le_bytes());
        }
        buf.extend_from_slice(&id.to_le_bytes());
        buf.push(data.attrs.priority);
        buf.extend_from_slice(&data.attrs.expires_at_ms.to_le_bytes());
        if ext {
            buf.extend_from_slice(&data.attrs.deliver_at_ms.to_le_bytes());
            buf.extend_from_slice(&attempts.to_le_bytes());
        }
        buf.push(data.header_format);
        buf.extend_from_slice(&(partitions.len() as u32).to_le_bytes());
        for p in partitions {
            buf.extend_from_slice(&p.0.to_le_bytes());
        }
        put_var(buf, data.exchange.as_bytes());
        put_var(buf, data.routing_key.as_bytes());
        put_var(buf, data.header);
        put_var(buf, data.body);
    })
}

/// Appends a framed settle record to `buf`.
pub(crate) fn encode_settle(buf: &mut Vec<u8>, partition: PartitionId, id: MessageId) -> usize {
    framed(buf, SETTLE_PAYLOAD_LEN, |buf| {
        buf.push(T_SETTLE);
        buf.extend_from_slice(&partition.0.to_le_bytes());
        buf.extend_from_slice(&id.to_le_bytes());
    })
}

/// Appends a framed requeue record to `buf`.
pub(crate) fn encode_requeue(
    buf: &mut Vec<u8>,
    partition: PartitionId,
    id: MessageId,
    attempts: u32,
    deliver_at_ms: u64,
) -> usize {
    framed(buf, REQUEUE_PAYLOAD_LEN, |buf| {
        buf.push(T_REQUEUE);
        buf.extend_from_slice(&partition.0.to_le_bytes());
        buf.extend_from_slice(&id.to_le_bytes());
        buf.extend_from_slice(&attempts.to_le_bytes());
        buf.extend_from_slice(&deliver_at_ms.to_le_bytes());
    })
}

/// Appends a framed receipt record to `buf`.
pub(crate) fn encode_receipt(
    buf: &mut Vec<u8>,
    partition: PartitionId,
    key_hash: u64,
    expires_at_ms: u64,
) -> usize {
    framed(buf, RECEIPT_PAYLOAD_LEN, |buf| {
        buf.push(T_RECEIPT);
        buf.extend_from_slice(&partition.0.to_le_bytes());
        buf.extend_from_slice(&key_hash.to_le_bytes());
        buf.extend_from_slice(&expires_at_ms.to_le_bytes());
    })
}

/// Appends a framed drop (`before` = `MessageId::MAX`) or truncate record.
pub(crate) fn encode_cut(buf: &mut Vec<u8>, partition: PartitionId, before: MessageId) -> usize {
    framed(buf, cut_payload_len(before), |buf| {
        if before == MessageId::MAX {
            buf.push(T_DROP);
            buf.extend_from_slice(&partition.0.to_le_bytes());
        } else {
            buf.push(T_TRUNCATE);
            buf.extend_from_slice(&partition.0.to_le_bytes());
            buf.extend_from_slice(&before.to_le_bytes());
        }
    })
}

/// Appends a framed put-state (`value` Some) or del-state record.
pub(crate) fn encode_state(
    buf: &mut Vec<u8>,
    seq: u64,
    version: u64,
    key: &[u8],
    value: Option<&[u8]>,
) -> usize {
    let len = match value {
        Some(v) => put_state_payload_len(key, v),
        None => del_state_payload_len(key),
    };
    framed(buf, len, |buf| {
        buf.push(if value.is_some() {
            T_PUT_STATE
        } else {
            T_DEL_STATE
        });
        buf.extend_from_slice(&seq.to_le_bytes());
        if let Some(v) = value {
            buf.extend_from_slice(&version.to_le_bytes());
            put_var(buf, key);
            put_var(buf, v);
        } else {
            put_var(buf, key);
        }
    })
}

/// Appends a framed put-meta record to `buf`.
pub(crate) fn encode_put_meta(buf: &mut Vec<u8>, version: u64, key: &[u8], value: &[u8]) -> usize {
    framed(buf, put_meta_payload_len(key, value), |buf| {
        buf.push(T_PUT_META);
        buf.extend_from_slice(&version.to_le_bytes());
        put_var(buf, key);
        put_var(buf, value);
    })
}

/// Appends a framed delete-meta record to `buf`.
pub(crate) fn encode_del_meta(buf: &mut Vec<u8>, version: u64, key: &[u8]) -> usize {
    framed(buf, del_meta_payload_len(key), |buf| {
        buf.push(T_DEL_META);
        buf.extend_from_slice(&version.to_le_bytes());
        put_var(buf, key);
    })
}

/// Appends a framed meta-batch record to `buf`.
pub(crate) fn encode_meta_batch(
    buf: &mut Vec<u8>,
    version: u64,
    changes: &[crate::MetaChange<'_>],
) -> usize {
    framed(buf, meta_batch_payload_len(changes), |buf| {
        buf.push(T_META_BATCH);
        buf.extend_from_slice(&version.to_le_bytes());
        // The record limit (< u32::MAX bytes) bounds the count too.
        buf.extend_from_slice(&(changes.len() as u32).to_le_bytes());
        for c in changes {
            match c {
                crate::MetaChange::Put { key, value } => {
                    buf.push(1);
                    put_var(buf, key);
                    put_var(buf, value);
                }
                crate::MetaChange::Delete { key } => {
                    buf.push(0);
                    put_var(buf, key);
                }
            }
        }
    })
}

// ---------------------------------------------------------------------------
// Decoding

/// Why a frame could not be taken from a buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum FrameError {
    /// The buffer ends inside the frame (a torn write, or a short read).
    Truncated,
    /// The frame is complete but its content is wrong.
    Corrupt(String),
}

/// Splits the frame at the start of `buf`, verifying the checksum. Returns the
/// payload and the frame's total length.
pub(crate) fn split_frame(buf: &[u8]) -> Result<(&[u8], usize), FrameError> {
    if buf.len() < FRAME_HEADER {
        return Err(FrameError::Truncated);
    }
    let len = u32::from_le_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize;
    let crc = u32::from_le_bytes([buf[4], buf[5], buf[6], buf[7]]);
    if len == 0 {
        // Every payload has at least a type byte; zeros are what a torn or
        // preallocated tail looks like.
        return Err(FrameError::Corrupt("zero-length record".into()));
    }
    let total = FRAME_HEADER
        .checked_add(len)
        .ok_or_else(|| FrameError::Corrupt("length overflow".into()))?;
    if buf.len() < total {
        return Err(FrameError::Truncated);
    }
    let payload = &buf[FRAME_HEADER..total];
    let actual = crc32c::crc32c(payload);
    if actual != crc {
        return Err(FrameError::Corrupt(format!(
            "checksum mismatch (stored {crc:#010x}, computed {actual:#010x})"
        )));
    }
    Ok((payload, total))
}

/// A bounds-checked cursor over a payload.
struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        if self.buf.len() < n {
            return Err(format!(
                "payload too short: need {n}, have {}",
                self.buf.len()
            ));
        }
        let (head, tail) = self.buf.split_at(n);
        self.buf = tail;
        Ok(head)
    }
    fn u8(&mut self) -> Result<u8, String> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> Result<u32, String> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self) -> Result<u64, String> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }
    fn var(&mut self) -> Result<&'a [u8], String> {
        let n = self.u32()? as usize;
        self.take(n)
    }
    fn finish(self) -> Result<(), String> {
        if self.buf.is_empty() {
            Ok(())
        } else {
            Err(format!("{} trailing bytes", self.buf.len()))
        }
    }
}

/// Decodes a payload (as returned by [`split_frame`]).
pub(crate) fn decode_payload(payload: &[u8]) -> Result<Record<'_>, String> {
    let mut r = Reader { buf: payload };
    let t = r.u8()?;
    let rec = match t {
        T_PUBLISH | T_RELOCATE | T_PAGE | T_PUBLISH_EXT | T_RELOCATE_EXT | T_PAGE_EXT | T_MOVE => {
            let kind = match t {
                T_PUBLISH | T_PUBLISH_EXT => MessageKind::Publish,
                T_RELOCATE | T_RELOCATE_EXT => MessageKind::Relocate,
                T_MOVE => MessageKind::Move,
                _ => MessageKind::Page,
            };
            let ext = t >= T_PUBLISH_EXT;
            let moved_from = if kind == MessageKind::Move {
                Some((PartitionId(r.u64()?), r.u64()?))
            } else {
                None
            };
            let id = r.u64()?;
            let priority = r.u8()?;
            let expires_at_ms = r.u64()?;
            let (deliver_at_ms, attempts) = if ext { (r.u64()?, r.u32()?) } else { (0, 0) };
            let header_format = r.u8()?;
            let n = r.u32()? as usize;
            let partitions_raw = r.take(
                n.checked_mul(8)
                    .ok_or_else(|| "partition count overflow".to_string())?,
            )?;
            if n == 0 {
                return Err("message record without partitions".into());
            }
            if kind == MessageKind::Relocate && n != 1 {
                return Err(format!("relocate record with {n} partitions"));
            }
            let exchange = r.var()?;
            let routing_key = r.var()?;
            let header = r.var()?;
            let body = r.var()?;
            Record::Message(MessageRecord {
                kind,
                id,
                partitions_raw,
                exchange,
                routing_key,
                header_format,
                header,
                body,
                attrs: MessageAttrs {
                    priority,
                    expires_at_ms,
                    deliver_at_ms,
                },
                attempts,
                moved_from,
            })
        }
        T_SETTLE => Record::Settle {
            partition: PartitionId(r.u64()?),
            id: r.u64()?,
        },
        T_PUT_META => Record::PutMeta {
            version: r.u64()?,
            key: r.var()?,
            value: r.var()?,
        },
        T_DEL_META => Record::DeleteMeta {
            version: r.u64()?,
            key: r.var()?,
        },
        T_META_BATCH => {
            let version = r.u64()?;
            let n = r.u32()? as usize;
            // Each change takes at least 5 bytes: a count beyond what the
            // payload can hold is damage, not an allocation.
            if n > payload.len() / 5 {
                return Err(format!(
                    "meta-batch of {n} changes in {} bytes",
                    payload.len()
                ));
            }
            let mut changes = Vec::with_capacity(n);
            for _ in 0..n {
                let present = r.u8()?;
                let key = r.var()?;
                let value = match present {
                    0 => None,
                    1 => Some(r.var()?),
                    other => return Err(format!("meta-batch change flag {other}")),
                };
                changes.push((key, value));
            }
            Record::MetaBatch { version, changes }
        }
        T_REQUEUE => Record::Requeue {
            partition: PartitionId(r.u64()?),
            id: r.u64()?,
            attempts: r.u32()?,
            deliver_at_ms: r.u64()?,
        },
        T_RECEIPT => Record::Receipt {
            partition: PartitionId(r.u64()?),
            key_hash: r.u64()?,
            expires_at_ms: r.u64()?,
        },
        T_DROP => Record::Cut {
            partition: PartitionId(r.u64()?),
            before: MessageId::MAX,
        },
        T_TRUNCATE => Record::Cut {
            partition: PartitionId(r.u64()?),
            before: r.u64()?,
        },
        T_PUT_STATE => Record::State {
            seq: r.u64()?,
            version: r.u64()?,
            key: r.var()?,
            value: Some(r.var()?),
        },
        T_DEL_STATE => Record::State {
            seq: r.u64()?,
            version: 0,
            key: r.var()?,
            value: None,
        },
        other => return Err(format!("unknown record type {other}")),
    };
    r.finish()?;
    Ok(rec)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data<'a>(body: &'a [u8]) -> MessageData<'a> {
        MessageData {
            exchange: "ex",
            routing_key: "rk.1",
            header_format: 2,
            header: b"hdr",
            body,
            attrs: MessageAttrs {
                priority: 3,
                expires_at_ms: 99,
                deliver_at_ms: 0,
            },
        }
    }

    #[test]
    fn roundtrip_all_types() {
        let mut buf = Vec::new();
        let parts = [PartitionId(1), PartitionId(7)];
        let l1 = encode_message(
            &mut buf,
            MessageKind::Publish,
            42,
            &parts,
            &data(b"hello"),
            0,
        );
        let l2 = encode_settle(&mut buf, PartitionId(7), 42);
        let l3 = encode_put_meta(&mut buf, 5, b"k", b"v");
        let l4 = encode_del_meta(&mut buf, 6, b"k");
        assert_eq!(buf.len(), l1 + l2 + l3 + l4);

        let (p, n) = split_frame(&buf).unwrap();
        assert_eq!(n, l1);
        match decode_payload(p).unwrap() {
            Record::Message(m) => {
                assert_eq!(m.kind, MessageKind::Publish);
                assert_eq!(m.id, 42);
                assert_eq!(m.partitions().collect::<Vec<_>>(), parts);
                let d = m.data().unwrap();
                assert_eq!(d.exchange, "ex");
                assert_eq!(d.routing_key, "rk.1");
                assert_eq!(d.body, b"hello");
                assert_eq!((d.header_format, d.header), (2, &b"hdr"[..]));
                assert_eq!(d.attrs.priority, 3);
                assert_eq!(d.attrs.expires_at_ms, 99);
            }
            other => panic!("{other:?}"),
        }
        let (p, _) = split_frame(&buf[l1..]).unwrap();
        assert!(matches!(
            decode_payload(p).unwrap(),
            Record::Settle {
                partition: PartitionId(7),
                id: 42
            }
        ));
        let (p, _) = split_frame(&buf[l1 + l2..]).unwrap();
        assert!(matches!(
            decode_payload(p).unwrap(),
            Record::PutMeta {
                version: 5,
                key: b"k",
                value: b"v"
            }
        ));
        let (p, _) = split_frame(&buf[l1 + l2 + l3..]).unwrap();
        assert!(matches!(
            decode_payload(p).unwrap(),
            Record::DeleteMeta {
                version: 6,
                key: b"k"
            }
        ));
    }

    /// A plain publish (no delay) is still the original type-1 record, byte
    /// for byte: built here by hand from the documented layout.
    #[test]
    fn plain_publish_layout_is_unchanged() {
        let mut buf = Vec::new();
        encode_message(
            &mut buf,
            MessageKind::Publish,
            0x0102,
            &[PartitionId(5)],
            &data(b"B"),
            0,
        );
        let mut want = vec![1u8];
        want.extend_from_slice(&0x0102u64.to_le_bytes());
        want.push(3);
        want.extend_from_slice(&99u64.to_le_bytes());
        want.push(2);
        want.extend_from_slice(&1u32.to_le_bytes());
        want.extend_from_slice(&5u64.to_le_bytes());
        for f in [&b"ex"[..], b"rk.1", b"hdr", b"B"] {
            want.extend_from_slice(&(f.len() as u32).to_le_bytes());
            want.extend_from_slice(f);
        }
        assert_eq!(&buf[FRAME_HEADER..], &want[..]);
        assert_eq!(&buf[..4], &(want.len() as u32).to_le_bytes());
        // The same with a relocate: type 3, same layout.
        let mut reloc = Vec::new();
        encode_message(
            &mut reloc,
            MessageKind::Relocate,
            0x0102,
            &[PartitionId(5)],
            &data(b"B"),
            0,
        );
        want[0] = 3;
        assert_eq!(&reloc[FRAME_HEADER..], &want[..]);
    }

    #[test]
    fn new_record_types_roundtrip() {
        let delayed = MessageData {
            attrs: MessageAttrs {
                deliver_at_ms: 1234,
                ..data(b"").attrs
            },
            ..data(b"later")
        };
        let mut buf = Vec::new();
        let lens = vec![
            encode_message(
                &mut buf,
                MessageKind::Publish,
                1,
                &[PartitionId(1)],
                &delayed,
                0,
            ),
            encode_message(
                &mut buf,
                MessageKind::Relocate,
                2,
                &[PartitionId(1)],
                &data(b"again"),
                7,
            ),
            encode_message(
                &mut buf,
                MessageKind::Page,
                3,
                &[PartitionId(4)],
                &delayed,
                0,
            ),
            encode_move(
                &mut buf,
                PartitionId(1),
                2,
                9,
                &[PartitionId(2), PartitionId(3)],
                &data(b"dead"),
            ),
            encode_requeue(&mut buf, PartitionId(1), 1, 4, 5678),
            encode_receipt(
                &mut buf,
                PartitionId(6),
                0xfeed_beef_0123_4567,
                1_700_000_000_123,
            ),
        ];
        assert_eq!(lens.iter().sum::<usize>(), buf.len());
        let mut off = 0;
        let mut recs = Vec::new();
        for len in &lens {
            let (p, n) = split_frame(&buf[off..]).unwrap();
            assert_eq!(n, *len);
            recs.push(decode_payload(p).unwrap());
            off += n;
        }
        let Record::Message(m) = &recs[0] else {
            panic!("{:?}", recs[0])
        };
        assert_eq!(m.kind, MessageKind::Publish);
        assert_eq!((m.attrs.deliver_at_ms, m.attempts), (1234, 0));
        assert_eq!(m.attrs.expires_at_ms, 99);
        assert_eq!(m.body, b"later");
        let Record::Message(m) = &recs[1] else {
            panic!("{:?}", recs[1])
        };
        assert_eq!(m.kind, MessageKind::Relocate);
        assert_eq!((m.attrs.deliver_at_ms, m.attempts), (0, 7));
        let Record::Message(m) = &recs[2] else {
            panic!("{:?}", recs[2])
        };
        assert_eq!(m.kind, MessageKind::Page);
        assert_eq!(m.attrs.deliver_at_ms, 1234);
        let Record::Message(m) = &recs[3] else {
            panic!("{:?}", recs[3])
        };
        assert_eq!(m.kind, MessageKind::Move);
        assert_eq!(m.id, 9);
        assert_eq!(m.moved_from, Some((PartitionId(1), 2)));
        assert_eq!(
            m.partitions().collect::<Vec<_>>(),
            vec![PartitionId(2), PartitionId(3)]
        );
        assert_eq!(m.data().unwrap().body, b"dead");
        assert!(matches!(
            recs[4],
            Record::Requeue {
                partition: PartitionId(1),
                id: 1,
                attempts: 4,
                deliver_at_ms: 5678
            }
        ));
        assert!(matches!(
            recs[5],
            Record::Receipt {
                partition: PartitionId(6),
                key_hash: 0xfeed_beef_0123_4567,
                expires_at_ms: 1_700_000_000_123
            }
        ));
        assert_eq!(lens[5], FRAME_HEADER + RECEIPT_PAYLOAD_LEN);
        // A receipt with a byte missing or one too many is refused.
        let mut r = Vec::new();
        encode_receipt(&mut r, PartitionId(1), 2, 3);
        let payload = &r[FRAME_HEADER..];
        assert!(decode_payload(&payload[..payload.len() - 1]).is_err());
        let mut longer = payload.to_vec();
        longer.push(0);
        assert!(decode_payload(&longer).is_err());
        // A move without target partitions is refused by the decoder.
        let mut bad = Vec::new();
        encode_move(
            &mut bad,
            PartitionId(1),
            2,
            9,
            &[PartitionId(2)],
            &data(b""),
        );
        // n sits after type, from, from id, id, priority, expiry, deliver_at,
        // attempts and header_format.
        let n_at = FRAME_HEADER + 1 + 8 + 8 + 8 + 1 + 8 + 8 + 4 + 1;
        assert_eq!(&bad[n_at..n_at + 4], &1u32.to_le_bytes());
        let mut payload = bad[FRAME_HEADER..].to_vec();
        let n_at = n_at - FRAME_HEADER;
        payload[n_at..n_at + 4].copy_from_slice(&0u32.to_le_bytes());
        payload.drain(n_at + 4..n_at + 12);
        assert!(decode_payload(&payload).is_err());
    }

    #[test]
    fn lifecycle_and_state_records_roundtrip() {
        let mut buf = Vec::new();
        let lens = [
            encode_cut(&mut buf, PartitionId(7), MessageId::MAX),
            encode_cut(&mut buf, PartitionId(8), 1234),
            encode_state(&mut buf, 5, 3, b"s\0t\0k", Some(b"value")),
            encode_state(&mut buf, 6, 0, b"s\0t\0k", None),
        ];
        assert_eq!(lens[0], FRAME_HEADER + cut_payload_len(MessageId::MAX));
        assert_eq!(lens[1], FRAME_HEADER + cut_payload_len(1234));
        let mut off = 0;
        let mut recs = Vec::new();
        for len in lens {
            let (p, n) = split_frame(&buf[off..]).unwrap();
            assert_eq!(n, len);
            recs.push(decode_payload(p).unwrap());
            off += n;
        }
        assert!(matches!(
            recs[0],
            Record::Cut {
                partition: PartitionId(7),
                before: MessageId::MAX
            }
        ));
        assert!(matches!(
            recs[1],
            Record::Cut {
                partition: PartitionId(8),
                before: 1234
            }
        ));
        assert!(matches!(
            recs[2],
            Record::State {
                seq: 5,
                version: 3,
                key: b"s\0t\0k",
                value: Some(b"value")
            }
        ));
        assert!(matches!(
            recs[3],
            Record::State {
                seq: 6,
                key: b"s\0t\0k",
                value: None,
                ..
            }
        ));
    }

    #[test]
    fn truncated_and_corrupt_frames_are_reported() {
        let mut buf = Vec::new();
        encode_message(
            &mut buf,
            MessageKind::Publish,
            1,
            &[PartitionId(1)],
            &data(b"x"),
            0,
        );
        for cut in 0..buf.len() {
            assert_eq!(
                split_frame(&buf[..cut]),
                Err(FrameError::Truncated),
                "cut {cut}"
            );
        }
        for i in 4..buf.len() {
            let mut bad = buf.clone();
            bad[i] ^= 0x40;
            assert!(
                matches!(split_frame(&bad), Err(FrameError::Corrupt(_))),
                "flip {i}"
            );
        }
    }

    #[test]
    fn decoder_never_panics_on_garbage() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for _ in 0..20_000 {
            let n = rng.gen_range(0..64);
            let mut b: Vec<u8> = (0..n).map(|_| rng.gen()).collect();
            if !b.is_empty() {
                b[0] = rng.gen_range(0..18);
            }
            let _ = decode_payload(&b);
            let _ = split_frame(&b);
        }
    }
}
