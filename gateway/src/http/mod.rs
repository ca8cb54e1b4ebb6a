//! The HTTP listener (`[http] listen`, default `0.0.0.0:15672` as RabbitMQ's
//! management plugin): the management API under `/api` ([`api`]), Prometheus
//! metrics at `/metrics` ([`metrics`]) and the dashboard at `/`
//! ([`dashboard`]), one axum router over the broker's [`Shared`] state.
//!
//! Handlers never touch queue state directly: they read the engine's
//! figures and change definitions through the same engine calls the
//! protocols use, so the API obeys the same rules and errors.

pub mod api;
pub mod dashboard;
pub mod error;
pub mod metrics;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use axum::Router;
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::server::Shared;

/// What every handler can reach.
pub struct HttpState {
    /// The broker: engine, authenticator, alarms, AMQP and MQTT state.
    pub shared: Arc<Shared>,
    /// When the broker started (uptime in `/api/overview`).
    pub started: Instant,
    /// `[http] metrics_per_queue`: `/metrics` writes one series per queue.
    pub metrics_per_queue: bool,
    /// The rates sampler, started by the first request that reports rates.
    pub rates: std::sync::OnceLock<Arc<api::rates::Sampler>>,
}

impl HttpState {
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
        .with_state(state)
}

/// Serves `listener` until `shutdown` turns true; requests in flight finish.
pub async fn serve(listener: TcpListener, state: State, mut shutdown: watch::Receiver<bool>) {
    let app = router(state).into_make_service_with_connect_info::<SocketAddr>();
    let stop = async move {
        let _ = shutdown.wait_for(|s| *s).await;
    };
    if let Err(e) = axum::serve(listener, app)
        .with_graceful_shutdown(stop)
        .await
    {
        tracing::error!(error = %e, "HTTP listener failed");
    }
}
