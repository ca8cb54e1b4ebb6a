//! Channel lifecycle: channel.open/close/flow, checks that a method's
//! channel is open, and the server-side close of one channel.

use super::content::Content;
use super::{reply, truncate, Connection, Event, Phase};
use amq_protocol::protocol::{channel, AMQPClass};

/// One open channel.
pub(super) struct ChannelState {
    /// The server sent channel.close and awaits close-ok.
    pub(super) closing: bool,
    /// The message in progress.
    pub(super) content: Content,
}

impl Connection {
    /// Whether `channel` is open and not being closed by the server.
    pub fn channel_is_usable(&self, channel: u16) -> bool {
        self.phase == Phase::Open && self.channels.get(&channel).is_some_and(|c| !c.closing)
    }

    /// Server-initiated channel close with a soft error. The caller releases
    /// the channel's engine state now; frames for it are discarded until the
    /// client's close-ok.
    pub fn close_channel(
        &mut self,
        channel: u16,
        code: u16,
        text: &str,
        class_id: u16,
        method_id: u16,
    ) {
        let Some(state) = self.channels.get_mut(&channel) else {
            return;
        };
        if state.closing {
            return;
        }
        state.closing = true;
        self.set_content(channel, Content::Idle);
        let reply_text = truncate(text);
        self.send_method(
            channel,
            AMQPClass::Channel(channel::AMQPMethod::Close(channel::Close {
                reply_code: code,
                reply_text: reply_text.as_str().into(),
                class_id,
                method_id,
            })),
        );
    }

    pub(super) fn remove_channel(&mut self, ch: u16) {
        self.set_content(ch, Content::Idle);
        self.channels.remove(&ch);
    }

    pub(super) fn clear_channels(&mut self) {
        self.channels.clear();
        self.partial_bytes = 0;
        self.incomplete = 0;
    }

    /// Checks that `ch` is an open channel; closes the connection (504) if not.
    pub(super) fn require_channel(&mut self, ch: u16, class_id: u16, method_id: u16) -> bool {
        if self.phase != Phase::Open {
            self.fail(
                reply::COMMAND_INVALID,
                "COMMAND_INVALID - connection not open".into(),
                class_id,
                method_id,
            );
            return false;
        }
        if !self.channels.contains_key(&ch) {
            self.fail(
                reply::CHANNEL_ERROR,
                format!("CHANNEL_ERROR - expected 'channel.open' on channel {ch}"),
                class_id,
                method_id,
            );
            return false;
        }
        true
    }

    pub(super) fn on_channel_method(
        &mut self,
        ch: u16,
        method: AMQPClass,
        class_id: u16,
        method_id: u16,
    ) {
        if let AMQPClass::Channel(channel::AMQPMethod::Open(_)) = method {
            if self.phase != Phase::Open {
                return self.fail(
                    reply::COMMAND_INVALID,
                    "COMMAND_INVALID - connection not open".into(),
                    20,
                    10,
                );
            }
            if ch > self.channel_max {
                return self.fail(
                    reply::CHANNEL_ERROR,
                    format!(
                        "CHANNEL_ERROR - channel {ch} exceeds channel_max {}",
                        self.channel_max
                    ),
                    20,
                    10,
                );
            }
            if self.channels.contains_key(&ch) {
                return self.fail(
                    reply::CHANNEL_ERROR,
                    format!("CHANNEL_ERROR - second 'channel.open' seen on channel {ch}"),
                    20,
                    10,
                );
            }
            let open = u32::try_from(self.channels.len()).unwrap_or(u32::MAX);
            if let Some(max) = self.open_channels_max.filter(|&m| open >= m) {
                return self.fail(
                    reply::NOT_ALLOWED,
                    format!(
                        "NOT_ALLOWED - number of channels opened ({open}) has reached the negotiated channel_max ({max})"
                    ),
                    20,
                    10,
                );
            }
            self.channels.insert(
                ch,
                ChannelState {
                    closing: false,
                    content: Content::Idle,
                },
            );
            self.send_method(
                ch,
                AMQPClass::Channel(channel::AMQPMethod::OpenOk(channel::OpenOk {})),
            );
            self.pending.push_back(Event::ChannelOpened(ch));
            return;
        }
        if !self.require_channel(ch, class_id, method_id) {
            return;
        }
        match method {
            AMQPClass::Channel(channel::AMQPMethod::Close(_)) => {
                self.remove_channel(ch);
                self.send_method(
                    ch,
                    AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {})),
                );
                self.pending.push_back(Event::ChannelClosed(ch));
            }
            AMQPClass::Channel(channel::AMQPMethod::CloseOk(_)) => {
                // A close-ok we did not ask for: ignore, as RabbitMQ does.
            }
            AMQPClass::Channel(channel::AMQPMethod::Flow(flow)) => {
                self.send_method(
                    ch,
                    AMQPClass::Channel(channel::AMQPMethod::FlowOk(channel::FlowOk {
                        active: flow.active,
                    })),
                );
                self.pending.push_back(Event::Flow {
                    channel: ch,
                    active: flow.active,
                });
            }
            AMQPClass::Channel(channel::AMQPMethod::FlowOk(_)) => {}
            AMQPClass::Connection(_) => self.fail(
                reply::COMMAND_INVALID,
                format!(
                    "COMMAND_INVALID - connection method {class_id}.{method_id} on channel {ch}"
                ),
                class_id,
                method_id,
            ),
            method => self.pending.push_back(Event::Method {
                channel: ch,
                method,
            }),
        }
    }
}
