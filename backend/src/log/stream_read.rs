//! Reading a partition forward from a known position ([`crate::Store::
//! read_from`]): what a stream consumer does. A stream's sparse index keeps
//! one position per chunk of events, so a reader seeks to it and decodes
//! the records that follow, skipping other partitions' records, instead of
//! replaying every retained segment as [`crate::Store::read_range`] must.

use super::record::{self, MessageKind, Record};
use super::{segment, LogStore, SegmentId};
use crate::{Location, MessageRef, RangeMessage, StoreError};
use std::sync::atomic::Ordering;

/// Bytes read from a segment per system call while scanning forward.
const BLOCK: u64 = 1 << 20;

impl LogStore {
    /// Up to `max` records of `first.partition` from `first` on, in log
    /// order (which is id order within a partition). Records not yet handed
    /// to the kernel are made so once (a flush) when the scan reaches them.
    pub(crate) fn read_from_now(
        &self,
        first: MessageRef,
        max: usize,
    ) -> Result<Vec<RangeMessage>, StoreError> {
        let p = first.partition;
        let mut out = Vec::new();
        let (mut seg, mut off) = (first.location.segment(), u64::from(first.location.offset()));
        let mut flushed = false;
        let mut sealed_len: Option<(SegmentId, u64)> = None;
        let seg_size = self.shared.opts.segment_size;
        while out.len() < max {
            let w = self.shared.written.load(Ordering::Acquire);
            let (wseg, wend) = ((w >> 32) as SegmentId, w & u64::from(u32::MAX));
            let end = match seg.cmp(&wseg) {
                // A sealed segment may be shorter than its nominal size.
                std::cmp::Ordering::Less => match sealed_len {
                    Some((s, len)) if s == seg => len,
                    _ => {
                        let path = segment::segment_path(&self.shared.log_dir, seg);
                        let len = std::fs::metadata(&path)
                            .map_or(0, |m| m.len())
                            .min(seg_size);
                        sealed_len = Some((seg, len));
                        len
                    }
                },
                std::cmp::Ordering::Equal => wend,
                std::cmp::Ordering::Greater => 0,
            };
            if off >= end {
                if seg < wseg {
                    match self.next_segment(seg) {
                        Some(n) => {
                            seg = n;
                            off = segment::HEADER_LEN as u64;
                            continue;
                        }
                        None => break,
                    }
                }
                // At what the writer has written: the rest is still in its
                // buffers. Once, make it written and look again.
                if flushed {
                    break;
                }
                self.flush()?;
                flushed = true;
                continue;
            }
            let len = (end - off).min(BLOCK);
            let buf = match self
                .shared
                .reads
                .read(Location::log(seg, off as u32, len as u32))
            {
                Ok(b) => b,
                // Reclaimed, or shorter than its nominal size: on to the next.
                Err(StoreError::NotFound(_)) => {
                    off = end;
                    continue;
                }
                Err(e) => return Err(e),
            };
            let mut pos = 0usize;
            let mut segment_done = false;
            while pos < buf.len() && out.len() < max {
                match record::split_frame(&buf[pos..]) {
                    Ok((payload, total)) => {
                        if let Ok(Record::Message(m)) = record::decode_payload(payload) {
                            if m.kind != MessageKind::Page
                                && m.id >= first.id
                                && m.partitions().any(|q| q == p)
                            {
                                let loc =
                                    Location::log(seg, (off as usize + pos) as u32, total as u32);
                                let message = self.read_stored(loc)?;
                                out.push(RangeMessage {
                                    at: MessageRef::new(p, m.id, loc),
                                    attempts: 0,
                                    message,
                                });
                            }
                        }
                        pos += total;
                    }
                    Err(record::FrameError::Truncated) => {
                        if pos == 0 {
                            // One record larger than a block: read it whole.
                            let want = if buf.len() >= 4 {
                                u32::from_le_bytes([buf[0], buf[1], buf[2], buf[3]]) as u64
                                    + record::FRAME_HEADER as u64
                            } else {
                                0
                            };
                            if want <= len || off + want > end {
                                segment_done = true;
                            } else {
                                let loc = Location::log(seg, off as u32, want as u32);
                                let message =
                                    match record::split_frame(&self.shared.reads.read(loc)?) {
                                        Ok((payload, _)) => match record::decode_payload(payload) {
                                            Ok(Record::Message(m))
                                                if m.kind != MessageKind::Page
                                                    && m.id >= first.id
                                                    && m.partitions().any(|q| q == p) =>
                                            {
                                                Some((m.id, self.read_stored(loc)?))
                                            }
                                            _ => None,
                                        },
                                        Err(_) => {
                                            segment_done = true;
                                            None
                                        }
                                    };
                                if let Some((id, message)) = message {
                                    out.push(RangeMessage {
                                        at: MessageRef::new(p, id, loc),
                                        attempts: 0,
                                        message,
                                    });
                                }
                                if !segment_done {
                                    pos = want as usize;
                                }
                            }
                        }
                        break;
                    }
                    // Zeros: the preallocated end of the segment.
                    Err(record::FrameError::Corrupt(_)) => {
                        segment_done = true;
                        break;
                    }
                }
            }
            off += pos as u64;
            if segment_done {
                if seg < wseg {
                    off = end;
                } else {
                    break;
                }
            }
        }
        Ok(out)
    }

    /// The retained segment after `seg`, if any.
    fn next_segment(&self, seg: SegmentId) -> Option<SegmentId> {
        let st = self.shared.state.lock();
        st.segments.range(seg + 1..).next().map(|(s, _)| *s)
    }
}
