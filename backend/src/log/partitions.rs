//! Partitions of the log store across handles: ownership (acquire, epochs,
//! fencing) and recovery of a partition at any time.
//!
//! A single process holds every partition of the embedded log, but it may
//! open several handles on it ([`super::LogStore::handle`]), as the
//! processes sharing a networked store would: each [`crate::Store::acquire`]
//! gives its handle the partition with a new epoch and fences the previous
//! holder. While only the first handle exists, no append is ever checked
//! (one flag), so the single-gateway hot path pays nothing for it.
//!
//! Recovery: open scans the whole log and keeps each partition's live
//! messages and receipts until they are asked for ([`Fresh`]). A partition
//! open listed, not yet handed out and not appended to since, is answered
//! from that list (the usual startup); one open did not list is empty as
//! long as no partition was appended to at all. Anything else (a takeover
//! between handles, a second recovery) scans the retained segments for the
//! partition's records: rare, allowed to be slow, and no index per message
//! in memory. Appends note the partitions they touch only while open's
//! lists are not all handed out (the engine takes them all at startup), so
//! the hot path pays nothing once recovery is done.

use super::record::{self, MessageKind, Record};
use super::{receipts, segment, LogStore, State};
use crate::{
    Epoch, MessageId, MessageRef, PartitionId, RangeMessage, Receipt, RecoveredMessage, StoreError,
    StoredMessage,
};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::Ordering;

/// The handle id of the [`LogStore`] itself; [`LogStore::handle`] numbers
/// the others from 2.
pub(crate) const FIRST_HANDLE: u64 = 1;

/// Ownership of partitions, in the append state.
///
/// Epochs come from one counter, so each acquire of a partition gets a
/// larger epoch than every earlier one. While a single handle exists
/// nothing is recorded (no memory per partition, no check per append):
/// there is nobody to fence. From the second handle on, each acquire
/// records its holder; a partition without a record (acquired before,
/// or never) is free to append to until someone acquires it.
#[derive(Default)]
pub(crate) struct Owners {
    /// Whether a second handle was ever made: until then nothing is checked.
    pub multi: bool,
    /// Current holder (handle) and epoch of every partition acquired since
    /// the second handle was made.
    pub holders: HashMap<PartitionId, (u64, Epoch)>,
    /// The last epoch given.
    last_epoch: u64,
}

impl Owners {
    /// Fails with `Fenced` when another handle than `handle` holds `p`.
    pub(crate) fn check(&self, handle: u64, p: PartitionId) -> Result<(), StoreError> {
        if !self.multi {
            return Ok(());
        }
        match self.holders.get(&p) {
            Some((h, _)) if *h != handle => Err(StoreError::Fenced(p)),
            _ => Ok(()),
        }
    }

    fn acquire(&mut self, handle: u64, p: PartitionId) -> Epoch {
        self.last_epoch += 1;
        let epoch = Epoch(self.last_epoch);
        if self.multi {
            self.holders.insert(p, (handle, epoch));
        }
        epoch
    }
}

/// Which of open's answers are still exact.
#[derive(Default)]
pub(crate) struct Fresh {
    /// Partitions whose listed messages are exact and not handed out.
    messages: HashSet<PartitionId>,
    /// Partitions whose listed receipts are exact and not handed out.
    receipts: HashSet<PartitionId>,
    /// No append named any partition since open.
    untouched: bool,
}

impl Fresh {
    pub(crate) fn new(
        messages: impl Iterator<Item = PartitionId>,
        receipts: impl Iterator<Item = PartitionId>,
    ) -> Fresh {
        Fresh {
            messages: messages.collect(),
            receipts: receipts.collect(),
            untouched: true,
        }
    }

    /// Whether appends must note their partitions.
    pub(crate) fn watching(&self) -> bool {
        self.untouched || !self.messages.is_empty() || !self.receipts.is_empty()
    }

    /// An append named `p`: open's answers for it are stale.
    pub(crate) fn appended(&mut self, p: PartitionId) {
        self.untouched = false;
        if !self.messages.is_empty() {
            self.messages.remove(&p);
        }
        if !self.receipts.is_empty() {
            self.receipts.remove(&p);
        }
    }
}

/// How a recovery is answered.
enum Answer<T> {
    /// From what open found.
    Open(T),
    /// Nothing: open found nothing and nothing was appended since.
    Nothing,
    /// By a scan.
    Scan,
}

/// What open found, handed out per partition (see [`Fresh`]).
#[derive(Default)]
pub(crate) struct OpenLists {
    pub messages: HashMap<PartitionId, Vec<RecoveredMessage>>,
    pub receipts: HashMap<PartitionId, Vec<Receipt>>,
    /// Partitions whose messages were handed out already.
    pub messages_taken: HashSet<PartitionId>,
    /// Partitions whose receipts were handed out already.
    pub receipts_taken: HashSet<PartitionId>,
}

/// A partition's records, found by a scan of the retained log.
#[derive(Default)]
struct Scanned {
    live: BTreeMap<MessageId, RecoveredMessage>,
    receipts: HashMap<u64, u64>,
}

impl LogStore {
    pub(crate) fn acquire_as(&self, handle: u64, p: PartitionId) -> Result<Epoch, StoreError> {
        let mut st = self.shared.state.lock();
        if st.closing || st.failed {
            return Err(StoreError::Closed);
        }
        Ok(st.owners.acquire(handle, p))
    }

    pub(crate) fn try_acquire_as(
        &self,
        handle: u64,
        p: PartitionId,
    ) -> Result<Option<Epoch>, StoreError> {
        let mut st = self.shared.state.lock();
        if st.closing || st.failed {
            return Err(StoreError::Closed);
        }
        if let Some((h, e)) = st.owners.holders.get(&p) {
            return Ok((*h == handle).then_some(*e));
        }
        Ok(Some(st.owners.acquire(handle, p)))
    }

    /// How to answer the recovery of `p`'s messages (`receipts`: of its
    /// receipts), handing out open's list when it is still exact.
    fn answer<T>(
        &self,
        st: &mut State,
        p: PartitionId,
        receipts: bool,
        take: impl FnOnce(&mut OpenLists) -> Option<T>,
    ) -> Answer<T> {
        let mut open = self.open_lists.lock();
        let (fresh, taken) = if receipts {
            (st.fresh.receipts.remove(&p), &mut open.receipts_taken)
        } else {
            (st.fresh.messages.remove(&p), &mut open.messages_taken)
        };
        let first = taken.insert(p);
        if fresh {
            if let Some(list) = take(&mut open) {
                return Answer::Open(list);
            }
        }
        let listed = if receipts {
            open.receipts.remove(&p).is_some()
        } else {
            open.messages.remove(&p).is_some()
        };
        if first && !listed && st.fresh.untouched {
            return Answer::Nothing;
        }
        Answer::Scan
    }

    pub(crate) fn recover_partition_as(
        &self,
        handle: u64,
        p: PartitionId,
    ) -> Result<Vec<RecoveredMessage>, StoreError> {
        let answer = {
            let mut st = self.shared.state.lock();
            st.owners.check(handle, p)?;
            self.answer(&mut st, p, false, |open| open.messages.remove(&p))
        };
        match answer {
            Answer::Open(list) => Ok(list),
            Answer::Nothing => Ok(Vec::new()),
            Answer::Scan => Ok(self.scan_partition(p)?.live.into_values().collect()),
        }
    }

    pub(crate) fn recover_receipts_as(
        &self,
        handle: u64,
        p: PartitionId,
    ) -> Result<Vec<Receipt>, StoreError> {
        let answer = {
            let mut st = self.shared.state.lock();
            st.owners.check(handle, p)?;
            self.answer(&mut st, p, true, |open| open.receipts.remove(&p))
        };
        match answer {
            Answer::Open(list) => return Ok(list),
            Answer::Nothing => return Ok(Vec::new()),
            Answer::Scan => {}
        }
        let now = super::now_ms();
        let mut found = self.scan_partition(p)?.receipts;
        // Receipts copied out of reclaimed segments.
        let files = self.receipt_files.lock().0.clone();
        for f in files {
            let path = receipts::path(&self.shared.dir, f.seq);
            let Ok(buf) = std::fs::read(&path) else {
                // Deleted meanwhile: all of it expired.
                continue;
            };
            if let Ok((_, entries)) = receipts::decode(&buf) {
                for (q, key_hash, expires) in entries {
                    if q == p {
                        let e = found.entry(key_hash).or_default();
                        *e = (*e).max(expires);
                    }
                }
            }
        }
        Ok(found
            .into_iter()
            .filter(|(_, e)| *e > now)
            .map(|(key_hash, expires_at_ms)| Receipt {
                key_hash,
                expires_at_ms,
            })
            .collect())
    }

    /// Startup is over (the first compaction): what open found and nobody
    /// asked for (partitions of deleted queues) is dropped, and appends stop
    /// noting their partitions; recoveries scan from now on.
    pub(crate) fn end_startup_window(&self) {
        let mut st = self.shared.state.lock();
        if st.fresh.watching() {
            st.fresh = Fresh::default();
            drop(st);
            *self.open_lists.lock() = OpenLists::default();
        }
    }

    /// Up to `max` live stored messages of `p` from id `from` on, read by
    /// a scan (the log keeps no per-partition index).
    pub(crate) fn read_range_now(
        &self,
        p: PartitionId,
        from: MessageId,
        max: usize,
    ) -> Result<Vec<RangeMessage>, StoreError> {
        let scanned = self.scan_partition(p)?;
        let mut out = Vec::new();
        for (id, m) in scanned.live.range(from..) {
            if out.len() >= max {
                break;
            }
            let mut message: StoredMessage = self.read_stored(m.location)?;
            message.attrs.deliver_at_ms = m.attrs.deliver_at_ms;
            out.push(RangeMessage {
                at: MessageRef::new(p, *id, m.location),
                attempts: m.attempts,
                message,
            });
        }
        Ok(out)
    }

    /// Waits until everything appended so far is durable, then replays the
    /// retained segments for the records of `p`.
    fn scan_partition(&self, p: PartitionId) -> Result<Scanned, StoreError> {
        self.flush()?;
        let segments: Vec<_> = self.shared.state.lock().segments.keys().copied().collect();
        let mut out = Scanned::default();
        for seg in segments {
            let path = segment::segment_path(&self.shared.log_dir, seg);
            let buf = match std::fs::read(&path) {
                Ok(b) => b,
                // Reclaimed meanwhile: nothing in it was live, and only a
                // prefix of the log is ever reclaimed.
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(StoreError::io(format!("reading {}", path.display()), e)),
            };
            let mut off = segment::HEADER_LEN;
            while off < buf.len() {
                let Some((rec, len)) = record::split_frame(&buf[off..])
                    .ok()
                    .and_then(|(payload, len)| Some((record::decode_payload(payload).ok()?, len)))
                else {
                    // The head's preallocated zeros, or the end of what the
                    // writer wrote so far: nothing of ours lies beyond (we
                    // flushed first).
                    break;
                };
                let loc = crate::Location::log(seg, off as u32, len as u32);
                match rec {
                    Record::Message(m) if m.kind == MessageKind::Page => {}
                    Record::Message(m) => {
                        if m.partitions().any(|q| q == p) {
                            out.live.insert(
                                m.id,
                                RecoveredMessage {
                                    id: m.id,
                                    location: loc,
                                    size: m.body.len() as u32,
                                    attempts: m.attempts,
                                    attrs: m.attrs,
                                },
                            );
                        }
                        if let Some((from, from_id)) = m.moved_from {
                            if from == p {
                                out.live.remove(&from_id);
                            }
                        }
                    }
                    Record::Settle { partition, id } if partition == p => {
                        out.live.remove(&id);
                    }
                    Record::Requeue {
                        partition,
                        id,
                        attempts,
                        deliver_at_ms,
                    } if partition == p => {
                        if let Some(m) = out.live.get_mut(&id) {
                            m.attempts = attempts;
                            m.attrs.deliver_at_ms = deliver_at_ms;
                        }
                    }
                    Record::Cut { partition, before } if partition == p => {
                        // A drop or truncation: what came before it, below
                        // `before`, leaves; later records stand.
                        let kept = out.live.split_off(&before);
                        out.live = kept;
                    }
                    Record::Receipt {
                        partition,
                        key_hash,
                        expires_at_ms,
                    } if partition == p => {
                        let e = out.receipts.entry(key_hash).or_default();
                        *e = (*e).max(expires_at_ms);
                    }
                    _ => {}
                }
                off += len;
            }
        }
        Ok(out)
    }

    /// Blocks until everything appended so far is durable.
    pub(crate) fn flush(&self) -> Result<(), StoreError> {
        let ticket = crate::Ticket::new(self.shared.state.lock().next_ticket);
        if ticket.get() <= self.shared.durable.load(Ordering::Acquire) {
            return Ok(());
        }
        let (tx, rx) = std::sync::mpsc::channel();
        self.when_durable_now(
            ticket,
            Box::new(move |r| {
                let _ = tx.send(r);
            }),
        );
        rx.recv().map_err(|_| StoreError::Closed)?
    }
}
