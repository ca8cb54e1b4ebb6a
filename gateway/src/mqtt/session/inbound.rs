//! PUBLISH from the client: routed through `amq.topic` (the topic mapped to
//! a routing key), stored like any publish; QoS 1 and 2 are answered
//! (PUBACK / PUBREC) in arrival order once what they stored is durable, as
//! AMQP confirms are. QoS 0 never waits.

use super::connect::TOPIC_EXCHANGE;
use super::{state_key, AckKind, PendingAck, Session};
use crate::engine::client::Published;
use crate::engine::message::Message;
// MQTT messages route by topic only: no header is looked at.
use crate::engine::properties::NoHeaders;
use crate::engine::tenant::RouteInput;
use crate::engine::{Client, EngineError};
use crate::mqtt::message_format;
use crate::session::durable::{Status, Ticket};
use bytes::Bytes;
use weir_protocols::mqtt::{Publish, QoS, Version};

/// MQTT 5 reason codes used here.
const NO_MATCHING_SUBSCRIBERS: u8 = 0x10;
const UNSPECIFIED_ERROR: u8 = 0x80;
const QUOTA_EXCEEDED: u8 = 0x97;
const NOT_AUTHORIZED: u8 = 0x87;

/// Routes and stores one MQTT publish through `client`. `publisher`: the
/// client id recorded for no-local subscriptions.
pub(super) fn route(
    client: &mut Client,
    p: &Publish,
    publisher: Option<&str>,
) -> Result<Published, EngineError> {
    let i = message_format::inbound(p, publisher, client.clock().now_ms());
    let route = RouteInput {
        exchange: TOPIC_EXCHANGE,
        routing_key: &i.routing_key,
        headers: &NoHeaders,
    };
    client.publish(&route, |id| Message {
        id,
        exchange: Bytes::from_static(TOPIC_EXCHANGE.as_bytes()),
        routing_key: Bytes::from(i.routing_key.clone().into_bytes()),
        properties: i.header.raw.clone(),
        body: p.payload.clone(),
        header_format: i.header.format,
        persistent: i.persistent,
        priority: 0,
        ttl_ms: i.ttl_ms,
    })
}

impl Session {
    pub(super) fn on_publish(&mut self, p: Publish) {
        let Some(client) = self.client.as_mut() else {
            return;
        };
        if let Some(m) = self.metrics.as_mut() {
            m.received();
        }
        // The tenant's max-message-size: dropped, and a QoS 1/2 publish
        // answered 0x97 (MQTT 5; 3.1.1 has no negative answer).
        if let Err(e) = client.check_message_size(p.payload.len() as u64) {
            tracing::debug!(peer = %self.peer, error = %e, "MQTT publish refused");
            if let Some(packet_id) = p.packet_id {
                let v5 = self.conn.version() == Some(Version::V5);
                let kind = if p.qos == QoS::ExactlyOnce {
                    AckKind::Received
                } else {
                    AckKind::Ack
                };
                self.queue_ack(packet_id, kind, if v5 { QUOTA_EXCEEDED } else { 0 }, false);
            }
            return;
        }
        let published = route(client, &p, Some(&self.client_id));
        let v5 = self.conn.version() == Some(Version::V5);
        if let Err(EngineError::AccessRefused(text)) = &published {
            // No write permission on amq.topic or the topic: nothing is
            // stored or retained. MQTT 5 answers 0x87 (QoS 1, 2); 3.1.1 has
            // no negative ack, so the connection is closed, as RabbitMQ's
            // MQTT plugin does.
            // Debug, not info: a client publishing where it may not
            // would write a log line per message.
            tracing::debug!(peer = %self.peer, topic = %p.topic, error = %text, "MQTT publish refused");
            match p.packet_id {
                Some(id) if v5 => {
                    let kind = if p.qos == QoS::ExactlyOnce {
                        AckKind::Received
                    } else {
                        AckKind::Ack
                    };
                    self.queue_ack(id, kind, NOT_AUTHORIZED, false);
                }
                _ if v5 => {}
                _ => self.conn.disconnect(NOT_AUTHORIZED, text),
            }
            return;
        }
        // Retained messages are kept per topic (an empty payload clears);
        // the store barrier below covers their metadata record too.
        let retained_ok = if p.retain { self.retain(&p) } else { true };
        let Some(packet_id) = p.packet_id else {
            return;
        };
        let (reason, needs_barrier) = match published {
            Ok(Published::Routed {
                needs_barrier,
                refused,
            }) => (if refused { QUOTA_EXCEEDED } else { 0 }, needs_barrier),
            Ok(Published::Unroutable) => (if v5 { NO_MATCHING_SUBSCRIBERS } else { 0 }, false),
            Ok(Published::NoSpace) => (QUOTA_EXCEEDED, false),
            Err(e) => {
                tracing::debug!(peer = %self.peer, error = %e, "MQTT publish failed");
                (UNSPECIFIED_ERROR, false)
            }
        };
        let reason = if retained_ok { reason } else { QUOTA_EXCEEDED };
        if p.qos == QoS::ExactlyOnce && reason < 0x80 {
            // Until PUBREL, a repeat of this id is the same message, also
            // after a restart (appended after the message itself: a crash
            // between the two can duplicate it, never lose it).
            let key = state_key("in", packet_id);
            self.state_changes.push((key, Some(Vec::new())));
        }
        // 3.1.1 has no negative PUBACK: a refused publish is acknowledged
        // (the message is dropped, as an unconfirmed publish may be).
        let reason = if v5 { reason } else { 0 };
        let (kind, durable) = if p.qos == QoS::ExactlyOnce {
            // Its id's session state must be on disk too.
            (AckKind::Received, true)
        } else {
            (AckKind::Ack, needs_barrier)
        };
        self.queue_ack(packet_id, kind, reason, durable);
    }

    /// PUBREL: the id is free again once that is durable (else a restart
    /// would take the client's next message with this id for a repeat).
    pub(super) fn on_pubrel(&mut self, packet_id: u16) {
        let key = state_key("in", packet_id);
        self.state_changes.push((key, None));
        self.queue_ack(packet_id, AckKind::Complete, 0, true);
    }

    /// Queues an answer in arrival order: after the batch's ticket when
    /// `durable` (its records must be on disk first) or when an earlier
    /// answer waits for one, else as soon as those before it went.
    pub(super) fn queue_ack(&mut self, packet_id: u16, kind: AckKind, reason: u8, durable: bool) {
        let ticket = if durable {
            self.durability.ticket()
        } else {
            self.acks.back().map_or(Ticket::NONE, |a| a.ticket)
        };
        self.acks.push_back(PendingAck {
            packet_id,
            kind,
            reason,
            ticket,
        });
    }

    /// Sends the acks whose tickets are durable, in order; a failed one
    /// closes the connection.
    pub(super) fn send_ready_acks(&mut self) {
        while let Some(a) = self.acks.front() {
            match self.durability.status(a.ticket) {
                Status::Pending => break,
                Status::Failed => return self.store_failed(),
                Status::Durable => {}
            }
            let Some(a) = self.acks.pop_front() else {
                break;
            };
            if matches!(a.kind, AckKind::Ack | AckKind::Received) {
                if let Some(m) = self.metrics.as_mut() {
                    m.confirmed_count(1);
                }
            }
            match a.kind {
                AckKind::Ack => self.conn.puback(a.packet_id, a.reason),
                AckKind::Received => self.conn.pubrec(a.packet_id, a.reason),
                AckKind::Complete => self.conn.pubcomp(a.packet_id),
                AckKind::Subscribed(codes) => self.conn.suback(a.packet_id, &codes),
                AckKind::Unsubscribed(codes) => self.conn.unsuback(a.packet_id, &codes),
            }
        }
    }

    /// Sets or clears the retained message of the publish's topic; false
    /// when a bound refused it.
    fn retain(&mut self, p: &Publish) -> bool {
        let Some(client) = self.client.as_mut() else {
            return true;
        };
        let now = client.clock().now_ms();
        let i = message_format::inbound(p, None, now);
        // Checked as the publish carrying it (a cached decision by now).
        match client.retain(&p.topic, i.header, p.payload.clone(), i.expires_at_ms, now) {
            Ok(wait) => {
                self.durability.after(wait);
                true
            }
            Err(e) => {
                tracing::debug!(peer = %self.peer, topic = %p.topic, error = %e, "retained message refused");
                false
            }
        }
    }
}
