//! The few MQTT 3.1.1 packets the benchmark needs, written and read by hand.
//!
//! Like weir-bench's AMQP hot path: a generic codec (mqttbytes) allocates a `String` per topic and a
//! packet enum per message, which on a 2-core machine shared with the broker would partly measure
//! the client. Every packet here is a fixed layout; the unit tests check each against mqttbytes.

use crate::conn::{err, Result};

/// Packet types (high nibble of the first byte).
const CONNECT: u8 = 1;
const CONNACK: u8 = 2;
const PUBLISH: u8 = 3;
const PUBACK: u8 = 4;
const SUBSCRIBE: u8 = 8;
const SUBACK: u8 = 9;
const PINGRESP: u8 = 13;
const DISCONNECT: u8 = 14;

/// Bytes a publish payload starts with: the send time (ns since the process epoch) and a sequence
/// number, both big-endian u64.
pub const STAMP: usize = 16;

/// Append the MQTT variable-length "remaining length".
pub fn put_len(out: &mut Vec<u8>, mut n: usize) {
    loop {
        let mut b = (n % 128) as u8;
        n /= 128;
        if n > 0 {
            b |= 0x80;
        }
        out.push(b);
        if n == 0 {
            break;
        }
    }
}

/// Append a length-prefixed MQTT string (or binary data).
pub fn put_str(out: &mut Vec<u8>, s: &[u8]) {
    out.extend_from_slice(&(s.len() as u16).to_be_bytes());
    out.extend_from_slice(s);
}

/// What a CONNECT says.
#[derive(Debug, Clone)]
pub struct ConnectOpts<'a> {
    pub client_id: &'a str,
    pub user: Option<&'a str>,
    pub pass: Option<&'a str>,
    pub clean_session: bool,
    pub keep_alive: u16,
}

/// Append a 3.1.1 CONNECT.
pub fn connect(out: &mut Vec<u8>, o: &ConnectOpts<'_>) {
    let mut body = Vec::with_capacity(64);
    put_str(&mut body, b"MQTT");
    body.push(4); // protocol level 3.1.1
    let mut flags = 0u8;
    if o.clean_session {
        flags |= 0x02;
    }
    if o.user.is_some() {
        flags |= 0x80;
    }
    if o.pass.is_some() {
        flags |= 0x40;
    }
    body.push(flags);
    body.extend_from_slice(&o.keep_alive.to_be_bytes());
    put_str(&mut body, o.client_id.as_bytes());
    if let Some(u) = o.user {
        put_str(&mut body, u.as_bytes());
    }
    if let Some(p) = o.pass {
        put_str(&mut body, p.as_bytes());
    }
    out.push(CONNECT << 4);
    put_len(out, body.len());
    out.extend_from_slice(&body);
}

/// Append a SUBSCRIBE of one filter at `qos`.
pub fn subscribe(out: &mut Vec<u8>, packet_id: u16, filter: &str, qos: u8) {
    out.push((SUBSCRIBE << 4) | 0x02);
    put_len(out, 2 + 2 + filter.len() + 1);
    out.extend_from_slice(&packet_id.to_be_bytes());
    put_str(out, filter.as_bytes());
    out.push(qos);
}

/// Append a PUBACK.
#[inline]
pub fn puback(out: &mut Vec<u8>, packet_id: u16) {
    let id = packet_id.to_be_bytes();
    out.extend_from_slice(&[PUBACK << 4, 2, id[0], id[1]]);
}

/// Append a DISCONNECT.
pub fn disconnect(out: &mut Vec<u8>) {
    out.extend_from_slice(&[DISCONNECT << 4, 0]);
}

/// A pre-encoded PUBLISH: every publish of a run is the same bytes except for the packet id, the
/// send time and the sequence number, patched in per copy (a ~300-byte memcpy per message).
pub struct PublishTemplate {
    bytes: Vec<u8>,
    /// Offset of the packet id (QoS > 0 only).
    id_at: Option<usize>,
    /// Offset of the payload's first byte.
    payload_at: usize,
}

impl PublishTemplate {
    /// A publish of `size` bytes (at least [`STAMP`]) to `topic` at `qos` (0 or 1).
    pub fn new(topic: &str, qos: u8, size: usize) -> Result<PublishTemplate> {
        if size < STAMP {
            return err(format!("payload size {size} is under {STAMP} bytes"));
        }
        if qos > 1 {
            return err("only QoS 0 and 1 are benchmarked");
        }
        let id_len = if qos > 0 { 2 } else { 0 };
        let mut bytes = vec![(PUBLISH << 4) | (qos << 1)];
        put_len(&mut bytes, 2 + topic.len() + id_len + size);
        put_str(&mut bytes, topic.as_bytes());
        let id_at = (qos > 0).then_some(bytes.len());
        bytes.extend(std::iter::repeat_n(0u8, id_len));
        let payload_at = bytes.len();
        bytes.resize(payload_at + size, b'x');
        Ok(PublishTemplate {
            bytes,
            id_at,
            payload_at,
        })
    }

    /// Append one copy with these stamps.
    #[inline]
    pub fn append(&self, out: &mut Vec<u8>, packet_id: u16, ts_ns: u64, seq: u64) {
        let base = out.len();
        out.extend_from_slice(&self.bytes);
        if let Some(at) = self.id_at {
            out[base + at..base + at + 2].copy_from_slice(&packet_id.to_be_bytes());
        }
        let p = base + self.payload_at;
        out[p..p + 8].copy_from_slice(&ts_ns.to_be_bytes());
        out[p + 8..p + 16].copy_from_slice(&seq.to_be_bytes());
    }
}

/// A packet from the broker, as much of it as the benchmark looks at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Packet {
    ConnAck {
        session_present: bool,
        code: u8,
    },
    SubAck {
        packet_id: u16,
        /// The first (only) return code: granted QoS or 0x80.
        code: u8,
    },
    /// A delivery; `ts`/`seq` are the payload's stamps (0 if it is shorter than [`STAMP`]).
    Publish {
        qos: u8,
        dup: bool,
        packet_id: u16,
        ts: u64,
        seq: u64,
    },
    PubAck {
        packet_id: u16,
    },
    PingResp,
    /// Anything else (the benchmark never expects it): its type.
    Other(u8),
}

/// Largest packet accepted from the broker: far above anything the benchmark makes it send.
const MAX_PACKET: usize = 1 << 20;

/// Parse the packet at the front of `buf`: `Ok(None)` when incomplete, else the packet and its
/// length.
pub fn parse(buf: &[u8]) -> Result<Option<(Packet, usize)>> {
    let Some(&first) = buf.first() else {
        return Ok(None);
    };
    // Remaining length: up to 4 bytes of 7 bits.
    let mut len = 0usize;
    let mut i = 1;
    loop {
        let Some(&b) = buf.get(i) else {
            return Ok(None);
        };
        len |= usize::from(b & 0x7f) << (7 * (i - 1));
        i += 1;
        if b & 0x80 == 0 {
            break;
        }
        if i > 4 {
            return err("malformed remaining length from the broker");
        }
    }
    if len > MAX_PACKET {
        return err(format!("packet of {len} bytes from the broker"));
    }
    let total = i + len;
    let Some(body) = buf.get(i..total) else {
        return Ok(None);
    };
    let u16_at = |at: usize| -> Result<u16> {
        body.get(at..at + 2)
            .map(|b| u16::from_be_bytes([b[0], b[1]]))
            .ok_or_else(|| crate::conn::BenchError(format!("short packet type {}", first >> 4)))
    };
    let u64_at = |at: usize| -> u64 {
        body.get(at..at + 8)
            .and_then(|b| <[u8; 8]>::try_from(b).ok())
            .map_or(0, u64::from_be_bytes)
    };
    let p = match first >> 4 {
        CONNACK => Packet::ConnAck {
            session_present: body.first().is_some_and(|f| f & 1 == 1),
            code: body.get(1).copied().unwrap_or(0xff),
        },
        SUBACK => Packet::SubAck {
            packet_id: u16_at(0)?,
            code: body.get(2).copied().unwrap_or(0x80),
        },
        PUBLISH => {
            let qos = (first >> 1) & 3;
            let topic_len = usize::from(u16_at(0)?);
            let mut at = 2 + topic_len;
            let packet_id = if qos > 0 {
                let id = u16_at(at)?;
                at += 2;
                id
            } else {
                0
            };
            let (ts, seq) = if body.len() >= at + STAMP {
                (u64_at(at), u64_at(at + 8))
            } else {
                (0, 0)
            };
            Packet::Publish {
                qos,
                dup: first & 0x08 != 0,
                packet_id,
                ts,
                seq,
            }
        }
        PUBACK => Packet::PubAck {
            packet_id: u16_at(0)?,
        },
        PINGRESP => Packet::PingResp,
        t => Packet::Other(t),
    };
    Ok(Some((p, total)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::BytesMut;
    use mqttbytes::v4;

    fn decode(bytes: &[u8]) -> v4::Packet {
        let mut b = BytesMut::from(bytes);
        let p = v4::read(&mut b, 1 << 20).unwrap();
        assert!(b.is_empty(), "trailing bytes");
        p
    }

    #[test]
    fn connect_is_what_mqttbytes_reads() {
        let mut out = Vec::new();
        connect(
            &mut out,
            &ConnectOpts {
                client_id: "c1",
                user: Some("guest"),
                pass: Some("pw"),
                clean_session: false,
                keep_alive: 60,
            },
        );
        match decode(&out) {
            v4::Packet::Connect(c) => {
                assert_eq!(c.client_id, "c1");
                assert!(!c.clean_session);
                assert_eq!(c.keep_alive, 60);
                let l = c.login.unwrap();
                assert_eq!((l.username.as_str(), l.password.as_str()), ("guest", "pw"));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn subscribe_puback_disconnect_decode() {
        let mut out = Vec::new();
        subscribe(&mut out, 7, "a/b", 1);
        match decode(&out) {
            v4::Packet::Subscribe(s) => {
                assert_eq!(s.pkid, 7);
                assert_eq!(s.filters[0].path, "a/b");
                assert_eq!(s.filters[0].qos, mqttbytes::QoS::AtLeastOnce);
            }
            other => panic!("{other:?}"),
        }
        for (f, want) in [
            (puback as fn(&mut Vec<u8>, u16), "PubAck"),
            (|o: &mut Vec<u8>, _| disconnect(o), "Disconnect"),
        ] {
            let mut out = Vec::new();
            f(&mut out, 300);
            let p = format!("{:?}", decode(&out));
            assert!(p.starts_with(want), "{p}");
        }
    }

    #[test]
    fn publish_template_round_trips() {
        for (qos, size) in [(0u8, 16usize), (1, 256), (1, 200_000)] {
            let t = PublishTemplate::new("bench/t", qos, size).unwrap();
            let mut out = Vec::new();
            t.append(&mut out, 513, 0x0102_0304_0506_0708, 42);
            match decode(&out) {
                v4::Packet::Publish(p) => {
                    assert_eq!(p.topic, "bench/t");
                    assert_eq!(p.payload.len(), size);
                    assert_eq!(p.pkid, if qos == 1 { 513 } else { 0 });
                    assert_eq!(p.payload[..8], 0x0102_0304_0506_0708u64.to_be_bytes());
                }
                other => panic!("{other:?}"),
            }
            // And our own parser reads it back, in pieces too.
            let (p, n) = parse(&out).unwrap().unwrap();
            assert_eq!(n, out.len());
            assert_eq!(
                p,
                Packet::Publish {
                    qos,
                    dup: false,
                    packet_id: if qos == 1 { 513 } else { 0 },
                    ts: 0x0102_0304_0506_0708,
                    seq: 42
                }
            );
            assert_eq!(parse(&out[..out.len() - 1]).unwrap(), None);
        }
        assert!(PublishTemplate::new("t", 1, 8).is_err());
    }

    #[test]
    fn parses_what_brokers_send() {
        let mut b = BytesMut::new();
        v4::ConnAck::new(v4::ConnectReturnCode::Success, true)
            .write(&mut b)
            .unwrap();
        v4::SubAck::new(
            9,
            vec![v4::SubscribeReasonCode::Success(
                mqttbytes::QoS::AtLeastOnce,
            )],
        )
        .write(&mut b)
        .unwrap();
        v4::PubAck::new(65535).write(&mut b).unwrap();
        v4::PingResp.write(&mut b).unwrap();
        let mut at = 0;
        let mut got = Vec::new();
        while let Some((p, n)) = parse(&b[at..]).unwrap() {
            got.push(p);
            at += n;
        }
        assert_eq!(
            got,
            vec![
                Packet::ConnAck {
                    session_present: true,
                    code: 0
                },
                Packet::SubAck {
                    packet_id: 9,
                    code: 1
                },
                Packet::PubAck { packet_id: 65535 },
                Packet::PingResp,
            ]
        );
        assert!(parse(&[0x30, 0xff, 0xff, 0xff, 0xff, 0x01]).is_err());
    }
}
