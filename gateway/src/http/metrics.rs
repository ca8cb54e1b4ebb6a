//! `GET /metrics`: Prometheus text format.

use axum::routing::get;
use axum::Router;

/// The `/metrics` route.
pub fn router() -> Router<super::State> {
    Router::new().route("/metrics", get(scrape))
}

/// One scrape.
async fn scrape() -> ([(axum::http::HeaderName, &'static str); 1], String) {
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        "# TYPE weir_up gauge\nweir_up 1\n".to_string(),
    )
}
