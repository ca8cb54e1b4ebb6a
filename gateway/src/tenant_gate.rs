//! What a publishing session obeys of its tenant's quota, beside the
//! broker's global alarms: the tenant's block (its queued messages or bytes
//! at their limit) and its publish rate. Shared by the AMQP and MQTT
//! sessions, which hold one per logged-in connection.
//!
//! * **Block**: the tenant's [`TenantQuota`] flips a watch when its queued
//!   limit is reached and when it drains below the resume mark. A session
//!   treats it as one more alarm: after the publish in hand it stops reading
//!   (AMQP also sends `connection.blocked` naming the tenant quota), and it
//!   waits on the watch (no polling, see [`wake`]) to read again.
//! * **Rate**: the session adds what it published in a batch to its
//!   [`Debt`]; after the batch it asks the tenant's limiter, and over the
//!   rate it stops reading for the time the limiter names (TCP pushes back
//!   on the producer): the pause's end is a deadline of the session
//!   driver's one timer ([`TenantGate::pause_deadline`]). No error, nothing
//!   allocated per message.
//! * **Store share**: when the store says the tenant is over its share of
//!   the log writer (several tenants write and this one's backlog would
//!   delay the others' confirms, see `Store::append_for`), the session stops
//!   reading after the batch until everything it appended is durable (one
//!   store barrier). A connection without limits gets its gate then, at
//!   the first such batch ([`TenantGate::for_store_share`]): an idle
//!   connection (think of 100,000 MQTT devices) carries none.
//!
//! A publisher that cannot be paused (an HTTP request, answered at once)
//! passes [`admit`] instead: the same alarms, block and rates, read at the
//! moment of the publish, and refused ([`Refusal`]) where a session would
//! stop reading. Every door that publishes goes through one of the two.

use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{oneshot, watch};
use weir_quota::{Debt, Rate, TenantQuota};

/// One connection's view of its tenant's block and rate.
pub struct TenantGate {
    quota: Arc<TenantQuota>,
    tenant: Arc<str>,
    block: watch::Receiver<bool>,
    /// The block as last seen.
    blocked: bool,
    /// The tenant's publish rate, the user's (`[[quota.users]]`) and the
    /// connection's own (`[[quota.connections]]`), each with what this
    /// connection owes it.
    rates: [Option<(Arc<Rate>, Debt)>; 3],
    /// Not read until then: over the rate.
    pause_until: Option<Instant>,
    /// Not read until this fires: the tenant was over its share of the
    /// store's writer, and this connection's appends are not durable yet.
    store_wait: Option<oneshot::Receiver<()>>,
}

impl TenantGate {
    /// The gate of an engine client's connection, if its tenant, user or
    /// `rule` (the connection's `[[quota.connections]]` override, whose
    /// rate is this connection's own) limits it; otherwise none until the
    /// store share asks for one ([`TenantGate::for_store_share`]).
    pub fn for_client(
        client: &weir_engine::Client,
        rule: Option<&weir_quota::ConnectionRule>,
    ) -> Option<Self> {
        let tenant = client.tenant();
        let user_rate = client.user_quota().and_then(|u| u.rate());
        let rule_rate = rule.and_then(|r| r.rate());
        let l = tenant.quota().limits();
        let limited = l.max_queued_bytes.is_some()
            || l.max_queued_messages.is_some()
            || l.max_memory.is_some()
            || l.publish_rate.is_some()
            || l.publish_bytes_rate.is_some()
            || user_rate.is_some()
            || rule_rate.is_some();
        limited.then(|| {
            let mut g = Self::new(tenant.name.clone(), tenant.quota().clone());
            g.rates[1] = user_rate.map(|r| (r, Debt::default()));
            g.rates[2] = rule_rate.map(|r| (r, Debt::default()));
            g
        })
    }

    /// A gate for a connection that had none, once the store says its
    /// tenant is over its share of the writer (call after each batch; the
    /// gate's [`TenantGate::end_batch`] then takes the pressure).
    pub fn for_store_share(client: &weir_engine::Client) -> Option<Self> {
        client.has_store_pressure().then(|| {
            let tenant = client.tenant();
            Self::new(tenant.name.clone(), tenant.quota().clone())
        })
    }

    /// The gate of a connection of `tenant`.
    pub fn new(tenant: Arc<str>, quota: Arc<TenantQuota>) -> Self {
        let mut block = quota.subscribe_blocked();
        let blocked = *block.borrow_and_update();
        let rate = quota.rate().map(|r| (r, Debt::default()));
        TenantGate {
            quota,
            tenant,
            block,
            blocked,
            rates: [rate, None, None],
            pause_until: None,
            store_wait: None,
        }
    }

    /// Whether the tenant is blocked (as last refreshed).
    pub fn blocked(&self) -> bool {
        self.blocked
    }

    /// Takes the block's current state if it changed (one atomic load when
    /// it did not). Returns whether it changed.
    pub fn refresh(&mut self) -> bool {
        if !self.block.has_changed().unwrap_or(false) {
            return false;
        }
        self.blocked = *self.block.borrow_and_update();
        true
    }

    /// The tenant's name.
    pub fn tenant(&self) -> &str {
        &self.tenant
    }

    /// The `connection.blocked` reason.
    pub fn reason(&self) -> String {
        self.quota.block_reason(&self.tenant)
    }

    /// A message of `bytes` was published: owed to the rate, if any.
    pub fn published(&mut self, bytes: usize) {
        for (_, debt) in self.rates.iter_mut().flatten() {
            debt.messages = debt.messages.saturating_add(1);
            debt.bytes = debt.bytes.saturating_add(bytes as u64);
        }
    }

    /// After a batch: takes its debt from the tenant's rate; over it, reads
    /// pause (see [`TenantGate::paused`]). Over the tenant's share of the
    /// store's writer, reads pause until `client`'s appends are durable.
    pub fn end_batch(&mut self, client: Option<&mut weir_engine::Client>) {
        if let Some(c) = client {
            if c.take_store_pressure() && self.store_wait.is_none() {
                let (tx, rx) = oneshot::channel();
                let barrier = c.durability_barrier(Box::new(move |_| {
                    let _ = tx.send(());
                }));
                // A store that refuses the barrier is failing: its own
                // errors reach the publishers; nothing to wait for here.
                if barrier.is_ok() {
                    self.store_wait = Some(rx);
                }
            }
        }
        if self.pause_until.is_some() {
            return;
        }
        let mut wait: Option<Duration> = None;
        for (rate, debt) in self.rates.iter_mut().flatten() {
            if !debt.is_empty() {
                wait = wait.max(rate.take(debt));
            }
        }
        if let Some(wait) = wait {
            crate::metrics::rate_pause(&self.tenant);
            self.pause_until = Some(Instant::now() + wait.max(Duration::from_millis(1)));
        }
    }

    /// Whether reads are paused by the rate or the store share.
    pub fn paused(&self) -> bool {
        self.pause_until.is_some() || self.store_wait.is_some()
    }

    /// When the rate's pause ends, if reads are paused by it.
    pub fn pause_deadline(&self) -> Option<Instant> {
        self.pause_until
    }

    /// Ends the rate's pause if it is over at `now`.
    pub fn end_pause_if_due(&mut self, now: Instant) {
        if self.pause_until.is_some_and(|at| at <= now) {
            self.pause_until = None;
        }
    }
}

/// Resolves when `gate`'s block changes (only if `watch_block`) or its
/// store-share pause is over; never without a gate or either. The caller
/// then refreshes its alarm state. (The rate's pause ends by the session's
/// timer: [`TenantGate::pause_deadline`].)
pub async fn wake(gate: Option<&mut TenantGate>, watch_block: bool) {
    let Some(g) = gate else {
        return std::future::pending().await;
    };
    tokio::select! {
        r = g.block.changed(), if watch_block => {
            if r.is_err() {
                // The tenant is gone: its block never changes again.
                std::future::pending::<()>().await;
            }
            // `changed` marked the value seen: take it here.
            g.blocked = *g.block.borrow_and_update();
        }
        // Sent, or dropped with a closing store: nothing left to wait for.
        _ = async { g.store_wait.as_mut().expect("guarded").await }, if g.store_wait.is_some() => {
            g.store_wait = None;
        }
        else => std::future::pending().await,
    }
}

/// Why [`admit`] refused a publish.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// A broker resource alarm (memory or disk) is set: every publisher
    /// of every tenant waits (HTTP 503).
    Alarm(&'static str),
    /// The tenant is at a queued messages, bytes or memory quota: its
    /// publishers wait until consumers drain it (HTTP 429).
    Quota(String),
    /// Over a publish rate (the tenant's, the user's or the connection
    /// rule's): try again after the time given (HTTP 429).
    Rate {
        /// Whose rate, for the reason.
        whose: String,
        /// When the rate has room again.
        retry_after: Duration,
    },
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refusal::Alarm(why) => write!(f, "publishing is blocked: {why}"),
            Refusal::Quota(why) => write!(f, "publishing is blocked: {why}"),
            Refusal::Rate { whose, retry_after } => write!(
                f,
                "{whose} publish rate exceeded: retry after {} ms",
                retry_after.as_millis()
            ),
        }
    }
}

/// The publish gate of a publisher that is answered at once rather than
/// paused (HTTP): the broker's `alarms`, the tenant's block and the publish
/// rates a session would obey for `client` (tenant, user, and `rule`, the
/// `[[quota.connections]]` override matching it). On success, one message
/// of `bytes` is charged to the rates. Checked before the publish, so a
/// tenant at its queued limit takes no more (a session's publish in hand
/// may still land; here nothing is in hand).
pub fn admit(
    alarms: crate::server::Alarms,
    client: &weir_engine::Client,
    rule: Option<&weir_quota::ConnectionRule>,
    bytes: usize,
) -> Result<(), Refusal> {
    if alarms.any() {
        return Err(Refusal::Alarm(alarms.reason()));
    }
    let tenant = client.tenant();
    let quota = tenant.quota();
    if quota.is_blocked() {
        return Err(Refusal::Quota(quota.block_reason(&tenant.name)));
    }
    let rates = [
        quota.rate().map(|r| (r, "tenant")),
        client
            .user_quota()
            .and_then(|u| u.rate())
            .map(|r| (r, "user")),
        rule.and_then(|r| r.rate()).map(|r| (r, "connection")),
    ];
    for (rate, whose) in rates.into_iter().flatten() {
        if let Err(retry_after) = rate.admit(bytes as u64) {
            crate::metrics::rate_pause(&tenant.name);
            let whose = match whose {
                "tenant" => format!("tenant '{}'", tenant.name),
                "user" => format!("user '{}'", client.principal()),
                _ => format!("connection rule of user '{}'", client.principal()),
            };
            return Err(Refusal::Rate { whose, retry_after });
        }
    }
    Ok(())
}
