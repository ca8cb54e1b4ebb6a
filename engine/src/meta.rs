//! How definitions are encoded in the store's metadata map.
//!
//! Keys are `kind \0 tenant \0 name …`, values JSON. JSON keeps the format
//! readable and forward-compatible; metadata changes are rare and small.

use super::exchange::ExchangeDef;
use super::queue::QueueDef;

/// Key of a tenant.
pub fn tenant_key(tenant: &str) -> Vec<u8> {
    key(&["t", tenant])
}

/// Key of an exchange.
pub fn exchange_key(tenant: &str, name: &str) -> Vec<u8> {
    key(&["x", tenant, name])
}

/// Key of a queue.
pub fn queue_key(tenant: &str, name: &str) -> Vec<u8> {
    key(&["q", tenant, name])
}

/// Key of a binding.
pub fn binding_key(tenant: &str, b: &BindingDef) -> Vec<u8> {
    let args = b.arguments.to_string();
    key(&[
        "b",
        tenant,
        &b.source,
        b.destination_kind.as_str(),
        &b.destination,
        &b.key,
        &args,
    ])
}

/// Key of a policy.
pub fn policy_key(tenant: &str, name: &str) -> Vec<u8> {
    key(&["P", tenant, name])
}

/// Key of a user (users belong to no tenant: the name takes the tenant's place).
pub fn user_key(name: &str) -> Vec<u8> {
    key(&["U", name])
}

/// Key of a user's permissions in a tenant.
pub fn permission_key(tenant: &str, user: &str) -> Vec<u8> {
    key(&["W", tenant, user])
}

/// Key of a user's topic permissions on an exchange of a tenant.
pub fn topic_permission_key(tenant: &str, user: &str, exchange: &str) -> Vec<u8> {
    key(&["T", tenant, user, exchange])
}

/// Key of the partition-id counter.
pub const NEXT_PARTITION_KEY: &[u8] = b"p";

fn key(parts: &[&str]) -> Vec<u8> {
    let mut k = Vec::with_capacity(parts.iter().map(|p| p.len() + 1).sum());
    for (i, p) in parts.iter().enumerate() {
        if i > 0 {
            k.push(0);
        }
        k.extend_from_slice(p.as_bytes());
    }
    k
}

/// Kind of a binding's destination.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DestinationKind {
    /// A queue.
    Queue,
    /// An exchange.
    Exchange,
}

impl DestinationKind {
    fn as_str(self) -> &'static str {
        match self {
            DestinationKind::Queue => "q",
            DestinationKind::Exchange => "x",
        }
    }
}

/// A persisted binding.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct BindingDef {
    /// Source exchange.
    pub source: String,
    /// Destination kind.
    pub destination_kind: DestinationKind,
    /// Destination name.
    pub destination: String,
    /// Binding key.
    pub key: String,
    /// Arguments.
    pub arguments: serde_json::Value,
}

/// A decoded metadata entry.
pub enum MetaEntry {
    /// A tenant.
    Tenant(String),
    /// An exchange of a tenant.
    Exchange(String, ExchangeDef),
    /// A queue of a tenant.
    Queue(String, QueueDef),
    /// A binding of a tenant.
    Binding(String, BindingDef),
    /// A policy of a tenant.
    Policy(String, crate::policy::PolicyDef),
    /// A user.
    User(crate::permissions::UserDef),
    /// A user's permissions in a tenant.
    Permission(crate::permissions::PermissionDef),
    /// A user's topic permissions on an exchange.
    TopicPermission(crate::permissions::TopicPermissionDef),
    /// The next partition id.
    NextPartition(u64),
}

/// Decodes one metadata entry; `None` for keys of unknown kinds (written by a
/// newer version) or undecodable values, which the caller reports.
pub fn decode(key: &[u8], value: &[u8]) -> Option<MetaEntry> {
    if key == NEXT_PARTITION_KEY {
        return serde_json::from_slice(value)
            .ok()
            .map(MetaEntry::NextPartition);
    }
    let mut parts = key.split(|b| *b == 0);
    let kind = parts.next()?;
    let tenant = String::from_utf8(parts.next()?.to_vec()).ok()?;
    Some(match kind {
        b"t" => MetaEntry::Tenant(tenant),
        b"x" => MetaEntry::Exchange(tenant, serde_json::from_slice(value).ok()?),
        b"q" => MetaEntry::Queue(tenant, serde_json::from_slice(value).ok()?),
        b"b" => MetaEntry::Binding(tenant, serde_json::from_slice(value).ok()?),
        b"P" => MetaEntry::Policy(tenant, serde_json::from_slice(value).ok()?),
        b"U" => MetaEntry::User(serde_json::from_slice(value).ok()?),
        b"W" => MetaEntry::Permission(serde_json::from_slice(value).ok()?),
        b"T" => MetaEntry::TopicPermission(serde_json::from_slice(value).ok()?),
        _ => return None,
    })
}
