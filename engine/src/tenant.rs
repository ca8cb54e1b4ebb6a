//! One tenant (AMQP virtual host): its exchanges, queues and bindings, and
//! the operations on them. Names are scoped per tenant.

use super::args::QueueArgs;
use super::consumer::{Consumer, Notice};
use super::exchange::{Destination, Exchange, ExchangeDef, ExchangeKind, HeaderLookup};
use super::meta::{self, BindingDef, DestinationKind};
use super::policy::{self, Policy, PolicyDef};
use super::queue::{Queue, QueueDef};
use super::{DurableWait, Engine, EngineError, Result};
use parking_lot::RwLock;
use serde_json::Value;
use std::collections::HashMap;
use std::fmt::Display;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use weir_backend::Op;
use weir_quota::{Limits, TenantQuota};

/// The exchanges every tenant has, as RabbitMQ pre-declares them.
const STANDARD_EXCHANGES: &[(&str, ExchangeKind)] = &[
    ("amq.direct", ExchangeKind::Direct),
    ("amq.fanout", ExchangeKind::Fanout),
    ("amq.topic", ExchangeKind::Topic),
    ("amq.headers", ExchangeKind::Headers),
    ("amq.match", ExchangeKind::Headers),
];

/// A queue.declare request.
#[derive(Clone, Debug)]
pub struct QueueDeclare {
    /// Name; empty asks the server to pick one (`amq.gen-…`).
    pub name: String,
    /// Only check that it exists.
    pub passive: bool,
    /// Survives restarts.
    pub durable: bool,
    /// Owned by the declaring connection and deleted with it.
    pub exclusive: bool,
    /// Deleted after its last consumer goes.
    pub auto_delete: bool,
    /// Arguments.
    pub arguments: Value,
    /// The declaring connection.
    pub connection: u64,
}

/// The answer to a queue declare.
#[derive(Clone, Debug)]
pub struct QueueDeclared {
    /// The (possibly generated) name.
    pub name: String,
    /// Ready messages.
    pub messages: u64,
    /// Consumers.
    pub consumers: u32,
}

/// What a message has that routing may look at.
pub struct RouteInput<'a> {
    /// Exchange name.
    pub exchange: &'a str,
    /// Routing key.
    pub routing_key: &'a str,
    /// Headers, for headers exchanges.
    pub headers: &'a dyn HeaderLookup,
}

/// Calls `f` with each routing key of the message's `CC` and `BCC`
/// headers. A byte scan rules them out for most messages without parsing.
fn for_sender_selected(headers: &dyn HeaderLookup, mut f: impl FnMut(&str)) {
    for name in crate::exchange::SENDER_SELECTED {
        if !headers.may_have(name) {
            continue;
        }
        if let Some(v) = headers.header(name) {
            for key in crate::exchange::header_routing_keys(&v) {
                f(key);
            }
        }
    }
}

/// How [`Tenant::route`] routed a message, beyond where to.
#[derive(Clone, Copy, Debug, Default)]
#[must_use]
pub struct Routed {
    /// Through an `x-delayed-message` exchange: `x-delay` holds it back in
    /// every queue it reaches.
    pub delayed: bool,
}

/// A tenant.
pub struct Tenant {
    /// Name.
    pub name: Arc<str>,
    engine: Weak<Engine>,
    /// The engine's clock, held here so a client reads it without reaching
    /// the engine (and without a field of its own per connection).
    clock: crate::clock::SharedClock,
    exchanges: RwLock<HashMap<String, Arc<Exchange>>>,
    queues: RwLock<HashMap<String, Arc<Queue>>>,
    /// Policies by name.
    policies: RwLock<Vec<Policy>>,
    /// Retained messages (MQTT) by topic (see [`crate::retained`]).
    pub(crate) retained: crate::retained::Retained,
    /// Protocol session state (see [`crate::session_state`]).
    pub(crate) session_state: crate::session_state::SessionState,
    /// Direct reply-to boxes (see [`crate::reply_to`]).
    pub(crate) replies: crate::reply_to::ReplyRoutes,
    /// Limits and usage (`[[tenants]]` quotas).
    quota: Arc<TenantQuota>,
    /// Declared arguments changed after the declare
    /// ([`Tenant::set_queue_expires`]), by queue name, with the queue they
    /// were changed for (a queue of the same name declared later is not
    /// it). Empty for nearly every tenant: a queue's `def` stays as
    /// declared, and a restart reads the rewritten definition.
    changed_arguments: RwLock<HashMap<String, (Weak<Queue>, Value)>>,
}

fn not_found_queue(name: &str, tenant: &str) -> EngineError {
    EngineError::NotFound(format!("no queue '{name}' in vhost '{tenant}'"))
}

fn not_found_exchange(name: &str, tenant: &str) -> EngineError {
    EngineError::NotFound(format!("no exchange '{name}' in vhost '{tenant}'"))
}

fn inequivalent(
    arg: &str,
    what: &str,
    name: &str,
    tenant: &str,
    received: impl Display,
    current: impl Display,
) -> EngineError {
    EngineError::PreconditionFailed(format!(
        "inequivalent arg '{arg}' for {what} '{name}' in vhost '{tenant}': received '{received}' but current is '{current}'"
    ))
}

impl Tenant {
    pub(crate) fn new(
        name: &str,
        engine: Weak<Engine>,
        clock: crate::clock::SharedClock,
    ) -> Arc<Self> {
        let mut exchanges = HashMap::new();
        for (n, kind) in STANDARD_EXCHANGES {
            exchanges.insert(
                n.to_string(),
                Exchange::new(ExchangeDef {
                    name: n.to_string(),
                    kind: *kind,
                    durable: true,
                    auto_delete: false,
                    internal: false,
                    delayed: false,
                    arguments: Value::Object(Default::default()),
                }),
            );
        }
        Arc::new(Tenant {
            name: name.into(),
            engine,
            clock,
            exchanges: RwLock::new(exchanges),
            queues: RwLock::new(HashMap::new()),
            policies: RwLock::new(Vec::new()),
            retained: Default::default(),
            session_state: Default::default(),
            replies: Default::default(),
            changed_arguments: Default::default(),
            quota: TenantQuota::new(),
        })
    }

    /// The engine's clock (see [`crate::clock`]).
    pub fn clock(&self) -> &crate::clock::SharedClock {
        &self.clock
    }

    /// The tenant's limits and usage: counts checked here and by
    /// [`crate::client::Client`], queued messages and bytes counted by its
    /// queues, and the block signal and rate limiter its publishing
    /// sessions obey.
    pub fn quota(&self) -> &Arc<TenantQuota> {
        &self.quota
    }

    /// Sets the tenant's limits (from the configuration at every start:
    /// they are not stored). Lowering a limit below the current usage
    /// refuses new things and blocks publishers; nothing is deleted.
    pub fn set_limits(&self, limits: Limits) {
        self.quota.set_limits(limits);
    }

    /// Consumers attached to the tenant's queues (a walk over them).
    pub fn consumer_count(&self) -> usize {
        self.queues
            .read()
            .values()
            .map(|q| q.consumer_count() as usize)
            .sum()
    }

    /// Sets (adds or replaces) a policy, durably, and applies it to the
    /// existing queues at once.
    pub fn set_policy(&self, def: PolicyDef) -> Result<DurableWait> {
        let engine = self.engine()?;
        let policy = self.check_policy(def)?;
        let key = meta::policy_key(&self.name, &policy.def.name);
        let value = serde_json::to_vec(&policy.def)
            .map_err(|e| EngineError::CommandInvalid(e.to_string()))?;
        let wait = engine.persist(&[Op::PutMeta {
            key: &key,
            value: &value,
        }])?;
        self.install_policy(policy);
        Ok(wait)
    }

    /// A policy as `def` defines it: checked, and within the size limits
    /// ([`crate::bounds`]).
    pub(crate) fn check_policy(&self, def: PolicyDef) -> Result<Policy> {
        crate::bounds::check_name("policy", &def.name)?;
        crate::bounds::check_pattern("policy pattern", &def.pattern)?;
        crate::bounds::check_arguments(
            &format_args!("policy '{}' in vhost '{}'", def.name, self.name),
            &Value::Object(def.definition.clone()),
        )?;
        Policy::new(def).map_err(|e| EngineError::PreconditionFailed(e.to_string()))
    }

    /// Deletes a policy; its queues fall back to their own arguments.
    pub fn delete_policy(&self, name: &str) -> Result<DurableWait> {
        let engine = self.engine()?;
        let found = {
            let mut w = self.policies.write();
            let before = w.len();
            w.retain(|p| p.def.name != name);
            w.len() < before
        };
        if !found {
            return Err(EngineError::NotFound(format!(
                "no policy '{name}' in vhost '{}'",
                self.name
            )));
        }
        let wait = engine.persist(&[Op::DeleteMeta {
            key: &meta::policy_key(&self.name, name),
        }])?;
        self.reapply_policies();
        Ok(wait)
    }

    /// The policies, by name.
    pub fn policies(&self) -> Vec<PolicyDef> {
        let mut v: Vec<PolicyDef> = self.policies.read().iter().map(|p| p.def.clone()).collect();
        v.sort_by(|a, b| a.name.cmp(&b.name));
        v
    }

    pub(crate) fn restore_policy(&self, def: PolicyDef) -> Result<()> {
        let policy =
            Policy::new(def).map_err(|e| EngineError::PreconditionFailed(e.to_string()))?;
        self.install_policy(policy);
        Ok(())
    }

    fn install_policy(&self, policy: Policy) {
        {
            let mut w = self.policies.write();
            w.retain(|p| p.def.name != policy.def.name);
            w.push(policy);
        }
        self.reapply_policies();
    }

    /// Recomputes every queue's arguments under the current policies.
    fn reapply_policies(&self) {
        let queues: Vec<Arc<Queue>> = self.queues.read().values().cloned().collect();
        for q in queues {
            self.apply_policy(&q);
        }
    }

    /// Sets `q`'s effective arguments: its own over its policy's.
    fn apply_policy(&self, q: &Arc<Queue>) {
        // No copy of the arguments unless they were changed (a restart
        // applies this to every queue).
        let changed = self.changed_arguments_of(q);
        let declared = changed.as_ref().unwrap_or(&q.def.arguments);
        let merged = {
            let policies = self.policies.read();
            policy::effective_arguments(declared, policy::select(&policies, q.name()))
        };
        match QueueArgs::parse(&merged) {
            Ok(args) => q.set_args(args),
            Err(e) => {
                tracing::warn!(queue = %q.name(), tenant = %self.name, error = %e, "policy not applied")
            }
        }
    }

    /// The arguments `q` was declared with, as changed since
    /// ([`Tenant::set_queue_expires`]).
    pub fn declared_arguments(&self, q: &Queue) -> Value {
        self.changed_arguments_of(q)
            .unwrap_or_else(|| q.def.arguments.clone())
    }

    /// `q`'s arguments if they were changed after its declare.
    fn changed_arguments_of(&self, q: &Queue) -> Option<Value> {
        let changed = self.changed_arguments.read();
        if changed.is_empty() {
            return None;
        }
        changed
            .get(q.name())
            .filter(|(owner, _)| std::ptr::eq(owner.as_ptr(), q))
            .map(|(_, args)| args.clone())
    }

    /// Sets (`Some`, ms) or removes (`None`) the `x-expires` of queue
    /// `name` after its declare: an MQTT 5 session's expiry set again by
    /// its DISCONNECT (3.14.2.2.2). Its declared arguments change in memory
    /// and, for a durable queue, in its stored definition (one metadata
    /// record; the wait resolves once it is durable), so a restart keeps
    /// the new value; the idle time counts from now. The caller checked
    /// permissions ([`crate::Client::set_queue_expires`]).
    pub fn set_queue_expires(
        &self,
        name: &str,
        expires_ms: Option<u64>,
    ) -> Result<Option<DurableWait>> {
        let engine = self.engine()?;
        let q = self
            .queues
            .read()
            .get(name)
            .cloned()
            .ok_or_else(|| not_found_queue(name, &self.name))?;
        let mut arguments = match self.declared_arguments(&q) {
            Value::Object(m) => m,
            _ => serde_json::Map::new(),
        };
        match expires_ms {
            Some(ms) => arguments.insert("x-expires".into(), Value::from(ms)),
            None => arguments.remove("x-expires"),
        };
        let arguments = Value::Object(arguments);
        QueueArgs::parse(&arguments)
            .map_err(|e| EngineError::PreconditionFailed(e.message(name, &self.name)))?;
        let wait = if q.def.durable && q.exclusive_owner().is_none() {
            let def = QueueDef {
                arguments: arguments.clone(),
                ..q.def.clone()
            };
            let value =
                serde_json::to_vec(&def).map_err(|e| EngineError::CommandInvalid(e.to_string()))?;
            let key = meta::queue_key(&self.name, name);
            Some(engine.persist(&[Op::PutMeta {
                key: &key,
                value: &value,
            }])?)
        } else {
            None
        };
        self.changed_arguments
            .write()
            .insert(name.to_string(), (Arc::downgrade(&q), arguments));
        if q.is_deleted() {
            // Deleted meanwhile: its removal may have run before the insert.
            self.changed_arguments.write().remove(name);
        }
        self.apply_policy(&q);
        Ok(wait)
    }

    pub(crate) fn engine(&self) -> Result<Arc<Engine>> {
        self.engine
            .upgrade()
            .ok_or_else(|| EngineError::CommandInvalid("broker is shutting down".into()))
    }

    pub(crate) fn restore_exchange(&self, def: ExchangeDef) {
        self.exchanges
            .write()
            .insert(def.name.clone(), Exchange::new(def));
    }

    pub(crate) fn restore_queue(&self, def: QueueDef) -> Arc<Queue> {
        let timers = self.engine().ok().map(|e| e.timers.clone());
        let q = Queue::with_timers(
            def,
            self.name.clone(),
            None,
            timers,
            Some(self.quota.clone()),
        );
        self.apply_policy(&q);
        // A restart is a use: x-expires counts from boot, as in RabbitMQ.
        q.touch();
        self.queues.write().insert(q.name().to_string(), q.clone());
        q
    }

    pub(crate) fn restore_binding(&self, b: &BindingDef) -> Result<()> {
        let source = self.exchange(&b.source)?;
        let dest = self.destination(b.destination_kind, &b.destination)?;
        source.bind(dest, &b.key, b.arguments.clone());
        Ok(())
    }

    fn destination(&self, kind: DestinationKind, name: &str) -> Result<Destination> {
        Ok(match kind {
            DestinationKind::Queue => Destination::Queue(
                self.queues
                    .read()
                    .get(name)
                    .cloned()
                    .ok_or_else(|| not_found_queue(name, &self.name))?,
            ),
            DestinationKind::Exchange => Destination::Exchange(self.exchange(name)?),
        })
    }

    /// How many queues it has.
    pub fn queue_count(&self) -> usize {
        self.queues.read().len()
    }

    /// Every queue.
    pub fn queues(&self) -> Vec<Arc<Queue>> {
        self.queues.read().values().cloned().collect()
    }

    /// Every exchange.
    pub fn exchanges(&self) -> Vec<Arc<Exchange>> {
        self.exchanges.read().values().cloned().collect()
    }

    /// An exchange by name (404 if missing).
    pub fn exchange(&self, name: &str) -> Result<Arc<Exchange>> {
        self.exchanges
            .read()
            .get(name)
            .cloned()
            .ok_or_else(|| not_found_exchange(name, &self.name))
    }

    /// The queue named `name`, exclusive or not (observers such as the
    /// management API; clients go through [`Tenant::queue`]).
    pub fn queue_named(&self, name: &str) -> Option<Arc<Queue>> {
        self.queues.read().get(name).cloned()
    }

    /// A queue by name, as seen by `connection` (404 if missing, 405 if
    /// another connection's exclusive queue).
    pub fn queue(&self, name: &str, connection: u64) -> Result<Arc<Queue>> {
        let q = self
            .queues
            .read()
            .get(name)
            .cloned()
            .ok_or_else(|| not_found_queue(name, &self.name))?;
        check_exclusive(&q, connection, &self.name)?;
        Ok(q)
    }

    /// exchange.declare.
    pub fn declare_exchange(&self, def: ExchangeDef, passive: bool) -> Result<Option<DurableWait>> {
        if def.name.is_empty() {
            if passive {
                return Ok(None);
            }
            return Err(EngineError::AccessRefused(format!(
                "operation not permitted on the default exchange in vhost '{}'",
                self.name
            )));
        }
        let existing = self.exchanges.read().get(&def.name).cloned();
        if let Some(x) = existing {
            if passive {
                return self.barrier(x.def.durable);
            }
            self.exchange_equivalent(&x.def, &def)?;
            return self.barrier(x.def.durable);
        }
        if passive {
            return Err(not_found_exchange(&def.name, &self.name));
        }
        self.check_new_exchange(&def)?;
        let engine = self.engine()?;
        let mut w = self.exchanges.write();
        if w.contains_key(&def.name) {
            // Raced with another declare of the same name: theirs stands;
            // answer as for an existing exchange (checks and durability).
            drop(w);
            return self.declare_exchange(def, passive);
        }
        if self.quota.limits().max_exchanges.is_some() {
            let declared = w.keys().filter(|n| !n.starts_with("amq.")).count();
            self.quota.check_exchange(&self.name, &def.name, declared)?;
        }
        let wait = if def.durable {
            let key = meta::exchange_key(&self.name, &def.name);
            let value =
                serde_json::to_vec(&def).map_err(|e| EngineError::CommandInvalid(e.to_string()))?;
            match engine.persist_new(&key, &value)? {
                Some(wait) => Some(wait),
                None => {
                    // Another handle of the store declared it first: take
                    // its definition and answer as for an existing one.
                    drop(w);
                    engine.apply_definition_changes();
                    if self.exchanges.read().contains_key(&def.name) {
                        return self.declare_exchange(def, passive);
                    }
                    return Err(declared_elsewhere("exchange", &def.name, &self.name));
                }
            }
        } else {
            None
        };
        w.insert(def.name.clone(), Exchange::new(def));
        Ok(wait)
    }

    /// A new exchange's name and arguments are acceptable: not reserved,
    /// within the size limits ([`crate::bounds`]).
    pub(crate) fn check_new_exchange(&self, def: &ExchangeDef) -> Result<()> {
        if def.name.is_empty() {
            return Err(EngineError::AccessRefused(format!(
                "operation not permitted on the default exchange in vhost '{}'",
                self.name
            )));
        }
        if def.name.starts_with("amq.") {
            return Err(EngineError::AccessRefused(format!(
                "exchange name '{}' contains reserved prefix 'amq.*'",
                def.name
            )));
        }
        crate::bounds::check_name("exchange", &def.name)?;
        crate::bounds::check_arguments(
            &format_args!("exchange '{}' in vhost '{}'", def.name, self.name),
            &def.arguments,
        )
    }

    /// A redeclare of `cur` as `def` is equivalent (RabbitMQ's 406 texts).
    pub(crate) fn exchange_equivalent(&self, cur: &ExchangeDef, def: &ExchangeDef) -> Result<()> {
        let same = |arg: &str, ok: bool, recv: &dyn Display, current: &dyn Display| {
            ok.then_some(())
                .ok_or_else(|| inequivalent(arg, "exchange", &def.name, &self.name, recv, current))
        };
        same(
            "type",
            cur.kind == def.kind,
            &def.kind.as_str(),
            &cur.kind.as_str(),
        )?;
        same(
            "durable",
            cur.durable == def.durable,
            &def.durable,
            &cur.durable,
        )?;
        same(
            "auto_delete",
            cur.auto_delete == def.auto_delete,
            &def.auto_delete,
            &cur.auto_delete,
        )?;
        same(
            "internal",
            cur.internal == def.internal,
            &def.internal,
            &cur.internal,
        )?;
        same(
            "type",
            cur.delayed == def.delayed,
            &def.type_name(),
            &cur.type_name(),
        )?;
        Ok(())
    }

    /// exchange.delete. Deleting a missing exchange succeeds, as in RabbitMQ.
    pub fn delete_exchange(&self, name: &str, if_unused: bool) -> Result<Option<DurableWait>> {
        if name.is_empty() || name.starts_with("amq.") {
            return Err(EngineError::AccessRefused(format!(
                "operation not permitted on exchange '{name}' in vhost '{}'",
                self.name
            )));
        }
        let Some(x) = self.exchanges.read().get(name).cloned() else {
            return Ok(None);
        };
        let mut emptied = Vec::new();
        let wait = self.remove_exchange(&x, if_unused, &mut emptied)?;
        self.auto_delete_exchanges(emptied);
        Ok(wait)
    }

    /// Removes exactly the exchange `x` (not a namesake declared since).
    /// Exchanges that lost a binding to it are pushed onto `emptied`, for
    /// the caller's auto-delete worklist.
    fn remove_exchange(
        &self,
        x: &Arc<Exchange>,
        if_unused: bool,
        emptied: &mut Vec<Arc<Exchange>>,
    ) -> Result<Option<DurableWait>> {
        let engine = self.engine()?;
        let name = x.def.name.as_str();
        {
            let mut w = self.exchanges.write();
            match w.get(name) {
                Some(cur) if Arc::ptr_eq(cur, x) => {}
                _ => return Ok(None),
            }
            if if_unused && x.binding_count() > 0 {
                return Err(EngineError::PreconditionFailed(format!(
                    "exchange '{name}' in vhost '{}' in use",
                    self.name
                )));
            }
            w.remove(name);
        }
        x.deleted.store(true, Ordering::Release);
        // Bindings from it, and exchange-to-exchange bindings to it.
        let mut keys: Vec<Vec<u8>> = Vec::new();
        for b in x.unbind_everything() {
            keys.push(meta::binding_key(&self.name, &binding_def(name, &b)));
        }
        let dest = Destination::Exchange(x.clone());
        // Only the exchanges bound to it (the reverse index), not all.
        for other in dest.sources().list() {
            let gone = other.unbind_all_to(&dest);
            if gone.is_empty() {
                continue;
            }
            for b in gone {
                keys.push(meta::binding_key(
                    &self.name,
                    &binding_def(&other.def.name, &b),
                ));
            }
            emptied.push(other);
        }
        if !x.def.durable {
            return Ok(None);
        }
        keys.push(meta::exchange_key(&self.name, name));
        let ops: Vec<Op> = keys.iter().map(|k| Op::DeleteMeta { key: k }).collect();
        Ok(Some(engine.persist(&ops)?))
    }

    /// queue.declare.
    pub fn declare_queue(&self, req: QueueDeclare) -> Result<(QueueDeclared, Option<DurableWait>)> {
        self.declare_queue_as(req, None)
    }

    /// queue.declare, a server-named queue getting `generated` (picked by
    /// the caller, which checked permissions on it) if given.
    pub(crate) fn declare_queue_as(
        &self,
        req: QueueDeclare,
        generated: Option<String>,
    ) -> Result<(QueueDeclared, Option<DurableWait>)> {
        let engine = self.engine()?;
        let name = if req.name.is_empty() && !req.passive {
            generated.unwrap_or_else(generated_name)
        } else {
            req.name.clone()
        };
        let existing = self.queues.read().get(&name).cloned();
        if let Some(q) = existing {
            check_exclusive(&q, req.connection, &self.name)?;
            if !req.passive {
                self.queue_equivalent(&q, &req, &name)?;
            }
            q.touch();
            let declared = QueueDeclared {
                name,
                messages: q.message_count(),
                consumers: q.consumer_count(),
            };
            // Its creation may still be on its way to disk: answer only
            // once it is durable.
            let wait = self.barrier(q.def.durable && q.exclusive_owner().is_none())?;
            return Ok((declared, wait));
        }
        if req.passive {
            return Err(not_found_queue(&name, &self.name));
        }
        let args = self.check_new_queue(&name, &req)?;
        let mut w = self.queues.write();
        if w.contains_key(&name) {
            // Raced with another declare: answer as for an existing queue.
            drop(w);
            return self.declare_queue(QueueDeclare { name, ..req });
        }
        // Under the write lock: two declares cannot both take the last place.
        self.quota.check_queue(&self.name, &name, w.len())?;
        let def = QueueDef {
            name: name.clone(),
            durable: req.durable,
            auto_delete: req.auto_delete,
            arguments: req.arguments.clone(),
            partitions: (0..args.partitions)
                .map(|_| engine.allocate_partition().0)
                .collect(),
        };
        // Exclusive queues die with their connection, so they are never stored.
        let wait = if req.durable && !req.exclusive {
            let key = meta::queue_key(&self.name, &name);
            let value =
                serde_json::to_vec(&def).map_err(|e| EngineError::CommandInvalid(e.to_string()))?;
            let next = serde_json::to_vec(&engine.next_partition_hint()).unwrap_or_default();
            // The counter first: the queue's ticket (later, also metadata)
            // covers it.
            engine.persist(&[Op::PutMeta {
                key: meta::NEXT_PARTITION_KEY,
                value: &next,
            }])?;
            match engine.persist_new(&key, &value)? {
                Some(wait) => Some(wait),
                None => {
                    // Another handle of the store declared it first: take
                    // its definition and answer as for an existing one.
                    drop(w);
                    engine.apply_definition_changes();
                    if self.has_queue(&name) {
                        return self.declare_queue_as(QueueDeclare { name, ..req }, None);
                    }
                    return Err(declared_elsewhere("queue", &name, &self.name));
                }
            }
        } else {
            None
        };
        let owner = req.exclusive.then_some(req.connection);
        let q = Queue::with_timers(
            def,
            self.name.clone(),
            owner,
            Some(engine.timers.clone()),
            Some(self.quota.clone()),
        );
        self.apply_policy(&q);
        q.touch();
        w.insert(name.clone(), q);
        Ok((
            QueueDeclared {
                name,
                messages: 0,
                consumers: 0,
            },
            wait,
        ))
    }

    /// A redeclare of `q` as `req` (under `name`) is equivalent
    /// (RabbitMQ's 406 texts; an exclusivity mismatch is 405).
    pub(crate) fn queue_equivalent(&self, q: &Queue, req: &QueueDeclare, name: &str) -> Result<()> {
        let same = |arg: &str, ok: bool, recv: &dyn Display, current: &dyn Display| {
            ok.then_some(())
                .ok_or_else(|| inequivalent(arg, "queue", name, &self.name, recv, current))
        };
        same(
            "durable",
            q.def.durable == req.durable,
            &req.durable,
            &q.def.durable,
        )?;
        if q.exclusive_owner().is_some() != req.exclusive {
            // RabbitMQ answers an exclusivity mismatch as a lock conflict.
            return Err(EngineError::ResourceLocked(format!(
                "cannot obtain exclusive access to locked queue '{name}' in vhost '{}'",
                self.name
            )));
        }
        same(
            "auto_delete",
            q.def.auto_delete == req.auto_delete,
            &req.auto_delete,
            &q.def.auto_delete,
        )?;
        let changed = self.changed_arguments_of(q);
        let declared = changed.as_ref().unwrap_or(&q.def.arguments);
        if let Some((k, recv, cur)) = differing_x_arg(&req.arguments, declared) {
            return Err(inequivalent(&k, "queue", name, &self.name, recv, cur));
        }
        Ok(())
    }

    /// A new queue `name` as `req` declares it is acceptable: not reserved,
    /// within the size limits ([`crate::bounds`]), its arguments valid for
    /// its type. Returns the parsed arguments.
    pub(crate) fn check_new_queue(&self, name: &str, req: &QueueDeclare) -> Result<QueueArgs> {
        if name.is_empty() {
            return Err(EngineError::PreconditionFailed(format!(
                "a queue needs a name in vhost '{}'",
                self.name
            )));
        }
        crate::bounds::check_name("queue", name)?;
        crate::bounds::check_arguments(
            &format_args!("queue '{name}' in vhost '{}'", self.name),
            &req.arguments,
        )?;
        if name.starts_with("amq.") && !req.name.is_empty() {
            return Err(EngineError::AccessRefused(format!(
                "queue name '{name}' contains reserved prefix 'amq.*'"
            )));
        }
        let args = crate::args::QueueArgs::parse(&req.arguments)
            .map_err(|e| EngineError::PreconditionFailed(e.message(name, &self.name)))?;
        if let Some((arg, type_name)) = QueueArgs::wrong_type(&req.arguments, args.queue_type) {
            return Err(EngineError::PreconditionFailed(format!(
                "invalid arg '{arg}' for queue '{name}' in vhost '{}' of queue type {type_name}",
                self.name
            )));
        }
        if matches!(
            args.queue_type,
            crate::args::QueueType::Quorum | crate::args::QueueType::Stream
        ) {
            // RabbitMQ's checks, in its order: a quorum queue is replicated
            // and durable by nature.
            let bad = if req.auto_delete {
                Some("auto-delete")
            } else if req.exclusive {
                Some("exclusive-owner")
            } else if !req.durable {
                Some("non-durable")
            } else {
                None
            };
            if let Some(prop) = bad {
                return Err(EngineError::PreconditionFailed(format!(
                    "invalid property '{prop}' for queue '{name}' in vhost '{}'",
                    self.name
                )));
            }
        }
        Ok(args)
    }

    /// queue.delete; returns the number of messages deleted. Deleting a
    /// missing queue succeeds with 0, as in RabbitMQ.
    pub fn delete_queue(
        &self,
        name: &str,
        if_unused: bool,
        if_empty: bool,
        connection: u64,
    ) -> Result<(u64, Option<DurableWait>)> {
        let q = match self.queue(name, connection) {
            Ok(q) => q,
            Err(EngineError::NotFound(_)) => return Ok((0, None)),
            Err(e) => return Err(e),
        };
        if if_unused && q.consumer_count() > 0 {
            return Err(EngineError::PreconditionFailed(format!(
                "queue '{name}' in vhost '{}' in use",
                self.name
            )));
        }
        if if_empty && q.message_count() > 0 {
            return Err(EngineError::PreconditionFailed(format!(
                "queue '{name}' in vhost '{}' not empty",
                self.name
            )));
        }
        self.remove_queue(&q)
    }

    /// Removes a queue: unbinds it, cancels its consumers, drops its
    /// messages. Each durable partition that held stored messages is
    /// emptied in the store by one [`Op::DropPartition`], whatever its
    /// depth, and its paged copies are released from the spill at once; a
    /// lease still out on it settles into nothing.
    fn remove_queue(&self, q: &Arc<Queue>) -> Result<(u64, Option<DurableWait>)> {
        let engine = self.engine()?;
        {
            let mut w = self.queues.write();
            match w.get(q.name()) {
                Some(cur) if Arc::ptr_eq(cur, q) => {
                    w.remove(q.name());
                }
                _ => return Ok((0, None)),
            }
        }
        self.changed_arguments.write().remove(q.name());
        q.mark_deleted();
        let dest = Destination::Queue(q.clone());
        let mut keys: Vec<Vec<u8>> = Vec::new();
        for x in dest.sources().list() {
            let gone = x.unbind_all_to(&dest);
            if gone.is_empty() {
                continue;
            }
            for b in gone {
                keys.push(meta::binding_key(&self.name, &binding_def(&x.def.name, &b)));
            }
            self.maybe_auto_delete_exchange(&x);
        }
        let mut count = 0u64;
        let mut dropped = Vec::new();
        for p in &q.partitions {
            let (consumers, entries) = p.delete();
            for c in consumers {
                c.cancel();
                c.conn.notice(Notice::ConsumerCancelled {
                    consumer: c.clone(),
                });
            }
            count += entries.len() as u64;
            if let Some(log) = &p.stream {
                log.close();
            }
            // Leased entries are not among `entries`: their records go too
            // (and a stream's events, which are never entries).
            if p.stream.is_some() || p.has_leases() || entries.iter().any(|e| e.location.is_some())
            {
                dropped.push(p);
            }
        }
        engine.retire(&q.partitions);
        let mut ops: Vec<Op> = dropped
            .iter()
            .filter(|p| p.durable)
            .map(|p| Op::DropPartition { partition: p.id })
            .collect();
        let stream_keys: Vec<Vec<u8>> = q
            .partitions
            .iter()
            .filter(|p| p.stream.is_some() && p.durable)
            .map(|p| crate::stream::state_key(p.id))
            .collect();
        ops.extend(stream_keys.iter().map(|k| Op::DeleteState { key: k }));
        let qkey = meta::queue_key(&self.name, q.name());
        if q.def.durable && q.exclusive_owner().is_none() {
            ops.push(Op::DeleteMeta { key: &qkey });
            ops.extend(keys.iter().map(|k| Op::DeleteMeta { key: k }));
        }
        let wait = if ops.is_empty() {
            None
        } else {
            Some(engine.persist(&ops)?)
        };
        // After the drops: the spill may share the store's accounting.
        if let Some(spill) = engine.store().spill() {
            for p in &dropped {
                spill.release_partition(p.id);
            }
        }
        Ok((count, wait))
    }

    /// The bindings to queue `name` (another connection's exclusive queue
    /// is locked), in no particular order: found through the queue's index
    /// of the exchanges bound to it and each one's index by destination, so
    /// the cost is the queue's own bindings, whatever else those exchanges
    /// hold (a reconnect storm of N sessions costs O(N), not O(N²)).
    pub fn queue_bindings(&self, name: &str, connection: u64) -> Result<Vec<BindingDef>> {
        let dest = Destination::Queue(self.queue(name, connection)?);
        let mut out = Vec::new();
        for x in dest.sources().list() {
            out.extend(
                x.bindings_to(&dest)
                    .iter()
                    .map(|b| binding_def(&x.def.name, b)),
            );
        }
        Ok(out)
    }

    /// queue.purge; returns the number of messages removed.
    pub fn purge_queue(&self, name: &str, connection: u64) -> Result<u64> {
        let q = self.queue(name, connection)?;
        let mut ops = Vec::new();
        let mut count = 0;
        for p in &q.partitions {
            for e in p.purge() {
                count += 1;
                if let Some(l) = e.location {
                    ops.push(Op::Settle {
                        partition: p.id,
                        id: e.id,
                        location: l,
                    });
                }
            }
        }
        let engine = self.engine()?;
        crate::spill::release_spilled(&**engine.store(), &mut ops);
        if !ops.is_empty() {
            engine.store().append(&ops, &mut Vec::new())?;
        }
        Ok(count)
    }

    /// queue.bind and exchange.bind.
    pub fn bind(
        &self,
        source: &str,
        kind: DestinationKind,
        destination: &str,
        key: &str,
        arguments: Value,
        connection: u64,
    ) -> Result<Option<DurableWait>> {
        self.check_binding(source, destination, key, &arguments)?;
        let (x, dest, durable) = self.binding_ends(source, kind, destination, connection)?;
        let added = x.bind(dest.clone(), key, arguments.clone());
        // A delete of either end that ran concurrently has already swept its
        // bindings: undo ours rather than route into (or from) a dead entity.
        let dead = x.deleted.load(Ordering::Acquire)
            || match &dest {
                Destination::Queue(q) => q.is_deleted(),
                Destination::Exchange(d) => d.deleted.load(Ordering::Acquire),
            };
        if dead {
            x.unbind(&dest, key, &arguments);
            return Err(EngineError::NotFound(format!(
                "{} '{destination}' in vhost '{}' was deleted",
                if kind == DestinationKind::Queue {
                    "queue"
                } else {
                    "exchange"
                },
                self.name
            )));
        }
        if !added {
            // Already bound; wait for the original's durability like a redeclare.
            return if durable {
                Ok(Some(self.engine()?.persist(&[])?))
            } else {
                Ok(None)
            };
        }
        if !durable {
            return Ok(None);
        }
        let def = BindingDef {
            source: source.to_string(),
            destination_kind: kind,
            destination: destination.to_string(),
            key: key.to_string(),
            arguments,
        };
        let k = meta::binding_key(&self.name, &def);
        let v = serde_json::to_vec(&def).map_err(|e| EngineError::CommandInvalid(e.to_string()))?;
        Ok(Some(
            self.engine()?
                .persist(&[Op::PutMeta { key: &k, value: &v }])?,
        ))
    }

    /// queue.unbind and exchange.unbind. Removing a missing binding, or one
    /// whose source or destination is missing, succeeds.
    pub fn unbind(
        &self,
        source: &str,
        kind: DestinationKind,
        destination: &str,
        key: &str,
        arguments: Value,
        connection: u64,
    ) -> Result<Option<DurableWait>> {
        // RabbitMQ answers unbind-ok when the source, the destination or
        // the binding is missing (teardown is idempotent); only the
        // default exchange and another connection's exclusive queue stay
        // errors.
        let (x, dest, durable) = match self.binding_ends(source, kind, destination, connection) {
            Ok(ends) => ends,
            Err(EngineError::NotFound(_)) => return Ok(None),
            Err(e) => return Err(e),
        };
        let removed = x.unbind(&dest, key, &arguments);
        if removed {
            self.maybe_auto_delete_exchange(&x);
        }
        if !removed || !durable {
            return Ok(None);
        }
        let def = BindingDef {
            source: source.to_string(),
            destination_kind: kind,
            destination: destination.to_string(),
            key: key.to_string(),
            arguments,
        };
        let k = meta::binding_key(&self.name, &def);
        Ok(Some(self.engine()?.persist(&[Op::DeleteMeta { key: &k }])?))
    }

    /// A binding's key and arguments are within the size limits
    /// ([`crate::bounds`]).
    pub(crate) fn check_binding(
        &self,
        source: &str,
        destination: &str,
        key: &str,
        arguments: &Value,
    ) -> Result<()> {
        crate::bounds::check_binding_key(key)?;
        crate::bounds::check_arguments(
            &format_args!(
                "binding of '{destination}' to exchange '{source}' in vhost '{}'",
                self.name
            ),
            arguments,
        )
    }

    fn binding_ends(
        &self,
        source: &str,
        kind: DestinationKind,
        destination: &str,
        connection: u64,
    ) -> Result<(Arc<Exchange>, Destination, bool)> {
        if source.is_empty() || (kind == DestinationKind::Exchange && destination.is_empty()) {
            return Err(EngineError::AccessRefused(format!(
                "operation not permitted on the default exchange in vhost '{}'",
                self.name
            )));
        }
        let dest = match kind {
            DestinationKind::Queue => Destination::Queue(self.queue(destination, connection)?),
            DestinationKind::Exchange => Destination::Exchange(self.exchange(destination)?),
        };
        let x = self.exchange(source)?;
        let durable = x.def.durable
            && match &dest {
                Destination::Queue(q) => q.def.durable && q.exclusive_owner().is_none(),
                Destination::Exchange(d) => d.def.durable,
            };
        Ok((x, dest, durable))
    }

    /// For an entity that already exists: resolves once everything appended
    /// so far (its creation included) is durable.
    fn barrier(&self, durable: bool) -> Result<Option<DurableWait>> {
        if !durable {
            return Ok(None);
        }
        Ok(Some(self.engine()?.persist(&[])?))
    }

    fn maybe_auto_delete_exchange(&self, x: &Arc<Exchange>) {
        self.auto_delete_exchanges(vec![x.clone()]);
    }

    /// Deletes the auto-delete exchanges of `work` left without bindings,
    /// and in turn those that this leaves without bindings: a worklist, not
    /// recursion, so a long chain of auto-delete exchanges cannot overflow
    /// the stack.
    fn auto_delete_exchanges(&self, mut work: Vec<Arc<Exchange>>) {
        while let Some(x) = work.pop() {
            if x.def.auto_delete && x.binding_count() == 0 && !x.deleted.load(Ordering::Acquire) {
                if let Err(e) = self.remove_exchange(&x, false, &mut work) {
                    tracing::warn!(exchange = %x.def.name, error = %e, "auto-delete of exchange failed");
                }
            }
        }
    }

    /// The queues a message reaches, and how it is routed. Missing
    /// exchange → 404; internal → 403.
    pub fn route(&self, input: &RouteInput<'_>, out: &mut Vec<Arc<Queue>>) -> Result<Routed> {
        if input.exchange.is_empty() {
            let queues = self.queues.read();
            if let Some(q) = queues.get(input.routing_key) {
                out.push(q.clone());
            }
            let mut extra = false;
            for_sender_selected(input.headers, |key| {
                if let Some(q) = queues.get(key) {
                    extra = true;
                    out.push(q.clone());
                }
            });
            if extra {
                out.sort_unstable_by_key(Arc::as_ptr);
                out.dedup_by(|a, b| Arc::ptr_eq(a, b));
            }
            return Ok(Routed::default());
        }
        let x = self.exchange(input.exchange)?;
        if x.def.internal {
            return Err(EngineError::AccessRefused(format!(
                "cannot publish to internal exchange '{}' in vhost '{}'",
                input.exchange, self.name
            )));
        }
        // The routing key and the CC/BCC keys route together, so an
        // alternate exchange takes the message only when none matched.
        let mut cc: Vec<Value> = Vec::new();
        for name in crate::exchange::SENDER_SELECTED {
            if input.headers.may_have(name) {
                cc.extend(input.headers.header(name));
            }
        }
        let alternate = |x: &Exchange| self.alternate_of(x);
        if cc.is_empty() {
            // The common case: no allocation.
            x.route_keys(&[input.routing_key], input.headers, &alternate, out);
        } else {
            let mut keys = vec![input.routing_key];
            for v in &cc {
                keys.extend(crate::exchange::header_routing_keys(v));
            }
            x.route_keys(&keys, input.headers, &alternate, out);
        }
        Ok(Routed {
            delayed: x.def.delayed,
        })
    }

    /// The alternate exchange of `x` (its `alternate-exchange` argument,
    /// else its policy's), if it exists. Asked only when `x` routes a
    /// message nowhere.
    fn alternate_of(&self, x: &Exchange) -> Option<Arc<Exchange>> {
        let name = match x.alternate_argument() {
            Some(n) => n.to_string(),
            None => {
                let policies = self.policies.read();
                policy::select_exchange(&policies, &x.def.name)?
                    .def
                    .definition
                    .get(crate::exchange::ALTERNATE_EXCHANGE)?
                    .as_str()?
                    .to_string()
            }
        };
        self.exchanges.read().get(&name).cloned()
    }

    /// Deletes `q` if it is still unused past its `x-expires` at `now_ms`
    /// (the engine's timer found it due; a use since then wins).
    pub(crate) fn expire_idle(&self, q: &Arc<Queue>, now_ms: u64) {
        if q.idle_deadline().is_some_and(|at| at <= now_ms) {
            tracing::info!(queue = %q.name(), tenant = %self.name, "deleting queue unused past its x-expires");
            if let Err(e) = self.remove_queue(q) {
                tracing::warn!(queue = %q.name(), error = %e, "expiring an idle queue failed");
            }
        }
    }

    /// Cancels consumer `c` of `q` and detaches it; deletes `q` if it is
    /// auto-delete and `c` was its last consumer.
    pub(crate) fn detach(&self, q: &Arc<Queue>, c: &Arc<Consumer>) {
        let left = q.detach_consumer(c);
        if left == Some(0) {
            // Idle from now on (x-expires counts from here).
            q.touch();
        }
        if left == Some(0) && q.def.auto_delete {
            if let Err(e) = self.remove_queue(q) {
                tracing::warn!(queue = %q.name(), error = %e, "auto-delete of queue failed");
            }
        }
    }

    /// Deletes the exclusive queues of a closed connection.
    pub fn connection_closed(&self, connection: u64) {
        let owned: Vec<_> = self
            .queues
            .read()
            .values()
            .filter(|q| q.exclusive_owner() == Some(connection))
            .cloned()
            .collect();
        for q in owned {
            if let Err(e) = self.remove_queue(&q) {
                tracing::warn!(queue = %q.name(), error = %e, "removing exclusive queue failed");
            }
        }
    }
}

/// Definitions changed through another handle of the store (`feed.rs`):
/// applied here in memory only, nothing written.
impl Tenant {
    /// Whether a queue named `name` exists here.
    pub(crate) fn has_queue(&self, name: &str) -> bool {
        self.queues.read().contains_key(name)
    }

    /// Another handle deleted exchange `name`: it goes, with its bindings.
    pub(crate) fn forget_exchange(&self, name: &str) {
        let Some(x) = self.exchanges.write().remove(name) else {
            return;
        };
        x.deleted.store(true, Ordering::Release);
        x.unbind_everything();
        let dest = Destination::Exchange(x.clone());
        for other in dest.sources().list() {
            other.unbind_all_to(&dest);
        }
    }

    /// Another handle deleted queue `name`: it goes, with its bindings; its
    /// consumers here are cancelled. Its messages are the deleting
    /// handle's to settle.
    pub(crate) fn forget_queue(&self, name: &str) {
        let Some(q) = self.queues.write().remove(name) else {
            return;
        };
        self.changed_arguments.write().remove(name);
        q.mark_deleted();
        let dest = Destination::Queue(q.clone());
        for x in dest.sources().list() {
            x.unbind_all_to(&dest);
        }
        for p in &q.partitions {
            let (consumers, _) = p.delete();
            for c in consumers {
                c.cancel();
                c.conn.notice(Notice::ConsumerCancelled {
                    consumer: c.clone(),
                });
            }
        }
    }

    /// Another handle removed binding `b`.
    pub(crate) fn forget_binding(&self, b: &BindingDef) {
        let Ok(x) = self.exchange(&b.source) else {
            return;
        };
        let dest = match b.destination_kind {
            DestinationKind::Queue => match self.queue_named(&b.destination) {
                Some(q) => Destination::Queue(q),
                None => return,
            },
            DestinationKind::Exchange => match self.exchange(&b.destination) {
                Ok(d) => Destination::Exchange(d),
                Err(_) => return,
            },
        };
        x.unbind(&dest, &b.key, &b.arguments);
    }
}

fn check_exclusive(q: &Queue, connection: u64, tenant: &str) -> Result<()> {
    match q.exclusive_owner() {
        Some(owner) if owner != connection => Err(EngineError::ResourceLocked(format!(
            "cannot obtain exclusive access to locked queue '{}' in vhost '{tenant}'. It could be originally declared on another connection or the exclusive property value does not match that of the original declaration.",
            q.name()
        ))),
        _ => Ok(()),
    }
}

fn binding_def(source: &str, b: &super::exchange::Binding) -> BindingDef {
    let (kind, name) = match &b.destination {
        Destination::Queue(q) => (DestinationKind::Queue, q.name().to_string()),
        Destination::Exchange(x) => (DestinationKind::Exchange, x.def.name.clone()),
    };
    BindingDef {
        source: source.to_string(),
        destination_kind: kind,
        destination: name,
        key: b.key.clone(),
        arguments: b.arguments.clone(),
    }
}

/// The first `x-` argument whose value differs between a redeclare and the
/// existing queue (RabbitMQ compares the arguments it understands).
fn differing_x_arg(received: &Value, current: &Value) -> Option<(String, String, String)> {
    const CHECKED: &[&str] = &[
        "x-queue-type",
        "x-message-ttl",
        "x-expires",
        "x-max-length",
        "x-max-length-bytes",
        "x-dead-letter-exchange",
        "x-dead-letter-routing-key",
        "x-max-priority",
        "x-overflow",
        "x-single-active-consumer",
        // Accepted for compatibility only (see args.rs), compared as
        // RabbitMQ 3.10 compares them.
        "x-queue-mode",
        "x-queue-master-locator",
        "x-queue-leader-locator",
        "x-quorum-initial-group-size",
        "x-dead-letter-strategy",
        "x-max-in-memory-length",
        "x-max-in-memory-bytes",
        "x-max-age",
        "x-stream-max-segment-size-bytes",
        // Weir's own: RabbitMQ does not know them, so checking them breaks
        // no RabbitMQ client, and a silently ignored difference (another
        // partition count) would surprise.
        "x-partitions",
        "x-delayed",
        "x-delayed-retry-type",
        "x-delayed-retry-min",
        "x-delayed-retry-max",
        "x-dedup-window",
        "x-dedup-on-message-id",
    ];
    // Checked for quorum queues only, as RabbitMQ does.
    const QUORUM: &[&str] = &["x-delivery-limit"];
    let quorum = current.get("x-queue-type").and_then(Value::as_str) == Some("quorum");
    let checked = CHECKED.iter().chain(QUORUM.iter().filter(|_| quorum));
    for k in checked {
        let r = received.get(*k);
        let c = current.get(*k);
        // x-queue-type 'classic' is the default and equals absent.
        let norm = |v: Option<&Value>| match v {
            Some(Value::String(s)) if *k == "x-queue-type" && s == "classic" => None,
            other => other.cloned(),
        };
        if norm(r) != norm(c) {
            let show = |v: Option<&Value>| {
                v.map(|v| v.to_string().trim_matches('"').to_string())
                    .unwrap_or_else(|| "none".into())
            };
            return Some((k.to_string(), show(r), show(c)));
        }
    }
    None
}

/// A server-generated queue name, `amq.gen-` plus 22 URL-safe characters.
pub(crate) fn generated_name() -> String {
    use std::sync::atomic::AtomicU64;
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    static SEED: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    // A random seed per process (not the clock: time is an input the engine
    // reads only through its `Clock`). Without OS randomness, the standard
    // library's hasher keys (themselves seeded by the OS) stand in.
    let seed = *SEED.get_or_init(|| {
        getrandom::u64().unwrap_or_else(|_| {
            use std::hash::{BuildHasher, Hasher};
            std::collections::hash_map::RandomState::new()
                .build_hasher()
                .finish()
        })
    });
    // splitmix64 over (seed, counter, pid): unique per process, unpredictable enough.
    let mut x = seed ^ n.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ ((std::process::id() as u64) << 32);
    let mut s = String::from("amq.gen-");
    for _ in 0..22 {
        x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        s.push(ALPHABET[(z % 64) as usize] as char);
    }
    s
}

/// A declare lost the race for `name` to another handle of the store, whose
/// definition did not arrive here.
fn declared_elsewhere(kind: &str, name: &str, tenant: &str) -> EngineError {
    EngineError::PreconditionFailed(format!(
        "{kind} '{name}' in vhost '{tenant}' was declared concurrently through another gateway; declare it again"
    ))
}
