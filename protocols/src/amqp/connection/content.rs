//! Content assembly: basic.publish, its content header and body frames
//! become one [`Publish`], under the message-size and partial-content caps,
//! copied out of the read buffer.

use super::codec::{self, RawFrame, Reader};
use super::{depth, reply, Connection, Event, Phase, Publish};
use amq_protocol::frame::parsing::parse_content_header;
use amq_protocol::protocol::basic;
use bytes::{Bytes, BytesMut};

/// Decodes a raw property block. Its `headers` table is depth-checked first,
/// so a block from anywhere (the wire, the store) is safe to decode.
pub fn parse_properties(raw: &[u8]) -> Option<basic::AMQPProperties> {
    depth::check_properties(raw).ok()?;
    basic::parse_properties(raw).ok().map(|(_, p)| p)
}

/// A channel's message in progress. Fields that are slices of the read
/// buffer are copied out ([`Content::detach`]) before the buffer is refilled,
/// so an incomplete message never pins more than its own bytes.
pub(super) enum Content {
    Idle,
    AwaitingHeader {
        publish: PendingPublish,
        /// Slices copied out of the read buffer already.
        owned: bool,
    },
    AwaitingBody {
        publish: PendingPublish,
        header: Header,
        /// Body bytes still to come.
        remaining: u64,
        /// Announced body size.
        total: u64,
        /// Body received so far, in its own allocation (capacity at most
        /// twice its length, and never more than `total`).
        body: BytesMut,
        owned: bool,
    },
}

impl Content {
    /// Bytes held for this incomplete message (names, properties, body).
    pub(super) fn cost(&self) -> usize {
        match self {
            Content::Idle => 0,
            Content::AwaitingHeader { publish, .. } => publish.cost(),
            Content::AwaitingBody {
                publish,
                header,
                body,
                ..
            } => publish.cost() + header.properties.len() + body.len(),
        }
    }

    /// Copies the slices that still point into the read buffer.
    pub(super) fn detach(&mut self) {
        match self {
            Content::Idle => {}
            Content::AwaitingHeader { publish, owned } => {
                if !*owned {
                    publish.detach();
                    *owned = true;
                }
            }
            Content::AwaitingBody {
                publish,
                header,
                owned,
                ..
            } => {
                if !*owned {
                    publish.detach();
                    header.properties = Bytes::copy_from_slice(&header.properties);
                    *owned = true;
                }
            }
        }
    }
}

pub(super) struct PendingPublish {
    pub(super) exchange: Bytes,
    pub(super) routing_key: Bytes,
    mandatory: bool,
    immediate: bool,
}

impl PendingPublish {
    pub(super) fn cost(&self) -> usize {
        self.exchange.len() + self.routing_key.len()
    }
    pub(super) fn detach(&mut self) {
        self.exchange = Bytes::copy_from_slice(&self.exchange);
        self.routing_key = Bytes::copy_from_slice(&self.routing_key);
    }
}

/// Appends `part` to a body being assembled, growing the buffer at most to
/// `total` and at most to twice what it holds, so the memory an incomplete
/// body holds stays proportional to the bytes actually received.
fn append_body(body: &mut BytesMut, part: &[u8], total: u64) {
    let need = body.len() + part.len();
    if body.capacity() < need {
        let total = usize::try_from(total).unwrap_or(usize::MAX);
        let target = body
            .capacity()
            .saturating_mul(2)
            .max(need)
            .min(total)
            .max(need);
        let mut grown = BytesMut::with_capacity(target);
        grown.extend_from_slice(body);
        *body = grown;
    }
    body.extend_from_slice(part);
}

pub(super) struct Header {
    pub(super) properties: Bytes,
    persistent: bool,
    priority: Option<u8>,
}

impl Connection {
    /// Replaces a channel's content, keeping the partial-content totals.
    pub(super) fn set_content(&mut self, ch: u16, content: Content) -> Content {
        let Some(state) = self.channels.get_mut(&ch) else {
            return Content::Idle;
        };
        let old = std::mem::replace(&mut state.content, content);
        let new = &state.content;
        self.partial_bytes = self.partial_bytes + new.cost() - old.cost();
        self.incomplete = self.incomplete + usize::from(!matches!(new, Content::Idle))
            - usize::from(!matches!(old, Content::Idle));
        old
    }

    /// Recomputes the partial-content totals (for debug assertions).
    pub(super) fn totals_hold(&self) -> bool {
        let bytes: usize = self.channels.values().map(|c| c.content.cost()).sum();
        let n = self
            .channels
            .values()
            .filter(|c| !matches!(c.content, Content::Idle))
            .count();
        bytes == self.partial_bytes && n == self.incomplete
    }

    pub(super) fn on_publish(&mut self, ch: u16, mut r: Reader) {
        if !self.require_channel(ch, codec::BASIC_CLASS, codec::BASIC_PUBLISH) {
            return;
        }
        let parsed = (|| {
            let _ticket = r.u16()?;
            let exchange = r.short_str()?;
            let routing_key = r.short_str()?;
            let bits = r.u8()?;
            r.is_empty().then_some((exchange, routing_key, bits))
        })();
        let Some((exchange, routing_key, bits)) = parsed else {
            return self.syntax_error(codec::BASIC_CLASS, codec::BASIC_PUBLISH);
        };
        self.set_content(
            ch,
            Content::AwaitingHeader {
                publish: PendingPublish {
                    exchange,
                    routing_key,
                    mandatory: bits & 1 != 0,
                    immediate: bits & 2 != 0,
                },
                owned: false,
            },
        );
    }

    /// Whether a channel may hold `cost` bytes of incomplete content while
    /// the other channels hold [`Self::partial_bytes`] (its own content is
    /// taken out first). Closes the channel with 406 when not.
    pub(super) fn admit_partial(&mut self, ch: u16, cost: usize) -> bool {
        let others = self.partial_bytes;
        // One message in progress is bounded by max_message_size alone.
        if others == 0 || others.saturating_add(cost) <= self.partial_limit {
            return true;
        }
        let text = format!(
            "PRECONDITION_FAILED - incomplete messages on this connection would hold {} bytes, over the limit of {}",
            others.saturating_add(cost),
            self.partial_limit
        );
        self.close_channel_for_content(ch, &text);
        false
    }

    /// Closes a channel with 406 for its content and tells the engine, which
    /// did not ask for the close, to release the channel's state.
    pub(super) fn close_channel_for_content(&mut self, ch: u16, text: &str) {
        if self.channel_is_usable(ch) {
            self.close_channel(ch, reply::PRECONDITION_FAILED, text, 60, 40);
            self.pending.push_back(Event::ChannelClosed(ch));
        }
    }

    pub(super) fn handle_content_frame(&mut self, frame: RawFrame) {
        let ch = frame.channel;
        if self.phase == Phase::Closing {
            return;
        }
        let Some(state) = self.channels.get_mut(&ch) else {
            return self.fail(
                reply::CHANNEL_ERROR,
                format!("CHANNEL_ERROR - content frame on unopened channel {ch}"),
                0,
                0,
            );
        };
        if state.closing {
            return;
        }
        // Taken out (totals adjusted here, as set_content would, without a
        // second map lookup on the hot path); put back below while still
        // incomplete.
        let content = std::mem::replace(&mut state.content, Content::Idle);
        self.partial_bytes -= content.cost();
        self.incomplete -= usize::from(!matches!(content, Content::Idle));
        match (frame.kind, content) {
            (codec::FRAME_HEADER, Content::AwaitingHeader { publish, .. }) => {
                if frame.payload.len() < 14
                    || depth::check_properties(&frame.payload[12..]).is_err()
                {
                    return self.fail(
                        reply::FRAME_ERROR,
                        "FRAME_ERROR - malformed content header or too deeply nested headers"
                            .into(),
                        60,
                        40,
                    );
                }
                let header = match parse_content_header(&frame.payload[..]) {
                    Ok((&[], h)) => h,
                    _ => {
                        return self.fail(
                            reply::FRAME_ERROR,
                            "FRAME_ERROR - malformed content header".into(),
                            60,
                            40,
                        )
                    }
                };
                if header.class_id != codec::BASIC_CLASS {
                    return self.fail(
                        reply::FRAME_ERROR,
                        format!("FRAME_ERROR - content header for class {}", header.class_id),
                        60,
                        40,
                    );
                }
                if header.body_size > self.config.max_message_size {
                    let text = format!(
                        "PRECONDITION_FAILED - message size {} is larger than configured max size {}",
                        header.body_size, self.config.max_message_size
                    );
                    // The body frames still to come are discarded as the channel closes.
                    self.close_channel_for_content(ch, &text);
                    return;
                }
                let props = &header.properties;
                let h = Header {
                    properties: frame.payload.slice(12..),
                    persistent: *props.delivery_mode() == Some(2),
                    priority: *props.priority(),
                };
                if header.body_size == 0 {
                    self.finish_publish(ch, publish, h, Bytes::new(), true);
                    return;
                }
                if !self.admit_partial(ch, publish.cost() + h.properties.len()) {
                    return;
                }
                self.set_content(
                    ch,
                    Content::AwaitingBody {
                        publish,
                        header: h,
                        remaining: header.body_size,
                        total: header.body_size,
                        body: BytesMut::new(),
                        owned: false,
                    },
                );
            }
            (
                codec::FRAME_BODY,
                Content::AwaitingBody {
                    publish,
                    header,
                    remaining,
                    total,
                    mut body,
                    owned,
                },
            ) => {
                let len = frame.payload.len() as u64;
                if len > remaining {
                    return self.fail(
                        reply::FRAME_ERROR,
                        format!("FRAME_ERROR - body frame of {len} bytes exceeds the {remaining} announced"),
                        60,
                        40,
                    );
                }
                let remaining = remaining - len;
                if remaining == 0 {
                    // A body in one frame is a slice of the read buffer
                    // (copied with the message's other fields below); a
                    // split one was copied as it arrived.
                    let (body, body_owned) = if body.is_empty() {
                        (frame.payload, false)
                    } else {
                        append_body(&mut body, &frame.payload, total);
                        (body.freeze(), true)
                    };
                    self.finish_publish(ch, publish, header, body, body_owned);
                    return;
                }
                let cost =
                    publish.cost() + header.properties.len() + body.len() + frame.payload.len();
                if !self.admit_partial(ch, cost) {
                    return;
                }
                append_body(&mut body, &frame.payload, total);
                self.set_content(
                    ch,
                    Content::AwaitingBody {
                        publish,
                        header,
                        remaining,
                        total,
                        body,
                        owned,
                    },
                );
            }
            (kind, _) => self.fail(
                reply::UNEXPECTED_FRAME,
                format!(
                    "UNEXPECTED_FRAME - unexpected content frame of type {kind} on channel {ch}"
                ),
                0,
                0,
            ),
        }
    }

    pub(super) fn finish_publish(
        &mut self,
        ch: u16,
        p: PendingPublish,
        h: Header,
        body: Bytes,
        body_owned: bool,
    ) {
        let (exchange, routing_key, properties, body) =
            own_message(p.exchange, p.routing_key, h.properties, body, body_owned);
        self.pending.push_back(Event::Publish {
            channel: ch,
            message: Publish {
                exchange,
                routing_key,
                mandatory: p.mandatory,
                immediate: p.immediate,
                properties,
                persistent: h.persistent,
                priority: h.priority,
                body,
            },
        });
    }
}

/// Gives a message buffers of its own. Its fields are slices of the socket
/// read buffer, which a queued message would otherwise keep alive whole (a
/// 1-byte message kept a 128 KB+ buffer alive): the exchange, routing key,
/// properties and, unless it was assembled from several frames into a buffer
/// of its exact size already, the body are copied into one exact-size
/// allocation. One allocation and a small copy per message: about 2–3% of
/// broker CPU at saturation (docs/BENCHMARKS.md).
fn own_message(
    exchange: Bytes,
    routing_key: Bytes,
    properties: Bytes,
    body: Bytes,
    body_owned: bool,
) -> (Bytes, Bytes, Bytes, Bytes) {
    let head = exchange.len() + routing_key.len() + properties.len();
    let total = head + if body_owned { 0 } else { body.len() };
    if total == 0 {
        return (exchange, routing_key, properties, body);
    }
    let mut all = BytesMut::with_capacity(total);
    for part in [&exchange, &routing_key, &properties] {
        all.extend_from_slice(part);
    }
    if !body_owned {
        all.extend_from_slice(&body);
    }
    let mut all = all.freeze();
    let exchange = all.split_to(exchange.len());
    let routing_key = all.split_to(routing_key.len());
    let properties = all.split_to(properties.len());
    let body = if body_owned { body } else { all };
    (exchange, routing_key, properties, body)
}
