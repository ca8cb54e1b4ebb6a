//! A credential that must not end up in logs.

use std::fmt;
use std::ops::Deref;

/// A password (or token) a client sent. Its `Debug` and `Display` print
/// `<redacted>`, so an event or error formatted with `{:?}` cannot leak it;
/// read it with [`Secret::expose`] (or through `Deref<Target = str>`, so
/// `&secret` passes where a `&str` is wanted).
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// Wraps a secret value.
    pub fn new(value: String) -> Self {
        Secret(value)
    }

    /// The secret itself, for the one place that checks it.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// The same as [`Self::expose`].
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl Deref for Secret {
    type Target = str;

    fn deref(&self) -> &str {
        &self.0
    }
}

impl From<String> for Secret {
    fn from(value: String) -> Self {
        Secret(value)
    }
}

impl From<&str> for Secret {
    fn from(value: &str) -> Self {
        Secret(value.to_string())
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<redacted>")
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<redacted>")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_and_display_hide_the_value_and_expose_returns_it() {
        let s = Secret::from("hunter2");
        assert_eq!(format!("{s:?}"), "<redacted>");
        assert_eq!(format!("{s}"), "<redacted>");
        assert_eq!(s.expose(), "hunter2");
        let as_str: &str = &s;
        assert_eq!(as_str, "hunter2");
    }
}
