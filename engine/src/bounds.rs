//! Size limits of definitions: names, arguments, policy definitions,
//! binding keys, user tags. Every definition is kept in memory and in the
//! store's metadata (and in every checkpoint of it), so none may be as
//! large as a client cares to send: without these bounds, 200 queues with
//! 1.9 MB of arguments each kept 731 MB of memory and a 380 MB checkpoint.
//!
//! Checked by the engine calls that create definitions, so every protocol,
//! the management API and definitions import meet the same limits. A
//! violation is [`EngineError::PreconditionFailed`] (AMQP 406, HTTP 400).
//! AMQP cannot even send most of them (its names and keys are short
//! strings of at most 255 bytes); the bounds are generous for real use.

use crate::error::{EngineError, Result};
use serde_json::Value;

/// Longest name of a queue, exchange, policy, vhost or user, in bytes
/// (AMQP's short-string limit).
pub const MAX_NAME_BYTES: usize = 255;

/// Largest argument table of a queue, exchange or binding, or policy
/// definition, in bytes of its JSON encoding.
pub const MAX_ARGUMENTS_BYTES: usize = 16 * 1024;

/// Most entries in an argument table or policy definition (top level).
pub const MAX_ARGUMENT_ENTRIES: usize = 128;

/// Longest binding key (MQTT topic filters, which become binding keys,
/// may be this long; AMQP keys are at most 255 bytes).
pub const MAX_BINDING_KEY_BYTES: usize = 65_535;

/// Longest policy pattern or permission regular expression, in bytes.
pub const MAX_PATTERN_BYTES: usize = 4096;

/// Most tags of a user.
pub const MAX_USER_TAGS: usize = 32;

fn refused(msg: String) -> EngineError {
    EngineError::PreconditionFailed(msg)
}

/// `s` cut to a printable length for an error text (a name can be huge
/// over HTTP; the error should not echo it whole).
fn short(s: &str) -> String {
    const SHOW: usize = 64;
    if s.len() <= SHOW {
        return s.to_string();
    }
    let mut end = SHOW;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

/// A name of a `what` ("queue", "exchange", …) is at most
/// [`MAX_NAME_BYTES`].
pub fn check_name(what: &str, name: &str) -> Result<()> {
    if name.len() > MAX_NAME_BYTES {
        return Err(refused(format!(
            "{what} name '{}' is {} bytes long: at most {MAX_NAME_BYTES}",
            short(name),
            name.len()
        )));
    }
    Ok(())
}

/// A pattern or regular expression (`what`) is at most
/// [`MAX_PATTERN_BYTES`].
pub fn check_pattern(what: &str, pattern: &str) -> Result<()> {
    if pattern.len() > MAX_PATTERN_BYTES {
        return Err(refused(format!(
            "{what} '{}' is {} bytes long: at most {MAX_PATTERN_BYTES}",
            short(pattern),
            pattern.len()
        )));
    }
    Ok(())
}

/// A binding key is at most [`MAX_BINDING_KEY_BYTES`].
pub fn check_binding_key(key: &str) -> Result<()> {
    if key.len() > MAX_BINDING_KEY_BYTES {
        return Err(refused(format!(
            "binding key '{}' is {} bytes long: at most {MAX_BINDING_KEY_BYTES}",
            short(key),
            key.len()
        )));
    }
    Ok(())
}

/// Counts JSON bytes and stops the encoder past the limit, so a huge
/// table is neither copied nor walked to its end.
struct Counter {
    n: usize,
}

impl std::io::Write for Counter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.n += buf.len();
        if self.n > MAX_ARGUMENTS_BYTES {
            return Err(std::io::Error::other("too large"));
        }
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// `args` (the arguments or definition of `what`, e.g. "queue 'q' in
/// vhost '/'") has at most [`MAX_ARGUMENT_ENTRIES`] entries and encodes
/// to at most [`MAX_ARGUMENTS_BYTES`] of JSON.
pub fn check_arguments(what: &dyn std::fmt::Display, args: &Value) -> Result<()> {
    if let Value::Object(m) = args {
        if m.len() > MAX_ARGUMENT_ENTRIES {
            return Err(refused(format!(
                "arguments of {what} have {} entries: at most {MAX_ARGUMENT_ENTRIES}",
                m.len()
            )));
        }
    }
    let mut c = Counter { n: 0 };
    if serde_json::to_writer(&mut c, args).is_err() {
        return Err(refused(format!(
            "arguments of {what} take more than {MAX_ARGUMENTS_BYTES} bytes"
        )));
    }
    Ok(())
}

/// A user's tags: at most [`MAX_USER_TAGS`], each a name.
pub fn check_tags(user: &str, tags: &[String]) -> Result<()> {
    if tags.len() > MAX_USER_TAGS {
        return Err(refused(format!(
            "user '{}' has {} tags: at most {MAX_USER_TAGS}",
            short(user),
            tags.len()
        )));
    }
    for t in tags {
        check_name("tag", t)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn names_arguments_and_tags_are_bounded() {
        assert!(check_name("queue", &"q".repeat(255)).is_ok());
        let e = check_name("queue", &"q".repeat(256)).unwrap_err();
        assert!(e.to_string().contains("256 bytes long: at most 255"), "{e}");
        assert!(e.to_string().len() < 200, "the name is not echoed whole");
        assert!(check_arguments(&"queue 'q'", &json!({"x-max-length": 10})).is_ok());
        let big = json!({ "x-big": "a".repeat(MAX_ARGUMENTS_BYTES) });
        let e = check_arguments(&"queue 'q'", &big).unwrap_err();
        assert!(e.to_string().contains("more than 16384 bytes"), "{e}");
        let many: serde_json::Map<String, Value> = (0..=MAX_ARGUMENT_ENTRIES)
            .map(|i| (format!("k{i}"), json!(1)))
            .collect();
        let e = check_arguments(&"queue 'q'", &Value::Object(many)).unwrap_err();
        assert!(e.to_string().contains("129 entries"), "{e}");
        assert!(check_tags("u", &vec!["t".into(); 33]).is_err());
        assert!(check_tags("u", &["administrator".into()]).is_ok());
        assert!(check_binding_key(&"k".repeat(65_536)).is_err());
        // A multi-byte character at the cut is not split.
        let e = check_name("queue", &"é".repeat(200)).unwrap_err();
        assert!(e.to_string().contains('…'));
    }
}
