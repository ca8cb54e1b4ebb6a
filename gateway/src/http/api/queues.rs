//! `/api/queues…`: list, show, declare, delete, purge, get, bindings; and
//! Weir's own: requeue a queue's dead letters back to their source queues,
//! and the delivery attempts of its queued messages.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::{Json, Router};
use base64::Engine as _;
use serde::Deserialize;
use serde_json::{json, Value};
use weir_engine::client::{DeadLetterMove, GetAck};
use weir_engine::lease::Settle;
use weir_engine::policy::Policy;
use weir_engine::queue::Queue;
use weir_engine::stats::{QueueStats, ATTEMPT_BUCKETS};
use weir_engine::tenant::QueueDeclare;

use super::auth::Caller;
use super::list::{list, Key, ListQuery, Listable};
use super::rates::{Rates, Sampler};
use super::{client, durable, engine, parse_body, rate, vhosts_of};
use crate::http::error::ApiError;

/// The routes.
pub fn router() -> Router<crate::http::State> {
    Router::new()
        .route("/api/queues", get(list_all))
        .route("/api/queues/{vhost}", get(list_all))
        .route(
            "/api/queues/{vhost}/{name}",
            get(show).put(declare).delete(delete),
        )
        .route(
            "/api/queues/{vhost}/{name}/contents",
            axum::routing::delete(purge),
        )
        .route("/api/queues/{vhost}/{name}/get", post(get_messages))
        .route("/api/queues/{vhost}/{name}/bindings", get(bindings))
        .route("/api/queues/{vhost}/{name}/attempts", get(attempts))
        .route(
            "/api/queues/{vhost}/{name}/requeue-dead-letters",
            post(requeue_dead_letters),
        )
}

/// What rendering a queue needs besides the queue.
struct Ctx {
    sampler: Arc<Sampler>,
    policies: Vec<(String, Vec<Policy>)>,
    now: u64,
}

impl Ctx {
    fn new(state: &crate::http::State, vhosts: &[String]) -> Self {
        let e = engine(state);
        let policies = vhosts
            .iter()
            .map(|v| {
                let ps = e
                    .tenant(v)
                    .map(|t| {
                        t.policies()
                            .into_iter()
                            .filter_map(|d| Policy::new(d).ok())
                            .collect()
                    })
                    .unwrap_or_default();
                (v.clone(), ps)
            })
            .collect();
        Ctx {
            sampler: state.rates().clone(),
            policies,
            now: e.clock().now_ms(),
        }
    }

    fn policy(&self, vhost: &str, name: &str) -> Option<&Policy> {
        let ps = &self.policies.iter().find(|(v, _)| v == vhost)?.1;
        weir_engine::policy::select(ps, name)
    }
}

struct Item {
    q: Arc<Queue>,
    ctx: Arc<Ctx>,
}

impl Listable for Item {
    fn name(&self) -> &str {
        self.q.name()
    }
    fn default_key(&self) -> (&str, &str) {
        (&self.q.tenant, self.q.name())
    }
    fn cheap_key(&self, field: &str) -> Option<Key> {
        let leased = || {
            self.q
                .partitions
                .iter()
                .map(|p| p.counters.leased.load(std::sync::atomic::Ordering::Relaxed))
                .sum::<u64>() as f64
        };
        Some(match field {
            "name" => Key::Str(self.q.name().to_string()),
            "vhost" => Key::Str(self.q.tenant.to_string()),
            "messages_ready" => Key::Num(self.q.message_count() as f64),
            "messages_unacknowledged" => Key::Num(leased()),
            "messages" => Key::Num(self.q.message_count() as f64 + leased()),
            "consumers" => Key::Num(f64::from(self.q.consumer_count())),
            _ => return None,
        })
    }
    fn render(&self) -> Value {
        render(&self.q, &self.q.stats(), &self.ctx)
    }
}

/// Age of the oldest message, delivery attempts, dead-letter and expiry
/// counters and retention: Weir's fields next to RabbitMQ's.
fn render(q: &Queue, s: &QueueStats, ctx: &Ctx) -> Value {
    let r: Rates = ctx.sampler.queue(q.dedup_id().0);
    let args = q.args();
    let kind = q
        .def
        .arguments
        .get("x-queue-type")
        .and_then(Value::as_str)
        .unwrap_or("classic");
    let policy = ctx.policy(&q.tenant, q.name());
    let oldest_age = s.oldest_age_ms(ctx.now);
    let histogram: Vec<Value> = ATTEMPT_BUCKETS
        .iter()
        .zip(s.attempts)
        .map(|(le, count)| {
            let le = if *le == u16::MAX {
                json!("+Inf")
            } else {
                json!(le)
            };
            json!({ "le": le, "count": count })
        })
        .collect();
    let c = s.counters;
    let utilisation = if s.consumers == 0 {
        Value::Null
    } else if s.ready == 0 {
        json!(1.0)
    } else {
        json!(0.0)
    };
    let retention = json!({
        "messages": s.ready,
        "max_messages": args.max_length,
        "bytes": s.ready_bytes,
        "max_bytes": args.max_length_bytes,
        "age_ms": oldest_age,
        "max_age_ms": q.message_ttl(),
        "overflow": format!("{:?}", args.overflow),
    });
    let message_stats = json!({
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
    });
    json!({
        "name": q.name(),
        "vhost": &*q.tenant,
        "durable": q.def.durable,
        "auto_delete": q.def.auto_delete,
        "exclusive": q.exclusive_owner().is_some(),
        "arguments": if q.def.arguments.is_null() { json!({}) } else { q.def.arguments.clone() },
        "type": kind,
        "state": "running",
        "node": super::node_name(),
        "policy": policy.map(|p| p.def.name.clone()),
        "effective_policy_definition": policy.map(|p| Value::Object(p.def.definition.clone())).unwrap_or(json!({})),
        "messages": s.messages(),
        "messages_details": rate(r.messages()),
        "messages_ready": s.ready,
        "messages_ready_details": rate(r.messages_ready),
        "messages_unacknowledged": s.leased,
        "messages_unacknowledged_details": rate(r.messages_unacknowledged),
        "latency_ms": r.latency_ms,
        "messages_delayed": s.delayed,
        "consumers": s.consumers,
        "consumer_utilisation": utilisation,
        // An estimate: the entries' fixed size plus the ready bytes.
        "memory": (s.ready + s.leased + s.delayed) * 64 + s.ready_bytes,
        "message_bytes": s.ready_bytes + s.leased_bytes,
        "message_bytes_ready": s.ready_bytes,
        "message_bytes_unacknowledged": s.leased_bytes,
        "head_message_timestamp": s.oldest_enqueued_ms.map(|t| t / 1000),
        "oldest_message_age_ms": oldest_age,
        "delivery_attempts": {
            "max": s.attempts_max(),
            "histogram": histogram,
        },
        "partitions": q.partitions.len(),
        "retention": retention,
        "message_stats": message_stats,
    })
}

fn items(state: &crate::http::State, vhosts: Vec<String>) -> Vec<Item> {
    let ctx = Arc::new(Ctx::new(state, &vhosts));
    let e = engine(state);
    vhosts
        .iter()
        .filter_map(|v| e.tenant(v))
        .flat_map(|t| t.queues())
        .map(|q| Item {
            q,
            ctx: ctx.clone(),
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
    let vhosts = vhosts_of(&state, &caller, vhost.as_deref().map(String::as_str))?;
    // Off the runtime's workers, one render at a time (crate::http::render).
    let (key, st) = (crate::http::render::list_key(&uri, &vhosts), state.clone());
    let render = move || crate::http::render::json(list(&q, items(&st, vhosts)));
    Ok(state
        .gates
        .queues
        .serve(key, crate::http::render::JSON, render)
        .await)
}

/// The queue, if the caller may see its vhost; 404 otherwise.
fn find(
    state: &crate::http::State,
    caller: &Caller,
    vhost: &str,
    name: &str,
) -> Result<Arc<Queue>, ApiError> {
    caller.require_vhost(engine(state), vhost)?;
    let t = engine(state)
        .tenant(vhost)
        .ok_or_else(ApiError::not_found)?;
    // A map lookup: a walk over every queue would cost each request
    // O(queues) at 100,000 queues.
    t.queue_named(name).ok_or_else(ApiError::not_found)
}

async fn show(
    State(state): State<crate::http::State>,
    caller: Caller,
    Path((vhost, name)): Path<(String, String)>,
) -> Result<Json<Value>, ApiError> {
    let q = find(&state, &caller, &vhost, &name)?;
    let ctx = Ctx::new(&state, &[vhost]);
    Ok(Json(render(&q, &q.stats(), &ctx)))
}

#[derive(Deserialize)]
struct DeclareBody {
    #[serde(default = "yes", deserialize_with = "super::lenient_bool")]
    durable: bool,
    #[serde(default, deserialize_with = "super::lenient_bool")]
    auto_delete: bool,
    #[serde(default)]
    arguments: Option<serde_json::Map<String, Value>>,
    /// RabbitMQ's node placement: accepted, ignored.
    #[serde(default)]
    #[allow(dead_code)]
    node: Option<Value>,
    /// Exclusive queues need a connection: refused.
    #[serde(default, deserialize_with = "super::lenient_opt_bool")]
    exclusive: Option<bool>,
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
    if b.exclusive == Some(true) {
        return Err(ApiError::bad_request(
            "an exclusive queue needs a connection to own it",
        ));
    }
    if name.is_empty() {
        return Err(ApiError::bad_request("a queue needs a name"));
    }
    let mut c = client(&state, &caller, &vhost)?;
    let existed = c.queue_exists(&name);
    let (_, wait) = c.declare_queue(QueueDeclare {
        name,
        passive: false,
        durable: b.durable,
        exclusive: false,
        auto_delete: b.auto_delete,
        arguments: b.arguments.map(Value::Object).unwrap_or(json!({})),
        connection: c.id(),
    })?;
    drop(c);
    durable(&state, wait).await?;
    Ok(super::created(!existed))
}

#[derive(Deserialize, Default)]
struct DeleteQuery {
    #[serde(rename = "if-unused", default)]
    if_unused: Option<String>,
    #[serde(rename = "if-empty", default)]
    if_empty: Option<String>,
}

async fn delete(
    State(state): State<crate::http::State>,
    caller: Caller,
    Path((vhost, name)): Path<(String, String)>,
    Query(dq): Query<DeleteQuery>,
) -> Result<StatusCode, ApiError> {
    find(&state, &caller, &vhost, &name)?;
    let mut c = client(&state, &caller, &vhost)?;
    // Another connection's exclusive queue too (RabbitMQ's management API
    // deletes them), as its owner would, after the configure check.
    let (_, wait) = c.admin_delete_queue(
        &name,
        dq.if_unused.as_deref() == Some("true"),
        dq.if_empty.as_deref() == Some("true"),
    )?;
    drop(c);
    durable(&state, wait).await?;
    state.shared.request_trim();
    Ok(StatusCode::NO_CONTENT)
}

async fn purge(
    State(state): State<crate::http::State>,
    caller: Caller,
    Path((vhost, name)): Path<(String, String)>,
) -> Result<StatusCode, ApiError> {
    find(&state, &caller, &vhost, &name)?;
    let mut c = client(&state, &caller, &vhost)?;
    // Another connection's exclusive queue too, after the read check.
    c.admin_purge_queue(&name)?;
    state.shared.request_trim();
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Deserialize)]
struct GetBody {
    #[serde(deserialize_with = "super::lenient_i64")]
    count: i64,
    ackmode: String,
    #[serde(default = "auto")]
    encoding: String,
    #[serde(default)]
    truncate: Option<Value>,
    /// Accepted for compatibility (older clients send it), ignored.
    #[serde(default)]
    #[allow(dead_code)]
    requeue: Option<Value>,
}

fn auto() -> String {
    "auto".into()
}

/// The most messages one get takes.
const MAX_GET: u32 = 10_000;
/// A get stops taking messages once the payloads it took reach this many
/// bytes (the answer is built in memory; `count` alone does not bound it).
const MAX_GET_BYTES: usize = 16 << 20;

async fn get_messages(
    State(state): State<crate::http::State>,
    caller: Caller,
    Path((vhost, name)): Path<(String, String)>,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    let b: GetBody = parse_body(&body)?;
    let settle = match b.ackmode.as_str() {
        "ack_requeue_true" | "reject_requeue_true" => Settle::Requeue,
        "ack_requeue_false" => Settle::Ack,
        "reject_requeue_false" => Settle::Drop,
        other => {
            return Err(ApiError::bad_request(format!(
                "invalid ackmode '{other}': ack_requeue_true, ack_requeue_false, reject_requeue_true or reject_requeue_false"
            )))
        }
    };
    if b.encoding != "auto" && b.encoding != "base64" {
        return Err(ApiError::bad_request(format!(
            "invalid encoding '{}': auto or base64",
            b.encoding
        )));
    }
    if !(0..=i64::from(MAX_GET)).contains(&b.count) {
        return Err(ApiError::bad_request(format!("count is at most {MAX_GET}")));
    }
    let truncate = match &b.truncate {
        None | Some(Value::Null) => None,
        Some(v) => Some(
            v.as_u64()
                .or_else(|| v.as_str().and_then(|s| s.parse().ok()))
                .ok_or_else(|| ApiError::bad_request("truncate is a number of bytes"))?
                as usize,
        ),
    };
    find(&state, &caller, &vhost, &name)?;
    let mut c = client(&state, &caller, &vhost)?;
    let codecs = engine(&state).codecs();
    let now = std::time::Instant::now();
    let mut out = Vec::new();
    let mut taken_bytes = 0usize;
    for tag in 1..=b.count as u64 {
        if taken_bytes >= MAX_GET_BYTES {
            break;
        }
        let got = c
            .get(&name, GetAck::Lease { scope: 1, tag, now })
            .map_err(|e| match e {
                weir_engine::ClientError::Engine(e) => ApiError::from(e),
                other => ApiError::internal(other.to_string()),
            })?;
        let Some(got) = got else { break };
        let m = &got.message;
        let props = codecs
            .decode(m.header_format, &m.properties)
            .map(|p| properties_json(&p))
            .unwrap_or_else(|_| json!({}));
        let mut body = &m.body[..];
        if let Some(t) = truncate {
            body = &body[..body.len().min(t)];
        }
        taken_bytes += body.len();
        let (payload, enc) = match (b.encoding.as_str(), std::str::from_utf8(body)) {
            ("auto", Ok(s)) => (s.to_string(), "string"),
            _ => (
                base64::engine::general_purpose::STANDARD.encode(body),
                "base64",
            ),
        };
        out.push(json!({
            "payload_bytes": m.body.len(),
            "redelivered": got.redelivered,
            "exchange": String::from_utf8_lossy(&m.exchange),
            "routing_key": String::from_utf8_lossy(&m.routing_key),
            "message_count": got.remaining,
            "properties": props,
            "payload": payload,
            "payload_encoding": enc,
        }));
    }
    if !out.is_empty() {
        c.settle(1, 0, true, settle)
            .map_err(|e| ApiError::internal(e.to_string()))?;
    }
    c.commit();
    Ok(Json(Value::Array(out)))
}

/// A message's properties in RabbitMQ's JSON shape.
pub(crate) fn properties_json(p: &weir_engine::properties::Properties) -> Value {
    let mut m = serde_json::Map::new();
    let mut put = |k: &str, v: Value| {
        m.insert(k.to_string(), v);
    };
    if let Some(v) = &p.content_type {
        put("content_type", json!(v));
    }
    if let Some(v) = &p.content_encoding {
        put("content_encoding", json!(v));
    }
    if let Some(v) = &p.headers {
        put("headers", v.to_json());
    }
    if let Some(v) = p.delivery_mode {
        let n = match v {
            weir_engine::properties::DeliveryMode::Transient => 1,
            weir_engine::properties::DeliveryMode::Persistent => 2,
        };
        put("delivery_mode", json!(n));
    }
    if let Some(v) = p.priority {
        put("priority", json!(v));
    }
    if let Some(v) = &p.correlation_id {
        put("correlation_id", json!(String::from_utf8_lossy(v)));
    }
    if let Some(v) = &p.reply_to {
        put("reply_to", json!(v));
    }
    if let Some(v) = p.ttl_ms {
        put("expiration", json!(v.to_string()));
    }
    if let Some(v) = &p.message_id {
        put("message_id", json!(v));
    }
    if let Some(v) = p.timestamp {
        put("timestamp", json!(v));
    }
    if let Some(v) = &p.kind {
        put("type", json!(v));
    }
    if let Some(v) = &p.user_id {
        put("user_id", json!(v));
    }
    if let Some(v) = &p.app_id {
        put("app_id", json!(v));
    }
    Value::Object(m)
}

async fn bindings(
    State(state): State<crate::http::State>,
    caller: Caller,
    Path((vhost, name)): Path<(String, String)>,
) -> Result<Json<Value>, ApiError> {
    let q = find(&state, &caller, &vhost, &name)?;
    let t = engine(&state)
        .tenant(&vhost)
        .ok_or_else(ApiError::not_found)?;
    let mut out = vec![super::bindings::default_binding(&vhost, q.name())];
    out.extend(
        super::bindings::all(&t)
            .into_iter()
            .filter(|b| {
                b.destination_kind == weir_engine::meta::DestinationKind::Queue
                    && b.destination == name
            })
            .map(|b| super::bindings::render(&vhost, &b)),
    );
    Ok(Json(Value::Array(out)))
}

/// Weir: the delivery attempts of a queue's ready messages (max and
/// histogram), without the rest of the queue.
async fn attempts(
    State(state): State<crate::http::State>,
    caller: Caller,
    Path((vhost, name)): Path<(String, String)>,
) -> Result<Json<Value>, ApiError> {
    let q = find(&state, &caller, &vhost, &name)?;
    let s = q.stats();
    let ctx = Ctx::new(&state, &[vhost]);
    let v = render(&q, &s, &ctx);
    Ok(Json(json!({
        "name": q.name(),
        "vhost": &*q.tenant,
        "messages_ready": s.ready,
        "messages_unacknowledged": s.leased,
        "redeliver": s.counters.redelivered,
        "delivery_attempts": v["delivery_attempts"].clone(),
    })))
}

/// Messages requeue-dead-letters moves per batch (one store barrier each).
const REQUEUE_BATCH: u64 = 1_000;

/// Weir: moves every ready message of a dead-letter queue back to the
/// queue it was dead-lettered from (the first `x-death` entry's `queue`),
/// by publishing a copy to that queue through the default exchange and
/// acknowledging the original. Messages without `x-death`, or whose source
/// queue is gone, stay. Answers how many moved and how many stayed.
async fn requeue_dead_letters(
    State(state): State<crate::http::State>,
    caller: Caller,
    Path((vhost, name)): Path<(String, String)>,
) -> Result<Json<Value>, ApiError> {
    let q = find(&state, &caller, &vhost, &name)?;
    let mut c = client(&state, &caller, &vhost)?;
    let now = std::time::Instant::now();
    let limit = q.message_count();
    let (mut moved, mut kept) = (0u64, 0u64);
    // Kept messages stay leased to the end (so no batch takes them again)
    // and go back at their places then.
    let mut keep_tags = Vec::new();
    let mut tag = 0;
    // In batches: each batch's copies are durable before its originals are
    // acknowledged, and the runtime thread is given back between batches
    // (a dead-letter queue of millions must not hold it for seconds).
    while tag < limit {
        // Each batch writes copies: not while a resource alarm holds every
        // publisher (what moved so far stays moved).
        let alarms = *state.shared.alarms.borrow();
        if alarms.any() {
            for t in keep_tags {
                c.settle(1, t, false, Settle::Requeue)
                    .map_err(|e| ApiError::internal(e.to_string()))?;
            }
            c.commit();
            return Err(ApiError::new(
                axum::http::StatusCode::SERVICE_UNAVAILABLE,
                "service_unavailable",
                format!(
                    "{} after {moved} messages moved",
                    crate::tenant_gate::Refusal::Alarm(alarms.reason())
                ),
            ));
        }
        let end = (tag + REQUEUE_BATCH).min(limit);
        let mut move_tags = Vec::new();
        let mut barrier = false;
        let mut drained = false;
        while tag < end {
            tag += 1;
            let got = c
                .get(&name, GetAck::Lease { scope: 1, tag, now })
                .map_err(|e| ApiError::internal(e.to_string()))?;
            let Some(got) = got else {
                drained = true;
                break;
            };
            match c.requeue_dead_letter(&name, &got.message)? {
                DeadLetterMove::Moved { needs_barrier } => {
                    barrier |= needs_barrier;
                    move_tags.push(tag);
                    moved += 1;
                }
                DeadLetterMove::Kept => {
                    keep_tags.push(tag);
                    kept += 1;
                }
            }
        }
        // The copies are durable before the originals are acknowledged.
        if barrier {
            let (tx, rx) = tokio::sync::oneshot::channel();
            c.durability_barrier(Box::new(move |r| {
                let _ = tx.send(r);
            }))
            .map_err(|e| ApiError::internal(e.to_string()))?;
            c.commit();
            match rx.await {
                Ok(Ok(())) => {}
                _ => {
                    let done = moved - move_tags.len() as u64;
                    return Err(ApiError::internal(format!(
                        "store failed after {done} messages moved; the rest stay where they are"
                    )));
                }
            }
        }
        for t in move_tags {
            c.settle(1, t, false, Settle::Ack)
                .map_err(|e| ApiError::internal(e.to_string()))?;
        }
        c.commit();
        if drained {
            break;
        }
        tokio::task::yield_now().await;
    }
    for t in keep_tags {
        c.settle(1, t, false, Settle::Requeue)
            .map_err(|e| ApiError::internal(e.to_string()))?;
    }
    c.commit();
    Ok(Json(json!({ "moved": moved, "kept": kept })))
}
