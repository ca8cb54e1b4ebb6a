//! Value encodings: chunk records, live entries, owners, and positions.

use weir_backend::{Location, MessageAttrs, MessageData, StoredMessage};

/// The tag in a position's first word: positions of other stores are told
/// apart (a read of one is `NotFound`).
const TAG: u32 = 0xFD00_0000;

/// Largest chunk id a position can name (56 bits).
pub const MAX_CHUNK: u64 = (1 << 56) - 1;

/// A position: the chunk and the record's byte offset in it.
pub fn location(chunk: u64, offset: u32) -> Location {
    Location::from_words([
        TAG | ((chunk >> 32) as u32 & 0x00ff_ffff),
        chunk as u32,
        offset,
    ])
}

/// The chunk and offset of a position of this store.
pub fn decode_location(loc: Location) -> Option<(u64, u32)> {
    let [a, b, c] = loc.words();
    (a & 0xff00_0000 == TAG).then(|| ((u64::from(a & 0x00ff_ffff) << 32) | u64::from(b), c))
}

fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    out.extend_from_slice(&(b.len() as u32).to_le_bytes());
    out.extend_from_slice(b);
}

/// Appends one message record to a chunk: its length, then the message.
pub fn encode_record(out: &mut Vec<u8>, id: u64, d: &MessageData<'_>) {
    let start = out.len();
    out.extend_from_slice(&0u32.to_le_bytes());
    out.extend_from_slice(&id.to_le_bytes());
    out.push(d.header_format);
    out.push(d.attrs.priority);
    out.extend_from_slice(&d.attrs.expires_at_ms.to_le_bytes());
    out.extend_from_slice(&d.attrs.deliver_at_ms.to_le_bytes());
    put_bytes(out, d.exchange.as_bytes());
    put_bytes(out, d.routing_key.as_bytes());
    put_bytes(out, d.header);
    put_bytes(out, d.body);
    let len = (out.len() - start - 4) as u32;
    out[start..start + 4].copy_from_slice(&len.to_le_bytes());
}

/// The encoded size of a record ([`encode_record`]).
pub fn record_size(d: &MessageData<'_>) -> usize {
    4 + 8 + 2 + 16 + 16 + d.exchange.len() + d.routing_key.len() + d.header.len() + d.body.len()
}

/// A cursor over bytes that fails instead of panicking on short input.
struct Cursor<'a>(&'a [u8]);

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let (a, b) = (self.0.get(..n)?, self.0.get(n..)?);
        self.0 = b;
        Some(a)
    }
    fn u8(&mut self) -> Option<u8> {
        Some(self.take(1)?[0])
    }
    fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.take(4)?.try_into().ok()?))
    }
    fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
    }
    fn bytes(&mut self) -> Option<&'a [u8]> {
        let n = self.u32()? as usize;
        self.take(n)
    }
}

/// The length of the record starting at `buf` (after its length word), if
/// `buf` holds the length word.
pub fn record_len(buf: &[u8]) -> Option<usize> {
    Cursor(buf).u32().map(|n| n as usize)
}

/// Decodes the record at the start of `buf` (length word included).
pub fn decode_record(buf: &[u8]) -> Option<StoredMessage> {
    let mut c = Cursor(buf);
    let len = c.u32()? as usize;
    let mut c = Cursor(c.take(len)?);
    let id = c.u64()?;
    let header_format = c.u8()?;
    let priority = c.u8()?;
    let expires_at_ms = c.u64()?;
    let deliver_at_ms = c.u64()?;
    let exchange = String::from_utf8(c.bytes()?.to_vec()).ok()?;
    let routing_key = String::from_utf8(c.bytes()?.to_vec()).ok()?;
    let header = bytes::Bytes::copy_from_slice(c.bytes()?);
    let body = bytes::Bytes::copy_from_slice(c.bytes()?);
    Some(StoredMessage {
        id,
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
    })
}

/// A live entry: where the message is and what recovery reports of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LiveEntry {
    /// Its chunk.
    pub chunk: u64,
    /// Its record's offset in the chunk.
    pub offset: u32,
    /// Body length.
    pub size: u32,
    /// Deliveries recorded by requeues.
    pub attempts: u32,
    /// Attributes (deliver_at as of the last requeue).
    pub attrs: MessageAttrs,
}

impl LiveEntry {
    /// Encodes it.
    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(37);
        v.extend_from_slice(&self.chunk.to_le_bytes());
        v.extend_from_slice(&self.offset.to_le_bytes());
        v.extend_from_slice(&self.size.to_le_bytes());
        v.extend_from_slice(&self.attempts.to_le_bytes());
        v.push(self.attrs.priority);
        v.extend_from_slice(&self.attrs.expires_at_ms.to_le_bytes());
        v.extend_from_slice(&self.attrs.deliver_at_ms.to_le_bytes());
        v
    }

    /// Decodes one; `None` when damaged.
    pub fn decode(v: &[u8]) -> Option<Self> {
        let mut c = Cursor(v);
        Some(LiveEntry {
            chunk: c.u64()?,
            offset: c.u32()?,
            size: c.u32()?,
            attempts: c.u32()?,
            attrs: MessageAttrs {
                priority: c.u8()?,
                expires_at_ms: c.u64()?,
                deliver_at_ms: c.u64()?,
            },
        })
    }
}

/// Two little-endian u64s (partition state: generation and truncation
/// point).
pub fn pair(a: u64, b: u64) -> Vec<u8> {
    let mut v = a.to_le_bytes().to_vec();
    v.extend_from_slice(&b.to_le_bytes());
    v
}

/// Decodes [`pair`]; absent or damaged: (0, 0).
pub fn unpair(v: Option<&[u8]>) -> (u64, u64) {
    let mut c = Cursor(v.unwrap_or_default());
    (c.u64().unwrap_or(0), c.u64().unwrap_or(0))
}

/// An owner value: epoch and node name.
pub fn owner(epoch: u64, node: &[u8]) -> Vec<u8> {
    let mut v = epoch.to_le_bytes().to_vec();
    v.extend_from_slice(node);
    v
}

/// Decodes [`owner`].
pub fn unowner(v: &[u8]) -> Option<(u64, &[u8])> {
    let e = u64::from_le_bytes(v.get(..8)?.try_into().ok()?);
    Some((e, &v[8..]))
}

/// A metadata feed event: key, and value if set.
pub fn feed_event(key: &[u8], value: Option<&[u8]>) -> Vec<u8> {
    let mut v = Vec::new();
    put_bytes(&mut v, key);
    match value {
        Some(val) => {
            v.push(1);
            v.extend_from_slice(val);
        }
        None => v.push(0),
    }
    v
}

/// Decodes [`feed_event`].
pub fn unfeed(v: &[u8]) -> Option<(Vec<u8>, Option<Vec<u8>>)> {
    let mut c = Cursor(v);
    let key = c.bytes()?.to_vec();
    let set = c.u8()? == 1;
    Some((key, set.then(|| c.0.to_vec())))
}
