//! `/api/policies[/{vhost}[/{name}]]`: read by monitors and by users with
//! access to the vhost; set and deleted by policymakers (with access to
//! the vhost) and administrators. Applied at once to existing queues
//! (`Tenant::set_policy`).

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::routing::get;
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{json, Map, Value};
use weir_engine::policy::{ApplyTo, PolicyDef};

use super::auth::Caller;
use super::{durable, engine, parse_body, vhosts_of};
use crate::http::error::ApiError;

/// The routes.
pub fn router() -> Router<crate::http::State> {
    Router::new()
        .route("/api/policies", get(list_all))
        .route("/api/policies/{vhost}", get(list_all))
        .route(
            "/api/policies/{vhost}/{name}",
            get(show).put(put).delete(delete),
        )
        // No operator policies in Weir: always empty.
        .route("/api/operator-policies", get(empty))
        .route("/api/operator-policies/{vhost}", get(empty))
}

async fn empty(_caller: Caller) -> Json<Value> {
    Json(json!([]))
}

/// A policy as RabbitMQ shows it.
pub(crate) fn policy_json(vhost: &str, p: &PolicyDef) -> Value {
    let apply = match p.apply_to {
        ApplyTo::Queues => "queues",
        ApplyTo::Exchanges => "exchanges",
        ApplyTo::All => "all",
    };
    json!({
        "vhost": vhost,
        "name": p.name,
        "pattern": p.pattern,
        "apply-to": apply,
        "definition": p.definition,
        "priority": p.priority,
    })
}

fn policies(state: &crate::http::State, vhosts: Vec<String>) -> Value {
    let e = engine(state);
    Value::Array(
        vhosts
            .iter()
            .filter_map(|v| e.tenant(v).map(|t| (v, t)))
            .flat_map(|(v, t)| t.policies().into_iter().map(move |p| policy_json(v, &p)))
            .collect(),
    )
}

/// `GET /api/policies` and `GET /api/policies/{vhost}`.
async fn list_all(
    State(state): State<crate::http::State>,
    caller: Caller,
    vhost: Option<Path<String>>,
) -> Result<Json<Value>, ApiError> {
    let v = vhosts_of(&state, &caller, vhost.as_deref().map(String::as_str))?;
    Ok(Json(policies(&state, v)))
}

async fn show(
    State(state): State<crate::http::State>,
    caller: Caller,
    Path((vhost, name)): Path<(String, String)>,
) -> Result<Json<Value>, ApiError> {
    caller.require_vhost(engine(&state), &vhost)?;
    let t = engine(&state)
        .tenant(&vhost)
        .ok_or_else(ApiError::not_found)?;
    t.policies()
        .iter()
        .find(|p| p.name == name)
        .map(|p| Json(policy_json(&vhost, p)))
        .ok_or_else(ApiError::not_found)
}

#[derive(Deserialize)]
struct PolicyBody {
    pattern: String,
    definition: Map<String, Value>,
    #[serde(default, deserialize_with = "super::lenient_i64")]
    priority: i64,
    #[serde(rename = "apply-to", default)]
    apply_to: Option<String>,
}

fn may_set(state: &crate::http::State, caller: &Caller, vhost: &str) -> Result<(), ApiError> {
    caller.require_policymaker()?;
    if engine(state).tenant(vhost).is_none() {
        return Err(ApiError::not_found());
    }
    if caller.is_admin() || caller.has_access(engine(state), vhost) {
        Ok(())
    } else {
        Err(ApiError::forbidden(format!(
            "Access refused to vhost '{vhost}' for user '{}'",
            caller.name
        )))
    }
}

async fn put(
    State(state): State<crate::http::State>,
    caller: Caller,
    Path((vhost, name)): Path<(String, String)>,
    body: Bytes,
) -> Result<StatusCode, ApiError> {
    may_set(&state, &caller, &vhost)?;
    let b: PolicyBody = parse_body(&body)?;
    let apply_to = match b.apply_to.as_deref() {
        None | Some("all") => ApplyTo::All,
        Some("queues") => ApplyTo::Queues,
        Some("exchanges") => ApplyTo::Exchanges,
        Some(other) => {
            return Err(ApiError::bad_request(format!(
                "invalid apply-to '{other}': all, queues or exchanges"
            )))
        }
    };
    let t = engine(&state)
        .tenant(&vhost)
        .ok_or_else(ApiError::not_found)?;
    let existed = t.policies().iter().any(|p| p.name == name);
    let w = t.set_policy(PolicyDef {
        name,
        pattern: b.pattern,
        apply_to,
        priority: i32::try_from(b.priority)
            .map_err(|_| ApiError::bad_request("priority out of range"))?,
        definition: b.definition,
    })?;
    durable(&state, Some(w)).await?;
    Ok(super::created(!existed))
}

async fn delete(
    State(state): State<crate::http::State>,
    caller: Caller,
    Path((vhost, name)): Path<(String, String)>,
) -> Result<StatusCode, ApiError> {
    may_set(&state, &caller, &vhost)?;
    let t = engine(&state)
        .tenant(&vhost)
        .ok_or_else(ApiError::not_found)?;
    let w = t.delete_policy(&name)?;
    durable(&state, Some(w)).await?;
    Ok(StatusCode::NO_CONTENT)
}
