//! The basic class except publish: qos, consume, cancel, get, ack, nack,
//! reject, recover.

use super::failure::{hard, soft, Failure};
use super::{scope, Session};
use crate::engine::args::ArgError;
use crate::engine::client::{GetAck, SubscribeOptions};
use crate::engine::lease::Settle;
use crate::engine::reply_to::REPLY_TO;
use crate::engine::stream::OffsetSpec;
use bytes::Bytes;
use std::time::Instant;
use weir_protocols::amqp::methods::{basic, AMQPClass};
use weir_protocols::amqp::types::{AMQPValue, FieldTable};
use weir_protocols::amqp::{codec, reply};

impl Session {
    /// basic.qos: per-consumer prefetch for later consumers, or (global)
    /// the channel-wide window of all its consumers, existing ones too.
    pub(super) fn on_qos(
        &mut self,
        ch: u16,
        prefetch_size: u32,
        prefetch_count: u16,
        global: bool,
    ) {
        let Some(c) = self.channels.get_mut(&ch) else {
            return;
        };
        if global {
            if let Some(client) = self.client.as_mut() {
                client.set_scope_window(scope(ch), u32::from(prefetch_count), prefetch_size);
            }
        } else {
            c.prefetch_count = prefetch_count;
            c.prefetch_size = prefetch_size;
        }
        self.reply(
            ch,
            AMQPClass::Basic(basic::AMQPMethod::QosOk(basic::QosOk {})),
        );
    }

    pub(super) fn on_basic(&mut self, ch: u16, m: basic::AMQPMethod) -> Result<(), Failure> {
        match m {
            basic::AMQPMethod::Consume(c) => self.on_consume(ch, c)?,
            basic::AMQPMethod::Cancel(c) => {
                self.client()?
                    .unsubscribe(scope(ch), c.consumer_tag.as_str().as_bytes());
                if !c.nowait {
                    self.reply(
                        ch,
                        AMQPClass::Basic(basic::AMQPMethod::CancelOk(basic::CancelOk {
                            consumer_tag: c.consumer_tag,
                        })),
                    );
                }
            }
            basic::AMQPMethod::Get(g) => self.on_get(ch, g)?,
            basic::AMQPMethod::Reject(r) => {
                let how = if r.requeue {
                    Settle::Requeue
                } else {
                    Settle::Drop
                };
                self.on_settle(ch, r.delivery_tag, false, how)?;
            }
            basic::AMQPMethod::Nack(n) => {
                let how = if n.requeue {
                    Settle::Requeue
                } else {
                    Settle::Drop
                };
                self.on_settle(ch, n.delivery_tag, n.multiple, how)?;
            }
            basic::AMQPMethod::Ack(a) => {
                self.on_settle(ch, a.delivery_tag, a.multiple, Settle::Ack)?;
            }
            basic::AMQPMethod::Recover(r) => {
                self.recover(ch, r.requeue)?;
                self.reply(
                    ch,
                    AMQPClass::Basic(basic::AMQPMethod::RecoverOk(basic::RecoverOk {})),
                );
            }
            basic::AMQPMethod::RecoverAsync(r) => self.recover(ch, r.requeue)?,
            other => {
                return Err(hard(
                    reply::COMMAND_INVALID,
                    format!("{other:?} is not valid from a client"),
                ))
            }
        }
        Ok(())
    }

    fn on_consume(&mut self, ch: u16, c: basic::Consume) -> Result<(), Failure> {
        let queue = self.queue_name(ch, c.queue.as_str())?;
        self.next_consumer_tag += 1;
        let generated = self.next_consumer_tag;
        if queue == REPLY_TO {
            // Direct reply-to: no queue; the engine keeps the channel's
            // reply box.
            let client = self.client()?;
            let tag: Bytes = if c.consumer_tag.as_str().is_empty() {
                Bytes::from(format!("amq.ctag-{}-{generated}", client.id()))
            } else {
                Bytes::copy_from_slice(c.consumer_tag.as_str().as_bytes())
            };
            client.consume_reply_to(scope(ch), tag.clone(), c.no_ack)?;
            if !c.nowait {
                let t = String::from_utf8_lossy(&tag).into_owned();
                self.reply(
                    ch,
                    AMQPClass::Basic(basic::AMQPMethod::ConsumeOk(basic::ConsumeOk {
                        consumer_tag: t.as_str().into(),
                    })),
                );
            }
            return Ok(());
        }
        let Some(chan) = self.channels.get(&ch) else {
            return Ok(());
        };
        let (prefetch_count, prefetch_bytes) = (chan.prefetch_count, chan.prefetch_size);
        let client = self.client()?;
        let (priority, offset) = match consume_args(&c.arguments) {
            Ok(p) => p,
            Err(e) => {
                // RabbitMQ looks the queue up before it checks the
                // arguments: a missing queue is a 404 even then.
                client.queue(&queue)?;
                return Err(soft(
                    reply::PRECONDITION_FAILED,
                    e.message(&queue, client.tenant_name()),
                ));
            }
        };
        let tag: Bytes = if c.consumer_tag.as_str().is_empty() {
            Bytes::from(format!("amq.ctag-{}-{generated}", client.id()))
        } else {
            Bytes::copy_from_slice(c.consumer_tag.as_str().as_bytes())
        };
        // Attached before answering; deliveries are only written after
        // this event (and after the consume-ok, if that has to queue).
        client.subscribe_at(
            &queue,
            SubscribeOptions {
                scope: scope(ch),
                tag: tag.clone(),
                exclusive: c.exclusive,
                no_ack: c.no_ack,
                prefetch_count: u32::from(prefetch_count),
                prefetch_bytes,
                priority,
            },
            offset,
        )?;
        if !c.nowait {
            let t = String::from_utf8_lossy(&tag).into_owned();
            // Its deliveries wait while any reply of the channel is queued.
            self.reply(
                ch,
                AMQPClass::Basic(basic::AMQPMethod::ConsumeOk(basic::ConsumeOk {
                    consumer_tag: t.as_str().into(),
                })),
            );
        }
        Ok(())
    }

    fn on_get(&mut self, ch: u16, g: basic::Get) -> Result<(), Failure> {
        let queue = self.queue_name(ch, g.queue.as_str())?;
        let Some(chan) = self.channels.get(&ch) else {
            return Ok(());
        };
        let tag = chan.delivery_tag + 1;
        let ack = if g.no_ack {
            GetAck::Auto
        } else {
            GetAck::Lease {
                scope: scope(ch),
                tag,
                now: Instant::now(),
            }
        };
        let Some(got) = self.client()?.get(&queue, ack)? else {
            self.reply(
                ch,
                AMQPClass::Basic(basic::AMQPMethod::GetEmpty(basic::GetEmpty {})),
            );
            return Ok(());
        };
        if let Some(chan) = self.channels.get_mut(&ch) {
            chan.delivery_tag = tag;
        }
        let frame_max = self.conn.frame_max();
        let m = &got.message;
        let properties = crate::amqp::headers::amqp_properties(m, &self.engine.codecs());
        self.reply_frames(ch, |out| {
            codec::write_get_ok(
                out,
                ch,
                tag,
                got.redelivered,
                &m.exchange,
                &m.routing_key,
                got.remaining.min(u32::MAX as u64) as u32,
            );
            codec::write_content(out, ch, &properties, &m.body, frame_max);
        });
        Ok(())
    }

    /// basic.ack, basic.nack, basic.reject.
    pub(super) fn on_settle(
        &mut self,
        ch: u16,
        tag: u64,
        multiple: bool,
        how: Settle,
    ) -> Result<(), Failure> {
        if self.is_transacted(ch) {
            return self.tx_settle(ch, tag, multiple, how);
        }
        self.client()?.settle(scope(ch), tag, multiple, how)?;
        Ok(())
    }

    fn recover(&mut self, ch: u16, requeue: bool) -> Result<(), Failure> {
        if !requeue {
            return Err(hard(reply::NOT_IMPLEMENTED, "requeue=false".into()));
        }
        if self.is_transacted(ch) {
            return self.tx_recover(ch);
        }
        self.client()?.settle(scope(ch), 0, true, Settle::Requeue)?;
        Ok(())
    }
}

/// Checks basic.consume's arguments as RabbitMQ does and returns the
/// consumer priority: `x-priority` must be an integer type (406
/// otherwise; any value, clamped to `i32`), `x-cancel-on-ha-failover` a
/// boolean; and where a stream consumer starts (`x-stream-offset`: `first`,
/// `last`, `next`, an interval such as `1h`, an integer offset or an AMQP
/// timestamp). Other arguments are ignored.
fn consume_args(args: &FieldTable) -> Result<(i32, Option<OffsetSpec>), ArgError> {
    let mut priority = 0;
    let mut offset = None;
    for (k, v) in args.inner() {
        match k.as_str() {
            "x-priority" => {
                let p: i64 = match *v {
                    AMQPValue::ShortShortInt(i) => i.into(),
                    AMQPValue::ShortShortUInt(i) => i.into(),
                    AMQPValue::ShortInt(i) => i.into(),
                    AMQPValue::ShortUInt(i) => i.into(),
                    AMQPValue::LongInt(i) => i.into(),
                    AMQPValue::LongUInt(i) => i.into(),
                    AMQPValue::LongLongInt(i) => i,
                    ref other => return Err(unacceptable("x-priority", other)),
                };
                // Only the order of priorities matters; clamping keeps it
                // for every value a client sends in practice.
                priority = p.clamp(i32::MIN.into(), i32::MAX.into()) as i32;
            }
            "x-cancel-on-ha-failover" if !matches!(v, AMQPValue::Boolean(_)) => {
                return Err(unacceptable("x-cancel-on-ha-failover", v));
            }
            "x-stream-offset" => offset = Some(stream_offset(v)?),
            _ => {}
        }
    }
    Ok((priority, offset))
}

/// `x-stream-offset`'s value.
fn stream_offset(v: &AMQPValue) -> Result<OffsetSpec, ArgError> {
    let n: i64 = match *v {
        AMQPValue::LongString(ref s) => {
            let text = String::from_utf8_lossy(s.as_bytes());
            return OffsetSpec::parse(&text).map_err(|e| ArgError {
                arg: "x-stream-offset",
                reason: e.to_string(),
            });
        }
        AMQPValue::ShortString(ref s) => {
            return OffsetSpec::parse(s.as_str()).map_err(|e| ArgError {
                arg: "x-stream-offset",
                reason: e.to_string(),
            })
        }
        AMQPValue::Timestamp(secs) => return Ok(OffsetSpec::Timestamp(secs.saturating_mul(1000))),
        AMQPValue::ShortShortInt(i) => i.into(),
        AMQPValue::ShortShortUInt(i) => i.into(),
        AMQPValue::ShortInt(i) => i.into(),
        AMQPValue::ShortUInt(i) => i.into(),
        AMQPValue::LongInt(i) => i.into(),
        AMQPValue::LongUInt(i) => i.into(),
        AMQPValue::LongLongInt(i) => i,
        ref other => return Err(unacceptable("x-stream-offset", other)),
    };
    // A negative offset is the first one, as RabbitMQ (osiris) reads it.
    Ok(u64::try_from(n).map_or(OffsetSpec::First, OffsetSpec::Offset))
}

/// RabbitMQ's `{unacceptable_type,…}` refusal, with its names of the AMQP
/// field types.
fn unacceptable(arg: &'static str, v: &AMQPValue) -> ArgError {
    let t = match v {
        AMQPValue::Boolean(_) => "bool",
        AMQPValue::ShortShortInt(_) => "byte",
        AMQPValue::ShortShortUInt(_) => "unsignedbyte",
        AMQPValue::ShortInt(_) => "short",
        AMQPValue::ShortUInt(_) => "unsignedshort",
        AMQPValue::LongInt(_) => "signedint",
        AMQPValue::LongUInt(_) => "unsignedint",
        AMQPValue::LongLongInt(_) => "long",
        AMQPValue::Float(_) => "float",
        AMQPValue::Double(_) => "double",
        AMQPValue::DecimalValue(_) => "decimal",
        AMQPValue::ShortString(_) | AMQPValue::LongString(_) => "longstr",
        AMQPValue::ByteArray(_) => "binary",
        AMQPValue::FieldArray(_) => "array",
        AMQPValue::FieldTable(_) => "table",
        AMQPValue::Timestamp(_) => "timestamp",
        AMQPValue::Void => "void",
    };
    ArgError {
        arg,
        reason: format!("{{unacceptable_type,{t}}}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use weir_protocols::amqp::types::{LongString, ShortString};

    fn args(k: &str, v: AMQPValue) -> FieldTable {
        let mut t = FieldTable::default();
        t.insert(ShortString::from(k.to_string()), v);
        t
    }

    #[test]
    fn x_priority_takes_any_integer_type_and_refuses_the_rest() {
        assert_eq!(consume_args(&FieldTable::default()).map(|a| a.0), Ok(0));
        assert_eq!(
            consume_args(&args("x-priority", AMQPValue::ShortShortInt(-3))).map(|a| a.0),
            Ok(-3)
        );
        assert_eq!(
            consume_args(&args("x-priority", AMQPValue::LongUInt(7))).map(|a| a.0),
            Ok(7)
        );
        assert_eq!(
            consume_args(&args("x-priority", AMQPValue::LongLongInt(1 << 40))).map(|a| a.0),
            Ok(i32::MAX)
        );
        let e = consume_args(&args(
            "x-priority",
            AMQPValue::LongString(LongString::from("5")),
        ))
        .unwrap_err();
        assert_eq!(
            e.message("q", "/"),
            "invalid arg 'x-priority' for queue 'q' in vhost '/': {unacceptable_type,longstr}"
        );
        assert!(consume_args(&args("x-priority", AMQPValue::Double(1.0))).is_err());
        assert!(consume_args(&args("x-cancel-on-ha-failover", AMQPValue::LongInt(1))).is_err());
        assert_eq!(
            consume_args(&args("x-other", AMQPValue::Double(1.0))).map(|a| a.0),
            Ok(0)
        );
    }

    #[test]
    fn x_stream_offset_takes_every_rabbitmq_form() {
        let off = |v| consume_args(&args("x-stream-offset", v)).map(|a| a.1);
        for (text, want) in [
            ("first", OffsetSpec::First),
            ("last", OffsetSpec::Last),
            ("next", OffsetSpec::Next),
            ("1h", OffsetSpec::Ago(3_600_000)),
            ("30m", OffsetSpec::Ago(1_800_000)),
        ] {
            assert_eq!(
                off(AMQPValue::LongString(LongString::from(text))),
                Ok(Some(want))
            );
        }
        assert_eq!(
            off(AMQPValue::LongLongInt(42)),
            Ok(Some(OffsetSpec::Offset(42)))
        );
        assert_eq!(off(AMQPValue::ShortInt(7)), Ok(Some(OffsetSpec::Offset(7))));
        assert_eq!(off(AMQPValue::LongLongInt(-1)), Ok(Some(OffsetSpec::First)));
        assert_eq!(
            off(AMQPValue::Timestamp(1_700_000_000)),
            Ok(Some(OffsetSpec::Timestamp(1_700_000_000_000)))
        );
        assert!(off(AMQPValue::LongString(LongString::from("soon"))).is_err());
        assert!(off(AMQPValue::Double(1.0)).is_err());
        assert_eq!(consume_args(&FieldTable::default()).map(|a| a.1), Ok(None));
    }
}
