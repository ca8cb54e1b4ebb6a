//! Durable users, permissions and topic permissions: the engine calls the
//! configuration applies at every start and the management API will use.
//! Each change is appended to the store's metadata and applied in memory at
//! once (a revoked permission holds for the next operation of every
//! client); the returned wait resolves when it is durable.

use crate::error::{EngineError, Result};
use crate::meta;
use crate::permissions::{PermissionDef, TopicPermissionDef, UserDef};
use crate::{DurableWait, Engine};
use weir_backend::Op;

fn invalid(e: impl std::fmt::Display) -> EngineError {
    EngineError::PreconditionFailed(e.to_string())
}

fn json<T: serde::Serialize>(v: &T) -> Result<Vec<u8>> {
    serde_json::to_vec(v).map_err(|e| EngineError::CommandInvalid(e.to_string()))
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
            let _ = t.delete_policy(&p.name)?;
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
        def.validate().map_err(invalid)?;
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
        def.validate().map_err(invalid)?;
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
