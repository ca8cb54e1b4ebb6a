//! Framing and the byte-level checks `mqttbytes` does not make.
//!
//! `mqttbytes` 0.6 decodes PUBLISH, SUBSCRIBE and (3.1.1) UNSUBSCRIBE here
//! and encodes everything the server sends. It is lenient or wrong in ways a
//! server cannot be, so this module checks the bytes first and decodes the
//! rest itself:
//!
//! * fixed header: the reserved flag bits of each packet type are not
//!   checked (SUBSCRIBE must have `0010`, PUBLISH must not have QoS 3 or DUP
//!   on QoS 0, …); remaining lengths of fixed-size packets (PINGREQ,
//!   3.1.1 acks and DISCONNECT) are not checked either.
//! * properties: duplicates are accepted (the last wins), properties not
//!   allowed in the packet are accepted when the parser knows them, flag
//!   values other than 0/1 pass, NUL characters in strings pass, and a
//!   property block whose last property runs past its declared length is
//!   read into the payload. [`props`] walks every block first.
//! * CONNECT: the password is decoded as a UTF-8 string (MQTT passwords are
//!   binary), an empty user name and an absent one are the same, a
//!   password without the user name flag is not caught, protocol level 3
//!   ("MQIsdp") is an error instead of a CONNACK — decoded here.
//! * MQTT 5 DISCONNECT with remaining length 0 or 1 (reason code only) and
//!   the acks' reason codes fail to parse; MQTT 5 UNSUBSCRIBE `dbg!`-prints
//!   to stderr — decoded here.
//! * string lengths are written as `len as u16`: callers keep strings
//!   under 64 KiB.
//!
//! No decoder here indexes or subtracts without a check: every read goes
//! through [`Reader`], which fails with a malformed-packet [`Fault`].

use super::reason;
use bytes::{BufMut, BytesMut};
use std::borrow::Cow;

/// Packet types (the high nibble of the first byte).
pub(super) mod kind {
    pub const CONNECT: u8 = 1;
    pub const CONNACK: u8 = 2;
    pub const PUBLISH: u8 = 3;
    pub const PUBACK: u8 = 4;
    pub const PUBREC: u8 = 5;
    pub const PUBREL: u8 = 6;
    pub const PUBCOMP: u8 = 7;
    pub const SUBSCRIBE: u8 = 8;
    pub const SUBACK: u8 = 9;
    pub const UNSUBSCRIBE: u8 = 10;
    pub const UNSUBACK: u8 = 11;
    pub const PINGREQ: u8 = 12;
    pub const PINGRESP: u8 = 13;
    pub const DISCONNECT: u8 = 14;
    pub const AUTH: u8 = 15;
}

/// Most user properties in one property block (MQTT 5 allows as many as
/// the packet holds: 3.3 million empty ones fit 16 MiB, each a pair of
/// strings in memory, ten times its 5 bytes on the wire). More: 0x95.
pub const MAX_USER_PROPERTIES: usize = 128;
/// Most bytes of user property names and values in one property block
/// (more: 0x95). Every other property occurs at most once per block and
/// is at most 64 KiB, so this bounds what a block can make us hold.
pub const MAX_USER_PROPERTY_BYTES: usize = 16 * 1024;

/// Largest remaining length a 4-byte variable byte integer can hold.
pub(super) const MAX_VARINT: u32 = 268_435_455;

/// Why a packet ends the connection: an MQTT 5 reason code (also used for
/// 3.1.1, where nothing is sent) and a text for the reason string and logs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Fault {
    pub code: u8,
    pub text: Cow<'static, str>,
}

impl Fault {
    pub fn new(code: u8, text: impl Into<Cow<'static, str>>) -> Fault {
        Fault {
            code,
            text: text.into(),
        }
    }

    /// 0x81: the bytes do not follow the packet format.
    pub fn malformed(text: impl Into<Cow<'static, str>>) -> Fault {
        Fault::new(reason::MALFORMED_PACKET, text)
    }

    /// 0x82: well formed, but not allowed here.
    pub fn protocol(text: impl Into<Cow<'static, str>>) -> Fault {
        Fault::new(reason::PROTOCOL_ERROR, text)
    }
}

/// Maps an `mqttbytes` decoding error to a fault. Any error after the
/// packet was framed means the packet is malformed (a zero packet
/// identifier is a protocol error).
pub(super) fn codec_fault(e: mqttbytes::Error, what: &'static str) -> Fault {
    match e {
        mqttbytes::Error::PacketIdZero => {
            Fault::protocol(format!("{what} with packet identifier 0"))
        }
        mqttbytes::Error::TopicNotUtf8 => {
            Fault::malformed(format!("{what}: string is not valid UTF-8"))
        }
        e => Fault::malformed(format!("{what}: {e:?}")),
    }
}

/// A parsed fixed header.
#[derive(Clone, Copy, Debug)]
pub(super) struct Header {
    /// The first byte (type and flags).
    pub byte1: u8,
    /// Bytes of the fixed header (2 to 5).
    pub header_len: usize,
    /// Bytes after the fixed header.
    pub remaining: usize,
}

impl Header {
    pub fn kind(&self) -> u8 {
        self.byte1 >> 4
    }

    pub fn flags(&self) -> u8 {
        self.byte1 & 0x0F
    }

    /// Size of the whole packet.
    pub fn total(&self) -> usize {
        self.header_len + self.remaining
    }

    /// The same header for `mqttbytes`.
    pub fn codec(&self) -> mqttbytes::FixedHeader {
        mqttbytes::FixedHeader::new(self.byte1, self.header_len - 1, self.remaining)
    }
}

/// Reads the fixed header at the start of `buf`: `Ok(None)` until its last
/// byte arrived. Only the length encoding is checked here.
pub(super) fn fixed_header(buf: &[u8]) -> Result<Option<Header>, Fault> {
    let Some((&byte1, rest)) = buf.split_first() else {
        return Ok(None);
    };
    let mut value = 0usize;
    for (i, &b) in rest.iter().take(4).enumerate() {
        value |= usize::from(b & 0x7F) << (7 * i);
        if b & 0x80 == 0 {
            return Ok(Some(Header {
                byte1,
                header_len: i + 2,
                remaining: value,
            }));
        }
    }
    if rest.len() >= 4 {
        return Err(Fault::malformed("remaining length longer than 4 bytes"));
    }
    Ok(None)
}

/// Checks the fixed header flags of a packet type (MQTT 5 2.1.3; 3.1.1
/// 2.2.2): reserved values are fixed, and a PUBLISH must not carry QoS 3
/// or DUP with QoS 0. Types 0 and 15 (AUTH, 5 only) are the caller's.
pub(super) fn check_flags(h: &Header) -> Result<(), Fault> {
    let expected = match h.kind() {
        kind::PUBLISH => {
            let qos = (h.flags() >> 1) & 3;
            if qos == 3 {
                return Err(Fault::malformed("PUBLISH with QoS 3"));
            }
            if qos == 0 && h.flags() & 0b1000 != 0 {
                return Err(Fault::malformed("PUBLISH with QoS 0 and DUP set"));
            }
            return Ok(());
        }
        kind::PUBREL | kind::SUBSCRIBE | kind::UNSUBSCRIBE => 0b0010,
        _ => 0,
    };
    if h.flags() != expected {
        return Err(Fault::malformed(format!(
            "reserved flags {:#06b} on packet type {}",
            h.flags(),
            h.kind()
        )));
    }
    Ok(())
}

/// Bytes of a variable byte integer holding `v`.
pub(super) fn varint_len(v: usize) -> usize {
    match v {
        0..=127 => 1,
        128..=16_383 => 2,
        16_384..=2_097_151 => 3,
        _ => 4,
    }
}

/// Writes a variable byte integer (`v` at most [`MAX_VARINT`]).
pub(super) fn put_varint(out: &mut BytesMut, mut v: usize) {
    loop {
        let mut b = (v % 128) as u8;
        v /= 128;
        if v > 0 {
            b |= 0x80;
        }
        out.put_u8(b);
        if v == 0 {
            return;
        }
    }
}

/// A cursor over a packet body; every read is bounds-checked.
pub(super) struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Reader<'a> {
        Reader { buf, pos: 0 }
    }

    pub fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    pub fn is_empty(&self) -> bool {
        self.remaining() == 0
    }

    /// The next `n` bytes.
    pub fn take(&mut self, n: usize) -> Result<&'a [u8], Fault> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&end| end <= self.buf.len())
            .ok_or_else(|| Fault::malformed("packet shorter than its fields"))?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    pub fn u8(&mut self) -> Result<u8, Fault> {
        Ok(self.take(1)?[0])
    }

    pub fn u16(&mut self) -> Result<u16, Fault> {
        let b = self.take(2)?;
        Ok(u16::from_be_bytes([b[0], b[1]]))
    }

    pub fn u32(&mut self) -> Result<u32, Fault> {
        let b = self.take(4)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }

    /// A variable byte integer (at most 4 bytes).
    pub fn varint(&mut self) -> Result<u32, Fault> {
        let mut value = 0u32;
        for i in 0..4 {
            let b = self.u8()?;
            value |= u32::from(b & 0x7F) << (7 * i);
            if b & 0x80 == 0 {
                return Ok(value);
            }
        }
        Err(Fault::malformed(
            "variable byte integer longer than 4 bytes",
        ))
    }

    /// Two-byte length, then that many bytes.
    pub fn binary(&mut self) -> Result<&'a [u8], Fault> {
        let n = self.u16()?;
        self.take(usize::from(n))
    }

    /// A UTF-8 encoded string: valid UTF-8 without U+0000 (MQTT 5 1.5.4,
    /// 3.1.1 1.5.3), else the packet is malformed.
    pub fn string(&mut self) -> Result<&'a str, Fault> {
        let b = self.binary()?;
        utf8(b)
    }
}

/// A UTF-8 encoded string's checks on raw bytes.
pub(super) fn utf8(b: &[u8]) -> Result<&str, Fault> {
    let s = std::str::from_utf8(b).map_err(|_| Fault::malformed("string is not valid UTF-8"))?;
    if b.contains(&0) {
        return Err(Fault::malformed("string contains U+0000"));
    }
    Ok(s)
}

/// MQTT 5 property identifiers (2.2.2.2).
pub(super) mod prop {
    pub const PAYLOAD_FORMAT: u8 = 1;
    pub const MESSAGE_EXPIRY: u8 = 2;
    pub const CONTENT_TYPE: u8 = 3;
    pub const RESPONSE_TOPIC: u8 = 8;
    pub const CORRELATION_DATA: u8 = 9;
    pub const SUBSCRIPTION_ID: u8 = 11;
    pub const SESSION_EXPIRY: u8 = 17;
    pub const ASSIGNED_CLIENT_ID: u8 = 18;
    pub const SERVER_KEEP_ALIVE: u8 = 19;
    pub const AUTH_METHOD: u8 = 21;
    pub const AUTH_DATA: u8 = 22;
    pub const REQUEST_PROBLEM_INFO: u8 = 23;
    pub const WILL_DELAY: u8 = 24;
    pub const REQUEST_RESPONSE_INFO: u8 = 25;
    pub const RESPONSE_INFO: u8 = 26;
    pub const SERVER_REFERENCE: u8 = 28;
    pub const REASON_STRING: u8 = 31;
    pub const RECEIVE_MAXIMUM: u8 = 33;
    pub const TOPIC_ALIAS_MAXIMUM: u8 = 34;
    pub const TOPIC_ALIAS: u8 = 35;
    pub const MAXIMUM_QOS: u8 = 36;
    pub const RETAIN_AVAILABLE: u8 = 37;
    pub const USER_PROPERTY: u8 = 38;
    pub const MAXIMUM_PACKET_SIZE: u8 = 39;
    pub const WILDCARD_AVAILABLE: u8 = 40;
    pub const SUBSCRIPTION_IDS_AVAILABLE: u8 = 41;
    pub const SHARED_AVAILABLE: u8 = 42;

    /// What a client may send in each packet.
    pub const CONNECT: &[u8] = &[
        SESSION_EXPIRY,
        RECEIVE_MAXIMUM,
        MAXIMUM_PACKET_SIZE,
        TOPIC_ALIAS_MAXIMUM,
        REQUEST_RESPONSE_INFO,
        REQUEST_PROBLEM_INFO,
        USER_PROPERTY,
        AUTH_METHOD,
        AUTH_DATA,
    ];
    pub const WILL: &[u8] = &[
        WILL_DELAY,
        PAYLOAD_FORMAT,
        MESSAGE_EXPIRY,
        CONTENT_TYPE,
        RESPONSE_TOPIC,
        CORRELATION_DATA,
        USER_PROPERTY,
    ];
    /// Subscription identifiers are server-to-client only (MQTT-3.3.4-6),
    /// so they are not in this list.
    pub const PUBLISH: &[u8] = &[
        PAYLOAD_FORMAT,
        MESSAGE_EXPIRY,
        TOPIC_ALIAS,
        RESPONSE_TOPIC,
        CORRELATION_DATA,
        USER_PROPERTY,
        CONTENT_TYPE,
    ];
    pub const ACK: &[u8] = &[REASON_STRING, USER_PROPERTY];
    pub const SUBSCRIBE: &[u8] = &[SUBSCRIPTION_ID, USER_PROPERTY];
    pub const UNSUBSCRIBE: &[u8] = &[USER_PROPERTY];
    pub const DISCONNECT: &[u8] = &[SESSION_EXPIRY, REASON_STRING, USER_PROPERTY];
}

/// A property value, borrowed from the packet.
#[derive(Clone, Copy, Debug)]
pub(super) enum Value<'a> {
    Byte(u8),
    Two(u16),
    Four(u32),
    Var(u32),
    Str(&'a str),
    Bin(&'a [u8]),
    Pair(&'a str, &'a str),
}

impl Value<'_> {
    pub fn int(&self) -> u32 {
        match *self {
            Value::Byte(v) => u32::from(v),
            Value::Two(v) => u32::from(v),
            Value::Four(v) | Value::Var(v) => v,
            _ => 0,
        }
    }
}

/// Walks a property block (length, then properties) at the reader's
/// position, calling `f` for each property. Unknown identifiers and
/// truncated values are malformed; a property not in `allowed`, a repeated
/// one (but user properties) and a flag outside 0/1 are protocol errors;
/// more than [`MAX_USER_PROPERTIES`] user properties or
/// [`MAX_USER_PROPERTY_BYTES`] of them is 0x95 (packet too large), found
/// before `f` sees one too many.
pub(super) fn props<'a>(
    r: &mut Reader<'a>,
    allowed: &[u8],
    what: &'static str,
    mut f: impl FnMut(u8, Value<'a>) -> Result<(), Fault>,
) -> Result<(), Fault> {
    let len = r.varint()?;
    let block = r
        .take(len as usize)
        .map_err(|_| Fault::malformed(format!("{what}: property length past the packet end")))?;
    let mut p = Reader::new(block);
    let mut seen = 0u64;
    let (mut users, mut user_bytes) = (0usize, 0usize);
    while !p.is_empty() {
        let id = p.varint()?;
        let Ok(id) = u8::try_from(id) else {
            return Err(Fault::malformed(format!("{what}: unknown property {id}")));
        };
        let value = match id {
            prop::PAYLOAD_FORMAT
            | prop::REQUEST_PROBLEM_INFO
            | prop::REQUEST_RESPONSE_INFO
            | prop::MAXIMUM_QOS
            | prop::RETAIN_AVAILABLE
            | prop::WILDCARD_AVAILABLE
            | prop::SUBSCRIPTION_IDS_AVAILABLE
            | prop::SHARED_AVAILABLE => Value::Byte(p.u8()?),
            prop::SERVER_KEEP_ALIVE
            | prop::RECEIVE_MAXIMUM
            | prop::TOPIC_ALIAS_MAXIMUM
            | prop::TOPIC_ALIAS => Value::Two(p.u16()?),
            prop::MESSAGE_EXPIRY
            | prop::SESSION_EXPIRY
            | prop::WILL_DELAY
            | prop::MAXIMUM_PACKET_SIZE => Value::Four(p.u32()?),
            prop::SUBSCRIPTION_ID => Value::Var(p.varint()?),
            prop::CONTENT_TYPE
            | prop::RESPONSE_TOPIC
            | prop::ASSIGNED_CLIENT_ID
            | prop::AUTH_METHOD
            | prop::RESPONSE_INFO
            | prop::SERVER_REFERENCE
            | prop::REASON_STRING => Value::Str(p.string()?),
            prop::CORRELATION_DATA | prop::AUTH_DATA => Value::Bin(p.binary()?),
            prop::USER_PROPERTY => {
                let k = p.string()?;
                let v = p.string()?;
                users += 1;
                user_bytes += k.len() + v.len();
                if users > MAX_USER_PROPERTIES || user_bytes > MAX_USER_PROPERTY_BYTES {
                    return Err(Fault::new(
                        reason::PACKET_TOO_LARGE,
                        format!(
                            "{what}: more than {MAX_USER_PROPERTIES} user properties \
                             or {MAX_USER_PROPERTY_BYTES} bytes of them"
                        ),
                    ));
                }
                Value::Pair(k, v)
            }
            _ => return Err(Fault::malformed(format!("{what}: unknown property {id}"))),
        };
        if !allowed.contains(&id) {
            return Err(Fault::protocol(format!(
                "{what}: property {id} not allowed"
            )));
        }
        if id != prop::USER_PROPERTY {
            let bit = 1u64 << id;
            if seen & bit != 0 {
                return Err(Fault::protocol(format!("{what}: property {id} repeated")));
            }
            seen |= bit;
        }
        if let Value::Byte(v) = value {
            if v > 1 {
                return Err(Fault::protocol(format!(
                    "{what}: property {id} is {v}, not 0 or 1"
                )));
            }
        }
        f(id, value)?;
    }
    Ok(())
}

/// An acknowledgement (PUBACK, PUBREC, PUBREL, PUBCOMP) from the client.
#[derive(Clone, Copy, Debug)]
pub(super) struct Ack {
    pub packet_id: u16,
    pub reason: u8,
}

/// Decodes an ack body. 3.1.1: exactly the packet id. MQTT 5: the packet
/// id, then optionally a reason code and properties (3.4.2.1).
pub(super) fn ack(body: &[u8], v5: bool, what: &'static str) -> Result<Ack, Fault> {
    let mut r = Reader::new(body);
    let packet_id = r.u16()?;
    if !v5 {
        if !r.is_empty() {
            return Err(Fault::malformed(format!("{what} longer than 2 bytes")));
        }
        return Ok(Ack {
            packet_id,
            reason: 0,
        });
    }
    let reason = if r.is_empty() { 0 } else { r.u8()? };
    if !r.is_empty() {
        props(&mut r, prop::ACK, what, |_, _| Ok(()))?;
    }
    if !r.is_empty() {
        return Err(Fault::malformed(format!(
            "{what}: bytes after the properties"
        )));
    }
    Ok(Ack { packet_id, reason })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fixed_header_lengths() {
        assert!(fixed_header(&[]).unwrap().is_none());
        assert!(fixed_header(&[0x30]).unwrap().is_none());
        assert!(fixed_header(&[0x30, 0x80]).unwrap().is_none());
        let h = fixed_header(&[0x30, 0x80, 0x01]).unwrap().unwrap();
        assert_eq!((h.header_len, h.remaining), (3, 128));
        let h = fixed_header(&[0x30, 0xFF, 0xFF, 0xFF, 0x7F])
            .unwrap()
            .unwrap();
        assert_eq!(h.remaining, MAX_VARINT as usize);
        assert_eq!(
            fixed_header(&[0x30, 0xFF, 0xFF, 0xFF, 0xFF])
                .unwrap_err()
                .code,
            reason::MALFORMED_PACKET
        );
    }

    #[test]
    fn varint_round_trip() {
        for v in [
            0usize,
            127,
            128,
            16_383,
            16_384,
            2_097_151,
            2_097_152,
            MAX_VARINT as usize,
        ] {
            let mut b = BytesMut::new();
            put_varint(&mut b, v);
            assert_eq!(b.len(), varint_len(v), "{v}");
            assert_eq!(Reader::new(&b).varint().unwrap() as usize, v);
        }
    }

    #[test]
    fn property_walk() {
        // Length 3: payload format 1, then a truncated message expiry.
        let mut r = Reader::new(&[3, 1, 1, 2]);
        let e = props(&mut r, prop::PUBLISH, "t", |_, _| Ok(())).unwrap_err();
        assert_eq!(e.code, reason::MALFORMED_PACKET);
        // Declared length past the end.
        let mut r = Reader::new(&[9, 1, 1]);
        assert!(props(&mut r, prop::PUBLISH, "t", |_, _| Ok(())).is_err());
        // Repeated.
        let mut r = Reader::new(&[4, 1, 1, 1, 0]);
        let e = props(&mut r, prop::PUBLISH, "t", |_, _| Ok(())).unwrap_err();
        assert_eq!(e.code, reason::PROTOCOL_ERROR);
        // Not allowed here.
        let mut r = Reader::new(&[2, 11, 1]);
        let e = props(&mut r, prop::PUBLISH, "t", |_, _| Ok(())).unwrap_err();
        assert_eq!(e.code, reason::PROTOCOL_ERROR);
        // Flag out of range.
        let mut r = Reader::new(&[2, 1, 2]);
        let e = props(&mut r, prop::PUBLISH, "t", |_, _| Ok(())).unwrap_err();
        assert_eq!(e.code, reason::PROTOCOL_ERROR);
        // Unknown.
        let mut r = Reader::new(&[2, 99, 0]);
        let e = props(&mut r, prop::PUBLISH, "t", |_, _| Ok(())).unwrap_err();
        assert_eq!(e.code, reason::MALFORMED_PACKET);
        // Two user properties, then the block ends where declared.
        let mut r = Reader::new(&[11, 38, 0, 1, b'k', 0, 0, 38, 0, 0, 0, 0, 0xAA]);
        let mut n = 0;
        props(&mut r, prop::PUBLISH, "t", |_, _| {
            n += 1;
            Ok(())
        })
        .unwrap();
        assert_eq!((n, r.remaining()), (2, 1));
    }

    #[test]
    fn user_properties_are_bounded() {
        // `n` user properties with `len`-byte names and empty values.
        let block = |n: usize, len: usize| {
            let mut body = BytesMut::new();
            for _ in 0..n {
                body.put_u8(prop::USER_PROPERTY);
                body.put_u16(len as u16);
                body.put_bytes(b'k', len);
                body.put_u16(0);
            }
            let mut b = BytesMut::new();
            put_varint(&mut b, body.len());
            b.extend_from_slice(&body);
            b
        };
        let walk = |b: &[u8]| {
            let mut seen = 0;
            let r = props(&mut Reader::new(b), prop::PUBLISH, "t", |_, _| {
                seen += 1;
                Ok(())
            });
            (r, seen)
        };
        assert_eq!(walk(&block(MAX_USER_PROPERTIES, 0)).0, Ok(()));
        let (r, seen) = walk(&block(MAX_USER_PROPERTIES + 1, 0));
        assert_eq!(r.unwrap_err().code, reason::PACKET_TOO_LARGE);
        assert_eq!(seen, MAX_USER_PROPERTIES, "refused before the one too many");
        let per = MAX_USER_PROPERTY_BYTES / 8;
        assert_eq!(walk(&block(8, per)).0, Ok(()));
        let (r, _) = walk(&block(9, per));
        assert_eq!(r.unwrap_err().code, reason::PACKET_TOO_LARGE);
    }

    #[test]
    fn strings() {
        assert!(utf8(b"ok").is_ok());
        assert!(utf8(b"a\0").is_err());
        assert!(utf8(&[0xC0, 0x80]).is_err());
        assert!(utf8(&[0xED, 0xA0, 0x80]).is_err()); // a surrogate
    }
}
