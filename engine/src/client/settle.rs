//! Settling leases, their expiry, and the batch a session commits once per
//! read.

use super::*;

impl Client {
    // ----- settling -----

    /// Settles the lease `tag` of `scope`, or with `multiple` every lease up
    /// to it (0 = all). The tag must be outstanding (unless 0 with
    /// `multiple`).
    pub fn settle(
        &mut self,
        scope: Scope,
        tag: u64,
        multiple: bool,
        how: Settle,
    ) -> Result<(), ClientError> {
        let Some(st) = self.scopes.get_mut(&scope) else {
            return if multiple && tag == 0 {
                Ok(())
            } else {
                Err(ClientError::UnknownTag(tag))
            };
        };
        // With a window shared by several consumers (AMQP global qos), the
        // credit a settle gives back may be what another queue of the scope
        // waits for: those queues dispatch again too, as RabbitMQ's limiter
        // wakes every queue blocked on the channel.
        let shared_window = st.subs.len() > 1
            && (st.window.max_count.load(Ordering::Relaxed) > 0
                || st.window.max_bytes.load(Ordering::Relaxed) > 0);
        if !multiple {
            let lease = st.leases.remove(tag).ok_or(ClientError::UnknownTag(tag))?;
            self.settle_one(lease, how, Return::Failed);
        } else {
            let leases = st
                .leases
                .take_up_to(tag)
                .ok_or(ClientError::UnknownTag(tag))?;
            self.settle_many(leases, how, Return::Failed);
        }
        if shared_window {
            self.redispatch(Some(scope));
        }
        Ok(())
    }

    /// Leases outstanding in `scope`.
    pub fn leases(&self, scope: Scope) -> usize {
        self.scopes.get(&scope).map_or(0, |st| st.leases.len())
    }

    /// Whether `tag` is an outstanding lease of `scope`.
    pub fn is_leased(&self, scope: Scope, tag: u64) -> bool {
        self.scopes
            .get(&scope)
            .is_some_and(|st| st.leases.contains(tag))
    }

    /// Appends the outstanding tags of `scope` up to and including `tag`
    /// (0 = all) to `out`, in order: what a `multiple` settle would take
    /// now (an AMQP transaction resolves its acks when they arrive).
    pub fn leased_tags(&self, scope: Scope, tag: u64, out: &mut Vec<u64>) {
        if let Some(st) = self.scopes.get(&scope) {
            st.leases.tags_up_to(tag, out);
        }
    }

    pub(super) fn settle_one(&mut self, l: Lease, how: Settle, why: Return) {
        if let Some(c) = &l.consumer {
            c.release(l.entry.size);
        }
        if l.partition.stream.is_some() {
            // A stream's acks only give credit back (as RabbitMQ's).
            return;
        }
        if how == Settle::Requeue && !l.partition.is_deleted() {
            let refused = l
                .partition
                .requeue(std::iter::once(l.entry), why, &mut self.settles);
            self.settle_refused(&l.partition, refused);
            if l.consumer.is_some() {
                self.push_dispatch(l.partition);
            }
            return;
        }
        if how == Settle::Drop && l.partition.dead_letters() {
            l.partition.reject(std::iter::once(l.entry));
        } else if let Some(loc) = l.partition.settled(&l.entry, how == Settle::Ack) {
            self.push_settle(l.partition.id, l.entry.id, loc);
        }
        self.push_dispatch(l.partition);
    }

    pub(super) fn settle_many(&mut self, leases: Vec<Lease>, how: Settle, why: Return) {
        // Grouped by partition so each takes its lock once per batch (a
        // `multiple` ack usually settles many leases of one queue).
        let mut drop: Vec<(Arc<Partition>, Vec<Entry>)> = Vec::new();
        let mut requeue: Vec<(Arc<Partition>, Vec<Entry>)> = Vec::new();
        for l in leases {
            if let Some(c) = &l.consumer {
                c.release(l.entry.size);
            }
            if l.partition.stream.is_some() {
                continue;
            }
            let drop_it = how != Settle::Requeue || l.partition.is_deleted();
            let groups = if drop_it { &mut drop } else { &mut requeue };
            match groups
                .iter_mut()
                .find(|(p, _)| Arc::ptr_eq(p, &l.partition))
            {
                Some((_, v)) => v.push(l.entry),
                None => groups.push((l.partition, vec![l.entry])),
            }
        }
        let acked = how == Settle::Ack;
        for (p, entries) in drop {
            if how == Settle::Drop && !p.is_deleted() && p.dead_letters() {
                p.reject(entries);
                self.push_dispatch(p);
                continue;
            }
            let settles = &mut self.settles;
            p.settled_many(&entries, acked, |id, location| {
                settles.push(Op::Settle {
                    partition: p.id,
                    id,
                    location,
                })
            });
            self.push_dispatch(p);
        }
        for (p, entries) in requeue {
            let refused = p.requeue(entries, why, &mut self.settles);
            self.settle_refused(&p, refused);
            if p.partitioned {
                self.push_dispatch(p);
            }
        }
    }

    /// Settles in the store what a deleted partition refused to take back.
    pub(super) fn settle_refused(&mut self, p: &Arc<Partition>, refused: Vec<Entry>) {
        for e in refused {
            // Paged entries of non-durable queues have a location too.
            if let Some(l) = e.location {
                self.push_settle(p.id, e.id, l);
            }
        }
    }

    pub(super) fn push_settle(
        &mut self,
        partition: PartitionId,
        id: MessageId,
        location: Location,
    ) {
        self.settles.push(Op::Settle {
            partition,
            id,
            location,
        });
    }

    pub(super) fn push_dispatch(&mut self, p: Arc<Partition>) {
        // Consecutive settles are usually of one partition: skip repeats
        // cheaply; `commit` deduplicates the rest.
        if self.to_dispatch.last().is_some_and(|x| Arc::ptr_eq(x, &p)) {
            return;
        }
        // The credit a settle gives back is the consumer's, shared by every
        // partition of its queue: a sibling refused for lack of it must be
        // offered it again, or it starves while this one runs dry.
        if let Some(q) = p.partitioned.then(|| p.queue()).flatten() {
            for sibling in q.partitions.iter().filter(|s| !Arc::ptr_eq(s, &p)) {
                self.to_dispatch.push(sibling.clone());
            }
        }
        self.to_dispatch.push(p);
    }

    // ----- lease expiry -----

    /// Scopes holding a lease written more than `timeout` before `now`
    /// (RabbitMQ's `consumer_timeout`): the caller closes them, which
    /// returns their leases to their queues.
    pub fn expired_scopes(&self, now: Instant, timeout: Duration) -> Vec<Scope> {
        self.scopes
            .iter()
            .filter(|(_, st)| {
                st.leases
                    .oldest()
                    .is_some_and(|since| now.saturating_duration_since(since) > timeout)
            })
            .map(|(s, _)| *s)
            .collect()
    }

    // ----- the batch -----

    /// Whether [`Self::commit`] has anything to do.
    pub fn has_uncommitted(&self) -> bool {
        !self.settles.is_empty() || !self.to_dispatch.is_empty()
    }

    /// Closes the batch: one store append for its settles (after every
    /// publish record they settle, which was appended when published), then
    /// the partitions whose consumers got credit back deliver again.
    pub fn commit(&mut self) {
        // Paged copies are released through the spill, not the store.
        crate::spill::release_spilled(&*self.store, &mut self.settles);
        if !self.settles.is_empty() {
            self.locs.clear();
            match self
                .store
                .append_for(self.share, &self.settles, &mut self.locs)
            {
                Ok((ticket, a)) => {
                    self.over_share |= a.over_share;
                    self.unconfirmed.note_ops(&self.settles, ticket);
                }
                Err(e) => tracing::error!(error = %e, "store refused settles"),
            }
            self.settles.clear();
        }
        dedup_partitions(&mut self.to_dispatch);
        for p in self.to_dispatch.drain(..) {
            p.dispatch();
        }
    }

    /// Whether the store said, since the last call, that this client's
    /// tenant is over its share of the store's writer (other tenants wait
    /// behind its backlog). A session then reads no more from its socket
    /// until a [`Self::durability_barrier`] completes: each of the tenant's
    /// connections has at most one batch ahead of the other tenants' next
    /// records. Never set while one tenant alone writes.
    pub fn take_store_pressure(&mut self) -> bool {
        std::mem::take(&mut self.over_share)
    }

    /// Whether [`Self::take_store_pressure`] would say yes (the flag stays).
    pub fn has_store_pressure(&self) -> bool {
        self.over_share
    }

    /// Calls `waiter` once everything this client appended so far is
    /// durable (a publisher's confirmation): the store's tickets of its
    /// publishes, receipts and settles since its last barrier, of the
    /// originals of duplicates it published, and of the metadata and state
    /// store changed so far (declares, MQTT session state and retained
    /// messages are written through the tenant). Barriers complete in the
    /// order they were asked for.
    pub fn durability_barrier(&mut self, waiter: Waiter) -> Result<(), StoreError> {
        if let Ok(engine) = self.tenant.engine() {
            self.unconfirmed
                .note_side(engine.meta_ticket(), engine.state_ticket());
        }
        self.unconfirmed.barrier(&*self.store, waiter);
        Ok(())
    }
}
