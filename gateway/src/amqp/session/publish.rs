//! basic.publish: the checks RabbitMQ makes, routing and storing through
//! the engine client, mandatory returns, and the bookkeeping publisher
//! confirms need. A transacted channel's publishes are held instead
//! ([`super::tx`]) and go through [`Session::store_publish`] at commit.

use super::failure::{hard, soft, Failure};
use super::scope;
use super::Session;
use crate::amqp::headers::{
    amqp_expiration, amqp_reply_to, amqp_user_id, check_expiration, lookup, with_reply_to, AMQP_091,
};
use crate::engine::client::Published;
use crate::engine::exchange::HeaderLookup;
use crate::engine::message::Message;
use crate::engine::reply_to::REPLY_TO;
use crate::engine::tenant::RouteInput;
use weir_protocols::amqp::{codec, reply, Publish};

/// The exchange name and routing key of `p` as text.
fn names(p: &Publish) -> Result<(&str, &str), Failure> {
    let exchange = std::str::from_utf8(&p.exchange)
        .map_err(|_| hard(reply::SYNTAX_ERROR, "exchange name is not UTF-8".into()))?;
    let routing_key = std::str::from_utf8(&p.routing_key)
        .map_err(|_| hard(reply::SYNTAX_ERROR, "routing key is not UTF-8".into()))?;
    Ok((exchange, routing_key))
}

impl Session {
    pub(super) fn on_publish(&mut self, ch: u16, p: Publish) -> Result<(), Failure> {
        if p.immediate {
            return Err(hard(reply::NOT_IMPLEMENTED, "immediate=true".into()));
        }
        // The tenant's max-message-size: 406, as RabbitMQ's max_message_size.
        self.client()?.check_message_size(p.body.len() as u64)?;
        let p = self.direct_reply_to(ch, p)?;
        let (exchange, routing_key) = names(&p)?;
        // RabbitMQ's validated user-id. RabbitMQ looks the exchange up
        // first, so a refused user-id to a missing exchange is a 404
        // (checked only on that path, as for the expiration below).
        if let Ok(Some(user_id)) = amqp_user_id(&p.properties) {
            let user_id = String::from_utf8_lossy(user_id);
            if let Err(e) = self.client()?.check_user_id(&user_id) {
                self.check_route(&p, exchange, routing_key)?;
                return Err(e.into());
            }
        }
        let ttl = self.publish_ttl(&p, exchange, routing_key)?;
        if self.is_transacted(ch) {
            // Routed at commit; its exchange is checked now, as RabbitMQ
            // does (which routes now and delivers at commit).
            self.check_route(&p, exchange, routing_key)?;
            return self.tx_publish(ch, p, ttl);
        }
        let published = self.store_publish(&p, ttl)?;
        let Some(c) = self.channels.get_mut(&ch) else {
            return Ok(());
        };
        if c.confirm {
            c.publish_tag += 1;
            c.batch_publishes += 1;
        }
        match published {
            Published::Routed {
                needs_barrier,
                refused,
            } => {
                c.batch_needs_store |= needs_barrier;
                // A queue at its length limit with reject-publish refused
                // it: nacked now, on its own, as for a full disk below.
                if refused && c.confirm {
                    let tag = c.publish_tag;
                    c.batch_publishes = c.batch_publishes.saturating_sub(1);
                    if self.conn.channel_is_usable(ch) {
                        self.write_confirm(ch, tag, false, true);
                    }
                }
            }
            Published::Unroutable => {
                if p.mandatory {
                    self.write_return(ch, &p, false);
                }
            }
            Published::NoSpace => {
                // Out of disk space: the publisher is told with basic.nack
                // (confirm mode) and the connection stays up; without
                // confirms the message is dropped, as an unconfirmed publish
                // may be.
                if c.confirm {
                    // Nacked now, on its own; the batch's multiple-ack must
                    // not cover it again (a multiple-ack skips tags already
                    // settled).
                    let tag = c.publish_tag;
                    c.batch_publishes = c.batch_publishes.saturating_sub(1);
                    if self.conn.channel_is_usable(ch) {
                        self.write_confirm(ch, tag, false, true);
                    }
                }
                tracing::debug!(channel = ch, "disk full: publish refused");
            }
        }
        Ok(())
    }

    /// Direct reply-to: a request asking for replies on
    /// `amq.rabbitmq.reply-to` carries the channel's reply address instead
    /// (406 when the channel has no reply consumer, as in RabbitMQ).
    fn direct_reply_to(&mut self, ch: u16, mut p: Publish) -> Result<Publish, Failure> {
        let asks = matches!(amqp_reply_to(&p.properties), Ok(Some(r)) if r == REPLY_TO.as_bytes());
        if asks {
            let address = match self.client()?.reply_to_address(scope(ch)) {
                Ok(a) => a,
                Err(e) => {
                    // RabbitMQ looks the exchange up first: a missing one
                    // is a 404 even then.
                    let (exchange, routing_key) = names(&p)?;
                    self.check_route(&p, exchange, routing_key)?;
                    return Err(e.into());
                }
            };
            if let Some(props) = with_reply_to(&p.properties, address.as_bytes()) {
                p.properties = props;
            }
        }
        Ok(p)
    }

    /// The message's own TTL from its `expiration`, refused with 406 as
    /// RabbitMQ refuses it. RabbitMQ looks the exchange up first, so a
    /// refused expiration on a missing exchange is a 404 (checked only on
    /// that path: a valid publish is routed once, by the engine).
    fn publish_ttl(
        &mut self,
        p: &Publish,
        exchange: &str,
        routing_key: &str,
    ) -> Result<Option<u64>, Failure> {
        let raw = match amqp_expiration(&p.properties) {
            Ok(None) => return Ok(None),
            Ok(Some(raw)) => raw,
            // The adapter parsed this block already: not reached.
            Err(e) => {
                return Err(hard(
                    reply::SYNTAX_ERROR,
                    format!("content header properties: {e}"),
                ))
            }
        };
        match check_expiration(raw) {
            Ok(ttl) => Ok(Some(ttl)),
            Err(e) => {
                self.check_route(p, exchange, routing_key)?;
                Err(soft(
                    reply::PRECONDITION_FAILED,
                    format!("invalid expiration '{}': {e}", String::from_utf8_lossy(raw)),
                ))
            }
        }
    }

    /// The errors a publish to `exchange` would meet (403 without write
    /// permission, 404 missing, 403 internal), without publishing.
    pub(super) fn check_route(
        &mut self,
        p: &Publish,
        exchange: &str,
        routing_key: &str,
    ) -> Result<(), Failure> {
        let headers = lookup(&p.properties);
        let route = RouteInput {
            exchange,
            routing_key,
            headers: &headers,
        };
        let mut scratch = Vec::new();
        let client = self.client()?;
        client.authorize_publish(&route)?;
        let _how = client.tenant().route(&route, &mut scratch)?;
        Ok(())
    }

    /// Routes and stores `p` through the engine client.
    pub(super) fn store_publish(
        &mut self,
        p: &Publish,
        ttl_ms: Option<u64>,
    ) -> Result<Published, Failure> {
        let (exchange, routing_key) = names(p)?;
        let headers = lookup(&p.properties);
        let route = RouteInput {
            exchange,
            routing_key,
            headers: &headers,
        };
        // BCC routes the message but never reaches a consumer (RabbitMQ's
        // sender-selected distribution): stored without it.
        let properties = if headers.may_have("BCC") && headers.header("BCC").is_some() {
            without_bcc(&p.properties).unwrap_or_else(|| p.properties.clone())
        } else {
            p.properties.clone()
        };
        Ok(self.client()?.publish(&route, |id| Message {
            id,
            exchange: p.exchange.clone(),
            routing_key: p.routing_key.clone(),
            properties,
            body: p.body.clone(),
            header_format: AMQP_091,
            persistent: p.persistent,
            priority: p.priority.unwrap_or(0),
            ttl_ms,
        })?)
    }

    /// basic.return of an unroutable mandatory publish. `in_order`: behind
    /// any queued replies (a transaction's returns precede its commit-ok
    /// and follow the replies before it); otherwise written at once.
    pub(super) fn write_return(&mut self, ch: u16, p: &Publish, in_order: bool) {
        let frame_max = self.conn.frame_max();
        let encode = |out: &mut bytes::BytesMut| {
            codec::write_return(
                out,
                ch,
                reply::NO_ROUTE,
                "NO_ROUTE",
                &p.exchange,
                &p.routing_key,
            );
            codec::write_content(out, ch, &p.properties, &p.body, frame_max);
        };
        if in_order {
            self.reply_frames(ch, encode);
        } else {
            encode(self.conn.out());
        }
    }
}

/// The AMQP property block `raw` without its `BCC` header; None if it
/// cannot be re-encoded (then it is kept as it came).
fn without_bcc(raw: &bytes::Bytes) -> Option<bytes::Bytes> {
    use crate::engine::properties::HeaderCodec;
    let codec = crate::amqp::headers::AmqpCodec;
    let mut props = codec.decode(raw).ok()?;
    if let Some(h) = props.headers.as_mut() {
        h.0.retain(|(k, _)| k != "BCC");
    }
    let mut out = Vec::with_capacity(raw.len());
    codec.encode(&props, &mut out).ok()?;
    Some(out.into())
}
