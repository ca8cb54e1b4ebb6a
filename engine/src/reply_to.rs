//! RabbitMQ's direct reply-to: RPC replies routed straight to the
//! requesting client's scope (an AMQP channel), without a queue.
//!
//! A client scope consumes the pseudo-queue [`REPLY_TO`] (no-ack only);
//! that gives it a reply box with an unguessable key. A request published
//! from that scope with `reply-to: amq.rabbitmq.reply-to` has it rewritten
//! (by the protocol session) to [`REPLY_TO_PREFIX`]`<key>`; a publish to
//! the default exchange with that routing key, from any client of the
//! tenant, is pushed into the box and the owning connection is woken.
//! Nothing is stored: as in RabbitMQ, a reply whose scope is gone (or whose
//! key is unknown) is dropped, and a mandatory publish of it is returned.
//!
//! Bounds: one box per scope; a box holds at most [`MAX_PENDING_REPLIES`]
//! replies not yet written to the client (more are dropped and counted, the
//! publisher is not told: RabbitMQ drops replies the same way when the
//! requester's channel is gone). The tenant's table of boxes is as large as
//! the number of consuming scopes, each removed when its scope cancels or
//! closes.

use crate::consumer::{ConnHandle, Scope};
use crate::message::Message;
use bytes::Bytes;
use parking_lot::Mutex;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// The pseudo-queue a client consumes to receive replies, and the value
/// of `reply-to` a request carries to ask for one.
pub const REPLY_TO: &str = "amq.rabbitmq.reply-to";

/// The routing key of a reply: this prefix and the box's key.
pub const REPLY_TO_PREFIX: &str = "amq.rabbitmq.reply-to.";

/// Replies one box holds before the client writes them; beyond, dropped.
pub const MAX_PENDING_REPLIES: usize = 2048;

/// A reply on its way to the client.
pub struct Reply {
    /// The scope (AMQP channel) that consumes the replies.
    pub scope: Scope,
    /// The reply consumer's tag.
    pub consumer_tag: Bytes,
    /// The routing key it was published with (the full reply address).
    pub routing_key: Bytes,
    /// The message.
    pub message: Arc<Message>,
}

/// One scope's reply consumer.
pub(crate) struct ReplyBox {
    pub(crate) key: String,
    pub(crate) scope: Scope,
    pub(crate) tag: Bytes,
    conn: Arc<ConnHandle>,
    pending: Mutex<VecDeque<Arc<Message>>>,
}

impl ReplyBox {
    /// The address requests carry in `reply-to`.
    pub(crate) fn address(&self) -> String {
        format!("{REPLY_TO_PREFIX}{}", self.key)
    }

    /// Takes the oldest reply not yet written.
    pub(crate) fn pop(&self) -> Option<Arc<Message>> {
        self.pending.lock().pop_front()
    }
}

/// A tenant's reply boxes by key.
#[derive(Default)]
pub struct ReplyRoutes {
    boxes: Mutex<HashMap<String, Arc<ReplyBox>>>,
    /// Replies dropped: a full box, or a box gone between lookup and push.
    dropped: AtomicU64,
}

impl ReplyRoutes {
    /// Opens a box for `scope` of connection `conn`, consumer tag `tag`.
    pub(crate) fn open(&self, conn: Arc<ConnHandle>, scope: Scope, tag: Bytes) -> Arc<ReplyBox> {
        let b = Arc::new(ReplyBox {
            key: new_key(),
            scope,
            tag,
            conn,
            pending: Mutex::new(VecDeque::new()),
        });
        self.boxes.lock().insert(b.key.clone(), b.clone());
        b
    }

    /// Removes a box: later replies to it are unroutable.
    pub(crate) fn close(&self, b: &ReplyBox) {
        self.boxes.lock().remove(&b.key);
    }

    /// Whether `address` (a routing key) names an open box.
    pub fn exists(&self, address: &str) -> bool {
        address
            .strip_prefix(REPLY_TO_PREFIX)
            .is_some_and(|k| self.boxes.lock().contains_key(k))
    }

    /// Delivers a reply published with routing key `address`; false when
    /// no box has that address (the publish is unroutable).
    pub(crate) fn deliver(&self, address: &str, message: Arc<Message>) -> bool {
        let Some(key) = address.strip_prefix(REPLY_TO_PREFIX) else {
            return false;
        };
        let Some(b) = self.boxes.lock().get(key).cloned() else {
            return false;
        };
        if b.conn.is_closed() {
            return false;
        }
        {
            let mut p = b.pending.lock();
            if p.len() >= MAX_PENDING_REPLIES {
                self.dropped.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(key, "reply box full: reply dropped");
                return true;
            }
            p.push_back(message);
        }
        b.conn.wake();
        true
    }

    /// Replies dropped because their box was full.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    /// Number of open boxes.
    pub fn len(&self) -> usize {
        self.boxes.lock().len()
    }

    /// Whether no box is open.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// 24 characters of a URL-safe alphabet from 144 random bits: a reply
/// address cannot be guessed by another client.
fn new_key() -> String {
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut raw = [0u8; 24];
    if getrandom::fill(&mut raw).is_err() {
        // No OS randomness (not expected on a running broker): fall back on
        // the generated-name source, unique per process.
        return crate::tenant::generated_name()["amq.gen-".len()..].to_string();
    }
    raw.iter()
        .map(|b| ALPHABET[(b & 63) as usize] as char)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::properties::HeaderFormat;

    fn message(body: &'static str) -> Arc<Message> {
        Arc::new(Message {
            id: 1,
            exchange: Bytes::new(),
            routing_key: Bytes::new(),
            properties: Bytes::new(),
            body: Bytes::from_static(body.as_bytes()),
            header_format: HeaderFormat::new(1),
            persistent: false,
            priority: 0,
            ttl_ms: None,
        })
    }

    #[test]
    fn replies_reach_an_open_box_only_and_are_bounded() {
        let routes = ReplyRoutes::default();
        let b = routes.open(ConnHandle::new(1), 3, Bytes::from_static(b"t"));
        let addr = b.address();
        assert!(addr.starts_with(REPLY_TO_PREFIX) && addr.len() == REPLY_TO_PREFIX.len() + 24);
        assert!(routes.exists(&addr));
        assert!(routes.deliver(&addr, message("a")));
        assert!(!routes.deliver("amq.rabbitmq.reply-to.nope", message("b")));
        assert!(!routes.deliver("other", message("c")));
        assert_eq!(
            b.pop().map(|m| m.body.clone()),
            Some(Bytes::from_static(b"a"))
        );
        for _ in 0..MAX_PENDING_REPLIES + 5 {
            assert!(routes.deliver(&addr, message("x")));
        }
        assert_eq!(routes.dropped(), 5);
        routes.close(&b);
        assert!(!routes.exists(&addr));
        assert!(!routes.deliver(&addr, message("d")));
        assert!(routes.is_empty());
    }

    #[test]
    fn keys_differ() {
        assert_ne!(new_key(), new_key());
    }
}
