//! Deliveries to the client: each message converted to an MQTT PUBLISH at
//! the QoS its subscriptions granted (at most the message's own), with the
//! matching subscriptions' identifiers; QoS 0 is settled when written, QoS
//! 1 and 2 hold their lease until PUBACK / PUBREC, within the client's
//! receive maximum.

use super::{Session, DELIVERY_HIGH_WATER, SCOPE};
use crate::engine::lease::Settle;
use crate::engine::message::now_ms;
use crate::mqtt::convert;
use std::time::Instant;
use weir_protocols::mqtt::{self, OutgoingPublish, QoS, SendError};

impl Session {
    pub(super) fn write_deliveries(&mut self) {
        self.write_retained();
        let Some(client) = self.client.as_mut() else {
            return;
        };
        let mut notices = Vec::new();
        client.drain(&mut notices);
        let codecs = self.engine.codecs();
        let batch_time = Instant::now();
        let now = now_ms();
        while self.conn.out.len() < DELIVERY_HIGH_WATER {
            let Some(d) = client.next_delivery() else {
                break;
            };
            let Some(message) = client.message_of(&d) else {
                client.discard(d);
                continue;
            };
            let out = match convert::outbound(&message, &d.entry, &codecs, now) {
                Ok(o) => o,
                Err(e) => {
                    // Published over AMQP with a key no MQTT topic has.
                    tracing::debug!(peer = %self.peer, error = %e, "delivery dropped");
                    self.next_tag += 1;
                    client.lease(SCOPE, self.next_tag, d, batch_time);
                    let _ = client.settle(SCOPE, self.next_tag, false, Settle::Ack);
                    continue;
                }
            };
            let subs: Vec<&super::Subscription> =
                match self.shared_subs.get(d.consumer.tag().as_ref()) {
                    Some((_, s)) => vec![s],
                    None => self.subscriptions.iter().collect(),
                };
            let matching: Vec<&super::Subscription> = subs
                .into_iter()
                .filter(|s| mqtt::matches(&s.filter, &out.topic))
                .collect();
            let own = out.publisher.as_deref() == Some(self.client_id.as_str());
            let wanted = matching.iter().any(|s| !(own && s.no_local));
            let expired = out.expired;
            self.next_tag += 1;
            let tag = self.next_tag;
            if !wanted || expired {
                // Not for this client after all ($-topics, no-local): gone.
                client.lease(SCOPE, tag, d, batch_time);
                let _ = client.settle(SCOPE, tag, false, Settle::Ack);
                continue;
            }
            let granted = matching
                .iter()
                .map(|s| s.qos)
                .max()
                .unwrap_or(QoS::AtMostOnce);
            let qos = granted.min(out.qos);
            if qos > QoS::AtMostOnce && !self.conn.can_send() {
                // The client's receive maximum: kept first in line here (a
                // QoS 2 id stays in flight until PUBCOMP, after its lease
                // gave the engine its credit back at PUBREC).
                client.defer(d);
                self.next_tag -= 1;
                break;
            }
            let mut ids: Vec<u32> = matching.iter().filter_map(|s| s.subscription_id).collect();
            ids.sort_unstable();
            ids.dedup();
            let sent = self.conn.publish(OutgoingPublish {
                topic: out.topic,
                payload: out.payload,
                qos,
                retain: out.retain && matching.iter().any(|s| s.retain_as_published),
                // Delivered before (possibly before a restart): the client
                // may have seen it.
                dup: d.entry.redelivered,
                packet_id: None,
                properties: out.properties,
                subscription_ids: ids,
            });
            match sent {
                Ok(Some(packet_id)) => {
                    client.lease(SCOPE, tag, d, batch_time);
                    self.inflight.insert(packet_id, Some(tag));
                }
                // QoS 0, or too large for the client (MQTT 5: dropped as if
                // delivered).
                Ok(None) | Err(SendError::TooLarge) => {
                    client.lease(SCOPE, tag, d, batch_time);
                    let _ = client.settle(SCOPE, tag, false, Settle::Ack);
                }
                Err(SendError::NoQuota) => {
                    client.defer(d);
                    self.next_tag -= 1;
                    break;
                }
                Err(SendError::NotConnected) => {
                    client.unsend(d);
                    self.next_tag -= 1;
                    break;
                }
            }
        }
        client.finish_deliveries();
        if client.has_uncommitted() {
            client.commit();
        }
    }

    /// The client acknowledged our publish `packet_id` (PUBACK, PUBREC or
    /// PUBCOMP): its lease is settled; `done` frees the id.
    pub(super) fn on_client_ack(&mut self, packet_id: u16, done: bool) {
        let tag = match self.inflight.get_mut(&packet_id) {
            Some(t) => t.take(),
            None => return,
        };
        if done {
            self.inflight.remove(&packet_id);
        }
        if let (Some(tag), Some(c)) = (tag, self.client.as_mut()) {
            let _ = c.settle(SCOPE, tag, false, Settle::Ack);
        }
    }
}

impl Session {
    /// Retained messages owed to new subscriptions, sent before queued
    /// deliveries and within the client's receive maximum. Not leased: an
    /// ack only frees the packet id.
    fn write_retained(&mut self) {
        while let Some(p) = self.retained_out.front() {
            if self.conn.out.len() >= DELIVERY_HIGH_WATER
                || (p.qos > QoS::AtMostOnce && !self.conn.can_send())
            {
                return;
            }
            let Some(p) = self.retained_out.pop_front() else {
                return;
            };
            match self.conn.publish(p) {
                Ok(Some(packet_id)) => {
                    self.inflight.insert(packet_id, None);
                }
                Ok(None) | Err(SendError::TooLarge) => {}
                Err(SendError::NoQuota) | Err(SendError::NotConnected) => return,
            }
        }
    }
}
