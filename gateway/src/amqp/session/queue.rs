//! queue.declare, queue.bind, queue.unbind, queue.purge, queue.delete.

use super::failure::{hard, Failure};
use super::Session;
use crate::amqp::headers::table_to_json;
use crate::engine::meta::DestinationKind;
use crate::engine::tenant::QueueDeclare;
use weir_protocols::amqp::methods::{queue, AMQPClass};
use weir_protocols::amqp::reply;

impl Session {
    pub(super) fn on_queue(
        &mut self,
        ch: u16,
        m: queue::AMQPMethod,
        ids: (u16, u16),
    ) -> Result<(), Failure> {
        // Permissions are checked by the engine client's calls.
        let conn_id = self.client()?.id();
        match m {
            queue::AMQPMethod::Declare(d) => {
                let name = if d.passive {
                    self.queue_name(ch, d.queue.as_str())?
                } else {
                    d.queue.as_str().to_string()
                };
                let req = QueueDeclare {
                    name,
                    passive: d.passive,
                    durable: d.durable,
                    exclusive: d.exclusive,
                    auto_delete: d.auto_delete,
                    arguments: table_to_json(&d.arguments),
                    connection: conn_id,
                };
                let (ok, wait) = self.client()?.declare_queue(req)?;
                if let Some(c) = self.channels.get_mut(&ch) {
                    c.last_queue = Some(ok.name.clone());
                }
                self.reply_when_durable(
                    ch,
                    d.nowait,
                    wait,
                    AMQPClass::Queue(queue::AMQPMethod::DeclareOk(queue::DeclareOk {
                        queue: ok.name.as_str().into(),
                        message_count: ok.messages.min(u32::MAX as u64) as u32,
                        consumer_count: ok.consumers,
                    })),
                    ids,
                );
            }
            queue::AMQPMethod::Bind(b) => {
                let queue = self.queue_name(ch, b.queue.as_str())?;
                let wait = self.client()?.bind(
                    b.exchange.as_str(),
                    DestinationKind::Queue,
                    &queue,
                    b.routing_key.as_str(),
                    table_to_json(&b.arguments),
                )?;
                self.reply_when_durable(
                    ch,
                    b.nowait,
                    wait,
                    AMQPClass::Queue(queue::AMQPMethod::BindOk(queue::BindOk {})),
                    ids,
                );
            }
            queue::AMQPMethod::Unbind(b) => {
                let queue = self.queue_name(ch, b.queue.as_str())?;
                let wait = self.client()?.unbind(
                    b.exchange.as_str(),
                    DestinationKind::Queue,
                    &queue,
                    b.routing_key.as_str(),
                    table_to_json(&b.arguments),
                )?;
                // queue.unbind has no nowait: always answered.
                self.reply_when_durable(
                    ch,
                    false,
                    wait,
                    AMQPClass::Queue(queue::AMQPMethod::UnbindOk(queue::UnbindOk {})),
                    ids,
                );
            }
            queue::AMQPMethod::Purge(p) => {
                let queue = self.queue_name(ch, p.queue.as_str())?;
                let n = self.client()?.purge_queue(&queue)?;
                if n > 0 {
                    self.shared.request_trim();
                }
                if !p.nowait {
                    self.reply(
                        ch,
                        AMQPClass::Queue(queue::AMQPMethod::PurgeOk(queue::PurgeOk {
                            message_count: n.min(u32::MAX as u64) as u32,
                        })),
                    );
                }
            }
            queue::AMQPMethod::Delete(d) => {
                let queue = self.queue_name(ch, d.queue.as_str())?;
                let (n, wait) = self
                    .client()?
                    .delete_queue(&queue, d.if_unused, d.if_empty)?;
                if n > 0 {
                    self.shared.request_trim();
                }
                self.reply_when_durable(
                    ch,
                    d.nowait,
                    wait,
                    AMQPClass::Queue(queue::AMQPMethod::DeleteOk(queue::DeleteOk {
                        message_count: n.min(u32::MAX as u64) as u32,
                    })),
                    ids,
                );
            }
            other => {
                return Err(hard(
                    reply::COMMAND_INVALID,
                    format!("unexpected method {other:?}"),
                ))
            }
        }
        Ok(())
    }
}
