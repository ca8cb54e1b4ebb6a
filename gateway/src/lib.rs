//! The Weir gateway: configuration, listeners, the routing and lease engine,
//! and the protocol sessions that connect them.
//!
//! * [`config`]: settings from file, environment and flags.
//! * [`engine`]: tenants, exchanges, queues, consumers, leases.
//! * [`header_codecs`]: each protocol's header codec under its format number.
//! * [`session`]: the session driver: one socket loop for every protocol,
//!   its adapter trait, flow control and answers that wait for the store.
//! * [`amqp`]: the AMQP 0-9-1 session (an adapter of the driver).
//! * [`mqtt`]: the MQTT 3.1.1/5 session, over TCP and WebSocket.
//! * [`http`]: the management API, `/metrics` and the dashboard.
//! * [`metrics`]: the Prometheus recorder, metric names, scrape-time figures.
//! * [`server`]: the broker's services, listeners, resource monitors,
//!   store opening, graceful shutdown.
//! * [`tenant_gate`]: a session's view of its tenant's block and publish rate.
//! * `otel` (cargo feature `otel`): OpenTelemetry export of the spans.
//! * [`readiness`]: `READY=1` to systemd (`Type=notify`) once listening.
//! * [`tls`]: TLS for the AMQPS and MQTTS listeners, certificate reload.

pub mod amqp;
pub mod config;
pub mod connections;
pub mod header_codecs;
pub mod http;
pub mod log_format;
pub mod metrics;
pub mod mqtt;
#[cfg(feature = "otel")]
pub mod otel;
pub mod readiness;
pub mod server;
pub mod session;
pub mod shovel;
pub mod tenant_gate;
pub mod tls;

/// `weir --version`: the crate version and the commit it was built from
/// (`build.rs`: `git rev-parse`, or `WEIR_COMMIT` where there is no `.git`,
/// as in a container build).
pub const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (commit ",
    env!("WEIR_COMMIT"),
    ")"
);

/// The engine lives in its own crate (`weir-engine`); re-exported for the sessions.
pub use weir_engine as engine;
