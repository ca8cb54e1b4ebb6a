//! The shovel's ends on another MQTT 3.1.1 broker, with rumqttc: a topic
//! filter subscribed to in a persistent session (so the broker keeps what
//! arrives while the shovel reconnects) with manual acknowledgements (a
//! PUBACK only once the destination confirmed), or QoS 1 publishes whose
//! PUBACKs confirm a batch.

use std::time::Duration;

use rumqttc::{AsyncClient, Event, EventLoop, MqttOptions, Packet, Publish, QoS};

use super::{Msg, ShovelError};

/// The largest MQTT packet the shovel sends or takes.
const MAX_PACKET: usize = 16 << 20;

fn options(uri: &str, client_id: &str) -> Result<MqttOptions, ShovelError> {
    let rest = uri
        .strip_prefix("mqtt://")
        .ok_or_else(|| ShovelError::Closed(format!("not an mqtt:// URI: {uri}")))?;
    let rest = rest.split('/').next().unwrap_or("");
    let (creds, hostport) = match rest.rsplit_once('@') {
        Some((c, h)) => (Some(c), h),
        None => (None, rest),
    };
    let (host, port) = match hostport.rsplit_once(':') {
        Some((h, p)) => (
            h,
            p.parse::<u16>()
                .map_err(|_| ShovelError::Closed(format!("bad port in {uri}")))?,
        ),
        None => (hostport, 1883),
    };
    let mut o = MqttOptions::new(client_id, host, port);
    o.set_keep_alive(Duration::from_secs(30));
    o.set_max_packet_size(MAX_PACKET, MAX_PACKET);
    if let Some(c) = creds {
        let (u, p) = c.split_once(':').unwrap_or((c, ""));
        o.set_credentials(u, p);
    }
    Ok(o)
}

fn qos(q: u8) -> QoS {
    if q == 0 {
        QoS::AtMostOnce
    } else {
        QoS::AtLeastOnce
    }
}

/// A topic filter on another broker, subscribed to.
pub struct MqttSource {
    client: AsyncClient,
    events: EventLoop,
    no_ack: bool,
}

impl MqttSource {
    /// Connects with a persistent session named `client_id` and subscribes.
    pub async fn open(
        uri: &str,
        client_id: &str,
        filter: &str,
        q: u8,
        prefetch: u16,
        no_ack: bool,
    ) -> Result<Self, ShovelError> {
        let mut o = options(uri, client_id)?;
        o.set_clean_session(false);
        o.set_manual_acks(!no_ack);
        // Room for a batch's acknowledgements between two polls.
        let (client, mut events) = AsyncClient::new(o, usize::from(prefetch) + 16);
        // The CONNACK first: a refused login is an error now, not a loop.
        loop {
            match events.poll().await? {
                Event::Incoming(Packet::ConnAck(_)) => break,
                _ => continue,
            }
        }
        client.subscribe(filter, qos(q)).await?;
        Ok(MqttSource {
            client,
            events,
            no_ack,
        })
    }

    /// Waits for at least one message, then takes what already arrived,
    /// up to `max`.
    pub async fn recv(&mut self, max: usize, out: &mut Vec<Msg>) -> Result<(), ShovelError> {
        loop {
            let ev = if out.is_empty() {
                self.events.poll().await?
            } else {
                match futures_lite::future::poll_once(self.events.poll()).await {
                    Some(ev) => ev?,
                    None => return Ok(()),
                }
            };
            if let Event::Incoming(Packet::Publish(p)) = ev {
                out.push(Msg {
                    exchange: "amq.topic".into(),
                    routing_key: weir_engine::topic::topic_to_routing_key(&p.topic),
                    header: None,
                    persistent: p.qos != QoS::AtMostOnce,
                    body: p.payload.clone(),
                    // The packet id and QoS are all an acknowledgement needs.
                    ack: u64::from(p.pkid) | (u64::from(p.qos as u8) << 16),
                });
                if out.len() >= max {
                    return Ok(());
                }
            }
        }
    }

    /// Acknowledges the batch (PUBACK each; sent by the next poll).
    pub async fn ack(&mut self, batch: &[Msg]) -> Result<(), ShovelError> {
        if self.no_ack {
            return Ok(());
        }
        for m in batch {
            let q = match m.ack >> 16 {
                0 => continue,
                1 => QoS::AtLeastOnce,
                _ => QoS::ExactlyOnce,
            };
            let mut p = Publish::new("", q, Vec::new());
            p.pkid = (m.ack & 0xffff) as u16;
            self.client.ack(&p).await?;
        }
        Ok(())
    }
}

/// A broker published to at QoS 1.
pub struct MqttDest {
    client: AsyncClient,
    events: EventLoop,
    topic: Option<String>,
    qos: u8,
}

impl MqttDest {
    /// Connects (a clean session named `client_id`).
    pub async fn open(
        uri: &str,
        client_id: &str,
        topic: Option<String>,
        q: u8,
        prefetch: u16,
    ) -> Result<Self, ShovelError> {
        let o = options(uri, client_id)?;
        let (client, mut events) = AsyncClient::new(o, usize::from(prefetch) + 16);
        loop {
            match events.poll().await? {
                Event::Incoming(Packet::ConnAck(_)) => break,
                _ => continue,
            }
        }
        Ok(MqttDest {
            client,
            events,
            topic,
            qos: q,
        })
    }

    /// Publishes the batch; with `confirm` (and QoS 1), returns once every
    /// publish was acknowledged.
    pub async fn send(&mut self, batch: &[Msg], confirm: bool) -> Result<(), ShovelError> {
        let mut expected = 0usize;
        for m in batch {
            let topic = match &self.topic {
                Some(t) => t.clone(),
                None => weir_engine::topic::routing_key_to_topic(&m.routing_key),
            };
            // Queued for the event loop, which sends it when polled below.
            self.client
                .publish_bytes(topic, qos(self.qos), false, m.body.clone())
                .await?;
            if self.qos > 0 {
                expected += 1;
            }
        }
        let mut acked = 0usize;
        let mut sent = 0usize;
        let target = if confirm { expected } else { 0 };
        while acked < target || sent < batch.len() {
            match self.events.poll().await? {
                Event::Incoming(Packet::PubAck(_)) => acked += 1,
                Event::Outgoing(rumqttc::Outgoing::Publish(_)) => sent += 1,
                _ => {}
            }
        }
        Ok(())
    }
}
