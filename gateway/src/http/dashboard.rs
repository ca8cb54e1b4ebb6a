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

/// The page's policy: everything from this origin, no inline script or
/// style, no plugins, no framing.
const CSP: &str = "default-src 'self'; script-src 'self'; style-src 'self'; \
    img-src 'self' data:; connect-src 'self'; object-src 'none'; base-uri 'none'; \
    form-action 'self'; frame-ancestors 'none'";

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
            // Never framed (clickjacking of its purge and delete buttons);
            // scripts, styles and requests only from this origin.
            (header::X_FRAME_OPTIONS, "DENY"),
            (header::CONTENT_SECURITY_POLICY, CSP),
            (header::REFERRER_POLICY, "no-referrer"),
        ],
        body,
    )
}
