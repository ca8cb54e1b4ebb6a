//! Publishing: route, allocate an id, append the store record, enqueue.

use super::*;

impl Client {
    // ----- publishing -----

    /// Routes and enqueues a message. `message` builds it once it is routed,
    /// given its id. Persistent copies in durable queues are appended to the
    /// store now (the confirmation waits for a barrier); transient copies
    /// into deep queues are paged to it.
    pub fn publish(
        &mut self,
        route: &RouteInput<'_>,
        message: impl FnOnce(MessageId) -> Message,
    ) -> Result<Published> {
        self.authorize_publish(route)?;
        if route.exchange.is_empty() && route.routing_key.starts_with(REPLY_TO_PREFIX) {
            // A direct reply-to reply: to the requester's box, not a queue.
            let id = self.store.allocate_ids(1);
            return Ok(
                if self
                    .tenant
                    .replies
                    .deliver(route.routing_key, Arc::new(message(id)))
                {
                    Published::Routed {
                        needs_barrier: false,
                        refused: false,
                    }
                } else {
                    Published::Unroutable
                },
            );
        }
        let mut queues = std::mem::take(&mut self.route_buf);
        queues.clear();
        let routed = self.tenant.route(route, &mut queues);
        let result = match routed {
            Err(e) => Err(e),
            Ok(_) if queues.is_empty() => Ok(Published::Unroutable),
            Ok(how) => self.enqueue_routed(route, how, &queues, message),
        };
        queues.clear();
        self.route_buf = queues;
        result
    }

    pub(super) fn enqueue_routed(
        &mut self,
        route: &RouteInput<'_>,
        how: Routed,
        queues: &[Arc<Queue>],
        message: impl FnOnce(MessageId) -> Message,
    ) -> Result<Published> {
        let id = self.store.allocate_ids(1);
        let message = Arc::new(message(id));
        debug_assert_eq!(message.id, id, "a message keeps the id it was given");
        let size = message.size();
        let now = self.tenant.clock().now_ms();
        // Idempotent publish: the queues that already hold the message's key
        // drop it; the others record it. Their receipts stay locked until
        // the end of this call (after the store append and the enqueue), so
        // of two publishers racing with one key exactly one enqueues.
        let mut dedup =
            crate::queue::dedup::Check::new(route.headers, &message, &self.codecs, queues, now);
        // A duplicate is confirmed like the original: once the original's
        // record is durable (the latest ticket of its queue's partitions).
        let mut dup_barrier = false;
        if let Some(d) = dedup.as_ref().filter(|d| d.any_duplicate()) {
            for (i, q) in queues.iter().enumerate() {
                if d.is_duplicate(i) && message.persistent && q.partitions[0].durable {
                    dup_barrier = true;
                    for (p, t) in d.original_tickets(i) {
                        self.unconfirmed.note(p, t);
                    }
                }
            }
        }
        // Pick each queue's partition, and store once for all durable ones.
        let mut targets = std::mem::take(&mut self.publish_targets);
        let mut durable_parts = std::mem::take(&mut self.publish_durable);
        targets.clear();
        durable_parts.clear();
        // The queue TTL shared by every durable target, if they share one:
        // stored with the message's own, so a deadline that passes while
        // the broker is down is not extended by the restart.
        let mut shared_ttl: Option<Option<u64>> = None;
        for (qi, q) in queues.iter().enumerate() {
            if dedup.as_ref().is_some_and(|d| d.is_duplicate(qi)) {
                continue;
            }
            let part = q.partition_for_publish(route.headers);
            // A stream keeps every event it takes, persistent or not.
            let kept = if (message.persistent || part.stream.is_some()) && part.durable {
                let ttl = q.message_ttl();
                shared_ttl = match shared_ttl {
                    None => Some(ttl),
                    Some(t) if t == ttl => Some(t),
                    Some(_) => Some(None),
                };
                durable_parts.push(part.id);
                Kept::Stored
            } else {
                Kept::Memory
            };
            targets.push((part.clone(), kept, qi));
        }
        if targets.is_empty() {
            // A duplicate everywhere: confirmed, nothing enqueued.
            self.publish_targets = targets;
            self.publish_durable = durable_parts;
            return Ok(Published::Routed {
                needs_barrier: dup_barrier,
                refused: false,
            });
        }
        // Transient copies (a transient message, or a non-durable queue) into
        // partitions already deeper than the in-memory window are paged to
        // the store too, after the durable ones in the same buffer, so memory
        // does not grow with queue depth. Skipped entirely on the hot path
        // (every target stored).
        let n_durable = durable_parts.len();
        if n_durable < targets.len() {
            for (part, kept, _) in &mut targets {
                if *kept == Kept::Memory && part.ready_len() >= HOT_ENTRIES as u64 {
                    *kept = Kept::Paged;
                    durable_parts.push(part.id);
                }
            }
        }
        // `x-delay` holds the message back, through an `x-delayed-message`
        // exchange or in queues declared `x-delayed` (the header is only
        // looked up then). Stored, so it keeps waiting across a restart.
        let delay_ms = if how.delayed || queues.iter().any(|q| q.delayed) {
            delay_header(route.headers)
        } else {
            0
        };
        let deliver_at_ms = if delay_ms > 0 {
            now.saturating_add(delay_ms)
        } else {
            0
        };
        // The message's own TTL counts from when it enters each queue (now,
        // or when its delay ends); stored, so the deadline holds across a
        // restart.
        let entered = now.max(deliver_at_ms);
        let expires_at_ms = message
            .ttl_ms
            .map_or(0, |t| entered.saturating_add(t).max(1));
        let stored_expiry = match shared_ttl.flatten() {
            Some(t) => {
                let at = entered.saturating_add(t).max(1);
                if expires_at_ms == 0 {
                    at
                } else {
                    at.min(expires_at_ms)
                }
            }
            None => expires_at_ms,
        };
        // A stream's events carry their publish time in the record (a
        // stream never delays): its index is rebuilt from it at restart.
        let deliver_at_ms =
            if deliver_at_ms == 0 && targets.iter().any(|(p, _, _)| p.stream.is_some()) {
                now
            } else {
                deliver_at_ms
            };
        let data = MessageData {
            exchange: route.exchange,
            routing_key: route.routing_key,
            header_format: message.header_format.to_u8(),
            header: &message.properties,
            body: &message.body,
            attrs: MessageAttrs {
                priority: message.priority,
                expires_at_ms: stored_expiry,
                deliver_at_ms,
            },
        };
        let mut location = None;
        // Receipts of stored copies ride in the publish's batch (one writer
        // round: after a crash both or neither), except where the queue may
        // refuse the message (a length limit with reject-publish): there the
        // receipt is appended once the queue took it, since a refused
        // publish must leave no receipt (its retry is not a duplicate).
        let mut with_publish: Vec<Op<'_>> = Vec::new();
        let mut receipt_in_batch: Vec<usize> = Vec::new();
        if let Some(d) = dedup.as_ref() {
            for (_, kept, qi) in &targets {
                if *kept != Kept::Stored || queues[*qi].may_refuse_publish() {
                    continue;
                }
                if let Some((partition, key_hash, expires_at_ms)) = d.receipt(*qi) {
                    with_publish.push(Op::Receipt {
                        partition,
                        key_hash,
                        expires_at_ms,
                    });
                    receipt_in_batch.push(*qi);
                }
            }
        }
        if n_durable > 0 {
            self.locs.clear();
            let publish = Op::Publish {
                id,
                partitions: &durable_parts[..n_durable],
                data,
            };
            let res = if with_publish.is_empty() {
                self.store
                    .append_for(self.share, &[publish], &mut self.locs)
            } else {
                with_publish.insert(0, publish);
                self.store
                    .append_for(self.share, &with_publish, &mut self.locs)
            };
            let res = res.map(|(ticket, a)| {
                self.over_share |= a.over_share;
                for p in &durable_parts[..n_durable] {
                    self.unconfirmed.note(*p, ticket);
                }
                for op in with_publish.iter().skip(1) {
                    if let Op::Receipt { partition, .. } = op {
                        self.unconfirmed.note(*partition, ticket);
                    }
                }
                if let Some(d) = dedup.as_mut() {
                    // A later duplicate is confirmed after this ticket.
                    for (part, kept, qi) in &targets {
                        if *kept == Kept::Stored {
                            d.note_ticket(*qi, part.id, ticket);
                        }
                    }
                }
            });
            if let Err(e) = res {
                // Nothing enqueued: no receipt either.
                if let Some(d) = dedup.as_mut() {
                    d.undo_all();
                }
                self.publish_targets = targets;
                self.publish_durable = durable_parts;
                return match e {
                    StoreError::NoSpace => Ok(Published::NoSpace),
                    e => Err(e.into()),
                };
            }
            location = self.locs.first().copied();
            debug_assert!(
                location.is_some(),
                "store returned no location for a publish"
            );
        }
        let mut page_location = None;
        if durable_parts.len() > n_durable {
            // To the store's spill, never waited on: a restart drops it
            // anyway. If it cannot take it (disk full, or the store has no
            // spill), the message simply stays in memory.
            let res = self
                .store
                .spill()
                .map(|s| s.spill(self.share, id, &durable_parts[n_durable..], data));
            match res {
                Some(Ok((loc, a))) => {
                    self.over_share |= a.over_share;
                    page_location = Some(loc);
                }
                Some(Err(e)) => tracing::debug!(error = %e, "not paging a transient message"),
                None => {}
            }
        }
        let mut refused_any = false;
        // Receipts and cancellations appended after the enqueue.
        let mut after: Vec<Op<'static>> = Vec::new();
        let mut cancelled = false;
        for (part, kept, qi) in targets.drain(..) {
            let location = match kept {
                Kept::Stored => location,
                // None if the store could not take the page: kept in memory.
                Kept::Paged => page_location,
                Kept::Memory => None,
            };
            let delayed =
                deliver_at_ms > 0 && (how.delayed || part.queue().is_some_and(|q| q.delayed));
            let entry = Entry {
                seq: 0,
                id,
                location,
                size,
                redelivered: false,
                attempts: 0,
                priority: message.priority,
                enqueued_ms: now,
                expires_at_ms,
                message: Some(message.clone()),
            };
            let refused = if let Some(log) = part.stream.as_deref() {
                if let Some(at) = entry.location {
                    let (_, cut) = log.append(MessageRef::new(part.id, id, at), now, &message);
                    if let Some(t) = cut {
                        self.truncate_stream(part.id, t);
                    }
                }
                Enqueued::Queued
            } else if delayed {
                part.enqueue_at(entry, deliver_at_ms)
            } else {
                part.enqueue(entry)
            };
            // The queue was deleted after routing, or is full and refuses
            // publishes: the message is gone from it (its record was
            // appended above, so the settle follows it).
            let taken = matches!(refused, Enqueued::Queued);
            let gone_kind = match refused {
                Enqueued::Deleted(_) => Gone::Deleted,
                _ => Gone::Other,
            };
            let gone = match refused {
                Enqueued::Queued => None,
                Enqueued::Deleted(e) => e.location,
                Enqueued::Overflow {
                    entry,
                    dead_lettered,
                } => {
                    refused_any = true;
                    entry.location.filter(|_| !dead_lettered)
                }
            };
            if let Some(l) = gone {
                self.settles.push(Op::Settle {
                    partition: part.id,
                    id,
                    location: l,
                });
            }
            if let Some(d) = dedup.as_mut() {
                let receipt = d.receipt(qi).filter(|_| kept == Kept::Stored);
                let in_batch = receipt_in_batch.contains(&qi);
                match (taken, receipt) {
                    // Before the publisher's barrier, so its confirm
                    // covers the receipt.
                    (true, Some((partition, key_hash, expires_at_ms))) if !in_batch => {
                        after.push(Op::Receipt {
                            partition,
                            key_hash,
                            expires_at_ms,
                        })
                    }
                    (false, receipt) => {
                        // Not taken: a retry must not be dropped as a
                        // duplicate.
                        d.undo(qi);
                        // Refused although the queue had no reason to (a
                        // policy set meanwhile): the stored receipt is
                        // cancelled. A deleted queue's receipts die with it.
                        if let (Some((partition, key_hash, expires_at_ms)), true) =
                            (receipt, in_batch && !matches!(gone_kind, Gone::Deleted))
                        {
                            after.push(Op::Receipt {
                                partition: crate::queue::dedup::cancel_id(partition),
                                key_hash,
                                expires_at_ms,
                            });
                            cancelled = true;
                        }
                    }
                    _ => {}
                }
            }
        }
        if !after.is_empty() {
            self.locs.clear();
            match self.store.append(&after, &mut self.locs) {
                Ok(ticket) => {
                    self.unconfirmed.note_ops(&after, ticket);
                    if cancelled {
                        // A cancellation wakes the writer at once (the
                        // publisher's nack does not wait for the store).
                        self.store.when_durable(ticket, Box::new(|_| {}));
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "idempotency receipt not stored: a duplicate may be accepted after a restart")
                }
            }
        }
        drop(dedup);
        self.publish_durable = durable_parts;
        self.publish_targets = targets;
        Ok(Published::Routed {
            needs_barrier: n_durable > 0 || dup_barrier,
            refused: refused_any,
        })
    }
}

/// The `x-delay` header in ms (0 if absent, not a number, or negative, as
/// RabbitMQ's delayed-message plugin treats them).
fn delay_header(headers: &dyn crate::exchange::HeaderLookup) -> u64 {
    match headers.header(crate::queue::DELAY_HEADER) {
        Some(serde_json::Value::Number(n)) => n
            .as_u64()
            .or_else(|| n.as_f64().filter(|f| *f > 0.0).map(|f| f as u64))
            .unwrap_or(0),
        Some(serde_json::Value::String(s)) => s.trim().parse().unwrap_or(0),
        _ => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::delay_header;
    use crate::exchange::HeaderLookup;
    use serde_json::{json, Value};

    struct One(Value);
    impl HeaderLookup for One {
        fn header(&self, name: &str) -> Option<Value> {
            (name == "x-delay").then(|| self.0.clone())
        }
    }

    #[test]
    fn x_delay_reads_numbers_and_digit_strings_and_ignores_the_rest() {
        for (v, ms) in [
            (json!(1500), 1500),
            (json!(2.9), 2),
            (json!("750"), 750),
            (json!(" 40 "), 40),
            (json!(-5), 0),
            (json!(-0.5), 0),
            (json!("soon"), 0),
            (json!("-3"), 0),
            (json!(null), 0),
            (json!([1, 2]), 0),
            (json!({"ms": 1}), 0),
            (json!(u64::MAX), u64::MAX),
        ] {
            assert_eq!(delay_header(&One(v.clone())), ms, "{v}");
        }
    }
}
