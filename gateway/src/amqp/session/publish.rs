//! basic.publish: routing and storing through the engine client, mandatory
//! returns, and the bookkeeping publisher confirms need.

use super::failure::{hard, Failure};
use super::Session;
use crate::amqp::convert::LazyHeaders;
use crate::engine::client::Published;
use crate::engine::message::Message;
use crate::engine::properties::HeaderFormat;
use crate::engine::tenant::RouteInput;
use weir_protocols::amqp::{codec, reply, Publish};

impl Session {
    pub(super) fn on_publish(&mut self, ch: u16, p: Publish) -> Result<(), Failure> {
        if p.immediate {
            return Err(hard(reply::NOT_IMPLEMENTED, "immediate=true".into()));
        }
        let exchange = std::str::from_utf8(&p.exchange)
            .map_err(|_| hard(reply::SYNTAX_ERROR, "exchange name is not UTF-8".into()))?;
        let routing_key = std::str::from_utf8(&p.routing_key)
            .map_err(|_| hard(reply::SYNTAX_ERROR, "routing key is not UTF-8".into()))?;
        let headers = LazyHeaders::new(&p.properties);
        let route = RouteInput {
            exchange,
            routing_key,
            headers: &headers,
        };
        let published = self.client()?.publish(&route, |id| Message {
            id,
            exchange: p.exchange.clone(),
            routing_key: p.routing_key.clone(),
            properties: p.properties.clone(),
            body: p.body.clone(),
            header_format: HeaderFormat::Amqp091,
            persistent: p.persistent,
            priority: p.priority.unwrap_or(0),
            ttl_ms: None,
        })?;
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
                    let frame_max = self.conn.frame_max();
                    let out = self.conn.out();
                    codec::write_return(
                        out,
                        ch,
                        reply::NO_ROUTE,
                        "NO_ROUTE",
                        &p.exchange,
                        &p.routing_key,
                    );
                    codec::write_content(out, ch, &p.properties, &p.body, frame_max);
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
}
