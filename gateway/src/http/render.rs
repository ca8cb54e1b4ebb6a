//! Expensive answers (`/metrics`, unpaged listings of every queue,
//! exchange, binding or connection) rendered off the runtime's workers,
//! one at a time per kind, shared.
//!
//! A [`Gate`] per kind: a request waits (asynchronously, holding no
//! worker) for the kind's single slot, then renders on the blocking pool.
//! A request that arrived before an identical render started (same key:
//! path, query and what the caller may see) takes that answer instead of
//! rendering again. So 32 scrapers of `GET /api/queues` cost one render at
//! a time, not 32 at once on the workers that serve AMQP and MQTT, a burst
//! of identical requests costs at most two renders, and clients that never
//! read their answer all hold the same bytes.
//!
//! No answer is older than its request: a client that just changed
//! something and asks sees the change (a TTL cache would break that; the
//! [`Gate::new`] TTL exists for kinds where staleness is acceptable).

use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use parking_lot::Mutex;
use tokio::sync::Semaphore;

use super::error::ApiError;

/// The answer of a render, shared by every request served from it.
struct Rendered(Arc<Vec<u8>>);

impl AsRef<[u8]> for Rendered {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

/// The last render of a kind.
struct Last {
    key: String,
    started: Instant,
    /// Kept within the TTL; otherwise only while some answer still holds
    /// it, so a large listing is not kept after it was sent.
    strong: Option<Arc<Vec<u8>>>,
    weak: Weak<Vec<u8>>,
}

/// One kind of expensive answer (see the module doc).
pub struct Gate {
    slot: Semaphore,
    last: Mutex<Option<Last>>,
    ttl: Duration,
    /// Asked to trim the heap after a large render (see below).
    shared: Arc<crate::server::Services>,
}

/// A render this large asks for a heap trim: its JSON tree was freed on a
/// blocking-pool thread whose malloc arena would otherwise keep the pages
/// (renders on different threads then add up in RSS).
const TRIM_AFTER: usize = 1 << 20;

impl Gate {
    /// A gate whose answers are reused for `ttl` (zero: only by requests
    /// that waited while it was rendered).
    pub fn new(ttl: Duration, shared: Arc<crate::server::Services>) -> Self {
        Gate {
            slot: Semaphore::new(1),
            last: Mutex::new(None),
            ttl,
            shared,
        }
    }

    /// The answer for `key`: shared if an identical render started after
    /// this request arrived or within the TTL, else rendered by `f` on the
    /// blocking pool, one render of this kind at a time.
    pub async fn serve<F>(&self, key: String, content_type: &'static str, f: F) -> Response
    where
        F: FnOnce() -> Result<Vec<u8>, ApiError> + Send + 'static,
    {
        let arrived = Instant::now();
        let Ok(_slot) = self.slot.acquire().await else {
            return ApiError::internal("renderer closed").into_response();
        };
        if let Some(body) = self.reuse(&key, arrived) {
            return answer(content_type, body);
        }
        let started = Instant::now();
        let body = match tokio::task::spawn_blocking(f).await {
            Ok(Ok(b)) => {
                if b.len() >= TRIM_AFTER {
                    self.shared.request_trim();
                }
                Arc::new(b)
            }
            Ok(Err(e)) => return e.into_response(),
            Err(_) => return ApiError::internal("rendering failed").into_response(),
        };
        *self.last.lock() = Some(Last {
            key,
            started,
            strong: (!self.ttl.is_zero()).then(|| body.clone()),
            weak: Arc::downgrade(&body),
        });
        answer(content_type, body)
    }

    fn reuse(&self, key: &str, arrived: Instant) -> Option<Arc<Vec<u8>>> {
        let mut last = self.last.lock();
        let l = last.as_mut()?;
        let fresh = l.started >= arrived || l.started.elapsed() < self.ttl;
        if !fresh {
            // Past its TTL: do not keep it for nobody.
            l.strong = None;
        }
        if l.key != key || !fresh {
            return None;
        }
        l.weak.upgrade()
    }
}

fn answer(content_type: &'static str, body: Arc<Vec<u8>>) -> Response {
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, content_type)],
        Body::from(Bytes::from_owner(Rendered(body))),
    )
        .into_response()
}

/// The JSON of `v` (a listing), for [`Gate::serve`].
pub fn json(v: Result<serde_json::Value, ApiError>) -> Result<Vec<u8>, ApiError> {
    serde_json::to_vec(&v?).map_err(|e| ApiError::internal(format!("JSON: {e}")))
}

/// JSON's content type.
pub const JSON: &str = "application/json";

/// The gates of the HTTP listener, one per kind of expensive answer.
pub struct Gates {
    /// `/metrics`.
    pub metrics: Gate,
    /// `GET /api/queues[/{vhost}]`.
    pub queues: Gate,
    /// `GET /api/exchanges[/{vhost}]`.
    pub exchanges: Gate,
    /// `GET /api/bindings[/{vhost}]`.
    pub bindings: Gate,
    /// `GET /api/connections`, `/api/vhosts/{vhost}/connections`.
    pub connections: Gate,
}

impl Gates {
    /// The gates of one listener (no TTL: answers are never older than
    /// their request).
    pub fn new(shared: &Arc<crate::server::Services>) -> Self {
        let gate = || Gate::new(Duration::ZERO, shared.clone());
        Gates {
            metrics: gate(),
            queues: gate(),
            exchanges: gate(),
            bindings: gate(),
            connections: gate(),
        }
    }
}

/// The key of a listing: the request's path and query, and the vhosts the
/// caller sees (two callers seeing the same vhosts get the same answer).
pub fn list_key(uri: &axum::http::Uri, vhosts: &[String]) -> String {
    let mut k = uri.to_string();
    for v in vhosts {
        k.push('\n');
        k.push_str(v);
    }
    k
}
