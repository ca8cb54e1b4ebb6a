//! `GET /`: the dashboard, a page embedded in the binary.

use axum::response::Html;
use axum::routing::get;
use axum::Router;

/// The dashboard's routes.
pub fn router() -> Router<super::State> {
    Router::new().route("/", get(index))
}

/// The page.
async fn index() -> Html<&'static str> {
    Html("<!doctype html><title>Weir</title><h1>Weir</h1>")
}
