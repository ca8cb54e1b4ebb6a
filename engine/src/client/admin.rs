//! The management API's operations that reach beyond a connection's own
//! view: deleting or purging another connection's exclusive queue (as
//! RabbitMQ's management API does), and moving dead letters back to the
//! queue they died in. Only clients opened with
//! [`Client::open_management`] may call them, and each is checked against
//! the principal's permissions as its protocol counterpart is.

use super::*;
use crate::deadletter::death_source;

/// What [`Client::requeue_dead_letter`] did with a dead letter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeadLetterMove {
    /// A copy is in the queue it died in: acknowledge the original once
    /// the copy is durable (after a [`Client::durability_barrier`] when
    /// `needs_barrier`).
    Moved {
        /// The copy is durable only after a barrier.
        needs_barrier: bool,
    },
    /// It stays: it records no source queue, names the queue it is in,
    /// names a queue that is gone, or that queue refused it (a length
    /// limit).
    Kept,
}

impl Client {
    /// Refuses a connection's client: these calls are the management API's.
    fn require_management(&self, what: &str) -> Result<()> {
        if self.counted {
            return Err(EngineError::AccessRefused(format!(
                "{what} is a management operation"
            )));
        }
        Ok(())
    }

    /// Deletes queue `name` whoever owns it: another connection's exclusive
    /// queue is deleted as its owner would delete it. Configure on the
    /// queue, as queue.delete. Returns the messages it held.
    pub fn admin_delete_queue(
        &mut self,
        name: &str,
        if_unused: bool,
        if_empty: bool,
    ) -> Result<(u64, Option<DurableWait>)> {
        self.require_management("deleting a queue of any connection")?;
        self.authorize(Permission::Configure, Resource::Queue(name))?;
        let owner = self.owner_of(name);
        self.tenant.delete_queue(name, if_unused, if_empty, owner)
    }

    /// Purges queue `name` whoever owns it. Read on the queue, as
    /// queue.purge. Returns the messages removed.
    pub fn admin_purge_queue(&mut self, name: &str) -> Result<u64> {
        self.require_management("purging a queue of any connection")?;
        self.authorize(Permission::Read, Resource::Queue(name))?;
        let owner = self.owner_of(name);
        self.tenant.purge_queue(name, owner)
    }

    /// The connection queue `name` is exclusive to, else this client's own
    /// (so the tenant's exclusivity check passes either way).
    fn owner_of(&self, name: &str) -> u64 {
        self.tenant
            .queue_named(name)
            .and_then(|q| q.exclusive_owner())
            .unwrap_or(self.handle.id)
    }

    /// Moves dead letter `message`, taken from queue `from`, back to the
    /// queue it was dead-lettered from (`x-first-death-queue`, else the
    /// newest `x-death` entry's `queue`): a copy is published there through
    /// the default exchange, with the publish check (write on the default
    /// exchange). The caller took `message` with read on `from` and
    /// acknowledges it once the copy is durable; a [`DeadLetterMove::Kept`]
    /// one goes back.
    pub fn requeue_dead_letter(&mut self, from: &str, message: &Message) -> Result<DeadLetterMove> {
        self.require_management("moving dead letters")?;
        let source = self
            .codecs
            .decode(message.header_format, &message.properties)
            .ok()
            .and_then(|p| p.headers.as_ref().and_then(death_source));
        let Some(source) = source.filter(|s| s != from && self.queue_exists(s)) else {
            return Ok(DeadLetterMove::Kept);
        };
        // No header routes: a `CC` header of the dead letter must not send
        // the copy anywhere else.
        let route = RouteInput {
            exchange: "",
            routing_key: &source,
            headers: &crate::properties::NoHeaders,
        };
        let r = self.publish(&route, |id| Message {
            id,
            exchange: message.exchange.clone(),
            routing_key: message.routing_key.clone(),
            properties: message.properties.clone(),
            body: message.body.clone(),
            header_format: message.header_format,
            persistent: message.persistent,
            priority: message.priority,
            ttl_ms: message.ttl_ms,
        })?;
        Ok(match r {
            Published::Routed {
                needs_barrier,
                refused: false,
            } => DeadLetterMove::Moved { needs_barrier },
            _ => DeadLetterMove::Kept,
        })
    }
}
