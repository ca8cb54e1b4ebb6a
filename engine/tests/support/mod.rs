//! What the engine's in-process tests share: an engine over a fresh store
//! ([`engine`], the one place that picks the store), and short forms of the
//! tenant calls the tests repeat. No sockets, no broker process.

#![allow(dead_code)] // each test file uses a different subset

use serde_json::{json, Map, Value};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use weir_backend::testing::MemStore;
use weir_engine::exchange::{ExchangeDef, ExchangeKind, HeaderLookup};
use weir_engine::meta::DestinationKind;
use weir_engine::tenant::{QueueDeclare, QueueDeclared, RouteInput};
use weir_engine::ManualClock;
use weir_engine::{Engine, EngineError, Tenant, DEFAULT_TENANT};

/// The connection id most tests act as.
pub const CONN: u64 = 1;
/// Another connection (for exclusive-queue checks).
pub const OTHER: u64 = 2;

/// An engine over its own store. Field order matters: the engine (and its
/// store's writer thread) goes before the directory is removed.
pub struct TestEngine {
    /// The engine.
    pub engine: Arc<Engine>,
    /// Its clock: time moves only when a test advances it.
    pub clock: Arc<ManualClock>,
    _dir: TempDir,
}

impl TestEngine {
    /// The default tenant (AMQP vhost `/`).
    pub fn tenant(&self) -> Arc<Tenant> {
        self.engine
            .tenant(DEFAULT_TENANT)
            .expect("the default tenant always exists")
    }
}

/// A fresh engine over the in-memory store (`MemStore`, which passes the
/// same contract suite as the log store); swapping in another `Store` is
/// the one line marked below.
pub fn engine() -> TestEngine {
    let store = MemStore::new(); // ← the store
    let clock = ManualClock::new();
    let engine = Engine::open(store, clock.clone()).expect("opening the engine");
    TestEngine {
        engine,
        clock,
        _dir: TempDir::new(),
    }
}

/// A directory under the system temp dir, removed on drop (the engine crate
/// has no `tempfile` dependency, and needs none for this).
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> TempDir {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let p = std::env::temp_dir().join(format!(
            "weir-engine-test-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&p).expect("creating a temp dir");
        TempDir(p)
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// An exchange definition with every flag off.
pub fn xdef(name: &str, kind: ExchangeKind) -> ExchangeDef {
    ExchangeDef {
        name: name.into(),
        kind,
        durable: false,
        auto_delete: false,
        internal: false,
        delayed: false,
        arguments: json!({}),
    }
}

/// A queue.declare of `name` by [`CONN`] with every flag off.
pub fn qdecl(name: &str) -> QueueDeclare {
    QueueDeclare {
        name: name.into(),
        passive: false,
        durable: false,
        exclusive: false,
        auto_delete: false,
        arguments: json!({}),
        connection: CONN,
    }
}

/// Declares an exchange (panics on error).
pub fn exchange(t: &Tenant, name: &str, kind: ExchangeKind) {
    t.declare_exchange(xdef(name, kind), false)
        .unwrap_or_else(|e| panic!("declaring exchange {name}: {e}"));
}

/// Declares a queue (panics on error).
pub fn queue(t: &Tenant, name: &str) -> QueueDeclared {
    t.declare_queue(qdecl(name))
        .unwrap_or_else(|e| panic!("declaring queue {name}: {e}"))
        .0
}

/// queue.bind by [`CONN`] (panics on error).
pub fn bind(t: &Tenant, queue: &str, exchange: &str, key: &str) {
    bind_args(t, queue, exchange, key, json!({}));
}

/// queue.bind with arguments (panics on error).
pub fn bind_args(t: &Tenant, queue: &str, exchange: &str, key: &str, args: Value) {
    t.bind(exchange, DestinationKind::Queue, queue, key, args, CONN)
        .unwrap_or_else(|e| panic!("binding {queue} to {exchange}/{key}: {e}"));
}

/// queue.unbind by [`CONN`] (panics on error).
pub fn unbind(t: &Tenant, queue: &str, exchange: &str, key: &str) {
    t.unbind(
        exchange,
        DestinationKind::Queue,
        queue,
        key,
        json!({}),
        CONN,
    )
    .unwrap_or_else(|e| panic!("unbinding {queue} from {exchange}/{key}: {e}"));
}

/// exchange.bind: `source` routes to `destination` (panics on error).
pub fn bind_x(t: &Tenant, destination: &str, source: &str, key: &str) {
    t.bind(
        source,
        DestinationKind::Exchange,
        destination,
        key,
        json!({}),
        CONN,
    )
    .unwrap_or_else(|e| panic!("binding exchange {destination} to {source}/{key}: {e}"));
}

/// Message headers for a headers exchange, as the adapters hand them over:
/// a JSON object.
pub struct Headers(pub Map<String, Value>);

impl HeaderLookup for Headers {
    fn header(&self, name: &str) -> Option<Value> {
        self.0.get(name).cloned()
    }
}

/// No headers.
pub fn no_headers() -> Headers {
    Headers(Map::new())
}

/// The names of the queues a message published to `exchange` with `key`
/// reaches, sorted (duplicates kept, so a queue routed twice shows).
pub fn try_route(
    t: &Tenant,
    exchange: &str,
    key: &str,
    headers: &Headers,
) -> Result<Vec<String>, EngineError> {
    let mut out = Vec::new();
    let _how = t.route(
        &RouteInput {
            exchange,
            routing_key: key,
            headers,
        },
        &mut out,
    )?;
    let mut names: Vec<String> = out.iter().map(|q| q.name().to_string()).collect();
    names.sort();
    Ok(names)
}

/// [`try_route`] without headers, panicking on error.
pub fn route(t: &Tenant, exchange: &str, key: &str) -> Vec<String> {
    try_route(t, exchange, key, &no_headers())
        .unwrap_or_else(|e| panic!("routing {exchange}/{key}: {e}"))
}

/// Whether `name` exists, as a passive declare by [`CONN`] sees it.
pub fn queue_exists(t: &Tenant, name: &str) -> bool {
    match t.declare_queue(QueueDeclare {
        passive: true,
        ..qdecl(name)
    }) {
        Ok(_) => true,
        Err(EngineError::NotFound(_)) => false,
        Err(e) => panic!("passive declare of {name}: {e}"),
    }
}

/// Whether the exchange `name` exists, as a passive declare sees it.
pub fn exchange_exists(t: &Tenant, name: &str) -> bool {
    match t.declare_exchange(xdef(name, ExchangeKind::Direct), true) {
        Ok(_) => true,
        Err(EngineError::NotFound(_)) => false,
        Err(e) => panic!("passive declare of exchange {name}: {e}"),
    }
}
