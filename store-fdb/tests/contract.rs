//! The store contract (v1 rules, contract_v2 and contract_lifecycle: the
//! whole suite of `weir_backend::testing::contract::run_all`) against the
//! FoundationDB store: over the in-memory seam always, and over a real
//! cluster when `WEIR_FDB_CLUSTER_FILE` names one (cargo feature `fdb`;
//! `scripts/start-fdb.sh` starts one and prints the variable).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use weir_backend::testing::contract::{run_all, Harness};
use weir_backend::Store;
use weir_store_fdb::kv::Kv;
use weir_store_fdb::{FdbStore, FdbStoreConfig, MemKv};

/// Stores over one seam; every `create` takes a fresh root prefix.
struct KvHarness {
    kv: Box<dyn Fn() -> Arc<dyn Kv>>,
    current: Option<(Arc<dyn Kv>, Vec<u8>)>,
}

static ROOTS: AtomicU64 = AtomicU64::new(0);

impl KvHarness {
    fn open(&self, node: &str) -> Arc<dyn Store> {
        let (kv, root) = self.current.clone().expect("created first");
        let config = FdbStoreConfig {
            root,
            node: node.into(),
            reader_threads: 2,
        };
        FdbStore::open(kv, config).expect("open")
    }
}

impl Harness for KvHarness {
    fn create(&mut self) -> Arc<dyn Store> {
        let root = format!(
            "weir-test/{}/{}/{}/",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos()),
            ROOTS.fetch_add(1, Ordering::Relaxed)
        );
        self.current = Some(((self.kv)(), root.into_bytes()));
        self.open("a")
    }

    fn persists(&self) -> bool {
        true
    }

    fn reopen(&mut self, store: Arc<dyn Store>) -> Arc<dyn Store> {
        store.close().expect("close");
        drop(store);
        self.open("a")
    }

    fn second_handle(&mut self, _store: &Arc<dyn Store>) -> Option<Arc<dyn Store>> {
        Some(self.open("b"))
    }

    fn crash(&mut self, store: Arc<dyn Store>) -> Option<Arc<dyn Store>> {
        // Nothing of a commit is left to lose once append returned: a crash
        // is a new handle of the same node without closing the old one.
        drop(store);
        Some(self.open("a"))
    }
}

#[test]
fn contract_over_the_in_memory_seam() {
    run_all(&mut KvHarness {
        kv: Box::new(|| Arc::new(MemKv::new())),
        current: None,
    });
}

#[cfg(feature = "fdb")]
#[test]
fn contract_against_a_foundationdb_cluster() {
    let Ok(file) = std::env::var("WEIR_FDB_CLUSTER_FILE") else {
        println!("skipped: WEIR_FDB_CLUSTER_FILE is not set (scripts/start-fdb.sh start DIR sets up a cluster)");
        return;
    };
    let kv: Arc<dyn Kv> = Arc::new(weir_store_fdb::FdbKv::open(&file).expect("open the cluster"));
    run_all(&mut KvHarness {
        kv: Box::new(move || kv.clone()),
        current: None,
    });
    println!("passed against the cluster of {file}");
}

#[cfg(not(feature = "fdb"))]
#[test]
fn contract_against_a_foundationdb_cluster() {
    println!(
        "skipped: built without the `fdb` feature (cargo test -p weir-store-fdb --features fdb)"
    );
}
