//! `GET /`: the dashboard, a plain HTML + JS + CSS page embedded in the
//! binary (no CDN, no build step). The page logs in with HTTP Basic
//! credentials against `/api/whoami` and polls the management API; it has
//! no server side of its own beyond serving these three files.

use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;

const INDEX_HTML: &str = include_str!("dashboard/index.html");
const APP_JS: &str = include_str!("dashboard/app.js");
const STYLE_CSS: &str = include_str!("dashboard/style.css");

/// The dashboard's routes.
pub fn router() -> Router<super::State> {
    Router::new()
        .route("/", get(|| asset("text/html; charset=utf-8", INDEX_HTML)))
        .route(
            "/dashboard/app.js",
            get(|| asset("text/javascript; charset=utf-8", APP_JS)),
        )
        .route(
            "/dashboard/style.css",
            get(|| asset("text/css; charset=utf-8", STYLE_CSS)),
        )
}

/// One embedded file. `no-cache` makes browsers revalidate, so a new binary's
/// page is never mixed with an old cached script.
async fn asset(content_type: &'static str, body: &'static str) -> impl IntoResponse {
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CACHE_CONTROL, "no-cache"),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        ],
        body,
    )
}
