//! exchange.declare, exchange.delete, exchange.bind, exchange.unbind.

use super::failure::{hard, soft, Failure};
use super::Session;
use crate::amqp::headers::table_to_json;
use crate::engine::exchange::{ExchangeDef, ExchangeKind};
use crate::engine::meta::DestinationKind;
use weir_protocols::amqp::methods::{exchange, AMQPClass};
use weir_protocols::amqp::reply;

impl Session {
    pub(super) fn on_exchange(
        &mut self,
        ch: u16,
        m: exchange::AMQPMethod,
        ids: (u16, u16),
    ) -> Result<(), Failure> {
        // Permissions are checked by the engine client's calls.
        match m {
            exchange::AMQPMethod::Declare(d) => {
                // Checked before anything else, as RabbitMQ does (its
                // `rabbit_exchange:check_type`): an unknown type closes the
                // connection with 503. A passive declare names no type
                // (RabbitMQ ignores it): the kind given here is unused.
                let arguments = table_to_json(&d.arguments);
                let (kind, delayed) =
                    match ExchangeKind::parse_declared(d.kind.as_str(), &arguments) {
                        Some(Ok(k)) => k,
                        None | Some(Err(_)) if d.passive => (ExchangeKind::Direct, false),
                        // RabbitMQ's delayed-message plugin: a missing or
                        // unknown `x-delayed-type` is a channel error.
                        Some(Err(text)) => return Err(soft(reply::PRECONDITION_FAILED, text)),
                        None => {
                            return Err(hard(
                                reply::COMMAND_INVALID,
                                format!("unknown exchange type '{}'", d.kind.as_str()),
                            ))
                        }
                    };
                let def = ExchangeDef {
                    name: d.exchange.as_str().to_string(),
                    kind,
                    durable: d.durable,
                    auto_delete: d.auto_delete,
                    internal: d.internal,
                    delayed,
                    arguments,
                };
                let wait = self.client()?.declare_exchange(def, d.passive)?;
                self.reply_when_durable(
                    ch,
                    d.nowait,
                    wait,
                    AMQPClass::Exchange(exchange::AMQPMethod::DeclareOk(exchange::DeclareOk {})),
                    ids,
                );
            }
            exchange::AMQPMethod::Delete(d) => {
                let wait = self
                    .client()?
                    .delete_exchange(d.exchange.as_str(), d.if_unused)?;
                self.reply_when_durable(
                    ch,
                    d.nowait,
                    wait,
                    AMQPClass::Exchange(exchange::AMQPMethod::DeleteOk(exchange::DeleteOk {})),
                    ids,
                );
            }
            exchange::AMQPMethod::Bind(b) => {
                let wait = self.client()?.bind(
                    b.source.as_str(),
                    DestinationKind::Exchange,
                    b.destination.as_str(),
                    b.routing_key.as_str(),
                    table_to_json(&b.arguments),
                )?;
                self.reply_when_durable(
                    ch,
                    b.nowait,
                    wait,
                    AMQPClass::Exchange(exchange::AMQPMethod::BindOk(exchange::BindOk {})),
                    ids,
                );
            }
            exchange::AMQPMethod::Unbind(b) => {
                let wait = self.client()?.unbind(
                    b.source.as_str(),
                    DestinationKind::Exchange,
                    b.destination.as_str(),
                    b.routing_key.as_str(),
                    table_to_json(&b.arguments),
                )?;
                self.reply_when_durable(
                    ch,
                    b.nowait,
                    wait,
                    AMQPClass::Exchange(exchange::AMQPMethod::UnbindOk(exchange::UnbindOk {})),
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
