//! PUBLISH from the client: topic checks and aliases, the QoS and retain
//! limits, the receive maximum, and the QoS 1/2 acknowledgements the
//! session answers with.
//!
//! A QoS 2 packet id is remembered from the PUBLISH until the session's
//! PUBCOMP: a repeated PUBLISH with an id answered by PUBREC is answered
//! again without a second event (exactly once, MQTT 5 4.3.3).

use super::connection::{Connection, Phase};
use super::event::*;
use super::handshake::{message_property, qos_from};
use super::reason;
use super::topic::{validate_topic, TopicError};
use super::wire::{self, prop, Ack, Fault, Header, Reader, Value};
use bytes::Bytes;
use mqttbytes::{v4, v5};
use std::collections::HashMap;

/// Where a QoS 1/2 publish from the client is: what comes next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum InState {
    /// QoS 1, handed to the session: its `puback` comes next.
    Puback,
    /// QoS 2, handed to the session: its `pubrec` comes next.
    Pubrec,
    /// QoS 2, PUBREC sent: the client's PUBREL comes next.
    Pubrel,
    /// QoS 2, PUBREL passed on: the session's `pubcomp` comes next.
    Pubcomp,
}

/// The client-to-server half of the connection's state.
#[derive(Default)]
pub(super) struct Inbound {
    /// QoS 1/2 publishes not completed (the receive maximum counts these).
    in_flight: HashMap<u16, InState>,
    /// Topic aliases the client set (MQTT 5), at most the maximum we sent.
    aliases: HashMap<u16, String>,
}

impl Connection {
    /// A PUBLISH from the client (flags already checked).
    pub(super) fn on_publish(&mut self, h: Header, packet: Bytes) -> Result<Option<Event>, Fault> {
        let qos = qos_from((h.flags() >> 1) & 3).unwrap_or(QoS::AtMostOnce);
        let (topic, packet_id, payload, dup, retain, alias, properties) = if self.v5() {
            // Validate the property block before mqttbytes reads it.
            let body = packet.get(h.header_len..).unwrap_or_default();
            let mut r = Reader::new(body);
            r.binary()?;
            if qos != QoS::AtMostOnce {
                r.u16()?;
            }
            let mut alias = None;
            let mut properties = MessageProperties::default();
            wire::props(&mut r, prop::PUBLISH, "PUBLISH", |id, v| {
                if let (prop::TOPIC_ALIAS, Value::Two(a)) = (id, v) {
                    alias = Some(a);
                    return Ok(());
                }
                message_property(&mut properties, id, v)
            })?;
            let payload_len = r.remaining();
            let p = v5::Publish::read(h.codec(), packet)
                .map_err(|e| wire::codec_fault(e, "PUBLISH"))?;
            if p.payload.len() != payload_len {
                return Err(Fault::malformed("PUBLISH properties misread"));
            }
            (
                p.topic, p.pkid, p.payload, p.dup, p.retain, alias, properties,
            )
        } else {
            let p = v4::Publish::read(h.codec(), packet)
                .map_err(|e| wire::codec_fault(e, "PUBLISH"))?;
            (
                p.topic,
                p.pkid,
                p.payload,
                p.dup,
                p.retain,
                None,
                MessageProperties::default(),
            )
        };

        if qos > self.config.maximum_qos {
            return Err(Fault::new(
                reason::QOS_NOT_SUPPORTED,
                format!(
                    "QoS {} above the maximum {}",
                    qos as u8, self.config.maximum_qos as u8
                ),
            ));
        }
        if retain && !self.config.retain_available {
            return Err(Fault::new(
                reason::RETAIN_NOT_SUPPORTED,
                "retain is not supported",
            ));
        }
        let topic = self.resolve_topic(topic, alias)?;

        let packet_id = match qos {
            QoS::AtMostOnce => None,
            _ => Some(packet_id),
        };
        if let Some(id) = packet_id {
            match (self.inbound.in_flight.get(&id).copied(), qos) {
                (None, _) => {
                    // 3.1.1 has no receive maximum to enforce: the session
                    // paces such clients by reading less.
                    if self.v5()
                        && self.inbound.in_flight.len()
                            >= usize::from(self.config.receive_maximum.max(1))
                    {
                        return Err(Fault::new(
                            reason::RECEIVE_MAXIMUM_EXCEEDED,
                            format!(
                                "more than {} QoS 1/2 publishes unacknowledged",
                                self.config.receive_maximum
                            ),
                        ));
                    }
                    let state = if qos == QoS::AtLeastOnce {
                        InState::Puback
                    } else {
                        InState::Pubrec
                    };
                    self.inbound.in_flight.insert(id, state);
                }
                // A resend of a publish the session has not answered yet:
                // its answer will acknowledge both.
                (Some(InState::Puback), QoS::AtLeastOnce)
                | (Some(InState::Pubrec), QoS::ExactlyOnce) => return Ok(None),
                // Already received and PUBREC'd: must not be delivered twice.
                (Some(InState::Pubrel), QoS::ExactlyOnce) => {
                    self.write_pubrec(id, reason::SUCCESS);
                    return Ok(None);
                }
                (Some(_), _) => {
                    return Err(Fault::protocol(format!("packet identifier {id} in use")));
                }
            }
        }
        Ok(Some(Event::Publish(Publish {
            topic,
            payload,
            qos,
            retain,
            dup,
            packet_id,
            properties,
        })))
    }

    /// The topic of a PUBLISH, its alias applied (MQTT 5 3.3.2.3.4).
    fn resolve_topic(&mut self, topic: String, alias: Option<u16>) -> Result<String, Fault> {
        let topic = match alias {
            Some(a) if a == 0 || a > self.config.topic_alias_maximum => {
                return Err(Fault::new(
                    reason::TOPIC_ALIAS_INVALID,
                    format!(
                        "topic alias {a}, the maximum is {}",
                        self.config.topic_alias_maximum
                    ),
                ));
            }
            Some(a) if topic.is_empty() => match self.inbound.aliases.get(&a) {
                Some(t) => return Ok(t.clone()),
                // MQTT 5 3.3.4: a zero-length topic needs a known alias.
                None => return Err(Fault::protocol(format!("topic alias {a} was never set"))),
            },
            _ if topic.is_empty() && self.v5() => {
                return Err(Fault::protocol("empty topic name without a topic alias"));
            }
            _ => topic,
        };
        match validate_topic(&topic, self.config.max_topic_levels) {
            Ok(()) => {}
            Err(TopicError::Null) => return Err(Fault::malformed("topic name contains U+0000")),
            Err(e) => {
                return Err(Fault::new(
                    reason::TOPIC_NAME_INVALID,
                    format!("topic name: {e}"),
                ))
            }
        }
        if let Some(a) = alias {
            self.inbound.aliases.insert(a, topic.clone());
        }
        Ok(topic)
    }

    /// Answers a QoS 1 publish (reason 0 = success; MQTT 5 codes such as
    /// 0x10 no matching subscribers, 0x87, 0x90, 0x97). 3.1.1 has no
    /// reason: every PUBACK there is plain.
    pub fn puback(&mut self, packet_id: u16, reason: u8) {
        if self.phase != Phase::Open {
            return;
        }
        if self.inbound.in_flight.get(&packet_id) == Some(&InState::Puback) {
            self.inbound.in_flight.remove(&packet_id);
        }
        if self.v5() {
            let _ = v5::PubAck {
                pkid: packet_id,
                reason: puback_reason(reason),
                properties: None,
            }
            .write(&mut self.out);
        } else {
            let _ = v4::PubAck::new(packet_id).write(&mut self.out);
        }
    }

    /// Answers a QoS 2 publish (reason < 0x80: the adapter remembers the id
    /// until PUBREL; a failure ends the exchange).
    pub fn pubrec(&mut self, packet_id: u16, reason: u8) {
        if self.phase != Phase::Open {
            return;
        }
        if self.inbound.in_flight.get(&packet_id) == Some(&InState::Pubrec) {
            if reason < 0x80 {
                self.inbound.in_flight.insert(packet_id, InState::Pubrel);
            } else {
                self.inbound.in_flight.remove(&packet_id);
            }
        }
        self.write_pubrec(packet_id, reason);
    }

    /// Completes a QoS 2 publish after [`Event::PubRel`].
    pub fn pubcomp(&mut self, packet_id: u16) {
        if self.phase != Phase::Open {
            return;
        }
        if self.inbound.in_flight.get(&packet_id) == Some(&InState::Pubcomp) {
            self.inbound.in_flight.remove(&packet_id);
        }
        self.write_pubcomp(packet_id, reason::SUCCESS);
    }

    /// A QoS 2 publish from the client that an earlier connection of the
    /// same session answered with PUBREC (persistent session resumed, or
    /// after a restart): a repeated PUBLISH with this id is answered PUBREC
    /// without an event, and its PUBREL becomes [`Event::PubRel`]. Call it
    /// after [`Self::accept`], before polling on.
    pub fn expect_pubrel(&mut self, packet_id: u16) {
        if self.phase == Phase::Open && packet_id != 0 {
            self.inbound.in_flight.insert(packet_id, InState::Pubrel);
        }
    }

    /// QoS 1/2 publishes from the client not completed yet (handed to the
    /// session and not answered, or QoS 2 between PUBREC and PUBCOMP).
    pub fn incoming_in_flight(&self) -> usize {
        self.inbound.in_flight.len()
    }

    /// PUBREL from the client.
    pub(super) fn on_pubrel(&mut self, ack: Ack) -> Result<Option<Event>, Fault> {
        let id = ack.packet_id;
        match self.inbound.in_flight.get(&id) {
            Some(InState::Pubrel) => {
                self.inbound.in_flight.insert(id, InState::Pubcomp);
                Ok(Some(Event::PubRel { packet_id: id }))
            }
            // Repeated: the session's pubcomp answers it.
            Some(InState::Pubcomp) => Ok(None),
            Some(_) => Err(Fault::protocol(format!(
                "PUBREL before PUBREC for packet {id}"
            ))),
            None => {
                // MQTT 5 4.3.3: answer so the client can drop it; 3.1.1 has no
                // reason code, and a plain PUBCOMP is what it waits for.
                self.write_pubcomp(id, reason::PACKET_ID_NOT_FOUND);
                Ok(None)
            }
        }
    }

    pub(super) fn write_pubrec(&mut self, packet_id: u16, reason: u8) {
        if self.v5() {
            let _ = v5::PubRec {
                pkid: packet_id,
                reason: pubrec_reason(reason),
                properties: None,
            }
            .write(&mut self.out);
        } else {
            let _ = v4::PubRec::new(packet_id).write(&mut self.out);
        }
    }

    fn write_pubcomp(&mut self, packet_id: u16, reason: u8) {
        if self.v5() {
            let _ = v5::PubComp {
                pkid: packet_id,
                reason: if reason == reason::PACKET_ID_NOT_FOUND {
                    v5::PubCompReason::PacketIdentifierNotFound
                } else {
                    v5::PubCompReason::Success
                },
                properties: None,
            }
            .write(&mut self.out);
        } else {
            let _ = v4::PubComp::new(packet_id).write(&mut self.out);
        }
    }
}

fn puback_reason(code: u8) -> v5::PubAckReason {
    use v5::PubAckReason as R;
    match code {
        0x00 => R::Success,
        0x10 => R::NoMatchingSubscribers,
        0x83 => R::ImplementationSpecificError,
        0x87 => R::NotAuthorized,
        0x90 => R::TopicNameInvalid,
        0x91 => R::PacketIdentifierInUse,
        0x97 => R::QuotaExceeded,
        0x99 => R::PayloadFormatInvalid,
        _ => R::UnspecifiedError,
    }
}

fn pubrec_reason(code: u8) -> v5::PubRecReason {
    use v5::PubRecReason as R;
    match code {
        0x00 => R::Success,
        0x10 => R::NoMatchingSubscribers,
        0x83 => R::ImplementationSpecificError,
        0x87 => R::NotAuthorized,
        0x90 => R::TopicNameInvalid,
        0x91 => R::PacketIdentifierInUse,
        0x97 => R::QuotaExceeded,
        0x99 => R::PayloadFormatInvalid,
        _ => R::UnspecifiedError,
    }
}
