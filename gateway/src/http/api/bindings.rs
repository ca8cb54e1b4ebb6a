//! `/api/bindings…`: list, create (POST, answering `Location` with the
//! binding's properties key), show and delete one binding by its
//! properties key, for exchange-to-queue (`/e/{src}/q/{dst}`) and
//! exchange-to-exchange (`/e/{src}/e/{dst}`) bindings.

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{json, Value};
use weir_engine::meta::{BindingDef, DestinationKind};
use weir_engine::Tenant;

use super::auth::Caller;
use super::list::{list, ListQuery, Listable};
use super::{client, durable, engine, exchange_name, parse_body, vhosts_of};
use crate::http::error::ApiError;

/// The routes.
pub fn router() -> Router<crate::http::State> {
    Router::new()
        .route("/api/bindings", get(list_all))
        .route("/api/bindings/{vhost}", get(list_all))
        .route(
            "/api/bindings/{vhost}/e/{source}/{kind}/{destination}",
            get(between).post(create),
        )
        .route(
            "/api/bindings/{vhost}/e/{source}/{kind}/{destination}/{props}",
            get(show).delete(delete),
        )
}

/// Every binding of a tenant (the default exchange's implicit ones
/// excluded).
pub(crate) fn all(t: &Tenant) -> Vec<BindingDef> {
    let mut out = Vec::new();
    for x in t.exchanges() {
        for b in x.bindings() {
            let (kind, name) = match &b.destination {
                weir_engine::exchange::Destination::Queue(q) => {
                    (DestinationKind::Queue, q.name().to_string())
                }
                weir_engine::exchange::Destination::Exchange(d) => {
                    (DestinationKind::Exchange, d.def.name.clone())
                }
            };
            out.push(BindingDef {
                source: x.def.name.clone(),
                destination_kind: kind,
                destination: name,
                key: b.key,
                arguments: b.arguments,
            });
        }
    }
    out.sort_by(|a, b| {
        (&a.source, &a.destination, &a.key).cmp(&(&b.source, &b.destination, &b.key))
    });
    out
}

/// RabbitMQ's properties key: the routing key (percent-encoded), `~` when
/// empty, then `~` and a hash of the arguments when there are any.
pub(crate) fn props_key(key: &str, args: &Value) -> String {
    let empty_args = args.is_null() || args.as_object().is_some_and(|m| m.is_empty());
    let enc: String = key
        .bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-_.".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect();
    if empty_args {
        if key.is_empty() {
            "~".into()
        } else {
            enc
        }
    } else {
        let h = weir_engine::queue::ordering_hash(args.to_string().as_bytes());
        format!("{enc}~{h:016x}")
    }
}

fn kind_name(k: DestinationKind) -> &'static str {
    match k {
        DestinationKind::Queue => "queue",
        DestinationKind::Exchange => "exchange",
    }
}

/// One binding as RabbitMQ shows it.
pub(crate) fn render(vhost: &str, b: &BindingDef) -> Value {
    json!({
        "source": b.source,
        "vhost": vhost,
        "destination": b.destination,
        "destination_type": kind_name(b.destination_kind),
        "routing_key": b.key,
        "arguments": if b.arguments.is_null() { json!({}) } else { b.arguments.clone() },
        "properties_key": props_key(&b.key, &b.arguments),
    })
}

/// The default exchange's implicit binding to a queue, as RabbitMQ lists it.
pub(crate) fn default_binding(vhost: &str, queue: &str) -> Value {
    json!({
        "source": "",
        "vhost": vhost,
        "destination": queue,
        "destination_type": "queue",
        "routing_key": queue,
        "arguments": {},
        "properties_key": props_key(queue, &Value::Null),
    })
}

struct Item {
    vhost: String,
    b: BindingDef,
}

impl Listable for Item {
    fn name(&self) -> &str {
        &self.b.source
    }
    fn default_key(&self) -> (&str, &str) {
        (&self.vhost, &self.b.source)
    }
    fn render(&self) -> Value {
        render(&self.vhost, &self.b)
    }
}

fn items(state: &crate::http::State, vhosts: Vec<String>) -> Vec<Item> {
    let e = engine(state);
    vhosts
        .into_iter()
        .filter_map(|v| e.tenant(&v).map(|t| (v, t)))
        .flat_map(|(v, t)| {
            all(&t).into_iter().map(move |b| Item {
                vhost: v.clone(),
                b,
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
        .bindings
        .serve(key, crate::http::render::JSON, render)
        .await)
}

fn dest_kind(k: &str) -> Result<DestinationKind, ApiError> {
    match k {
        "q" => Ok(DestinationKind::Queue),
        "e" => Ok(DestinationKind::Exchange),
        _ => Err(ApiError::not_found()),
    }
}

/// The bindings from `source` to `destination`, checking both exist.
fn between_defs(
    state: &crate::http::State,
    caller: &Caller,
    vhost: &str,
    source: &str,
    kind: DestinationKind,
    destination: &str,
) -> Result<Vec<BindingDef>, ApiError> {
    caller.require_vhost(engine(state), vhost)?;
    let t = engine(state)
        .tenant(vhost)
        .ok_or_else(ApiError::not_found)?;
    t.exchange(source).map_err(|_| ApiError::not_found())?;
    let dest_exists = match kind {
        DestinationKind::Queue => t.queue_named(destination).is_some(),
        DestinationKind::Exchange => t.exchange(destination).is_ok(),
    };
    if !dest_exists {
        return Err(ApiError::not_found());
    }
    Ok(all(&t)
        .into_iter()
        .filter(|b| {
            b.source == source && b.destination_kind == kind && b.destination == destination
        })
        .collect())
}

async fn between(
    State(state): State<crate::http::State>,
    caller: Caller,
    Path((vhost, source, kind, destination)): Path<(String, String, String, String)>,
) -> Result<Json<Value>, ApiError> {
    let k = dest_kind(&kind)?;
    let source = exchange_name(&source).to_string();
    let defs = between_defs(&state, &caller, &vhost, &source, k, &destination)?;
    Ok(Json(Value::Array(
        defs.iter().map(|b| render(&vhost, b)).collect(),
    )))
}

#[derive(Deserialize)]
struct CreateBody {
    #[serde(default)]
    routing_key: String,
    #[serde(default)]
    arguments: Option<serde_json::Map<String, Value>>,
}

async fn create(
    State(state): State<crate::http::State>,
    caller: Caller,
    Path((vhost, source, kind, destination)): Path<(String, String, String, String)>,
    body: Bytes,
) -> Result<impl IntoResponse, ApiError> {
    let k = dest_kind(&kind)?;
    let source = exchange_name(&source).to_string();
    if source.is_empty() {
        return Err(ApiError::forbidden(
            "operation not permitted on the default exchange",
        ));
    }
    let b: CreateBody = parse_body(&body)?;
    between_defs(&state, &caller, &vhost, &source, k, &destination)?;
    let args = b.arguments.map(Value::Object).unwrap_or(json!({}));
    let mut c = client(&state, &caller, &vhost)?;
    let wait = c.bind(&source, k, &destination, &b.routing_key, args.clone())?;
    drop(c);
    durable(&state, wait).await?;
    let mut h = HeaderMap::new();
    let loc = props_key(&b.routing_key, &args);
    if let Ok(v) = HeaderValue::from_str(&loc) {
        h.insert(header::LOCATION, v);
    }
    Ok((StatusCode::CREATED, h))
}

fn find_one(
    state: &crate::http::State,
    caller: &Caller,
    p: &(String, String, String, String, String),
) -> Result<BindingDef, ApiError> {
    let (vhost, source, kind, destination, props) = p;
    let k = dest_kind(kind)?;
    let defs = between_defs(state, caller, vhost, exchange_name(source), k, destination)?;
    defs.into_iter()
        .find(|b| props_key(&b.key, &b.arguments) == *props)
        .ok_or_else(ApiError::not_found)
}

async fn show(
    State(state): State<crate::http::State>,
    caller: Caller,
    Path(p): Path<(String, String, String, String, String)>,
) -> Result<Json<Value>, ApiError> {
    let b = find_one(&state, &caller, &p)?;
    Ok(Json(render(&p.0, &b)))
}

async fn delete(
    State(state): State<crate::http::State>,
    caller: Caller,
    Path(p): Path<(String, String, String, String, String)>,
) -> Result<StatusCode, ApiError> {
    let b = find_one(&state, &caller, &p)?;
    let mut c = client(&state, &caller, &p.0)?;
    let wait = c.unbind(
        &b.source,
        b.destination_kind,
        &b.destination,
        &b.key,
        b.arguments,
    )?;
    drop(c);
    durable(&state, wait).await?;
    Ok(StatusCode::NO_CONTENT)
}
