//! How an error ends up on the wire: a channel close (soft) or a connection
//! close (hard), and the mapping of engine errors onto AMQP reply codes.

use super::Session;
use crate::engine::{ClientError, EngineError};
use weir_protocols::amqp::reply;

/// A failure that ends the connection with a hard AMQP error.
pub(super) struct Hard {
    pub(super) code: u16,
    pub(super) text: String,
    pub(super) class_id: u16,
    pub(super) method_id: u16,
}

/// Why handling a method failed.
pub(super) enum Failure {
    /// Close the channel with this code.
    Channel(u16, String),
    /// Close the connection.
    Connection(Hard),
}

impl From<EngineError> for Failure {
    fn from(e: EngineError) -> Self {
        let text = e.to_string();
        match e {
            EngineError::NotFound(_) => Failure::Channel(reply::NOT_FOUND, text),
            EngineError::AccessRefused(_) => Failure::Channel(reply::ACCESS_REFUSED, text),
            EngineError::ResourceLocked(_) => Failure::Channel(reply::RESOURCE_LOCKED, text),
            EngineError::PreconditionFailed(_) => {
                Failure::Channel(reply::PRECONDITION_FAILED, text)
            }
            EngineError::CommandInvalid(_) => bare_hard(reply::COMMAND_INVALID, text),
            EngineError::NotImplemented(_) => bare_hard(reply::NOT_IMPLEMENTED, text),
            EngineError::Store(_) => bare_hard(reply::INTERNAL_ERROR, text),
            // Tenant limits, as RabbitMQ answers them: connections close
            // the connection (530), the rest the channel (406).
            EngineError::Quota(
                weir_quota::QuotaError::Connections { .. }
                | weir_quota::QuotaError::UserConnections { .. },
            ) => {
                crate::metrics::quota_refused(crate::metrics::Protocol::Amqp);
                bare_hard(reply::NOT_ALLOWED, text)
            }
            EngineError::Quota(_) => {
                crate::metrics::quota_refused(crate::metrics::Protocol::Amqp);
                Failure::Channel(reply::PRECONDITION_FAILED, text)
            }
        }
    }
}

impl From<ClientError> for Failure {
    fn from(e: ClientError) -> Self {
        match e {
            ClientError::Engine(e) => e.into(),
            ClientError::UnknownTag(tag) => soft(
                reply::PRECONDITION_FAILED,
                format!("unknown delivery tag {tag}"),
            ),
            e @ ClientError::TagInUse(_) => hard(reply::NOT_ALLOWED, e.to_string()),
            e @ ClientError::Unreadable => hard(reply::INTERNAL_ERROR, e.to_string()),
        }
    }
}

/// A hard failure whose text already names its code.
fn bare_hard(code: u16, text: String) -> Failure {
    Failure::Connection(Hard {
        code,
        text,
        class_id: 0,
        method_id: 0,
    })
}

/// Closes the connection with `code`.
pub(super) fn hard(code: u16, text: String) -> Failure {
    bare_hard(code, format!("{} - {text}", reply::name(code)))
}

/// Closes the channel with `code`.
pub(super) fn soft(code: u16, text: String) -> Failure {
    Failure::Channel(code, format!("{} - {text}", reply::name(code)))
}

impl Session {
    /// Acts on a failure of the method `class_id.method_id` on `channel`.
    /// A channel failure while earlier replies are still queued waits its
    /// turn behind them (the channel takes no more events meanwhile), so a
    /// client sees the replies it was due before the close.
    pub(super) fn fail(&mut self, channel: u16, f: Failure, class_id: u16, method_id: u16) {
        if let Some(m) = self.metrics.as_ref() {
            m.error(match f {
                Failure::Channel(..) => "channel",
                Failure::Connection(_) => "connection",
            });
        }
        match f {
            Failure::Channel(code, text) => {
                if !self.replies.is_empty() {
                    if let Some(c) = self.channels.get_mut(&channel) {
                        if !c.failed {
                            c.failed = true;
                            let epoch = c.epoch;
                            // Its consumers stop and its leases go back now.
                            if let Some(client) = self.client.as_mut() {
                                client.release_scope(super::scope(channel));
                            }
                            self.replies
                                .push_close(channel, epoch, code, text, class_id, method_id);
                        }
                        return;
                    }
                }
                self.close_channel_now(channel, code, &text, class_id, method_id);
            }
            Failure::Connection(h) => {
                tracing::info!(peer = %self.peer, code = h.code, text = %h.text, "closing connection");
                self.release_all();
                let (c, m) = if h.class_id == 0 {
                    (class_id, method_id)
                } else {
                    (h.class_id, h.method_id)
                };
                self.conn.fail(h.code, h.text, c, m);
            }
        }
    }

    /// Releases `channel` and sends channel.close.
    pub(super) fn close_channel_now(
        &mut self,
        channel: u16,
        code: u16,
        text: &str,
        class_id: u16,
        method_id: u16,
    ) {
        tracing::debug!(peer = %self.peer, channel, code, %text, "closing channel");
        self.release_channel(channel);
        self.conn
            .close_channel(channel, code, text, class_id, method_id);
    }
}
