//! `/api/exchanges…`: list, show, declare, delete, publish, and the
//! bindings an exchange is the source or destination of. The default
//! exchange is `amq.default` in paths, as in RabbitMQ.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use base64::Engine as _;
use serde::Deserialize;
use serde_json::{json, Value};
use weir_engine::exchange::{Exchange, ExchangeDef, ExchangeKind};
use weir_engine::meta::DestinationKind;
use weir_engine::properties::{DeliveryMode, HeaderFormat, Properties, Table};

use super::auth::Caller;
use super::list::{list, Key, ListQuery, Listable};
use super::{client, durable, engine, exchange_name, parse_body, vhosts_of};
use crate::http::error::ApiError;

/// The largest publish request body (413 beyond): the JSON with the
/// payload, base64 or not. Stated here so the bound does not depend on a
/// framework default.
pub const PUBLISH_BODY_MAX: usize = 2 << 20;

/// The routes.
pub fn router() -> Router<crate::http::State> {
    Router::new()
        .route("/api/exchanges", get(list_all))
        .route("/api/exchanges/{vhost}", get(list_all))
        .route(
            "/api/exchanges/{vhost}/{name}",
            get(show).put(declare).delete(delete),
        )
        .route(
            "/api/exchanges/{vhost}/{name}/publish",
            post(publish).layer(axum::extract::DefaultBodyLimit::max(PUBLISH_BODY_MAX)),
        )
        .route(
            "/api/exchanges/{vhost}/{name}/bindings/source",
            get(bindings_source),
        )
        .route(
            "/api/exchanges/{vhost}/{name}/bindings/destination",
            get(bindings_destination),
        )
}

fn render(vhost: &str, x: &Exchange) -> Value {
    let d = &x.def;
    json!({
        "name": d.name,
        "vhost": vhost,
        "type": d.type_name(),
        "durable": d.durable,
        "auto_delete": d.auto_delete,
        "internal": d.internal,
        "arguments": if d.arguments.is_null() { json!({}) } else { d.arguments.clone() },
        "user_who_performed_action": "",
        "policy": Value::Null,
    })
}

struct Item {
    vhost: String,
    x: Arc<Exchange>,
}

impl Listable for Item {
    fn name(&self) -> &str {
        &self.x.def.name
    }
    fn default_key(&self) -> (&str, &str) {
        (&self.vhost, &self.x.def.name)
    }
    fn cheap_key(&self, field: &str) -> Option<Key> {
        Some(match field {
            "name" => Key::Str(self.x.def.name.clone()),
            "vhost" => Key::Str(self.vhost.clone()),
            "type" => Key::Str(self.x.def.type_name().to_string()),
            _ => return None,
        })
    }
    fn render(&self) -> Value {
        render(&self.vhost, &self.x)
    }
}

/// The default exchange, which the engine routes without an object: shown
/// as RabbitMQ shows it (name "", direct, durable).
fn default_exchange() -> Arc<Exchange> {
    Exchange::new(ExchangeDef {
        name: String::new(),
        kind: ExchangeKind::Direct,
        durable: true,
        auto_delete: false,
        internal: false,
        delayed: false,
        arguments: json!({}),
    })
}

fn items(state: &crate::http::State, vhosts: Vec<String>) -> Vec<Item> {
    let e = engine(state);
    vhosts
        .into_iter()
        .filter_map(|v| e.tenant(&v).map(|t| (v, t)))
        .flat_map(|(v, t)| {
            std::iter::once(default_exchange())
                .chain(t.exchanges())
                .map(move |x| Item {
                    vhost: v.clone(),
                    x,
                })
        })
        .collect()
}

/// `GET /api/<resource>` and `GET /api/<resource>/{vhost}`: one vhost, or
/// every vhost the caller sees.
async fn list_all(
    State(state): State<crate::http::State>,
    caller: Caller,
    vhost: Option<Path<String>>,
    Query(q): Query<ListQuery>,
    uri: axum::http::Uri,
) -> Result<axum::response::Response, ApiError> {
    let v = vhosts_of(&state, &caller, vhost.as_deref().map(String::as_str))?;
    // Off the runtime's workers, one render at a time (crate::http::render).
    let (key, st) = (crate::http::render::list_key(&uri, &v), state.clone());
    let render = move || crate::http::render::json(list(&q, items(&st, v)));
    Ok(state
        .gates
        .exchanges
        .serve(key, crate::http::render::JSON, render)
        .await)
}

fn find(
    state: &crate::http::State,
    caller: &Caller,
    vhost: &str,
    name: &str,
) -> Result<Arc<Exchange>, ApiError> {
    caller.require_vhost(engine(state), vhost)?;
    let t = engine(state)
        .tenant(vhost)
        .ok_or_else(ApiError::not_found)?;
    let name = exchange_name(name);
    if name.is_empty() {
        return Ok(default_exchange());
    }
    t.exchange(name).map_err(|_| ApiError::not_found())
}

async fn show(
    State(state): State<crate::http::State>,
    caller: Caller,
    Path((vhost, name)): Path<(String, String)>,
) -> Result<Json<Value>, ApiError> {
    let x = find(&state, &caller, &vhost, &name)?;
    Ok(Json(render(&vhost, &x)))
}

#[derive(Deserialize)]
struct DeclareBody {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default = "yes", deserialize_with = "super::lenient_bool")]
    durable: bool,
    #[serde(default, deserialize_with = "super::lenient_bool")]
    auto_delete: bool,
    #[serde(default, deserialize_with = "super::lenient_bool")]
    internal: bool,
    #[serde(default)]
    arguments: Option<serde_json::Map<String, Value>>,
}

fn yes() -> bool {
    true
}

async fn declare(
    State(state): State<crate::http::State>,
    caller: Caller,
    Path((vhost, name)): Path<(String, String)>,
    body: Bytes,
) -> Result<StatusCode, ApiError> {
    let b: DeclareBody = parse_body(&body)?;
    let name = exchange_name(&name).to_string();
    let arguments = b.arguments.map(Value::Object).unwrap_or(json!({}));
    let (kind, delayed) = match ExchangeKind::parse_declared(&b.kind, &arguments) {
        None => {
            return Err(ApiError::bad_request(format!(
                "invalid exchange type '{}'",
                b.kind
            )))
        }
        Some(Err(e)) => return Err(ApiError::bad_request(e)),
        Some(Ok(k)) => k,
    };
    let mut c = client(&state, &caller, &vhost)?;
    let existed = c.exchange_exists(&name);
    let wait = c.declare_exchange(
        ExchangeDef {
            name,
            kind,
            durable: b.durable,
            auto_delete: b.auto_delete,
            internal: b.internal,
            delayed,
            arguments,
        },
        false,
    )?;
    drop(c);
    durable(&state, wait).await?;
    Ok(super::created(!existed))
}

#[derive(Deserialize, Default)]
struct DeleteQuery {
    #[serde(rename = "if-unused", default)]
    if_unused: Option<String>,
}

async fn delete(
    State(state): State<crate::http::State>,
    caller: Caller,
    Path((vhost, name)): Path<(String, String)>,
    Query(dq): Query<DeleteQuery>,
) -> Result<StatusCode, ApiError> {
    find(&state, &caller, &vhost, &name)?;
    let mut c = client(&state, &caller, &vhost)?;
    let wait = c.delete_exchange(
        exchange_name(&name),
        dq.if_unused.as_deref() == Some("true"),
    )?;
    drop(c);
    durable(&state, wait).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Deserialize)]
struct PublishBody {
    #[serde(default)]
    properties: serde_json::Map<String, Value>,
    routing_key: String,
    payload: String,
    payload_encoding: String,
}

/// RabbitMQ's JSON properties as Weir's neutral ones.
fn properties(m: &serde_json::Map<String, Value>) -> Result<Properties, ApiError> {
    let s = |k: &str| m.get(k).and_then(Value::as_str).map(str::to_string);
    let mut p = Properties {
        content_type: s("content_type"),
        content_encoding: s("content_encoding"),
        correlation_id: s("correlation_id").map(String::into_bytes),
        reply_to: s("reply_to"),
        message_id: s("message_id"),
        kind: s("type"),
        user_id: s("user_id"),
        app_id: s("app_id"),
        ..Properties::default()
    };
    if let Some(v) = m.get("delivery_mode") {
        p.delivery_mode = match v
            .as_u64()
            .or_else(|| v.as_str().and_then(|s| s.parse().ok()))
        {
            Some(2) => Some(DeliveryMode::Persistent),
            Some(1) => Some(DeliveryMode::Transient),
            _ => return Err(ApiError::bad_request("delivery_mode is 1 or 2")),
        };
    }
    if let Some(v) = m.get("priority") {
        p.priority = Some(
            v.as_u64()
                .and_then(|n| u8::try_from(n).ok())
                .ok_or_else(|| ApiError::bad_request("priority is 0 to 255"))?,
        );
    }
    if let Some(v) = m.get("expiration") {
        let ttl = v
            .as_str()
            .and_then(|s| s.parse::<u64>().ok())
            .ok_or_else(|| ApiError::bad_request("expiration is a string of milliseconds"))?;
        p.ttl_ms = Some(ttl);
    }
    if let Some(v) = m.get("timestamp") {
        p.timestamp = Some(
            v.as_u64()
                .ok_or_else(|| ApiError::bad_request("timestamp is seconds"))?,
        );
    }
    if let Some(h) = m.get("headers") {
        let h = h
            .as_object()
            .ok_or_else(|| ApiError::bad_request("headers is an object"))?;
        let mut t = Table::new();
        for (k, v) in h {
            t.push(k.clone(), header_value(v)?);
        }
        p.headers = Some(t);
    }
    Ok(p)
}

fn header_value(v: &Value) -> Result<weir_engine::properties::Value, ApiError> {
    use weir_engine::properties::Value as V;
    Ok(match v {
        Value::Null => V::Void,
        Value::Bool(b) => V::Bool(*b),
        Value::Number(n) => match (n.as_i64(), n.as_f64()) {
            (Some(i), _) => V::I64(i),
            (None, Some(f)) => V::F64(f),
            _ => return Err(ApiError::bad_request("header number out of range")),
        },
        Value::String(s) => V::String(s.clone()),
        Value::Array(a) => V::Array(a.iter().map(header_value).collect::<Result<_, _>>()?),
        Value::Object(o) => {
            let mut t = Table::new();
            for (k, v) in o {
                t.push(k.clone(), header_value(v)?);
            }
            V::Table(t)
        }
    })
}

async fn publish(
    State(state): State<crate::http::State>,
    caller: Caller,
    Path((vhost, name)): Path<(String, String)>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let b: PublishBody = parse_body(&body)?;
    let body = match b.payload_encoding.as_str() {
        "string" => bytes::Bytes::from(b.payload.into_bytes()),
        "base64" => bytes::Bytes::from(
            base64::engine::general_purpose::STANDARD
                .decode(b.payload.as_bytes())
                .map_err(|e| ApiError::bad_request(format!("invalid base64 payload: {e}")))?,
        ),
        other => {
            return Err(ApiError::bad_request(format!(
                "invalid payload_encoding '{other}': string or base64"
            )))
        }
    };
    find(&state, &caller, &vhost, &name)?;
    let exchange = exchange_name(&name).to_string();
    let p = properties(&b.properties)?;
    let raw = p
        .to_bytes()
        .map_err(|e| ApiError::bad_request(format!("properties: {e}")))?;
    // Synchronous part (the route input is not Send); the wait after.
    let (routed, wait) = {
        let mut c = client(&state, &caller, &vhost)?;
        c.check_message_size(body.len() as u64)?;
        // The alarms, quotas and rates every publisher obeys.
        if let Err(r) = super::admit_publish(&state, &caller, &c, body.len() + raw.len()) {
            return Ok(super::refused(r));
        }
        let route = weir_engine::tenant::RouteInput {
            exchange: &exchange,
            routing_key: &b.routing_key,
            headers: &p,
        };
        let (persistent, priority, ttl_ms) = (p.is_persistent(), p.priority.unwrap_or(0), p.ttl_ms);
        let r = c.publish(&route, |id| weir_engine::message::Message {
            id,
            exchange: bytes::Bytes::from(exchange.clone().into_bytes()),
            routing_key: bytes::Bytes::from(b.routing_key.clone().into_bytes()),
            properties: raw,
            body,
            header_format: HeaderFormat::WEIR,
            persistent,
            priority,
            ttl_ms,
        })?;
        match r {
            weir_engine::client::Published::Unroutable => (false, None),
            weir_engine::client::Published::NoSpace => {
                return Err(ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "service_unavailable",
                    "the store is out of disk space",
                ))
            }
            weir_engine::client::Published::Routed { needs_barrier, .. } => {
                let wait = needs_barrier.then(|| crate::session::durable::appended(&mut c));
                c.commit();
                (true, wait)
            }
        }
    };
    if let Some(w) = wait {
        w.await
            .map_err(|_| ApiError::internal("the store failed"))?;
    }
    Ok(Json(json!({ "routed": routed })).into_response())
}

async fn bindings_dir(
    state: crate::http::State,
    caller: Caller,
    vhost: String,
    name: String,
    as_source: bool,
) -> Result<Json<Value>, ApiError> {
    find(&state, &caller, &vhost, &name)?;
    let t = engine(&state)
        .tenant(&vhost)
        .ok_or_else(ApiError::not_found)?;
    let name = exchange_name(&name);
    let out: Vec<Value> = super::bindings::all(&t)
        .into_iter()
        .filter(|b| {
            if as_source {
                b.source == name
            } else {
                b.destination_kind == DestinationKind::Exchange && b.destination == name
            }
        })
        .map(|b| super::bindings::render(&vhost, &b))
        .collect();
    Ok(Json(Value::Array(out)))
}

async fn bindings_source(
    State(state): State<crate::http::State>,
    caller: Caller,
    Path((vhost, name)): Path<(String, String)>,
) -> Result<Json<Value>, ApiError> {
    bindings_dir(state, caller, vhost, name, true).await
}

async fn bindings_destination(
    State(state): State<crate::http::State>,
    caller: Caller,
    Path((vhost, name)): Path<(String, String)>,
) -> Result<Json<Value>, ApiError> {
    bindings_dir(state, caller, vhost, name, false).await
}
