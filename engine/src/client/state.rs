//! What a protocol session keeps in the engine besides messages: MQTT
//! retained messages and the session's own durable state, each through a
//! checked call.
//!
//! * Retained messages belong to the tenant's [`MQTT_EXCHANGE`] topics:
//!   setting one is checked as the publish that carries it (write on the
//!   exchange, topic write on the topic's routing key), reading them as the
//!   subscription that asks for them (read on the exchange, topic read on
//!   the filter's binding key). Both decisions are the client's cached ones,
//!   so the check costs a hash lookup after the publish or bind it follows.
//! * Session state is the state of this client's own session, named by
//!   [`Client::set_client_id`]: keys are relative to it, so a session can
//!   neither read nor change another's. No permission beyond the tenant's:
//!   the state is the session's, not a resource of the tenant.

use super::*;
use crate::properties::MessageHeader;
use crate::retained::{RetainError, RetainedCursor, RetainedMessage};
use crate::topic::{filter_to_binding_key, topic_to_routing_key, MQTT_EXCHANGE};

impl Client {
    // ----- retained messages (MQTT) -----

    /// Sets (non-empty `body`) or clears (empty) `topic`'s retained
    /// message (see [`Tenant::retain`]: bounds, expiry, the durability
    /// wait). Checked as a publish of `topic` to [`MQTT_EXCHANGE`]: write
    /// on the exchange and topic write on the topic's routing key (a will
    /// or publish its user may not send is not retained either).
    pub fn retain(
        &mut self,
        topic: &str,
        header: MessageHeader,
        body: Bytes,
        expires_at_ms: Option<u64>,
        now_ms: u64,
    ) -> Result<Option<DurableWait>, RetainError> {
        let key = topic_to_routing_key(topic);
        self.authorize_publish(&RouteInput {
            exchange: MQTT_EXCHANGE,
            routing_key: &key,
            headers: &crate::properties::NoHeaders,
        })?;
        self.tenant
            .retain(topic, header, body, expires_at_ms, now_ms)
    }

    /// Read on [`MQTT_EXCHANGE`] and topic read on `filter`'s binding key:
    /// the checks of the subscription the retained messages are sent for.
    fn authorize_retained_read(&mut self, filter: &str) -> Result<()> {
        self.authorize(Permission::Read, Resource::Exchange(MQTT_EXCHANGE))?;
        self.authorize_topic_read(MQTT_EXCHANGE, &filter_to_binding_key(filter))
    }

    /// Every retained message matching MQTT filter `filter`, unexpired at
    /// `now_ms`, in trie order, all at once (see [`Tenant::retained`]: for
    /// small sets; a session takes them with [`Self::retained_next`]).
    /// Checked as a subscription to `filter` is.
    pub fn retained(&mut self, filter: &str, now_ms: u64) -> Result<Vec<Arc<RetainedMessage>>> {
        self.authorize_retained_read(filter)?;
        Ok(self.tenant.retained(filter, now_ms))
    }

    /// One step of a lookup of retained messages (see
    /// [`Tenant::retained_next`]: at most `max` more, a bounded walk).
    /// Checked at every step as a subscription to the cursor's filter is,
    /// so a revoked permission stops a long lookup.
    pub fn retained_next(
        &mut self,
        cursor: &mut RetainedCursor,
        max: usize,
        now_ms: u64,
        out: &mut impl Extend<Arc<RetainedMessage>>,
    ) -> Result<()> {
        self.authorize_retained_read(cursor.filter())?;
        self.tenant.retained_next(cursor, max, now_ms, out);
        Ok(())
    }

    // ----- the session's own state -----

    /// The prefix of this client's session's state keys; an error before
    /// [`Self::set_client_id`] named the session.
    fn session_prefix(&self) -> Result<&str> {
        self.session_prefix.as_deref().ok_or_else(|| {
            EngineError::CommandInvalid("no session: the client id is not set".into())
        })
    }

    /// This client's session's durable state (MQTT: its QoS 2 packet ids),
    /// keys relative to the session, in key order.
    pub fn session_state(&self) -> Result<Vec<(String, Vec<u8>)>> {
        let prefix = self.session_prefix()?;
        Ok(self
            .tenant
            .session_state(prefix)
            .into_iter()
            .map(|(k, v)| (k[prefix.len()..].to_string(), v))
            .collect())
    }

    /// Sets (`Some`) or removes (`None`) values of this client's session
    /// state (keys relative to the session) in one store append; the wait
    /// resolves once it is durable.
    pub fn update_session_state(&self, changes: &[(&str, Option<&[u8]>)]) -> Result<DurableWait> {
        let prefix = self.session_prefix()?;
        let keys: Vec<String> = changes
            .iter()
            .map(|(k, _)| format!("{prefix}{k}"))
            .collect();
        let full: Vec<(&str, Option<&[u8]>)> = keys
            .iter()
            .zip(changes)
            .map(|(k, (_, v))| (k.as_str(), *v))
            .collect();
        self.tenant.update_session_state(&full)
    }

    /// Removes all of this client's session state (a new or ended
    /// session); None when there was none.
    pub fn clear_session_state(&self) -> Result<Option<DurableWait>> {
        let prefix = self.session_prefix()?;
        let keys: Vec<String> = self
            .tenant
            .session_state(prefix)
            .into_iter()
            .map(|(k, _)| k)
            .collect();
        if keys.is_empty() {
            return Ok(None);
        }
        let changes: Vec<(&str, Option<&[u8]>)> = keys.iter().map(|k| (k.as_str(), None)).collect();
        self.tenant.update_session_state(&changes).map(Some)
    }
}
