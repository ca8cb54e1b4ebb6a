//! Telling a torn tail from corruption.
//!
//! A crash mid-write can only damage the end of the data written to the head
//! segment: a partial or invalid last record, followed by nothing valid (with
//! preallocated segments: followed only by zeros), and only past the
//! segment's *recorded end* (`segment.rs`), below which everything was
//! fsynced: a clean shutdown records the segment's whole length there, and
//! the writer records its fsynced end about once a second. Everything else,
//! a bad record with valid records after it, a bad record or zeros below the
//! recorded end, a segment shorter than its recorded end, or any damage in a
//! sealed segment (sealed segments are fsynced before their successor
//! exists), may hold confirmed data and is reported as corruption, never
//! truncated silently.

use super::record::{self, Record};
use super::LostRecord;
use crate::MessageId;

/// What starts at a given offset of a segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Item {
    /// A valid record of `len` bytes (framing included).
    Record { len: usize },
    /// Damage up to `end` (exclusive), where the next valid record starts,
    /// the recorded end is, or the segment ends.
    Damaged { end: usize },
    /// A partial or invalid record with nothing valid after it, at the end of
    /// the head segment and at or past its recorded end: an unconfirmed torn
    /// write.
    TornTail,
    /// Only zeros from here on in the head segment, at or past its recorded
    /// end: its preallocated, never-written rest. A clean end.
    CleanEnd,
}

/// Whether a valid record (frame checksum and payload decoding) starts at
/// `buf[0]`, and its length.
pub(crate) fn valid_record(buf: &[u8]) -> Option<usize> {
    let (payload, len) = record::split_frame(buf).ok()?;
    record::decode_payload(payload).ok()?;
    Some(len)
}

/// Classifies what starts at `off` (< `buf.len()`) of a segment whose bytes
/// are `buf`; `head` says whether it is the last (head) segment, and
/// `recorded_end` is the durable end its header records (0: none).
pub(crate) fn next_item(buf: &[u8], off: usize, head: bool, recorded_end: u64) -> Item {
    debug_assert!(off < buf.len());
    let rest = &buf[off..];
    // Below the recorded end every byte was fsynced: nothing there is torn.
    let may_be_torn = head && off as u64 >= recorded_end;
    if may_be_torn && rest.iter().all(|b| *b == 0) {
        return Item::CleanEnd;
    }
    if let Some(len) = valid_record(rest) {
        return Item::Record { len };
    }
    // Past the last non-zero byte nothing valid can start (a frame header of
    // zeros is an empty record, which is invalid).
    let data_end = buf.iter().rposition(|b| *b != 0).map_or(0, |p| p + 1);
    for next in off + 1..data_end {
        if valid_record(&buf[next..]).is_some() {
            return Item::Damaged { end: next };
        }
    }
    if may_be_torn {
        Item::TornTail
    } else if head {
        // What lies past the recorded end may still be an unconfirmed torn
        // write: the next call classifies it.
        Item::Damaged {
            end: usize::try_from(recorded_end).map_or(buf.len(), |e| e.min(buf.len())),
        }
    } else {
        Item::Damaged { end: buf.len() }
    }
}

/// Why the record at `buf[0]` was rejected, for reports.
pub(crate) fn reason(buf: &[u8]) -> String {
    match record::split_frame(buf) {
        Err(record::FrameError::Truncated) => "record runs past the valid data".into(),
        Err(record::FrameError::Corrupt(r)) => r,
        Ok((payload, _)) => match record::decode_payload(payload) {
            Err(r) => r,
            Ok(_) => "valid record".into(),
        },
    }
}

/// Best-effort description of the records in a damaged range: frame headers
/// are followed while their lengths stay inside the range, and payloads are
/// decoded ignoring the checksum.
pub(crate) fn describe(range: &[u8], base_offset: u64) -> Vec<LostRecord> {
    let mut out = Vec::new();
    let mut off = 0usize;
    while off < range.len() {
        let rest = &range[off..];
        let parsed = (rest.len() >= record::FRAME_HEADER)
            .then(|| u32::from_le_bytes([rest[0], rest[1], rest[2], rest[3]]) as usize)
            .and_then(|len| {
                let total = record::FRAME_HEADER.checked_add(len)?;
                let payload = rest.get(record::FRAME_HEADER..total)?;
                let lost = match record::decode_payload(payload).ok()? {
                    Record::Message(m) => {
                        let mut v = vec![LostRecord::Message {
                            id: m.id,
                            partitions: m.partitions().collect(),
                        }];
                        if let Some((partition, id)) = m.moved_from {
                            v.push(LostRecord::Settle { partition, id });
                        }
                        v
                    }
                    Record::Settle { partition, id } => vec![LostRecord::Settle { partition, id }],
                    Record::Requeue { partition, id, .. } => {
                        vec![LostRecord::Requeue { partition, id }]
                    }
                    Record::Receipt { partition, .. } => vec![LostRecord::Receipt { partition }],
                    Record::PutMeta { version, .. }
                    | Record::DeleteMeta { version, .. }
                    | Record::MetaBatch { version, .. } => {
                        vec![LostRecord::Meta { version }]
                    }
                    Record::Cut { partition, before } => {
                        vec![LostRecord::Cut { partition, before }]
                    }
                    Record::State { key, .. } => vec![LostRecord::State { key: key.to_vec() }],
                };
                Some((lost, total))
            });
        match parsed {
            Some((lost, total)) => {
                out.extend(lost);
                off += total;
            }
            None => {
                out.push(LostRecord::Unreadable {
                    offset: base_offset + off as u64,
                    len: (range.len() - off) as u64,
                });
                break;
            }
        }
    }
    out
}

/// Ids of the messages among `lost`.
pub(crate) fn lost_message_ids(lost: &[LostRecord]) -> Vec<MessageId> {
    lost.iter()
        .filter_map(|l| match l {
            LostRecord::Message { id, .. } => Some(*id),
            _ => None,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{MessageAttrs, MessageData, PartitionId};
    use record::MessageKind;

    fn segment(n: u64) -> (Vec<u8>, Vec<usize>) {
        let mut buf = Vec::new();
        let mut starts = Vec::new();
        for id in 1..=n {
            starts.push(buf.len());
            let body = vec![b'x'; 100];
            record::encode_message(
                &mut buf,
                MessageKind::Publish,
                id,
                &[PartitionId(7)],
                &MessageData {
                    exchange: "",
                    routing_key: "q",
                    header_format: 1,
                    header: b"",
                    body: &body,
                    attrs: MessageAttrs::default(),
                },
                0,
            );
        }
        (buf, starts)
    }

    /// Walks a whole segment the way recovery does.
    fn walk(buf: &[u8], head: bool) -> Vec<(usize, Item)> {
        walk_to(buf, head, 0)
    }

    /// The same, for a segment whose header records `recorded_end`.
    fn walk_to(buf: &[u8], head: bool, recorded_end: u64) -> Vec<(usize, Item)> {
        let mut out = Vec::new();
        let mut off = 0;
        while off < buf.len() {
            let item = next_item(buf, off, head, recorded_end);
            out.push((off, item));
            off = match item {
                Item::Record { len } => off + len,
                Item::Damaged { end } => end,
                Item::TornTail | Item::CleanEnd => break,
            };
        }
        out
    }

    #[test]
    fn intact_segment_is_all_records() {
        let (buf, starts) = segment(5);
        let items = walk(&buf, true);
        assert_eq!(items.len(), 5);
        assert!(items.iter().all(|(_, i)| matches!(i, Item::Record { .. })));
        assert_eq!(items.iter().map(|(o, _)| *o).collect::<Vec<_>>(), starts);
    }

    #[test]
    fn zeros_after_the_data_are_a_clean_end() {
        let (mut buf, _) = segment(3);
        buf.resize(buf.len() + 4096, 0);
        let items = walk(&buf, true);
        assert_eq!(items.last().unwrap().1, Item::CleanEnd);
        assert_eq!(items.len(), 4);
    }

    #[test]
    fn partial_last_record_is_a_torn_tail() {
        let (buf, starts) = segment(4);
        for cut in starts[3] + 1..buf.len() {
            // Torn, with and without the preallocated zeros after it.
            for zeros in [0usize, 512] {
                let mut b = buf[..cut].to_vec();
                b.resize(cut + zeros, 0);
                let items = walk(&b, true);
                assert_eq!(items.len(), 4, "cut {cut}");
                assert_eq!(items[3], (starts[3], Item::TornTail), "cut {cut}");
            }
        }
    }

    #[test]
    fn flipped_bit_with_valid_records_after_is_corruption() {
        let (buf, starts) = segment(6);
        // Every byte of the third record, the length field included.
        for i in starts[2]..starts[3] {
            let mut b = buf.clone();
            b[i] ^= 0x10;
            b.resize(b.len() + 1000, 0);
            let items = walk(&b, true);
            assert_eq!(
                items[2],
                (starts[2], Item::Damaged { end: starts[3] }),
                "flip at {i}"
            );
            // Everything after the damage is still found.
            let recs = items
                .iter()
                .filter(|(_, it)| matches!(it, Item::Record { .. }))
                .count();
            assert_eq!(recs, 5, "flip at {i}");
            assert_eq!(items.last().unwrap().1, Item::CleanEnd);
        }
    }

    #[test]
    fn damaged_last_record_of_a_sealed_segment_is_corruption() {
        let (mut buf, starts) = segment(3);
        let last = buf.len() - 1;
        buf[last] ^= 1;
        let items = walk(&buf, false);
        assert_eq!(items[2], (starts[2], Item::Damaged { end: buf.len() }));
        // The same bytes at the end of the head segment: a torn tail.
        assert_eq!(walk(&buf, true)[2], (starts[2], Item::TornTail));
    }

    #[test]
    fn below_the_recorded_end_nothing_is_torn() {
        let (buf, starts) = segment(4);
        let end = buf.len() as u64;
        // A flipped bit in the last record of a cleanly closed segment (its
        // whole length recorded): damage, in every byte of the record.
        for i in starts[3]..buf.len() {
            let mut b = buf.clone();
            b[i] ^= 0x20;
            let items = walk_to(&b, true, end);
            assert_eq!(
                items[3],
                (starts[3], Item::Damaged { end: buf.len() }),
                "flip at {i}"
            );
            // Recorded only up to the record before it: a torn tail.
            assert_eq!(
                walk_to(&b, true, starts[3] as u64)[3],
                (starts[3], Item::TornTail)
            );
        }
        // Cut inside the last record, below the recorded end: damage.
        let cut = &buf[..starts[3] + 10];
        assert_eq!(
            walk_to(cut, true, end)[3],
            (starts[3], Item::Damaged { end: cut.len() })
        );
        // Zeros where fsynced records were: damage up to the recorded end,
        // then the clean end of the preallocated rest.
        let mut z = buf.clone();
        z[starts[2]..].fill(0);
        z.resize(buf.len() + 512, 0);
        let items = walk_to(&z, true, end);
        assert_eq!(items[2], (starts[2], Item::Damaged { end: buf.len() }));
        assert_eq!(items[3], (buf.len(), Item::CleanEnd));
        // A torn write past the recorded end is still a torn tail.
        let mut t = buf.clone();
        t.extend_from_slice(&buf[starts[1]..starts[1] + 30]);
        let items = walk_to(&t, true, end);
        assert_eq!(items[4], (buf.len(), Item::TornTail));
    }

    #[test]
    fn damage_is_described_by_its_readable_header() {
        let (mut buf, starts) = segment(3);
        // A payload bit (in the body): checksum fails, header readable.
        buf[starts[1] + 60] ^= 0x01;
        let lost = describe(&buf[starts[1]..starts[2]], starts[1] as u64);
        assert_eq!(
            lost,
            vec![LostRecord::Message {
                id: 2,
                partitions: vec![PartitionId(7)]
            }]
        );
        assert_eq!(lost_message_ids(&lost), vec![2]);
        // A length bit: nothing readable, the range is reported.
        let (mut buf, starts) = segment(3);
        buf[starts[1] + 2] ^= 0x01;
        let lost = describe(&buf[starts[1]..starts[2]], starts[1] as u64);
        assert_eq!(
            lost,
            vec![LostRecord::Unreadable {
                offset: starts[1] as u64,
                len: (starts[2] - starts[1]) as u64
            }]
        );
    }

    #[test]
    fn fuzz_entry_points_never_panic_on_mutated_segments() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        let (clean, _) = segment(8);
        for _ in 0..3000 {
            let mut b = clean.clone();
            match rng.gen_range(0..4) {
                0 => {
                    for _ in 0..rng.gen_range(1..4) {
                        let i = rng.gen_range(0..b.len());
                        b[i] ^= 1 << rng.gen_range(0..8);
                    }
                }
                1 => b.truncate(rng.gen_range(0..b.len())),
                2 => b.resize(b.len() + rng.gen_range(0..300), 0),
                _ => {
                    let n = rng.gen_range(0..200);
                    b = (0..n).map(|_| rng.gen()).collect();
                }
            }
            crate::log::fuzzing::recover_tail(&b);
            crate::log::fuzzing::decode_record(&b);
        }
    }
}
