//! SUBSCRIBE and UNSUBSCRIBE: a subscription is a binding of the session
//! queue to `amq.topic` (its options in the binding's arguments); a shared
//! subscription (`$share/group/filter`) is a consumer on the group's queue,
//! which every member consumes, so its messages spread over the group.

use super::connect::{binding_arguments, TOPIC_EXCHANGE};
use super::{AckKind, Session, Subscription, SCOPE};
use crate::engine::client::SubscribeOptions;
use crate::engine::meta::DestinationKind;
use crate::engine::retained::RetainedCursor;
use crate::engine::tenant::QueueDeclare;
use crate::engine::topic;
use serde_json::Value;
use weir_protocols::mqtt::SubscribeFilter;

const UNSPECIFIED_ERROR: u8 = 0x80;
/// v5 "Not authorized" (3.1.1 has only 0x80, which the adapter sends).
const NOT_AUTHORIZED: u8 = 0x87;
const QUOTA_EXCEEDED: u8 = 0x97;
const NO_SUBSCRIPTION_EXISTED: u8 = 0x11;

/// The queue of a shared subscription group.
fn shared_queue(group: &str, filter: &str) -> String {
    format!("mqtt-shared-{group}-{filter}")
}

/// The consumer tag of the session's membership in a group.
fn shared_tag(group: &str, filter: &str) -> Vec<u8> {
    format!("share:{group}:{filter}").into_bytes()
}

/// The session-state key recording a persistent session's membership in a
/// shared subscription group (NUL separates: MQTT strings hold none), so a
/// resumed session consumes the group's queue again.
pub(super) fn shared_state_key(group: &str, filter: &str) -> String {
    format!("{SHARED_STATE}\0{group}\0{filter}")
}

/// The first part of [`shared_state_key`].
pub(super) const SHARED_STATE: &str = "share";

impl Session {
    pub(super) fn on_subscribe(
        &mut self,
        packet_id: u16,
        filters: Vec<SubscribeFilter>,
        subscription_id: Option<u32>,
    ) {
        let mut codes = Vec::with_capacity(filters.len());
        for f in filters {
            if let Some(code) = f.invalid {
                codes.push(code);
                continue;
            }
            if !self.has_room_for(&f) {
                tracing::debug!(peer = %self.peer, filter = %f.filter, "MQTT subscribe over the session's subscription limit");
                let v5 = self.conn.version() == Some(weir_protocols::mqtt::Version::V5);
                codes.push(if v5 {
                    QUOTA_EXCEEDED
                } else {
                    UNSPECIFIED_ERROR
                });
                continue;
            }
            let sub = Subscription {
                filter: f
                    .shared
                    .as_ref()
                    .map_or_else(|| f.filter.clone(), |s| s.filter.clone()),
                qos: f.qos,
                no_local: f.no_local,
                retain_as_published: f.retain_as_published,
                subscription_id,
            };
            let r = match &f.shared {
                Some(s) => self.subscribe_shared(&s.group, sub, true),
                None => self.subscribe_own(sub, f.retain_handling),
            };
            let v5 = self.conn.version() == Some(weir_protocols::mqtt::Version::V5);
            codes.push(match r {
                Ok(()) => f.qos as u8,
                Err(e @ crate::engine::EngineError::AccessRefused(_)) => {
                    tracing::info!(peer = %self.peer, filter = %f.filter, error = %e, "MQTT subscription refused");
                    NOT_AUTHORIZED
                }
                // The tenant's max-queues or max-consumers (MQTT 5: 0x97).
                Err(crate::engine::EngineError::Quota(q)) if v5 => {
                    tracing::debug!(peer = %self.peer, filter = %f.filter, error = %q, "MQTT subscribe over quota");
                    QUOTA_EXCEEDED
                }
                Err(e) => {
                    tracing::debug!(peer = %self.peer, filter = %f.filter, error = %e, "MQTT subscribe failed");
                    UNSPECIFIED_ERROR
                }
            });
        }
        // A persistent session's subscriptions are durable bindings:
        // SUBACK once they are on disk.
        let durable = self.session_expiry_secs > 0;
        self.queue_ack(packet_id, AckKind::Subscribed(codes), 0, durable);
    }

    /// Whether `f` fits the session's subscription limit
    /// (`mqtt.max_subscriptions`): a filter it has already replaces its
    /// subscription and always fits.
    fn has_room_for(&self, f: &SubscribeFilter) -> bool {
        let max = self.shared.mqtt.max_subscriptions;
        if max == 0 || self.subscriptions.len() + self.shared_subs.len() < max {
            return true;
        }
        match &f.shared {
            Some(s) => self
                .shared_subs
                .contains_key(&shared_tag(&s.group, &s.filter)),
            None => self.subscriptions.iter().any(|s| s.filter == f.filter),
        }
    }

    /// A subscription on the session queue: bound, or re-bound with new
    /// options.
    fn subscribe_own(
        &mut self,
        sub: Subscription,
        retain_handling: u8,
    ) -> Result<(), crate::engine::EngineError> {
        if self.client.is_none() {
            return Ok(());
        }
        if !self.queue_open {
            self.declare_session_queue()?;
        }
        let key = topic::filter_to_binding_key(&sub.filter);
        let existed = self
            .subscriptions
            .iter()
            .position(|s| s.filter == sub.filter);
        let queue = self.queue();
        // Permissions (write on the queue, read on amq.topic, topic read on
        // the key) are checked by the engine client's calls.
        let Some(client) = self.client.as_mut() else {
            return Ok(());
        };
        if let Some(i) = existed {
            client.unbind(
                TOPIC_EXCHANGE,
                DestinationKind::Queue,
                &queue,
                &key,
                binding_arguments(&self.subscriptions[i]),
            )?;
            self.subscriptions.remove(i);
        }
        client.bind(
            TOPIC_EXCHANGE,
            DestinationKind::Queue,
            &queue,
            &key,
            binding_arguments(&sub),
        )?;
        let send_retained = match retain_handling {
            0 => true,
            1 => existed.is_none(),
            _ => false,
        };
        if send_retained {
            self.send_retained(&sub);
        }
        self.subscriptions.push(sub);
        Ok(())
    }

    /// A member of a shared subscription group consumes the group's queue.
    ///
    /// A persistent session's membership is part of the session (MQTT 5
    /// 4.8.2): recorded in its session state (`record`; a resumed session
    /// joins again from there), and the group's queue it makes is durable
    /// and stays without consumers, so messages for the group wait there
    /// while its members are offline; it expires as the member's session
    /// does (`x-expires`) and is bounded as a session queue is. A clean
    /// session's group queue goes with its last consumer. A queue that
    /// exists already is used as it is (its first member made it).
    pub(super) fn subscribe_shared(
        &mut self,
        group: &str,
        sub: Subscription,
        record: bool,
    ) -> Result<(), crate::engine::EngineError> {
        let queue = shared_queue(group, &sub.filter);
        let tag = shared_tag(group, &sub.filter);
        let persistent = self.session_expiry_secs > 0;
        if persistent && record {
            let options = binding_arguments(&sub).to_string().into_bytes();
            self.state_changes
                .push((shared_state_key(group, &sub.filter), Some(options)));
        }
        if let Some(existing) = self.shared_subs.get_mut(&tag) {
            *existing = (queue, sub);
            return Ok(());
        }
        let mut args = serde_json::Map::new();
        if persistent && self.session_expiry_secs != u32::MAX {
            args.insert(
                "x-expires".into(),
                serde_json::json!(u64::from(self.session_expiry_secs) * 1000),
            );
        }
        let max_queued = self.shared.mqtt.max_queued_messages;
        if persistent && max_queued > 0 {
            args.insert("x-max-length".into(), serde_json::json!(max_queued));
            args.insert("x-overflow".into(), serde_json::json!("drop-head"));
        }
        let Some(client) = self.client.as_mut() else {
            return Ok(());
        };
        let key = topic::filter_to_binding_key(&sub.filter);
        // Checked before the group's queue is made for nothing.
        client.authorize_binding(TOPIC_EXCHANGE, DestinationKind::Queue, &queue, &key)?;
        if client.queue(&queue).is_err() {
            let declared = client.declare_queue(QueueDeclare {
                name: queue.clone(),
                passive: false,
                durable: persistent,
                exclusive: false,
                auto_delete: !persistent,
                arguments: Value::Object(args),
                connection: self.conn_id,
            });
            // Another member may have made it meanwhile, its own way.
            if let Err(e) = declared {
                if client.queue(&queue).is_err() {
                    return Err(e);
                }
            }
        }
        client.bind(
            TOPIC_EXCHANGE,
            DestinationKind::Queue,
            &queue,
            &key,
            Value::Object(Default::default()),
        )?;
        client
            .subscribe(
                &queue,
                SubscribeOptions {
                    scope: SCOPE,
                    tag: tag.clone().into(),
                    prefetch_count: 0,
                    ..Default::default()
                },
            )
            .map_err(|e| match e {
                crate::engine::ClientError::Engine(e) => e,
                e => crate::engine::EngineError::CommandInvalid(e.to_string()),
            })?;
        self.shared_subs.insert(tag, (queue, sub));
        Ok(())
    }

    pub(super) fn on_unsubscribe(&mut self, packet_id: u16, filters: Vec<String>) {
        let mut codes = Vec::with_capacity(filters.len());
        for f in filters {
            let found = match weir_protocols::mqtt::validate_filter(&f, usize::MAX) {
                Ok(Some(shared)) => {
                    let tag = shared_tag(&shared.group, &shared.filter);
                    let had = self.shared_subs.remove(&tag).is_some();
                    if had {
                        if let Some(c) = self.client.as_mut() {
                            c.unsubscribe(SCOPE, &tag);
                        }
                        if self.session_expiry_secs > 0 {
                            self.state_changes
                                .push((shared_state_key(&shared.group, &shared.filter), None));
                        }
                    }
                    had
                }
                _ => self.unsubscribe_own(&f),
            };
            codes.push(if found { 0 } else { NO_SUBSCRIPTION_EXISTED });
        }
        let durable = self.session_expiry_secs > 0;
        self.queue_ack(packet_id, AckKind::Unsubscribed(codes), 0, durable);
    }

    fn unsubscribe_own(&mut self, filter: &str) -> bool {
        let Some(i) = self.subscriptions.iter().position(|s| s.filter == filter) else {
            return false;
        };
        let old = self.subscriptions.remove(i);
        // Its retained messages not sent yet are not owed any more.
        self.retained_out.retain(|r| r.cursor.filter() != filter);
        let queue = self.queue();
        if let Some(c) = self.client.as_mut() {
            let _ = c.unbind(
                TOPIC_EXCHANGE,
                DestinationKind::Queue,
                &queue,
                &topic::filter_to_binding_key(filter),
                binding_arguments(&old),
            );
        }
        true
    }

    /// Owes the client the retained messages matching a new subscription:
    /// a cursor over the tenant's retained messages, walked by
    /// `write_retained` as the client's window allows (sent with the retain
    /// flag, at most at the subscription's QoS). The same filter again
    /// (repeated in one SUBSCRIBE, or subscribed again before its retained
    /// messages went out) replaces the cursor: they are sent once.
    fn send_retained(&mut self, sub: &Subscription) {
        if self.client.is_none() {
            return;
        }
        self.retained_out
            .retain(|r| r.cursor.filter() != sub.filter.as_str());
        self.retained_out.push_back(RetainedSend {
            cursor: RetainedCursor::new(&sub.filter),
            qos: sub.qos,
            subscription_id: sub.subscription_id,
            found: std::collections::VecDeque::new(),
        });
    }
}

/// Retained messages owed to one subscription: where the lookup stands,
/// and the few it found that are not sent yet (references to the tenant's
/// copies, at most one step's worth).
pub(super) struct RetainedSend {
    pub(super) cursor: RetainedCursor,
    pub(super) qos: weir_protocols::mqtt::QoS,
    pub(super) subscription_id: Option<u32>,
    pub(super) found:
        std::collections::VecDeque<std::sync::Arc<crate::engine::retained::RetainedMessage>>,
}
