//! `/api/overview`, `/api/whoami`, `/api/health/checks/alarms`,
//! `/api/aliveness-test/{vhost}`.

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde_json::{json, Value};
use weir_engine::client::GetAck;
use weir_engine::lease::Settle;
use weir_engine::properties::{HeaderFormat, Properties};
use weir_engine::tenant::QueueDeclare;

use super::auth::Caller;
use super::{client, engine, rate, visible_vhosts};
use crate::http::error::ApiError;

/// The routes.
pub fn router() -> Router<crate::http::State> {
    Router::new()
        .route("/api/overview", get(overview))
        .route("/api/whoami", get(whoami))
        .route("/api/health/checks/alarms", get(alarms))
        .route("/api/aliveness-test/{vhost}", get(aliveness))
}

/// `GET /api/overview`: who we are and the broker-wide figures (over the
/// vhosts the caller sees).
async fn overview(State(state): State<crate::http::State>, caller: Caller) -> Json<Value> {
    let e = engine(&state);
    let (mut ready, mut leased, mut queues, mut exchanges, mut consumers) =
        (0u64, 0u64, 0u64, 0u64, 0u64);
    let mut c = weir_engine::stats::QueueCounters::default();
    let vhosts = visible_vhosts(&state, &caller);
    for v in &vhosts {
        let Some(t) = e.tenant(v) else { continue };
        exchanges += t.exchanges().len() as u64;
        for q in t.queues() {
            queues += 1;
            consumers += u64::from(q.consumer_count());
            let x = q.counters();
            ready += x.ready;
            leased += x.leased;
            c.published += x.published;
            c.delivered += x.delivered;
            c.acked += x.acked;
            c.redelivered += x.redelivered;
            c.dead_lettered += x.dead_lettered;
            c.expired += x.expired;
        }
    }
    let r = state.rates().vhosts(vhosts.iter().map(String::as_str));
    let (conns, channels) = state.shared.connections.counts();
    Json(json!({
        "product_name": "Weir",
        "product_version": env!("CARGO_PKG_VERSION"),
        "management_version": env!("CARGO_PKG_VERSION"),
        "rabbitmq_version": "3.13.0",
        "erlang_version": "none",
        "cluster_name": super::node_name(),
        "node": super::node_name(),
        "uptime": state.started.elapsed().as_millis() as u64,
        "rates_mode": "basic",
        "statistics_db_event_queue": 0,
        "queue_totals": {
            "messages": ready + leased,
            "messages_details": rate(r.messages()),
            "messages_ready": ready,
            "messages_ready_details": rate(r.messages_ready),
            "messages_unacknowledged": leased,
            "messages_unacknowledged_details": rate(r.messages_unacknowledged),
        },
        // Weir's own: mean enqueue-to-delivery latency of the messages
        // delivered over the last sample interval (null if none).
        "latency_ms": r.latency_ms,
        "object_totals": {
            "queues": queues,
            "exchanges": exchanges,
            "consumers": consumers,
            "connections": conns,
            "channels": channels,
        },
        "message_stats": {
            "publish": c.published,
            "publish_details": rate(r.publish),
            "deliver_get": c.delivered,
            "deliver_get_details": rate(r.deliver_get),
            "ack": c.acked,
            "ack_details": rate(r.ack),
            "redeliver": c.redelivered,
            "redeliver_details": rate(r.redeliver),
            "dead_lettered": c.dead_lettered,
            "dead_lettered_details": rate(r.dead_lettered),
            "expired": c.expired,
            "expired_details": rate(r.expired),
        },
        "listeners": [],
        "contexts": [],
    }))
}

/// `GET /api/whoami`.
async fn whoami(caller: Caller) -> Json<Value> {
    Json(json!({ "name": caller.name, "tags": caller.tags }))
}

/// `GET /api/health/checks/alarms`: 200 `{"status":"ok"}`, or 503 with the
/// alarms in effect.
async fn alarms(State(state): State<crate::http::State>, _caller: Caller) -> Response {
    let a = *state.shared.alarms.borrow();
    if !a.any() {
        return Json(json!({ "status": "ok" })).into_response();
    }
    let mut list = Vec::new();
    if a.memory {
        list.push(json!({ "node": super::node_name(), "resource": "memory" }));
    }
    if a.disk {
        list.push(json!({ "node": super::node_name(), "resource": "disk" }));
    }
    (
        StatusCode::SERVICE_UNAVAILABLE,
        Json(json!({ "status": "failed", "reason": "resource alarm(s) in effect in the cluster", "alarms": list })),
    )
        .into_response()
}

/// `GET /api/aliveness-test/{vhost}`: declares `aliveness-test`, publishes
/// a message to it, gets it back; `{"status":"ok"}`.
async fn aliveness(
    State(state): State<crate::http::State>,
    caller: Caller,
    Path(vhost): Path<String>,
) -> Result<Json<Value>, ApiError> {
    caller.require_vhost(engine(&state), &vhost)?;
    let mut c = client(&state, &caller, &vhost)?;
    let (_, wait) = c.declare_queue(QueueDeclare {
        name: "aliveness-test".into(),
        passive: false,
        durable: false,
        exclusive: false,
        auto_delete: false,
        arguments: json!({}),
        connection: c.id(),
    })?;
    drop(wait);
    let props = Properties::default();
    let raw = props
        .to_bytes()
        .map_err(|e| ApiError::internal(e.to_string()))?;
    let route = weir_engine::tenant::RouteInput {
        exchange: "",
        routing_key: "aliveness-test",
        headers: &props,
    };
    c.publish(&route, |id| weir_engine::message::Message {
        id,
        exchange: bytes::Bytes::new(),
        routing_key: bytes::Bytes::from_static(b"aliveness-test"),
        properties: raw,
        body: bytes::Bytes::from_static(b"test_message"),
        header_format: HeaderFormat::WEIR,
        persistent: false,
        priority: 0,
        ttl_ms: None,
    })?;
    let now = std::time::Instant::now();
    let got = c
        .get(
            "aliveness-test",
            GetAck::Lease {
                scope: 1,
                tag: 1,
                now,
            },
        )
        .map_err(|e| ApiError::internal(e.to_string()))?;
    if got.is_none() {
        return Ok(Json(
            json!({ "status": "failed", "reason": "message not routed" }),
        ));
    }
    c.settle(1, 1, false, Settle::Ack)
        .map_err(|e| ApiError::internal(e.to_string()))?;
    c.commit();
    Ok(Json(json!({ "status": "ok" })))
}
