//! `GET /metrics`: Prometheus text format (see [`crate::metrics`]).
//!
//! With `[http] metrics_auth` (the default) the per-queue series, which name
//! every tenant's queues, are written only for a caller authenticated as a
//! `monitoring` or `administrator` user (HTTP Basic); without credentials
//! the queue series are summed per tenant. Wrong credentials are 401, a
//! user without those tags 403. Renders go through the `/metrics` gate
//! (off the runtime's workers, one at a time, shared by scrapes that
//! waited for the same render).

use axum::extract::{FromRequestParts, State};
use axum::http::header::AUTHORIZATION;
use axum::http::request::Parts;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;

use super::api::auth::Caller;
use super::error::ApiError;

/// The `/metrics` route.
pub fn router() -> Router<super::State> {
    Router::new().route("/metrics", get(scrape))
}

const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// One scrape: authenticated first (if asked), then rendered or shared.
async fn scrape(State(state): State<super::State>, mut parts: Parts) -> Response {
    let per_queue = state.metrics_per_queue
        && (!state.metrics_auth
            || match parts.headers.contains_key(AUTHORIZATION) {
                false => false,
                true => match Caller::from_request_parts(&mut parts, &state).await {
                    Ok(c) if c.is_monitor() => true,
                    Ok(_) => {
                        return ApiError::forbidden(
                            "the per-queue series need the monitoring or administrator tag",
                        )
                        .into_response()
                    }
                    Err(e) => return e.into_response(),
                },
            });
    let key = if per_queue { "per-queue" } else { "per-tenant" };
    let s = state.clone();
    state
        .gates
        .metrics
        .serve(key.into(), CONTENT_TYPE, move || {
            Ok(crate::metrics::render::render(&s.shared, s.started, per_queue).into_bytes())
        })
        .await
}
