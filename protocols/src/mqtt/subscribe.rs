//! SUBSCRIBE and UNSUBSCRIBE from the client, SUBACK and UNSUBACK back.
//!
//! A filter the server cannot accept does not end the connection: it is
//! marked [`SubscribeFilter::invalid`] with the SUBACK code to answer. What
//! ends it: a malformed packet (reserved option bits, QoS 3, retain
//! handling 3, no filter at all), packet id 0, subscription identifier 0,
//! and (MQTT 5) no-local on a shared subscription.

use super::connection::{Connection, Phase};
use super::event::*;
use super::reason;
use super::topic::validate_filter;
use super::wire::{self, prop, Fault, Header, Reader, Value};
use bytes::Bytes;
use mqttbytes::{v4, v5};

impl Connection {
    /// A SUBSCRIBE (flags already checked).
    pub(super) fn on_subscribe(
        &mut self,
        h: Header,
        packet: Bytes,
    ) -> Result<Option<Event>, Fault> {
        let v5 = self.v5();
        // What mqttbytes does not check, before it reads the packet.
        let body = packet.get(h.header_len..).unwrap_or_default();
        let mut r = Reader::new(body);
        let packet_id = r.u16()?;
        if packet_id == 0 {
            return Err(Fault::protocol("SUBSCRIBE with packet identifier 0"));
        }
        let mut subscription_id = None;
        let mut user_properties = Vec::new();
        if v5 {
            wire::props(&mut r, prop::SUBSCRIBE, "SUBSCRIBE", |id, v| {
                match (id, v) {
                    (prop::SUBSCRIPTION_ID, Value::Var(0)) => {
                        return Err(Fault::protocol("subscription identifier 0"))
                    }
                    (prop::SUBSCRIPTION_ID, Value::Var(n)) => subscription_id = Some(n),
                    (prop::USER_PROPERTY, Value::Pair(k, v)) => {
                        user_properties.push((k.to_string(), v.to_string()))
                    }
                    _ => {}
                }
                Ok(())
            })?;
        }
        let mut count = 0usize;
        while !r.is_empty() {
            r.string()?;
            let options = r.u8()?;
            let reserved = if v5 { 0b1100_0000 } else { 0b1111_1100 };
            if options & reserved != 0 {
                return Err(Fault::malformed("SUBSCRIBE options: reserved bits set"));
            }
            if options & 0b11 == 3 {
                return Err(Fault::malformed("SUBSCRIBE with QoS 3"));
            }
            if (options >> 4) & 0b11 == 3 {
                return Err(Fault::malformed("SUBSCRIBE with retain handling 3"));
            }
            count += 1;
        }
        if count == 0 {
            return Err(Fault::protocol("SUBSCRIBE without a topic filter"));
        }

        let raw: Vec<(String, QoS, bool, bool, u8)> = if v5 {
            let s = v5::Subscribe::read(h.codec(), packet)
                .map_err(|e| wire::codec_fault(e, "SUBSCRIBE"))?;
            s.filters
                .into_iter()
                .map(|f| {
                    let rh = match f.retain_forward_rule {
                        v5::RetainForwardRule::OnEverySubscribe => 0,
                        v5::RetainForwardRule::OnNewSubscribe => 1,
                        v5::RetainForwardRule::Never => 2,
                    };
                    (
                        f.path,
                        from_codec_qos(f.qos),
                        f.nolocal,
                        f.preserve_retain,
                        rh,
                    )
                })
                .collect()
        } else {
            let s = v4::Subscribe::read(h.codec(), packet)
                .map_err(|e| wire::codec_fault(e, "SUBSCRIBE"))?;
            s.filters
                .into_iter()
                .map(|f| (f.path, from_codec_qos(f.qos), false, false, 0))
                .collect()
        };
        let mut filters = Vec::with_capacity(raw.len());
        for (filter, qos, no_local, retain_as_published, retain_handling) in raw {
            let (shared, invalid) = match validate_filter(&filter, self.config.max_topic_levels) {
                Ok(Some(_)) if !self.config.shared_subscriptions => {
                    (None, Some(reason::SHARED_SUBSCRIPTIONS_NOT_SUPPORTED))
                }
                Ok(Some(_)) if no_local => {
                    // MQTT-3.8.3-4.
                    return Err(Fault::protocol("no-local on a shared subscription"));
                }
                Ok(shared) => (shared, None),
                Err(_) => (None, Some(reason::TOPIC_FILTER_INVALID)),
            };
            filters.push(SubscribeFilter {
                filter,
                shared,
                qos,
                no_local,
                retain_as_published,
                retain_handling,
                invalid,
            });
        }
        Ok(Some(Event::Subscribe {
            packet_id,
            filters,
            subscription_id,
            user_properties,
        }))
    }

    /// An UNSUBSCRIBE (flags already checked). MQTT 5 is decoded here:
    /// mqttbytes' decoder prints to stderr.
    pub(super) fn on_unsubscribe(
        &mut self,
        h: Header,
        packet: Bytes,
    ) -> Result<Option<Event>, Fault> {
        let body = packet.get(h.header_len..).unwrap_or_default();
        let mut r = Reader::new(body);
        let packet_id = r.u16()?;
        if packet_id == 0 {
            return Err(Fault::protocol("UNSUBSCRIBE with packet identifier 0"));
        }
        let filters = if self.v5() {
            wire::props(&mut r, prop::UNSUBSCRIBE, "UNSUBSCRIBE", |_, _| Ok(()))?;
            let mut filters = Vec::new();
            while !r.is_empty() {
                filters.push(r.string()?.to_string());
            }
            filters
        } else {
            // Checked first: UTF-8 without NUL, and the packet ends where the
            // last filter does.
            while !r.is_empty() {
                r.string()?;
            }
            v4::Unsubscribe::read(h.codec(), packet)
                .map_err(|e| wire::codec_fault(e, "UNSUBSCRIBE"))?
                .topics
        };
        if filters.is_empty() {
            return Err(Fault::protocol("UNSUBSCRIBE without a topic filter"));
        }
        Ok(Some(Event::Unsubscribe { packet_id, filters }))
    }

    /// Answers a SUBSCRIBE: one reason code per filter (granted QoS 0-2,
    /// or a failure code; 3.1.1 maps every failure to 0x80). MQTT 5 codes
    /// SUBACK does not define are sent as 0x80.
    pub fn suback(&mut self, packet_id: u16, codes: &[u8]) {
        if self.phase != Phase::Open {
            return;
        }
        if self.v5() {
            let codes = codes
                .iter()
                .map(|&c| {
                    v5::SubscribeReasonCode::try_from(c)
                        .unwrap_or(v5::SubscribeReasonCode::Unspecified)
                })
                .collect();
            let _ = v5::SubAck::new(packet_id, codes).write(&mut self.out);
        } else {
            let codes = codes
                .iter()
                .map(|&c| match c {
                    0 => v4::SubscribeReasonCode::Success(mqttbytes::QoS::AtMostOnce),
                    1 => v4::SubscribeReasonCode::Success(mqttbytes::QoS::AtLeastOnce),
                    2 => v4::SubscribeReasonCode::Success(mqttbytes::QoS::ExactlyOnce),
                    _ => v4::SubscribeReasonCode::Failure,
                })
                .collect();
            let _ = v4::SubAck::new(packet_id, codes).write(&mut self.out);
        }
    }

    /// Answers an UNSUBSCRIBE (MQTT 5: one code per filter, 0x00 or 0x11
    /// no subscription existed; 3.1.1 has no codes).
    pub fn unsuback(&mut self, packet_id: u16, codes: &[u8]) {
        if self.phase != Phase::Open {
            return;
        }
        if self.v5() {
            use v5::UnsubAckReason as R;
            let reasons = codes
                .iter()
                .map(|&c| match c {
                    0x00 => R::Success,
                    0x11 => R::NoSubscriptionExisted,
                    0x83 => R::ImplementationSpecificError,
                    0x87 => R::NotAuthorized,
                    0x8F => R::TopicFilterInvalid,
                    0x91 => R::PacketIdentifierInUse,
                    _ => R::UnspecifiedError,
                })
                .collect();
            let _ = v5::UnsubAck {
                pkid: packet_id,
                reasons,
                properties: None,
            }
            .write(&mut self.out);
        } else {
            let _ = v4::UnsubAck::new(packet_id).write(&mut self.out);
        }
    }
}

fn from_codec_qos(q: mqttbytes::QoS) -> QoS {
    match q {
        mqttbytes::QoS::AtMostOnce => QoS::AtMostOnce,
        mqttbytes::QoS::AtLeastOnce => QoS::AtLeastOnce,
        mqttbytes::QoS::ExactlyOnce => QoS::ExactlyOnce,
    }
}
