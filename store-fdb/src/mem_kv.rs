//! [`MemKv`]: the key/value seam in memory, with FoundationDB's
//! optimistic concurrency (a transaction that read a key or range another
//! committed transaction wrote after it began fails with a retryable
//! conflict), so the store's logic runs and is tested without a cluster.

use crate::kv::{le_u64, Kv, KvError, KvTxn, KvWake, Pairs};
use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::sync::Arc;

/// Commits remembered for conflict checks; a transaction older than the
/// oldest of them conflicts (as FoundationDB's 5-second window would).
const HISTORY: usize = 4096;

/// (commit version, keys written, ranges cleared).
type Commit = (u64, Vec<Vec<u8>>, Vec<(Vec<u8>, Vec<u8>)>);

#[derive(Default)]
struct State {
    data: BTreeMap<Vec<u8>, Vec<u8>>,
    version: u64,
    /// What each recent commit wrote.
    history: std::collections::VecDeque<Commit>,
    watches: Vec<(Vec<u8>, KvWake)>,
}

/// An in-memory transactional key/value store (cheap to clone: handles
/// share the data).
#[derive(Clone, Default)]
pub struct MemKv {
    state: Arc<Mutex<State>>,
}

impl MemKv {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }
}

impl Kv for MemKv {
    fn begin(&self) -> Result<Box<dyn KvTxn>, KvError> {
        let version = self.state.lock().version;
        Ok(Box::new(MemTxn {
            kv: self.clone(),
            read_version: version,
            reads: Vec::new(),
            read_ranges: Vec::new(),
            writes: Vec::new(),
            watches: Vec::new(),
        }))
    }
}

enum Write {
    Set(Vec<u8>, Vec<u8>),
    Clear(Vec<u8>),
    ClearRange(Vec<u8>, Vec<u8>),
    Add(Vec<u8>, i64),
    Max(Vec<u8>, u64),
}

struct MemTxn {
    kv: MemKv,
    read_version: u64,
    reads: Vec<Vec<u8>>,
    read_ranges: Vec<(Vec<u8>, Vec<u8>)>,
    writes: Vec<Write>,
    watches: Vec<(Vec<u8>, KvWake)>,
}

fn apply(data: &mut BTreeMap<Vec<u8>, Vec<u8>>, w: &Write) {
    match w {
        Write::Set(k, v) => {
            data.insert(k.clone(), v.clone());
        }
        Write::Clear(k) => {
            data.remove(k);
        }
        Write::ClearRange(b, e) => {
            let keys: Vec<Vec<u8>> = data
                .range(b.clone()..e.clone())
                .map(|(k, _)| k.clone())
                .collect();
            for k in keys {
                data.remove(&k);
            }
        }
        Write::Add(k, d) => {
            let v = data.get(k).map_or(0, |v| le_u64(v)).wrapping_add(*d as u64);
            data.insert(k.clone(), v.to_le_bytes().to_vec());
        }
        Write::Max(k, m) => {
            let v = data.get(k).map_or(0, |v| le_u64(v)).max(*m);
            data.insert(k.clone(), v.to_le_bytes().to_vec());
        }
    }
}

impl MemTxn {
    /// The committed data with this transaction's writes applied (read
    /// your writes).
    fn view(&self, begin: &[u8], end: &[u8]) -> BTreeMap<Vec<u8>, Vec<u8>> {
        let st = self.kv.state.lock();
        let mut view: BTreeMap<Vec<u8>, Vec<u8>> = st
            .data
            .range(begin.to_vec()..end.to_vec())
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        drop(st);
        for w in &self.writes {
            apply(&mut view, w);
        }
        view.retain(|k, _| k.as_slice() >= begin && k.as_slice() < end);
        view
    }
}

impl KvTxn for MemTxn {
    fn get(&mut self, key: &[u8]) -> Result<Option<Vec<u8>>, KvError> {
        self.reads.push(key.to_vec());
        let mut end = key.to_vec();
        end.push(0);
        Ok(self.view(key, &end).remove(key))
    }

    fn range(&mut self, begin: &[u8], end: &[u8], limit: usize) -> Result<Pairs, KvError> {
        let out: Vec<(Vec<u8>, Vec<u8>)> = self.view(begin, end).into_iter().take(limit).collect();
        // Conflicts cover what was read: up to the last key returned when
        // the limit cut the range.
        let read_end = match out.last() {
            Some((k, _)) if out.len() == limit => {
                let mut e = k.clone();
                e.push(0);
                e
            }
            _ => end.to_vec(),
        };
        self.read_ranges.push((begin.to_vec(), read_end));
        Ok(out)
    }

    fn set(&mut self, key: &[u8], value: &[u8]) {
        self.writes.push(Write::Set(key.to_vec(), value.to_vec()));
    }

    fn clear(&mut self, key: &[u8]) {
        self.writes.push(Write::Clear(key.to_vec()));
    }

    fn clear_range(&mut self, begin: &[u8], end: &[u8]) {
        self.writes
            .push(Write::ClearRange(begin.to_vec(), end.to_vec()));
    }

    fn add(&mut self, key: &[u8], delta: i64) {
        self.writes.push(Write::Add(key.to_vec(), delta));
    }

    fn max(&mut self, key: &[u8], value: u64) {
        self.writes.push(Write::Max(key.to_vec(), value));
    }

    fn watch(&mut self, key: &[u8], wake: KvWake) -> Result<(), KvError> {
        self.watches.push((key.to_vec(), wake));
        Ok(())
    }

    fn commit(self: Box<Self>) -> Result<(), KvError> {
        let MemTxn {
            kv,
            read_version,
            reads,
            read_ranges,
            writes,
            watches,
        } = *self;
        let mut fired = Vec::new();
        {
            let mut st = kv.state.lock();
            let hit = |k: &[u8]| {
                reads.iter().any(|r| r.as_slice() == k)
                    || read_ranges
                        .iter()
                        .any(|(b, e)| k >= b.as_slice() && k < e.as_slice())
            };
            let overlaps = |b: &[u8], e: &[u8]| {
                reads.iter().any(|r| r.as_slice() >= b && r.as_slice() < e)
                    || read_ranges
                        .iter()
                        .any(|(rb, re)| rb.as_slice() < e && b < re.as_slice())
            };
            if st
                .history
                .front()
                .is_some_and(|(v, _, _)| *v > read_version + 1)
                && st.version > read_version
            {
                return Err(KvError::retryable("transaction too old"));
            }
            for (v, keys, ranges) in &st.history {
                if *v <= read_version {
                    continue;
                }
                if keys.iter().any(|k| hit(k)) || ranges.iter().any(|(b, e)| overlaps(b, e)) {
                    return Err(KvError::retryable("conflict"));
                }
            }
            let mut keys = Vec::new();
            let mut ranges = Vec::new();
            for w in &writes {
                apply(&mut st.data, w);
                match w {
                    Write::Set(k, _) | Write::Clear(k) | Write::Add(k, _) | Write::Max(k, _) => {
                        keys.push(k.clone())
                    }
                    Write::ClearRange(b, e) => ranges.push((b.clone(), e.clone())),
                }
            }
            if !writes.is_empty() {
                st.version += 1;
                let v = st.version;
                let changed = |k: &[u8]| {
                    keys.iter().any(|w| w.as_slice() == k)
                        || ranges
                            .iter()
                            .any(|(b, e)| k >= b.as_slice() && k < e.as_slice())
                };
                let (hit_w, keep): (Vec<_>, Vec<_>) = std::mem::take(&mut st.watches)
                    .into_iter()
                    .partition(|(k, _)| changed(k));
                st.watches = keep;
                fired.extend(hit_w.into_iter().map(|(_, w)| w));
                st.history.push_back((v, keys, ranges));
                while st.history.len() > HISTORY {
                    st.history.pop_front();
                }
            }
            // A watch whose key changed since this transaction read it
            // fires at once, as FoundationDB's does.
            for (k, w) in watches {
                let stale = st
                    .history
                    .iter()
                    .any(|(v, keys, _)| *v > read_version && keys.contains(&k));
                if stale {
                    fired.push(w);
                } else {
                    st.watches.push((k, w));
                }
            }
        }
        for w in fired {
            w();
        }
        Ok(())
    }
}
