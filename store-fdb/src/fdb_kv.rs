//! `FdbKv`: the key/value seam over a FoundationDB cluster (cargo feature
//! `fdb`), through the `foundationdb` crate. Each call blocks the calling
//! thread on the client's future: the store calls the seam from its own
//! threads (appends from the caller, reads on the reader threads), never
//! awaiting inside a runtime.

use crate::kv::{Kv, KvError, KvErrorKind, KvTxn, KvWake, Pairs};
use foundationdb::options::MutationType;
use foundationdb::{Database, FdbError, RangeOption, Transaction};
use futures_executor::block_on;
use parking_lot::Mutex;
use std::sync::{Arc, OnceLock};
use std::time::Instant;

/// The client's network thread: started once per process and kept for its
/// life (FoundationDB cannot start it again after stopping it).
static NETWORK: OnceLock<Result<(), String>> = OnceLock::new();

fn boot() -> Result<(), KvError> {
    NETWORK
        .get_or_init(|| {
            let guard = foundationdb::api::FdbApiBuilder::default()
                .build()
                .map_err(|e| format!("FoundationDB API: {e}"))
                .and_then(|b| {
                    // SAFETY: called once per process (OnceLock), and the
                    // guard is leaked so the network is never stopped while
                    // a handle may still use it (what `boot` requires).
                    unsafe { b.boot() }.map_err(|e| format!("FoundationDB network: {e}"))
                })?;
            Box::leak(Box::new(guard));
            Ok(())
        })
        .clone()
        .map_err(KvError::fatal)
}

fn kv_error(e: FdbError) -> KvError {
    let kind = if e.is_maybe_committed() {
        KvErrorKind::MaybeCommitted
    } else if e.is_retryable() {
        KvErrorKind::Retryable
    } else {
        KvErrorKind::Fatal
    };
    KvError {
        kind,
        message: format!("FoundationDB error {}: {}", e.code(), e.message()),
    }
}

/// A read version younger than this is reused by [`Kv::begin_recent`]
/// (FoundationDB keeps versions readable for five seconds).
const RECENT: std::time::Duration = std::time::Duration::from_millis(1000);

/// A FoundationDB database as a [`Kv`].
pub struct FdbKv {
    db: Database,
    /// The newest version this handle read at or committed, and when.
    seen: Arc<Mutex<(i64, Instant)>>,
}

impl FdbKv {
    /// Opens the cluster named by `cluster_file` (empty: FoundationDB's
    /// default cluster file), starting the client's network thread on
    /// first use.
    pub fn open(cluster_file: &str) -> Result<Self, KvError> {
        if cluster_file.contains('\0') {
            return Err(KvError::fatal("a cluster file path with a NUL byte"));
        }
        boot()?;
        let path = (!cluster_file.is_empty()).then_some(cluster_file);
        let db = Database::new(path).map_err(kv_error)?;
        Ok(FdbKv {
            db,
            seen: Arc::new(Mutex::new((0, Instant::now()))),
        })
    }
}

impl Kv for FdbKv {
    fn begin(&self) -> Result<Box<dyn KvTxn>, KvError> {
        let trx = self.db.create_trx().map_err(kv_error)?;
        Ok(Box::new(FdbTxn {
            trx,
            watches: Vec::new(),
            seen: self.seen.clone(),
        }))
    }

    fn begin_recent(&self) -> Result<Box<dyn KvTxn>, KvError> {
        let trx = self.db.create_trx().map_err(kv_error)?;
        let (version, at) = *self.seen.lock();
        if version > 0 && at.elapsed() < RECENT {
            trx.set_read_version(version);
        }
        Ok(Box::new(FdbTxn {
            trx,
            watches: Vec::new(),
            seen: self.seen.clone(),
        }))
    }
}

type WatchFuture =
    Box<dyn std::future::Future<Output = foundationdb::FdbResult<()>> + Send + Unpin>;

struct FdbTxn {
    trx: Transaction,
    watches: Vec<(WatchFuture, KvWake)>,
    seen: Arc<Mutex<(i64, Instant)>>,
}

/// Records `version` as seen now, if newer.
fn saw(seen: &Mutex<(i64, Instant)>, version: i64) {
    let mut s = seen.lock();
    if version > s.0 {
        *s = (version, Instant::now());
    }
}

impl KvTxn for FdbTxn {
    fn get(&mut self, key: &[u8]) -> Result<Option<Vec<u8>>, KvError> {
        block_on(self.trx.get(key, false))
            .map(|v| v.map(|s| s.to_vec()))
            .map_err(kv_error)
    }

    fn get_many(&mut self, keys: &[Vec<u8>]) -> Result<Vec<Option<Vec<u8>>>, KvError> {
        // Issued together, awaited in order: one round trip, not one per key.
        let futures: Vec<_> = keys.iter().map(|k| self.trx.get(k, false)).collect();
        futures
            .into_iter()
            .map(|f| block_on(f).map(|v| v.map(|s| s.to_vec())).map_err(kv_error))
            .collect()
    }

    fn range(&mut self, begin: &[u8], end: &[u8], limit: usize) -> Result<Pairs, KvError> {
        let mut out = Vec::new();
        let mut from = begin.to_vec();
        let mut iteration = 1;
        while out.len() < limit {
            let mut opt = RangeOption::from((from.clone(), end.to_vec()));
            opt.limit = Some(limit - out.len());
            opt.mode = foundationdb::options::StreamingMode::WantAll;
            let values = block_on(self.trx.get_range(&opt, iteration, false)).map_err(kv_error)?;
            let more = values.more();
            for kv in values.iter() {
                out.push((kv.key().to_vec(), kv.value().to_vec()));
            }
            match out.last() {
                Some((k, _)) if more => {
                    from = k.clone();
                    from.push(0);
                    iteration += 1;
                }
                _ => break,
            }
        }
        Ok(out)
    }

    fn set(&mut self, key: &[u8], value: &[u8]) {
        self.trx.set(key, value);
    }

    fn clear(&mut self, key: &[u8]) {
        self.trx.clear(key);
    }

    fn clear_range(&mut self, begin: &[u8], end: &[u8]) {
        self.trx.clear_range(begin, end);
    }

    fn add(&mut self, key: &[u8], delta: i64) {
        self.trx
            .atomic_op(key, &delta.to_le_bytes(), MutationType::Add);
    }

    fn max(&mut self, key: &[u8], value: u64) {
        self.trx
            .atomic_op(key, &value.to_le_bytes(), MutationType::Max);
    }

    fn watch(&mut self, key: &[u8], wake: KvWake) -> Result<(), KvError> {
        self.watches.push((Box::new(self.trx.watch(key)), wake));
        Ok(())
    }

    fn commit(self: Box<Self>) -> Result<(), KvError> {
        let FdbTxn { trx, watches, seen } = *self;
        // Every transaction of the store reads first, so this is known.
        if let Ok(v) = block_on(trx.get_read_version()) {
            saw(&seen, v);
        }
        let committed = block_on(trx.commit()).map_err(|e| kv_error(*e))?;
        if let Ok(v) = committed.committed_version() {
            saw(&seen, v);
        }
        for (fut, wake) in watches {
            // One thread per armed watch: the store keeps at most one armed
            // per handle (its change feed), so this is bounded.
            std::thread::Builder::new()
                .name("weir-fdb-watch".into())
                .spawn(move || {
                    // Woken on a change or an error alike: the store then
                    // reads the feed and re-arms.
                    let _ = block_on(fut);
                    wake();
                })
                .map_err(|e| KvError::fatal(format!("watch thread: {e}")))?;
        }
        Ok(())
    }
}
