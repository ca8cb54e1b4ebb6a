//! A client's stream consumers: where they start, pumping their cursors
//! into deliveries, and the truncations retention asks for.

use super::*;
use crate::stream::reader::Pumped;
use crate::stream::{OffsetSpec, Truncation};

impl Client {
    /// Checks a stream consume as RabbitMQ does (manual acks, a prefetch
    /// count) and finds each partition's start; retention is applied first,
    /// so a start it dropped is refused, never skipped.
    pub(super) fn stream_starts(
        &mut self,
        q: &Arc<Queue>,
        opts: &SubscribeOptions,
        offset: Option<OffsetSpec>,
    ) -> Result<Vec<crate::stream::reader::Start>, ClientError> {
        let rs = format!("queue '{}' in vhost '{}'", q.name(), self.tenant.name);
        if opts.no_ack {
            return Err(EngineError::NotImplemented(format!(
                "automatic acknowledgement not supported by stream queues {rs}"
            ))
            .into());
        }
        if opts.prefetch_count == 0 {
            return Err(EngineError::PreconditionFailed(format!(
                "consumer prefetch count is not set for '{rs}'"
            ))
            .into());
        }
        let now = self.tenant.clock().now_ms();
        let spec = offset.unwrap_or(OffsetSpec::Next);
        let mut starts = Vec::with_capacity(q.partitions.len());
        for p in &q.partitions {
            let Some(log) = p.stream.as_deref() else {
                continue;
            };
            if let Some(t) = log.enforce(now) {
                self.truncate_stream(p.id, t);
            }
            let start = log.start(spec, now).map_err(|r| {
                EngineError::PreconditionFailed(format!("{r} (stream {rs}, partition {})", p.id.0))
            })?;
            starts.push((p.clone(), start));
        }
        Ok(starts)
    }

    /// Appends what retention dropped from stream partition `p`: its new
    /// first offset in the state store, then the truncation, in one batch
    /// (a crash keeps the state, or both).
    pub(super) fn truncate_stream(&mut self, p: PartitionId, t: Truncation) {
        let key = crate::stream::state_key(p);
        let value = t.state_value();
        let ops = [
            Op::PutState {
                key: &key,
                value: &value,
            },
            Op::Truncate {
                partition: p,
                before: t.before,
            },
        ];
        self.locs.clear();
        match self.store.append(&ops, &mut self.locs) {
            Ok(ticket) => self.unconfirmed.note_ops(&ops, ticket),
            Err(e) => tracing::warn!(partition = p.0, error = %e, "stream truncation not stored"),
        }
    }

    /// Turns stream cursors into deliveries while their consumers have
    /// credit. A consumer overtaken by retention is cancelled (its client
    /// is told, and its next consume gets the refusal): never moved on
    /// silently.
    pub(super) fn pump_streams(&mut self, notices: &mut Vec<Notice>) {
        self.streams.retain(|s| !s.consumer.is_dead());
        let mut lost = Vec::new();
        for (i, s) in self.streams.iter_mut().enumerate() {
            if let Pumped::Lost(r) = s.pump(
                &*self.store,
                &self.codecs,
                &self.read_waker,
                &mut self.pending,
            ) {
                lost.push((i, r));
            }
        }
        for (i, r) in lost.into_iter().rev() {
            let s = self.streams.swap_remove(i);
            let c = s.consumer;
            tracing::warn!(consumer = %String::from_utf8_lossy(c.tag()), refusal = %r, "stream consumer overtaken by retention: cancelled");
            let tag = c.tag().clone();
            self.unsubscribe(c.scope(), &tag);
            notices.push(Notice::ConsumerCancelled { consumer: c });
        }
    }
}
