//! PUBLISH to the client: packet ids, the client's receive maximum and
//! maximum packet size, outgoing topic aliases, and the client's
//! acknowledgements (PUBACK, PUBREC → PUBREL, PUBCOMP).

use super::connection::{Connection, Phase};
use super::event::*;
use super::reason;
use super::wire::{Ack, MAX_VARINT};
use bytes::Bytes;
use mqttbytes::{v4, v5};
use std::collections::HashMap;

/// A message for the client.
#[derive(Clone, Debug)]
pub struct OutgoingPublish {
    pub topic: String,
    pub payload: Bytes,
    pub qos: QoS,
    pub retain: bool,
    /// A resend of a publish the client may have seen (persistent session
    /// resumed): keeps `packet_id`.
    pub dup: bool,
    /// For a resend: the id it had. `None`: the adapter allocates one (QoS > 0).
    pub packet_id: Option<u16>,
    /// MQTT 5 properties (dropped for 3.1.1). `message_expiry_secs` is sent
    /// as given: the session passes the time left, not the original value.
    /// Strings and binary values longer than 65,535 bytes are left out.
    pub properties: MessageProperties,
    /// MQTT 5 subscription identifiers of the matching subscriptions
    /// (values outside 1..=268,435,455 are left out).
    pub subscription_ids: Vec<u32>,
}

/// Why a publish was not sent.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SendError {
    /// Larger than the client's maximum packet size: MQTT 5 says discard
    /// it as if it had been delivered.
    #[error("larger than the client's maximum packet size")]
    TooLarge,
    /// The client's receive maximum is reached: wait for an ack.
    #[error("the client's receive maximum is reached")]
    NoQuota,
    /// Not connected (before CONNACK or after the end).
    #[error("not connected")]
    NotConnected,
}

/// Where a QoS 1/2 publish to the client is: the ack it awaits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum OutState {
    Puback,
    Pubrec,
    /// PUBREL sent.
    Pubcomp,
}

/// The server-to-client half of the connection's state.
pub(super) struct Outbound {
    /// QoS 1/2 publishes not completed (the client's receive maximum
    /// counts these).
    in_flight: HashMap<u16, OutState>,
    /// Where the search for a free packet id starts.
    next_id: u16,
    /// Topic → alias, for topics sent with an alias (at most the client's
    /// topic alias maximum and the server's; first come, first served,
    /// never replaced).
    aliases: HashMap<String, u16>,
}

impl Default for Outbound {
    fn default() -> Self {
        Outbound {
            in_flight: HashMap::new(),
            next_id: 1,
            aliases: HashMap::new(),
        }
    }
}

impl Outbound {
    /// A packet id not in flight, from `next_id` on (wrapping, 0 skipped).
    fn free_id(&self) -> Option<u16> {
        let mut id = self.next_id;
        for _ in 0..u16::MAX {
            if id != 0 && !self.in_flight.contains_key(&id) {
                return Some(id);
            }
            id = id.wrapping_add(1);
        }
        None
    }
}

/// Longest string or binary value the two-byte length prefix can carry.
const MAX_FIELD: usize = u16::MAX as usize;

impl Connection {
    /// Whether a QoS 1/2 publish can be sent now (client's receive maximum).
    pub fn can_send(&self) -> bool {
        self.phase == Phase::Open && self.quota_left()
    }

    /// Whether `packet_id` is free for a publish (not in flight): a resend
    /// under an earlier connection's id checks this first.
    pub fn packet_id_free(&self, packet_id: u16) -> bool {
        packet_id != 0 && !self.outbound.in_flight.contains_key(&packet_id)
    }

    fn quota_left(&self) -> bool {
        self.outbound.in_flight.len() < usize::from(self.client.receive_maximum)
    }

    /// QoS 1/2 publishes sent to the client and not completed.
    pub fn outgoing_in_flight(&self) -> usize {
        self.outbound.in_flight.len()
    }

    /// Encodes a publish to the client; returns its packet id (QoS 1/2).
    /// Applies an outgoing topic alias when the client allows them.
    ///
    /// A resend (`packet_id: Some`) of an id already in flight takes no
    /// more quota. On an error nothing is written and nothing changes.
    pub fn publish(&mut self, msg: OutgoingPublish) -> Result<Option<u16>, SendError> {
        if self.phase != Phase::Open {
            return Err(SendError::NotConnected);
        }
        let packet_id = match (msg.qos, msg.packet_id) {
            (QoS::AtMostOnce, _) => None,
            (_, Some(id)) if id != 0 => {
                if !self.outbound.in_flight.contains_key(&id) && !self.quota_left() {
                    return Err(SendError::NoQuota);
                }
                Some(id)
            }
            _ => {
                if !self.quota_left() {
                    return Err(SendError::NoQuota);
                }
                Some(self.outbound.free_id().ok_or(SendError::NoQuota)?)
            }
        };
        if msg.topic.len() > MAX_FIELD {
            return Err(SendError::TooLarge);
        }
        let pkid = packet_id.unwrap_or(0);
        // MQTT-3.3.1-2: DUP is 0 on every QoS 0 message.
        let dup = msg.dup && packet_id.is_some();
        let mut new_alias = None;
        let remaining = if self.v5() {
            // Each alias keeps its topic for the connection's life: the
            // server's own maximum bounds that memory too.
            let max_alias = self
                .client
                .topic_alias_maximum
                .min(self.config.topic_alias_maximum);
            let (topic, alias) = match self.outbound.aliases.get(&msg.topic) {
                Some(&a) => (String::new(), Some(a)),
                None if max_alias > 0 && self.outbound.aliases.len() < usize::from(max_alias) => {
                    // Aliases 1..=len are taken, so the next one is free.
                    let a = u16::try_from(self.outbound.aliases.len() + 1).unwrap_or(max_alias);
                    new_alias = Some(a);
                    (msg.topic.clone(), Some(a))
                }
                None => (msg.topic.clone(), None),
            };
            let properties = publish_properties(&msg.properties, &msg.subscription_ids, alias);
            let p = v5::Publish {
                dup,
                qos: codec_qos(msg.qos),
                retain: msg.retain,
                topic,
                pkid,
                properties,
                payload: msg.payload,
            };
            let remaining = self.check_size(p.len())?;
            p.write(&mut self.out).map_err(|_| SendError::TooLarge)?;
            remaining
        } else {
            let p = v4::Publish {
                dup,
                qos: codec_qos(msg.qos),
                retain: msg.retain,
                topic: msg.topic.clone(),
                pkid,
                payload: msg.payload,
            };
            let remaining = self.check_size(p.len())?;
            p.write(&mut self.out).map_err(|_| SendError::TooLarge)?;
            remaining
        };
        debug_assert!(remaining <= MAX_VARINT as usize);
        if let Some(a) = new_alias {
            self.outbound.aliases.insert(msg.topic, a);
        }
        if let Some(id) = packet_id {
            let state = if msg.qos == QoS::AtLeastOnce {
                OutState::Puback
            } else {
                OutState::Pubrec
            };
            self.outbound.in_flight.insert(id, state);
            if msg.packet_id.is_none() {
                self.outbound.next_id = id.wrapping_add(1).max(1);
            }
        }
        Ok(packet_id)
    }

    /// A packet's remaining length, if the whole packet fits the
    /// protocol and the client's maximum packet size.
    fn check_size(&self, remaining: usize) -> Result<usize, SendError> {
        if remaining > MAX_VARINT as usize || !self.fits(remaining) {
            return Err(SendError::TooLarge);
        }
        Ok(remaining)
    }

    /// Keeps `packet_id` in flight for a QoS 2 publish an earlier connection
    /// of the session sent and the client has not acknowledged: it is sent
    /// again later (DUP) with this id, which no other publish may take
    /// meanwhile. Call it after [`Self::accept`].
    pub fn reserve_packet_id(&mut self, packet_id: u16) {
        if self.phase == Phase::Open && packet_id != 0 {
            self.outbound.in_flight.insert(packet_id, OutState::Pubrec);
        }
    }

    /// Re-sends PUBREL for a QoS 2 publish the client acknowledged with
    /// PUBREC before a reconnect (the id is in flight until PUBCOMP).
    pub fn pubrel(&mut self, packet_id: u16) {
        if self.phase != Phase::Open || packet_id == 0 {
            return;
        }
        self.outbound.in_flight.insert(packet_id, OutState::Pubcomp);
        self.write_pubrel(packet_id, reason::SUCCESS);
    }

    /// PUBACK from the client; an id not awaiting one is ignored.
    pub(super) fn on_puback(&mut self, ack: Ack) -> Option<Event> {
        let id = ack.packet_id;
        if self.outbound.in_flight.get(&id) != Some(&OutState::Puback) {
            return None;
        }
        self.outbound.in_flight.remove(&id);
        Some(Event::PubAck {
            packet_id: id,
            reason: ack.reason,
        })
    }

    /// PUBREC from the client: PUBREL goes out at once (a failure reason
    /// ends the exchange instead, 4.3.3).
    pub(super) fn on_pubrec(&mut self, ack: Ack) -> Option<Event> {
        let id = ack.packet_id;
        match self.outbound.in_flight.get(&id) {
            Some(OutState::Pubrec) => {
                if ack.reason < 0x80 {
                    self.outbound.in_flight.insert(id, OutState::Pubcomp);
                    self.write_pubrel(id, reason::SUCCESS);
                } else {
                    self.outbound.in_flight.remove(&id);
                }
                Some(Event::PubRec {
                    packet_id: id,
                    reason: ack.reason,
                })
            }
            Some(OutState::Pubcomp) => {
                // Our PUBREL crossed a repeated PUBREC: repeat it.
                self.write_pubrel(id, reason::SUCCESS);
                None
            }
            Some(OutState::Puback) => None,
            None => {
                self.write_pubrel(id, reason::PACKET_ID_NOT_FOUND);
                None
            }
        }
    }

    /// PUBCOMP from the client; an id not awaiting one is ignored.
    pub(super) fn on_pubcomp(&mut self, ack: Ack) -> Option<Event> {
        let id = ack.packet_id;
        if self.outbound.in_flight.get(&id) != Some(&OutState::Pubcomp) {
            return None;
        }
        self.outbound.in_flight.remove(&id);
        Some(Event::PubComp { packet_id: id })
    }

    fn write_pubrel(&mut self, packet_id: u16, reason: u8) {
        if self.v5() {
            let _ = v5::PubRel {
                pkid: packet_id,
                reason: if reason == reason::PACKET_ID_NOT_FOUND {
                    v5::PubRelReason::PacketIdentifierNotFound
                } else {
                    v5::PubRelReason::Success
                },
                properties: None,
            }
            .write(&mut self.out);
        } else {
            let _ = v4::PubRel::new(packet_id).write(&mut self.out);
        }
    }
}

fn codec_qos(q: QoS) -> mqttbytes::QoS {
    match q {
        QoS::AtMostOnce => mqttbytes::QoS::AtMostOnce,
        QoS::AtLeastOnce => mqttbytes::QoS::AtLeastOnce,
        QoS::ExactlyOnce => mqttbytes::QoS::ExactlyOnce,
    }
}

/// MQTT 5 PUBLISH properties, `None` when there are none.
fn publish_properties(
    m: &MessageProperties,
    subscription_ids: &[u32],
    alias: Option<u16>,
) -> Option<v5::PublishProperties> {
    let fits = |s: &&String| s.len() <= MAX_FIELD;
    let p = v5::PublishProperties {
        payload_format_indicator: m.payload_is_utf8.map(u8::from),
        message_expiry_interval: m.message_expiry_secs,
        topic_alias: alias,
        response_topic: m.response_topic.as_ref().filter(fits).cloned(),
        correlation_data: m
            .correlation_data
            .as_ref()
            .filter(|b| b.len() <= MAX_FIELD)
            .cloned(),
        user_properties: m
            .user_properties
            .iter()
            .filter(|(k, v)| k.len() <= MAX_FIELD && v.len() <= MAX_FIELD)
            .cloned()
            .collect(),
        subscription_identifiers: subscription_ids
            .iter()
            .filter(|&&id| (1..=MAX_VARINT).contains(&id))
            .map(|&id| id as usize)
            .collect(),
        content_type: m.content_type.as_ref().filter(fits).cloned(),
    };
    let empty = p.payload_format_indicator.is_none()
        && p.message_expiry_interval.is_none()
        && p.topic_alias.is_none()
        && p.response_topic.is_none()
        && p.correlation_data.is_none()
        && p.user_properties.is_empty()
        && p.subscription_identifiers.is_empty()
        && p.content_type.is_none();
    (!empty).then_some(p)
}
