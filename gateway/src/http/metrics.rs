//! `GET /metrics`: Prometheus text format (see [`crate::metrics`]).

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;

/// The `/metrics` route.
pub fn router() -> Router<super::State> {
    Router::new().route("/metrics", get(scrape))
}

/// One scrape. The walk over every queue runs on the blocking pool, so a
/// large scrape never holds a runtime worker that serves connections.
async fn scrape(State(state): State<super::State>) -> Response {
    let s = state.clone();
    match tokio::task::spawn_blocking(move || {
        crate::metrics::render::render(&s.shared, s.started, s.metrics_per_queue)
    })
    .await
    {
        Ok(text) => (
            [(
                header::CONTENT_TYPE,
                "text/plain; version=0.0.4; charset=utf-8",
            )],
            text,
        )
            .into_response(),
        Err(_) => super::error::ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal_error",
            "rendering the metrics failed",
        )
        .into_response(),
    }
}
