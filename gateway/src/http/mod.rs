//! The HTTP listener (`[http] listen`, default `0.0.0.0:15672` as RabbitMQ's
//! management plugin): the management API under `/api` ([`api`]), Prometheus
//! metrics at `/metrics` ([`metrics`]) and the dashboard at `/`
//! ([`dashboard`]), one axum router over the broker's [`Services`].
//!
//! Handlers never touch queue state directly: they read the engine's
//! figures and change definitions through the same engine calls the
//! protocols use, so the API obeys the same rules and errors.

pub mod api;
pub mod conn;
pub mod dashboard;
pub mod error;
pub mod metrics;
pub mod render;

use std::sync::Arc;
use std::time::Instant;

use axum::extract::Request;
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Router;
use tokio::net::TcpListener;
use tokio::sync::watch;

pub use conn::Limits;

use crate::server::Services;

/// What every handler can reach.
pub struct HttpState {
    /// The broker: engine, authenticator, alarms, AMQP and MQTT state.
    pub shared: Arc<Services>,
    /// When the broker started (uptime in `/api/overview`).
    pub started: Instant,
    /// `[http] metrics_per_queue`: `/metrics` writes one series per queue.
    pub metrics_per_queue: bool,
    /// `[http] metrics_auth`: the per-queue series need a monitoring user.
    pub metrics_auth: bool,
    /// The rates sampler, started by the first request that reports rates.
    pub rates: std::sync::OnceLock<Arc<api::rates::Sampler>>,
    /// One render at a time per kind of expensive answer.
    pub gates: render::Gates,
}

impl HttpState {
    /// The state of a listener configured by `cfg`.
    pub fn new(shared: Arc<Services>, started: Instant, cfg: &crate::config::HttpConfig) -> State {
        Arc::new(HttpState {
            gates: render::Gates::new(&shared),
            shared,
            started,
            metrics_per_queue: cfg.metrics_per_queue,
            metrics_auth: cfg.metrics_auth,
            rates: Default::default(),
        })
    }

    /// The rates sampler (started on first use).
    pub fn rates(&self) -> &Arc<api::rates::Sampler> {
        self.rates
            .get_or_init(|| api::rates::Sampler::start(&self.shared.engine))
    }
}

/// The handlers' shared state, as axum passes it.
pub type State = Arc<HttpState>;

/// The whole HTTP surface.
pub fn router(state: State) -> Router {
    Router::new()
        .merge(api::router())
        .merge(metrics::router())
        .merge(dashboard::router())
        .fallback(error::not_found)
        .layer(axum::middleware::from_fn(json_bodies_only))
        .with_state(state)
}

/// Serves `listener` until `shutdown` turns true; requests in flight finish.
/// Connections are bounded and timed out as `limits` says ([`conn`]).
pub async fn serve(
    listener: TcpListener,
    state: State,
    limits: Limits,
    shutdown: watch::Receiver<bool>,
) {
    conn::serve(listener, router(state), limits, shutdown).await;
}

/// Request bodies are JSON: one with another content type is refused with
/// 415 before any handler parses it (as RabbitMQ's API does; `rabbitmqadmin`,
/// `weirctl` and the dashboard send `application/json`). Empty bodies need
/// no content type.
async fn json_bodies_only(req: Request, next: Next) -> Response {
    let h = req.headers();
    let has_body = h.contains_key(header::TRANSFER_ENCODING)
        || h.get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.trim() != "0");
    if has_body && !is_json(h.get(header::CONTENT_TYPE)) {
        return error::ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
            "request bodies must be JSON: send Content-Type: application/json",
        )
        .into_response();
    }
    next.run(req).await
}

/// `application/json` or a `+json` type, parameters (charset) allowed.
fn is_json(v: Option<&axum::http::HeaderValue>) -> bool {
    let Some(t) = v.and_then(|v| v.to_str().ok()) else {
        return false;
    };
    let t = t
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    t == "application/json" || (t.starts_with("application/") && t.ends_with("+json"))
}
