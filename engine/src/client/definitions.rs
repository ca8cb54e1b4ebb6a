//! Permissions, and the operations on definitions (exchanges, queues,
//! bindings) they guard.

use super::*;

impl Client {
    // ----- permissions, and the operations on definitions they guard -----

    /// Names this client's MQTT session: the client id `{client_id}` stands
    /// for in topic permissions, and the session whose state
    /// ([`Self::session_state`]) this client reaches, its own only.
    pub fn set_client_id(&mut self, client_id: &str) {
        self.authz.set_client_id(client_id);
        self.session_prefix = Some(format!("mqtt\0{client_id}\0"));
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
    pub(super) fn authorize_topic_read(&mut self, source: &str, key: &str) -> Result<()> {
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

    /// Sets or removes a queue's `x-expires` after its declare (an MQTT 5
    /// session's expiry changed at DISCONNECT): configure on the queue, as
    /// a declare; another connection's exclusive queue is locked. See
    /// [`crate::tenant::Tenant::set_queue_expires`].
    pub fn set_queue_expires(
        &mut self,
        name: &str,
        expires_ms: Option<u64>,
    ) -> Result<Option<DurableWait>> {
        self.authorize(Permission::Configure, Resource::Queue(name))?;
        self.tenant.queue(name, self.handle.id)?;
        self.tenant.set_queue_expires(name, expires_ms)
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

    /// The bindings to queue `name` (its subscriptions, for an MQTT session
    /// queue), looked up through the queue's own index of the exchanges
    /// bound to it: O(its bindings), however many the exchanges hold (see
    /// [`Tenant::queue_bindings`]). Read on the queue: what reaches a queue
    /// is part of reading it, and a session resuming consumes the queue
    /// next anyway. Another connection's exclusive queue is locked.
    pub fn queue_bindings(&mut self, name: &str) -> Result<Vec<crate::meta::BindingDef>> {
        self.authorize(Permission::Read, Resource::Queue(name))?;
        self.tenant.queue_bindings(name, self.handle.id)
    }

    /// Whether queue `name` exists (another connection's exclusive queue
    /// included). No permission: a passive declare tells any client of the
    /// tenant as much.
    pub fn queue_exists(&self, name: &str) -> bool {
        self.tenant.queue_named(name).is_some()
    }

    /// Whether exchange `name` exists; no permission, as
    /// [`Self::queue_exists`].
    pub fn exchange_exists(&self, name: &str) -> bool {
        self.tenant.exchange(name).is_ok()
    }

    /// The errors a publish of `route` would meet (no write permission,
    /// a missing or internal exchange), without publishing: for a protocol
    /// that must answer them before it has the whole message (AMQP's
    /// content header carrying an invalid expiration).
    pub fn check_route(&mut self, route: &RouteInput<'_>) -> Result<()> {
        self.authorize_publish(route)?;
        let mut scratch = Vec::new();
        self.tenant.route(route, &mut scratch).map(drop)
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
}
