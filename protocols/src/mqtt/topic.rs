//! Topic names and filters: validation, shared-subscription parsing,
//! matching.
//!
//! CONTRACT SKELETON (issue 8).

/// `$share/{group}/{filter}`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SharedFilter {
    pub group: String,
    pub filter: String,
}

/// Why a topic name or filter is refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TopicError {
    #[error("empty")]
    Empty,
    #[error("wildcard in a topic name")]
    Wildcard,
    #[error("misplaced wildcard")]
    BadWildcard,
    #[error("null character")]
    Null,
    #[error("too many levels")]
    TooManyLevels,
    #[error("malformed shared subscription")]
    BadShare,
}

/// Checks a PUBLISH topic name.
pub fn validate_topic(topic: &str, max_levels: usize) -> Result<(), TopicError> {
    let _ = (topic, max_levels);
    todo!()
}

/// Checks a SUBSCRIBE filter; parses `$share/...`.
pub fn validate_filter(
    filter: &str,
    max_levels: usize,
) -> Result<Option<SharedFilter>, TopicError> {
    let _ = (filter, max_levels);
    todo!()
}

/// Whether `filter` matches `topic` (the `$` rule: a filter starting with a
/// wildcard does not match a topic starting with `$`).
pub fn matches(filter: &str, topic: &str) -> bool {
    let _ = (filter, topic);
    todo!()
}
