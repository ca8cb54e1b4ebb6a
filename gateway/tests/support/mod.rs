//! What the in-process session tests share: the real listener and sessions
//! over an in-memory store.

use std::sync::Arc;
use weir_backend::testing::MemStore;
use weir_gateway::config::{Cli, Config};
use weir_gateway::server::Broker;

/// A broker on a free port over `store`; returns its AMQP URI.
pub async fn broker(store: Arc<MemStore>, dir: &std::path::Path) -> String {
    let cli = Cli::try_parse_from([
        "weir",
        "--amqp-listen",
        "127.0.0.1:0",
        "--mqtt-listen",
        "127.0.0.1:0",
        "--mqtt-ws-listen",
        "127.0.0.1:0",
        "--http-listen",
        "127.0.0.1:0",
        "--data-dir",
        dir.to_str().expect("utf-8 temp dir"),
        "--disk-free-limit",
        "1MB",
    ])
    .expect("flags parse");
    let cfg = Config::load_with_env(cli, |_| None).expect("config loads");
    let b = Broker::start_with_store(&cfg, store)
        .await
        .expect("broker starts");
    let addr = b.amqp_addr().expect("bound");
    tokio::spawn(b.run(std::future::pending()));
    format!("amqp://guest:guest@{addr}/%2f")
}
