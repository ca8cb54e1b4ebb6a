//! Topic names and filters: validation and shared-subscription parsing.
//! Matching is the engine's (`weir_engine::topic`, with the topic
//! exchange's rules and the mapping between the two): this crate only
//! checks what arrives on the wire.
//!
//! Levels are separated by `/`; a level may be empty (`a//b` has three).
//! Filters may use `+` (exactly one level) and `#` (any number of levels,
//! including none, as the last level only); topic names may use neither.
//! Topics starting with `$` (`$SYS/...`) are not matched by a filter whose
//! first level is a wildcard (MQTT 5 4.7.2).

/// `$share/{group}/{filter}`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SharedFilter {
    /// The share name (non-empty, no `/`, `+` or `#`).
    pub group: String,
    /// The filter itself (validated like any other filter).
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

/// The prefix of a shared subscription filter.
const SHARE_PREFIX: &str = "$share/";

/// Checks a PUBLISH topic name: non-empty, no wildcard, no NUL, at most
/// `max_levels` levels.
pub fn validate_topic(topic: &str, max_levels: usize) -> Result<(), TopicError> {
    if topic.is_empty() {
        return Err(TopicError::Empty);
    }
    let mut levels = 1usize;
    for b in topic.bytes() {
        match b {
            b'+' | b'#' => return Err(TopicError::Wildcard),
            0 => return Err(TopicError::Null),
            b'/' => levels += 1,
            _ => {}
        }
    }
    if levels > max_levels {
        return Err(TopicError::TooManyLevels);
    }
    Ok(())
}

/// Checks a SUBSCRIBE (or UNSUBSCRIBE) filter; parses `$share/...`.
///
/// A shared filter needs a non-empty share name without wildcards and a
/// non-empty filter after it; the level limit applies to that filter.
pub fn validate_filter(
    filter: &str,
    max_levels: usize,
) -> Result<Option<SharedFilter>, TopicError> {
    if filter.is_empty() {
        return Err(TopicError::Empty);
    }
    if filter.as_bytes().contains(&0) {
        return Err(TopicError::Null);
    }
    if let Some(rest) = filter.strip_prefix(SHARE_PREFIX) {
        let Some((group, inner)) = rest.split_once('/') else {
            return Err(TopicError::BadShare);
        };
        if group.is_empty() || group.contains(['+', '#']) || inner.is_empty() {
            return Err(TopicError::BadShare);
        }
        check_filter_levels(inner, max_levels)?;
        return Ok(Some(SharedFilter {
            group: group.to_string(),
            filter: inner.to_string(),
        }));
    }
    check_filter_levels(filter, max_levels)?;
    Ok(None)
}

/// Wildcard placement and the level count of a (non-shared) filter.
fn check_filter_levels(filter: &str, max_levels: usize) -> Result<(), TopicError> {
    let mut levels = filter.split('/').peekable();
    let mut count = 0usize;
    while let Some(level) = levels.next() {
        count += 1;
        if level.contains('#') && (level != "#" || levels.peek().is_some()) {
            return Err(TopicError::BadWildcard);
        }
        if level.contains('+') && level != "+" {
            return Err(TopicError::BadWildcard);
        }
    }
    if count > max_levels {
        return Err(TopicError::TooManyLevels);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topics() {
        assert_eq!(validate_topic("a/b", 8), Ok(()));
        assert_eq!(validate_topic("a//b/", 8), Ok(()));
        assert_eq!(validate_topic("", 8), Err(TopicError::Empty));
        assert_eq!(validate_topic("a/+", 8), Err(TopicError::Wildcard));
        assert_eq!(validate_topic("a/#", 8), Err(TopicError::Wildcard));
        assert_eq!(validate_topic("a\0", 8), Err(TopicError::Null));
        assert_eq!(validate_topic("a/b/c", 2), Err(TopicError::TooManyLevels));
        assert_eq!(validate_topic("a/b", 2), Ok(()));
    }

    #[test]
    fn filters() {
        for ok in ["#", "+", "a/#", "+/+/#", "a/+/b", "/", "a//+", "$SYS/#"] {
            assert_eq!(validate_filter(ok, 8), Ok(None), "{ok}");
        }
        for bad in ["a#", "a/#/b", "#/a", "a+/b", "a/b+", "++"] {
            assert_eq!(
                validate_filter(bad, 8),
                Err(TopicError::BadWildcard),
                "{bad}"
            );
        }
        assert_eq!(validate_filter("", 8), Err(TopicError::Empty));
        assert_eq!(validate_filter("a\0/#", 8), Err(TopicError::Null));
        assert_eq!(validate_filter("a/b/c", 2), Err(TopicError::TooManyLevels));
    }

    #[test]
    fn shared() {
        assert_eq!(
            validate_filter("$share/g/a/+", 8),
            Ok(Some(SharedFilter {
                group: "g".into(),
                filter: "a/+".into()
            }))
        );
        for bad in [
            "$share/",
            "$share/g",
            "$share/g/",
            "$share//a",
            "$share/g+/a",
            "$share/#/a",
        ] {
            assert_eq!(validate_filter(bad, 8), Err(TopicError::BadShare), "{bad}");
        }
        assert_eq!(
            validate_filter("$share/g/a#", 8),
            Err(TopicError::BadWildcard)
        );
        // Levels counted on the filter after the share name.
        assert!(validate_filter("$share/g/a/b", 2).is_ok());
        // Not a share: just a filter whose first level is `$sharex`.
        assert_eq!(validate_filter("$sharex/a", 8), Ok(None));
    }
}
