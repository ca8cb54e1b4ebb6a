//! `/api/definitions[/{vhost}]`: export (GET) and import (POST) in
//! RabbitMQ's JSON, so a RabbitMQ export imports here and the other way
//! round. Administrators only. An import is all or nothing: the whole
//! document is checked first (the same rules as the API's and the
//! protocols' declares) and committed as one store batch with one fsync
//! ([`weir_engine::Engine::import`]), so a refused import changes nothing
//! and a crash leaves all of it or none. Users whose hash is not an
//! argon2 PHC string (RabbitMQ's salted SHA-256) cannot be verified by
//! Weir: they are skipped and named in the answer (200 with
//! `skipped_users`; 204 when nothing was skipped).

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde_json::{json, Value};
use weir_engine::definitions::{Import, ImportedQueue};
use weir_engine::exchange::{ExchangeDef, ExchangeKind};
use weir_engine::meta::{BindingDef, DestinationKind};
use weir_engine::permissions::{PermissionDef, TopicPermissionDef};
use weir_engine::policy::{ApplyTo, PolicyDef};

use super::auth::Caller;
use super::{durable, engine, parse_body};
use crate::http::error::ApiError;

/// The largest definitions document imported (other bodies keep axum's
/// 2 MB default): 100,000 queues take about 10 MB.
pub const MAX_DEFINITIONS_BYTES: usize = 64 << 20;

/// The routes.
pub fn router() -> Router<crate::http::State> {
    Router::new()
        .route("/api/definitions", get(export_all).post(import_all))
        .route(
            "/api/definitions/{vhost}",
            get(export_vhost).post(import_vhost),
        )
        .layer(axum::extract::DefaultBodyLimit::max(MAX_DEFINITIONS_BYTES))
}

fn export(state: &crate::http::State, only: Option<&str>) -> Value {
    let e = engine(state);
    let vhosts: Vec<String> = e
        .tenant_names()
        .into_iter()
        .filter(|v| only.is_none_or(|o| o == v))
        .collect();
    let (mut queues, mut exchanges, mut bindings, mut policies) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for v in &vhosts {
        let Some(t) = e.tenant(v) else { continue };
        for q in t.queues() {
            if q.exclusive_owner().is_some() {
                continue;
            }
            queues.push(json!({
                "name": q.name(), "vhost": v, "durable": q.def.durable,
                "auto_delete": q.def.auto_delete,
                "arguments": match t.declared_arguments(&q) { Value::Null => json!({}), a => a },
            }));
        }
        for x in t.exchanges() {
            let d = &x.def;
            if d.name.is_empty() || d.name.starts_with("amq.") {
                continue;
            }
            exchanges.push(json!({
                "name": d.name, "vhost": v, "type": d.type_name(), "durable": d.durable,
                "auto_delete": d.auto_delete, "internal": d.internal,
                "arguments": if d.arguments.is_null() { json!({}) } else { d.arguments.clone() },
            }));
        }
        for b in super::bindings::all(&t) {
            let mut r = super::bindings::render(v, &b);
            if let Value::Object(m) = &mut r {
                m.remove("properties_key");
            }
            bindings.push(r);
        }
        for p in t.policies() {
            policies.push(super::policies::policy_json(v, &p));
        }
    }
    let mut out = json!({
        "rabbit_version": "3.13.0",
        "rabbitmq_version": "3.13.0",
        "product_name": "Weir",
        "product_version": env!("CARGO_PKG_VERSION"),
        "parameters": state
            .shared
            .shovels
            .list(Some(&vhosts))
            .iter()
            .map(super::shovels::param_json)
            .collect::<Vec<_>>(),
        "policies": policies,
        "queues": queues,
        "exchanges": exchanges,
        "bindings": bindings,
    });
    if only.is_none() {
        out["users"] = Value::Array(e.users().iter().map(super::users::user_json).collect());
        out["vhosts"] = Value::Array(vhosts.iter().map(|v| json!({ "name": v, "limits": [], "metadata": {"description": "", "tags": []} })).collect());
        out["permissions"] = Value::Array(
            e.permissions()
                .list()
                .iter()
                .map(super::users::permission_json)
                .collect(),
        );
        out["topic_permissions"] = Value::Array(
            e.permissions()
                .list_topic()
                .iter()
                .map(super::users::topic_permission_json)
                .collect(),
        );
        out["global_parameters"] = json!([]);
    }
    out
}

async fn export_all(
    State(state): State<crate::http::State>,
    caller: Caller,
) -> Result<Json<Value>, ApiError> {
    caller.require_admin()?;
    Ok(Json(export(&state, None)))
}

async fn export_vhost(
    State(state): State<crate::http::State>,
    caller: Caller,
    Path(vhost): Path<String>,
) -> Result<Json<Value>, ApiError> {
    caller.require_admin()?;
    if engine(&state).tenant(&vhost).is_none() {
        return Err(ApiError::not_found());
    }
    Ok(Json(export(&state, Some(&vhost))))
}

fn s<'a>(v: &'a Value, k: &str) -> Result<&'a str, ApiError> {
    v.get(k)
        .and_then(Value::as_str)
        .ok_or_else(|| ApiError::bad_request(format!("definitions: '{k}' missing in {v}")))
}

fn b(v: &Value, k: &str, default: bool) -> bool {
    v.get(k).and_then(Value::as_bool).unwrap_or(default)
}

fn args(v: &Value) -> Value {
    match v.get("arguments") {
        Some(a @ Value::Object(_)) => a.clone(),
        _ => json!({}),
    }
}

fn items<'a>(d: &'a Value, k: &str) -> impl Iterator<Item = &'a Value> {
    d.get(k).and_then(Value::as_array).into_iter().flatten()
}

async fn import(
    state: &crate::http::State,
    d: &Value,
    only: Option<&str>,
    caller_name: &str,
) -> Result<Response, ApiError> {
    let e = engine(state);
    let vhost_of = |v: &Value| -> Result<String, ApiError> {
        match only {
            Some(o) => Ok(o.to_string()),
            None => s(v, "vhost").map(str::to_string),
        }
    };
    // The whole document first, then one engine call that checks all of it
    // and commits it as one store batch (all or nothing, one fsync).
    let mut im = Import::default();
    let mut skipped = Vec::new();
    if only.is_none() {
        for v in items(d, "vhosts") {
            im.tenants.push(s(v, "name")?.to_string());
        }
        for u in items(d, "users") {
            let name = s(u, "name")?;
            let hash = u
                .get("password_hash")
                .and_then(Value::as_str)
                .map(str::to_string);
            let tags = super::users::parse_tags(u.get("tags"))?;
            match super::users::make_user(name, None, hash, tags, None).await {
                Ok(def) => im.users.push(def),
                Err(_) => skipped.push(name.to_string()),
            }
        }
        let is_skipped = |p: &Value| {
            skipped
                .iter()
                .any(|u| u == s(p, "user").unwrap_or_default())
        };
        for p in items(d, "permissions") {
            if is_skipped(p) {
                continue;
            }
            im.permissions.push(PermissionDef {
                user: s(p, "user")?.into(),
                vhost: s(p, "vhost")?.into(),
                configure: s(p, "configure")?.into(),
                write: s(p, "write")?.into(),
                read: s(p, "read")?.into(),
                from_config: false,
            });
        }
        for p in items(d, "topic_permissions") {
            if is_skipped(p) {
                continue;
            }
            im.topic_permissions.push(TopicPermissionDef {
                user: s(p, "user")?.into(),
                vhost: s(p, "vhost")?.into(),
                exchange: s(p, "exchange")?.into(),
                write: s(p, "write")?.into(),
                read: s(p, "read")?.into(),
                from_config: false,
            });
        }
    }
    for p in items(d, "policies") {
        let apply_to = match p.get("apply-to").and_then(Value::as_str) {
            Some("queues") => ApplyTo::Queues,
            Some("exchanges") => ApplyTo::Exchanges,
            _ => ApplyTo::All,
        };
        im.policies.push((
            vhost_of(p)?,
            PolicyDef {
                name: s(p, "name")?.into(),
                pattern: s(p, "pattern")?.into(),
                apply_to,
                priority: p.get("priority").and_then(Value::as_i64).unwrap_or(0) as i32,
                definition: p
                    .get("definition")
                    .and_then(Value::as_object)
                    .cloned()
                    .unwrap_or_default(),
            },
        ));
    }
    for x in items(d, "exchanges") {
        let a = args(x);
        let kind = s(x, "type")?;
        let (kind, delayed) = match ExchangeKind::parse_declared(kind, &a) {
            Some(Ok(k)) => k,
            Some(Err(m)) => return Err(ApiError::bad_request(m)),
            None => {
                return Err(ApiError::bad_request(format!(
                    "invalid exchange type '{kind}'"
                )))
            }
        };
        im.exchanges.push((
            vhost_of(x)?,
            ExchangeDef {
                name: s(x, "name")?.into(),
                kind,
                durable: b(x, "durable", true),
                auto_delete: b(x, "auto_delete", false),
                internal: b(x, "internal", false),
                delayed,
                arguments: a,
            },
        ));
    }
    for q in items(d, "queues") {
        im.queues.push((
            vhost_of(q)?,
            ImportedQueue {
                name: s(q, "name")?.into(),
                durable: b(q, "durable", true),
                auto_delete: b(q, "auto_delete", false),
                arguments: args(q),
            },
        ));
    }
    for x in items(d, "bindings") {
        let destination_kind = match s(x, "destination_type")? {
            "queue" => DestinationKind::Queue,
            "exchange" => DestinationKind::Exchange,
            other => {
                return Err(ApiError::bad_request(format!(
                    "invalid destination_type '{other}'"
                )))
            }
        };
        im.bindings.push((
            vhost_of(x)?,
            BindingDef {
                source: s(x, "source")?.into(),
                destination_kind,
                destination: s(x, "destination")?.into(),
                key: s(x, "routing_key")?.into(),
                arguments: args(x),
            },
        ));
    }
    let mut shovels = Vec::new();
    for p in items(d, "parameters") {
        if p.get("component").and_then(Value::as_str) != Some("shovel") {
            continue;
        }
        let vhost = vhost_of(p)?;
        let name = s(p, "name")?.to_string();
        let value = p.get("value").cloned().unwrap_or(Value::Null);
        // Checked with the rest, before anything is applied.
        crate::shovel::ShovelDef::parse(&value, &vhost)
            .map_err(|e| ApiError::bad_request(format!("shovel '{name}': {e}")))?;
        shovels.push((vhost, name, value));
    }
    // Checking and applying tens of thousands of items takes a while: not
    // on a runtime worker.
    let e = e.clone();
    let wait = tokio::task::spawn_blocking(move || e.import(im))
        .await
        .map_err(|e| ApiError::internal(format!("import: {e}")))??;
    durable(state, wait).await?;
    // Shovels (runtime parameters of component `shovel`), once their
    // vhosts exist; checked before anything else is, below.
    if !shovels.is_empty() {
        let reg = state.shared.shovels.clone();
        let user = caller_name.to_string();
        tokio::task::spawn_blocking(move || {
            for (vhost, name, value) in shovels {
                reg.put(&vhost, &name, value, &user, false)?;
            }
            Ok::<_, crate::shovel::ShovelsError>(())
        })
        .await
        .map_err(|e| ApiError::internal(format!("import: {e}")))?
        .map_err(super::shovels::shovels_error)?;
    }
    if skipped.is_empty() {
        Ok(StatusCode::NO_CONTENT.into_response())
    } else {
        tracing::warn!(users = ?skipped, "definitions import: users with a hash Weir cannot verify were skipped");
        Ok((StatusCode::OK, Json(json!({ "skipped_users": skipped }))).into_response())
    }
}

async fn import_all(
    State(state): State<crate::http::State>,
    caller: Caller,
    body: Bytes,
) -> Result<Response, ApiError> {
    caller.require_admin()?;
    let d: Value = parse_body(&body)?;
    import(&state, &d, None, &caller.name).await
}

async fn import_vhost(
    State(state): State<crate::http::State>,
    caller: Caller,
    Path(vhost): Path<String>,
    body: Bytes,
) -> Result<Response, ApiError> {
    caller.require_admin()?;
    if engine(&state).tenant(&vhost).is_none() {
        return Err(ApiError::not_found());
    }
    let d: Value = parse_body(&body)?;
    import(&state, &d, Some(&vhost), &caller.name).await
}
