//! The management API, in the shape of RabbitMQ's wherever they overlap
//! (paths, field names, status codes, error bodies), so `rabbitmqadmin`,
//! HTTP client crates and monitoring scripts work unchanged. Every request
//! is authenticated ([`auth`]); every change goes through the same engine
//! calls as the protocols (a [`weir_engine::Client`] opened for the
//! caller, so the caller's permissions are checked per object).
//!
//! One file per resource; the list of endpoints with what Weir adds or
//! lacks is docs/http-api.md.

pub mod auth;
pub mod bindings;
pub mod connections;
pub mod definitions;
pub mod exchanges;
pub mod list;
pub mod overview;
pub mod policies;
pub mod queues;
pub mod rates;
pub mod shovels;
pub mod users;
pub mod vhosts;

use std::sync::Arc;

use axum::http::StatusCode;
use axum::Router;
use serde_json::{json, Value};
use weir_engine::{Client, DurableWait, Engine};

use crate::http::error::ApiError;
use auth::Caller;

/// The `/api` routes.
pub fn router() -> Router<super::State> {
    Router::new()
        .merge(overview::router())
        .merge(vhosts::router())
        .merge(queues::router())
        .merge(exchanges::router())
        .merge(bindings::router())
        .merge(connections::router())
        .merge(users::router())
        .merge(policies::router())
        .merge(definitions::router())
        .merge(shovels::router())
}

/// The engine behind the state.
pub(crate) fn engine(state: &super::State) -> &Arc<Engine> {
    &state.shared.engine
}

/// Waits until a change is durable (500 if the store failed): the same
/// tickets as a session's answers ([`crate::session::durable`]).
pub(crate) async fn durable(
    state: &super::State,
    wait: Option<DurableWait>,
) -> Result<(), ApiError> {
    crate::session::durable::settled(engine(state), wait)
        .await
        .map_err(|e| ApiError::internal(format!("store: {e}")))
}

/// An engine client of `vhost` for the caller: the engine checks the
/// caller's permissions on each operation. 404 for a missing vhost, 403
/// without access. Not a connection: the tenant's connection limit does
/// not apply. Closed when dropped.
pub(crate) fn client(
    state: &super::State,
    caller: &Caller,
    vhost: &str,
) -> Result<Client, ApiError> {
    let engine = engine(state);
    if engine.tenant(vhost).is_none() {
        return Err(ApiError::not_found());
    }
    Client::open_management(engine, vhost, &caller.name).map_err(|e| match e {
        weir_engine::EngineError::AccessRefused(r) => ApiError::forbidden(r),
        other => other.into(),
    })
}

/// A publish refused by the publish gate ([`crate::tenant_gate::admit`]):
/// 503 under a resource alarm, 429 at a quota or over a rate (with
/// `Retry-After` in seconds), in RabbitMQ's error body shape.
pub(crate) fn refused(r: crate::tenant_gate::Refusal) -> axum::response::Response {
    use crate::tenant_gate::Refusal;
    use axum::response::IntoResponse;
    let reason = r.to_string();
    match r {
        Refusal::Alarm(_) => ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "service_unavailable",
            reason,
        )
        .into_response(),
        Refusal::Quota(_) => {
            ApiError::new(StatusCode::TOO_MANY_REQUESTS, "too_many_requests", reason)
                .into_response()
        }
        Refusal::Rate { retry_after, .. } => {
            let mut resp =
                ApiError::new(StatusCode::TOO_MANY_REQUESTS, "too_many_requests", reason)
                    .into_response();
            let secs = retry_after.as_secs() + u64::from(retry_after.subsec_nanos() > 0);
            resp.headers_mut()
                .insert(axum::http::header::RETRY_AFTER, secs.max(1).into());
            resp
        }
    }
}

/// The publish gate for an HTTP request of `caller` publishing `bytes`
/// through `c` (see [`crate::tenant_gate::admit`]).
pub(crate) fn admit_publish(
    state: &super::State,
    caller: &Caller,
    c: &Client,
    bytes: usize,
) -> Result<(), crate::tenant_gate::Refusal> {
    let alarms = *state.shared.alarms.borrow();
    let rule = engine(state).connection_quotas.find(&caller.name, None);
    crate::tenant_gate::admit(alarms, c, rule.as_deref(), bytes)
}

/// RabbitMQ's rate object.
pub(crate) fn rate(x: f64) -> Value {
    json!({ "rate": (x * 10.0).round() / 10.0 })
}

/// The node name reported in objects (RabbitMQ's `node`).
pub(crate) fn node_name() -> String {
    static NODE: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    NODE.get_or_init(|| {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|s| s.trim().to_string())
            .unwrap_or_else(|_| "localhost".into());
        format!("weir@{host}")
    })
    .clone()
}

/// 201 for a created object, 204 for one that existed.
pub(crate) fn created(new: bool) -> StatusCode {
    if new {
        StatusCode::CREATED
    } else {
        StatusCode::NO_CONTENT
    }
}

/// The exchange name in a path: RabbitMQ writes the default exchange as
/// `amq.default`.
pub(crate) fn exchange_name(n: &str) -> &str {
    if n == "amq.default" {
        ""
    } else {
        n
    }
}

/// A JSON body, or 400 with serde's reason.
pub(crate) fn parse_body<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    let body = if body.iter().all(u8::is_ascii_whitespace) {
        &b"{}"[..]
    } else {
        body
    };
    serde_json::from_slice(body).map_err(|e| ApiError::bad_request(format!("invalid JSON: {e}")))
}

/// The vhosts the caller sees, sorted.
pub(crate) fn visible_vhosts(state: &super::State, caller: &Caller) -> Vec<String> {
    let engine = engine(state);
    engine
        .tenant_names()
        .into_iter()
        .filter(|v| caller.sees_vhost(engine, v))
        .collect()
}

/// Vhosts of a listing: one (checked) or every visible one.
pub(crate) fn vhosts_of(
    state: &super::State,
    caller: &Caller,
    vhost: Option<&str>,
) -> Result<Vec<String>, ApiError> {
    match vhost {
        Some(v) => {
            caller.require_vhost(engine(state), v)?;
            Ok(vec![v.to_string()])
        }
        None => Ok(visible_vhosts(state, caller)),
    }
}

/// A boolean as RabbitMQ takes it: `true`, or the strings `"true"` /
/// `"false"` (what `rabbitmqadmin` sends).
pub(crate) fn lenient_bool<'de, D: serde::Deserializer<'de>>(d: D) -> Result<bool, D::Error> {
    match Value::deserialize(d)? {
        Value::Bool(b) => Ok(b),
        Value::String(s) if s == "true" => Ok(true),
        Value::String(s) if s == "false" => Ok(false),
        other => Err(serde::de::Error::custom(format!(
            "expected a boolean, got {other}"
        ))),
    }
}

/// An optional boolean, leniently (see [`lenient_bool`]).
pub(crate) fn lenient_opt_bool<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<Option<bool>, D::Error> {
    lenient_bool(d).map(Some)
}

/// A number as RabbitMQ takes it: a JSON number or a string of digits.
pub(crate) fn lenient_i64<'de, D: serde::Deserializer<'de>>(d: D) -> Result<i64, D::Error> {
    match Value::deserialize(d)? {
        Value::Number(n) => n
            .as_i64()
            .ok_or_else(|| serde::de::Error::custom(format!("expected an integer, got {n}"))),
        Value::String(s) => s
            .trim()
            .parse()
            .map_err(|_| serde::de::Error::custom(format!("expected an integer, got \"{s}\""))),
        other => Err(serde::de::Error::custom(format!(
            "expected an integer, got {other}"
        ))),
    }
}

use serde::Deserialize as _;
