//! The engine's per-client interface: what every protocol session (AMQP
//! today; MQTT, the native protocol and HTTP later) calls to publish,
//! subscribe, take deliveries and settle them.
//!
//! A [`Client`] belongs to one connection's task and is used from it alone
//! (`&mut self`); partitions on other tasks reach it only through its
//! [`ConnHandle`] outbox. It owns what used to live in the AMQP session:
//!
//! * publishing: route, allocate an id, append the store record
//!   ([`Op::Publish`] for durable copies; deep transient ones go to the
//!   store's spill), enqueue, and settle in the store what a deleted
//!   partition refused;
//! * leases, per *scope* (an AMQP channel; one per MQTT session): recorded
//!   when a delivery is written, settled by tag, requeued when the scope or
//!   the client closes, expired by a time the caller passes;
//! * the batch: settles gathered and appended once per [`Client::commit`],
//!   then the partitions whose consumers got credit back dispatch again.
//!
//! A client is **sealed**: it is the only door a session has to its tenant,
//! and every call through it is checked against the principal's
//! permissions (RabbitMQ's table, see `definitions.rs`). There is no way
//! from a client to the [`Tenant`] itself: retained messages and session
//! state (`state.rs`), a queue's bindings, existence checks and the
//! management API's operations on other connections' queues and dead
//! letters (`admin.rs`) each have their own checked call.
//!
//! Ordering rules kept here so no protocol has to know them: a settle is
//! appended after its publish record (publishes are appended at once,
//! settles at commit); entries refused by a deleted partition are settled
//! in the store; a read-back retries while compaction moves the record.

use crate::consumer::{ConnHandle, Consumer, Credit, Delivery, Notice, Scope, NO_ACK_WINDOW};
use crate::error::{ClientError, EngineError, Result};
use crate::lease::{Lease, Leases, Settle};
use crate::message::{Entry, Message};
use crate::meta::DestinationKind;
use crate::permissions::{is_topic, Authz, Permission, Resource};
use crate::properties::Value;
use crate::queue::{AttachError, Enqueued, Partition, Queue, Return, HOT_ENTRIES};
use crate::reply_to::{Reply, ReplyBox, REPLY_TO, REPLY_TO_PREFIX};
use crate::tenant::{QueueDeclare, QueueDeclared, RouteInput, Routed};
use crate::DurableWait;
use crate::{Engine, Tenant};
use bytes::Bytes;
use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use weir_backend::{
    Location, MessageAttrs, MessageData, MessageId, MessageRef, Op, PartitionId, ShareTag, Store,
    StoreError, Waiter,
};

mod admin;
mod definitions;
mod deliver;
mod durable;
mod publish;
mod settle;
mod state;
mod stream;

pub use admin::DeadLetterMove;

/// The result of a publish.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Published {
    /// No queue matched (nothing stored, no id allocated).
    Unroutable,
    /// Enqueued in every matching queue, unless `refused`.
    Routed {
        /// A durable copy was appended: the publisher's confirmation must
        /// wait for a [`Client::durability_barrier`].
        needs_barrier: bool,
        /// A queue at its length limit with `x-overflow: reject-publish[-dlx]`
        /// refused it: the publisher's confirmation is negative (the other
        /// queues did take it, as in RabbitMQ).
        refused: bool,
    },
    /// The store is out of space: nothing was enqueued.
    NoSpace,
}

/// How a subscription takes deliveries.
#[derive(Debug, Clone, Default)]
pub struct SubscribeOptions {
    /// The scope it lives in (its leases and its flow flag are the scope's).
    pub scope: Scope,
    /// The tag the client knows it by; unique within the scope.
    pub tag: Bytes,
    /// The only consumer of its queue.
    pub exclusive: bool,
    /// Deliveries are settled when written (no leases).
    pub no_ack: bool,
    /// Unacknowledged deliveries it may hold (0 = no limit).
    pub prefetch_count: u32,
    /// Unacknowledged bytes it may hold (0 = no limit).
    pub prefetch_bytes: u32,
    /// Consumer priority (AMQP `x-priority`, default 0): the queue offers
    /// each message to its highest-priority consumers that can take it,
    /// round robin among equals; lower ones get messages only while every
    /// higher one is blocked. Ignored by single-active-consumer queues.
    pub priority: i32,
}

/// How a [`Client::get`] settles what it takes.
#[derive(Debug, Clone, Copy)]
pub enum GetAck {
    /// Settled at once.
    Auto,
    /// Leased under `tag` in `scope`, written at `now`.
    Lease {
        /// The scope.
        scope: Scope,
        /// The delivery tag.
        tag: u64,
        /// The time it is written.
        now: Instant,
    },
}

/// A message taken by [`Client::get`].
#[derive(Debug)]
pub struct Got {
    /// The message.
    pub message: Arc<Message>,
    /// Delivered before (or possibly before a restart).
    pub redelivered: bool,
    /// Ready messages left in the queue.
    pub remaining: u64,
}

/// Where a published message's copy for one partition is kept.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kept {
    /// In the store, durably (a persistent message in a durable queue).
    Stored,
    /// In the store as a page record: transient, but too deep in its queue
    /// to stay in memory.
    Paged,
    /// In memory only.
    Memory,
}

/// Why a queue did not take a published message (for its receipt).
#[derive(Clone, Copy)]
enum Gone {
    /// Deleted after routing.
    Deleted,
    /// Taken, or refused by a length limit.
    Other,
}

/// A consumer as its client knows it.
struct Subscription {
    consumer: Arc<Consumer>,
    queue: Arc<Queue>,
}

/// The state of one scope.
struct ScopeState {
    leases: Leases,
    /// Subscriptions by tag.
    subs: HashMap<Bytes, Subscription>,
    /// Window shared by the scope's acknowledging consumers (AMQP's global
    /// qos); unlimited until set.
    window: Arc<Credit>,
    /// False pauses the scope's deliveries (channel.flow).
    flow: Arc<AtomicBool>,
    /// The scope's direct reply-to consumer, if any.
    reply: Option<Arc<ReplyBox>>,
}

impl Default for ScopeState {
    fn default() -> Self {
        ScopeState {
            leases: Leases::default(),
            subs: HashMap::new(),
            window: Credit::new(0, 0),
            flow: Arc::new(AtomicBool::new(true)),
            reply: None,
        }
    }
}

/// Scopes are small integers looked up once per delivery: a multiplicative
/// hash is enough and cheaper than SipHash.
#[derive(Default)]
struct ScopeHasher(u64);

impl Hasher for ScopeHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(*b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }
    fn write_u32(&mut self, n: u32) {
        self.0 = u64::from(n).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

type ScopeMap<V> = HashMap<Scope, V, BuildHasherDefault<ScopeHasher>>;

/// One client of the engine: a connection of some protocol, authenticated
/// as `principal`, working in one tenant.
pub struct Client {
    store: Arc<dyn Store>,
    tenant: Arc<Tenant>,
    principal: Arc<str>,
    handle: Arc<ConnHandle>,
    scopes: ScopeMap<ScopeState>,
    /// Deliveries drained from the outbox and not yet handed out.
    pending: VecDeque<Delivery>,
    /// Reads of cold deliveries in flight (`readback.rs`).
    reads: Vec<crate::readback::Reads>,
    /// Messages of cold deliveries read ahead, until handed out.
    prefetched: HashMap<crate::readback::ReadKey, Arc<Message>>,
    /// Wakes this connection's task when a read completes.
    read_waker: std::task::Waker,
    /// Handed out by [`Self::next_delivery`] since the last
    /// [`Self::finish_deliveries`].
    taken: u32,
    raw_notices: Vec<Notice>,
    /// Deliveries the caller could not write, put back at the batch's end.
    unsend: Vec<(Arc<Partition>, Entry)>,
    /// Settles gathered in this batch, appended to the store once.
    settles: Vec<Op<'static>>,
    /// Partitions whose consumers got credit back in this batch.
    to_dispatch: Vec<Arc<Partition>>,
    // Buffers reused by every publish: nothing allocated per message.
    route_buf: Vec<Arc<Queue>>,
    /// Per publish: (partition, how it is kept, index of its queue).
    publish_targets: Vec<(Arc<Partition>, Kept, usize)>,
    /// Per publish: the stored partitions, then the paged ones.
    publish_durable: Vec<PartitionId>,
    locs: Vec<Location>,
    closed: bool,
    /// The principal's own limits (`[[quota.users]]`), if any.
    user_quota: Option<Arc<weir_quota::TenantQuota>>,
    /// Header codecs (headers the engine adds, e.g. `x-delivery-count`).
    codecs: Arc<crate::properties::HeaderCodecs>,
    /// Stream subscriptions' cursors (`crate::stream::reader`).
    streams: Vec<crate::stream::reader::StreamSub>,
    /// The principal's permissions in the tenant, with cached decisions.
    authz: Authz,
    /// The tenant, to the store's fairness.
    share: ShareTag,
    /// Tickets of this client's appends a durability barrier waits for.
    unconfirmed: durable::Unconfirmed,
    /// The store said the tenant is over its share of the writer since
    /// [`Self::take_store_pressure`] was last asked.
    over_share: bool,
    /// Scopes with a direct reply-to consumer (a fast check per batch).
    reply_scopes: u32,
    /// It counts toward the connection limits (not a management client).
    counted: bool,
    /// The principal has RabbitMQ's `impersonator` tag: its publishes may
    /// carry another `user_id`.
    impersonator: bool,
    /// The prefix of this client's protocol session's state keys, once
    /// [`Self::set_client_id`] named the session: the only session state
    /// it reaches.
    session_prefix: Option<String>,
}

impl Client {
    /// Opens a client of `tenant` for `principal`, with a fresh connection
    /// id. Refused ([`EngineError::AccessRefused`], RabbitMQ's "access to
    /// vhost 'b' refused for user 'u'") when the principal has no
    /// permissions there; a missing tenant is `NotFound` (RabbitMQ also
    /// tells a missing vhost apart).
    pub fn open(engine: &Arc<Engine>, tenant: &str, principal: &str) -> Result<Client> {
        Self::open_with(engine, tenant, principal, true)
    }

    /// Opens a client for one management operation (the HTTP API's
    /// declare, purge, publish, get): permissions are checked as for
    /// [`Client::open`], but it is not a client connection, so it does not
    /// count toward the tenant's or user's connection limits (an operator
    /// must be able to purge a tenant that is at its limit).
    pub fn open_management(engine: &Arc<Engine>, tenant: &str, principal: &str) -> Result<Client> {
        Self::open_with(engine, tenant, principal, false)
    }

    fn open_with(
        engine: &Arc<Engine>,
        tenant: &str,
        principal: &str,
        counted: bool,
    ) -> Result<Client> {
        let t = engine
            .tenant(tenant)
            .ok_or_else(|| EngineError::NotFound(format!("no vhost '{tenant}'")))?;
        let principal: Arc<str> = principal.into();
        let authz = Authz::open(engine.permissions().clone(), principal.clone(), tenant)
            .map_err(EngineError::AccessRefused)?;
        let user_quota = engine.user_quotas.get(&principal);
        if counted {
            // Given back in `close` (`closed` makes that happen once).
            t.quota().add_connection(tenant, &principal)?;
            if let Some(u) = &user_quota {
                if let Err(e) = u.add_user_connection(&principal) {
                    t.quota().remove_connection();
                    return Err(e.into());
                }
            }
        }
        let handle = ConnHandle::new(engine.next_connection_id());
        let read_waker =
            std::task::Waker::from(Arc::new(crate::readback::WakeConn(handle.clone())));
        Ok(Client {
            counted,
            authz,
            share: ShareTag(t.quota().tag()),
            unconfirmed: Default::default(),
            over_share: false,
            store: engine.store().clone(),
            tenant: t,
            principal,
            handle,
            codecs: engine.codecs(),
            streams: Vec::new(),
            scopes: ScopeMap::default(),
            pending: VecDeque::new(),
            reads: Vec::new(),
            prefetched: HashMap::new(),
            read_waker,
            taken: 0,
            raw_notices: Vec::new(),
            unsend: Vec::new(),
            settles: Vec::new(),
            to_dispatch: Vec::new(),
            route_buf: Vec::new(),
            publish_targets: Vec::new(),
            publish_durable: Vec::new(),
            locs: Vec::with_capacity(1),
            closed: false,
            user_quota,
            impersonator: false,
            reply_scopes: 0,
            session_prefix: None,
        })
    }

    /// The connection id (owner of exclusive queues).
    pub fn id(&self) -> u64 {
        self.handle.id
    }

    /// The name of the tenant it works in (for messages and metrics; the
    /// tenant itself is reached only through this client's checked calls).
    pub fn tenant_name(&self) -> &Arc<str> {
        &self.tenant.name
    }

    /// The tenant's limits and usage (`[[tenants]]` quotas): what a
    /// session's flow gate watches. Read-only use; it grants nothing.
    pub fn tenant_quota(&self) -> &Arc<weir_quota::TenantQuota> {
        self.tenant.quota()
    }

    /// The engine's clock: what a session reads, once per batch, for the
    /// times it passes in (lease times, a publish's expiry).
    pub fn clock(&self) -> &crate::clock::SharedClock {
        self.tenant.clock()
    }

    /// Refuses a message of `size` bytes over the tenant's
    /// `max-message-size` (RabbitMQ's 406 text); one atomic load.
    pub fn check_message_size(&self, size: u64) -> Result<()> {
        self.tenant.quota().check_message_size(size)?;
        if let Some(u) = &self.user_quota {
            u.check_message_size(size)?;
        }
        Ok(())
    }

    /// The channels (protocol sub-sessions) this connection may have open
    /// at once: the lower of its tenant's and its user's
    /// `max-channels-per-connection`, if any.
    pub fn max_channels(&self) -> Option<u32> {
        let user = self
            .user_quota
            .as_ref()
            .and_then(|u| u.limits().max_channels_per_connection);
        match (
            self.tenant.quota().limits().max_channels_per_connection,
            user,
        ) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// The principal's own limits (`[[quota.users]]`), if any: its publish
    /// rate, for the session.
    pub fn user_quota(&self) -> Option<&Arc<weir_quota::TenantQuota>> {
        self.user_quota.as_ref()
    }

    /// Who it is authenticated as.
    pub fn principal(&self) -> &str {
        &self.principal
    }

    /// The outbox partitions push deliveries to; await
    /// [`ConnHandle::notified`] on it to learn that there is something to
    /// [`Self::drain`].
    pub fn handle(&self) -> &Arc<ConnHandle> {
        &self.handle
    }

    /// A queue by name, as this client sees it (another connection's
    /// exclusive queue is locked).
    pub fn queue(&self, name: &str) -> Result<Arc<Queue>> {
        self.tenant.queue(name, self.handle.id)
    }

    fn scope_mut(&mut self, scope: Scope) -> &mut ScopeState {
        self.scopes.entry(scope).or_default()
    }

    // ----- closing -----

    /// A scope closed (an AMQP channel): its subscriptions are cancelled and
    /// its leases return to their queues, marked redelivered.
    pub fn release_scope(&mut self, scope: Scope) {
        let Some(mut st) = self.scopes.remove(&scope) else {
            return;
        };
        if let Some(b) = st.reply.take() {
            // Replies to it from now on are unroutable; those waiting go.
            self.tenant.replies.close(&b);
            self.reply_scopes -= 1;
        }
        for (_, sub) in st.subs.drain() {
            self.tenant.detach(&sub.queue, &sub.consumer);
        }
        let leases = st.leases.take_all();
        self.settle_many(leases, Settle::Requeue, Return::Released);
    }

    /// The connection is gone: every scope is released, deliveries not yet
    /// written go back, its exclusive queues are deleted and the batch is
    /// committed. Idempotent; dropping a client closes it.
    pub fn close(&mut self) {
        if self.closed {
            return;
        }
        self.closed = true;
        self.handle.close();
        self.finish_deliveries();
        let scopes: Vec<Scope> = self.scopes.keys().copied().collect();
        for s in scopes {
            self.release_scope(s);
        }
        self.handle
            .drain_into(&mut self.pending, &mut self.raw_notices);
        self.raw_notices.clear();
        self.reads.clear();
        self.prefetched.clear();
        self.streams.clear();
        while let Some(d) = self.pending.pop_front() {
            self.handle.unsent_done(1);
            d.consumer.release(d.entry.size);
            if d.partition.stream.is_some() {
                continue;
            }
            let refused = d.partition.unsend(std::iter::once(d.entry));
            self.settle_refused(&d.partition, refused);
        }
        self.tenant.connection_closed(self.handle.id);
        self.commit();
        if self.counted {
            self.tenant.quota().remove_connection();
            if let Some(u) = &self.user_quota {
                u.remove_connection();
            }
        }
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        self.close();
    }
}

fn dedup_partitions(v: &mut Vec<Arc<Partition>>) {
    if v.len() < 2 {
        return;
    }
    let mut out: Vec<Arc<Partition>> = Vec::with_capacity(v.len());
    for p in v.drain(..) {
        if !out.iter().any(|x| Arc::ptr_eq(x, &p)) {
            out.push(p);
        }
    }
    *v = out;
}
