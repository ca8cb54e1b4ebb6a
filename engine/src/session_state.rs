//! Durable protocol session state: small values a protocol session must
//! find again after a restart and that belong to no queue (MQTT: the QoS 2
//! packet ids between PUBREC and PUBREL, both ways). Kept per tenant in
//! memory and in the store's state store (key `s \0 tenant \0 key`, each key
//! versioned on its own, recovered by scanning [`KEY_PREFIX`] at open), so a
//! change is one state record and durable when its wait resolves. It shares
//! no version with the metadata map or with other keys: session state of
//! many sessions is written concurrently without conflicting.
//!
//! Meant for bounded state (per session, at most its in-flight window): the
//! embedded log keeps its state store in memory and rewrites it whole at
//! each checkpoint.

use crate::{DurableWait, Engine, Result, Tenant};
use parking_lot::RwLock;
use std::collections::BTreeMap;
use weir_backend::Op;

const KEY_KIND: &[u8] = b"s";

/// The state-store prefix of every session-state key.
pub(crate) const KEY_PREFIX: &[u8] = b"s\0";

/// One tenant's session state.
#[derive(Default)]
pub(crate) struct SessionState {
    values: RwLock<BTreeMap<String, Vec<u8>>>,
}

/// The state-store key of `key` in `tenant`.
fn state_key(tenant: &str, key: &str) -> Vec<u8> {
    let mut k = Vec::with_capacity(KEY_KIND.len() + tenant.len() + key.len() + 2);
    k.extend_from_slice(KEY_KIND);
    k.push(0);
    k.extend_from_slice(tenant.as_bytes());
    k.push(0);
    k.extend_from_slice(key.as_bytes());
    k
}

/// `(tenant, key)` of a session-state key; None for other kinds.
pub(crate) fn decode_key(k: &[u8]) -> Option<(String, String)> {
    let rest = k.strip_prefix(KEY_KIND)?.strip_prefix(&[0])?;
    let split = rest.iter().position(|&b| b == 0)?;
    let tenant = std::str::from_utf8(&rest[..split]).ok()?;
    let key = std::str::from_utf8(&rest[split + 1..]).ok()?;
    Some((tenant.to_string(), key.to_string()))
}

impl SessionState {
    pub(crate) fn restore(&self, key: String, value: Vec<u8>) {
        self.values.write().insert(key, value);
    }
}

impl Tenant {
    /// Sets (`Some`) or removes (`None`) session-state values in one
    /// state-store append; the wait resolves once it is durable.
    pub fn update_session_state(&self, changes: &[(&str, Option<&[u8]>)]) -> Result<DurableWait> {
        let engine: std::sync::Arc<Engine> = self.engine()?;
        let keys: Vec<Vec<u8>> = changes
            .iter()
            .map(|(k, _)| state_key(&self.name, k))
            .collect();
        let ops: Vec<Op<'_>> = changes
            .iter()
            .zip(&keys)
            .map(|((_, v), k)| match v {
                Some(v) => Op::PutState { key: k, value: v },
                None => Op::DeleteState { key: k },
            })
            .collect();
        // Memory and the append under one lock: two updates of one key
        // reach the store in the order memory saw them.
        let mut values = self.session_state.values.write();
        let wait = engine.persist(&ops)?;
        for (k, v) in changes {
            match v {
                Some(v) => values.insert(k.to_string(), v.to_vec()),
                None => values.remove(*k),
            };
        }
        Ok(wait)
    }

    /// Every session-state value whose key starts with `prefix`.
    pub fn session_state(&self, prefix: &str) -> Vec<(String, Vec<u8>)> {
        self.session_state
            .values
            .read()
            .range(prefix.to_string()..)
            .take_while(|(k, _)| k.starts_with(prefix))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    }
}
