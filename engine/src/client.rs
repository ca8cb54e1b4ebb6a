//! The engine's per-client interface: what every protocol session (AMQP
//! today; MQTT, the native protocol and HTTP later) calls to publish,
//! subscribe, take deliveries and settle them.
//!
//! A [`Client`] belongs to one connection's task and is used from it alone
//! (`&mut self`); partitions on other tasks reach it only through its
//! [`ConnHandle`] outbox. It owns what used to live in the AMQP session:
//!
//! * publishing: route, allocate an id, append the store record
//!   ([`Op::Publish`] for durable copies, [`Op::Page`] for deep transient
//!   ones), enqueue, and settle in the store what a deleted partition refused;
//! * leases, per *scope* (an AMQP channel; one per MQTT session): recorded
//!   when a delivery is written, settled by tag, requeued when the scope or
//!   the client closes, expired by a time the caller passes;
//! * the batch: settles gathered and appended once per [`Client::commit`],
//!   then the partitions whose consumers got credit back dispatch again.
//!
//! Ordering rules kept here so no protocol has to know them: a settle is
//! appended after its publish record (publishes are appended at once,
//! settles at commit); entries refused by a deleted partition are settled
//! in the store; a read-back retries while compaction moves the record.

use crate::consumer::{ConnHandle, Consumer, Credit, Delivery, Notice, Scope, NO_ACK_WINDOW};
use crate::error::{ClientError, EngineError, Result};
use crate::lease::{Lease, Leases, Settle};
use crate::message::{now_ms, Entry, Message};
use crate::meta::DestinationKind;
use crate::permissions::{is_topic, Authz, Permission, Resource};
use crate::properties::{HeaderFormat, Value};
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
    Location, MessageAttrs, MessageData, MessageId, Op, Owner, PartitionId, Store, StoreError,
    Waiter,
};

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
    /// The principal's permissions in the tenant, with cached decisions.
    authz: Authz,
    /// The tenant, to the store's fairness.
    owner: Owner,
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
        Ok(Client {
            counted,
            authz,
            owner: Owner(t.quota().tag()),
            over_share: false,
            store: engine.store().clone(),
            tenant: t,
            principal,
            handle: ConnHandle::new(engine.next_connection_id()),
            codecs: engine.codecs(),
            scopes: ScopeMap::default(),
            pending: VecDeque::new(),
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
        })
    }

    /// The connection id (owner of exclusive queues).
    pub fn id(&self) -> u64 {
        self.handle.id
    }

    /// The tenant it works in.
    pub fn tenant(&self) -> &Arc<Tenant> {
        &self.tenant
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

    // ----- publishing -----

    /// Routes and enqueues a message. `message` builds it once it is routed,
    /// given its id. Persistent copies in durable queues are appended to the
    /// store now (the confirmation waits for a barrier); transient copies
    /// into deep queues are paged to it.
    pub fn publish(
        &mut self,
        route: &RouteInput<'_>,
        message: impl FnOnce(MessageId) -> Message,
    ) -> Result<Published> {
        self.authorize_publish(route)?;
        if route.exchange.is_empty() && route.routing_key.starts_with(REPLY_TO_PREFIX) {
            // A direct reply-to reply: to the requester's box, not a queue.
            let id = self.store.allocate_ids(1);
            return Ok(
                if self
                    .tenant
                    .replies
                    .deliver(route.routing_key, Arc::new(message(id)))
                {
                    Published::Routed {
                        needs_barrier: false,
                        refused: false,
                    }
                } else {
                    Published::Unroutable
                },
            );
        }
        let mut queues = std::mem::take(&mut self.route_buf);
        queues.clear();
        let routed = self.tenant.route(route, &mut queues);
        let result = match routed {
            Err(e) => Err(e),
            Ok(_) if queues.is_empty() => Ok(Published::Unroutable),
            Ok(how) => self.enqueue_routed(route, how, &queues, message),
        };
        queues.clear();
        self.route_buf = queues;
        result
    }

    fn enqueue_routed(
        &mut self,
        route: &RouteInput<'_>,
        how: Routed,
        queues: &[Arc<Queue>],
        message: impl FnOnce(MessageId) -> Message,
    ) -> Result<Published> {
        let id = self.store.allocate_ids(1);
        let message = Arc::new(message(id));
        debug_assert_eq!(message.id, id, "a message keeps the id it was given");
        let size = message.size();
        let now = now_ms();
        // Idempotent publish: the queues that already hold the message's key
        // drop it; the others record it. Their receipts stay locked until
        // the end of this call (after the store append and the enqueue), so
        // of two publishers racing with one key exactly one enqueues.
        let mut dedup =
            crate::queue::dedup::Check::new(route.headers, &message, &self.codecs, queues, now);
        // A duplicate is confirmed like the original: after everything
        // appended so far (the original's record among it) is durable.
        let dup_barrier = dedup.as_ref().is_some_and(|d| {
            d.any_duplicate()
                && queues.iter().enumerate().any(|(i, q)| {
                    d.is_duplicate(i) && message.persistent && q.partitions[0].durable
                })
        });
        // Pick each queue's partition, and store once for all durable ones.
        let mut targets = std::mem::take(&mut self.publish_targets);
        let mut durable_parts = std::mem::take(&mut self.publish_durable);
        targets.clear();
        durable_parts.clear();
        // The queue TTL shared by every durable target, if they share one:
        // stored with the message's own, so a deadline that passes while
        // the broker is down is not extended by the restart.
        let mut shared_ttl: Option<Option<u64>> = None;
        for (qi, q) in queues.iter().enumerate() {
            if dedup.as_ref().is_some_and(|d| d.is_duplicate(qi)) {
                continue;
            }
            let part = q.partition_for_publish(route.headers);
            let kept = if message.persistent && part.durable {
                let ttl = q.message_ttl();
                shared_ttl = match shared_ttl {
                    None => Some(ttl),
                    Some(t) if t == ttl => Some(t),
                    Some(_) => Some(None),
                };
                durable_parts.push(part.id);
                Kept::Stored
            } else {
                Kept::Memory
            };
            targets.push((part.clone(), kept, qi));
        }
        if targets.is_empty() {
            // A duplicate everywhere: confirmed, nothing enqueued.
            self.publish_targets = targets;
            self.publish_durable = durable_parts;
            return Ok(Published::Routed {
                needs_barrier: dup_barrier,
                refused: false,
            });
        }
        // Transient copies (a transient message, or a non-durable queue) into
        // partitions already deeper than the in-memory window are paged to
        // the store too, after the durable ones in the same buffer, so memory
        // does not grow with queue depth. Skipped entirely on the hot path
        // (every target stored).
        let n_durable = durable_parts.len();
        if n_durable < targets.len() {
            for (part, kept, _) in &mut targets {
                if *kept == Kept::Memory && part.ready_len() >= HOT_ENTRIES as u64 {
                    *kept = Kept::Paged;
                    durable_parts.push(part.id);
                }
            }
        }
        // `x-delay` holds the message back, through an `x-delayed-message`
        // exchange or in queues declared `x-delayed` (the header is only
        // looked up then). Stored, so it keeps waiting across a restart.
        let delay_ms = if how.delayed || queues.iter().any(|q| q.delayed) {
            delay_header(route.headers)
        } else {
            0
        };
        let deliver_at_ms = if delay_ms > 0 {
            now.saturating_add(delay_ms)
        } else {
            0
        };
        // The message's own TTL counts from when it enters each queue (now,
        // or when its delay ends); stored, so the deadline holds across a
        // restart.
        let entered = now.max(deliver_at_ms);
        let expires_at_ms = message
            .ttl_ms
            .map_or(0, |t| entered.saturating_add(t).max(1));
        let stored_expiry = match shared_ttl.flatten() {
            Some(t) => {
                let at = entered.saturating_add(t).max(1);
                if expires_at_ms == 0 {
                    at
                } else {
                    at.min(expires_at_ms)
                }
            }
            None => expires_at_ms,
        };
        let data = MessageData {
            exchange: route.exchange,
            routing_key: route.routing_key,
            header_format: message.header_format.to_u8(),
            header: &message.properties,
            body: &message.body,
            attrs: MessageAttrs {
                priority: message.priority,
                expires_at_ms: stored_expiry,
                deliver_at_ms,
            },
        };
        let mut location = None;
        // Receipts of stored copies ride in the publish's batch (one writer
        // round: after a crash both or neither), except where the queue may
        // refuse the message (a length limit with reject-publish): there the
        // receipt is appended once the queue took it, since a refused
        // publish must leave no receipt (its retry is not a duplicate).
        let mut with_publish: Vec<Op<'_>> = Vec::new();
        let mut receipt_in_batch: Vec<usize> = Vec::new();
        if let Some(d) = dedup.as_ref() {
            for (_, kept, qi) in &targets {
                if *kept != Kept::Stored || queues[*qi].may_refuse_publish() {
                    continue;
                }
                if let Some((partition, key_hash, expires_at_ms)) = d.receipt(*qi) {
                    with_publish.push(Op::Receipt {
                        partition,
                        key_hash,
                        expires_at_ms,
                    });
                    receipt_in_batch.push(*qi);
                }
            }
        }
        if n_durable > 0 {
            self.locs.clear();
            let publish = Op::Publish {
                id,
                partitions: &durable_parts[..n_durable],
                data,
            };
            let res = if with_publish.is_empty() {
                self.store
                    .append_for(self.owner, &[publish], &mut self.locs, None)
            } else {
                with_publish.insert(0, publish);
                self.store
                    .append_for(self.owner, &with_publish, &mut self.locs, None)
            };
            let res = res.map(|a| self.over_share |= a.over_share);
            if let Err(e) = res {
                // Nothing enqueued: no receipt either.
                if let Some(d) = dedup.as_mut() {
                    d.undo_all();
                }
                self.publish_targets = targets;
                self.publish_durable = durable_parts;
                return match e {
                    StoreError::NoSpace => Ok(Published::NoSpace),
                    e => Err(e.into()),
                };
            }
            location = self.locs.first().copied();
            debug_assert!(
                location.is_some(),
                "store returned no location for a publish"
            );
        }
        let mut page_location = None;
        if durable_parts.len() > n_durable {
            self.locs.clear();
            // Never waited on: a restart drops it anyway. If the store cannot
            // take it (disk full), the message simply stays in memory.
            let res = self.store.append_for(
                self.owner,
                &[Op::Page {
                    id,
                    partitions: &durable_parts[n_durable..],
                    data,
                }],
                &mut self.locs,
                None,
            );
            match res {
                Ok(a) => {
                    self.over_share |= a.over_share;
                    page_location = self.locs.first().copied();
                }
                Err(e) => tracing::debug!(error = %e, "not paging a transient message"),
            }
        }
        let mut refused_any = false;
        // Receipts and cancellations appended after the enqueue.
        let mut after: Vec<Op<'static>> = Vec::new();
        let mut cancelled = false;
        for (part, kept, qi) in targets.drain(..) {
            let location = match kept {
                Kept::Stored => location,
                // None if the store could not take the page: kept in memory.
                Kept::Paged => page_location,
                Kept::Memory => None,
            };
            let delayed =
                deliver_at_ms > 0 && (how.delayed || part.queue().is_some_and(|q| q.delayed));
            let entry = Entry {
                seq: 0,
                id,
                location,
                size,
                redelivered: false,
                attempts: 0,
                priority: message.priority,
                enqueued_ms: now,
                expires_at_ms,
                message: Some(message.clone()),
            };
            let refused = if delayed {
                part.enqueue_at(entry, deliver_at_ms)
            } else {
                part.enqueue(entry)
            };
            // The queue was deleted after routing, or is full and refuses
            // publishes: the message is gone from it (its record was
            // appended above, so the settle follows it).
            let taken = matches!(refused, Enqueued::Queued);
            let gone_kind = match refused {
                Enqueued::Deleted(_) => Gone::Deleted,
                _ => Gone::Other,
            };
            let gone = match refused {
                Enqueued::Queued => None,
                Enqueued::Deleted(e) => e.location,
                Enqueued::Overflow {
                    entry,
                    dead_lettered,
                } => {
                    refused_any = true;
                    entry.location.filter(|_| !dead_lettered)
                }
            };
            if let Some(l) = gone {
                self.settles.push(Op::Settle {
                    partition: part.id,
                    id,
                    location: l,
                });
            }
            if let Some(d) = dedup.as_mut() {
                let receipt = d.receipt(qi).filter(|_| kept == Kept::Stored);
                let in_batch = receipt_in_batch.contains(&qi);
                match (taken, receipt) {
                    // Before the publisher's barrier, so its confirm
                    // covers the receipt.
                    (true, Some((partition, key_hash, expires_at_ms))) if !in_batch => {
                        after.push(Op::Receipt {
                            partition,
                            key_hash,
                            expires_at_ms,
                        })
                    }
                    (false, receipt) => {
                        // Not taken: a retry must not be dropped as a
                        // duplicate.
                        d.undo(qi);
                        // Refused although the queue had no reason to (a
                        // policy set meanwhile): the stored receipt is
                        // cancelled. A deleted queue's receipts die with it.
                        if let (Some((partition, key_hash, expires_at_ms)), true) =
                            (receipt, in_batch && !matches!(gone_kind, Gone::Deleted))
                        {
                            after.push(Op::Receipt {
                                partition: crate::queue::dedup::cancel_id(partition),
                                key_hash,
                                expires_at_ms,
                            });
                            cancelled = true;
                        }
                    }
                    _ => {}
                }
            }
        }
        if !after.is_empty() {
            self.locs.clear();
            // A cancellation wakes the writer at once (the publisher's nack
            // does not wait for the store).
            let wake: Option<Waiter> = cancelled.then(|| Box::new(|_| {}) as Waiter);
            if let Err(e) = self.store.append(&after, &mut self.locs, wake) {
                tracing::warn!(error = %e, "idempotency receipt not stored: a duplicate may be accepted after a restart");
            }
        }
        drop(dedup);
        self.publish_durable = durable_parts;
        self.publish_targets = targets;
        Ok(Published::Routed {
            needs_barrier: n_durable > 0 || dup_barrier,
            refused: refused_any,
        })
    }

    // ----- permissions, and the operations on definitions they guard -----

    /// Sets the MQTT client id `{client_id}` stands for in topic permissions.
    pub fn set_client_id(&mut self, client_id: &str) {
        self.authz.set_client_id(client_id);
    }

    /// `p` on `r` for this client's principal, or `AccessRefused` with
    /// RabbitMQ's text. Permission changes apply from the next call.
    pub fn authorize(&mut self, p: Permission, r: Resource<'_>) -> Result<()> {
        self.authz.check(p, r).map_err(EngineError::AccessRefused)
    }

    /// The publish check: write on the exchange, and topic write on the
    /// routing key for a topic exchange the principal has topic permissions
    /// on. Cached per exchange (and key) until the definitions change.
    /// [`Self::publish`] calls it; a protocol that routes later (AMQP
    /// transactions) calls it when the publish arrives.
    pub fn authorize_publish(&mut self, route: &RouteInput<'_>) -> Result<()> {
        let tenant = &self.tenant;
        self.authz
            .check_publish(route.exchange, route.routing_key, || {
                is_topic(tenant, route.exchange)
            })
            .map_err(EngineError::AccessRefused)
    }

    /// Topic read on a binding key, when `source` is a topic exchange.
    fn authorize_topic_read(&mut self, source: &str, key: &str) -> Result<()> {
        if !is_topic(&self.tenant, source) {
            return Ok(());
        }
        self.authz
            .check_topic_read(source, key)
            .map_err(EngineError::AccessRefused)
    }

    /// Tells the client the principal's tags (from its login): the
    /// `impersonator` tag lifts the `user_id` check of [`Self::check_user_id`].
    pub fn set_tags(&mut self, tags: &[String]) {
        self.impersonator = tags.iter().any(|t| t == "impersonator");
    }

    /// Checks again that the principal may use the tenant (its access may
    /// have been revoked since it connected): a connection's
    /// `update-secret` re-checks its user with this. `AccessRefused` with
    /// RabbitMQ's vhost text if not.
    pub fn recheck_access(&mut self) -> Result<()> {
        let engine = self.tenant.engine()?;
        self.authz = Authz::open(
            engine.permissions().clone(),
            self.principal.clone(),
            &self.tenant.name,
        )
        .map_err(EngineError::AccessRefused)?;
        Ok(())
    }

    /// RabbitMQ's validated user id: a published message's `user_id`
    /// property must name the connection's user, unless that user is an
    /// impersonator (406 with RabbitMQ's text otherwise).
    pub fn check_user_id(&self, user_id: &str) -> Result<()> {
        if user_id == &*self.principal || self.impersonator {
            return Ok(());
        }
        Err(EngineError::PreconditionFailed(format!(
            "user_id property set to '{user_id}' but authenticated user was '{}'",
            self.principal
        )))
    }

    /// exchange.declare: configure on the exchange (none when passive); an
    /// `alternate-exchange` also needs write on it and read on this one.
    pub fn declare_exchange(
        &mut self,
        def: crate::exchange::ExchangeDef,
        passive: bool,
    ) -> Result<Option<DurableWait>> {
        if !passive {
            self.authorize(Permission::Configure, Resource::Exchange(&def.name))?;
            if let Some(ae) = def
                .arguments
                .get("alternate-exchange")
                .and_then(serde_json::Value::as_str)
            {
                self.authorize(Permission::Write, Resource::Exchange(ae))?;
                self.authorize(Permission::Read, Resource::Exchange(&def.name))?;
            }
        }
        self.tenant.declare_exchange(def, passive)
    }

    /// exchange.delete: configure on the exchange.
    pub fn delete_exchange(&mut self, name: &str, if_unused: bool) -> Result<Option<DurableWait>> {
        self.authorize(Permission::Configure, Resource::Exchange(name))?;
        self.tenant.delete_exchange(name, if_unused)
    }

    /// queue.declare: configure on the queue (a server-named queue's name
    /// is picked first, as RabbitMQ does; none when passive); an
    /// `x-dead-letter-exchange` also needs write on it and read on the queue.
    pub fn declare_queue(
        &mut self,
        req: QueueDeclare,
    ) -> Result<(QueueDeclared, Option<DurableWait>)> {
        if req.passive && (req.name == REPLY_TO || self.tenant.replies.exists(&req.name)) {
            // RabbitMQ answers a passive declare of the reply pseudo-queue
            // (and of a live reply address) with no messages, one consumer.
            return Ok((
                QueueDeclared {
                    name: req.name,
                    messages: 0,
                    consumers: 1,
                },
                None,
            ));
        }
        let mut generated = None;
        if !req.passive {
            let name = if req.name.is_empty() {
                generated.insert(crate::tenant::generated_name()).as_str()
            } else {
                req.name.as_str()
            };
            self.authorize(Permission::Configure, Resource::Queue(name))?;
            if let Some(dlx) = req
                .arguments
                .get("x-dead-letter-exchange")
                .and_then(serde_json::Value::as_str)
            {
                self.authorize(Permission::Write, Resource::Exchange(dlx))?;
                let name = generated.as_deref().unwrap_or(&req.name);
                self.authorize(Permission::Read, Resource::Queue(name))?;
            }
        }
        self.tenant.declare_queue_as(req, generated)
    }

    /// queue.delete: configure on the queue. Returns the messages it held.
    pub fn delete_queue(
        &mut self,
        name: &str,
        if_unused: bool,
        if_empty: bool,
    ) -> Result<(u64, Option<DurableWait>)> {
        self.authorize(Permission::Configure, Resource::Queue(name))?;
        self.tenant
            .delete_queue(name, if_unused, if_empty, self.handle.id)
    }

    /// queue.purge: read on the queue. Returns the messages removed.
    pub fn purge_queue(&mut self, name: &str) -> Result<u64> {
        self.authorize(Permission::Read, Resource::Queue(name))?;
        self.tenant.purge_queue(name, self.handle.id)
    }

    /// queue.bind / exchange.bind: write on the destination, read on the
    /// source, and topic read on the key when the source is a topic exchange.
    pub fn bind(
        &mut self,
        source: &str,
        kind: DestinationKind,
        destination: &str,
        key: &str,
        arguments: serde_json::Value,
    ) -> Result<Option<DurableWait>> {
        self.authorize_binding(source, kind, destination, key)?;
        self.tenant
            .bind(source, kind, destination, key, arguments, self.handle.id)
    }

    /// queue.unbind / exchange.unbind: as [`Self::bind`].
    pub fn unbind(
        &mut self,
        source: &str,
        kind: DestinationKind,
        destination: &str,
        key: &str,
        arguments: serde_json::Value,
    ) -> Result<Option<DurableWait>> {
        self.authorize_binding(source, kind, destination, key)?;
        self.tenant
            .unbind(source, kind, destination, key, arguments, self.handle.id)
    }

    /// The checks of [`Self::bind`] alone (a protocol that creates the
    /// destination only for the binding checks first).
    pub fn authorize_binding(
        &mut self,
        source: &str,
        kind: DestinationKind,
        destination: &str,
        key: &str,
    ) -> Result<()> {
        let dest = match kind {
            DestinationKind::Queue => Resource::Queue(destination),
            DestinationKind::Exchange => Resource::Exchange(destination),
        };
        self.authorize(Permission::Write, dest)?;
        self.authorize(Permission::Read, Resource::Exchange(source))?;
        self.authorize_topic_read(source, key)
    }

    // ----- subscriptions -----

    /// Subscribes to `queue`. Exclusivity is checked and the consumer
    /// attached in one step owned by the queue, so of two exclusive
    /// subscriptions racing for one queue exactly one wins. Deliveries may
    /// be pushed to the outbox before this returns; they are only handed
    /// out by [`Self::next_delivery`], after the caller answered.
    pub fn subscribe(
        &mut self,
        queue: &str,
        opts: SubscribeOptions,
    ) -> Result<Arc<Consumer>, ClientError> {
        self.authorize(Permission::Read, Resource::Queue(queue))?;
        let q = self.queue(queue)?;
        if self.tenant.quota().max_consumers().is_some() {
            let count = self.tenant.consumer_count();
            self.tenant
                .quota()
                .check_consumer(&self.tenant.name, count)
                .map_err(EngineError::from)?;
        }
        let handle = self.handle.clone();
        let tenant = self.tenant.name.clone();
        let st = self.scope_mut(opts.scope);
        if st.subs.contains_key(&opts.tag) || st.reply.as_ref().is_some_and(|r| r.tag == opts.tag) {
            return Err(ClientError::TagInUse(
                String::from_utf8_lossy(&opts.tag).into_owned(),
            ));
        }
        let (credit, window) = if opts.no_ack {
            (Credit::new(NO_ACK_WINDOW, 0), None)
        } else {
            (
                Credit::new(opts.prefetch_count, opts.prefetch_bytes),
                Some(st.window.clone()),
            )
        };
        let consumer = Consumer::new(
            opts.tag.clone(),
            opts.scope,
            opts.no_ack,
            opts.exclusive,
            opts.priority,
            handle,
            credit,
            window,
            st.flow.clone(),
        );
        match q.attach_consumer(&consumer) {
            Ok(()) => q.touch(),
            Err(AttachError::NotFound) => {
                return Err(EngineError::NotFound(format!(
                    "no queue '{}' in vhost '{}'",
                    q.name(),
                    tenant
                ))
                .into())
            }
            Err(AttachError::Exclusive) => {
                return Err(EngineError::AccessRefused(format!(
                    "queue '{}' in vhost '{}' in exclusive use",
                    q.name(),
                    tenant
                ))
                .into())
            }
        }
        st.subs.insert(
            opts.tag,
            Subscription {
                consumer: consumer.clone(),
                queue: q,
            },
        );
        Ok(consumer)
    }

    /// Cancels the subscription `tag` of `scope`; false if there is none.
    /// Its leases stay until settled; its undelivered deliveries go back.
    pub fn unsubscribe(&mut self, scope: Scope, tag: &[u8]) -> bool {
        if let Some(st) = self.scopes.get_mut(&scope) {
            if st.reply.as_ref().is_some_and(|r| r.tag == tag) {
                if let Some(b) = st.reply.take() {
                    self.tenant.replies.close(&b);
                    self.reply_scopes -= 1;
                }
                return true;
            }
        }
        let Some(sub) = self
            .scopes
            .get_mut(&scope)
            .and_then(|st| st.subs.remove(tag))
        else {
            return false;
        };
        self.tenant.detach(&sub.queue, &sub.consumer);
        true
    }

    /// Whether `scope` has a subscription tagged `tag`.
    pub fn has_subscription(&self, scope: Scope, tag: &[u8]) -> bool {
        self.scopes.get(&scope).is_some_and(|st| {
            st.subs.contains_key(tag) || st.reply.as_ref().is_some_and(|r| r.tag == tag)
        })
    }

    /// Direct reply-to: makes `tag` the reply consumer of `scope` (a
    /// consume of [`REPLY_TO`]). RabbitMQ's refusals: an acknowledging
    /// consumer, or a second one in the scope, is a 406.
    pub fn consume_reply_to(
        &mut self,
        scope: Scope,
        tag: Bytes,
        no_ack: bool,
    ) -> Result<(), ClientError> {
        let handle = self.handle.clone();
        let st = self.scope_mut(scope);
        if st.subs.contains_key(&tag) || st.reply.as_ref().is_some_and(|r| r.tag == tag) {
            return Err(ClientError::TagInUse(
                String::from_utf8_lossy(&tag).into_owned(),
            ));
        }
        if !no_ack {
            return Err(EngineError::PreconditionFailed(
                "reply consumer cannot acknowledge".into(),
            )
            .into());
        }
        if st.reply.is_some() {
            return Err(
                EngineError::PreconditionFailed("reply consumer already set".into()).into(),
            );
        }
        let b = self.tenant.replies.open(handle, scope, tag);
        self.scope_mut(scope).reply = Some(b);
        self.reply_scopes += 1;
        Ok(())
    }

    /// The address a request from `scope` gets as its `reply-to` when it
    /// asks for [`REPLY_TO`]; 406 (RabbitMQ's text) when the scope has no
    /// reply consumer.
    pub fn reply_to_address(&self, scope: Scope) -> Result<String> {
        self.scopes
            .get(&scope)
            .and_then(|st| st.reply.as_ref())
            .map(|b| b.address())
            .ok_or_else(|| {
                EngineError::PreconditionFailed("fast reply consumer does not exist".into())
            })
    }

    /// Whether any scope has a direct reply-to consumer.
    pub fn has_reply_consumers(&self) -> bool {
        self.reply_scopes > 0
    }

    /// The next reply waiting for one of this client's reply consumers.
    /// Replies are not leased (their consumers never acknowledge).
    pub fn next_reply(&mut self) -> Option<Reply> {
        if self.reply_scopes == 0 {
            return None;
        }
        self.scopes.values().find_map(|st| {
            let b = st.reply.as_ref()?;
            let message = b.pop()?;
            Some(Reply {
                scope: b.scope,
                consumer_tag: b.tag.clone(),
                routing_key: Bytes::from(b.address()),
                message,
            })
        })
    }

    /// Pauses or resumes the deliveries of `scope` (AMQP channel.flow).
    pub fn set_flow(&mut self, scope: Scope, active: bool) {
        let st = self.scope_mut(scope);
        st.flow.store(active, Ordering::Release);
        if active {
            self.redispatch(Some(scope));
        }
    }

    /// Sets the window shared by the scope's acknowledging consumers
    /// (0 = no limit). It applies to existing consumers too; a raised limit
    /// may let their queues deliver at the next commit.
    pub fn set_scope_window(&mut self, scope: Scope, count: u32, bytes: u32) {
        let st = self.scope_mut(scope);
        st.window.max_count.store(count, Ordering::Relaxed);
        st.window.max_bytes.store(bytes, Ordering::Relaxed);
        self.redispatch(Some(scope));
    }

    /// Queues a dispatch of every partition `scope` (or every scope)
    /// consumes from, for the next commit.
    fn redispatch(&mut self, scope: Option<Scope>) {
        let scopes = self
            .scopes
            .iter()
            .filter(|(s, _)| scope.is_none_or(|x| x == **s));
        for (_, st) in scopes {
            for sub in st.subs.values() {
                self.to_dispatch
                    .extend(sub.queue.partitions.iter().cloned());
            }
        }
        dedup_partitions(&mut self.to_dispatch);
    }

    // ----- pulls -----

    /// Takes the head message of `queue` (AMQP basic.get), if any.
    pub fn get(&mut self, queue: &str, ack: GetAck) -> Result<Option<Got>, ClientError> {
        self.authorize(Permission::Read, Resource::Queue(queue))?;
        let q = self.queue(queue)?;
        let got = q
            .partitions
            .iter()
            .find_map(|p| p.get().map(|(e, _)| (p.clone(), e)));
        let Some((partition, entry)) = got else {
            return Ok(None);
        };
        q.touch();
        let remaining = q.message_count();
        let message = match &entry.message {
            Some(m) => m.clone(),
            None => match self.read_back(&partition, &entry) {
                Some(m) => m,
                None => {
                    // Unreadable (the store said why): drop it rather than
                    // fail on it forever, and free its record.
                    if let Some(l) = partition.settled(&entry, false) {
                        self.push_settle(partition.id, entry.id, l);
                    }
                    return Err(ClientError::Unreadable);
                }
            },
        };
        let message = self.with_delivery_count(&partition, &entry, message);
        let redelivered = entry.redelivered;
        match ack {
            GetAck::Auto => self.settle_one(
                Lease {
                    partition,
                    consumer: None,
                    entry,
                    since: Instant::now(),
                },
                Settle::Ack,
                Return::Failed,
            ),
            GetAck::Lease { scope, tag, now } => self.scope_mut(scope).leases.insert(
                tag,
                Lease {
                    partition,
                    consumer: None,
                    entry,
                    since: now,
                },
            ),
        }
        Ok(Some(Got {
            message,
            redelivered,
            remaining,
        }))
    }

    // ----- deliveries -----

    /// Takes what partitions pushed to this client. Notices about
    /// subscriptions the client has since replaced or cancelled are
    /// dropped; the rest are appended to `notices`.
    pub fn drain(&mut self, notices: &mut Vec<Notice>) {
        self.handle
            .drain_into(&mut self.pending, &mut self.raw_notices);
        for n in self.raw_notices.drain(..) {
            match n {
                Notice::ConsumerCancelled { consumer } => {
                    // Only if the tag still names this consumer: the client
                    // may have cancelled it and reused the tag since.
                    let current = self.scopes.get_mut(&consumer.scope()).is_some_and(|st| {
                        let same = st
                            .subs
                            .get(consumer.tag())
                            .is_some_and(|s| Arc::ptr_eq(&s.consumer, &consumer));
                        if same {
                            st.subs.remove(consumer.tag());
                        }
                        same
                    });
                    if current {
                        notices.push(Notice::ConsumerCancelled { consumer });
                    }
                }
            }
        }
    }

    /// The next drained delivery. Hand each back with exactly one of
    /// [`Self::lease`] (written), [`Self::unsend`] (cannot be written),
    /// [`Self::discard`] (unreadable) or [`Self::defer`] (not now), then
    /// call [`Self::finish_deliveries`] once for the batch.
    pub fn next_delivery(&mut self) -> Option<Delivery> {
        let d = self.pending.pop_front()?;
        self.taken += 1;
        Some(d)
    }

    /// Puts a delivery back at the front, for a later batch (the write
    /// buffer is full).
    pub fn defer(&mut self, d: Delivery) {
        self.taken -= 1;
        self.pending.push_front(d);
    }

    /// Deliveries waiting to be handed out.
    pub fn pending_deliveries(&self) -> usize {
        self.pending.len()
    }

    /// The delivery cannot be written (its scope or consumer is gone): it
    /// goes back to its queue, not marked redelivered, at the batch's end.
    pub fn unsend(&mut self, d: Delivery) {
        d.consumer.release(d.entry.size);
        self.unsend.push((d.partition, d.entry));
    }

    /// The message of a delivery: in memory, or read back from the store
    /// (retrying while compaction moves its record). None if unreadable:
    /// then [`Self::discard`] it.
    pub fn message_of(&self, d: &Delivery) -> Option<Arc<Message>> {
        let m = match &d.entry.message {
            Some(m) => m.clone(),
            None => self.read_back(&d.partition, &d.entry)?,
        };
        Some(self.with_delivery_count(&d.partition, &d.entry, m))
    }

    /// On a queue that counts deliveries (a delivery limit, or a quorum
    /// queue), a message returned before carries `x-delivery-count`: how
    /// many times it was delivered and came back (RabbitMQ 4's header).
    /// Rewritten through the message's own codec, so every protocol shows
    /// it its way; only returned messages pay for it.
    fn with_delivery_count(&self, p: &Partition, e: &Entry, m: Arc<Message>) -> Arc<Message> {
        if e.attempts <= 1 || !p.counts_deliveries() {
            return m;
        }
        let codecs = &self.codecs;
        let rewritten = codecs
            .decode(m.header_format, &m.properties)
            .and_then(|mut props| {
                let headers = props.headers.get_or_insert_with(Default::default);
                let count = Value::I64(i64::from(e.attempts) - 1);
                match headers.0.iter_mut().find(|(k, _)| k == "x-delivery-count") {
                    Some((_, v)) => *v = count,
                    None => headers.push("x-delivery-count", count),
                }
                let mut raw = Vec::with_capacity(m.properties.len() + 24);
                codecs.get(m.header_format)?.encode(&props, &mut raw)?;
                Ok(raw)
            });
        match rewritten {
            Ok(raw) => Arc::new(Message {
                id: m.id,
                exchange: m.exchange.clone(),
                routing_key: m.routing_key.clone(),
                properties: Bytes::from(raw),
                body: m.body.clone(),
                header_format: m.header_format,
                persistent: m.persistent,
                priority: m.priority,
                ttl_ms: m.ttl_ms,
            }),
            Err(err) => {
                tracing::debug!(error = %err, "x-delivery-count not added: headers undecodable");
                m
            }
        }
    }

    /// Drops a delivery whose message is unreadable, freeing its record,
    /// rather than looping on it forever.
    pub fn discard(&mut self, d: Delivery) {
        d.consumer.release(d.entry.size);
        if let Some(l) = d.partition.settled(&d.entry, false) {
            self.push_settle(d.partition.id, d.entry.id, l);
        }
    }

    /// The delivery was written under `tag` in `scope` at `now` (`now_ms`
    /// the same moment in ms since the epoch, as `enqueued_ms`: the wait in
    /// the queue is counted for the queue's latency figure): it is leased
    /// until settled, or settled now for an auto-ack consumer. Tags must
    /// increase within a scope. The session reads the clock once per batch
    /// and passes it to every delivery of the batch.
    pub fn lease(&mut self, scope: Scope, tag: u64, d: Delivery, now: Instant, now_ms: u64) {
        debug_assert_eq!(scope, d.consumer.scope(), "leased in its consumer's scope");
        d.partition
            .waited(now_ms.saturating_sub(d.entry.enqueued_ms));
        if d.consumer.no_ack() {
            d.consumer.release(d.entry.size);
            if let Some(l) = d.partition.settled(&d.entry, true) {
                self.push_settle(d.partition.id, d.entry.id, l);
            }
            self.push_dispatch(d.partition);
            return;
        }
        let mut entry = d.entry;
        if entry.location.is_some() {
            // Written: a stored message's lease needs only its location (a
            // requeue reads the body back), so a client holding many
            // unacked messages does not hold their bodies.
            entry.message = None;
        }
        self.scope_mut(scope).leases.insert(
            tag,
            Lease {
                partition: d.partition,
                consumer: Some(d.consumer),
                entry,
                since: now,
            },
        );
    }

    /// Ends a batch of deliveries: gives their room on the way to this
    /// client back, redispatches the client's queues if one was refused for
    /// lack of that room, and returns unsent deliveries to their queues.
    pub fn finish_deliveries(&mut self) {
        // Only when room was freed: a refused queue left `starved` set (and
        // woke us once); redispatching without room would be refused again
        // and wake us again, a spin for as long as deliveries are held.
        if self.taken > 0 {
            self.handle.unsent_done(self.taken);
            self.taken = 0;
            if self.handle.take_starved() {
                self.redispatch(None);
            }
        }
        let mut unsend = std::mem::take(&mut self.unsend);
        for (p, e) in unsend.drain(..) {
            let refused = p.unsend(std::iter::once(e));
            self.settle_refused(&p, refused);
        }
        self.unsend = unsend;
    }

    // ----- settling -----

    /// Settles the lease `tag` of `scope`, or with `multiple` every lease up
    /// to it (0 = all). The tag must be outstanding (unless 0 with
    /// `multiple`).
    pub fn settle(
        &mut self,
        scope: Scope,
        tag: u64,
        multiple: bool,
        how: Settle,
    ) -> Result<(), ClientError> {
        let Some(st) = self.scopes.get_mut(&scope) else {
            return if multiple && tag == 0 {
                Ok(())
            } else {
                Err(ClientError::UnknownTag(tag))
            };
        };
        // With a window shared by several consumers (AMQP global qos), the
        // credit a settle gives back may be what another queue of the scope
        // waits for: those queues dispatch again too, as RabbitMQ's limiter
        // wakes every queue blocked on the channel.
        let shared_window = st.subs.len() > 1
            && (st.window.max_count.load(Ordering::Relaxed) > 0
                || st.window.max_bytes.load(Ordering::Relaxed) > 0);
        if !multiple {
            let lease = st.leases.remove(tag).ok_or(ClientError::UnknownTag(tag))?;
            self.settle_one(lease, how, Return::Failed);
        } else {
            let leases = st
                .leases
                .take_up_to(tag)
                .ok_or(ClientError::UnknownTag(tag))?;
            self.settle_many(leases, how, Return::Failed);
        }
        if shared_window {
            self.redispatch(Some(scope));
        }
        Ok(())
    }

    /// Leases outstanding in `scope`.
    pub fn leases(&self, scope: Scope) -> usize {
        self.scopes.get(&scope).map_or(0, |st| st.leases.len())
    }

    /// Whether `tag` is an outstanding lease of `scope`.
    pub fn is_leased(&self, scope: Scope, tag: u64) -> bool {
        self.scopes
            .get(&scope)
            .is_some_and(|st| st.leases.contains(tag))
    }

    /// Appends the outstanding tags of `scope` up to and including `tag`
    /// (0 = all) to `out`, in order: what a `multiple` settle would take
    /// now (an AMQP transaction resolves its acks when they arrive).
    pub fn leased_tags(&self, scope: Scope, tag: u64, out: &mut Vec<u64>) {
        if let Some(st) = self.scopes.get(&scope) {
            st.leases.tags_up_to(tag, out);
        }
    }

    fn settle_one(&mut self, l: Lease, how: Settle, why: Return) {
        if let Some(c) = &l.consumer {
            c.release(l.entry.size);
        }
        if how == Settle::Requeue && !l.partition.is_deleted() {
            let refused = l
                .partition
                .requeue(std::iter::once(l.entry), why, &mut self.settles);
            self.settle_refused(&l.partition, refused);
            if l.consumer.is_some() {
                self.push_dispatch(l.partition);
            }
            return;
        }
        if how == Settle::Drop && l.partition.dead_letters() {
            l.partition.reject(std::iter::once(l.entry));
        } else if let Some(loc) = l.partition.settled(&l.entry, how == Settle::Ack) {
            self.push_settle(l.partition.id, l.entry.id, loc);
        }
        self.push_dispatch(l.partition);
    }

    fn settle_many(&mut self, leases: Vec<Lease>, how: Settle, why: Return) {
        // Grouped by partition so each takes its lock once per batch (a
        // `multiple` ack usually settles many leases of one queue).
        let mut drop: Vec<(Arc<Partition>, Vec<Entry>)> = Vec::new();
        let mut requeue: Vec<(Arc<Partition>, Vec<Entry>)> = Vec::new();
        for l in leases {
            if let Some(c) = &l.consumer {
                c.release(l.entry.size);
            }
            let drop_it = how != Settle::Requeue || l.partition.is_deleted();
            let groups = if drop_it { &mut drop } else { &mut requeue };
            match groups
                .iter_mut()
                .find(|(p, _)| Arc::ptr_eq(p, &l.partition))
            {
                Some((_, v)) => v.push(l.entry),
                None => groups.push((l.partition, vec![l.entry])),
            }
        }
        let acked = how == Settle::Ack;
        for (p, entries) in drop {
            if how == Settle::Drop && !p.is_deleted() && p.dead_letters() {
                p.reject(entries);
                self.push_dispatch(p);
                continue;
            }
            let settles = &mut self.settles;
            p.settled_many(&entries, acked, |id, location| {
                settles.push(Op::Settle {
                    partition: p.id,
                    id,
                    location,
                })
            });
            self.push_dispatch(p);
        }
        for (p, entries) in requeue {
            let refused = p.requeue(entries, why, &mut self.settles);
            self.settle_refused(&p, refused);
            if p.partitioned {
                self.push_dispatch(p);
            }
        }
    }

    /// Settles in the store what a deleted partition refused to take back.
    fn settle_refused(&mut self, p: &Arc<Partition>, refused: Vec<Entry>) {
        for e in refused {
            // Paged entries of non-durable queues have a location too.
            if let Some(l) = e.location {
                self.push_settle(p.id, e.id, l);
            }
        }
    }

    fn push_settle(&mut self, partition: PartitionId, id: MessageId, location: Location) {
        self.settles.push(Op::Settle {
            partition,
            id,
            location,
        });
    }

    fn push_dispatch(&mut self, p: Arc<Partition>) {
        // Consecutive settles are usually of one partition: skip repeats
        // cheaply; `commit` deduplicates the rest.
        if self.to_dispatch.last().is_some_and(|x| Arc::ptr_eq(x, &p)) {
            return;
        }
        // The credit a settle gives back is the consumer's, shared by every
        // partition of its queue: a sibling refused for lack of it must be
        // offered it again, or it starves while this one runs dry.
        if let Some(q) = p.partitioned.then(|| p.queue()).flatten() {
            for sibling in q.partitions.iter().filter(|s| !Arc::ptr_eq(s, &p)) {
                self.to_dispatch.push(sibling.clone());
            }
        }
        self.to_dispatch.push(p);
    }

    // ----- lease expiry -----

    /// Scopes holding a lease written more than `timeout` before `now`
    /// (RabbitMQ's `consumer_timeout`): the caller closes them, which
    /// returns their leases to their queues.
    pub fn expired_scopes(&self, now: Instant, timeout: Duration) -> Vec<Scope> {
        self.scopes
            .iter()
            .filter(|(_, st)| {
                st.leases
                    .oldest()
                    .is_some_and(|since| now.saturating_duration_since(since) > timeout)
            })
            .map(|(s, _)| *s)
            .collect()
    }

    // ----- the batch -----

    /// Whether [`Self::commit`] has anything to do.
    pub fn has_uncommitted(&self) -> bool {
        !self.settles.is_empty() || !self.to_dispatch.is_empty()
    }

    /// Closes the batch: one store append for its settles (after every
    /// publish record they settle, which was appended when published), then
    /// the partitions whose consumers got credit back deliver again.
    pub fn commit(&mut self) {
        if !self.settles.is_empty() {
            self.locs.clear();
            match self
                .store
                .append_for(self.owner, &self.settles, &mut self.locs, None)
            {
                Ok(a) => self.over_share |= a.over_share,
                Err(e) => tracing::error!(error = %e, "store refused settles"),
            }
            self.settles.clear();
        }
        dedup_partitions(&mut self.to_dispatch);
        for p in self.to_dispatch.drain(..) {
            p.dispatch();
        }
    }

    /// Whether the store said, since the last call, that this client's
    /// tenant is over its share of the store's writer (other tenants wait
    /// behind its backlog). A session then reads no more from its socket
    /// until a [`Self::durability_barrier`] completes: each of the tenant's
    /// connections has at most one batch ahead of the other tenants' next
    /// records. Never set while one tenant alone writes.
    pub fn take_store_pressure(&mut self) -> bool {
        std::mem::take(&mut self.over_share)
    }

    /// Whether [`Self::take_store_pressure`] would say yes (the flag stays).
    pub fn has_store_pressure(&self) -> bool {
        self.over_share
    }

    /// Calls `waiter` once everything appended so far is durable (a
    /// publisher's confirmation).
    pub fn durability_barrier(&self, waiter: Waiter) -> Result<(), StoreError> {
        self.store.append(&[], &mut Vec::new(), Some(waiter))
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
        while let Some(d) = self.pending.pop_front() {
            self.handle.unsent_done(1);
            d.consumer.release(d.entry.size);
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

    fn read_back(&self, p: &Partition, e: &Entry) -> Option<Arc<Message>> {
        // Compaction may have moved the record since the entry was handed
        // out, and may move it again (and reclaim the old segment) between
        // the lookup and the read: retry while the location keeps changing.
        let mut loc = p.leased_location(e)?;
        let mut read = self.store.read(loc);
        for _ in 0..3 {
            if read.is_ok() {
                break;
            }
            match p.leased_location(e) {
                Some(now) if now != loc => {
                    loc = now;
                    read = self.store.read(loc);
                }
                _ => break,
            }
        }
        let read = read.map_err(|err| err.to_string()).and_then(|m| {
            // A tag this version does not know (a newer writer) is refused
            // like an unreadable record, never guessed at.
            let f = HeaderFormat::from_u8(m.header_format).map_err(|err| err.to_string())?;
            Ok((m, f))
        });
        match read {
            Ok((m, header_format)) => Some(Arc::new(Message {
                id: m.id,
                exchange: Bytes::from(m.exchange.into_bytes()),
                routing_key: Bytes::from(m.routing_key.into_bytes()),
                properties: m.header,
                body: m.body,
                header_format,
                persistent: true,
                priority: m.attrs.priority,
                // A read-back only serves a delivery: its expiry is the
                // entry's (`expires_at_ms`), fixed at enqueue.
                ttl_ms: None,
            })),
            Err(err) => {
                tracing::error!(error = %err, id = e.id, "cannot read a queued message back from the store");
                None
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

/// The `x-delay` header in ms (0 if absent, not a number, or negative, as
/// RabbitMQ's delayed-message plugin treats them).
fn delay_header(headers: &dyn crate::exchange::HeaderLookup) -> u64 {
    match headers.header(crate::queue::DELAY_HEADER) {
        Some(serde_json::Value::Number(n)) => n
            .as_u64()
            .or_else(|| n.as_f64().filter(|f| *f > 0.0).map(|f| f as u64))
            .unwrap_or(0),
        Some(serde_json::Value::String(s)) => s.trim().parse().unwrap_or(0),
        _ => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::delay_header;
    use crate::exchange::HeaderLookup;
    use serde_json::{json, Value};

    struct One(Value);
    impl HeaderLookup for One {
        fn header(&self, name: &str) -> Option<Value> {
            (name == "x-delay").then(|| self.0.clone())
        }
    }

    #[test]
    fn x_delay_reads_numbers_and_digit_strings_and_ignores_the_rest() {
        for (v, ms) in [
            (json!(1500), 1500),
            (json!(2.9), 2),
            (json!("750"), 750),
            (json!(" 40 "), 40),
            (json!(-5), 0),
            (json!(-0.5), 0),
            (json!("soon"), 0),
            (json!("-3"), 0),
            (json!(null), 0),
            (json!([1, 2]), 0),
            (json!({"ms": 1}), 0),
            (json!(u64::MAX), u64::MAX),
        ] {
            assert_eq!(delay_header(&One(v.clone())), ms, "{v}");
        }
    }
}
