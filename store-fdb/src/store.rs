//! [`FdbStore`]: the [`Store`] contract v2 over the key/value seam.
//!
//! One transaction per append (a batch over [`MAX_TXN_BYTES`] of message
//! records is cut into several, committed in order). The append's own
//! transaction reads the owner key of every partition it names, so the
//! epoch fence and the writes it guards commit together or not at all; it
//! writes a commit marker of its own, so that after
//! `commit_unknown_result` a retry first looks for the marker and applies
//! the batch at most once. An append returns once its transaction is
//! committed (FoundationDB makes a commit durable and replicated before it
//! answers), so every ticket is durable when it is handed out. See
//! [`crate::keys`] for the keyspace.

use crate::codec::{self, LiveEntry};
use crate::keys::{Keys, FEED_KEPT, PART};
use crate::kv::{le_u64, prefix_end, Kv, KvError, KvErrorKind, KvTxn};
use crate::reader::Reader;
use parking_lot::Mutex;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use weir_backend::{
    Epoch, LiveSet, Location, MessageData, MessageId, MessageRef, MetaChange, MetaEvent, MetaFeed,
    Op, PartitionId, RangeMessage, ReadFuture, Receipt, RecoveredMessage, RecoveredMeta,
    StateEntry, Store, StoreError, StoreStats, StoredMessage, Ticket, Waiter, Wake,
};

/// Message-record bytes per transaction (FoundationDB refuses
/// transactions over 10 MB and advises well under; 5 s is the other
/// limit, far from a few MB).
pub const MAX_TXN_BYTES: usize = 4 << 20;

/// Ids leased per round trip: `I` is read and written once per lease.
const ID_LEASE: u64 = 4096;

/// Entries read per transaction when walking a partition.
const PAGE: usize = 5_000;

/// Attempts of a transaction before its error is returned.
const ATTEMPTS: u32 = 64;

/// Where a store lives and who opens it.
#[derive(Clone, Debug)]
pub struct FdbStoreConfig {
    /// The root prefix of the store's keys (one per Weir cluster).
    pub root: Vec<u8>,
    /// This gateway's name: ownership is held by name, so a restarted
    /// gateway keeps the partitions it held. Two live gateways must never
    /// share a name.
    pub node: String,
    /// Threads serving asynchronous reads.
    pub reader_threads: usize,
}

impl FdbStoreConfig {
    /// `weir/<cluster>/` as root, for gateway `node`.
    pub fn new(cluster: &str, node: &str) -> Self {
        FdbStoreConfig {
            root: format!("weir/{cluster}/").into_bytes(),
            node: node.to_string(),
            reader_threads: 4,
        }
    }
}

/// Why a transaction body stopped.
enum Abort {
    Kv(KvError),
    Store(StoreError),
}

impl From<KvError> for Abort {
    fn from(e: KvError) -> Self {
        Abort::Kv(e)
    }
}

impl From<StoreError> for Abort {
    fn from(e: StoreError) -> Self {
        Abort::Store(e)
    }
}

fn backend(e: KvError) -> StoreError {
    match e.kind {
        KvErrorKind::Retryable | KvErrorKind::MaybeCommitted => StoreError::Retryable(e.message),
        KvErrorKind::Fatal => StoreError::Backend(Box::new(e)),
    }
}

/// The FoundationDB store (over any [`Kv`]).
pub struct FdbStore {
    inner: Arc<Inner>,
}

struct Inner {
    kv: Arc<dyn Kv>,
    keys: Keys,
    node: Vec<u8>,
    /// The id lease: next id, end of the lease.
    ids: Mutex<(u64, u64)>,
    tickets: AtomicU64,
    /// Commit markers of committed transactions, cleared by the next one.
    markers: Mutex<Vec<u64>>,
    closed: AtomicBool,
    appended: AtomicU64,
    commits: AtomicU64,
    reclaimed: AtomicU64,
    reader: Reader,
    /// Serializes reclamation within the handle (`compact` runs one at a time).
    compacting: Mutex<()>,
    /// Chunks this handle wrote, recent first out: chunks never change, so
    /// reading one back (a delivery soon after its publish) needs no
    /// round trip. Evicted when reclaimed here; a chunk another gateway
    /// reclaimed may still be read from it (only settled messages lived
    /// there).
    cache: Mutex<ChunkCache>,
}

/// A watcher's wake, called once by whichever comes first: the writing
/// thread of a handle in this process, or the FoundationDB watch.
type WakeSlot = Arc<Mutex<Option<Wake>>>;

/// Watchers per (seam, root) in this process: a metadata change made
/// through a handle of this process wakes them on the writing thread, at
/// once; handles in other processes are woken by FoundationDB's watch on
/// `G`, a little later.
static LOCAL_WATCHERS: std::sync::LazyLock<Mutex<Watchers>> =
    std::sync::LazyLock::new(|| Mutex::new(HashMap::new()));

/// Wakes by (seam address, root).
type Watchers = HashMap<(usize, Vec<u8>), Vec<WakeSlot>>;

/// Bytes of chunks kept by [`ChunkCache`].
const CACHE_BYTES: usize = 32 << 20;

#[derive(Default)]
struct ChunkCache {
    chunks: HashMap<u64, Arc<Vec<u8>>>,
    order: std::collections::VecDeque<u64>,
    bytes: usize,
}

impl ChunkCache {
    fn insert(&mut self, chunk: u64, blob: Arc<Vec<u8>>) {
        if blob.len() > CACHE_BYTES / 4 {
            return;
        }
        self.bytes += blob.len();
        self.chunks.insert(chunk, blob);
        self.order.push_back(chunk);
        while self.bytes > CACHE_BYTES {
            let Some(old) = self.order.pop_front() else {
                break;
            };
            if let Some(b) = self.chunks.remove(&old) {
                self.bytes -= b.len();
            }
        }
    }

    fn remove(&mut self, chunk: u64) {
        if let Some(b) = self.chunks.remove(&chunk) {
            self.bytes -= b.len();
        }
    }

    fn read(&self, chunk: u64, offset: u32) -> Option<StoredMessage> {
        let blob = self.chunks.get(&chunk)?;
        codec::decode_record(blob.get(offset as usize..)?)
    }
}

impl FdbStore {
    /// Opens the store under `config.root` in `kv`.
    pub fn open(kv: Arc<dyn Kv>, config: FdbStoreConfig) -> Result<Arc<Self>, StoreError> {
        if config.node.is_empty() {
            return Err(StoreError::Invalid("a node name is required".into()));
        }
        let inner = Arc::new(Inner {
            kv,
            keys: Keys::new(&config.root),
            node: config.node.into_bytes(),
            ids: Mutex::new((0, 0)),
            tickets: AtomicU64::new(0),
            markers: Mutex::new(Vec::new()),
            closed: AtomicBool::new(false),
            appended: AtomicU64::new(0),
            commits: AtomicU64::new(0),
            reclaimed: AtomicU64::new(0),
            reader: Reader::new(config.reader_threads.max(1)),
            compacting: Mutex::new(()),
            cache: Mutex::new(ChunkCache::default()),
        });
        // Reachable now, not at the first publish.
        inner.run(None, |t| Ok(t.get(&inner.keys.key(b'G', &[]))?))?;
        Ok(Arc::new(FdbStore { inner }))
    }
}

impl Inner {
    /// This handle's entry in [`LOCAL_WATCHERS`].
    fn watch_key(&self) -> (usize, Vec<u8>) {
        (
            Arc::as_ptr(&self.kv) as *const () as usize,
            self.keys.root().to_vec(),
        )
    }

    /// Wakes this process's watchers after a metadata change committed.
    fn wake_local(&self) {
        let slots = LOCAL_WATCHERS
            .lock()
            .remove(&self.watch_key())
            .unwrap_or_default();
        for slot in slots {
            let wake = slot.lock().take();
            if let Some(w) = wake {
                w();
            }
        }
    }

    fn check_open(&self) -> Result<(), StoreError> {
        if self.closed.load(Ordering::Acquire) {
            Err(StoreError::Closed)
        } else {
            Ok(())
        }
    }

    /// Runs `body` in a transaction until it commits, retrying retryable
    /// errors. With a `marker`, the transaction also writes it, and a
    /// `commit_unknown_result` is resolved by looking for it: the body's
    /// effects are applied once.
    fn run<T>(
        &self,
        marker: Option<u64>,
        body: impl FnMut(&mut dyn KvTxn) -> Result<T, Abort>,
    ) -> Result<T, StoreError> {
        self.run_at(false, marker, body)
    }

    /// [`Inner::run`]; `recent`: the first attempt may read at a version
    /// this handle already saw ([`Kv::begin_recent`]), for immutable keys.
    fn run_at<T>(
        &self,
        recent: bool,
        marker: Option<u64>,
        mut body: impl FnMut(&mut dyn KvTxn) -> Result<T, Abort>,
    ) -> Result<T, StoreError> {
        let mut last = None;
        for attempt in 0..ATTEMPTS {
            if attempt > 0 {
                std::thread::sleep(Duration::from_millis((1u64 << attempt.min(7)).min(100)));
            }
            let mut t = if recent && attempt == 0 {
                self.kv.begin_recent()
            } else {
                self.kv.begin()
            }
            .map_err(backend)?;
            let cleared: Vec<u64> = match marker {
                Some(m) => {
                    let old = self.markers.lock().clone();
                    for o in &old {
                        t.clear(&self.marker_key(*o));
                    }
                    t.set(&self.marker_key(m), &[]);
                    old
                }
                None => Vec::new(),
            };
            let value = match body(&mut *t) {
                Ok(v) => v,
                Err(Abort::Store(e)) => return Err(e),
                Err(Abort::Kv(e)) if e.kind == KvErrorKind::Fatal => return Err(backend(e)),
                Err(Abort::Kv(e)) => {
                    last = Some(e);
                    continue;
                }
            };
            match t.commit() {
                Ok(()) => {
                    self.commits.fetch_add(1, Ordering::Relaxed);
                    if let Some(m) = marker {
                        let mut ms = self.markers.lock();
                        ms.retain(|o| !cleared.contains(o));
                        ms.push(m);
                    }
                    return Ok(value);
                }
                Err(e) if e.kind == KvErrorKind::MaybeCommitted => {
                    if let Some(m) = marker {
                        if self.committed(m)? {
                            self.markers.lock().push(m);
                            return Ok(value);
                        }
                    }
                    last = Some(e);
                }
                Err(e) if e.kind == KvErrorKind::Retryable => last = Some(e),
                Err(e) => return Err(backend(e)),
            }
        }
        Err(last.map_or(
            StoreError::Retryable("transaction retried too often".into()),
            backend,
        ))
    }

    fn marker_key(&self, m: u64) -> Vec<u8> {
        self.keys.key(b'X', &[&self.node, &[0], &m.to_be_bytes()])
    }

    /// Whether the transaction that wrote marker `m` committed.
    fn committed(&self, m: u64) -> Result<bool, StoreError> {
        self.run(None, |t| Ok(t.get(&self.marker_key(m))?.is_some()))
    }

    fn lease_ids(&self, n: u64) -> Result<(u64, u64), StoreError> {
        let key = self.keys.key(b'I', &[]);
        let len = n.max(ID_LEASE);
        self.run(None, |t| {
            // Id 0 is never handed out.
            let start = t.get(&key)?.map_or(1, |v| le_u64(&v)).max(1);
            t.set(&key, &(start + len).to_le_bytes());
            Ok((start, start + len))
        })
    }

    fn allocate(&self, n: u64) -> u64 {
        let mut ids = self.ids.lock();
        if ids.0 + n > ids.1 || ids.0 == 0 {
            let mut delay = 10;
            loop {
                match self.lease_ids(n) {
                    Ok(lease) => {
                        *ids = lease;
                        break;
                    }
                    Err(StoreError::Closed) => break,
                    Err(e) => {
                        // The signature cannot fail: wait for the cluster.
                        tracing::warn!(error = %e, "leasing message ids; retrying");
                        std::thread::sleep(Duration::from_millis(delay));
                        delay = (delay * 2).min(1000);
                    }
                }
            }
        }
        let first = ids.0;
        ids.0 += n;
        first
    }

    fn meta_version(&self, t: &mut dyn KvTxn) -> Result<u64, KvError> {
        Ok(t.get(&self.keys.key(b'G', &[]))?.map_or(0, |v| le_u64(&v)))
    }

    /// Applies metadata `changes` as one new version; returns it.
    fn meta_change(&self, t: &mut dyn KvTxn, changes: &[MetaChange<'_>]) -> Result<u64, Abort> {
        let v = self.meta_version(t)? + 1;
        t.set(&self.keys.key(b'G', &[]), &v.to_le_bytes());
        let mut feed = Vec::new();
        for c in changes {
            let (key, value) = match *c {
                MetaChange::Put { key, value } => (key, Some(value)),
                MetaChange::Delete { key } => (key, None),
            };
            let mk = self.keys.key(b'M', &[key]);
            match value {
                Some(val) => {
                    if val.len() + 8 > PART {
                        return Err(StoreError::TooLarge(val.len()).into());
                    }
                    let mut stored = v.to_le_bytes().to_vec();
                    stored.extend_from_slice(val);
                    t.set(&mk, &stored);
                }
                None => t.clear(&mk),
            }
            let ev = codec::feed_event(key, value);
            feed.extend_from_slice(&(ev.len() as u32).to_le_bytes());
            feed.extend_from_slice(&ev);
        }
        if feed.len() > PART {
            return Err(StoreError::TooLarge(feed.len()).into());
        }
        t.set(&self.keys.num(b'F', v), &feed);
        if v > FEED_KEPT {
            t.clear_range(&self.keys.num(b'F', 0), &self.keys.num(b'F', v - FEED_KEPT));
        }
        Ok(v)
    }

    /// Takes message `id` out of `p` if it is live there; returns its entry.
    fn kill(
        &self,
        t: &mut dyn KvTxn,
        p: PartitionId,
        id: MessageId,
        states: &HashMap<PartitionId, (u64, u64)>,
        dec: &mut BTreeMap<u64, i64>,
    ) -> Result<Option<LiveEntry>, Abort> {
        let (gen, trunc) = states.get(&p).copied().unwrap_or_default();
        if id < trunc {
            return Ok(None);
        }
        let key = self.keys.live(p.0, gen, id);
        let Some(v) = t.get(&key)? else {
            return Ok(None);
        };
        t.clear(&key);
        let e = LiveEntry::decode(&v);
        if let Some(e) = e {
            *dec.entry(e.chunk).or_default() -= 1;
        }
        Ok(e)
    }

    fn publish(
        &self,
        t: &mut dyn KvTxn,
        id: MessageId,
        partitions: &[PartitionId],
        data: &MessageData<'_>,
        at: (u64, u32),
        states: &HashMap<PartitionId, (u64, u64)>,
    ) {
        let entry = LiveEntry {
            chunk: at.0,
            offset: at.1,
            size: data.body.len() as u32,
            attempts: 0,
            attrs: data.attrs,
        };
        let value = entry.encode();
        for p in partitions {
            let (gen, _) = states.get(p).copied().unwrap_or_default();
            t.set(&self.keys.live(p.0, gen, id), &value);
            t.set(&self.keys.num(b'K', p.0), &[]);
        }
        t.max(&self.keys.key(b'I', &[]), id + 1);
    }

    /// Applies one group of an append (see [`Store::append`]).
    #[allow(clippy::too_many_arguments)]
    fn apply(
        &self,
        t: &mut dyn KvTxn,
        ops: &[Op<'_>],
        chunk: u64,
        blob: &[u8],
        offsets: &[u32],
    ) -> Result<(), Abort> {
        let mut parts = BTreeSet::new();
        for op in ops {
            match op {
                Op::Publish { partitions, .. } => parts.extend(partitions.iter().copied()),
                Op::Move {
                    partitions, from, ..
                } => {
                    parts.extend(partitions.iter().copied());
                    parts.insert(*from);
                }
                Op::Settle { partition, .. }
                | Op::Requeue { partition, .. }
                | Op::DropPartition { partition }
                | Op::Truncate { partition, .. } => {
                    parts.insert(*partition);
                }
                _ => {}
            }
        }
        // Owners and partition states in one round trip.
        let mut keys: Vec<Vec<u8>> = parts.iter().map(|p| self.keys.num(b'O', p.0)).collect();
        keys.extend(parts.iter().map(|p| self.keys.num(b'P', p.0)));
        let got = t.get_many(&keys)?;
        let (owners, pstates) = got.split_at(parts.len());
        for (p, v) in parts.iter().zip(owners) {
            if let Some(v) = v {
                match codec::unowner(v) {
                    Some((_, node)) if node == self.node.as_slice() => {}
                    _ => return Err(StoreError::Fenced(*p).into()),
                }
            }
        }
        let mut states: HashMap<PartitionId, (u64, u64)> = parts
            .iter()
            .zip(pstates)
            .map(|(p, v)| (*p, codec::unpair(v.as_deref())))
            .collect();
        // The live entries this batch settles, requeues or moves, read in
        // one round trip: the reads in `kill` then hit the transaction's
        // own cache.
        let touched: Vec<Vec<u8>> = ops
            .iter()
            .filter_map(|op| match *op {
                Op::Settle { partition, id, .. } | Op::Requeue { partition, id, .. } => {
                    Some((partition, id))
                }
                Op::Move { from, from_id, .. } => Some((from, from_id)),
                _ => None,
            })
            .map(|(p, id)| {
                let (gen, _) = states.get(&p).copied().unwrap_or_default();
                self.keys.live(p.0, gen, id)
            })
            .collect();
        if !touched.is_empty() {
            t.get_many(&touched)?;
        }
        let mut refs = 0i64;
        let mut dec: BTreeMap<u64, i64> = BTreeMap::new();
        if !blob.is_empty() {
            for (i, part) in blob.chunks(PART).enumerate() {
                t.set(&self.keys.chunk_part(chunk, i as u32), part);
            }
            t.set(
                &self.keys.num(b'Z', chunk),
                &(blob.len() as u64).to_le_bytes(),
            );
            t.add(&self.keys.key(b'B', &[&self.node]), blob.len() as i64);
        }
        let mut at = offsets.iter();
        for op in ops {
            match *op {
                Op::Publish {
                    id,
                    partitions,
                    ref data,
                } => {
                    let off = *at.next().unwrap_or(&0);
                    self.publish(t, id, partitions, data, (chunk, off), &states);
                    refs += partitions.len() as i64;
                }
                Op::Move {
                    id,
                    partitions,
                    ref data,
                    from,
                    from_id,
                    ..
                } => {
                    let off = *at.next().unwrap_or(&0);
                    self.kill(t, from, from_id, &states, &mut dec)?;
                    self.publish(t, id, partitions, data, (chunk, off), &states);
                    refs += partitions.len() as i64;
                }
                Op::Settle { partition, id, .. } => {
                    self.kill(t, partition, id, &states, &mut dec)?;
                }
                Op::Requeue {
                    partition,
                    id,
                    attempts,
                    deliver_at_ms,
                    ..
                } => {
                    let (gen, trunc) = states.get(&partition).copied().unwrap_or_default();
                    if id >= trunc {
                        let key = self.keys.live(partition.0, gen, id);
                        if let Some(mut e) = t.get(&key)?.as_deref().and_then(LiveEntry::decode) {
                            e.attempts = attempts;
                            e.attrs.deliver_at_ms = deliver_at_ms;
                            t.set(&key, &e.encode());
                        }
                    }
                }
                Op::Receipt {
                    partition,
                    key_hash,
                    expires_at_ms,
                } => {
                    t.max(&self.keys.num2(b'V', partition.0, key_hash), expires_at_ms);
                }
                Op::PutMeta { key, value } => {
                    self.meta_change(t, &[MetaChange::Put { key, value }])?;
                }
                Op::DeleteMeta { key } => {
                    self.meta_change(t, &[MetaChange::Delete { key }])?;
                }
                Op::MetaBatch { changes } => {
                    if !changes.is_empty() {
                        self.meta_change(t, changes)?;
                    }
                }
                Op::DropPartition { partition } => {
                    let s = states.entry(partition).or_default();
                    *s = (s.0 + 1, 0);
                    t.set(&self.keys.num(b'P', partition.0), &codec::pair(s.0, s.1));
                    t.set(&self.keys.num(b'D', partition.0), &[]);
                }
                Op::Truncate { partition, before } => {
                    let s = states.entry(partition).or_default();
                    s.1 = s.1.max(before);
                    t.set(&self.keys.num(b'P', partition.0), &codec::pair(s.0, s.1));
                    t.set(&self.keys.num(b'D', partition.0), &[]);
                }
                Op::PutState { key, value } => self.put_state(t, key, Some(value))?,
                Op::DeleteState { key } => self.put_state(t, key, None)?,
            }
        }
        if refs != 0 {
            *dec.entry(chunk).or_default() += refs;
        }
        for (c, d) in dec {
            if d != 0 {
                t.add(&self.keys.num(b'R', c), d);
            }
            if d < 0 || c != chunk {
                t.set(&self.keys.num(b'Q', c), &[]);
            }
        }
        Ok(())
    }

    fn put_state(&self, t: &mut dyn KvTxn, key: &[u8], value: Option<&[u8]>) -> Result<(), Abort> {
        let sk = self.keys.key(b'S', &[key]);
        let version = t.get(&sk)?.map_or(0, |v| le_u64(&v[..v.len().min(8)]));
        let parts = self.keys.state_parts(key);
        t.clear_range(&parts, &prefix_end(&parts));
        match value {
            None => t.clear(&sk),
            Some(value) => {
                let mut pieces = value.chunks(PART);
                let first = pieces.next().unwrap_or_default();
                let rest: Vec<&[u8]> = pieces.collect();
                let mut v = (version + 1).to_le_bytes().to_vec();
                v.extend_from_slice(&(rest.len() as u32 + 1).to_le_bytes());
                v.extend_from_slice(first);
                t.set(&sk, &v);
                for (i, p) in rest.iter().enumerate() {
                    t.set(&self.keys.state_part(key, i as u32 + 1), p);
                }
            }
        }
        Ok(())
    }

    /// Reads the record at `offset` of `chunk`; `None` when the chunk is
    /// gone.
    fn read_record(
        &self,
        t: &mut dyn KvTxn,
        chunk: u64,
        offset: u32,
    ) -> Result<Option<StoredMessage>, KvError> {
        if let Some(m) = self.cache.lock().read(chunk, offset) {
            return Ok(Some(m));
        }
        let off = offset as usize;
        let first = (off / PART) as u32;
        let end = prefix_end(&self.keys.num(b'C', chunk));
        // Two parts: a small record, or the start of a large one.
        let got = t.range(&self.keys.chunk_part(chunk, first), &end, 2)?;
        if got.first().map(|(k, _)| k.as_slice()) != Some(&self.keys.chunk_part(chunk, first)[..]) {
            return Ok(None);
        }
        let mut buf: Vec<u8> = got.iter().flat_map(|(_, v)| v.iter().copied()).collect();
        let skip = off % PART;
        if buf.len() < skip {
            return Ok(None);
        }
        buf.drain(..skip);
        let Some(len) = codec::record_len(&buf) else {
            return Ok(None);
        };
        let need = 4 + len;
        if buf.len() < need {
            let last = ((off + need - 1) / PART) as u32;
            let more = t.range(
                &self.keys.chunk_part(chunk, first + 2),
                &self.keys.chunk_part(chunk, last + 1),
                usize::MAX,
            )?;
            buf.extend(more.iter().flat_map(|(_, v)| v.iter().copied()));
        }
        Ok(buf.get(..need).and_then(codec::decode_record))
    }

    fn read_one(&self, loc: Location) -> Result<StoredMessage, StoreError> {
        let Some((chunk, offset)) = codec::decode_location(loc) else {
            return Err(StoreError::NotFound(loc));
        };
        if let Some(m) = self.cache.lock().read(chunk, offset) {
            return Ok(m);
        }
        // A chunk never changes: a recent version is enough, and one that
        // misses it (written by another gateway since) is retried fresh.
        match self.run_at(true, None, |t| Ok(self.read_record(t, chunk, offset)?))? {
            Some(m) => Ok(m),
            None => self
                .run(None, |t| Ok(self.read_record(t, chunk, offset)?))?
                .ok_or(StoreError::NotFound(loc)),
        }
    }

    /// Walks the live entries of `p` from id `from` (at most `max`).
    fn live_entries(
        &self,
        t: &mut dyn KvTxn,
        p: PartitionId,
        from: MessageId,
        max: usize,
    ) -> Result<Vec<(MessageId, LiveEntry)>, KvError> {
        let (gen, trunc) = codec::unpair(t.get(&self.keys.num(b'P', p.0))?.as_deref());
        let begin = self.keys.live(p.0, gen, from.max(trunc));
        let end = prefix_end(&self.keys.num2(b'L', p.0, gen));
        let root = self.keys.root().len() + 1;
        Ok(t.range(&begin, &end, max)?
            .into_iter()
            .filter_map(|(k, v)| {
                let id = u64::from_be_bytes(k.get(root + 16..root + 24)?.try_into().ok()?);
                Some((id, LiveEntry::decode(&v)?))
            })
            .collect())
    }

    fn owner_is_other(&self, t: &mut dyn KvTxn, p: PartitionId) -> Result<bool, KvError> {
        Ok(match t.get(&self.keys.num(b'O', p.0))? {
            Some(v) => !matches!(codec::unowner(&v), Some((_, n)) if n == self.node.as_slice()),
            None => false,
        })
    }

    /// Reclaims what drops, truncations and settles left: dead live
    /// entries, then chunks nothing lives in. Bounded transactions.
    fn reclaim(&self) -> Result<(), StoreError> {
        let root = self.keys.root().len() + 1;
        loop {
            let d_begin = self.keys.key(b'D', &[]);
            let drops = self.run(None, |t| {
                Ok(t.range(&d_begin, &prefix_end(&d_begin), 64)?)
            })?;
            if drops.is_empty() {
                break;
            }
            for (dk, _) in drops {
                let p = self.keys.field(&dk, 0);
                loop {
                    let done = self.run(None, |t| {
                        let (gen, trunc) =
                            codec::unpair(t.get(&self.keys.num(b'P', p))?.as_deref());
                        let mut dead = t.range(
                            &self.keys.num2(b'L', p, 0),
                            &self.keys.num2(b'L', p, gen),
                            1000,
                        )?;
                        if dead.len() < 1000 && trunc > 0 {
                            dead.extend(t.range(
                                &self.keys.live(p, gen, 0),
                                &self.keys.live(p, gen, trunc),
                                1000 - dead.len(),
                            )?);
                        }
                        let mut dec: BTreeMap<u64, i64> = BTreeMap::new();
                        for (k, v) in &dead {
                            t.clear(k);
                            if let Some(e) = LiveEntry::decode(v) {
                                *dec.entry(e.chunk).or_default() -= 1;
                            }
                        }
                        for (c, d) in dec {
                            t.add(&self.keys.num(b'R', c), d);
                            t.set(&self.keys.num(b'Q', c), &[]);
                        }
                        let done = dead.len() < 1000;
                        if done {
                            t.clear(&dk);
                        }
                        let _ = root;
                        Ok(done)
                    })?;
                    if done {
                        break;
                    }
                }
            }
        }
        loop {
            let q_begin = self.keys.key(b'Q', &[]);
            let n = self.run(None, |t| {
                let cands = t.range(&q_begin, &prefix_end(&q_begin), 500)?;
                let mut freed = 0u64;
                for (qk, _) in &cands {
                    let c = self.keys.field(qk, 0);
                    t.clear(qk);
                    let live = t
                        .get(&self.keys.num(b'R', c))?
                        .map_or(0, |v| le_u64(&v) as i64);
                    if live <= 0 {
                        let size = t.get(&self.keys.num(b'Z', c))?.map_or(0, |v| le_u64(&v));
                        let cp = self.keys.num(b'C', c);
                        t.clear_range(&cp, &prefix_end(&cp));
                        t.clear(&self.keys.num(b'R', c));
                        t.clear(&self.keys.num(b'Z', c));
                        self.cache.lock().remove(c);
                        t.add(&self.keys.key(b'B', &[&self.node]), -(size as i64));
                        freed += 1;
                    }
                }
                Ok((cands.len(), freed))
            })?;
            self.reclaimed.fetch_add(n.1, Ordering::Relaxed);
            if n.0 == 0 {
                break;
            }
        }
        Ok(())
    }
}

impl Store for FdbStore {
    fn allocate_ids(&self, n: u64) -> MessageId {
        self.inner.allocate(n)
    }

    fn append(&self, ops: &[Op<'_>], locations: &mut Vec<Location>) -> Result<Ticket, StoreError> {
        let me = &*self.inner;
        me.check_open()?;
        if ops.is_empty() {
            return Ok(Ticket::NONE);
        }
        for op in ops {
            match op {
                Op::Publish { partitions, .. } | Op::Move { partitions, .. }
                    if partitions.is_empty() =>
                {
                    return Err(StoreError::Invalid("a publish names no partition".into()))
                }
                _ => {}
            }
        }
        // Groups of ops whose message records stay under MAX_TXN_BYTES,
        // each with a chunk of its own.
        let mut groups: Vec<(usize, usize)> = Vec::new();
        let (mut start, mut bytes) = (0, 0usize);
        for (i, op) in ops.iter().enumerate() {
            let size = match op {
                Op::Publish { data, .. } | Op::Move { data, .. } => codec::record_size(data),
                _ => 64,
            };
            if size > MAX_TXN_BYTES {
                return Err(StoreError::TooLarge(size));
            }
            if bytes + size > MAX_TXN_BYTES && i > start {
                groups.push((start, i));
                (start, bytes) = (i, 0);
            }
            bytes += size;
        }
        groups.push((start, ops.len()));
        let ticket = me.tickets.fetch_add(1, Ordering::Relaxed) + 1;
        let mut out = Vec::new();
        for (gi, &(a, b)) in groups.iter().enumerate() {
            let group = &ops[a..b];
            let mut blob = Vec::new();
            let mut offsets = Vec::new();
            for op in group {
                if let Op::Publish { id, data, .. } | Op::Move { id, data, .. } = op {
                    offsets.push(blob.len() as u32);
                    codec::encode_record(&mut blob, *id, data);
                }
            }
            let chunk = if blob.is_empty() { 0 } else { me.allocate(1) };
            if chunk > codec::MAX_CHUNK {
                return Err(StoreError::Invalid("chunk ids exhausted".into()));
            }
            // Markers are unique per transaction: the ticket and the group.
            let marker = (ticket << 8) | (gi as u64 & 0xff);
            me.run(Some(marker), |t| me.apply(t, group, chunk, &blob, &offsets))?;
            let blob_len = blob.len();
            if !blob.is_empty() {
                me.cache.lock().insert(chunk, Arc::new(blob));
            }
            out.extend(offsets.iter().map(|&o| codec::location(chunk, o)));
            // Ids chosen by the caller past this handle's lease: later
            // allocations start after them (the counter got a `max`).
            let top = group
                .iter()
                .filter_map(|op| match op {
                    Op::Publish { id, .. } | Op::Move { id, .. } => Some(*id),
                    _ => None,
                })
                .max();
            if let Some(top) = top {
                let mut ids = me.ids.lock();
                if top >= ids.0 {
                    ids.0 = top + 1;
                }
            }
            let small = group.len().saturating_sub(offsets.len()) as u64 * 16;
            me.appended
                .fetch_add(blob_len as u64 + small, Ordering::Relaxed);
        }
        locations.extend(out);
        let meta = ops.iter().any(|op| match op {
            Op::PutMeta { .. } | Op::DeleteMeta { .. } => true,
            Op::MetaBatch { changes } => !changes.is_empty(),
            _ => false,
        });
        if meta {
            me.wake_local();
        }
        Ok(Ticket::new(ticket))
    }

    fn when_durable(&self, _ticket: Ticket, waiter: Waiter) {
        // Every ticket is committed (durable, replicated) before append
        // returns it, so waiters run at once, in registration order.
        waiter(Ok(()));
    }

    fn read_many(&self, refs: &[MessageRef]) -> ReadFuture<Vec<Result<StoredMessage, StoreError>>> {
        let inner = self.inner.clone();
        let refs = refs.to_vec();
        self.inner.reader.run(move || {
            let read_all = |recent: bool| {
                let mut cache: HashMap<Location, StoredMessage> = HashMap::new();
                inner.run_at(recent, None, |t| {
                    let mut out = Vec::with_capacity(refs.len());
                    for r in &refs {
                        if let Some(m) = cache.get(&r.location) {
                            out.push(Some(m.clone()));
                            continue;
                        }
                        let m = match codec::decode_location(r.location) {
                            Some((c, o)) => inner.read_record(t, c, o)?,
                            None => None,
                        };
                        if let Some(m) = &m {
                            cache.insert(r.location, m.clone());
                        }
                        out.push(m);
                    }
                    Ok(out)
                })
            };
            // Chunks never change: a recent version first, a fresh one if
            // it missed something (written by another gateway since).
            let got = match read_all(true) {
                Ok(ms) if ms.iter().any(Option::is_none) => read_all(false),
                other => other,
            };
            match got {
                Ok(ms) => ms
                    .into_iter()
                    .zip(&refs)
                    .map(|(m, r)| m.ok_or(StoreError::NotFound(r.location)))
                    .collect(),
                Err(e) => {
                    let text = e.to_string();
                    refs.iter()
                        .map(|_| Err(StoreError::Retryable(text.clone())))
                        .collect()
                }
            }
        })
    }

    fn read_range(
        &self,
        partition: PartitionId,
        from: MessageId,
        max: usize,
    ) -> ReadFuture<Result<Vec<RangeMessage>, StoreError>> {
        let inner = self.inner.clone();
        self.inner.reader.run(move || {
            inner.run(None, |t| {
                let entries = inner.live_entries(t, partition, from, max.min(PAGE))?;
                let mut out = Vec::with_capacity(entries.len());
                for (id, e) in entries {
                    if let Some(message) = inner.read_record(t, e.chunk, e.offset)? {
                        out.push(RangeMessage {
                            at: MessageRef::new(partition, id, codec::location(e.chunk, e.offset)),
                            attempts: e.attempts,
                            message,
                        });
                    }
                }
                Ok(out)
            })
        })
    }

    fn read(&self, location: Location) -> Result<StoredMessage, StoreError> {
        self.inner.read_one(location)
    }

    fn recovered_meta(&self) -> Result<RecoveredMeta, StoreError> {
        let me = &*self.inner;
        let prefix = me.keys.key(b'M', &[]);
        me.run(None, |t| {
            let version = me.meta_version(t)?;
            let mut meta = BTreeMap::new();
            let mut key_versions = BTreeMap::new();
            for (k, v) in t.range(&prefix, &prefix_end(&prefix), usize::MAX)? {
                let key = k[prefix.len()..].to_vec();
                key_versions.insert(key.clone(), le_u64(&v[..v.len().min(8)]));
                meta.insert(key, v.get(8..).unwrap_or_default().to_vec());
            }
            Ok(RecoveredMeta {
                meta,
                version,
                key_versions,
                truncated_bytes: 0,
            })
        })
    }

    fn put_if(
        &self,
        key: &[u8],
        value: Option<&[u8]>,
        expected: u64,
    ) -> Result<(Ticket, u64), StoreError> {
        let me = &*self.inner;
        me.check_open()?;
        let ticket = me.tickets.fetch_add(1, Ordering::Relaxed) + 1;
        let mk = me.keys.key(b'M', &[key]);
        let v = me.run(Some(ticket << 8), |t| {
            let found = t.get(&mk)?.map_or(0, |v| le_u64(&v[..v.len().min(8)]));
            if found != expected {
                return Err(StoreError::Conflict { expected, found }.into());
            }
            let change = match value {
                Some(value) => MetaChange::Put { key, value },
                None => MetaChange::Delete { key },
            };
            me.meta_change(t, &[change])
        })?;
        me.wake_local();
        Ok((Ticket::new(ticket), v))
    }

    fn watch(&self, since: u64, wake: Wake) -> Result<MetaFeed, StoreError> {
        let me = &*self.inner;
        me.check_open()?;
        let slot: WakeSlot = Arc::new(Mutex::new(Some(wake)));
        let g = me.keys.key(b'G', &[]);
        let feed = me.run(None, |t| {
            let version = me.meta_version(t)?;
            if version <= since {
                // Armed by the attempt that commits (a seam arms watches
                // at commit).
                let fdb_slot = slot.clone();
                t.watch(
                    &g,
                    Box::new(move || {
                        let wake = fdb_slot.lock().take();
                        if let Some(w) = wake {
                            w();
                        }
                    }),
                )?;
                return Ok(MetaFeed::Changes(Vec::new()));
            }
            let rows = t.range(
                &me.keys.num(b'F', since + 1),
                &me.keys.num(b'F', version + 1),
                usize::MAX,
            )?;
            if rows.first().map(|(k, _)| me.keys.field(k, 0)) != Some(since + 1) {
                return Ok(MetaFeed::Reload);
            }
            let mut events = Vec::new();
            for (k, v) in rows {
                let version = me.keys.field(&k, 0);
                let mut rest = &v[..];
                while rest.len() >= 4 {
                    let n = u32::from_le_bytes([rest[0], rest[1], rest[2], rest[3]]) as usize;
                    let Some(ev) = rest.get(4..4 + n) else { break };
                    if let Some((key, value)) = codec::unfeed(ev) {
                        events.push(MetaEvent {
                            version,
                            key,
                            value,
                        });
                    }
                    rest = &rest[4 + n..];
                }
            }
            Ok(MetaFeed::Changes(events))
        })?;
        if matches!(&feed, MetaFeed::Changes(c) if c.is_empty()) {
            LOCAL_WATCHERS
                .lock()
                .entry(me.watch_key())
                .or_default()
                .push(slot);
        }
        Ok(feed)
    }

    fn acquire(&self, partition: PartitionId) -> Result<Epoch, StoreError> {
        let me = &*self.inner;
        me.check_open()?;
        let key = me.keys.num(b'O', partition.0);
        me.run(None, |t| {
            let epoch = t
                .get(&key)?
                .as_deref()
                .and_then(codec::unowner)
                .map_or(0, |(e, _)| e)
                + 1;
            t.set(&key, &codec::owner(epoch, &me.node));
            Ok(Epoch(epoch))
        })
    }

    fn try_acquire(&self, partition: PartitionId) -> Result<Option<Epoch>, StoreError> {
        let me = &*self.inner;
        me.check_open()?;
        let key = me.keys.num(b'O', partition.0);
        me.run(None, |t| {
            let held = t.get(&key)?;
            match held.as_deref().and_then(codec::unowner) {
                Some((e, node)) if node == me.node.as_slice() => Ok(Some(Epoch(e))),
                Some(_) => Ok(None),
                None => {
                    t.set(&key, &codec::owner(1, &me.node));
                    Ok(Some(Epoch(1)))
                }
            }
        })
    }

    fn recovered_partitions(&self) -> Result<Vec<PartitionId>, StoreError> {
        let me = &*self.inner;
        let prefix = me.keys.key(b'K', &[]);
        let end = prefix_end(&prefix);
        let mut from = prefix.clone();
        let mut out = Vec::new();
        loop {
            // `K` marks partitions that ever held a message; each is checked
            // for a live one, a page of them per transaction.
            let (page, more) = me.run(None, |t| {
                let rows = t.range(&from, &end, 500)?;
                let mut live = Vec::new();
                for (k, _) in &rows {
                    let p = PartitionId(me.keys.field(k, 0));
                    if !me.live_entries(t, p, 0, 1)?.is_empty() {
                        live.push(p);
                    }
                }
                let next = rows.last().map(|(k, _)| {
                    let mut n = k.clone();
                    n.push(0);
                    n
                });
                Ok((live, if rows.len() == 500 { next } else { None }))
            })?;
            out.extend(page);
            match more {
                Some(next) => from = next,
                None => return Ok(out),
            }
        }
    }

    fn recover_partition(
        &self,
        partition: PartitionId,
    ) -> Result<Vec<RecoveredMessage>, StoreError> {
        let me = &*self.inner;
        let mut out: Vec<RecoveredMessage> = Vec::new();
        let mut from = 0;
        loop {
            // Pages in transactions of their own: a deep partition does not
            // hit the five-second limit. The owner check is repeated per page.
            let page = me.run(None, |t| {
                if me.owner_is_other(t, partition)? {
                    return Err(StoreError::Fenced(partition).into());
                }
                Ok(me.live_entries(t, partition, from, PAGE)?)
            })?;
            let n = page.len();
            out.extend(page.into_iter().map(|(id, e)| RecoveredMessage {
                id,
                location: codec::location(e.chunk, e.offset),
                size: e.size,
                attempts: e.attempts,
                attrs: e.attrs,
            }));
            match out.last() {
                Some(last) if n == PAGE => from = last.id + 1,
                _ => return Ok(out),
            }
        }
    }

    fn recover_receipts(&self, partition: PartitionId) -> Result<Vec<Receipt>, StoreError> {
        let me = &*self.inner;
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        let prefix = me.keys.num(b'V', partition.0);
        me.run(None, |t| {
            if me.owner_is_other(t, partition)? {
                return Err(StoreError::Fenced(partition).into());
            }
            Ok(t.range(&prefix, &prefix_end(&prefix), usize::MAX)?
                .iter()
                .map(|(k, v)| Receipt {
                    key_hash: me.keys.field(k, 8),
                    expires_at_ms: le_u64(v),
                })
                .filter(|r| r.expires_at_ms > now)
                .collect())
        })
    }

    fn compact(&self, _live: &dyn LiveSet) -> Result<usize, StoreError> {
        // Nothing moves: a chunk is deleted whole once nothing lives in
        // it, so positions never change.
        let _one = self.inner.compacting.lock();
        self.inner.reclaim()?;
        Ok(0)
    }

    fn stats(&self) -> StoreStats {
        let me = &*self.inner;
        let prefix = me.keys.key(b'B', &[]);
        let disk = me
            .run(None, |t| {
                Ok(t.range(&prefix, &prefix_end(&prefix), usize::MAX)?
                    .iter()
                    .map(|(_, v)| le_u64(v) as i64)
                    .sum::<i64>())
            })
            .unwrap_or(0);
        StoreStats {
            appended_bytes: me.appended.load(Ordering::Relaxed),
            syncs: me.commits.load(Ordering::Relaxed),
            segments: 0,
            disk_bytes: disk.max(0) as u64,
            reclaimed_segments: me.reclaimed.load(Ordering::Relaxed),
        }
    }

    fn close(&self) -> Result<(), StoreError> {
        self.inner.closed.store(true, Ordering::Release);
        self.inner.reader.stop();
        Ok(())
    }

    fn scan_state(&self, prefix: &[u8]) -> Result<Vec<StateEntry>, StoreError> {
        let me = &*self.inner;
        let begin = me.keys.key(b'S', &[prefix]);
        let skip = me.keys.key(b'S', &[]).len();
        me.run(None, |t| {
            let rows = t.range(&begin, &prefix_end(&begin), usize::MAX)?;
            let mut out = Vec::with_capacity(rows.len());
            for (k, v) in rows {
                let key = k[skip..].to_vec();
                let version = le_u64(&v[..v.len().min(8)]);
                let parts = v
                    .get(8..12)
                    .map_or(1, |b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]));
                let mut value = v.get(12..).unwrap_or_default().to_vec();
                if parts > 1 {
                    let pp = me.keys.state_parts(&key);
                    for (_, p) in t.range(&pp, &prefix_end(&pp), usize::MAX)? {
                        value.extend_from_slice(&p);
                    }
                }
                out.push(StateEntry {
                    key,
                    value,
                    version,
                });
            }
            Ok(out)
        })
    }
}
