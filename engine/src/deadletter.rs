//! Dead-lettering: messages a queue gives up on (rejected without requeue,
//! expired, pushed out by a length limit, returned more often than its
//! delivery limit) are republished to the queue's dead-letter exchange with
//! RabbitMQ's `x-death` history, or dropped without one.
//!
//! It runs on the engine's timer task ([`crate::Engine::run_timers`]), one
//! batch per partition: the partition hands over its dead list (entries
//! whose records stay live until now), and this module reads what is not
//! in memory, rewrites the headers through the message's own
//! [`HeaderCodec`](crate::properties::HeaderCodec), routes, and appends one
//! store batch for the whole list: a persistent message that moves between
//! durable queues is one [`Op::Move`] record (publish to the targets and
//! settle in the source at once, so a crash never leaves it in both queues
//! or in neither); the rest are settles. Only then are the new entries
//! enqueued, so a target's consumers never see a message the store lacks.
//!
//! A message that would come back to a queue it already died in, with no
//! rejection anywhere in that cycle, is dropped for that queue and counted
//! (RabbitMQ's cycle rule), so automatic dead-lettering never loops.

use crate::message::{Entry, Message};
use crate::properties::{LazyLookup, Table, Value};
use crate::queue::{Enqueued, Partition, Queue};
use crate::tenant::RouteInput;
use crate::Engine;
use bytes::Bytes;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use weir_backend::{Location, MessageAttrs, MessageData, MessageId, Op, PartitionId};

/// Why a message was dead-lettered (RabbitMQ's `x-death` reasons).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeadReason {
    /// Rejected or nacked without requeue.
    Rejected,
    /// Its TTL (the queue's or its own) passed.
    Expired,
    /// Pushed out (or refused) by a length limit.
    Maxlen,
    /// Returned more often than the queue's delivery limit.
    DeliveryLimit,
}

impl DeadReason {
    /// The `reason` string in `x-death`.
    pub fn as_str(self) -> &'static str {
        match self {
            DeadReason::Rejected => "rejected",
            DeadReason::Expired => "expired",
            DeadReason::Maxlen => "maxlen",
            DeadReason::DeliveryLimit => "delivery_limit",
        }
    }
}

/// Engine-wide dead-letter counters.
#[derive(Default, Debug)]
pub struct DeadLetterStats {
    /// Messages republished to a dead-letter exchange (once per message,
    /// however many queues it reached).
    pub republished: AtomicU64,
    /// Messages given up without reaching a queue: no dead-letter
    /// exchange, no route, or a cycle without a rejection.
    pub dropped: AtomicU64,
    /// Of `dropped`, those dropped by the cycle rule.
    pub cycles: AtomicU64,
}

/// One message on its way out of `from`.
struct Outgoing {
    entry: Entry,
    reason: DeadReason,
    /// Where its record is now (durable source).
    location: Option<Location>,
    /// The republished message and the partitions it goes to.
    republish: Option<(Arc<Message>, Vec<Arc<Partition>>)>,
}

/// Dead-letters `dead` (entries taken out of partition `from`): appends
/// one store batch, then enqueues the republished copies. A target that
/// pushes entries out by its own limits puts them on its own dead list,
/// handled on its own turn of the timer task: dead-lettering never recurses.
pub(crate) fn process(engine: &Engine, from: &Arc<Partition>, dead: Vec<(Entry, DeadReason)>) {
    if dead.is_empty() {
        return;
    }
    let queue = from.queue();
    let tenant = queue.as_ref().and_then(|q| engine.tenant(&q.tenant));
    let args = queue.as_ref().map(|q| q.args());
    let dlx = args.as_ref().and_then(|a| a.dead_letter_exchange.clone());
    let now = engine.clock().now_ms();
    let mut out: Vec<Outgoing> = Vec::with_capacity(dead.len());
    for (entry, reason) in dead {
        let location = from.dead_location(&entry);
        debug_assert!(entry.location.is_none() || location.is_some());
        let mut o = Outgoing {
            entry,
            reason,
            location,
            republish: None,
        };
        if let (Some(dlx), Some(tenant), Some(queue)) = (&dlx, &tenant, &queue) {
            o.republish = republish(engine, from, queue, tenant, dlx, &o, now);
        }
        out.push(o);
    }
    // One batch: moves, plain publishes (a persistent message leaving a
    // transient queue for a durable one) and settles.
    let mut publish_parts: Vec<Vec<PartitionId>> = Vec::with_capacity(out.len());
    for o in &out {
        let parts = match &o.republish {
            Some((m, targets)) if m.persistent => {
                targets.iter().filter(|p| p.durable).map(|p| p.id).collect()
            }
            _ => Vec::new(),
        };
        publish_parts.push(parts);
    }
    let mut ops: Vec<Op<'_>> = Vec::with_capacity(out.len() * 2);
    // For each outgoing, the index in `ops` of the op whose location its
    // durable copies get.
    let mut stored_at: Vec<Option<usize>> = Vec::with_capacity(out.len());
    let mut n_located = 0usize;
    for (o, parts) in out.iter().zip(&publish_parts) {
        let mut at = None;
        match (&o.republish, parts.is_empty(), o.location) {
            (Some((m, _)), false, from_location) => {
                let data = MessageData {
                    exchange: std::str::from_utf8(&m.exchange).unwrap_or(""),
                    routing_key: std::str::from_utf8(&m.routing_key).unwrap_or(""),
                    header_format: m.header_format.to_u8(),
                    header: &m.properties,
                    body: &m.body,
                    attrs: MessageAttrs {
                        priority: m.priority,
                        // Its own TTL counts again from here; stored, so it
                        // holds across a restart.
                        expires_at_ms: m.ttl_ms.map_or(0, |t| now.saturating_add(t)),
                        deliver_at_ms: 0,
                    },
                };
                // Out of a durable queue into durable ones: one record, so
                // a crash never leaves it in both or in neither.
                ops.push(match from_location {
                    Some(l) => Op::Move {
                        id: m.id,
                        partitions: parts,
                        data,
                        from: from.id,
                        from_id: o.entry.id,
                        from_location: l,
                    },
                    None => Op::Publish {
                        id: m.id,
                        partitions: parts,
                        data,
                    },
                });
                at = Some(n_located);
                n_located += 1;
            }
            (_, _, Some(l)) => ops.push(Op::Settle {
                partition: from.id,
                id: o.entry.id,
                location: l,
            }),
            (_, _, None) => {}
        }
        stored_at.push(at);
    }
    let mut locations = Vec::with_capacity(n_located);
    // A paged source is released through the spill (a move from it becomes
    // a publish, so the ops that get a location keep their order and
    // `stored_at` still holds).
    crate::spill::release_spilled(&**engine.store(), &mut ops);
    if !ops.is_empty() {
        if let Err(e) = engine.store().append(&ops, &mut locations) {
            // Nothing of the batch was applied: the messages stay where they
            // were in the store and come back (redelivered) after a restart.
            tracing::error!(error = %e, partition = from.id.0, "dead-lettering failed to reach the store");
            return;
        }
    }
    drop(ops);
    from.forget_dead(out.iter().map(|o| o.entry.id));
    let stats = &engine.dead_letters;
    let mut refused = Vec::new();
    for (o, at) in out.into_iter().zip(stored_at) {
        let Some((m, targets)) = o.republish else {
            stats.dropped.fetch_add(1, Ordering::Relaxed);
            continue;
        };
        stats.republished.fetch_add(1, Ordering::Relaxed);
        let location = at.and_then(|i| locations.get(i).copied());
        for p in targets {
            let stored = m.persistent && p.durable;
            let e = Entry {
                seq: 0,
                id: m.id,
                location: if stored { location } else { None },
                size: m.size(),
                redelivered: false,
                attempts: 0,
                priority: m.priority,
                enqueued_ms: now,
                expires_at_ms: m.ttl_ms.map_or(0, |t| now.saturating_add(t)),
                message: Some(m.clone()),
            };
            // Deleted meanwhile, or full with reject-publish: the copy is
            // settled (with reject-publish-dlx the target dead-letters it
            // through its own list).
            let gone = match p.enqueue(e) {
                Enqueued::Queued
                | Enqueued::Overflow {
                    dead_lettered: true,
                    ..
                } => None,
                Enqueued::Deleted(e) | Enqueued::Overflow { entry: e, .. } => e.location,
            };
            if let Some(l) = gone {
                refused.push(Op::Settle {
                    partition: p.id,
                    id: m.id,
                    location: l,
                });
            }
        }
    }
    crate::spill::release_spilled(&**engine.store(), &mut refused);
    if !refused.is_empty() {
        let mut sink = Vec::new();
        if let Err(e) = engine.store().append(&refused, &mut sink) {
            tracing::error!(error = %e, "cannot settle dead-lettered copies refused by their queue");
        }
    }
}

/// Builds the dead-lettered copy of `o` and finds its target partitions;
/// None when it goes nowhere (no route, or a cycle).
fn republish(
    engine: &Engine,
    from: &Partition,
    queue: &Queue,
    tenant: &crate::Tenant,
    dlx: &str,
    o: &Outgoing,
    now: u64,
) -> Option<(Arc<Message>, Vec<Arc<Partition>>)> {
    let original = match &o.entry.message {
        Some(m) => m.clone(),
        None => read_back(engine, from, &o.entry)?,
    };
    let codecs = engine.codecs();
    let mut props = match codecs.decode(original.header_format, &original.properties) {
        Ok(p) => p,
        Err(e) => {
            tracing::warn!(error = %e, "dead-lettering a message whose headers cannot be decoded: dropped");
            return None;
        }
    };
    let args = queue.args();
    let routing_key = args
        .dead_letter_routing_key
        .clone()
        .unwrap_or_else(|| String::from_utf8_lossy(&original.routing_key).into_owned());
    let mut headers = props.headers.take().unwrap_or_default();
    // x-death lists the routing key and the CC keys (BCC never reached the
    // store). With a dead-letter routing key the CC header goes: the copy
    // is routed by that key alone, as RabbitMQ does.
    let mut death_keys = vec![String::from_utf8_lossy(&original.routing_key).into_owned()];
    if let Some(cc) = headers.get("CC") {
        let cc = cc.to_json();
        death_keys.extend(crate::exchange::header_routing_keys(&cc).map(str::to_owned));
    }
    if args.dead_letter_routing_key.is_some() {
        headers.0.retain(|(k, _)| k != "CC");
    }
    // The copy loses its `expiration` whatever the reason (RabbitMQ's rule:
    // it would otherwise expire again in the dead-letter queue); x-death
    // keeps it as original-expiration.
    let original_expiration = props.ttl_ms.take();
    record_death(
        &mut headers,
        queue.name(),
        o.reason,
        &String::from_utf8_lossy(&original.exchange),
        &death_keys,
        original_expiration,
        now,
    );
    let deaths = death_history(&headers);
    props.headers = Some(headers);
    let mut raw = Vec::with_capacity(original.properties.len() + 128);
    if let Err(e) = codecs
        .get(original.header_format)
        .and_then(|c| c.encode(&props, &mut raw))
    {
        tracing::warn!(error = %e, "cannot encode a dead-lettered message's headers: dropped");
        return None;
    }
    let lookup = LazyLookup::new(original.header_format, &raw, &codecs);
    let mut queues = Vec::new();
    let route = RouteInput {
        exchange: dlx,
        routing_key: &routing_key,
        headers: &lookup,
    };
    if let Err(e) = tenant.route(&route, &mut queues) {
        tracing::debug!(error = %e, dlx, "dead-letter exchange refused the message");
        return None;
    }
    let before = queues.len();
    queues.retain(|q| !is_cycle(q.name(), &deaths));
    if queues.len() < before {
        engine.dead_letters.cycles.fetch_add(1, Ordering::Relaxed);
    }
    if queues.is_empty() {
        return None;
    }
    let targets = queues
        .iter()
        .map(|q| q.partition_for_publish(&lookup).clone())
        .collect();
    drop(lookup);
    let id: MessageId = engine.store().allocate_ids(1);
    let message = Arc::new(Message {
        id,
        exchange: Bytes::copy_from_slice(dlx.as_bytes()),
        routing_key: Bytes::from(routing_key.into_bytes()),
        properties: Bytes::from(raw),
        body: original.body.clone(),
        header_format: original.header_format,
        persistent: original.persistent,
        priority: original.priority,
        ttl_ms: None,
    });
    Some((message, targets))
}

/// Reads a message whose body is not in memory, following compaction.
fn read_back(engine: &Engine, p: &Partition, e: &Entry) -> Option<Arc<Message>> {
    crate::readback::read_located(&**engine.store(), p.id, e.id, || p.dead_location(e))
}

/// Adds this death to `x-death` (RabbitMQ's format: newest first; a
/// repeated queue + reason increments its `count` and moves to the front)
/// and sets `x-first-death-*` (once) and `x-last-death-*`.
pub fn record_death(
    headers: &mut Table,
    queue: &str,
    reason: DeadReason,
    exchange: &str,
    routing_keys: &[String],
    original_expiration: Option<u64>,
    now_ms: u64,
) {
    let mut deaths: Vec<Value> = match take(headers, "x-death") {
        Some(Value::Array(a)) => a,
        _ => Vec::new(),
    };
    let same = deaths.iter().position(|d| match d {
        Value::Table(t) => {
            str_of(t.get("queue")) == Some(queue)
                && str_of(t.get("reason")) == Some(reason.as_str())
        }
        _ => false,
    });
    let entry = match same.map(|i| deaths.remove(i)) {
        Some(Value::Table(mut t)) => {
            let count = match t.get("count") {
                Some(Value::I64(n)) => *n,
                Some(Value::I32(n)) => i64::from(*n),
                Some(Value::U32(n)) => i64::from(*n),
                _ => 0,
            };
            set(&mut t, "count", Value::I64(count + 1));
            set(&mut t, "time", Value::Timestamp(now_ms / 1000));
            t
        }
        _ => {
            let mut t = Table::new();
            t.push("count", Value::I64(1));
            t.push("reason", Value::String(reason.as_str().into()));
            t.push("queue", Value::String(queue.into()));
            t.push("time", Value::Timestamp(now_ms / 1000));
            t.push("exchange", Value::String(exchange.into()));
            t.push(
                "routing-keys",
                Value::Array(
                    routing_keys
                        .iter()
                        .map(|k| Value::String(k.clone()))
                        .collect(),
                ),
            );
            if let Some(ms) = original_expiration {
                t.push("original-expiration", Value::String(ms.to_string()));
            }
            t
        }
    };
    deaths.insert(0, Value::Table(entry));
    set(headers, "x-death", Value::Array(deaths));
    if headers.get("x-first-death-reason").is_none() {
        set(
            headers,
            "x-first-death-exchange",
            Value::String(exchange.into()),
        );
        set(headers, "x-first-death-queue", Value::String(queue.into()));
        set(
            headers,
            "x-first-death-reason",
            Value::String(reason.as_str().into()),
        );
    }
    set(
        headers,
        "x-last-death-exchange",
        Value::String(exchange.into()),
    );
    set(headers, "x-last-death-queue", Value::String(queue.into()));
    set(
        headers,
        "x-last-death-reason",
        Value::String(reason.as_str().into()),
    );
}

/// (queue, reason) of each `x-death` entry, newest first.
fn death_history(headers: &Table) -> Vec<(String, String)> {
    match headers.get("x-death") {
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(|d| match d {
                Value::Table(t) => Some((
                    str_of(t.get("queue"))?.to_string(),
                    str_of(t.get("reason"))?.to_string(),
                )),
                _ => None,
            })
            .collect(),
        _ => Vec::new(),
    }
}

/// The queue a dead letter came from, as its headers record it:
/// `x-first-death-queue`, else the newest `x-death` entry's `queue`; None
/// for a message that was never dead-lettered (what the management API's
/// requeue of dead letters moves it back to).
pub fn death_source(headers: &Table) -> Option<String> {
    if let Some(q) = str_of(headers.get("x-first-death-queue")) {
        return Some(q.to_string());
    }
    match headers.get("x-death") {
        Some(Value::Array(a)) => match a.first() {
            Some(Value::Table(t)) => str_of(t.get("queue")).map(str::to_string),
            _ => None,
        },
        _ => None,
    }
}

/// RabbitMQ's cycle rule: going back to `queue`, where it died before, is
/// a cycle unless a rejection happened on the way (newest deaths up to and
/// including the one in `queue`).
fn is_cycle(queue: &str, deaths: &[(String, String)]) -> bool {
    let Some(i) = deaths.iter().position(|(q, _)| q == queue) else {
        return false;
    };
    deaths[..=i]
        .iter()
        .all(|(_, r)| r != DeadReason::Rejected.as_str())
}

fn str_of(v: Option<&Value>) -> Option<&str> {
    match v {
        Some(Value::String(s)) => Some(s),
        Some(Value::Bytes(b)) => std::str::from_utf8(b).ok(),
        _ => None,
    }
}

fn take(t: &mut Table, name: &str) -> Option<Value> {
    let i = t.0.iter().position(|(k, _)| k == name)?;
    Some(t.0.remove(i).1)
}

fn set(t: &mut Table, name: &str, v: Value) {
    match t.0.iter_mut().find(|(k, _)| k == name) {
        Some((_, slot)) => *slot = v,
        None => t.push(name, v),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn x_death_counts_repeats_and_keeps_the_first_death() {
        let mut h = Table::new();
        let keys = ["k".to_string()];
        record_death(&mut h, "q1", DeadReason::Rejected, "x", &keys, None, 5_000);
        record_death(
            &mut h,
            "q2",
            DeadReason::Expired,
            "dlx",
            &keys,
            Some(100),
            6_000,
        );
        record_death(&mut h, "q1", DeadReason::Rejected, "x", &keys, None, 7_000);
        let deaths = death_history(&h);
        assert_eq!(
            deaths,
            vec![
                ("q1".to_string(), "rejected".to_string()),
                ("q2".to_string(), "expired".to_string())
            ]
        );
        let Some(Value::Array(a)) = h.get("x-death") else {
            panic!("x-death missing")
        };
        let Value::Table(first) = &a[0] else { panic!() };
        assert_eq!(first.get("count"), Some(&Value::I64(2)));
        assert_eq!(
            str_of(h.get("x-first-death-queue")),
            Some("q1"),
            "first death kept"
        );
        assert_eq!(str_of(h.get("x-last-death-reason")), Some("rejected"));
        assert_eq!(death_source(&h).as_deref(), Some("q1"));
        let mut only_deaths = h.clone();
        take(&mut only_deaths, "x-first-death-queue");
        assert_eq!(death_source(&only_deaths).as_deref(), Some("q1"));
        assert_eq!(death_source(&Table::new()), None);
    }

    #[test]
    fn a_cycle_without_a_rejection_is_dropped() {
        let d = |v: &[(&str, &str)]| -> Vec<(String, String)> {
            v.iter()
                .map(|(q, r)| (q.to_string(), r.to_string()))
                .collect()
        };
        // q1 expired into q2, q2 expired back into q1: cycle.
        assert!(is_cycle("q1", &d(&[("q2", "expired"), ("q1", "expired")])));
        // A rejection on the way: allowed.
        assert!(!is_cycle(
            "q1",
            &d(&[("q2", "rejected"), ("q1", "expired")])
        ));
        // Never died in q3.
        assert!(!is_cycle("q3", &d(&[("q2", "expired")])));
    }
}
