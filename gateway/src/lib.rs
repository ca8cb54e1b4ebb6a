//! The Weir gateway: configuration, listeners, the routing and lease engine,
//! and the protocol sessions that connect them.
//!
//! * [`config`]: settings from file, environment and flags.
//! * [`engine`]: tenants, exchanges, queues, consumers, leases.
//! * [`header_codecs`]: each protocol's header codec under its format number.
//! * [`amqp`]: one task per AMQP connection, driving the sans-IO adapter.
//! * [`mqtt`]: MQTT topic and message conversion.
//! * [`http`]: the management API, `/metrics` and the dashboard.
//! * [`metrics`]: the Prometheus recorder, metric names, scrape-time figures.
//! * [`server`]: listeners, store opening, graceful shutdown.
//! * [`tenant_gate`]: a session's view of its tenant's block and publish rate.
//! * `otel` (cargo feature `otel`): OpenTelemetry export of the spans.
//! * [`tls`]: TLS for the AMQPS and MQTTS listeners, certificate reload.

pub mod amqp;
pub mod config;
pub mod connections;
pub mod header_codecs;
pub mod http;
pub mod metrics;
pub mod mqtt;
#[cfg(feature = "otel")]
pub mod otel;
pub mod server;
pub mod tenant_gate;
pub mod tls;

/// The engine lives in its own crate (`weir-engine`); re-exported for the sessions.
pub use weir_engine as engine;
