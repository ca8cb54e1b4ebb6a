//! Durable users, permissions and topic permissions: the engine calls the
//! configuration applies at every start and the management API will use;
//! and definitions import ([`Engine::import`]): checked whole, stored as
//! one metadata batch.
//! Each change is appended to the store's metadata and applied in memory at
//! once (a revoked permission holds for the next operation of every
//! client); the returned wait resolves when it is durable.

use crate::error::{EngineError, Result};
use crate::meta;
use crate::permissions::{PermissionDef, TopicPermissionDef, UserDef};
use crate::tenant::{QueueDeclare, Tenant};
use crate::{DurableWait, Engine};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use weir_backend::{MetaChange, Op};

fn invalid(e: impl std::fmt::Display) -> EngineError {
    EngineError::PreconditionFailed(e.to_string())
}

fn json<T: serde::Serialize>(v: &T) -> Result<Vec<u8>> {
    serde_json::to_vec(v).map_err(|e| EngineError::CommandInvalid(e.to_string()))
}

/// A user's name and tags are within the size limits, its hash usable.
fn check_user(def: &UserDef) -> Result<()> {
    if def.name.is_empty() {
        return Err(invalid("a user needs a name"));
    }
    crate::bounds::check_name("user", &def.name)?;
    crate::bounds::check_tags(&def.name, &def.tags)?;
    crate::auth::check_hash(&def.name, &def.password_hash).map_err(invalid)
}

fn check_permission(def: &PermissionDef) -> Result<()> {
    for (what, p) in [
        ("configure pattern", &def.configure),
        ("write pattern", &def.write),
        ("read pattern", &def.read),
    ] {
        crate::bounds::check_pattern(what, p)?;
    }
    def.validate().map_err(invalid)
}

fn check_topic_permission(def: &TopicPermissionDef) -> Result<()> {
    crate::bounds::check_name("exchange", &def.exchange)?;
    crate::bounds::check_pattern("write pattern", &def.write)?;
    crate::bounds::check_pattern("read pattern", &def.read)?;
    def.validate().map_err(invalid)
}

/// Definitions the configuration file sets at a start (see
/// [`Engine::apply_configured`]).
#[derive(Clone, Debug, Default)]
pub struct Configured {
    /// Users, their hashes resolved.
    pub users: Vec<UserDef>,
    /// Permissions.
    pub permissions: Vec<PermissionDef>,
    /// Topic permissions.
    pub topic_permissions: Vec<TopicPermissionDef>,
}

impl Engine {
    /// The authenticator every protocol logs in with; its user table is
    /// this engine's users.
    pub fn authenticator(&self) -> &std::sync::Arc<crate::auth::Authenticator> {
        &self.auth
    }

    /// Every user's permissions, as clients check them.
    pub fn permissions(&self) -> &std::sync::Arc<crate::permissions::Permissions> {
        &self.permissions
    }

    /// The users, by name.
    pub fn users(&self) -> Vec<UserDef> {
        self.users.read().values().cloned().collect()
    }

    /// Adds or replaces a user (its hash is checked; cached logins of the
    /// user are forgotten at once).
    pub fn put_user(&self, def: UserDef) -> Result<DurableWait> {
        check_user(&def)?;
        self.auth
            .put(
                &def.name,
                &def.password_hash,
                def.tags.clone(),
                def.loopback_only,
            )
            .map_err(invalid)?;
        let wait = self.persist(&[Op::PutMeta {
            key: &meta::user_key(&def.name),
            value: &json(&def)?,
        }])?;
        self.users.write().insert(def.name.clone(), def);
        Ok(wait)
    }

    /// Deletes a user with its permissions and topic permissions (as
    /// RabbitMQ does); `None` when there was no such user.
    pub fn delete_user(&self, name: &str) -> Result<Option<DurableWait>> {
        if self.users.write().remove(name).is_none() {
            return Ok(None);
        }
        self.auth.remove(name);
        let mut keys = vec![meta::user_key(name)];
        for p in self.permissions.list() {
            if p.user == name {
                self.permissions.clear(name, &p.vhost);
                keys.push(meta::permission_key(&p.vhost, name));
            }
        }
        for t in self.permissions.list_topic() {
            if t.user == name {
                self.permissions
                    .clear_topic(name, &t.vhost, Some(&t.exchange));
                keys.push(meta::topic_permission_key(&t.vhost, name, &t.exchange));
            }
        }
        let ops: Vec<Op> = keys.iter().map(|k| Op::DeleteMeta { key: k }).collect();
        Ok(Some(self.persist(&ops)?))
    }

    /// Deletes tenant `name` with everything in it: queues (their messages
    /// settled, consumers cancelled), exchanges, bindings, policies and
    /// every user's permissions in it; its record leaves the store. The
    /// default tenant can be deleted too, as in RabbitMQ. Connections open
    /// on it are the caller's to close. The returned wait is the last
    /// metadata change's (the store makes them durable in order).
    pub fn delete_tenant(self: &std::sync::Arc<Self>, name: &str) -> Result<Option<DurableWait>> {
        let Some(t) = self.tenant(name) else {
            return Err(EngineError::NotFound(format!("no vhost '{name}'")));
        };
        // Out of the map first: no new client opens it meanwhile.
        self.tenants.write().remove(name);
        for q in t.queues() {
            let owner = q.exclusive_owner().unwrap_or(0);
            let _ = t.delete_queue(q.name(), false, false, owner)?;
        }
        for x in t.exchanges() {
            if x.def.name.is_empty() || x.def.name.starts_with("amq.") {
                continue;
            }
            let _ = t.delete_exchange(&x.def.name, false)?;
        }
        for p in t.policies() {
            // Durable in order with the tenant's deletion below.
            drop(t.delete_policy(&p.name)?);
        }
        for p in self.permissions.list() {
            if p.vhost == name {
                let _ = self.clear_permissions(&p.user, name)?;
            }
        }
        for p in self.permissions.list_topic() {
            if p.vhost == name {
                let _ = self.clear_topic_permissions(&p.user, name, None)?;
            }
        }
        Ok(Some(self.persist(&[Op::DeleteMeta {
            key: &meta::tenant_key(name),
        }])?))
    }

    fn check_user_and_tenant(&self, user: &str, vhost: &str) -> Result<()> {
        if !self.users.read().contains_key(user) {
            return Err(EngineError::NotFound(format!("no user '{user}'")));
        }
        if self.tenant(vhost).is_none() {
            return Err(EngineError::NotFound(format!("no vhost '{vhost}'")));
        }
        Ok(())
    }

    /// Sets (replaces) a user's permissions in a tenant; both must exist.
    pub fn set_permissions(&self, def: PermissionDef) -> Result<DurableWait> {
        self.check_user_and_tenant(&def.user, &def.vhost)?;
        check_permission(&def)?;
        let wait = self.persist(&[Op::PutMeta {
            key: &meta::permission_key(&def.vhost, &def.user),
            value: &json(&def)?,
        }])?;
        self.permissions.set(def).map_err(invalid)?;
        Ok(wait)
    }

    /// Removes a user's permissions in a tenant (the user can no longer
    /// open it); `None` when there were none.
    pub fn clear_permissions(&self, user: &str, vhost: &str) -> Result<Option<DurableWait>> {
        if !self.permissions.clear(user, vhost) {
            return Ok(None);
        }
        Ok(Some(self.persist(&[Op::DeleteMeta {
            key: &meta::permission_key(vhost, user),
        }])?))
    }

    /// Sets (replaces) a user's topic permissions on an exchange of a
    /// tenant; the user and the tenant must exist.
    pub fn set_topic_permissions(&self, def: TopicPermissionDef) -> Result<DurableWait> {
        self.check_user_and_tenant(&def.user, &def.vhost)?;
        check_topic_permission(&def)?;
        let wait = self.persist(&[Op::PutMeta {
            key: &meta::topic_permission_key(&def.vhost, &def.user, &def.exchange),
            value: &json(&def)?,
        }])?;
        self.permissions.set_topic(def).map_err(invalid)?;
        Ok(wait)
    }

    /// Removes a user's topic permissions in a tenant, on one exchange or
    /// (`None`) all; `None` when there were none.
    pub fn clear_topic_permissions(
        &self,
        user: &str,
        vhost: &str,
        exchange: Option<&str>,
    ) -> Result<Option<DurableWait>> {
        let removed = self.permissions.clear_topic(user, vhost, exchange);
        if removed.is_empty() {
            return Ok(None);
        }
        let keys: Vec<Vec<u8>> = removed
            .iter()
            .map(|t| meta::topic_permission_key(vhost, user, &t.exchange))
            .collect();
        let ops: Vec<Op> = keys.iter().map(|k| Op::DeleteMeta { key: k }).collect();
        Ok(Some(self.persist(&ops)?))
    }

    /// Makes the configuration's definitions current: sets every given
    /// user, permission and topic permission (unchanged ones are not
    /// rewritten), and removes those a previous configuration set
    /// (`from_config`) that this one no longer has. Definitions made
    /// otherwise (the management API) are left alone. Returns the waits of
    /// the changes.
    pub fn apply_configured(&self, c: Configured) -> Result<Vec<DurableWait>> {
        let mut waits = Vec::new();
        let wanted_users: std::collections::HashSet<&str> =
            c.users.iter().map(|u| u.name.as_str()).collect();
        for u in self.users() {
            if u.from_config && !wanted_users.contains(u.name.as_str()) {
                tracing::info!(user = %u.name, "user removed (no longer configured)");
                waits.extend(self.delete_user(&u.name)?);
            }
        }
        for u in &c.users {
            if self.users.read().get(&u.name) != Some(u) {
                waits.push(self.put_user(u.clone())?);
            }
        }
        let wanted: std::collections::HashSet<(&str, &str)> = c
            .permissions
            .iter()
            .map(|p| (p.user.as_str(), p.vhost.as_str()))
            .collect();
        for p in self.permissions.list() {
            if p.from_config && !wanted.contains(&(p.user.as_str(), p.vhost.as_str())) {
                waits.extend(self.clear_permissions(&p.user, &p.vhost)?);
            }
        }
        let current = self.permissions.list();
        for p in c.permissions {
            if !current.contains(&p) {
                waits.push(self.set_permissions(p)?);
            }
        }
        let wanted: std::collections::HashSet<(&str, &str, &str)> = c
            .topic_permissions
            .iter()
            .map(|t| (t.user.as_str(), t.vhost.as_str(), t.exchange.as_str()))
            .collect();
        for t in self.permissions.list_topic() {
            if t.from_config
                && !wanted.contains(&(t.user.as_str(), t.vhost.as_str(), t.exchange.as_str()))
            {
                waits.extend(self.clear_topic_permissions(&t.user, &t.vhost, Some(&t.exchange))?);
            }
        }
        let current = self.permissions.list_topic();
        for t in c.topic_permissions {
            if !current.contains(&t) {
                waits.push(self.set_topic_permissions(t)?);
            }
        }
        Ok(waits)
    }

    /// At recovery: a stored user.
    pub(crate) fn restore_user(&self, def: UserDef) {
        match self.auth.put(
            &def.name,
            &def.password_hash,
            def.tags.clone(),
            def.loopback_only,
        ) {
            Ok(()) => {
                self.users.write().insert(def.name.clone(), def);
            }
            Err(e) => tracing::warn!(user = %def.name, error = %e, "ignoring a stored user"),
        }
    }

    /// At recovery, when the store holds no user at all: RabbitMQ's
    /// default user `guest` (password `guest`, loopback only) with every
    /// permission on `/`, in memory only (a configuration sets its own).
    pub(crate) fn default_user(&self) {
        self.restore_user(UserDef {
            name: "guest".into(),
            password_hash: crate::auth::GUEST_PASSWORD_HASH.into(),
            tags: vec!["administrator".into()],
            loopback_only: true,
            from_config: true,
        });
        let mut p = PermissionDef::full("guest", crate::DEFAULT_TENANT);
        p.from_config = true;
        if let Err(e) = self.permissions.set(p) {
            tracing::warn!(error = %e, "default permissions");
        }
    }
}

/// A queue in a definitions import (never exclusive).
#[derive(Clone, Debug)]
pub struct ImportedQueue {
    /// Name.
    pub name: String,
    /// Survives restarts.
    pub durable: bool,
    /// Deleted after its last consumer goes.
    pub auto_delete: bool,
    /// Arguments.
    pub arguments: serde_json::Value,
}

/// A definitions document (RabbitMQ's `/api/definitions`), parsed by the
/// caller; each item of a tenant names it (the `String` of the pairs).
#[derive(Clone, Debug, Default)]
pub struct Import {
    /// Tenants (vhosts) created if missing.
    pub tenants: Vec<String>,
    /// Users, added or replaced.
    pub users: Vec<UserDef>,
    /// Permissions, set.
    pub permissions: Vec<PermissionDef>,
    /// Topic permissions, set.
    pub topic_permissions: Vec<TopicPermissionDef>,
    /// Policies, set.
    pub policies: Vec<(String, crate::policy::PolicyDef)>,
    /// Exchanges, declared (an existing one must be equivalent).
    pub exchanges: Vec<(String, crate::exchange::ExchangeDef)>,
    /// Queues, declared (an existing one must be equivalent).
    pub queues: Vec<(String, ImportedQueue)>,
    /// Bindings, added.
    pub bindings: Vec<(String, crate::meta::BindingDef)>,
}

impl Import {
    /// Items in the document.
    pub fn len(&self) -> usize {
        self.tenants.len()
            + self.users.len()
            + self.permissions.len()
            + self.topic_permissions.len()
            + self.policies.len()
            + self.exchanges.len()
            + self.queues.len()
            + self.bindings.len()
    }

    /// Whether it holds nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Validated import, ready to apply: what is new, per tenant.
struct Plan {
    tenants: Vec<String>,
    exchanges: Vec<(Arc<Tenant>, crate::exchange::ExchangeDef)>,
    queues: Vec<(Arc<Tenant>, crate::queue::QueueDef)>,
    bindings: Vec<(Arc<Tenant>, crate::meta::BindingDef)>,
    policies: Vec<(Arc<Tenant>, crate::policy::PolicyDef)>,
}

impl Engine {
    /// Imports a definitions document all or nothing: every item is
    /// checked first (against the existing definitions and the rest of the
    /// document: equivalence of redeclared queues and exchanges, binding
    /// ends, permissions' users and tenants, quotas, size limits), and the
    /// first problem refuses the whole import with nothing changed. Then
    /// every metadata change is appended as one [`Op::MetaBatch`] (one
    /// record, one fsync: after a crash the store holds all of it or none)
    /// and applied in memory as recovery would. The wait resolves when the
    /// batch is durable. Items that exist unchanged are left alone.
    ///
    /// A declare by a client racing with the import for a name the import
    /// creates keeps the client's (in memory; the stored definition is the
    /// import's until that queue or exchange changes again).
    pub fn import(self: &Arc<Self>, d: Import) -> Result<Option<DurableWait>> {
        let plan = self.check_import(&d)?;
        // The metadata, keyed so a key written twice is written once.
        let mut meta: BTreeMap<Vec<u8>, Vec<u8>> = BTreeMap::new();
        for t in &plan.tenants {
            meta.insert(meta::tenant_key(t), b"{}".to_vec());
        }
        for u in &d.users {
            meta.insert(meta::user_key(&u.name), json(u)?);
        }
        for p in &d.permissions {
            meta.insert(meta::permission_key(&p.vhost, &p.user), json(p)?);
        }
        for p in &d.topic_permissions {
            meta.insert(
                meta::topic_permission_key(&p.vhost, &p.user, &p.exchange),
                json(p)?,
            );
        }
        for (t, p) in &plan.policies {
            meta.insert(meta::policy_key(&t.name, &p.name), json(p)?);
        }
        for (t, x) in plan.exchanges.iter().filter(|(_, x)| x.durable) {
            meta.insert(meta::exchange_key(&t.name, &x.name), json(x)?);
        }
        let mut any_queue = false;
        for (t, q) in plan.queues.iter().filter(|(_, q)| q.durable) {
            meta.insert(meta::queue_key(&t.name, &q.name), json(q)?);
            any_queue = true;
        }
        if any_queue {
            meta.insert(
                meta::NEXT_PARTITION_KEY.to_vec(),
                json(&self.next_partition_hint())?,
            );
        }
        // Whether a binding is stored: both its ends are durable (looked up
        // by name, among the new ones first).
        let new_x: HashMap<(&str, &str), bool> = plan
            .exchanges
            .iter()
            .map(|(t, x)| ((&*t.name, x.name.as_str()), x.durable))
            .collect();
        let new_q: HashMap<(&str, &str), bool> = plan
            .queues
            .iter()
            .map(|(t, q)| ((&*t.name, q.name.as_str()), q.durable))
            .collect();
        let exchange_durable = |t: &Arc<Tenant>, name: &str| {
            new_x
                .get(&(&*t.name, name))
                .copied()
                .or_else(|| t.exchange(name).ok().map(|x| x.def.durable))
        };
        let durable_ends = |t: &Arc<Tenant>, b: &crate::meta::BindingDef| {
            let dest = match b.destination_kind {
                meta::DestinationKind::Queue => new_q
                    .get(&(&*t.name, b.destination.as_str()))
                    .copied()
                    .or_else(|| {
                        t.queue_named(&b.destination)
                            .map(|q| q.def.durable && q.exclusive_owner().is_none())
                    }),
                meta::DestinationKind::Exchange => exchange_durable(t, &b.destination),
            };
            exchange_durable(t, &b.source) == Some(true) && dest == Some(true)
        };
        for (t, b) in &plan.bindings {
            if durable_ends(t, b) {
                meta.insert(meta::binding_key(&t.name, b), json(b)?);
            }
        }
        let changes: Vec<MetaChange<'_>> = meta
            .iter()
            .map(|(k, v)| MetaChange::Put { key: k, value: v })
            .collect();
        let wait = if changes.is_empty() {
            None
        } else {
            Some(self.persist(&[Op::MetaBatch { changes: &changes }])?)
        };
        drop(changes);
        // In memory, as recovery restores what it reads. Items of a new
        // tenant were checked against a scratch object: they go to the
        // registered one.
        for t in &plan.tenants {
            self.tenant_or_create(t);
        }
        let registered = |t: Arc<Tenant>| self.tenant(&t.name).unwrap_or(t);
        for u in d.users {
            self.auth
                .put(&u.name, &u.password_hash, u.tags.clone(), u.loopback_only)
                .map_err(invalid)?;
            self.users.write().insert(u.name.clone(), u);
        }
        for p in d.permissions {
            self.permissions.set(p).map_err(invalid)?;
        }
        for p in d.topic_permissions {
            self.permissions.set_topic(p).map_err(invalid)?;
        }
        for (t, p) in plan.policies {
            registered(t).restore_policy(p)?;
        }
        for (t, x) in plan.exchanges {
            let t = registered(t);
            if t.exchange(&x.name).is_err() {
                t.restore_exchange(x);
            }
        }
        for (t, q) in plan.queues {
            let t = registered(t);
            if t.queue_named(&q.name).is_none() {
                t.restore_queue(q);
            }
        }
        for (t, b) in plan.bindings {
            registered(t).restore_binding(&b)?;
        }
        Ok(wait)
    }

    /// The tenant `name`, or (for one the import creates) a scratch one to
    /// check its items against, registered only when the import applies.
    fn import_tenant(
        self: &Arc<Self>,
        name: &str,
        new: &mut HashMap<String, Arc<Tenant>>,
    ) -> Result<Arc<Tenant>> {
        if let Some(t) = self.tenant(name) {
            return Ok(t);
        }
        // A document naming a vhost it does not create is malformed (400
        // over HTTP, as before imports were checked whole).
        new.get(name)
            .cloned()
            .ok_or_else(|| invalid(format!("no vhost '{name}'")))
    }

    /// Checks an import whole without changing anything (see
    /// [`Engine::import`]); what it would add.
    fn check_import(self: &Arc<Self>, d: &Import) -> Result<Plan> {
        let mut new_tenants: HashMap<String, Arc<Tenant>> = HashMap::new();
        let mut tenants = Vec::new();
        for t in &d.tenants {
            if t.is_empty() {
                return Err(invalid("a vhost needs a name"));
            }
            crate::bounds::check_name("vhost", t)?;
            if self.tenant(t).is_none() && !new_tenants.contains_key(t) {
                new_tenants.insert(
                    t.clone(),
                    Tenant::new(t, Arc::downgrade(self), self.clock.clone()),
                );
                tenants.push(t.clone());
            }
        }
        let mut users: HashSet<&str> = HashSet::new();
        for u in &d.users {
            check_user(u)?;
            users.insert(u.name.as_str());
        }
        let user_exists = |u: &str| users.contains(u) || self.users.read().contains_key(u);
        for p in &d.permissions {
            if !user_exists(&p.user) {
                return Err(EngineError::NotFound(format!("no user '{}'", p.user)));
            }
            self.import_tenant(&p.vhost, &mut new_tenants)?;
            check_permission(p)?;
        }
        for p in &d.topic_permissions {
            if !user_exists(&p.user) {
                return Err(EngineError::NotFound(format!("no user '{}'", p.user)));
            }
            self.import_tenant(&p.vhost, &mut new_tenants)?;
            check_topic_permission(p)?;
        }
        let mut policies = Vec::new();
        for (v, p) in &d.policies {
            let t = self.import_tenant(v, &mut new_tenants)?;
            t.check_policy(p.clone())?;
            policies.push((t, p.clone()));
        }
        // Exchanges: new ones, and the quota counting them.
        let mut exchanges: Vec<(Arc<Tenant>, crate::exchange::ExchangeDef)> = Vec::new();
        let mut planned_x: HashMap<(String, String), usize> = HashMap::new();
        let mut added_x: HashMap<String, usize> = HashMap::new();
        for (v, x) in &d.exchanges {
            let t = self.import_tenant(v, &mut new_tenants)?;
            if let Ok(cur) = t.exchange(&x.name) {
                t.exchange_equivalent(&cur.def, x)?;
                continue;
            }
            if let Some(i) = planned_x.get(&(v.clone(), x.name.clone())) {
                t.exchange_equivalent(&exchanges[*i].1, x)?;
                continue;
            }
            t.check_new_exchange(x)?;
            if t.quota().limits().max_exchanges.is_some() {
                // Counted once per tenant, then the import's added to it.
                let count = added_x.entry(v.clone()).or_insert_with(|| {
                    t.exchanges()
                        .iter()
                        .filter(|e| !e.def.name.starts_with("amq."))
                        .count()
                });
                t.quota().check_exchange(&t.name, &x.name, *count)?;
                *count += 1;
            }
            planned_x.insert((v.clone(), x.name.clone()), exchanges.len());
            exchanges.push((t, x.clone()));
        }
        let mut queues: Vec<(Arc<Tenant>, crate::queue::QueueDef)> = Vec::new();
        let mut planned_q: HashMap<(String, String), usize> = HashMap::new();
        let mut added_q: HashMap<String, usize> = HashMap::new();
        for (v, q) in &d.queues {
            let t = self.import_tenant(v, &mut new_tenants)?;
            let req = QueueDeclare {
                name: q.name.clone(),
                passive: false,
                durable: q.durable,
                exclusive: false,
                auto_delete: q.auto_delete,
                arguments: q.arguments.clone(),
                connection: 0,
            };
            if let Some(cur) = t.queue_named(&q.name) {
                t.queue_equivalent(&cur, &req, &q.name)?;
                continue;
            }
            if let Some(i) = planned_q.get(&(v.clone(), q.name.clone())) {
                let def = &queues[*i].1;
                let same = def.durable == q.durable
                    && def.auto_delete == q.auto_delete
                    && def.arguments == q.arguments;
                if !same {
                    return Err(invalid(format!(
                        "queue '{}' in vhost '{v}' is defined twice, differently",
                        q.name
                    )));
                }
                continue;
            }
            let args = t.check_new_queue(&q.name, &req)?;
            let count = added_q.entry(v.clone()).or_insert_with(|| t.queue_count());
            t.quota().check_queue(&t.name, &q.name, *count)?;
            *count += 1;
            planned_q.insert((v.clone(), q.name.clone()), queues.len());
            queues.push((
                t,
                crate::queue::QueueDef {
                    name: q.name.clone(),
                    durable: q.durable,
                    auto_delete: q.auto_delete,
                    arguments: q.arguments.clone(),
                    // Ids only: a failed import wastes a few, harmlessly.
                    partitions: (0..args.partitions)
                        .map(|_| self.allocate_partition().0)
                        .collect(),
                },
            ));
        }
        let mut bindings = Vec::new();
        for (v, b) in &d.bindings {
            let t = self.import_tenant(v, &mut new_tenants)?;
            t.check_binding(&b.source, &b.destination, &b.key, &b.arguments)?;
            if b.source.is_empty()
                || (b.destination_kind == meta::DestinationKind::Exchange
                    && b.destination.is_empty())
            {
                return Err(EngineError::AccessRefused(format!(
                    "operation not permitted on the default exchange in vhost '{v}'"
                )));
            }
            let key = |n: &str| (v.clone(), n.to_string());
            if t.exchange(&b.source).is_err() && !planned_x.contains_key(&key(&b.source)) {
                return Err(EngineError::NotFound(format!(
                    "no exchange '{}' in vhost '{v}'",
                    b.source
                )));
            }
            match b.destination_kind {
                meta::DestinationKind::Queue => match t.queue_named(&b.destination) {
                    Some(q) if q.exclusive_owner().is_some() => {
                        return Err(EngineError::ResourceLocked(format!(
                            "cannot obtain exclusive access to locked queue '{}' in vhost '{v}'",
                            b.destination
                        )))
                    }
                    Some(_) => {}
                    None if planned_q.contains_key(&key(&b.destination)) => {}
                    None => {
                        return Err(EngineError::NotFound(format!(
                            "no queue '{}' in vhost '{v}'",
                            b.destination
                        )))
                    }
                },
                meta::DestinationKind::Exchange => {
                    if t.exchange(&b.destination).is_err()
                        && !planned_x.contains_key(&key(&b.destination))
                    {
                        return Err(EngineError::NotFound(format!(
                            "no exchange '{}' in vhost '{v}'",
                            b.destination
                        )));
                    }
                }
            }
            bindings.push((t, b.clone()));
        }
        Ok(Plan {
            tenants,
            exchanges,
            queues,
            bindings,
            policies,
        })
    }
}
