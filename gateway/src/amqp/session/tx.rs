//! AMQP transactions (tx.select, tx.commit, tx.rollback), as RabbitMQ
//! has them: on a transacted channel, publishes and acks/nacks/rejects are
//! held by the session and take effect at tx.commit; tx.rollback drops
//! them (rolled-back acks leave their messages unacked, still leased).
//!
//! What is checked when a method arrives, as RabbitMQ does: a publish's
//! exchange (404, or 403 for an internal one) and `expiration` (406); an
//! ack's delivery tag (406 unknown delivery tag; a `multiple` ack takes the
//! leases outstanding *now*, not those delivered before the commit). The
//! commit then publishes everything through the engine client, mandatory
//! returns included, settles the held tags, and answers commit-ok once
//! every persistent publish of the transaction is durable (the batch's
//! [`Ticket`], through [`super::replies`]: the connection is not stalled
//! meanwhile).
//!
//! Held work is bounded: [`MAX_TX_ENTRIES`] per channel and
//! [`MAX_TX_BYTES`] per connection; past either the channel is closed
//! with 406 rather than the buffer growing.

use super::failure::{soft, Failure};
use super::{scope, Session};
use crate::engine::client::Published;
use crate::engine::lease::Settle;
use crate::engine::ClientError;
use crate::session::durable::Ticket;
use std::collections::HashSet;
use weir_protocols::amqp::methods::{tx, AMQPClass};
use weir_protocols::amqp::{reply, Publish};

/// Publishes and settled delivery tags one transaction may hold.
pub(super) const MAX_TX_ENTRIES: usize = 65_536;
/// Bytes of uncommitted messages (and settles) a connection may hold in
/// all its transactions.
pub(super) const MAX_TX_BYTES: usize = 32 << 20;
/// What a held settle counts against [`MAX_TX_BYTES`] (its entry and its
/// place in the set of settled tags).
const SETTLE_COST: usize = 32;
/// What a held publish costs beyond its bytes.
const PUBLISH_OVERHEAD: usize = 64;

/// The uncommitted work of a transacted channel.
#[derive(Default)]
pub(super) struct Tx {
    /// Publishes, in order, with their checked `expiration`.
    publishes: Vec<(Publish, Option<u64>)>,
    /// Settles, one per delivery tag, in order.
    settles: Vec<(u64, Settle)>,
    /// The tags in `settles`: no longer unacked as far as the client's
    /// later acks are concerned (RabbitMQ takes them off its unacked list
    /// at once and puts them back on rollback).
    settled: HashSet<u64>,
    /// Bytes counted against [`MAX_TX_BYTES`].
    bytes: usize,
}

impl Tx {
    /// Bytes it counts against [`MAX_TX_BYTES`].
    pub(super) fn bytes(&self) -> usize {
        self.bytes
    }

    fn entries(&self) -> usize {
        self.publishes.len() + self.settles.len()
    }
}

/// The cost of holding `p`.
fn publish_cost(p: &Publish) -> usize {
    p.exchange.len() + p.routing_key.len() + p.properties.len() + p.body.len() + PUBLISH_OVERHEAD
}

fn too_large() -> Failure {
    soft(
        reply::PRECONDITION_FAILED,
        format!(
            "transaction too large: at most {MAX_TX_ENTRIES} publishes and acknowledgements \
             per transaction and {MAX_TX_BYTES} bytes of uncommitted messages per connection; \
             commit more often"
        ),
    )
}

fn not_open() -> Failure {
    super::failure::hard(reply::COMMAND_INVALID, "connection not open".into())
}

fn not_transactional() -> Failure {
    soft(
        reply::PRECONDITION_FAILED,
        "channel is not transactional".into(),
    )
}

impl Session {
    /// Whether channel `ch` is transacted.
    pub(super) fn is_transacted(&self, ch: u16) -> bool {
        self.channels.get(&ch).is_some_and(|c| c.tx.is_some())
    }

    /// tx.select, tx.commit, tx.rollback.
    pub(super) fn on_tx(
        &mut self,
        ch: u16,
        m: tx::AMQPMethod,
        ids: (u16, u16),
    ) -> Result<(), Failure> {
        match m {
            tx::AMQPMethod::Select(_) => {
                let Some(c) = self.channels.get_mut(&ch) else {
                    return Ok(());
                };
                if c.confirm {
                    return Err(soft(
                        reply::PRECONDITION_FAILED,
                        "cannot switch from confirm to tx mode".into(),
                    ));
                }
                // Selecting again is allowed and keeps what is held.
                c.tx.get_or_insert_with(Tx::default);
                self.reply(ch, AMQPClass::Tx(tx::AMQPMethod::SelectOk(tx::SelectOk {})));
            }
            tx::AMQPMethod::Commit(_) => self.tx_commit(ch, ids)?,
            tx::AMQPMethod::Rollback(_) => {
                let held = self.take_tx(ch)?;
                // Held acks were never settled: their leases stay as they
                // were (unacked, not redelivered), as in RabbitMQ.
                drop(held);
                self.reply(
                    ch,
                    AMQPClass::Tx(tx::AMQPMethod::RollbackOk(tx::RollbackOk {})),
                );
            }
            other => {
                return Err(super::failure::hard(
                    reply::COMMAND_INVALID,
                    format!("{other:?} is not valid from a client"),
                ))
            }
        }
        Ok(())
    }

    /// Takes the channel's held work, leaving an empty transaction.
    fn take_tx(&mut self, ch: u16) -> Result<Tx, Failure> {
        let Some(c) = self.channels.get_mut(&ch) else {
            return Ok(Tx::default());
        };
        let held = std::mem::take(c.tx.as_mut().ok_or_else(not_transactional)?);
        self.tx_bytes -= held.bytes;
        Ok(held)
    }

    /// Holds a publish of a transacted channel until commit (its checks
    /// are done: [`Session::on_publish`]).
    pub(super) fn tx_publish(
        &mut self,
        ch: u16,
        p: Publish,
        ttl: Option<u64>,
    ) -> Result<(), Failure> {
        let cost = publish_cost(&p);
        let total = self.tx_bytes + cost;
        let Some(t) = self.channels.get_mut(&ch).and_then(|c| c.tx.as_mut()) else {
            return Ok(());
        };
        if t.entries() >= MAX_TX_ENTRIES || total > MAX_TX_BYTES {
            return Err(too_large());
        }
        t.publishes.push((p, ttl));
        t.bytes += cost;
        self.tx_bytes = total;
        Ok(())
    }

    /// Holds an ack, nack or reject of a transacted channel until commit.
    /// The tags it covers are resolved now, as RabbitMQ does.
    pub(super) fn tx_settle(
        &mut self,
        ch: u16,
        tag: u64,
        multiple: bool,
        how: Settle,
    ) -> Result<(), Failure> {
        let s = scope(ch);
        let mut tags = Vec::new();
        {
            // Fields apart: the client is read while the channel is.
            let client = self.client.as_ref().ok_or_else(not_open)?;
            let Some(t) = self.channels.get(&ch).and_then(|c| c.tx.as_ref()) else {
                return Ok(());
            };
            let outstanding = |tag| client.is_leased(s, tag) && !t.settled.contains(&tag);
            if multiple {
                if tag != 0 && !outstanding(tag) {
                    return Err(ClientError::UnknownTag(tag).into());
                }
                client.leased_tags(s, tag, &mut tags);
                tags.retain(|x| !t.settled.contains(x));
            } else {
                if !outstanding(tag) {
                    return Err(ClientError::UnknownTag(tag).into());
                }
                tags.push(tag);
            }
        }
        let cost = tags.len() * SETTLE_COST;
        let total = self.tx_bytes + cost;
        let Some(t) = self.channels.get_mut(&ch).and_then(|c| c.tx.as_mut()) else {
            return Ok(());
        };
        if t.entries() + tags.len() > MAX_TX_ENTRIES || total > MAX_TX_BYTES {
            return Err(too_large());
        }
        for x in tags {
            t.settled.insert(x);
            t.settles.push((x, how));
        }
        t.bytes += cost;
        self.tx_bytes = total;
        Ok(())
    }

    /// basic.recover on a transacted channel: the leases not settled by
    /// the transaction go back to their queues; those it settles stay
    /// with it (RabbitMQ took them off its unacked list at the ack).
    pub(super) fn tx_recover(&mut self, ch: u16) -> Result<(), Failure> {
        let s = scope(ch);
        let mut tags = Vec::new();
        self.client()?.leased_tags(s, 0, &mut tags);
        if let Some(t) = self.channels.get(&ch).and_then(|c| c.tx.as_ref()) {
            tags.retain(|x| !t.settled.contains(x));
        }
        let client = self.client()?;
        for tag in tags {
            client.settle(s, tag, false, Settle::Requeue)?;
        }
        Ok(())
    }

    /// tx.commit: the held publishes, in order (returns for unroutable
    /// mandatory ones), then the held settles; commit-ok once the
    /// persistent publishes are durable.
    ///
    /// Each publish is its own store append (as outside a transaction):
    /// a crash in the middle of a commit can keep a prefix of its
    /// publishes, never one the client was told was committed. The held
    /// settles go into the batch's one append.
    fn tx_commit(&mut self, ch: u16, ids: (u16, u16)) -> Result<(), Failure> {
        let held = self.take_tx(ch)?;
        let mut needs_barrier = false;
        let mut refused = false;
        for (p, ttl) in held.publishes {
            match self.store_publish(&p, ttl)? {
                Published::Routed {
                    needs_barrier: b, ..
                } => needs_barrier |= b,
                Published::Unroutable => {
                    if p.mandatory {
                        self.write_return(ch, &p, true);
                    }
                }
                // Out of disk space: RabbitMQ fails a commit some of whose
                // publishes were refused ("partial tx completion").
                Published::NoSpace => refused = true,
            }
        }
        let s = scope(ch);
        let client = self.client()?;
        for (tag, how) in held.settles {
            match client.settle(s, tag, false, how) {
                // Returned to its queue since (basic.recover cannot take
                // it; only a channel close could, and that drops this).
                Ok(()) | Err(ClientError::UnknownTag(_)) => {}
                Err(e) => return Err(e.into()),
            }
        }
        if refused {
            return Err(soft(
                reply::PRECONDITION_FAILED,
                "partial tx completion".into(),
            ));
        }
        let ticket = if needs_barrier {
            self.durability.ticket()
        } else {
            Ticket::NONE
        };
        self.reply_after(
            ch,
            ticket,
            AMQPClass::Tx(tx::AMQPMethod::CommitOk(tx::CommitOk {})),
            ids,
        );
        Ok(())
    }
}
