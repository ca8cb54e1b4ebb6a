//! Shovels in the management API (issue 27), as RabbitMQ's shovel plugin
//! serves them: definitions as runtime parameters of component `shovel`
//! (`/api/parameters/shovel[/{vhost}[/{name}]]`: read with access to the
//! vhost, set and deleted by policymakers with access to it and by
//! administrators) and their status (`/api/shovels[/{vhost}]`,
//! `/api/shovels/vhost/{vhost}/{name}`, `DELETE …/restart`). Weir adds
//! `transferred`, `rate` and `failures` to each status.

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::routing::{delete, get};
use axum::{Json, Router};
use serde_json::{json, Value};

use super::auth::Caller;
use super::{engine, parse_body, vhosts_of};
use crate::http::error::ApiError;
use crate::shovel::def::{Endpoint, Target};
use crate::shovel::{Listed, ShovelsError};

/// The routes.
pub fn router() -> Router<crate::http::State> {
    Router::new()
        .route("/api/parameters/shovel", get(list_params))
        .route("/api/parameters/shovel/{vhost}", get(list_params))
        .route(
            "/api/parameters/shovel/{vhost}/{name}",
            get(show_param).put(put_param).delete(delete_param),
        )
        .route("/api/shovels", get(list_status))
        .route("/api/shovels/{vhost}", get(list_status))
        .route("/api/shovels/vhost/{vhost}/{name}", get(show_status))
        .route("/api/shovels/vhost/{vhost}/{name}/restart", delete(restart))
}

/// A shovel as a runtime parameter.
pub(crate) fn param_json(s: &Listed) -> Value {
    json!({
        "vhost": s.vhost,
        "component": "shovel",
        "name": s.name,
        "value": s.value,
    })
}

/// A URI without its password.
fn redact(uri: &str) -> String {
    let Some((scheme, rest)) = uri.split_once("://") else {
        return uri.to_string();
    };
    match rest.split_once('@') {
        Some((cred, host)) => {
            let user = cred.split(':').next().unwrap_or("");
            format!("{scheme}://{user}@{host}")
        }
        None => uri.to_string(),
    }
}

fn end_fields(out: &mut serde_json::Map<String, Value>, side: &str, e: &Endpoint) {
    out.insert(format!("{side}_protocol"), json!(e.protocol()));
    let (uri, target) = match e {
        Endpoint::Local { vhost, target } => {
            let v = if vhost == "/" {
                "%2F".to_string()
            } else {
                vhost.clone()
            };
            (format!("amqp:///{v}"), Some(target))
        }
        Endpoint::Amqp { uri, target } => (redact(uri), Some(target)),
        Endpoint::Mqtt { uri, topic, .. } => {
            if let Some(t) = topic {
                out.insert(format!("{side}_topic"), json!(t));
            }
            (redact(uri), None)
        }
        Endpoint::Nats {
            uri,
            subject,
            stream,
            consumer,
        } => {
            if let Some(s) = subject {
                out.insert(format!("{side}_subject"), json!(s));
            }
            if let Some(s) = stream {
                out.insert(format!("{side}_stream"), json!(s));
            }
            if let Some(c) = consumer {
                out.insert(format!("{side}_consumer"), json!(c));
            }
            (redact(uri), None)
        }
    };
    out.insert(format!("{side}_uri"), json!(uri));
    match target {
        Some(Target::Queue(q)) => {
            out.insert(format!("{side}_queue"), json!(q));
        }
        Some(Target::Exchange { name, key }) => {
            out.insert(format!("{side}_exchange"), json!(name));
            if let Some(k) = key {
                out.insert(format!("{side}_exchange_key"), json!(k));
            }
        }
        None => {}
    }
}

/// A shovel's status as RabbitMQ's `GET /api/shovels` shows it.
pub(crate) fn status_json(s: &Listed) -> Value {
    let (state, reason) = s.status.state.lock().clone();
    let mut m = serde_json::Map::new();
    m.insert("node".into(), json!(super::node_name()));
    m.insert("name".into(), json!(s.name));
    m.insert("vhost".into(), json!(s.vhost));
    m.insert("type".into(), json!("dynamic"));
    m.insert("state".into(), json!(state.name()));
    m.insert(
        "blocked_status".into(),
        json!(if state == crate::shovel::State::Running {
            "running"
        } else {
            "blocked"
        }),
    );
    if let Some(r) = reason {
        m.insert("reason".into(), json!(r));
    }
    end_fields(&mut m, "src", &s.def.src);
    end_fields(&mut m, "dest", &s.def.dest);
    m.insert("ack_mode".into(), json!(s.def.ack_mode.name()));
    m.insert(
        "transferred".into(),
        json!(s
            .status
            .transferred
            .load(std::sync::atomic::Ordering::Relaxed)),
    );
    m.insert(
        "rate".into(),
        json!((s.status.rate() * 10.0).round() / 10.0),
    );
    m.insert(
        "failures".into(),
        json!(s.status.failures.load(std::sync::atomic::Ordering::Relaxed)),
    );
    Value::Object(m)
}

async fn list_params(
    State(state): State<crate::http::State>,
    caller: Caller,
    vhost: Option<Path<String>>,
) -> Result<Json<Value>, ApiError> {
    let v = vhosts_of(&state, &caller, vhost.as_deref().map(String::as_str))?;
    let list = state.shared.shovels.list(Some(&v));
    Ok(Json(Value::Array(list.iter().map(param_json).collect())))
}

async fn show_param(
    State(state): State<crate::http::State>,
    caller: Caller,
    Path((vhost, name)): Path<(String, String)>,
) -> Result<Json<Value>, ApiError> {
    caller.require_vhost(engine(&state), &vhost)?;
    let list = state.shared.shovels.list(Some(&[vhost]));
    list.iter()
        .find(|s| s.name == name)
        .map(|s| Json(param_json(s)))
        .ok_or_else(ApiError::not_found)
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

pub(crate) fn shovels_error(e: ShovelsError) -> ApiError {
    match e {
        ShovelsError::Def(d) => ApiError::bad_request(d.to_string()),
        ShovelsError::TooMany => ApiError::bad_request(e.to_string()),
        other => ApiError::internal(other.to_string()),
    }
}

async fn put_param(
    State(state): State<crate::http::State>,
    caller: Caller,
    Path((vhost, name)): Path<(String, String)>,
    body: Bytes,
) -> Result<StatusCode, ApiError> {
    may_set(&state, &caller, &vhost)?;
    let b: Value = parse_body(&body)?;
    let value = b
        .get("value")
        .cloned()
        .ok_or_else(|| ApiError::bad_request("'value' is required"))?;
    if name.is_empty() || name.len() > 255 {
        return Err(ApiError::bad_request("a shovel name is 1 to 255 bytes"));
    }
    let shovels = state.shared.shovels.clone();
    let user = caller.name.clone();
    // Writes shovels.json (an fsync): not on a runtime worker.
    let new = tokio::task::spawn_blocking(move || shovels.put(&vhost, &name, value, &user, false))
        .await
        .map_err(|e| ApiError::internal(e.to_string()))?
        .map_err(shovels_error)?;
    Ok(super::created(new))
}

async fn delete_param(
    State(state): State<crate::http::State>,
    caller: Caller,
    Path((vhost, name)): Path<(String, String)>,
) -> Result<StatusCode, ApiError> {
    may_set(&state, &caller, &vhost)?;
    let shovels = state.shared.shovels.clone();
    let found = tokio::task::spawn_blocking(move || shovels.delete(&vhost, &name))
        .await
        .map_err(|e| ApiError::internal(e.to_string()))?
        .map_err(shovels_error)?;
    if found {
        Ok(StatusCode::NO_CONTENT)
    } else {
        Err(ApiError::not_found())
    }
}

async fn list_status(
    State(state): State<crate::http::State>,
    caller: Caller,
    vhost: Option<Path<String>>,
) -> Result<Json<Value>, ApiError> {
    let v = vhosts_of(&state, &caller, vhost.as_deref().map(String::as_str))?;
    let list = state.shared.shovels.list(Some(&v));
    Ok(Json(Value::Array(list.iter().map(status_json).collect())))
}

async fn show_status(
    State(state): State<crate::http::State>,
    caller: Caller,
    Path((vhost, name)): Path<(String, String)>,
) -> Result<Json<Value>, ApiError> {
    caller.require_vhost(engine(&state), &vhost)?;
    let list = state.shared.shovels.list(Some(&[vhost]));
    list.iter()
        .find(|s| s.name == name)
        .map(|s| Json(status_json(s)))
        .ok_or_else(ApiError::not_found)
}

async fn restart(
    State(state): State<crate::http::State>,
    caller: Caller,
    Path((vhost, name)): Path<(String, String)>,
) -> Result<StatusCode, ApiError> {
    may_set(&state, &caller, &vhost)?;
    if state.shared.shovels.restart(&vhost, &name) {
        Ok(StatusCode::NO_CONTENT)
    } else {
        Err(ApiError::not_found())
    }
}

#[cfg(test)]
mod tests {
    use super::redact;

    #[test]
    fn passwords_are_not_shown() {
        assert_eq!(redact("amqp://u:secret@h:5672/v"), "amqp://u@h:5672/v");
        assert_eq!(redact("amqp://h"), "amqp://h");
    }
}
