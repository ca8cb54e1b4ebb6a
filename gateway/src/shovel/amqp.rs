//! The shovel's ends on another AMQP 0-9-1 broker (RabbitMQ), with lapin:
//! a queue consumed with a prefetch and acknowledged once the destination
//! confirmed (`multiple` acks, one per batch), or an exchange published to
//! in confirm mode.

use futures_lite::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use weir_engine::properties::HeaderCodecs;

use super::def::Target;
use super::{Msg, ShovelError};
use crate::amqp::headers::AMQP_091;

/// A queue the shovel names is declared durable when missing, as
/// RabbitMQ's shovel does: a passive declare first (an existing queue of
/// another type or with arguments must not be redeclared), and on 404 a
/// new channel (the failed one is closed) declaring it. Returns its ready
/// messages and the channel to use.
async fn ensure_queue(
    conn: &Connection,
    ch: Channel,
    queue: &str,
) -> Result<(Channel, u64), ShovelError> {
    let passive = QueueDeclareOptions {
        passive: true,
        ..Default::default()
    };
    match ch
        .queue_declare(queue.into(), passive, FieldTable::default())
        .await
    {
        Ok(q) => Ok((ch, u64::from(q.message_count()))),
        Err(e) if is_not_found(&e) => {
            let ch = conn.create_channel().await?;
            let q = ch
                .queue_declare(
                    queue.into(),
                    QueueDeclareOptions {
                        durable: true,
                        ..Default::default()
                    },
                    FieldTable::default(),
                )
                .await?;
            Ok((ch, u64::from(q.message_count())))
        }
        Err(e) => Err(e.into()),
    }
}

fn is_not_found(e: &lapin::Error) -> bool {
    matches!(e.kind(), lapin::ErrorKind::ProtocolError(p) if p.get_id() == 404)
}

async fn connect(uri: &str) -> Result<(Connection, Channel), ShovelError> {
    let props = ConnectionProperties::default().with_connection_name("weir-shovel".into());
    let conn = Connection::connect(uri, props).await?;
    let ch = conn.create_channel().await?;
    Ok((conn, ch))
}

/// A queue on another broker, consumed.
pub struct AmqpSource {
    conn: Connection,
    ch: Channel,
    consumer: lapin::Consumer,
    no_ack: bool,
    queue_length: u64,
}

impl AmqpSource {
    /// Connects and starts consuming `target` (a queue, or a private
    /// queue bound to an exchange).
    pub async fn open(
        uri: &str,
        target: &Target,
        prefetch: u16,
        no_ack: bool,
    ) -> Result<Self, ShovelError> {
        let (conn, ch) = connect(uri).await?;
        let (ch, queue, queue_length) = match target {
            Target::Queue(q) => {
                let (ch, len) = ensure_queue(&conn, ch, q).await?;
                (ch, q.clone(), len)
            }
            Target::Exchange { name, key } => {
                let d = ch
                    .queue_declare(
                        "".into(),
                        QueueDeclareOptions {
                            exclusive: true,
                            auto_delete: true,
                            ..Default::default()
                        },
                        FieldTable::default(),
                    )
                    .await?;
                let q = d.name().as_str().to_string();
                ch.queue_bind(
                    q.as_str().into(),
                    name.as_str().into(),
                    key.as_deref().unwrap_or("#").into(),
                    QueueBindOptions::default(),
                    FieldTable::default(),
                )
                .await?;
                (ch, q, 0)
            }
        };
        ch.basic_qos(prefetch, BasicQosOptions::default()).await?;
        let consumer = ch
            .basic_consume(
                queue.as_str().into(),
                "weir-shovel".into(),
                BasicConsumeOptions {
                    no_ack,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await?;
        Ok(AmqpSource {
            conn,
            ch,
            consumer,
            no_ack,
            queue_length,
        })
    }

    /// Messages in the queue when the shovel started consuming.
    pub fn queue_length(&self) -> u64 {
        self.queue_length
    }

    fn push(d: lapin::message::Delivery, out: &mut Vec<Msg>) -> Result<(), ShovelError> {
        let raw = properties_bytes(&d.properties)?;
        out.push(Msg {
            exchange: d.exchange.as_str().to_string(),
            routing_key: d.routing_key.as_str().to_string(),
            persistent: d.properties.delivery_mode() == &Some(2),
            header: Some((AMQP_091, raw)),
            body: bytes::Bytes::from(d.data),
            ack: d.delivery_tag,
        });
        Ok(())
    }

    /// Waits for at least one delivery, then takes what already arrived,
    /// up to `max`.
    pub async fn recv(&mut self, max: usize, out: &mut Vec<Msg>) -> Result<(), ShovelError> {
        match self.consumer.next().await {
            None => {
                return Err(ShovelError::Closed(
                    "the source consumer was cancelled".into(),
                ))
            }
            Some(d) => Self::push(d?, out)?,
        }
        while out.len() < max {
            match futures_lite::future::poll_once(self.consumer.next()).await {
                Some(Some(d)) => Self::push(d?, out)?,
                Some(None) => break,
                None => break,
            }
        }
        Ok(())
    }

    /// Acknowledges everything up to the batch's last delivery.
    pub async fn ack(&mut self, batch: &[Msg]) -> Result<(), ShovelError> {
        if self.no_ack {
            return Ok(());
        }
        if let Some(last) = batch.last() {
            self.ch
                .basic_ack(last.ack, BasicAckOptions { multiple: true })
                .await?;
        }
        Ok(())
    }

    /// Closes the connection (unacknowledged deliveries return to the queue).
    pub async fn close(self) {
        let _ = self.conn.close(200, "shovel stopped".into()).await;
    }
}

/// A broker published to in confirm mode.
pub struct AmqpDest {
    conn: Connection,
    ch: Channel,
    target: Target,
}

impl AmqpDest {
    /// Connects and selects confirm mode.
    pub async fn open(uri: &str, target: &Target) -> Result<Self, ShovelError> {
        let (conn, ch) = connect(uri).await?;
        let ch = match target {
            Target::Queue(q) => ensure_queue(&conn, ch, q).await?.0,
            Target::Exchange { .. } => ch,
        };
        ch.confirm_select(ConfirmSelectOptions::default()).await?;
        Ok(AmqpDest {
            conn,
            ch,
            target: target.clone(),
        })
    }

    /// Publishes the batch; with `confirm`, returns once the broker
    /// confirmed every message (a nack fails the batch).
    pub async fn send(
        &mut self,
        batch: &[Msg],
        confirm: bool,
        codecs: &HeaderCodecs,
    ) -> Result<(), ShovelError> {
        let mut confirms = Vec::with_capacity(batch.len());
        for m in batch {
            let (exchange, key) = match &self.target {
                Target::Queue(q) => ("", q.as_str()),
                Target::Exchange { name, key } => {
                    (name.as_str(), key.as_deref().unwrap_or(&m.routing_key))
                }
            };
            let props = amqp_properties(m, codecs);
            let c = self
                .ch
                .basic_publish(
                    exchange.into(),
                    key.into(),
                    BasicPublishOptions::default(),
                    &m.body,
                    props,
                )
                .await?;
            confirms.push(c);
        }
        if confirm {
            for c in confirms {
                if c.await?.is_nack() {
                    return Err(ShovelError::Nacked("the destination broker nacked".into()));
                }
            }
        }
        Ok(())
    }

    /// Closes the connection.
    pub async fn close(self) {
        let _ = self.conn.close(200, "shovel stopped".into()).await;
    }
}

/// lapin's parsed properties as the AMQP property block Weir stores.
fn properties_bytes(p: &BasicProperties) -> Result<bytes::Bytes, ShovelError> {
    use amq_protocol::frame::WriteContext;
    let ctx = amq_protocol::protocol::basic::gen_properties(p)(WriteContext::from(Vec::new()))
        .map_err(|e| ShovelError::Closed(format!("encoding properties: {e:?}")))?;
    Ok(bytes::Bytes::from(ctx.write))
}

/// A message's header as lapin's properties (converted through the codec
/// registry when it was not published over AMQP).
fn amqp_properties(m: &Msg, codecs: &HeaderCodecs) -> BasicProperties {
    let persistent =
        || BasicProperties::default().with_delivery_mode(if m.persistent { 2 } else { 1 });
    let Some((format, raw)) = &m.header else {
        return persistent();
    };
    match codecs.convert(*format, raw, AMQP_091) {
        Ok(block) => {
            weir_protocols::amqp::connection::parse_properties(&block).unwrap_or_else(persistent)
        }
        Err(_) => persistent(),
    }
}
