//! `/api/connections[/{name}]` (GET; DELETE closes it: AMQP 320
//! CONNECTION_FORCED with the `X-Reason` header's text, MQTT 5 DISCONNECT
//! 0x98), `/api/connections/{name}/channels`,
//! `/api/vhosts/{vhost}/connections`, `/api/vhosts/{vhost}/channels`,
//! `/api/channels[/{name}]`, `/api/consumers[/{vhost}]`, from the registry
//! of live connections ([`crate::connections`]: who, client properties,
//! traffic, open channel numbers) and the queues' consumers.
//!
//! Users see their own connections; monitors and administrators see all
//! (and administrators may close any).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::routing::get;
use axum::{Json, Router};
use serde_json::{json, Value};

use super::auth::Caller;
use super::list::{list, ListQuery, Listable};
use super::{engine, vhosts_of};
use crate::connections::ConnInfo;
use crate::http::error::ApiError;

/// The routes.
pub fn router() -> Router<crate::http::State> {
    Router::new()
        .route("/api/connections", get(list_connections))
        .route("/api/connections/{name}", get(show).delete(close))
        .route("/api/connections/{name}/channels", get(connection_channels))
        .route("/api/vhosts/{vhost}/connections", get(vhost_connections))
        .route("/api/vhosts/{vhost}/channels", get(vhost_channels))
        .route("/api/channels", get(list_channels))
        .route("/api/channels/{name}", get(show_channel))
        .route("/api/consumers", get(consumers_all))
        .route("/api/consumers/{vhost}", get(consumers_all))
}

fn render(c: &Arc<ConnInfo>) -> Value {
    let t = &c.traffic;
    let (recv_rate, send_rate) = c.rates();
    let mut v = json!({
        "name": c.name,
        "node": super::node_name(),
        "type": "network",
        "protocol": c.protocol,
        "user": c.user,
        "vhost": c.vhost,
        "peer_host": c.peer.ip().to_string(),
        "peer_port": c.peer.port(),
        "ssl": c.tls,
        "state": "running",
        "channels": c.channels.load(Ordering::Relaxed),
        "connected_at": c.connected_at_ms,
        "client_properties": c.client_properties(),
        "recv_oct": t.recv_oct.load(Ordering::Relaxed),
        "recv_oct_details": { "rate": recv_rate },
        "send_oct": t.send_oct.load(Ordering::Relaxed),
        "send_oct_details": { "rate": send_rate },
        "recv_cnt": t.recv_cnt.load(Ordering::Relaxed),
        "send_cnt": t.send_cnt.load(Ordering::Relaxed),
    });
    // RabbitMQ shows it only when the client named the connection.
    if let Some(n) = c.user_provided_name() {
        v["user_provided_name"] = json!(n);
    }
    v
}

struct Item(Arc<ConnInfo>, String);

impl Listable for Item {
    fn name(&self) -> &str {
        &self.0.name
    }
    fn default_key(&self) -> (&str, &str) {
        (&self.1, &self.0.name)
    }
    fn render(&self) -> Value {
        render(&self.0)
    }
}

/// Listed oldest first.
fn item(c: Arc<ConnInfo>) -> Item {
    let key = format!("{:020}", c.connected_at_ms);
    Item(c, key)
}

fn visible(state: &crate::http::State, caller: &Caller) -> Vec<Arc<ConnInfo>> {
    state
        .shared
        .connections
        .list()
        .into_iter()
        .filter(|c| caller.is_monitor() || c.user == caller.name)
        .collect()
}

async fn list_connections(
    State(state): State<crate::http::State>,
    caller: Caller,
    Query(q): Query<ListQuery>,
    uri: axum::http::Uri,
) -> Result<axum::response::Response, ApiError> {
    let (key, st) = (connections_key(&uri, &caller), state.clone());
    let render = move || {
        let items = visible(&st, &caller).into_iter().map(item).collect();
        crate::http::render::json(list(&q, items))
    };
    Ok(state
        .gates
        .connections
        .serve(key, crate::http::render::JSON, render)
        .await)
}

/// Monitors see every connection, others their own: the render's key.
fn connections_key(uri: &axum::http::Uri, caller: &Caller) -> String {
    let who = if caller.is_monitor() {
        ""
    } else {
        &caller.name
    };
    crate::http::render::list_key(uri, &[who.to_string()])
}

async fn vhost_connections(
    State(state): State<crate::http::State>,
    caller: Caller,
    Path(vhost): Path<String>,
    Query(q): Query<ListQuery>,
    uri: axum::http::Uri,
) -> Result<axum::response::Response, ApiError> {
    caller.require_vhost(engine(&state), &vhost)?;
    let (key, st) = (connections_key(&uri, &caller), state.clone());
    let render = move || {
        let items = visible(&st, &caller)
            .into_iter()
            .filter(|c| c.vhost == vhost)
            .map(item)
            .collect();
        crate::http::render::json(list(&q, items))
    };
    Ok(state
        .gates
        .connections
        .serve(key, crate::http::render::JSON, render)
        .await)
}

fn find(
    state: &crate::http::State,
    caller: &Caller,
    name: &str,
) -> Result<Arc<ConnInfo>, ApiError> {
    let c = state
        .shared
        .connections
        .get(name)
        .ok_or_else(ApiError::not_found)?;
    if caller.is_monitor() || c.user == caller.name {
        Ok(c)
    } else {
        Err(ApiError::not_found())
    }
}

async fn show(
    State(state): State<crate::http::State>,
    caller: Caller,
    Path(name): Path<String>,
) -> Result<Json<Value>, ApiError> {
    Ok(Json(render(&find(&state, &caller, &name)?)))
}

async fn close(
    State(state): State<crate::http::State>,
    caller: Caller,
    Path(name): Path<String>,
    headers: HeaderMap,
) -> Result<StatusCode, ApiError> {
    let c = find(&state, &caller, &name)?;
    if !caller.is_admin() && c.user != caller.name {
        return Err(ApiError::forbidden("Not administrator user"));
    }
    let reason = headers
        .get("x-reason")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("Closed via management plugin");
    state.shared.connections.close(&name, reason);
    Ok(StatusCode::NO_CONTENT)
}

/// One open channel of a connection.
struct Chan {
    c: Arc<ConnInfo>,
    number: u16,
    name: String,
    /// Connections oldest first, then channel numbers.
    key: String,
}

impl Listable for Chan {
    fn name(&self) -> &str {
        &self.name
    }
    fn default_key(&self) -> (&str, &str) {
        (&self.key, "")
    }
    fn render(&self) -> Value {
        let c = &self.c;
        json!({
            "name": self.name,
            "number": self.number,
            "node": super::node_name(),
            "user": c.user,
            "vhost": c.vhost,
            "state": "running",
            "connection_details": {
                "name": c.name,
                "peer_host": c.peer.ip().to_string(),
                "peer_port": c.peer.port(),
            },
        })
    }
}

/// RabbitMQ's channel name: the connection's, then the number.
fn channel_name(c: &ConnInfo, n: u16) -> String {
    format!("{} ({n})", c.name)
}

fn channels_of(c: &Arc<ConnInfo>) -> impl Iterator<Item = Chan> + '_ {
    // Per-channel figures (publishes, deliveries, prefetch) are not kept:
    // the registry knows which channels are open.
    c.channel_numbers().into_iter().map(move |n| Chan {
        c: c.clone(),
        number: n,
        name: channel_name(c, n),
        key: format!("{:020}.{:020}.{n:05}", c.connected_at_ms, c.id),
    })
}

async fn connection_channels(
    State(state): State<crate::http::State>,
    caller: Caller,
    Path(name): Path<String>,
    Query(q): Query<ListQuery>,
) -> Result<Json<Value>, ApiError> {
    let c = find(&state, &caller, &name)?;
    Ok(Json(list(&q, channels_of(&c).collect())?))
}

async fn list_channels(
    State(state): State<crate::http::State>,
    caller: Caller,
    Query(q): Query<ListQuery>,
) -> Result<Json<Value>, ApiError> {
    let conns = visible(&state, &caller);
    Ok(Json(list(
        &q,
        conns.iter().flat_map(channels_of).collect(),
    )?))
}

async fn vhost_channels(
    State(state): State<crate::http::State>,
    caller: Caller,
    Path(vhost): Path<String>,
    Query(q): Query<ListQuery>,
) -> Result<Json<Value>, ApiError> {
    caller.require_vhost(engine(&state), &vhost)?;
    let conns: Vec<_> = visible(&state, &caller)
        .into_iter()
        .filter(|c| c.vhost == vhost)
        .collect();
    Ok(Json(list(
        &q,
        conns.iter().flat_map(channels_of).collect(),
    )?))
}

async fn show_channel(
    State(state): State<crate::http::State>,
    caller: Caller,
    Path(name): Path<String>,
) -> Result<Json<Value>, ApiError> {
    // "<connection name> (<number>)"
    let (conn, n) = name
        .strip_suffix(')')
        .and_then(|s| s.rsplit_once(" ("))
        .and_then(|(conn, n)| Some((conn, n.parse::<u16>().ok()?)))
        .ok_or_else(ApiError::not_found)?;
    let c = find(&state, &caller, conn)?;
    let ch = channels_of(&c)
        .find(|ch| ch.number == n)
        .ok_or_else(ApiError::not_found)?;
    Ok(Json(ch.render()))
}

fn consumers(state: &crate::http::State, vhosts: Vec<String>) -> Value {
    let e = engine(state);
    // One pass over the connections, then a lookup per consumer (not a
    // walk over every connection per consumer).
    let by_engine_id: std::collections::HashMap<u64, _> = state
        .shared
        .connections
        .list()
        .into_iter()
        .map(|c| (c.engine_id, c))
        .collect();
    let mut out = Vec::new();
    for v in vhosts {
        let Some(t) = e.tenant(&v) else { continue };
        for q in t.queues() {
            if q.consumer_count() == 0 {
                continue;
            }
            for c in q.consumers() {
                let conn = by_engine_id.get(&c.connection_id());
                out.push(json!({
                    "consumer_tag": String::from_utf8_lossy(c.tag()),
                    "exclusive": c.exclusive(),
                    "ack_required": !c.no_ack(),
                    "prefetch_count": c.prefetch_count(),
                    "active": true,
                    "activity_status": "up",
                    "arguments": { "x-priority": c.priority() },
                    "queue": { "name": q.name(), "vhost": v },
                    "channel_details": conn.as_ref().map(|k| json!({
                        "name": format!("{} ({})", k.name, c.scope()),
                        "number": c.scope(),
                        "connection_name": k.name,
                        "peer_host": k.peer.ip().to_string(),
                        "peer_port": k.peer.port(),
                        "user": k.user,
                    })).unwrap_or(json!({})),
                }));
            }
        }
    }
    Value::Array(out)
}

/// `GET /api/consumers` and `GET /api/consumers/{vhost}`.
async fn consumers_all(
    State(state): State<crate::http::State>,
    caller: Caller,
    vhost: Option<Path<String>>,
) -> Result<Json<Value>, ApiError> {
    let v = vhosts_of(&state, &caller, vhost.as_deref().map(String::as_str))?;
    Ok(Json(consumers(&state, v)))
}
