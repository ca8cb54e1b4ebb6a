//! Per-connection quota overrides (`[[quota.connections]]`): rules matched
//! by the login name and/or the connection's own name (AMQP's
//! `connection_name` client property, MQTT's client id), giving matching
//! connections their own publish rates and channel limit.
//!
//! * **Rates** are per connection: each matching connection gets its own
//!   limiter, checked on top of its tenant's and user's shared ones (the
//!   tightest one paces it). A rule can single out, say, every `sensor-*`
//!   client at 10 msg/s, whatever the tenant allows in total.
//! * **`max-channels-per-connection`** replaces the tenant's and user's
//!   value for matching connections, lower or higher: a known connection
//!   pool may open more channels than the tenant's default.
//!
//! The first rule that matches applies; a rule without patterns matches
//! every connection. Patterns are regular expressions matched against the
//! whole name.

use crate::rate::Rate;
use regex::Regex;
use std::sync::{Arc, RwLock};

/// One rule. Built from the configuration.
#[derive(Debug)]
pub struct ConnectionRule {
    user: Option<Regex>,
    name: Option<Regex>,
    /// Messages per second of one matching connection.
    pub publish_rate: Option<u32>,
    /// Bytes per second of one matching connection.
    pub publish_bytes_rate: Option<u32>,
    /// Channels open at once on a matching AMQP connection (replaces the
    /// tenant's and user's limit).
    pub max_channels_per_connection: Option<u32>,
}

/// A pattern of a rule does not compile.
#[derive(Debug, thiserror::Error)]
#[error("invalid pattern '{pattern}': {source}")]
pub struct PatternError {
    /// The pattern as written.
    pub pattern: String,
    /// Why.
    #[source]
    pub source: regex::Error,
}

fn whole(pattern: &str) -> Result<Regex, PatternError> {
    Regex::new(&format!("^(?:{pattern})$")).map_err(|source| PatternError {
        pattern: pattern.into(),
        source,
    })
}

impl ConnectionRule {
    /// A rule for connections whose login name matches `user` and whose
    /// own name matches `name` (each whole; `None` matches anything).
    pub fn new(
        user: Option<&str>,
        name: Option<&str>,
        publish_rate: Option<u32>,
        publish_bytes_rate: Option<u32>,
        max_channels_per_connection: Option<u32>,
    ) -> Result<Self, PatternError> {
        Ok(ConnectionRule {
            user: user.map(whole).transpose()?,
            name: name.map(whole).transpose()?,
            publish_rate,
            publish_bytes_rate,
            max_channels_per_connection,
        })
    }

    /// Whether a connection of `user` named `name` is covered. A rule with
    /// a name pattern never covers a connection without a name.
    pub fn matches(&self, user: &str, name: Option<&str>) -> bool {
        self.user.as_ref().is_none_or(|r| r.is_match(user))
            && match (&self.name, name) {
                (None, _) => true,
                (Some(r), Some(n)) => r.is_match(n),
                (Some(_), None) => false,
            }
    }

    /// A new limiter for one matching connection; `None` without a rate.
    pub fn rate(&self) -> Option<Arc<Rate>> {
        (self.publish_rate.is_some() || self.publish_bytes_rate.is_some())
            .then(|| Arc::new(Rate::new(self.publish_rate, self.publish_bytes_rate)))
    }
}

/// The configured rules, in order.
#[derive(Debug, Default)]
pub struct ConnectionQuotas {
    rules: RwLock<Vec<Arc<ConnectionRule>>>,
}

impl ConnectionQuotas {
    /// Replaces the rules (connections opened from now on see them).
    pub fn set(&self, rules: Vec<ConnectionRule>) {
        let rules = rules.into_iter().map(Arc::new).collect();
        match self.rules.write() {
            Ok(mut g) => *g = rules,
            Err(p) => *p.into_inner() = rules,
        }
    }

    /// The first rule covering a connection of `user` named `name`.
    pub fn find(&self, user: &str, name: Option<&str>) -> Option<Arc<ConnectionRule>> {
        let rules = match self.rules.read() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        if rules.is_empty() {
            return None;
        }
        rules.iter().find(|r| r.matches(user, name)).cloned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_matching_rule_applies_and_patterns_match_whole_names() {
        let q = ConnectionQuotas::default();
        q.set(vec![
            ConnectionRule::new(None, Some("sensor-.*"), Some(10), None, None).unwrap(),
            ConnectionRule::new(Some("loader"), None, None, None, Some(500)).unwrap(),
        ]);
        let r = q.find("anyone", Some("sensor-7")).unwrap();
        assert_eq!(r.publish_rate, Some(10));
        assert!(r.rate().is_some());
        // Whole names only, and a name rule needs a name.
        assert!(q.find("anyone", Some("a-sensor-7")).is_none());
        assert!(q.find("anyone", None).is_none());
        let r = q.find("loader", None).unwrap();
        assert_eq!(r.max_channels_per_connection, Some(500));
        assert!(r.rate().is_none());
        assert!(q.find("loaders", None).is_none());
        // A rule without patterns covers everyone.
        q.set(vec![
            ConnectionRule::new(None, None, Some(1), None, None).unwrap()
        ]);
        assert!(q.find("x", None).is_some());
    }

    #[test]
    fn a_bad_pattern_is_refused_naming_it() {
        let e = ConnectionRule::new(Some("(unclosed"), None, None, None, None).unwrap_err();
        assert!(e.to_string().contains("'(unclosed'"), "{e}");
    }
}
