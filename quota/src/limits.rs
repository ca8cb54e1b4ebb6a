//! Per-tenant limits and the counters they are checked against.
//!
//! A [`TenantQuota`] belongs to one tenant (AMQP vhost). The engine checks
//! the count limits (connections, channels, queues, exchanges, consumers,
//! message size) where it creates those things; the queued messages and
//! bytes are counted by the tenant's queues as they change (one atomic add
//! per change), and crossing the limit flips a [`watch`] the tenant's
//! publishing sessions wait on, as they wait on the broker's global alarms.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use tokio::sync::watch;

/// A tenant's limits, as configured. `None` is unlimited.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Limits {
    /// Open connections of the tenant (RabbitMQ `max-connections`).
    pub max_connections: Option<u32>,
    /// Channels open at once on one connection (enforced by the AMQP
    /// adapter: 530 before channel.open-ok).
    pub max_channels_per_connection: Option<u32>,
    /// Queues of the tenant (RabbitMQ `max-queues`).
    pub max_queues: Option<u32>,
    /// Exchanges declared by clients (the predeclared `amq.*` ones and the
    /// default exchange do not count).
    pub max_exchanges: Option<u32>,
    /// Consumers attached to the tenant's queues.
    pub max_consumers: Option<u32>,
    /// Messages ready in the tenant's queues: at it, publishers are blocked.
    pub max_queued_messages: Option<u64>,
    /// Bytes (bodies and properties) of the messages ready in the tenant's
    /// queues: at it, publishers are blocked.
    pub max_queued_bytes: Option<u64>,
    /// Largest message accepted, bytes.
    pub max_message_size: Option<u64>,
    /// Bytes (bodies) of the ready messages the tenant's queues hold in
    /// memory, not paged out to the store: at it, publishers are blocked,
    /// before the broker's global memory watermark blocks everyone.
    pub max_memory: Option<u64>,
    /// Messages per second the tenant's publishers may send together.
    pub publish_rate: Option<u32>,
    /// Bytes per second the tenant's publishers may send together.
    pub publish_bytes_rate: Option<u32>,
}

/// A hard limit was reached. The text is RabbitMQ's where RabbitMQ has the
/// limit; each protocol maps the kind to its code.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuotaError {
    /// `max-connections` (AMQP 530 NOT_ALLOWED at connection.open, MQTT 0x97).
    #[error("access to vhost '{tenant}' refused for user '{user}': connection limit ({limit}) is reached")]
    Connections {
        /// The tenant.
        tenant: String,
        /// The user logging in.
        user: String,
        /// The limit.
        limit: u32,
    },
    /// A user's `max-connections` (`[[quota.users]]`; AMQP 530, MQTT 0x97).
    #[error("Connection refused for user '{user}'. User connection limit ({limit}) is reached")]
    UserConnections {
        /// The user.
        user: String,
        /// The limit.
        limit: u32,
    },
    /// `max-queues` (AMQP 406 PRECONDITION_FAILED).
    #[error(
        "cannot declare queue '{queue}': queue limit in vhost '{tenant}' ({limit}) is reached"
    )]
    Queues {
        /// The queue being declared.
        queue: String,
        /// The tenant.
        tenant: String,
        /// The limit.
        limit: u32,
    },
    /// `max-exchanges` (AMQP 406 PRECONDITION_FAILED).
    #[error("cannot declare exchange '{exchange}': exchange limit in vhost '{tenant}' ({limit}) is reached")]
    Exchanges {
        /// The exchange being declared.
        exchange: String,
        /// The tenant.
        tenant: String,
        /// The limit.
        limit: u32,
    },
    /// `max-consumers` (AMQP 406 PRECONDITION_FAILED, MQTT SUBACK 0x97).
    #[error("cannot add consumer: consumer limit in vhost '{tenant}' ({limit}) is reached")]
    Consumers {
        /// The tenant.
        tenant: String,
        /// The limit.
        limit: u32,
    },
    /// `max-message-size` (AMQP 406 PRECONDITION_FAILED, MQTT 0x97).
    #[error("message size {size} is larger than configured max size {limit}")]
    MessageSize {
        /// The message's size.
        size: u64,
        /// The limit.
        limit: u64,
    },
}

/// Where a blocked tenant's publishers resume: below 90 % of a queued limit
/// (at least one below it). The hysteresis keeps a tenant at its limit from
/// being blocked and unblocked per message.
fn resume_at(limit: u64) -> u64 {
    limit.saturating_sub((limit / 10).max(1))
}

const UNLIMITED: u64 = u64::MAX;

/// One tenant's limits and usage.
pub struct TenantQuota {
    limits: parking_lot_free::Cell<Limits>,
    /// Limits read on hot paths, as atomics ([`UNLIMITED`] for none).
    max_queued_messages: AtomicU64,
    max_queued_bytes: AtomicU64,
    max_message_size: AtomicU64,
    max_memory: AtomicU64,
    connections: AtomicU32,
    queued_messages: AtomicU64,
    queued_bytes: AtomicU64,
    /// Of `queued_bytes`, those of messages kept only in the store (not in
    /// memory). The tenant's memory (see [`Limits::max_memory`]) is the
    /// difference: counted this way round, a message held in memory (the
    /// common case) costs no atomic beyond `queued_bytes`.
    paged: AtomicU64,
    /// Set while the tenant is at a queued or memory limit.
    blocked: watch::Sender<bool>,
    /// The watch's value, for the per-message paths (the watch's own
    /// value sits behind a lock).
    blocked_now: AtomicBool,
    rate: parking_lot_free::Cell<Option<Arc<crate::rate::Rate>>>,
    /// A number naming the tenant to shared machinery that must not learn
    /// what a tenant is (the store's fair shares of its writer).
    tag: u32,
}

/// The next [`TenantQuota::tag`]. 0 is left for the broker's own work.
static NEXT_TAG: AtomicU32 = AtomicU32::new(1);

/// A minimal lock for rarely changed values (no extra dependency).
mod parking_lot_free {
    use std::sync::Mutex;

    /// A value read by clone and replaced whole.
    #[derive(Default)]
    pub struct Cell<T>(Mutex<T>);

    impl<T: Clone> Cell<T> {
        pub fn new(v: T) -> Self {
            Cell(Mutex::new(v))
        }
        pub fn get(&self) -> T {
            match self.0.lock() {
                Ok(g) => g.clone(),
                Err(p) => p.into_inner().clone(),
            }
        }
        pub fn set(&self, v: T) {
            match self.0.lock() {
                Ok(mut g) => *g = v,
                Err(p) => *p.into_inner() = v,
            }
        }
    }
}

impl Default for TenantQuota {
    fn default() -> Self {
        TenantQuota {
            limits: parking_lot_free::Cell::new(Limits::default()),
            max_queued_messages: AtomicU64::new(UNLIMITED),
            max_queued_bytes: AtomicU64::new(UNLIMITED),
            max_message_size: AtomicU64::new(UNLIMITED),
            max_memory: AtomicU64::new(UNLIMITED),
            connections: AtomicU32::new(0),
            queued_messages: AtomicU64::new(0),
            queued_bytes: AtomicU64::new(0),
            paged: AtomicU64::new(0),
            blocked: watch::Sender::new(false),
            blocked_now: AtomicBool::new(false),
            rate: parking_lot_free::Cell::new(None),
            tag: NEXT_TAG.fetch_add(1, Ordering::Relaxed).max(1),
        }
    }
}

impl std::fmt::Debug for TenantQuota {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TenantQuota")
            .field("limits", &self.limits())
            .field("connections", &self.connections())
            .field("queued_messages", &self.queued_messages())
            .field("queued_bytes", &self.queued_bytes())
            .field("memory", &self.memory())
            .field("blocked", &self.is_blocked())
            .finish()
    }
}

impl TenantQuota {
    /// Unlimited, nothing counted.
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// A number unique to this tenant for the life of the process (never
    /// 0): what the store's fairness knows of it.
    pub fn tag(&self) -> u32 {
        self.tag
    }

    /// The limits in force.
    pub fn limits(&self) -> Limits {
        self.limits.get()
    }

    /// Replaces the limits. Rates apply to connections opened from now on;
    /// the queued limits at once.
    pub fn set_limits(&self, limits: Limits) {
        let opt = |v: Option<u64>| v.unwrap_or(UNLIMITED);
        self.max_queued_messages
            .store(opt(limits.max_queued_messages), Ordering::Relaxed);
        self.max_queued_bytes
            .store(opt(limits.max_queued_bytes), Ordering::Relaxed);
        self.max_message_size
            .store(opt(limits.max_message_size), Ordering::Relaxed);
        self.max_memory
            .store(opt(limits.max_memory), Ordering::Relaxed);
        let rate =
            (limits.publish_rate.is_some() || limits.publish_bytes_rate.is_some()).then(|| {
                Arc::new(crate::rate::Rate::new(
                    limits.publish_rate,
                    limits.publish_bytes_rate,
                ))
            });
        self.rate.set(rate);
        self.limits.set(limits);
        self.update_blocked();
    }

    /// The tenant's publish rate limiter, shared by its connections; `None`
    /// without a rate limit.
    pub fn rate(&self) -> Option<Arc<crate::rate::Rate>> {
        self.rate.get()
    }

    // -- connections ------------------------------------------------------

    /// Counts a new connection of `user`, or refuses it at `max-connections`.
    /// Each success is paired with one [`TenantQuota::remove_connection`].
    pub fn add_connection(&self, tenant: &str, user: &str) -> Result<(), QuotaError> {
        let limit = self.limits().max_connections;
        let prev = self.connections.fetch_add(1, Ordering::AcqRel);
        if let Some(limit) = limit {
            if prev >= limit {
                self.connections.fetch_sub(1, Ordering::AcqRel);
                return Err(QuotaError::Connections {
                    tenant: tenant.into(),
                    user: user.into(),
                    limit,
                });
            }
        }
        Ok(())
    }

    /// Counts a new connection of the user whose limits these are, or
    /// refuses it at the user's `max-connections`.
    pub fn add_user_connection(&self, user: &str) -> Result<(), QuotaError> {
        self.add_connection("", user).map_err(|e| match e {
            QuotaError::Connections { limit, .. } => QuotaError::UserConnections {
                user: user.into(),
                limit,
            },
            e => e,
        })
    }

    /// A connection counted by [`TenantQuota::add_connection`] closed.
    pub fn remove_connection(&self) {
        self.connections.fetch_sub(1, Ordering::AcqRel);
    }

    /// Open connections.
    pub fn connections(&self) -> u32 {
        self.connections.load(Ordering::Relaxed)
    }

    // -- counts checked by their owners -----------------------------------

    /// May a tenant with `count` queues declare `queue`?
    pub fn check_queue(&self, tenant: &str, queue: &str, count: usize) -> Result<(), QuotaError> {
        match self.limits().max_queues {
            Some(limit) if count >= limit as usize => Err(QuotaError::Queues {
                queue: queue.into(),
                tenant: tenant.into(),
                limit,
            }),
            _ => Ok(()),
        }
    }

    /// May a tenant with `count` client-declared exchanges declare `exchange`?
    pub fn check_exchange(
        &self,
        tenant: &str,
        exchange: &str,
        count: usize,
    ) -> Result<(), QuotaError> {
        match self.limits().max_exchanges {
            Some(limit) if count >= limit as usize => Err(QuotaError::Exchanges {
                exchange: exchange.into(),
                tenant: tenant.into(),
                limit,
            }),
            _ => Ok(()),
        }
    }

    /// The consumer limit, if any (counting consumers costs a walk, done
    /// only when there is one).
    pub fn max_consumers(&self) -> Option<u32> {
        self.limits().max_consumers
    }

    /// May a tenant with `count` consumers add one?
    pub fn check_consumer(&self, tenant: &str, count: usize) -> Result<(), QuotaError> {
        match self.limits().max_consumers {
            Some(limit) if count >= limit as usize => Err(QuotaError::Consumers {
                tenant: tenant.into(),
                limit,
            }),
            _ => Ok(()),
        }
    }

    /// Is a message of `size` bytes accepted? One atomic load.
    pub fn check_message_size(&self, size: u64) -> Result<(), QuotaError> {
        let limit = self.max_message_size.load(Ordering::Relaxed);
        if size > limit {
            return Err(QuotaError::MessageSize { size, limit });
        }
        Ok(())
    }

    // -- queued messages and bytes -----------------------------------------

    /// `messages` of `bytes` were queued. Blocks the tenant's publishers
    /// when a queued limit is reached.
    pub fn queued(&self, messages: u64, bytes: u64) {
        let m = self.queued_messages.fetch_add(messages, Ordering::Relaxed) + messages;
        let b = self.queued_bytes.fetch_add(bytes, Ordering::Relaxed) + bytes;
        // Memory is at most the queued bytes: `paged` is read only when
        // the queued bytes alone reach the memory limit.
        let max_mem = self.max_memory.load(Ordering::Relaxed);
        if (m >= self.max_queued_messages.load(Ordering::Relaxed)
            || b >= self.max_queued_bytes.load(Ordering::Relaxed)
            || (b >= max_mem && b.saturating_sub(self.paged.load(Ordering::Relaxed)) >= max_mem))
            && !self.blocked_now.load(Ordering::Relaxed)
        {
            self.update_blocked();
        }
    }

    /// `messages` of `bytes` left the tenant's queues (delivered, expired,
    /// purged, deleted). Unblocks its publishers below the resume mark.
    pub fn dequeued(&self, messages: u64, bytes: u64) {
        let (pm, pb) = (
            self.queued_messages.fetch_sub(messages, Ordering::Relaxed),
            self.queued_bytes.fetch_sub(bytes, Ordering::Relaxed),
        );
        debug_assert!(pm >= messages && pb >= bytes, "dequeued more than queued");
        let (m, b) = (pm.wrapping_sub(messages), pb.wrapping_sub(bytes));
        // One relaxed load while unblocked (the common case); the watch's
        // lock only while blocked.
        if self.blocked_now.load(Ordering::Relaxed)
            && m < resume_at(self.max_queued_messages.load(Ordering::Relaxed))
            && b < resume_at(self.max_queued_bytes.load(Ordering::Relaxed))
        {
            self.update_blocked();
        }
    }

    // -- memory -------------------------------------------------------------

    /// `bytes` about to be counted by [`TenantQuota::queued`] are of
    /// messages kept only in the store, not in memory. Call it before
    /// `queued`, so the memory figure never counts them even for a moment.
    pub fn paged(&self, bytes: u64) {
        self.paged.fetch_add(bytes, Ordering::Relaxed);
    }

    /// `bytes` counted by [`TenantQuota::paged`] are about to leave the
    /// queues: call it before their [`TenantQuota::dequeued`] (which
    /// re-checks the block).
    pub fn unpaged(&self, bytes: u64) {
        let prev = self.paged.fetch_sub(bytes, Ordering::Relaxed);
        debug_assert!(prev >= bytes, "unpaged more than paged");
    }

    /// Bytes of the tenant's ready messages held in memory.
    pub fn memory(&self) -> u64 {
        self.queued_bytes()
            .saturating_sub(self.paged.load(Ordering::Relaxed))
    }

    /// Re-evaluates the block under the watch's lock, from the counters as
    /// they are now (concurrent updates settle on the right state).
    fn update_blocked(&self) {
        self.blocked.send_if_modified(|blocked| {
            let (m, b, mem) = (self.queued_messages(), self.queued_bytes(), self.memory());
            let (max_m, max_b, max_mem) = (
                self.max_queued_messages.load(Ordering::Relaxed),
                self.max_queued_bytes.load(Ordering::Relaxed),
                self.max_memory.load(Ordering::Relaxed),
            );
            let want = if *blocked {
                !(m < resume_at(max_m) && b < resume_at(max_b) && mem < resume_at(max_mem))
            } else {
                m >= max_m || b >= max_b || mem >= max_mem
            };
            let changed = want != *blocked;
            *blocked = want;
            self.blocked_now.store(want, Ordering::Relaxed);
            changed
        });
    }

    /// Messages ready in the tenant's queues.
    pub fn queued_messages(&self) -> u64 {
        self.queued_messages.load(Ordering::Relaxed)
    }

    /// Bytes of the messages ready in the tenant's queues.
    pub fn queued_bytes(&self) -> u64 {
        self.queued_bytes.load(Ordering::Relaxed)
    }

    /// Whether the tenant's publishers are blocked (a queued or memory limit).
    pub fn is_blocked(&self) -> bool {
        *self.blocked.borrow()
    }

    /// The block signal, for a publishing session to wait on.
    pub fn subscribe_blocked(&self) -> watch::Receiver<bool> {
        self.blocked.subscribe()
    }

    /// Why the tenant is blocked (the `connection.blocked` reason).
    pub fn block_reason(&self, tenant: &str) -> String {
        let l = self.limits();
        if l.max_memory
            .is_some_and(|max| self.memory() >= resume_at(max))
        {
            format!("tenant '{tenant}' memory quota")
        } else if l
            .max_queued_bytes
            .is_some_and(|max| self.queued_bytes() >= resume_at(max))
        {
            format!("tenant '{tenant}' queued bytes quota")
        } else {
            format!("tenant '{tenant}' queued messages quota")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn quota(l: Limits) -> Arc<TenantQuota> {
        let q = TenantQuota::new();
        q.set_limits(l);
        q
    }

    #[test]
    fn connections_are_limited_and_given_back() {
        let q = quota(Limits {
            max_connections: Some(2),
            ..Limits::default()
        });
        q.add_connection("a", "u").unwrap();
        q.add_connection("a", "u").unwrap();
        let e = q.add_connection("a", "u").unwrap_err();
        assert_eq!(
            e.to_string(),
            "access to vhost 'a' refused for user 'u': connection limit (2) is reached"
        );
        assert_eq!(q.connections(), 2);
        q.remove_connection();
        q.add_connection("a", "u").unwrap();
    }

    #[test]
    fn user_connections_are_counted_over_tenants() {
        let users = UserQuotas::default();
        assert!(users.get("u").is_none());
        users.set(
            "u",
            Limits {
                max_connections: Some(1),
                ..Limits::default()
            },
        );
        let q = users.get("u").unwrap();
        q.add_user_connection("u").unwrap();
        assert_eq!(
            q.add_user_connection("u").unwrap_err().to_string(),
            "Connection refused for user 'u'. User connection limit (1) is reached"
        );
        q.remove_connection();
        q.add_user_connection("u").unwrap();
    }

    #[test]
    fn queue_limit_text_is_rabbitmqs() {
        let q = quota(Limits {
            max_queues: Some(1),
            ..Limits::default()
        });
        q.check_queue("a", "q0", 0).unwrap();
        let e = q.check_queue("a", "q1", 1).unwrap_err();
        assert_eq!(
            e.to_string(),
            "cannot declare queue 'q1': queue limit in vhost 'a' (1) is reached"
        );
    }

    #[test]
    fn zero_limits_refuse_everything() {
        let q = quota(Limits {
            max_queues: Some(0),
            max_connections: Some(0),
            ..Limits::default()
        });
        assert!(q.check_queue("a", "q", 0).is_err());
        assert!(q.add_connection("a", "u").is_err());
    }

    #[test]
    fn message_size() {
        let q = quota(Limits {
            max_message_size: Some(10),
            ..Limits::default()
        });
        q.check_message_size(10).unwrap();
        assert_eq!(
            q.check_message_size(11).unwrap_err().to_string(),
            "message size 11 is larger than configured max size 10"
        );
        TenantQuota::new().check_message_size(u64::MAX).unwrap();
    }

    #[test]
    fn queued_bytes_block_at_the_limit_and_resume_below_the_mark() {
        let q = quota(Limits {
            max_queued_bytes: Some(1000),
            ..Limits::default()
        });
        let mut rx = q.subscribe_blocked();
        q.queued(1, 999);
        assert!(!q.is_blocked());
        q.queued(1, 1);
        assert!(q.is_blocked());
        assert!(rx.has_changed().unwrap());
        assert!(*rx.borrow_and_update());
        // Hysteresis: still blocked just below the limit.
        q.dequeued(1, 50);
        assert!(q.is_blocked());
        q.dequeued(1, 900);
        assert!(!q.is_blocked());
        assert!(!*rx.borrow_and_update());
        assert_eq!((q.queued_messages(), q.queued_bytes()), (0, 50));
    }

    #[test]
    fn memory_blocks_at_the_limit_names_it_and_resumes_below_the_mark() {
        let q = quota(Limits {
            max_memory: Some(1000),
            max_queued_bytes: Some(1 << 20),
            ..Limits::default()
        });
        // Paged-out messages count toward queued bytes, not memory.
        q.paged(5000);
        q.queued(1, 5000);
        q.queued(1, 999);
        assert_eq!(q.memory(), 999);
        assert!(!q.is_blocked());
        q.queued(1, 1);
        assert!(q.is_blocked());
        assert_eq!(q.block_reason("a"), "tenant 'a' memory quota");
        // Paged bytes leaving do not unblock while memory is at the mark.
        q.unpaged(5000);
        q.dequeued(1, 5000);
        assert!(q.is_blocked());
        q.dequeued(1, 50);
        assert!(q.is_blocked());
        q.dequeued(1, 900);
        assert!(!q.is_blocked());
        assert_eq!(q.memory(), 50);
    }

    #[test]
    fn queued_messages_block() {
        let q = quota(Limits {
            max_queued_messages: Some(3),
            ..Limits::default()
        });
        q.queued(2, 0);
        assert!(!q.is_blocked());
        q.queued(1, 0);
        assert!(q.is_blocked());
        q.dequeued(3, 0);
        assert!(!q.is_blocked());
    }

    #[test]
    fn unlimited_never_blocks() {
        let q = TenantQuota::new();
        q.queued(1 << 40, 1 << 60);
        assert!(!q.is_blocked());
    }

    #[test]
    fn lowering_a_limit_blocks_at_once() {
        let q = TenantQuota::new();
        q.queued(10, 10_000);
        q.set_limits(Limits {
            max_queued_bytes: Some(5_000),
            ..Limits::default()
        });
        assert!(q.is_blocked());
    }
}

/// Per-user limits (`[[quota.users]]`), by user name: each user's limits
/// apply on top of its tenant's (connections counted over all tenants,
/// its own publish rate shared by its connections). Queued limits do not
/// apply to users.
#[derive(Default)]
pub struct UserQuotas {
    by_name: std::sync::RwLock<std::collections::HashMap<String, Arc<TenantQuota>>>,
}

impl std::fmt::Debug for UserQuotas {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UserQuotas").finish_non_exhaustive()
    }
}

impl UserQuotas {
    /// Sets `user`'s limits (replacing earlier ones; counters are kept).
    pub fn set(&self, user: &str, limits: Limits) {
        let mut m = match self.by_name.write() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        m.entry(user.to_string())
            .or_insert_with(TenantQuota::new)
            .set_limits(limits);
    }

    /// `user`'s limits and counters, if it has limits.
    pub fn get(&self, user: &str) -> Option<Arc<TenantQuota>> {
        let m = match self.by_name.read() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        m.get(user).cloned()
    }
}
