//! Subscriptions, pulls (basic.get) and deliveries: from a partition's
//! outbox to a lease, with the read-back of paged or cold messages.

use super::*;

impl Client {
    // ----- subscriptions -----

    /// Subscribes to `queue`. Exclusivity is checked and the consumer
    /// attached in one step owned by the queue, so of two exclusive
    /// subscriptions racing for one queue exactly one wins. Deliveries may
    /// be pushed to the outbox before this returns; they are only handed
    /// out by [`Self::next_delivery`], after the caller answered.
    pub fn subscribe(
        &mut self,
        queue: &str,
        opts: SubscribeOptions,
    ) -> Result<Arc<Consumer>, ClientError> {
        self.subscribe_at(queue, opts, None)
    }

    /// [`Self::subscribe`], starting a stream queue's consumer at `offset`
    /// (`next` when None; ignored by other queues, as RabbitMQ ignores
    /// `x-stream-offset` there). A stream consumer must acknowledge and
    /// have a prefetch count; an offset dropped by retention is refused
    /// (`crate::stream::Refusal`), never skipped.
    pub fn subscribe_at(
        &mut self,
        queue: &str,
        opts: SubscribeOptions,
        offset: Option<crate::stream::OffsetSpec>,
    ) -> Result<Arc<Consumer>, ClientError> {
        self.authorize(Permission::Read, Resource::Queue(queue))?;
        let q = self.queue(queue)?;
        let stream_starts = if q.partitions[0].stream.is_some() {
            Some(self.stream_starts(&q, &opts, offset)?)
        } else {
            None
        };
        if self.tenant.quota().max_consumers().is_some() {
            let count = self.tenant.consumer_count();
            self.tenant
                .quota()
                .check_consumer(&self.tenant.name, count)
                .map_err(EngineError::from)?;
        }
        let handle = self.handle.clone();
        let tenant = self.tenant.name.clone();
        let st = self.scope_mut(opts.scope);
        if st.subs.contains_key(&opts.tag) || st.reply.as_ref().is_some_and(|r| r.tag == opts.tag) {
            return Err(ClientError::TagInUse(
                String::from_utf8_lossy(&opts.tag).into_owned(),
            ));
        }
        let (credit, window) = if opts.no_ack {
            (Credit::new(NO_ACK_WINDOW, 0), None)
        } else {
            (
                Credit::new(opts.prefetch_count, opts.prefetch_bytes),
                Some(st.window.clone()),
            )
        };
        let consumer = Consumer::new(
            opts.tag.clone(),
            opts.scope,
            opts.no_ack,
            opts.exclusive,
            opts.priority,
            handle,
            credit,
            window,
            st.flow.clone(),
        );
        match q.attach_consumer(&consumer) {
            Ok(()) => q.touch(),
            Err(AttachError::NotFound) => {
                return Err(EngineError::NotFound(format!(
                    "no queue '{}' in vhost '{}'",
                    q.name(),
                    tenant
                ))
                .into())
            }
            Err(AttachError::Exclusive) => {
                return Err(EngineError::AccessRefused(format!(
                    "queue '{}' in vhost '{}' in exclusive use",
                    q.name(),
                    tenant
                ))
                .into())
            }
        }
        st.subs.insert(
            opts.tag,
            Subscription {
                consumer: consumer.clone(),
                queue: q,
            },
        );
        if let Some(starts) = stream_starts {
            self.streams.push(crate::stream::reader::StreamSub::new(
                consumer.clone(),
                starts,
            ));
        }
        Ok(consumer)
    }

    /// Cancels the subscription `tag` of `scope`; false if there is none.
    /// Its leases stay until settled; its undelivered deliveries go back.
    pub fn unsubscribe(&mut self, scope: Scope, tag: &[u8]) -> bool {
        if let Some(st) = self.scopes.get_mut(&scope) {
            if st.reply.as_ref().is_some_and(|r| r.tag == tag) {
                if let Some(b) = st.reply.take() {
                    self.tenant.replies.close(&b);
                    self.reply_scopes -= 1;
                }
                return true;
            }
        }
        let Some(sub) = self
            .scopes
            .get_mut(&scope)
            .and_then(|st| st.subs.remove(tag))
        else {
            return false;
        };
        self.tenant.detach(&sub.queue, &sub.consumer);
        true
    }

    /// Whether `scope` has a subscription tagged `tag`.
    pub fn has_subscription(&self, scope: Scope, tag: &[u8]) -> bool {
        self.scopes.get(&scope).is_some_and(|st| {
            st.subs.contains_key(tag) || st.reply.as_ref().is_some_and(|r| r.tag == tag)
        })
    }

    /// Direct reply-to: makes `tag` the reply consumer of `scope` (a
    /// consume of [`REPLY_TO`]). RabbitMQ's refusals: an acknowledging
    /// consumer, or a second one in the scope, is a 406.
    pub fn consume_reply_to(
        &mut self,
        scope: Scope,
        tag: Bytes,
        no_ack: bool,
    ) -> Result<(), ClientError> {
        let handle = self.handle.clone();
        let st = self.scope_mut(scope);
        if st.subs.contains_key(&tag) || st.reply.as_ref().is_some_and(|r| r.tag == tag) {
            return Err(ClientError::TagInUse(
                String::from_utf8_lossy(&tag).into_owned(),
            ));
        }
        if !no_ack {
            return Err(EngineError::PreconditionFailed(
                "reply consumer cannot acknowledge".into(),
            )
            .into());
        }
        if st.reply.is_some() {
            return Err(
                EngineError::PreconditionFailed("reply consumer already set".into()).into(),
            );
        }
        let b = self.tenant.replies.open(handle, scope, tag);
        self.scope_mut(scope).reply = Some(b);
        self.reply_scopes += 1;
        Ok(())
    }

    /// The address a request from `scope` gets as its `reply-to` when it
    /// asks for [`REPLY_TO`]; 406 (RabbitMQ's text) when the scope has no
    /// reply consumer.
    pub fn reply_to_address(&self, scope: Scope) -> Result<String> {
        self.scopes
            .get(&scope)
            .and_then(|st| st.reply.as_ref())
            .map(|b| b.address())
            .ok_or_else(|| {
                EngineError::PreconditionFailed("fast reply consumer does not exist".into())
            })
    }

    /// Whether any scope has a direct reply-to consumer.
    pub fn has_reply_consumers(&self) -> bool {
        self.reply_scopes > 0
    }

    /// The next reply waiting for one of this client's reply consumers.
    /// Replies are not leased (their consumers never acknowledge).
    pub fn next_reply(&mut self) -> Option<Reply> {
        if self.reply_scopes == 0 {
            return None;
        }
        self.scopes.values().find_map(|st| {
            let b = st.reply.as_ref()?;
            let message = b.pop()?;
            Some(Reply {
                scope: b.scope,
                consumer_tag: b.tag.clone(),
                routing_key: Bytes::from(b.address()),
                message,
            })
        })
    }

    /// Pauses or resumes the deliveries of `scope` (AMQP channel.flow).
    pub fn set_flow(&mut self, scope: Scope, active: bool) {
        let st = self.scope_mut(scope);
        st.flow.store(active, Ordering::Release);
        if active {
            self.redispatch(Some(scope));
        }
    }

    /// Sets the window shared by the scope's acknowledging consumers
    /// (0 = no limit). It applies to existing consumers too; a raised limit
    /// may let their queues deliver at the next commit.
    pub fn set_scope_window(&mut self, scope: Scope, count: u32, bytes: u32) {
        let st = self.scope_mut(scope);
        st.window.max_count.store(count, Ordering::Relaxed);
        st.window.max_bytes.store(bytes, Ordering::Relaxed);
        self.redispatch(Some(scope));
    }

    /// Queues a dispatch of every partition `scope` (or every scope)
    /// consumes from, for the next commit.
    pub(super) fn redispatch(&mut self, scope: Option<Scope>) {
        let scopes = self
            .scopes
            .iter()
            .filter(|(s, _)| scope.is_none_or(|x| x == **s));
        for (_, st) in scopes {
            for sub in st.subs.values() {
                self.to_dispatch
                    .extend(sub.queue.partitions.iter().cloned());
            }
        }
        dedup_partitions(&mut self.to_dispatch);
        if !self.streams.is_empty() {
            // Stream cursors are pumped by the next drain.
            self.handle.wake();
        }
    }

    // ----- pulls -----

    /// Takes the head message of `queue` (AMQP basic.get), if any.
    pub fn get(&mut self, queue: &str, ack: GetAck) -> Result<Option<Got>, ClientError> {
        self.authorize(Permission::Read, Resource::Queue(queue))?;
        let q = self.queue(queue)?;
        if q.partitions[0].stream.is_some() {
            return Err(EngineError::NotImplemented(format!(
                "basic.get not supported by stream queues queue '{}' in vhost '{}'",
                q.name(),
                self.tenant.name
            ))
            .into());
        }
        let got = q
            .partitions
            .iter()
            .find_map(|p| p.get().map(|(e, _)| (p.clone(), e)));
        let Some((partition, entry)) = got else {
            return Ok(None);
        };
        q.touch();
        let remaining = q.message_count();
        let message = match &entry.message {
            Some(m) => m.clone(),
            // A pull answers at once: read on this thread.
            None => match crate::readback::read_blocking(&*self.store, &partition, &entry) {
                Some(m) => m,
                None => {
                    // Unreadable (the store said why): drop it rather than
                    // fail on it forever, and free its record.
                    if let Some(l) = partition.settled(&entry, false) {
                        self.push_settle(partition.id, entry.id, l);
                    }
                    return Err(ClientError::Unreadable);
                }
            },
        };
        let message = self.with_delivery_count(&partition, &entry, message);
        let redelivered = entry.redelivered;
        match ack {
            GetAck::Auto => self.settle_one(
                Lease {
                    partition,
                    consumer: None,
                    entry,
                    since: self.tenant.clock().now(),
                },
                Settle::Ack,
                Return::Failed,
            ),
            GetAck::Lease { scope, tag, now } => self.scope_mut(scope).leases.insert(
                tag,
                Lease {
                    partition,
                    consumer: None,
                    entry,
                    since: now,
                },
            ),
        }
        Ok(Some(Got {
            message,
            redelivered,
            remaining,
        }))
    }

    // ----- deliveries -----

    /// Takes what partitions pushed to this client. Notices about
    /// subscriptions the client has since replaced or cancelled are
    /// dropped; the rest are appended to `notices`.
    /// Cold deliveries (bodies in the store) start their reads here, in one
    /// batch; [`Self::next_delivery`] holds back one whose read has not
    /// completed, and the connection's task is woken when it has.
    pub fn drain(&mut self, notices: &mut Vec<Notice>) {
        let before = self.pending.len();
        self.handle
            .drain_into(&mut self.pending, &mut self.raw_notices);
        self.prefetch(before);
        if !self.streams.is_empty() {
            self.pump_streams(notices);
        }
        for n in self.raw_notices.drain(..) {
            match n {
                Notice::ConsumerCancelled { consumer } => {
                    // Only if the tag still names this consumer: the client
                    // may have cancelled it and reused the tag since.
                    let current = self.scopes.get_mut(&consumer.scope()).is_some_and(|st| {
                        let same = st
                            .subs
                            .get(consumer.tag())
                            .is_some_and(|s| Arc::ptr_eq(&s.consumer, &consumer));
                        if same {
                            st.subs.remove(consumer.tag());
                        }
                        same
                    });
                    if current {
                        notices.push(Notice::ConsumerCancelled { consumer });
                    }
                }
            }
        }
    }

    /// Polls the reads in flight, then starts one batch of reads for the
    /// cold deliveries from `pending[from..]` on (those just drained).
    fn prefetch(&mut self, from: usize) {
        let mut i = 0;
        while i < self.reads.len() {
            match self.reads[i].poll(&self.read_waker) {
                Some(done) => {
                    self.prefetched.extend(done);
                    self.reads.swap_remove(i);
                }
                None => i += 1,
            }
        }
        let mut cold = Vec::new();
        for d in self.pending.range(from..) {
            if d.entry.message.is_some() {
                continue;
            }
            if let Some(at) = d.partition.leased_location(&d.entry) {
                match crate::readback::read_spilled(&*self.store, at) {
                    Some(m) => {
                        self.prefetched.insert((d.partition.id, d.entry.id), m);
                    }
                    None => cold.push((d.partition.id, d.entry.id, at)),
                }
            }
        }
        if cold.is_empty() {
            return;
        }
        let mut reads = crate::readback::Reads::start(&*self.store, cold);
        match reads.poll(&self.read_waker) {
            // Answered at once (the embedded log): nothing waits.
            Some(done) => self.prefetched.extend(done),
            None => self.reads.push(reads),
        }
    }

    /// The next drained delivery. Hand each back with exactly one of
    /// [`Self::lease`] (written), [`Self::unsend`] (cannot be written),
    /// [`Self::discard`] (unreadable) or [`Self::defer`] (not now), then
    /// call [`Self::finish_deliveries`] once for the batch. `None` also
    /// while the next one's message is still being read from the store
    /// (the connection's task is woken when it is).
    pub fn next_delivery(&mut self) -> Option<Delivery> {
        if !self.reads.is_empty() {
            let front = self.pending.front()?;
            let key = (front.partition.id, front.entry.id);
            if front.entry.message.is_none()
                && !self.prefetched.contains_key(&key)
                && self.reads.iter().any(|r| r.covers(key))
            {
                return None;
            }
        }
        let d = self.pending.pop_front()?;
        self.taken += 1;
        Some(d)
    }

    /// Puts a delivery back at the front, for a later batch (the write
    /// buffer is full).
    pub fn defer(&mut self, d: Delivery) {
        self.taken -= 1;
        self.pending.push_front(d);
    }

    /// Deliveries waiting to be handed out.
    pub fn pending_deliveries(&self) -> usize {
        self.pending.len()
    }

    /// The delivery cannot be written (its scope or consumer is gone): it
    /// goes back to its queue, not marked redelivered, at the batch's end.
    pub fn unsend(&mut self, d: Delivery) {
        self.prefetched.remove(&(d.partition.id, d.entry.id));
        d.consumer.release(d.entry.size);
        if d.partition.stream.is_some() {
            // A stream's events stay where they are: nothing goes back.
            return;
        }
        self.unsend.push((d.partition, d.entry));
    }

    /// The message of a delivery: in memory, read ahead by
    /// [`Self::drain`], or (when that read failed) read back from the store
    /// now, retrying while compaction moves its record. None if unreadable:
    /// then [`Self::discard`] it.
    pub fn message_of(&mut self, d: &Delivery) -> Option<Arc<Message>> {
        let m = match &d.entry.message {
            Some(m) => m.clone(),
            None => match self.prefetched.remove(&(d.partition.id, d.entry.id)) {
                Some(m) => m,
                None => crate::readback::read_blocking(&*self.store, &d.partition, &d.entry)?,
            },
        };
        Some(self.with_delivery_count(&d.partition, &d.entry, m))
    }

    /// On a queue that counts deliveries (a delivery limit, or a quorum
    /// queue), a message returned before carries `x-delivery-count`: how
    /// many times it was delivered and came back (RabbitMQ 4's header).
    /// Rewritten through the message's own codec, so every protocol shows
    /// it its way; only returned messages pay for it.
    pub(super) fn with_delivery_count(
        &self,
        p: &Partition,
        e: &Entry,
        m: Arc<Message>,
    ) -> Arc<Message> {
        if e.attempts <= 1 || !p.counts_deliveries() {
            return m;
        }
        let codecs = &self.codecs;
        let rewritten = codecs
            .decode(m.header_format, &m.properties)
            .and_then(|mut props| {
                let headers = props.headers.get_or_insert_with(Default::default);
                let count = Value::I64(i64::from(e.attempts) - 1);
                match headers.0.iter_mut().find(|(k, _)| k == "x-delivery-count") {
                    Some((_, v)) => *v = count,
                    None => headers.push("x-delivery-count", count),
                }
                let mut raw = Vec::with_capacity(m.properties.len() + 24);
                codecs.get(m.header_format)?.encode(&props, &mut raw)?;
                Ok(raw)
            });
        match rewritten {
            Ok(raw) => Arc::new(Message {
                id: m.id,
                exchange: m.exchange.clone(),
                routing_key: m.routing_key.clone(),
                properties: Bytes::from(raw),
                body: m.body.clone(),
                header_format: m.header_format,
                persistent: m.persistent,
                priority: m.priority,
                ttl_ms: m.ttl_ms,
            }),
            Err(err) => {
                tracing::debug!(error = %err, "x-delivery-count not added: headers undecodable");
                m
            }
        }
    }

    /// Drops a delivery whose message is unreadable, freeing its record,
    /// rather than looping on it forever.
    pub fn discard(&mut self, d: Delivery) {
        self.prefetched.remove(&(d.partition.id, d.entry.id));
        d.consumer.release(d.entry.size);
        if d.partition.stream.is_some() {
            return;
        }
        if let Some(l) = d.partition.settled(&d.entry, false) {
            self.push_settle(d.partition.id, d.entry.id, l);
        }
    }

    /// The delivery was written under `tag` in `scope` at `now` (`now_ms`
    /// the same moment in ms since the epoch, as `enqueued_ms`: the wait in
    /// the queue is counted for the queue's latency figure): it is leased
    /// until settled, or settled now for an auto-ack consumer. Tags must
    /// increase within a scope. The session reads the clock once per batch
    /// and passes it to every delivery of the batch.
    pub fn lease(&mut self, scope: Scope, tag: u64, d: Delivery, now: Instant, now_ms: u64) {
        debug_assert_eq!(scope, d.consumer.scope(), "leased in its consumer's scope");
        d.partition
            .waited(now_ms.saturating_sub(d.entry.enqueued_ms));
        if d.consumer.no_ack() {
            d.consumer.release(d.entry.size);
            if let Some(l) = d.partition.settled(&d.entry, true) {
                self.push_settle(d.partition.id, d.entry.id, l);
            }
            self.push_dispatch(d.partition);
            return;
        }
        let mut entry = d.entry;
        if entry.location.is_some() {
            // Written: a stored message's lease needs only its location (a
            // requeue reads the body back), so a client holding many
            // unacked messages does not hold their bodies.
            entry.message = None;
        }
        self.scope_mut(scope).leases.insert(
            tag,
            Lease {
                partition: d.partition,
                consumer: Some(d.consumer),
                entry,
                since: now,
            },
        );
    }

    /// Ends a batch of deliveries: gives their room on the way to this
    /// client back, redispatches the client's queues if one was refused for
    /// lack of that room, and returns unsent deliveries to their queues.
    pub fn finish_deliveries(&mut self) {
        // Only when room was freed: a refused queue left `starved` set (and
        // woke us once); redispatching without room would be refused again
        // and wake us again, a spin for as long as deliveries are held.
        if self.taken > 0 {
            self.handle.unsent_done(self.taken);
            self.taken = 0;
            if self.handle.take_starved() {
                self.redispatch(None);
            }
        }
        let mut unsend = std::mem::take(&mut self.unsend);
        for (p, e) in unsend.drain(..) {
            let refused = p.unsend(std::iter::once(e));
            self.settle_refused(&p, refused);
        }
        self.unsend = unsend;
    }
}
