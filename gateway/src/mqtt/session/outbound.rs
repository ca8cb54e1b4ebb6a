//! Deliveries to the client: each message converted to an MQTT PUBLISH at
//! the QoS its subscriptions granted (at most the message's own), with the
//! matching subscriptions' identifiers; QoS 0 is settled when written, QoS
//! 1 and 2 hold their lease until PUBACK / PUBREC, within the client's
//! receive maximum.

use super::{state_key, InFlight, Session, SCOPE};
use crate::engine::lease::Settle;
use crate::engine::topic;
use crate::mqtt::message_format;
use crate::session::DELIVERY_HIGH_WATER;
use std::time::Instant;
use weir_protocols::mqtt::{OutgoingPublish, QoS, SendError};

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
        let now = self.engine.clock().now_ms();
        while self.conn.out.len() < DELIVERY_HIGH_WATER {
            let Some(d) = client.next_delivery() else {
                break;
            };
            if self
                .resume
                .as_mut()
                .is_some_and(|r| r.skip.remove(&d.entry.id))
            {
                // The client received it (PUBREC) before a restart.
                self.next_tag += 1;
                settle_unsent(client, self.next_tag, d, batch_time, now);
                continue;
            }
            let Some(message) = client.message_of(&d) else {
                client.discard(d);
                continue;
            };
            let out = match message_format::outbound(&message, &d.entry, &codecs, now) {
                Ok(o) => o,
                Err(e) => {
                    // Published over AMQP with a key no MQTT topic has.
                    tracing::debug!(peer = %self.peer, error = %e, "delivery dropped");
                    self.next_tag += 1;
                    settle_unsent(client, self.next_tag, d, batch_time, now);
                    continue;
                }
            };
            // The subscriptions this delivery is for: its shared one, or the
            // session's own that match its topic (MQTT's matching: AMQP's `#`
            // also reaches `$` topics). No allocation per delivery.
            let subs: &[super::Subscription] = match self.shared_subs.get(d.consumer.tag().as_ref())
            {
                Some((_, s)) => std::slice::from_ref(s),
                None => &self.subscriptions,
            };
            let matching = || {
                subs.iter()
                    .filter(|s| topic::mqtt_matches(&s.filter, &out.topic))
            };
            let own = out.publisher.as_deref() == Some(self.client_id.as_str());
            let wanted = matching().any(|s| !(own && s.no_local));
            self.next_tag += 1;
            let tag = self.next_tag;
            if !wanted || out.expired {
                // Not for this client after all ($-topics, no-local): gone.
                settle_unsent(client, tag, d, batch_time, now);
                continue;
            }
            let granted = matching().map(|s| s.qos).max().unwrap_or(QoS::AtMostOnce);
            // Sent at QoS 2 under an id before a restart: again with that id.
            let resend2 = self
                .resume
                .as_ref()
                .and_then(|r| r.send.get(&d.entry.id).copied());
            let qos = if resend2.is_some() {
                QoS::ExactlyOnce
            } else {
                granted.min(out.qos)
            };
            // Sent at QoS 1 by the previous connection: again with its id
            // if that is free (else a new one; DUP either way).
            let resend = resend2.or_else(|| {
                let r = self.resume.as_ref()?;
                let id = *r.send1.get(&d.entry.id)?;
                (qos == QoS::AtLeastOnce && self.conn.packet_id_free(id)).then_some(id)
            });
            if qos > QoS::AtMostOnce && !self.conn.can_send() {
                // The client's receive maximum: kept first in line here (a
                // QoS 2 id stays in flight until PUBCOMP, after its lease
                // gave the engine its credit back at PUBREC).
                client.defer(d);
                self.next_tag -= 1;
                break;
            }
            let mut ids: Vec<u32> = matching().filter_map(|s| s.subscription_id).collect();
            ids.sort_unstable();
            ids.dedup();
            let retain = out.retain && matching().any(|s| s.retain_as_published);
            let enqueued_ms = d.entry.enqueued_ms;
            let sent = self.conn.publish(OutgoingPublish {
                topic: out.topic,
                payload: out.payload,
                qos,
                retain,
                // Delivered before (possibly before a restart): the client
                // may have seen it.
                dup: d.entry.redelivered || resend.is_some(),
                packet_id: resend,
                properties: out.properties,
                subscription_ids: ids,
            });
            match sent {
                Ok(Some(packet_id)) => {
                    if let Some(m) = self.metrics.as_mut() {
                        m.delivered(enqueued_ms, now);
                    }
                    let id = d.entry.id;
                    client.lease(SCOPE, tag, d, batch_time, now);
                    if let Some(r) = self.resume.as_mut() {
                        r.send.remove(&id);
                        r.send1.remove(&id);
                        if r.send.is_empty() && r.send1.is_empty() && r.skip.is_empty() {
                            self.resume = None;
                        }
                    }
                    self.inflight.insert(
                        packet_id,
                        InFlight {
                            tag: Some(tag),
                            message: Some(id),
                            stored: qos == QoS::ExactlyOnce,
                        },
                    );
                    if qos == QoS::ExactlyOnce {
                        // The id is the message's from now on, also after a
                        // restart: stored before the PUBLISH leaves.
                        let key = state_key("out", packet_id);
                        let mut v = vec![b'P'];
                        v.extend_from_slice(&id.to_le_bytes());
                        self.state_changes.push((key, Some(v)));
                    }
                }
                // QoS 0, or too large for the client (MQTT 5: dropped as if
                // delivered).
                Ok(None) => {
                    if let Some(m) = self.metrics.as_mut() {
                        m.delivered(enqueued_ms, now);
                    }
                    settle_unsent(client, tag, d, batch_time, now)
                }
                Err(SendError::TooLarge) => settle_unsent(client, tag, d, batch_time, now),
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
        // State before settles, as at the end of a batch.
        self.flush_state();
        if let Some(client) = self.client.as_mut() {
            if client.has_uncommitted() {
                client.commit();
            }
        }
        self.request_barrier();
    }

    /// PUBACK: the message is done.
    pub(super) fn on_puback(&mut self, packet_id: u16) {
        if let Some(f) = self.inflight.remove(&packet_id) {
            self.settle(f.tag);
        }
    }

    /// PUBREC: the client has the message. Its id stays in flight until
    /// PUBCOMP, recorded as received before the message's settle (so a
    /// restart sends PUBREL, never the message again); a failure reason
    /// ends the exchange.
    pub(super) fn on_pubrec(&mut self, packet_id: u16, reason: u8) {
        let Some(f) = self.inflight.get_mut(&packet_id) else {
            return;
        };
        let tag = f.tag.take();
        let message = f.message.filter(|_| f.stored);
        let key = state_key("out", packet_id);
        if reason >= 0x80 {
            self.inflight.remove(&packet_id);
            if message.is_some() {
                self.state_changes.push((key, None));
            }
        } else if let Some(id) = message {
            let mut v = vec![b'R'];
            v.extend_from_slice(&id.to_le_bytes());
            self.state_changes.push((key, Some(v)));
        }
        self.settle(tag);
    }

    /// PUBCOMP: the id is free.
    pub(super) fn on_pubcomp(&mut self, packet_id: u16) {
        if let Some(f) = self.inflight.remove(&packet_id) {
            if f.stored {
                let key = state_key("out", packet_id);
                self.state_changes.push((key, None));
            }
            self.settle(f.tag);
        }
    }

    fn settle(&mut self, tag: Option<u64>) {
        if let (Some(tag), Some(c)) = (tag, self.client.as_mut()) {
            let _ = c.settle(SCOPE, tag, false, Settle::Ack);
        }
    }
}

/// Settles a delivery the client will not get (or needs no ack for) as
/// done: leased under `tag` and acknowledged at once.
fn settle_unsent(
    client: &mut crate::engine::Client,
    tag: u64,
    d: crate::engine::consumer::Delivery,
    now: Instant,
    now_ms: u64,
) {
    client.lease(SCOPE, tag, d, now, now_ms);
    let _ = client.settle(SCOPE, tag, false, Settle::Ack);
}

/// Retained messages looked up per step for one subscription: a few more
/// than a window usually has room for, few enough to hold.
const RETAINED_BATCH: usize = 32;
/// Lookup steps (each at most `STEP_NODES` index nodes) per turn of the
/// session loop; with more to do, the task yields and comes back.
const RETAINED_STEPS: usize = 4;

impl Session {
    /// Retained messages owed to new subscriptions, in subscription order,
    /// sent before queued deliveries and within the client's receive
    /// maximum and the output high water: each subscription's cursor is
    /// walked only as far as they allow, so nothing is queued beyond the
    /// client's window. Not leased: an ack only frees the packet id. Sets
    /// `retained_yield` when it stopped for its step budget, not for the
    /// client.
    fn write_retained(&mut self) {
        self.retained_yield = false;
        if self.retained_out.is_empty() {
            return;
        }
        if self.client.is_none() {
            return;
        }
        let codecs = self.engine.codecs();
        let now = self.engine.clock().now_ms();
        let mut steps = 0;
        while let Some(r) = self.retained_out.front_mut() {
            if self.conn.out.len() >= DELIVERY_HIGH_WATER {
                return;
            }
            let Some(m) = r.found.front() else {
                if r.cursor.is_done() {
                    self.retained_out.pop_front();
                    continue;
                }
                if r.qos > QoS::AtMostOnce && !self.conn.can_send() {
                    return;
                }
                if steps == RETAINED_STEPS {
                    self.retained_yield = true;
                    return;
                }
                steps += 1;
                let Some(client) = self.client.as_mut() else {
                    return;
                };
                // Checked as the subscription is: a revoked permission
                // ends the lookup.
                if let Err(e) =
                    client.retained_next(&mut r.cursor, RETAINED_BATCH, now, &mut r.found)
                {
                    tracing::debug!(peer = %self.peer, filter = %r.cursor.filter(), error = %e, "retained messages not sent");
                    self.retained_out.pop_front();
                }
                continue;
            };
            let out = match message_format::outbound_retained(m, &codecs, now) {
                Ok(o) if !o.expired => o,
                _ => {
                    r.found.pop_front();
                    continue;
                }
            };
            let qos = out.qos.min(r.qos);
            if qos > QoS::AtMostOnce && !self.conn.can_send() {
                return;
            }
            r.found.pop_front();
            let p = OutgoingPublish {
                topic: out.topic,
                payload: out.payload,
                qos,
                retain: true,
                dup: false,
                packet_id: None,
                properties: out.properties,
                subscription_ids: r.subscription_id.into_iter().collect(),
            };
            match self.conn.publish(p) {
                Ok(Some(packet_id)) => {
                    self.inflight.insert(
                        packet_id,
                        InFlight {
                            tag: None,
                            message: None,
                            stored: false,
                        },
                    );
                }
                Ok(None) | Err(SendError::TooLarge) => {}
                Err(SendError::NoQuota) | Err(SendError::NotConnected) => return,
            }
        }
    }
}
