//! Users' permissions within tenants, as RabbitMQ defines them.
//!
//! * **Permissions** per (user, tenant): three regular expressions,
//!   `configure`, `write` and `read`, matched against queue and exchange
//!   names. As in RabbitMQ they are *not* anchored (`re:run` searches), so
//!   `"^app\\."` and `"app"` differ; the empty string means `^$` (nothing:
//!   no resource is named ""; the default exchange is checked as
//!   `amq.default`). A user with no permission entry on a tenant cannot
//!   open it at all.
//! * **Topic permissions** per (user, tenant, exchange): `write` and `read`
//!   regular expressions over routing keys, checked for topic exchanges only
//!   (publishes: write; bindings and MQTT subscriptions: read). A user with
//!   no topic permission for an exchange is not restricted by them.
//!   `{username}`, `{vhost}` and (MQTT) `{client_id}` are replaced by the
//!   connection's values before the match; unlike RabbitMQ the values are
//!   regex-escaped, so a user named `a.b` does not also match `aXb`.
//!
//! Which operation needs which permission (RabbitMQ's table) is applied by
//! [`crate::Client`]; the definitions are durable in the store's metadata
//! (see [`crate::Engine::set_permissions`]).

use parking_lot::RwLock;
use regex::Regex;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// The exchange name permissions see for the default exchange (RabbitMQ's).
pub const DEFAULT_EXCHANGE_ALIAS: &str = "amq.default";

/// What an operation does to a resource.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Permission {
    /// Create, delete or change a resource.
    Configure,
    /// Put messages into it (publish, the destination of a binding).
    Write,
    /// Take messages out of it (consume, get, purge, the source of a binding).
    Read,
}

impl Permission {
    /// RabbitMQ's word for it.
    pub fn as_str(self) -> &'static str {
        match self {
            Permission::Configure => "configure",
            Permission::Write => "write",
            Permission::Read => "read",
        }
    }
}

/// A resource a permission is checked on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Resource<'a> {
    /// A queue by name.
    Queue(&'a str),
    /// An exchange by name ("" is the default exchange).
    Exchange(&'a str),
}

impl Resource<'_> {
    fn kind(&self) -> &'static str {
        match self {
            Resource::Queue(_) => "queue",
            Resource::Exchange(_) => "exchange",
        }
    }

    /// The name permissions are matched against.
    fn checked_name(&self) -> &str {
        match self {
            Resource::Queue(n) => n,
            Resource::Exchange("") => DEFAULT_EXCHANGE_ALIAS,
            Resource::Exchange(n) => n,
        }
    }
}

/// A stored user: what [`crate::auth::Authenticator`] verifies logins with.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct UserDef {
    /// Login name.
    pub name: String,
    /// argon2id PHC string.
    pub password_hash: String,
    /// RabbitMQ tags (`administrator`, `monitoring`, …).
    #[serde(default)]
    pub tags: Vec<String>,
    /// Accepted from loopback addresses only (`guest` by default).
    #[serde(default)]
    pub loopback_only: bool,
    /// Set from the configuration file: removed at a start whose
    /// configuration no longer has it (definitions made through the
    /// management API are not).
    #[serde(default)]
    pub from_config: bool,
}

/// A user's permissions in one tenant (RabbitMQ definitions' `permissions`).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PermissionDef {
    /// User name.
    pub user: String,
    /// Tenant (vhost).
    pub vhost: String,
    /// Regular expression over names the user may configure.
    pub configure: String,
    /// Regular expression over names the user may write to.
    pub write: String,
    /// Regular expression over names the user may read from.
    pub read: String,
    /// Set from the configuration file (see [`UserDef::from_config`]).
    #[serde(default)]
    pub from_config: bool,
}

impl PermissionDef {
    /// Every permission on every resource of `vhost`.
    pub fn full(user: &str, vhost: &str) -> Self {
        PermissionDef {
            user: user.to_string(),
            vhost: vhost.to_string(),
            configure: ".*".into(),
            write: ".*".into(),
            read: ".*".into(),
            from_config: false,
        }
    }
}

/// A user's topic permissions on one exchange of one tenant (RabbitMQ
/// definitions' `topic_permissions`).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TopicPermissionDef {
    /// User name.
    pub user: String,
    /// Tenant (vhost).
    pub vhost: String,
    /// The (topic) exchange.
    pub exchange: String,
    /// Regular expression over routing keys the user may publish with.
    pub write: String,
    /// Regular expression over binding keys the user may bind (subscribe) with.
    pub read: String,
    /// Set from the configuration file (see [`UserDef::from_config`]).
    #[serde(default)]
    pub from_config: bool,
}

/// An invalid permission definition.
#[derive(Debug, thiserror::Error)]
pub enum PermissionError {
    /// A pattern that is not a regular expression.
    #[error("{which} pattern '{pattern}' is not a valid regular expression: {reason}")]
    Pattern {
        /// `configure`, `write` or `read`.
        which: &'static str,
        /// The pattern.
        pattern: String,
        /// The parser's complaint.
        reason: String,
    },
}

/// Compiles a resource pattern: "" is `^$`, as in RabbitMQ.
fn compile(which: &'static str, pattern: &str) -> Result<Regex, PermissionError> {
    let p = if pattern.is_empty() { "^$" } else { pattern };
    Regex::new(p).map_err(|e| PermissionError::Pattern {
        which,
        pattern: pattern.to_string(),
        reason: e.to_string(),
    })
}

/// Replaces `{username}`, `{vhost}` and `{client_id}` (escaped) in a topic
/// pattern; "" becomes `^$`.
pub fn expand_topic_pattern(
    pattern: &str,
    user: &str,
    vhost: &str,
    client_id: Option<&str>,
) -> String {
    if pattern.is_empty() {
        return "^$".to_string();
    }
    let mut p = pattern
        .replace("{username}", &regex::escape(user))
        .replace("{vhost}", &regex::escape(vhost));
    if let Some(id) = client_id {
        p = p.replace("{client_id}", &regex::escape(id));
    }
    p
}

/// Checks a topic pattern compiles once its variables are filled in.
fn check_topic_pattern(which: &'static str, pattern: &str) -> Result<(), PermissionError> {
    compile(which, &expand_topic_pattern(pattern, "u", "v", Some("c"))).map(|_| ())
}

impl PermissionDef {
    /// Checks the three patterns.
    pub fn validate(&self) -> Result<(), PermissionError> {
        compile("configure", &self.configure)?;
        compile("write", &self.write)?;
        compile("read", &self.read)?;
        Ok(())
    }
}

impl TopicPermissionDef {
    /// Checks both patterns.
    pub fn validate(&self) -> Result<(), PermissionError> {
        check_topic_pattern("write", &self.write)?;
        check_topic_pattern("read", &self.read)
    }
}

/// What one user may do in one tenant: compiled once per change.
#[derive(Debug)]
pub struct VhostAccess {
    configure: Regex,
    write: Regex,
    read: Regex,
    /// Topic permission patterns by exchange (raw: variables are filled in
    /// per connection).
    topics: HashMap<String, TopicPatterns>,
}

/// The raw topic patterns of one exchange.
#[derive(Clone, Debug)]
pub struct TopicPatterns {
    /// Routing keys that may be published with.
    pub write: String,
    /// Binding keys that may be bound with.
    pub read: String,
}

impl TopicPatterns {
    /// The pattern for `p` (configure has none: treated as read).
    pub fn get(&self, p: Permission) -> &str {
        match p {
            Permission::Write => &self.write,
            _ => &self.read,
        }
    }
}

impl VhostAccess {
    /// Whether `p` on `r` is allowed.
    pub fn allows(&self, p: Permission, r: Resource<'_>) -> bool {
        let re = match p {
            Permission::Configure => &self.configure,
            Permission::Write => &self.write,
            Permission::Read => &self.read,
        };
        re.is_match(r.checked_name())
    }

    /// The topic permissions on `exchange`, if any.
    pub fn topic(&self, exchange: &str) -> Option<&TopicPatterns> {
        self.topics.get(exchange)
    }
}

/// RabbitMQ's refusal text for a resource.
pub fn refused(p: Permission, r: Resource<'_>, vhost: &str, user: &str) -> String {
    let name = r.checked_name();
    format!(
        "{} access to {} '{}' in vhost '{}' refused for user '{}'",
        p.as_str(),
        r.kind(),
        name,
        vhost,
        user
    )
}

/// RabbitMQ's refusal text for a routing key.
pub fn topic_refused(p: Permission, key: &str, exchange: &str, vhost: &str, user: &str) -> String {
    format!(
        "{} access to topic '{}' in exchange '{}' in vhost '{}' refused for user '{}'",
        p.as_str(),
        key,
        exchange,
        vhost,
        user
    )
}

/// RabbitMQ's refusal text for a tenant.
pub fn vhost_refused(vhost: &str, user: &str) -> String {
    format!("access to vhost '{vhost}' refused for user '{user}'")
}

#[derive(Default)]
struct Table {
    /// (user, vhost) → permissions.
    perms: HashMap<(String, String), PermissionDef>,
    /// (user, vhost) → exchange → topic permissions.
    topics: HashMap<(String, String), BTreeMap<String, TopicPermissionDef>>,
    /// (user, vhost) → compiled, for every entry of `perms`.
    access: HashMap<(String, String), Arc<VhostAccess>>,
}

impl Table {
    fn rebuild(&mut self, k: &(String, String)) {
        let Some(p) = self.perms.get(k) else {
            self.access.remove(k);
            return;
        };
        // Definitions are validated before they get here (and when
        // restored); a pattern that still fails grants nothing.
        let nothing = || Regex::new("^$").expect("a valid pattern");
        let topics = self
            .topics
            .get(k)
            .map(|m| {
                m.values()
                    .map(|t| {
                        (
                            t.exchange.clone(),
                            TopicPatterns {
                                write: t.write.clone(),
                                read: t.read.clone(),
                            },
                        )
                    })
                    .collect()
            })
            .unwrap_or_default();
        let access = VhostAccess {
            configure: compile("configure", &p.configure).unwrap_or_else(|_| nothing()),
            write: compile("write", &p.write).unwrap_or_else(|_| nothing()),
            read: compile("read", &p.read).unwrap_or_else(|_| nothing()),
            topics,
        };
        self.access.insert(k.clone(), Arc::new(access));
    }
}

/// Every user's permissions, in memory (the engine keeps them durable).
#[derive(Default)]
pub struct Permissions {
    table: RwLock<Table>,
    /// Bumped by every change: clients compare it on each operation (one
    /// atomic load) and drop their cached decisions when it moved.
    generation: AtomicU64,
}

impl std::fmt::Debug for Permissions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Permissions")
            .field("entries", &self.table.read().perms.len())
            .finish_non_exhaustive()
    }
}

fn pair(user: &str, vhost: &str) -> (String, String) {
    (user.to_string(), vhost.to_string())
}

impl Permissions {
    /// The current generation (changes with every definition change).
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    fn changed(&self) {
        self.generation.fetch_add(1, Ordering::AcqRel);
    }

    /// What `user` may do in `vhost`; `None`: no access at all.
    pub fn access(&self, user: &str, vhost: &str) -> Option<Arc<VhostAccess>> {
        self.table.read().access.get(&pair(user, vhost)).cloned()
    }

    /// Sets (replaces) a user's permissions in a tenant (validated).
    pub fn set(&self, def: PermissionDef) -> Result<(), PermissionError> {
        def.validate()?;
        let k = pair(&def.user, &def.vhost);
        let mut t = self.table.write();
        t.perms.insert(k.clone(), def);
        t.rebuild(&k);
        drop(t);
        self.changed();
        Ok(())
    }

    /// Removes a user's permissions in a tenant; whether there were any.
    pub fn clear(&self, user: &str, vhost: &str) -> bool {
        let k = pair(user, vhost);
        let mut t = self.table.write();
        let had = t.perms.remove(&k).is_some();
        t.rebuild(&k);
        drop(t);
        self.changed();
        had
    }

    /// Sets (replaces) a user's topic permissions on an exchange.
    pub fn set_topic(&self, def: TopicPermissionDef) -> Result<(), PermissionError> {
        def.validate()?;
        let k = pair(&def.user, &def.vhost);
        let mut t = self.table.write();
        t.topics
            .entry(k.clone())
            .or_default()
            .insert(def.exchange.clone(), def);
        t.rebuild(&k);
        drop(t);
        self.changed();
        Ok(())
    }

    /// Removes a user's topic permissions in a tenant, on one exchange or
    /// (`None`) on all; returns the removed definitions.
    pub fn clear_topic(
        &self,
        user: &str,
        vhost: &str,
        exchange: Option<&str>,
    ) -> Vec<TopicPermissionDef> {
        let k = pair(user, vhost);
        let mut t = self.table.write();
        let removed = match (t.topics.get_mut(&k), exchange) {
            (None, _) => Vec::new(),
            (Some(m), Some(x)) => m.remove(x).into_iter().collect(),
            (Some(m), None) => std::mem::take(m).into_values().collect(),
        };
        if t.topics.get(&k).is_some_and(BTreeMap::is_empty) {
            t.topics.remove(&k);
        }
        t.rebuild(&k);
        drop(t);
        self.changed();
        removed
    }

    /// Every permission definition, sorted by user then tenant.
    pub fn list(&self) -> Vec<PermissionDef> {
        let mut v: Vec<PermissionDef> = self.table.read().perms.values().cloned().collect();
        v.sort_by(|a, b| (&a.user, &a.vhost).cmp(&(&b.user, &b.vhost)));
        v
    }

    /// Every topic permission definition, sorted by user, tenant, exchange.
    pub fn list_topic(&self) -> Vec<TopicPermissionDef> {
        let t = self.table.read();
        let mut v: Vec<TopicPermissionDef> = t
            .topics
            .values()
            .flat_map(|m| m.values().cloned())
            .collect();
        v.sort_by(|a, b| (&a.user, &a.vhost, &a.exchange).cmp(&(&b.user, &b.vhost, &b.exchange)));
        v
    }
}

/// Whether `name` is a topic exchange of `tenant` (topic permissions apply
/// to those only).
pub(crate) fn is_topic(tenant: &crate::Tenant, name: &str) -> bool {
    tenant
        .exchange(name)
        .is_ok_and(|x| x.def.kind == crate::exchange::ExchangeKind::Topic)
}

/// Most routing keys (per exchange) or exchanges whose decision a client
/// remembers; a full cache is emptied (decisions are cheap to recompute,
/// this only bounds memory against a client using endless keys).
const DECISIONS_MAX: usize = 256;

/// One exchange's publish decision, as a client caches it.
struct ExchangeDecision {
    /// Write permission on the exchange.
    write: bool,
    /// The compiled topic write pattern, when the exchange is a topic
    /// exchange and the user has topic permissions on it.
    topic: Option<Regex>,
    /// Routing key → allowed, for `topic`.
    keys: HashMap<Box<str>, bool>,
}

/// A client's view of its permissions, with its cached decisions (one
/// client is used by one task: no locks here).
pub(crate) struct Authz {
    registry: Arc<Permissions>,
    user: Arc<str>,
    vhost: String,
    client_id: Option<String>,
    generation: u64,
    access: Option<Arc<VhostAccess>>,
    publish: HashMap<Box<str>, ExchangeDecision>,
    /// The last exchange published to whose decision needs no key: most
    /// publishers use one exchange, so the hot path is one compare.
    last_free: Option<Box<str>>,
    /// (exchange, binding key) → topic read allowed.
    topic_read: HashMap<(Box<str>, Box<str>), bool>,
}

impl Authz {
    /// The view of `user` in `vhost`; refused when the user has no
    /// permissions there.
    pub(crate) fn open(
        registry: Arc<Permissions>,
        user: Arc<str>,
        vhost: &str,
    ) -> Result<Self, String> {
        let generation = registry.generation();
        let access = registry.access(&user, vhost);
        if access.is_none() {
            return Err(vhost_refused(vhost, &user));
        }
        Ok(Authz {
            registry,
            user,
            vhost: vhost.to_string(),
            client_id: None,
            generation,
            access,
            publish: HashMap::new(),
            last_free: None,
            topic_read: HashMap::new(),
        })
    }

    pub(crate) fn set_client_id(&mut self, id: &str) {
        self.client_id = Some(id.to_string());
        self.publish.clear();
        self.last_free = None;
        self.topic_read.clear();
    }

    /// Picks up changed definitions (one atomic load when nothing changed).
    fn refresh(&mut self) {
        let g = self.registry.generation();
        if g != self.generation {
            self.generation = g;
            self.access = self.registry.access(&self.user, &self.vhost);
            self.publish.clear();
            self.last_free = None;
            self.topic_read.clear();
        }
    }

    /// `p` on `r`, or RabbitMQ's refusal text.
    pub(crate) fn check(&mut self, p: Permission, r: Resource<'_>) -> Result<(), String> {
        self.refresh();
        match &self.access {
            Some(a) if a.allows(p, r) => Ok(()),
            Some(_) => Err(refused(p, r, &self.vhost, &self.user)),
            None => Err(vhost_refused(&self.vhost, &self.user)),
        }
    }

    fn topic_regex(&self, exchange: &str, p: Permission) -> Option<Regex> {
        let t = self.access.as_ref()?.topic(exchange)?;
        let expanded =
            expand_topic_pattern(t.get(p), &self.user, &self.vhost, self.client_id.as_deref());
        // Validated when set; a pattern that fails with these values grants nothing.
        Some(Regex::new(&expanded).unwrap_or_else(|_| Regex::new("^$").expect("valid")))
    }

    /// Topic read on `key` of `exchange` (a topic exchange: the caller
    /// checks the kind).
    pub(crate) fn check_topic_read(&mut self, exchange: &str, key: &str) -> Result<(), String> {
        self.refresh();
        let k = (Box::<str>::from(exchange), Box::<str>::from(key));
        let ok = match self.topic_read.get(&k) {
            Some(ok) => *ok,
            None => {
                let ok = self
                    .topic_regex(exchange, Permission::Read)
                    .is_none_or(|re| re.is_match(key));
                if self.topic_read.len() >= DECISIONS_MAX {
                    self.topic_read.clear();
                }
                self.topic_read.insert(k, ok);
                ok
            }
        };
        if ok {
            Ok(())
        } else {
            Err(topic_refused(
                Permission::Read,
                key,
                exchange,
                &self.vhost,
                &self.user,
            ))
        }
    }

    /// The publish check: write on the exchange and, for a topic exchange
    /// with topic permissions, topic write on the routing key. Decisions
    /// are cached per exchange (and per key): the hot path is two hash
    /// lookups and an atomic load. `is_topic` is asked only on a miss.
    pub(crate) fn check_publish(
        &mut self,
        exchange: &str,
        key: &str,
        is_topic: impl FnOnce() -> bool,
    ) -> Result<(), String> {
        self.refresh();
        if self.last_free.as_deref() == Some(exchange) {
            return Ok(());
        }
        if !self.publish.contains_key(exchange) {
            let Some(access) = self.access.as_ref() else {
                return Err(vhost_refused(&self.vhost, &self.user));
            };
            let write = access.allows(Permission::Write, Resource::Exchange(exchange));
            let topic = if write && access.topic(exchange).is_some() && is_topic() {
                self.topic_regex(exchange, Permission::Write)
            } else {
                None
            };
            if self.publish.len() >= DECISIONS_MAX {
                self.publish.clear();
            }
            self.publish.insert(
                exchange.into(),
                ExchangeDecision {
                    write,
                    topic,
                    keys: HashMap::new(),
                },
            );
        }
        let Some(d) = self.publish.get_mut(exchange) else {
            return Err(vhost_refused(&self.vhost, &self.user));
        };
        if !d.write {
            return Err(refused(
                Permission::Write,
                Resource::Exchange(exchange),
                &self.vhost,
                &self.user,
            ));
        }
        let Some(re) = &d.topic else {
            self.last_free = Some(exchange.into());
            return Ok(());
        };
        let ok = match d.keys.get(key) {
            Some(ok) => *ok,
            None => {
                let ok = re.is_match(key);
                if d.keys.len() >= DECISIONS_MAX {
                    d.keys.clear();
                }
                d.keys.insert(key.into(), ok);
                ok
            }
        };
        if ok {
            Ok(())
        } else {
            Err(topic_refused(
                Permission::Write,
                key,
                exchange,
                &self.vhost,
                &self.user,
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn perms(c: &str, w: &str, r: &str) -> PermissionDef {
        PermissionDef {
            user: "u".into(),
            vhost: "v".into(),
            configure: c.into(),
            write: w.into(),
            read: r.into(),
            from_config: false,
        }
    }

    #[test]
    fn patterns_are_searched_and_empty_means_nothing() {
        let p = Permissions::default();
        p.set(perms("^app\\.", "x", "")).expect("valid");
        let a = p.access("u", "v").expect("access");
        assert!(a.allows(Permission::Configure, Resource::Queue("app.q")));
        assert!(!a.allows(Permission::Configure, Resource::Queue("my.app.q")));
        // Not anchored: "x" matches anywhere in the name.
        assert!(a.allows(Permission::Write, Resource::Exchange("box")));
        assert!(!a.allows(Permission::Read, Resource::Queue("q")));
        assert!(p.access("u", "w").is_none());
        assert!(p.access("v", "v").is_none());
    }

    #[test]
    fn the_default_exchange_is_checked_as_amq_default() {
        let p = Permissions::default();
        p.set(perms("", "^amq\\.default$", "")).expect("valid");
        let a = p.access("u", "v").expect("access");
        assert!(a.allows(Permission::Write, Resource::Exchange("")));
    }

    #[test]
    fn invalid_patterns_are_refused() {
        let p = Permissions::default();
        assert!(p.set(perms("(", "", "")).is_err());
        let t = TopicPermissionDef {
            user: "u".into(),
            vhost: "v".into(),
            exchange: "amq.topic".into(),
            write: "^{username}(".into(),
            read: "^{username}\\.".into(),
            from_config: false,
        };
        assert!(p.set_topic(t).is_err());
    }

    #[test]
    fn variables_are_expanded_and_escaped() {
        assert_eq!(
            expand_topic_pattern(
                "^{username}\\.{client_id}\\.{vhost}",
                "a.b",
                "/",
                Some("c+")
            ),
            "^a\\.b\\.c\\+\\./"
        );
        assert_eq!(expand_topic_pattern("", "u", "v", None), "^$");
    }

    #[test]
    fn publish_decisions_are_cached_and_dropped_on_change() {
        let p = Arc::new(Permissions::default());
        p.set(perms(".*", "^amq\\.topic$", ".*")).expect("valid");
        p.set_topic(TopicPermissionDef {
            user: "u".into(),
            vhost: "v".into(),
            exchange: "amq.topic".into(),
            write: "^{username}\\.".into(),
            read: ".*".into(),
            from_config: false,
        })
        .expect("valid");
        let mut z = Authz::open(p.clone(), "u".into(), "v").expect("access");
        assert!(z.check_publish("amq.topic", "u.k", || true).is_ok());
        let e = z.check_publish("amq.topic", "w.k", || true).unwrap_err();
        assert_eq!(
            e,
            "write access to topic 'w.k' in exchange 'amq.topic' in vhost 'v' refused for user 'u'"
        );
        // Not a topic exchange: topic permissions do not apply.
        let mut z2 = Authz::open(p.clone(), "u".into(), "v").expect("access");
        assert!(z2.check_publish("amq.topic", "w.k", || false).is_ok());
        assert!(z.check_publish("other", "k", || true).is_err());
        p.clear_topic("u", "v", None);
        assert!(z.check_publish("amq.topic", "w.k", || true).is_ok());
        p.clear("u", "v");
        assert_eq!(
            z.check_publish("amq.topic", "w.k", || true).unwrap_err(),
            "access to vhost 'v' refused for user 'u'"
        );
    }
}
