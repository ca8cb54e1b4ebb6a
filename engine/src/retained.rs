//! Retained messages (MQTT): per tenant, the last retained message of each
//! topic.
//!
//! * **Set** by a retained publish ([`Tenant::retain`]), **replaced** by the
//!   next one to the same topic, **cleared** by one with an empty payload.
//! * **Durable**: each one is an entry of the store's metadata map (key
//!   `r \0 tenant \0 topic`, value [`encode_value`]), appended before the
//!   change is visible and recovered by [`crate::Engine::open`]. The caller
//!   gets the store's [`DurableWait`], so an MQTT session acknowledges a
//!   retained QoS 1/2 publish only once the retained copy is durable too.
//!   The store keeps its metadata map in memory and checkpoints it whole,
//!   so a retained body costs its size twice in memory (here and in the
//!   store's map) and is rewritten with every checkpoint: hence the bounds.
//! * **Bounded** ([`RetainedLimits`]): retained messages per tenant, and
//!   bytes (topic + header + body) over every tenant. A retained publish
//!   that would pass either is refused with [`RetainError::TooManyMessages`]
//!   or [`RetainError::TooManyBytes`] (MQTT 5: 0x97 quota exceeded, see
//!   [`RetainError::is_quota_exceeded`]); replacing a message by one no
//!   larger, and clearing, are always allowed, so a tenant over a lowered
//!   bound can still shrink.
//! * **Expiring** (MQTT 5 message expiry): a retained message with a
//!   deadline is not returned after it ([`Tenant::retained`]); it is removed
//!   from memory and the store by the next retained publish of its tenant
//!   or by [`crate::Engine::sweep_retained`] (the gateway calls it
//!   periodically), and at restart.
//! * **Lookup** by MQTT topic filter ([`topic_matches`], with MQTT's
//!   `$`-topic rule); a filter with a literal first level only scans the
//!   topics under it.
//!
//! The engine never depends on the protocol crates (`engine/tests/layers.rs`),
//! so the MQTT filter match is implemented here, on plain strings.

use crate::error::EngineError;
use crate::properties::{HeaderFormat, MessageHeader};
use crate::{DurableWait, Engine, Tenant};
use bytes::Bytes;
use parking_lot::{Mutex, RwLock};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use weir_backend::Op;

/// Kind byte of a retained message's metadata key.
const KEY_KIND: &[u8] = b"r";

/// Version byte leading [`encode_value`]'s output.
const VALUE_VERSION: u8 = 1;

/// Bounds on retained messages. 0 means no bound.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RetainedLimits {
    /// Retained messages per tenant.
    pub max_messages_per_tenant: usize,
    /// Bytes (topic + header + body) of every tenant's retained messages
    /// together.
    pub max_total_bytes: u64,
}

impl Default for RetainedLimits {
    /// 100,000 per tenant, 64 MiB in total.
    fn default() -> Self {
        RetainedLimits {
            max_messages_per_tenant: 100_000,
            max_total_bytes: 64 << 20,
        }
    }
}

/// One retained message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RetainedMessage {
    /// The MQTT topic it was published to (as published, `/`-separated).
    pub topic: String,
    /// Its header, in the publisher's format (MQTT's, normally).
    pub header: MessageHeader,
    /// The payload (never empty: an empty one clears).
    pub body: Bytes,
    /// When it expires, ms since the Unix epoch (MQTT 5 message expiry,
    /// counted from publish); None if never.
    pub expires_at_ms: Option<u64>,
}

impl RetainedMessage {
    /// Bytes counted against [`RetainedLimits::max_total_bytes`].
    pub fn size(&self) -> u64 {
        (self.topic.len() + self.header.raw.len() + self.body.len()) as u64
    }

    /// Whether it has expired at `now_ms`. Deliverable during the
    /// millisecond of its deadline, as queued messages are.
    pub fn is_expired(&self, now_ms: u64) -> bool {
        self.expires_at_ms.is_some_and(|at| at < now_ms)
    }
}

/// Why a retained publish was refused.
#[derive(Debug, thiserror::Error)]
pub enum RetainError {
    /// The tenant holds [`RetainedLimits::max_messages_per_tenant`] already.
    #[error("retained messages of vhost '{tenant}' are at their limit of {limit}")]
    TooManyMessages {
        /// The tenant.
        tenant: String,
        /// The bound.
        limit: usize,
    },
    /// It would take retained messages over [`RetainedLimits::max_total_bytes`].
    #[error("retained messages would exceed their limit of {limit} bytes")]
    TooManyBytes {
        /// The bound.
        limit: u64,
    },
    /// The store failed (or the broker is shutting down).
    #[error(transparent)]
    Engine(#[from] EngineError),
}

impl RetainError {
    /// A bound refused it (MQTT 5: reason code 0x97 quota exceeded), as
    /// opposed to a store failure.
    pub fn is_quota_exceeded(&self) -> bool {
        matches!(
            self,
            RetainError::TooManyMessages { .. } | RetainError::TooManyBytes { .. }
        )
    }
}

/// The engine-wide side of the bounds: the limits and the bytes every
/// tenant's retained messages take.
#[derive(Debug, Default)]
pub(crate) struct RetainedBudget {
    limits: RwLock<RetainedLimits>,
    bytes: AtomicU64,
}

impl RetainedBudget {
    pub(crate) fn limits(&self) -> RetainedLimits {
        *self.limits.read()
    }

    pub(crate) fn set_limits(&self, limits: RetainedLimits) {
        *self.limits.write() = limits;
    }

    pub(crate) fn bytes(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }

    /// Takes `add` bytes and gives back `sub` in one step, unless the result
    /// passes `limit` while growing.
    fn apply(&self, add: u64, sub: u64, limit: u64) -> Result<(), RetainError> {
        self.bytes
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |cur| {
                let next = cur.saturating_sub(sub).saturating_add(add);
                (limit == 0 || add <= sub || next <= limit).then_some(next)
            })
            .map(|_| ())
            .map_err(|_| RetainError::TooManyBytes { limit })
    }

    /// Takes `add` and gives back `sub` whatever the limit: to undo an
    /// [`Self::apply`] the store refused, and for removals and recovery.
    fn force(&self, add: u64, sub: u64) {
        let _ = self
            .bytes
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |cur| {
                Some(cur.saturating_sub(sub).saturating_add(add))
            });
    }
}

/// A tenant's retained messages.
#[derive(Debug, Default)]
pub(crate) struct Retained {
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    by_topic: BTreeMap<String, Arc<RetainedMessage>>,
    /// (deadline, topic) of the ones that expire, earliest first.
    expiry: BTreeSet<(u64, String)>,
}

impl Inner {
    /// Topics expired at `now_ms`, earliest first.
    fn expired(&self, now_ms: u64) -> Vec<String> {
        self.expiry
            .iter()
            .take_while(|(at, _)| *at < now_ms)
            .map(|(_, t)| t.clone())
            .collect()
    }

    fn insert(&mut self, m: Arc<RetainedMessage>) -> Option<Arc<RetainedMessage>> {
        let old = self.remove(&m.topic);
        if let Some(at) = m.expires_at_ms {
            self.expiry.insert((at, m.topic.clone()));
        }
        self.by_topic.insert(m.topic.clone(), m);
        old
    }

    fn remove(&mut self, topic: &str) -> Option<Arc<RetainedMessage>> {
        let old = self.by_topic.remove(topic)?;
        if let Some(at) = old.expires_at_ms {
            self.expiry.remove(&(at, old.topic.clone()));
        }
        Some(old)
    }
}

/// The metadata key of `topic`'s retained message in `tenant`.
pub fn key(tenant: &str, topic: &str) -> Vec<u8> {
    let mut k = Vec::with_capacity(KEY_KIND.len() + tenant.len() + topic.len() + 2);
    k.extend_from_slice(KEY_KIND);
    k.push(0);
    k.extend_from_slice(tenant.as_bytes());
    k.push(0);
    k.extend_from_slice(topic.as_bytes());
    k
}

/// A retained message as a metadata value: version, header format, a flag
/// byte (bit 0: an expiry follows), the expiry (u64 LE, ms since the epoch),
/// the header's length (u32 LE), the header, then the body.
pub fn encode_value(m: &RetainedMessage) -> Vec<u8> {
    let mut v = Vec::with_capacity(16 + m.header.raw.len() + m.body.len());
    v.push(VALUE_VERSION);
    v.push(m.header.format.to_u8());
    match m.expires_at_ms {
        Some(at) => {
            v.push(1);
            v.extend_from_slice(&at.to_le_bytes());
        }
        None => v.push(0),
    }
    // A header is bounded by the publish that carried it (MQTT: 256 MiB).
    let n = u32::try_from(m.header.raw.len()).unwrap_or(u32::MAX);
    v.extend_from_slice(&n.to_le_bytes());
    v.extend_from_slice(&m.header.raw[..n as usize]);
    v.extend_from_slice(&m.body);
    v
}

/// Why a stored retained message could not be read back.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// The key has no tenant or no topic part, or one is not UTF-8.
    #[error("malformed retained-message key")]
    Key,
    /// The value is truncated, of an unknown version or format, or has
    /// unknown flags.
    #[error("malformed retained-message value: {0}")]
    Value(&'static str),
}

/// A retained message from its metadata entry: None if `key` is not a
/// retained message's; else the tenant and the message, or why it is
/// unreadable.
pub fn decode_entry(
    key: &[u8],
    value: &[u8],
) -> Option<Result<(String, RetainedMessage), DecodeError>> {
    let mut parts = key.splitn(3, |b| *b == 0);
    if parts.next()? != KEY_KIND {
        return None;
    }
    Some(decode_parts(parts.next(), parts.next(), value))
}

fn decode_parts(
    tenant: Option<&[u8]>,
    topic: Option<&[u8]>,
    value: &[u8],
) -> Result<(String, RetainedMessage), DecodeError> {
    let text = |b: Option<&[u8]>| {
        b.and_then(|b| std::str::from_utf8(b).ok())
            .map(str::to_owned)
            .ok_or(DecodeError::Key)
    };
    let tenant = text(tenant)?;
    let topic = text(topic)?;
    let (&version, rest) = value.split_first().ok_or(DecodeError::Value("empty"))?;
    if version != VALUE_VERSION {
        return Err(DecodeError::Value("unknown version"));
    }
    let (&format, rest) = rest.split_first().ok_or(DecodeError::Value("truncated"))?;
    let format = HeaderFormat::from_u8(format).map_err(|_| DecodeError::Value("unknown format"))?;
    let (&flags, mut rest) = rest.split_first().ok_or(DecodeError::Value("truncated"))?;
    let expires_at_ms = match flags {
        0 => None,
        1 => {
            let (at, r) = rest
                .split_first_chunk::<8>()
                .ok_or(DecodeError::Value("truncated"))?;
            rest = r;
            Some(u64::from_le_bytes(*at))
        }
        _ => return Err(DecodeError::Value("unknown flags")),
    };
    let (n, rest) = rest
        .split_first_chunk::<4>()
        .ok_or(DecodeError::Value("truncated"))?;
    let n = u32::from_le_bytes(*n) as usize;
    if rest.len() < n {
        return Err(DecodeError::Value("truncated"));
    }
    let (header, body) = rest.split_at(n);
    Ok((
        tenant,
        RetainedMessage {
            topic,
            header: MessageHeader::new(format, Bytes::copy_from_slice(header)),
            body: Bytes::copy_from_slice(body),
            expires_at_ms,
        },
    ))
}

/// Whether MQTT topic filter `filter` matches topic name `topic`: `+`
/// matches one level (an empty one too), `#` (last) the parent level and
/// everything under it; a filter starting with a wildcard does not match a
/// topic starting with `$` (MQTT-4.7.2-1). Both are assumed valid (the
/// adapter checks them); a shared subscription's `$share/group/` prefix is
/// the caller's to strip.
pub fn topic_matches(filter: &str, topic: &str) -> bool {
    if topic.starts_with('$') && (filter.starts_with('+') || filter.starts_with('#')) {
        return false;
    }
    let mut f = filter.split('/');
    let mut t = topic.split('/');
    loop {
        match (f.next(), t.next()) {
            (Some("#"), _) => return true,
            (Some("+"), Some(_)) => {}
            (Some(fl), Some(tl)) if fl == tl => {}
            (None, None) => return true,
            _ => return false,
        }
    }
}

/// The levels of `filter` before its first wildcard, each followed by `/`,
/// and whether that wildcard is a `#` (None: no wildcard at all).
fn literal_prefix(filter: &str) -> Option<(String, bool)> {
    let mut prefix = String::new();
    for level in filter.split('/') {
        match level {
            "+" => return Some((prefix, false)),
            "#" => return Some((prefix, true)),
            l => {
                prefix.push_str(l);
                prefix.push('/');
            }
        }
    }
    None
}

impl Retained {
    /// Sets (non-empty `body`) or clears (empty) `topic`'s retained message.
    #[allow(clippy::too_many_arguments)]
    fn set(
        &self,
        engine: &Engine,
        tenant: &str,
        topic: &str,
        header: MessageHeader,
        body: Bytes,
        expires_at_ms: Option<u64>,
        now_ms: u64,
    ) -> Result<Option<DurableWait>, RetainError> {
        let budget = &engine.retained;
        let limits = budget.limits();
        let mut inner = self.inner.lock();
        // Expired ones go in the same store append.
        let expired = inner.expired(now_ms);
        let mut freed: u64 = expired
            .iter()
            .filter_map(|t| inner.by_topic.get(t))
            .map(|m| m.size())
            .sum();
        let mut keys: Vec<Vec<u8>> = expired.iter().map(|t| key(tenant, t)).collect();
        let old = inner
            .by_topic
            .get(topic)
            .filter(|m| !m.is_expired(now_ms))
            .cloned();
        let clear = body.is_empty() || expires_at_ms.is_some_and(|at| at < now_ms);
        let new = (!clear).then(|| RetainedMessage {
            topic: topic.to_owned(),
            header,
            body,
            expires_at_ms,
        });
        if clear && old.is_none() && keys.is_empty() {
            return Ok(None);
        }
        if let Some(o) = &old {
            freed += o.size();
            if clear {
                keys.push(key(tenant, topic));
            }
        }
        let added = new.as_ref().map_or(0, RetainedMessage::size);
        if new.is_some() && old.is_none() && limits.max_messages_per_tenant != 0 {
            let live = inner.by_topic.len() - expired.len();
            if live >= limits.max_messages_per_tenant {
                return Err(RetainError::TooManyMessages {
                    tenant: tenant.to_owned(),
                    limit: limits.max_messages_per_tenant,
                });
            }
        }
        budget.apply(added, freed, limits.max_total_bytes)?;
        let put = new.as_ref().map(|m| (key(tenant, topic), encode_value(m)));
        let mut ops: Vec<Op<'_>> = keys.iter().map(|k| Op::DeleteMeta { key: k }).collect();
        if let Some((k, v)) = &put {
            ops.push(Op::PutMeta { key: k, value: v });
        }
        let wait = match engine.persist(&ops) {
            Ok(w) => w,
            Err(e) => {
                budget.force(freed, added);
                return Err(e.into());
            }
        };
        for t in &expired {
            inner.remove(t);
        }
        match new {
            Some(m) => {
                inner.insert(Arc::new(m));
            }
            None => {
                inner.remove(topic);
            }
        }
        // A clear that found nothing but expired neighbours has nothing to wait for.
        Ok((old.is_some() || put.is_some()).then_some(wait))
    }

    /// The unexpired retained messages matching `filter`, by topic.
    fn matching(&self, filter: &str, now_ms: u64) -> Vec<Arc<RetainedMessage>> {
        let inner = self.inner.lock();
        let live = |m: &&Arc<RetainedMessage>| !m.is_expired(now_ms);
        let Some((prefix, hash)) = literal_prefix(filter) else {
            return inner
                .by_topic
                .get(filter)
                .filter(live)
                .cloned()
                .into_iter()
                .collect();
        };
        let mut out = Vec::new();
        // `a/#` matches `a` itself, which sorts before the range of `a/`.
        if hash && !prefix.is_empty() {
            let parent = &prefix[..prefix.len() - 1];
            out.extend(inner.by_topic.get(parent).filter(live).cloned());
        }
        out.extend(
            inner
                .by_topic
                .range::<str, _>((
                    std::ops::Bound::Included(prefix.as_str()),
                    std::ops::Bound::Unbounded,
                ))
                .take_while(|(t, _)| t.starts_with(&prefix))
                .filter(|(t, _)| topic_matches(filter, t))
                .map(|(_, m)| m)
                .filter(live)
                .cloned(),
        );
        out
    }

    /// Removes the messages expired at `now_ms` (from the store too,
    /// without waiting); returns how many.
    fn sweep(&self, engine: &Engine, tenant: &str, now_ms: u64) -> usize {
        let mut inner = self.inner.lock();
        let expired = inner.expired(now_ms);
        if expired.is_empty() {
            return 0;
        }
        let keys: Vec<Vec<u8>> = expired.iter().map(|t| key(tenant, t)).collect();
        let ops: Vec<Op<'_>> = keys.iter().map(|k| Op::DeleteMeta { key: k }).collect();
        if let Err(e) = engine.persist(&ops) {
            tracing::warn!(tenant, error = %e, "removing expired retained messages failed");
            return 0;
        }
        let mut freed = 0;
        for t in &expired {
            if let Some(m) = inner.remove(t) {
                freed += m.size();
            }
        }
        engine.retained.force(0, freed);
        expired.len()
    }

    /// Puts back a message recovered from the store (no bounds: they held
    /// when it was set).
    pub(crate) fn restore(&self, engine: &Engine, m: RetainedMessage) {
        let mut inner = self.inner.lock();
        let added = m.size();
        let freed = inner.insert(Arc::new(m)).map_or(0, |o| o.size());
        engine.retained.force(added, freed);
    }

    fn len(&self) -> usize {
        self.inner.lock().by_topic.len()
    }
}

impl Tenant {
    /// Sets `topic`'s retained message (a retained MQTT publish), replacing
    /// the one before; an empty `body` clears it. `expires_at_ms` is its
    /// MQTT 5 expiry (ms since the epoch), `now_ms` the current time (a
    /// message already expired clears too; expired neighbours are removed
    /// on the way). Returns when the change is durable (None when nothing
    /// changed: a clear of a topic without a retained message). Refused
    /// with [`RetainError::TooManyMessages`] / [`RetainError::TooManyBytes`]
    /// past the bounds ([`crate::Engine::set_retained_limits`]).
    pub fn retain(
        &self,
        topic: &str,
        header: MessageHeader,
        body: Bytes,
        expires_at_ms: Option<u64>,
        now_ms: u64,
    ) -> Result<Option<DurableWait>, RetainError> {
        let engine = self.engine()?;
        self.retained.set(
            &engine,
            &self.name,
            topic,
            header,
            body,
            expires_at_ms,
            now_ms,
        )
    }

    /// The retained messages whose topic matches MQTT filter `filter`
    /// (see [`topic_matches`]) and that have not expired at `now_ms`,
    /// ordered by topic.
    pub fn retained(&self, filter: &str, now_ms: u64) -> Vec<Arc<RetainedMessage>> {
        self.retained.matching(filter, now_ms)
    }

    /// Retained messages held (expired ones not swept yet included).
    pub fn retained_count(&self) -> usize {
        self.retained.len()
    }

    /// Removes this tenant's retained messages expired at `now_ms`.
    pub(crate) fn sweep_retained(&self, engine: &Engine, now_ms: u64) -> usize {
        self.retained.sweep(engine, &self.name, now_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filter_matching_follows_mqtt() {
        let yes = [
            ("a/b", "a/b"),
            ("a/+", "a/b"),
            ("a/+", "a/"),
            ("+/+", "/a"),
            ("a/#", "a"),
            ("a/#", "a/b/c"),
            ("#", "a/b"),
            ("#", "/"),
            ("+", "a"),
            ("+/b/#", "x/b"),
            ("$SYS/#", "$SYS/broker"),
            ("$SYS/+", "$SYS/x"),
            ("a/$x", "a/$x"),
            ("+/$x", "a/$x"),
        ];
        for (f, t) in yes {
            assert!(topic_matches(f, t), "{f} should match {t}");
        }
        let no = [
            ("a/b", "a/c"),
            ("a/+", "a"),
            ("a/+", "a/b/c"),
            ("+", "/a"),
            ("a", "a/b"),
            ("a/b", "a"),
            ("#", "$SYS/x"),
            ("+/broker", "$SYS/broker"),
            ("+", "$x"),
            ("a/#", "ab"),
            ("a/b/#", "a"),
        ];
        for (f, t) in no {
            assert!(!topic_matches(f, t), "{f} should not match {t}");
        }
    }

    #[test]
    fn literal_prefix_stops_at_the_first_wildcard() {
        assert_eq!(literal_prefix("a/b"), None);
        assert_eq!(literal_prefix("a/b/+/c"), Some(("a/b/".into(), false)));
        assert_eq!(literal_prefix("a/#"), Some(("a/".into(), true)));
        assert_eq!(literal_prefix("#"), Some((String::new(), true)));
        assert_eq!(literal_prefix("+/x"), Some((String::new(), false)));
    }

    #[test]
    fn values_round_trip_and_garbage_is_refused() {
        let m = RetainedMessage {
            topic: "a/b\0c".into(),
            header: MessageHeader::new(HeaderFormat::Mqtt, Bytes::from_static(&[1, 2])),
            body: Bytes::from_static(b"body"),
            expires_at_ms: Some(77),
        };
        let k = key("ten", &m.topic);
        let v = encode_value(&m);
        let (t, back) = decode_entry(&k, &v)
            .expect("a retained key")
            .expect("decodes");
        assert_eq!(t, "ten");
        assert_eq!(back, m);
        let m2 = RetainedMessage {
            expires_at_ms: None,
            ..m.clone()
        };
        let v2 = encode_value(&m2);
        assert_eq!(decode_entry(&k, &v2).unwrap().unwrap().1, m2);
        assert!(decode_entry(b"q\0ten\0x", &v).is_none());
        for cut in 0..v.len() - m.body.len() {
            assert!(
                decode_entry(&k, &v[..cut]).unwrap().is_err(),
                "cut at {cut}"
            );
        }
        let mut bad = v.clone();
        bad[1] = 99;
        assert!(decode_entry(&k, &bad).unwrap().is_err());
        bad = v.clone();
        bad[2] = 2;
        assert!(decode_entry(&k, &bad).unwrap().is_err());
        assert_eq!(decode_entry(b"r\0ten", &v), Some(Err(DecodeError::Key)));
    }
}
