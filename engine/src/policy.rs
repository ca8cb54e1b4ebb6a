//! RabbitMQ-style policies: per tenant, a name, a regular expression over
//! queue names, what they apply to, a priority and a definition with the
//! keys of queue arguments (`message-ttl`, `expires`, `max-length`,
//! `max-length-bytes`, `overflow`, `dead-letter-exchange`,
//! `dead-letter-routing-key`, `delivery-limit`), and for exchanges
//! `alternate-exchange`.
//!
//! At most one policy applies to a queue: the matching one with the
//! highest priority (ties: the name that sorts last wins, a stable rule).
//! Its definition is merged under the queue's own arguments as RabbitMQ
//! merges them: for the numeric limits (`message-ttl`, `expires`,
//! `max-length`, `max-length-bytes`, `delivery-limit`) the lower value
//! wins; for the rest the queue's argument wins. `max-priority` and
//! `x-partitions` shape a queue at declare and cannot come from a policy
//! (RabbitMQ refuses `max-priority` in a policy too).
//!
//! Policies are definitions like queues: stored in the metadata map
//! (durable), applied to existing queues when set or deleted.

use crate::args::{ArgError, QueueArgs};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// What a policy applies to.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ApplyTo {
    /// Queues only.
    Queues,
    /// Exchanges only (the key acted on is `alternate-exchange`).
    Exchanges,
    /// Both.
    #[default]
    All,
}

/// A policy as defined (and persisted).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct PolicyDef {
    /// Name, unique in its tenant.
    pub name: String,
    /// Regular expression over queue (or exchange) names.
    pub pattern: String,
    /// What it applies to.
    #[serde(default)]
    pub apply_to: ApplyTo,
    /// Higher wins when several match.
    #[serde(default)]
    pub priority: i32,
    /// Keys without the `x-` prefix, as in RabbitMQ.
    pub definition: Map<String, Value>,
}

/// Why a policy was refused.
#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    /// The pattern is not a valid regular expression.
    #[error("invalid pattern '{pattern}' in policy '{name}': {reason}")]
    Pattern {
        /// The policy.
        name: String,
        /// The pattern.
        pattern: String,
        /// The parser's message.
        reason: String,
    },
    /// A key that policies cannot set, or a value of the wrong type.
    #[error("invalid definition in policy '{name}': {reason}")]
    Definition {
        /// The policy.
        name: String,
        /// Why.
        reason: String,
    },
}

/// The keys a policy may set, and whether the lower of policy and
/// argument wins (numeric limits) rather than the argument.
const KEYS: &[(&str, bool)] = &[
    ("message-ttl", true),
    ("expires", true),
    ("max-length", true),
    ("max-length-bytes", true),
    ("delivery-limit", true),
    ("overflow", false),
    ("dead-letter-exchange", false),
    ("dead-letter-routing-key", false),
    // Streams: the queue's own `x-max-age` wins, as RabbitMQ merges it.
    ("max-age", false),
];

/// The keys a policy may set on exchanges (the exchange's own argument
/// wins, as in RabbitMQ).
const EXCHANGE_KEYS: &[&str] = &[crate::exchange::ALTERNATE_EXCHANGE];

/// A checked policy, ready to match.
#[derive(Debug)]
pub struct Policy {
    /// Its definition.
    pub def: PolicyDef,
    pattern: regex::Regex,
}

impl Policy {
    /// Checks a definition: the pattern compiles, every key is one a
    /// policy may set, and the values pass the queue-argument checks.
    pub fn new(def: PolicyDef) -> Result<Policy, PolicyError> {
        let pattern = regex::Regex::new(&def.pattern).map_err(|e| PolicyError::Pattern {
            name: def.name.clone(),
            pattern: def.pattern.clone(),
            reason: e.to_string(),
        })?;
        for (k, v) in &def.definition {
            if EXCHANGE_KEYS.contains(&k.as_str()) {
                if !v.is_string() {
                    return Err(PolicyError::Definition {
                        name: def.name.clone(),
                        reason: format!("'{k}' must be a string"),
                    });
                }
                continue;
            }
            if !KEYS.iter().any(|(key, _)| key == k) {
                return Err(PolicyError::Definition {
                    name: def.name.clone(),
                    reason: format!("'{k}' cannot be set by a policy"),
                });
            }
        }
        // The values must be valid queue arguments on their own.
        let mut probe = as_arguments(&def.definition);
        probe.retain(|k, _| {
            !EXCHANGE_KEYS
                .iter()
                .any(|e| k.strip_prefix("x-") == Some(*e))
        });
        if probe.contains_key("x-dead-letter-routing-key")
            && !probe.contains_key("x-dead-letter-exchange")
        {
            // A policy may set the routing key alone (for queues that name
            // their exchange): check its type only.
            probe.insert(
                "x-dead-letter-exchange".into(),
                Value::String(String::new()),
            );
        }
        QueueArgs::parse(&Value::Object(probe)).map_err(|e: ArgError| PolicyError::Definition {
            name: def.name.clone(),
            reason: e.to_string(),
        })?;
        Ok(Policy { def, pattern })
    }

    /// Whether it applies to the exchange `name`.
    pub fn matches_exchange(&self, name: &str) -> bool {
        self.def.apply_to != ApplyTo::Queues && self.pattern.is_match(name)
    }

    /// Whether it applies to the queue `name`.
    pub fn matches_queue(&self, name: &str) -> bool {
        self.def.apply_to != ApplyTo::Exchanges && self.pattern.is_match(name)
    }
}

fn as_arguments(definition: &Map<String, Value>) -> Map<String, Value> {
    definition
        .iter()
        .map(|(k, v)| (format!("x-{k}"), v.clone()))
        .collect()
}

/// The policy that applies to queue `name` among `policies`.
pub fn select<'a>(policies: &'a [Policy], name: &str) -> Option<&'a Policy> {
    policies
        .iter()
        .filter(|p| p.matches_queue(name))
        .max_by(|a, b| {
            a.def
                .priority
                .cmp(&b.def.priority)
                .then_with(|| a.def.name.cmp(&b.def.name))
        })
}

/// The policy that applies to exchange `name` among `policies`.
pub fn select_exchange<'a>(policies: &'a [Policy], name: &str) -> Option<&'a Policy> {
    policies
        .iter()
        .filter(|p| p.matches_exchange(name))
        .max_by(|a, b| {
            a.def
                .priority
                .cmp(&b.def.priority)
                .then_with(|| a.def.name.cmp(&b.def.name))
        })
}

/// A queue's declared arguments with `policy` merged under them (see the
/// module doc), ready for [`QueueArgs::parse`].
pub fn effective_arguments(declared: &Value, policy: Option<&Policy>) -> Value {
    let Some(policy) = policy else {
        return declared.clone();
    };
    let mut out = declared.as_object().cloned().unwrap_or_default();
    for (key, lower_wins) in KEYS {
        let Some(pv) = policy.def.definition.get(*key) else {
            continue;
        };
        let name = format!("x-{key}");
        match out.get(&name) {
            None | Some(Value::Null) => {
                out.insert(name, pv.clone());
            }
            Some(av) if *lower_wins => {
                // A negative limit means none (RabbitMQ 4's delivery-limit):
                // it never beats a real one, and a real one replaces it.
                if let (Some(a), Some(p)) = (av.as_i64(), pv.as_i64()) {
                    if p >= 0 && (a < 0 || p < a) {
                        out.insert(name, pv.clone());
                    }
                }
            }
            Some(_) => {}
        }
    }
    Value::Object(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn policy(name: &str, pattern: &str, priority: i32, def: Value) -> Policy {
        Policy::new(PolicyDef {
            name: name.into(),
            pattern: pattern.into(),
            apply_to: ApplyTo::Queues,
            priority,
            definition: def.as_object().cloned().unwrap_or_default(),
        })
        .expect("valid policy")
    }

    #[test]
    fn highest_priority_match_applies_and_arguments_merge_as_rabbitmq() {
        let ps = vec![
            policy("low", "^jobs\\.", 0, json!({"message-ttl": 100})),
            policy(
                "high",
                "^jobs\\.",
                5,
                json!({"message-ttl": 5000, "max-length": 10, "dead-letter-exchange": "pdlx"}),
            ),
        ];
        assert!(select(&ps, "other").is_none());
        let p = select(&ps, "jobs.a").expect("a match");
        assert_eq!(p.def.name, "high");
        let args = effective_arguments(
            &json!({"x-message-ttl": 1000, "x-max-length": 50, "x-dead-letter-exchange": "own"}),
            Some(p),
        );
        let q = QueueArgs::parse(&args).expect("valid");
        // Numeric limits: the lower wins; the rest: the argument wins.
        assert_eq!(q.message_ttl, Some(1000));
        assert_eq!(q.max_length, Some(10));
        assert_eq!(q.dead_letter_exchange.as_deref(), Some("own"));
    }

    #[test]
    fn bad_policies_are_refused() {
        let bad = |def: Value, pattern: &str| {
            Policy::new(PolicyDef {
                name: "p".into(),
                pattern: pattern.into(),
                apply_to: ApplyTo::All,
                priority: 0,
                definition: def.as_object().cloned().unwrap_or_default(),
            })
            .is_err()
        };
        assert!(bad(json!({"max-priority": 10}), ".*"), "max-priority");
        assert!(bad(json!({"message-ttl": "soon"}), ".*"), "type");
        assert!(bad(json!({"max-length": 1}), "("), "pattern");
        assert!(!bad(json!({"dead-letter-routing-key": "k"}), ".*"));
    }

    #[test]
    fn a_negative_delivery_limit_means_none_in_a_merge() {
        let p = policy("p", ".*", 0, json!({"delivery-limit": -1}));
        let merged = effective_arguments(&json!({"x-delivery-limit": 3}), Some(&p));
        assert_eq!(merged["x-delivery-limit"], json!(3), "-1 does not remove 3");
        let p = policy("p", ".*", 0, json!({"delivery-limit": 5}));
        let merged = effective_arguments(&json!({"x-delivery-limit": -1}), Some(&p));
        assert_eq!(merged["x-delivery-limit"], json!(5), "5 replaces none");
    }
}
