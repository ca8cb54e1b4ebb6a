//! Retained messages (MQTT): per tenant, the last retained message of each
//! topic.
//!
//! * **Set** by a retained publish ([`Tenant::retain`]), **replaced** by the
//!   next one to the same topic, **cleared** by one with an empty payload.
//! * **Durable**: each one is a key of the store's state store (key
//!   `r \0 tenant \0 topic`, value [`encode_value`]), versioned on its own
//!   (no version shared with the metadata map or other topics), appended
//!   before the change is visible and recovered by [`crate::Engine::open`]
//!   from a scan of [`KEY_PREFIX`]. The caller gets the store's
//!   [`DurableWait`], so an MQTT session acknowledges a retained QoS 1/2
//!   publish only once the retained copy is durable too. The embedded log
//!   keeps its state store in memory and checkpoints it whole, so a
//!   retained body costs its size twice in memory (here and in the store)
//!   and is rewritten with every checkpoint: hence the bounds.
//! * **Bounded** ([`RetainedLimits`]): retained messages and bytes (topic +
//!   header + body) per tenant, and bytes over every tenant as a ceiling, so
//!   one tenant filling its budget leaves the others theirs. A retained
//!   publish that would pass one is refused with
//!   [`RetainError::TooManyMessages`], [`RetainError::TenantBytes`] or
//!   [`RetainError::TooManyBytes`] (MQTT 5: 0x97 quota exceeded, see
//!   [`RetainError::is_quota_exceeded`]); replacing a message by one no
//!   larger, and clearing, are always allowed, so a tenant over a lowered
//!   bound can still shrink.
//! * **Expiring** (MQTT 5 message expiry): a retained message with a
//!   deadline is not returned after it ([`Tenant::retained`]); it is removed
//!   from memory and the store by the next retained publish of its tenant
//!   or by [`crate::Engine::sweep_retained`] (the gateway calls it
//!   periodically), and at restart.
//! * **Indexed** by topic level (a trie: a set or clear costs its topic's
//!   levels, not the number of topics) and **looked up lazily** by MQTT
//!   topic filter ([`topic_matches`]'s rules, `$`-topic rule included): a
//!   [`RetainedCursor`] walks the trie in bounded steps
//!   ([`Tenant::retained_next`]), each visiting at most [`STEP_NODES`]
//!   nodes under the tenant's lock, so a subscriber takes retained messages
//!   as its window allows and a wide filter never holds a thread long.
//!
//! The engine never depends on the protocol crates (`engine/tests/layers.rs`),
//! so the MQTT filter match is implemented here, on plain strings.

use crate::error::EngineError;
use crate::properties::{HeaderFormat, MessageHeader};
use crate::{DurableWait, Engine, Tenant};
use bytes::Bytes;
use parking_lot::{Mutex, RwLock};
use std::collections::btree_map::Range;
use std::collections::{BTreeMap, BTreeSet};
use std::ops::Bound;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use weir_backend::Op;

/// Kind byte of a retained message's state-store key.
const KEY_KIND: &[u8] = b"r";

/// The state-store prefix of every retained message's key.
pub(crate) const KEY_PREFIX: &[u8] = b"r\0";

/// Version byte leading [`encode_value`]'s output.
const VALUE_VERSION: u8 = 1;

/// Bounds on retained messages. 0 means no bound.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RetainedLimits {
    /// Retained messages per tenant.
    pub max_messages_per_tenant: usize,
    /// Bytes (topic + header + body) of one tenant's retained messages.
    pub max_bytes_per_tenant: u64,
    /// Bytes (topic + header + body) of every tenant's retained messages
    /// together: the ceiling over the tenants' own budgets.
    pub max_total_bytes: u64,
}

impl Default for RetainedLimits {
    /// 100,000 and 16 MiB per tenant, 64 MiB in total.
    fn default() -> Self {
        RetainedLimits {
            max_messages_per_tenant: 100_000,
            max_bytes_per_tenant: 16 << 20,
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
    /// It would take the tenant's retained messages over
    /// [`RetainedLimits::max_bytes_per_tenant`].
    #[error("retained messages of vhost '{tenant}' would exceed their limit of {limit} bytes")]
    TenantBytes {
        /// The tenant.
        tenant: String,
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
            RetainError::TooManyMessages { .. }
                | RetainError::TooManyBytes { .. }
                | RetainError::TenantBytes { .. }
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

/// Trie nodes a [`Tenant::retained_next`] step visits at most (under the
/// tenant's lock): a wide filter over many topics is walked in steps of
/// this many, the caller serving others in between.
pub const STEP_NODES: usize = 4096;

/// A tenant's retained messages.
#[derive(Debug, Default)]
pub(crate) struct Retained {
    inner: Mutex<Inner>,
}

/// One topic level of the trie: the message of the topic ending here, and
/// the levels below, in order.
#[derive(Debug, Default)]
struct Node {
    message: Option<Arc<RetainedMessage>>,
    children: BTreeMap<Box<str>, Node>,
}

#[derive(Debug, Default)]
struct Inner {
    /// By topic level; the root stands for no level (no topic ends there).
    root: Node,
    /// Messages in the trie.
    count: usize,
    /// Their bytes ([`RetainedMessage::size`]), this tenant's budget.
    bytes: u64,
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

    fn get(&self, topic: &str) -> Option<&Arc<RetainedMessage>> {
        let mut node = &self.root;
        for level in topic.split('/') {
            node = node.children.get(level)?;
        }
        node.message.as_ref()
    }

    /// Sets `m`'s topic to `m`; returns the message it replaced. Costs the
    /// topic's levels.
    fn insert(&mut self, m: Arc<RetainedMessage>) -> Option<Arc<RetainedMessage>> {
        let old = self.remove(&m.topic);
        if let Some(at) = m.expires_at_ms {
            self.expiry.insert((at, m.topic.clone()));
        }
        let mut node = &mut self.root;
        for level in m.topic.split('/') {
            node = node.children.entry(level.into()).or_default();
        }
        self.count += 1;
        self.bytes += m.size();
        node.message = Some(m);
        old
    }

    /// Removes `topic`'s message, and the levels left with nothing under
    /// them. Iterative (a topic may have many levels): one walk down to
    /// take the message, one to cut the empty branch off where it starts.
    fn remove(&mut self, topic: &str) -> Option<Arc<RetainedMessage>> {
        let levels: Vec<&str> = topic.split('/').collect();
        let mut node = &mut self.root;
        // The deepest node that stays (the root, or one holding a message
        // or another branch), and which of its children leads down.
        let mut keep = (0, levels[0]);
        for (depth, level) in levels.iter().enumerate() {
            node = node.children.get_mut(*level)?;
            let last = depth + 1 == levels.len();
            if !last && (node.message.is_some() || node.children.len() > 1) {
                keep = (depth + 1, levels[depth + 1]);
            }
        }
        let old = node.message.take()?;
        if node.children.is_empty() {
            let mut at = &mut self.root;
            for level in &levels[..keep.0] {
                at = at.children.get_mut(*level)?;
            }
            at.children.remove(keep.1);
        }
        if let Some(at) = old.expires_at_ms {
            self.expiry.remove(&(at, old.topic.clone()));
        }
        self.count -= 1;
        self.bytes = self.bytes.saturating_sub(old.size());
        Some(old)
    }

    /// One step of `cursor`'s walk: appends the live messages matching its
    /// filter after its position, in trie order, until `max` are found, the
    /// walk ends, or [`STEP_NODES`] nodes were visited. Iterative, with one
    /// frame per level of the path walked (a filter may have many levels).
    fn step(
        &self,
        cursor: &mut RetainedCursor,
        max: usize,
        now_ms: u64,
        out: &mut impl Extend<Arc<RetainedMessage>>,
    ) {
        if cursor.done {
            return;
        }
        let max = max.max(1);
        let filter: Vec<&str> = cursor.filter.split('/').collect();
        let after_owned = cursor.after.take();
        let resuming = after_owned.is_some();
        let after: &[Box<str>] = after_owned.as_deref().unwrap_or(&[]);
        // A filter starting with a wildcard never matches a `$` topic.
        let wild_root = matches!(filter[0], "+" | "#");
        let mut stack = vec![Frame {
            level: "",
            fi: 0,
            on_path: resuming,
            children: candidates(&self.root, &filter, 0, after, 0, resuming),
        }];
        let (mut visited, mut found) = (0, 0);
        while let Some(top) = stack.last_mut() {
            let (fi, on_path) = (top.fi, top.on_path);
            let Some((level, node)) = top.children.as_mut().and_then(Iterator::next) else {
                stack.pop();
                continue;
            };
            visited += 1;
            let parent_depth = stack.len() - 1;
            if parent_depth == 0 && wild_root && level.starts_with('$') {
                if visited >= STEP_NODES {
                    cursor.after = Some(vec![level.clone()]);
                    return;
                }
                continue;
            }
            let depth = parent_depth + 1;
            // On the cursor's path (never before it: the range starts at
            // its level): done already, unless it is a descendant.
            let on_cursor_path = on_path && **level == *after[parent_depth];
            let is_cursor = on_cursor_path && depth == after.len();
            let child_fi = if filter[fi] == "#" { fi } else { fi + 1 };
            if !on_cursor_path && (child_fi == filter.len() || filter[child_fi] == "#") {
                if let Some(m) = node.message.as_ref().filter(|m| !m.is_expired(now_ms)) {
                    out.extend(std::iter::once(m.clone()));
                    found += 1;
                }
            }
            let child_on_path = on_cursor_path && !is_cursor;
            stack.push(Frame {
                level,
                fi: child_fi,
                on_path: child_on_path,
                children: candidates(node, &filter, child_fi, after, depth, child_on_path),
            });
            if found >= max || visited >= STEP_NODES {
                // Everything up to this node is done.
                cursor.after = Some(stack[1..].iter().map(|f| f.level.into()).collect());
                return;
            }
        }
        cursor.done = true;
    }
}

/// A node on the path a cursor step walks.
struct Frame<'a> {
    /// Its topic level.
    level: &'a str,
    /// The filter level its children are matched against.
    fi: usize,
    /// It is a strict prefix of the cursor's position: its children before
    /// the cursor's level there are done.
    on_path: bool,
    /// Its children still to visit (None: none can match).
    children: Option<Range<'a, Box<str>, Node>>,
}

/// The children of `node` (at `depth`) that filter level `fi` may match:
/// one for a literal level, all of them (in order) for a wildcard, none
/// past the filter's end; from the cursor's level on when `on_path`.
fn candidates<'a>(
    node: &'a Node,
    filter: &[&str],
    fi: usize,
    after: &[Box<str>],
    depth: usize,
    on_path: bool,
) -> Option<Range<'a, Box<str>, Node>> {
    let level = *filter.get(fi)?;
    let from: Option<&str> = if on_path {
        after.get(depth).map(|l| &**l)
    } else {
        None
    };
    match level {
        "+" | "#" => {
            let lower = from.map_or(Bound::Unbounded, Bound::Included);
            Some(node.children.range::<str, _>((lower, Bound::Unbounded)))
        }
        literal => {
            if from.is_some_and(|f| literal < f) {
                return None;
            }
            Some(
                node.children
                    .range::<str, _>((Bound::Included(literal), Bound::Included(literal))),
            )
        }
    }
}

/// Where a lookup of retained messages by MQTT topic filter stands: made
/// by [`RetainedCursor::new`], advanced by [`Tenant::retained_next`] until
/// [`RetainedCursor::is_done`]. It holds the topic levels of the last node
/// visited, not a reference into the index: a message set or cleared
/// between steps is found or not as its topic falls after or before that.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RetainedCursor {
    filter: String,
    after: Option<Vec<Box<str>>>,
    done: bool,
}

impl RetainedCursor {
    /// A lookup of the retained messages matching `filter` (valid, without
    /// a `$share/group/` prefix), from the first.
    pub fn new(filter: &str) -> Self {
        RetainedCursor {
            filter: filter.to_owned(),
            after: None,
            done: false,
        }
    }

    /// The filter looked up.
    pub fn filter(&self) -> &str {
        &self.filter
    }

    /// Every matching message was returned.
    pub fn is_done(&self) -> bool {
        self.done
    }
}

/// The state-store key of `topic`'s retained message in `tenant`.
pub fn key(tenant: &str, topic: &str) -> Vec<u8> {
    let mut k = Vec::with_capacity(KEY_KIND.len() + tenant.len() + topic.len() + 2);
    k.extend_from_slice(KEY_KIND);
    k.push(0);
    k.extend_from_slice(tenant.as_bytes());
    k.push(0);
    k.extend_from_slice(topic.as_bytes());
    k
}

/// A retained message as a state-store value: version, header format, a flag
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

/// A retained message from its state-store entry: None if `key` is not a
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
            .filter_map(|t| inner.get(t))
            .map(|m| m.size())
            .sum();
        let mut keys: Vec<Vec<u8>> = expired.iter().map(|t| key(tenant, t)).collect();
        let old = inner.get(topic).filter(|m| !m.is_expired(now_ms)).cloned();
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
            let live = inner.count - expired.len();
            if live >= limits.max_messages_per_tenant {
                return Err(RetainError::TooManyMessages {
                    tenant: tenant.to_owned(),
                    limit: limits.max_messages_per_tenant,
                });
            }
        }
        // The tenant's own budget, then the ceiling over every tenant.
        let tenant_limit = limits.max_bytes_per_tenant;
        if tenant_limit != 0
            && added > freed
            && inner.bytes.saturating_sub(freed).saturating_add(added) > tenant_limit
        {
            return Err(RetainError::TenantBytes {
                tenant: tenant.to_owned(),
                limit: tenant_limit,
            });
        }
        budget.apply(added, freed, limits.max_total_bytes)?;
        let put = new.as_ref().map(|m| (key(tenant, topic), encode_value(m)));
        let mut ops: Vec<Op<'_>> = keys.iter().map(|k| Op::DeleteState { key: k }).collect();
        if let Some((k, v)) = &put {
            ops.push(Op::PutState { key: k, value: v });
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

    /// One step of `cursor` (see [`Inner::step`]).
    fn next(
        &self,
        cursor: &mut RetainedCursor,
        max: usize,
        now_ms: u64,
        out: &mut impl Extend<Arc<RetainedMessage>>,
    ) {
        self.inner.lock().step(cursor, max, now_ms, out);
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
        let ops: Vec<Op<'_>> = keys.iter().map(|k| Op::DeleteState { key: k }).collect();
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
        self.inner.lock().count
    }

    fn bytes(&self) -> u64 {
        self.inner.lock().bytes
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

    /// Every retained message whose topic matches MQTT filter `filter`
    /// (see [`topic_matches`]) and that has not expired at `now_ms`, in
    /// trie order (by topic level by level). All at once, in as many steps
    /// as it takes: for tests and small sets; a subscriber's session takes
    /// them with [`Self::retained_next`] as its window allows.
    pub fn retained(&self, filter: &str, now_ms: u64) -> Vec<Arc<RetainedMessage>> {
        let mut cursor = RetainedCursor::new(filter);
        let mut out = Vec::new();
        while !cursor.is_done() {
            self.retained
                .next(&mut cursor, usize::MAX, now_ms, &mut out);
        }
        out
    }

    /// One step of a lookup: appends to `out` at most `max` more retained
    /// messages matching `cursor`'s filter (unexpired at `now_ms`, in trie
    /// order), visiting at most [`STEP_NODES`] index nodes under the
    /// tenant's lock, so it may append none before the cursor is done.
    pub fn retained_next(
        &self,
        cursor: &mut RetainedCursor,
        max: usize,
        now_ms: u64,
        out: &mut impl Extend<Arc<RetainedMessage>>,
    ) {
        self.retained.next(cursor, max, now_ms, out);
    }

    /// Retained messages held (expired ones not swept yet included).
    pub fn retained_count(&self) -> usize {
        self.retained.len()
    }

    /// Bytes ([`RetainedMessage::size`]) this tenant's retained messages
    /// take (expired ones not swept yet included), counted against
    /// [`RetainedLimits::max_bytes_per_tenant`].
    pub fn retained_bytes(&self) -> u64 {
        self.retained.bytes()
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
    fn values_round_trip_and_garbage_is_refused() {
        let m = RetainedMessage {
            topic: "a/b\0c".into(),
            header: MessageHeader::new(HeaderFormat::new(3), Bytes::from_static(&[1, 2])),
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
        // 0 is no header format (any other number is one, with or without a codec).
        bad[1] = 0;
        assert!(decode_entry(&k, &bad).unwrap().is_err());
        bad = v.clone();
        bad[2] = 2;
        assert!(decode_entry(&k, &bad).unwrap().is_err());
        assert_eq!(decode_entry(b"r\0ten", &v), Some(Err(DecodeError::Key)));
    }
}
