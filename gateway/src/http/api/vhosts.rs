//! `/api/vhosts[/{vhost}]`: vhosts are Weir's tenants. PUT creates one
//! durably (and, as RabbitMQ, gives the creating user full permissions
//! in it); DELETE removes it with everything in it and closes its
//! connections.

use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::routing::get;
use axum::{Json, Router};
use serde_json::{json, Value};
use weir_engine::permissions::PermissionDef;

use super::auth::Caller;
use super::list::{list, ListQuery, Listable};
use super::{durable, engine, visible_vhosts};
use crate::http::error::ApiError;

/// The routes.
pub fn router() -> Router<crate::http::State> {
    Router::new()
        .route("/api/vhosts", get(list_all))
        .route("/api/vhosts/{vhost}", get(show).put(create).delete(delete))
        .route("/api/vhosts/{vhost}/permissions", get(permissions))
}

struct Item {
    name: String,
    v: Value,
}

impl Listable for Item {
    fn name(&self) -> &str {
        &self.name
    }
    fn default_key(&self) -> (&str, &str) {
        (&self.name, "")
    }
    fn render(&self) -> Value {
        self.v.clone()
    }
}

fn render(state: &crate::http::State, name: &str) -> Option<Value> {
    let t = engine(state).tenant(name)?;
    let (mut ready, mut leased) = (0u64, 0u64);
    for q in t.queues() {
        ready += q.message_count();
        leased += q
            .partitions
            .iter()
            .map(|p| p.counters.leased.load(std::sync::atomic::Ordering::Relaxed))
            .sum::<u64>();
    }
    Some(json!({
        "name": name,
        "description": "",
        "tags": [],
        "metadata": { "description": "", "tags": [] },
        "default_queue_type": "classic",
        "tracing": false,
        "cluster_state": { super::node_name(): "running" },
        "messages": ready + leased,
        "messages_ready": ready,
        "messages_unacknowledged": leased,
    }))
}

async fn list_all(
    State(state): State<crate::http::State>,
    caller: Caller,
    Query(q): Query<ListQuery>,
) -> Result<Json<Value>, ApiError> {
    let items = visible_vhosts(&state, &caller)
        .into_iter()
        .filter_map(|n| render(&state, &n).map(|v| Item { name: n, v }))
        .collect();
    Ok(Json(list(&q, items)?))
}

async fn show(
    State(state): State<crate::http::State>,
    caller: Caller,
    Path(vhost): Path<String>,
) -> Result<Json<Value>, ApiError> {
    caller.require_vhost(engine(&state), &vhost)?;
    render(&state, &vhost)
        .map(Json)
        .ok_or_else(ApiError::not_found)
}

async fn create(
    State(state): State<crate::http::State>,
    caller: Caller,
    Path(vhost): Path<String>,
) -> Result<StatusCode, ApiError> {
    caller.require_admin()?;
    let e = engine(&state);
    let existed = e.tenant(&vhost).is_some();
    let (_, wait) = e.add_tenant(&vhost)?;
    durable(&state, wait).await?;
    if !existed {
        // As RabbitMQ: the user who creates a vhost gets full permissions
        // in it.
        let w = e.set_permissions(PermissionDef::full(&caller.name, &vhost))?;
        durable(&state, Some(w)).await?;
    }
    Ok(super::created(!existed))
}

async fn delete(
    State(state): State<crate::http::State>,
    caller: Caller,
    Path(vhost): Path<String>,
) -> Result<StatusCode, ApiError> {
    caller.require_admin()?;
    let e = engine(&state);
    if e.tenant(&vhost).is_none() {
        return Err(ApiError::not_found());
    }
    state
        .shared
        .connections
        .close_vhost(&vhost, "vhost deleted");
    let wait = e.delete_tenant(&vhost)?;
    durable(&state, wait).await?;
    state.shared.request_trim();
    Ok(StatusCode::NO_CONTENT)
}

async fn permissions(
    State(state): State<crate::http::State>,
    caller: Caller,
    Path(vhost): Path<String>,
) -> Result<Json<Value>, ApiError> {
    caller.require_admin()?;
    if engine(&state).tenant(&vhost).is_none() {
        return Err(ApiError::not_found());
    }
    let out: Vec<Value> = engine(&state)
        .permissions()
        .list()
        .into_iter()
        .filter(|p| p.vhost == vhost)
        .map(|p| super::users::permission_json(&p))
        .collect();
    Ok(Json(Value::Array(out)))
}
