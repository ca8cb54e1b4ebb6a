//! What the in-process session tests share: the real listener and sessions
//! over an in-memory store.

#![allow(dead_code)] // each test file uses some of it

use std::net::SocketAddr;
use std::sync::Arc;
use weir_backend::testing::MemStore;
use weir_gateway::config::{Cli, Config};
use weir_gateway::server::Broker;

/// The addresses of a broker started by [`start`].
pub struct Addrs {
    pub amqp: SocketAddr,
    pub mqtt: SocketAddr,
    pub mqtt_ws: SocketAddr,
    pub http: SocketAddr,
}

/// A broker on free ports over `store`, serving until the test ends.
pub async fn start(store: Arc<MemStore>, dir: &std::path::Path) -> Addrs {
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
    let addrs = Addrs {
        amqp: b.amqp_addr().expect("bound"),
        mqtt: b.listener_addr("MQTT").expect("bound"),
        mqtt_ws: b.listener_addr("MQTT WebSocket").expect("bound"),
        http: b.http_addr().expect("bound"),
    };
    tokio::spawn(b.run(std::future::pending()));
    addrs
}

/// A broker on a free port over `store`; returns its AMQP URI.
pub async fn broker(store: Arc<MemStore>, dir: &std::path::Path) -> String {
    let addrs = start(store, dir).await;
    format!("amqp://guest:guest@{}/%2f", addrs.amqp)
}
