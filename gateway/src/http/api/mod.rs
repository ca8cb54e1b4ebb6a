//! The management API, in the shape of RabbitMQ's wherever they overlap
//! (paths, field names, status codes, error bodies), so `rabbitmqadmin`,
//! HTTP client crates and monitoring scripts work unchanged.

use axum::extract::State;
use axum::routing::get;
use axum::{Json, Router};

/// The `/api` routes.
pub fn router() -> Router<super::State> {
    Router::new().route("/api/overview", get(overview))
}

/// `GET /api/overview`: who we are and the broker-wide figures.
async fn overview(State(state): State<super::State>) -> Json<serde_json::Value> {
    Json(serde_json::json!({
        "product_name": "Weir",
        "product_version": env!("CARGO_PKG_VERSION"),
        "management_version": env!("CARGO_PKG_VERSION"),
        "uptime": state.started.elapsed().as_millis() as u64,
    }))
}
