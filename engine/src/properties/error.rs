//! Why header bytes could not be decoded or converted.

use super::{HeaderFormat, MAX_DEPTH};

/// Why header bytes could not be decoded or converted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PropertiesError {
    /// No bytes at all (not even the version).
    #[error("empty properties encoding")]
    Empty,
    /// A version this build does not know (written by a newer one).
    #[error("unknown properties encoding version {0}")]
    UnknownVersion(u8),
    /// A header-format byte that is no format (0).
    #[error("unknown header format {0}")]
    UnknownFormat(u8),
    /// No codec registered for a format the conversion needs (a format of a
    /// protocol this process does not serve).
    #[error("no codec registered for header format {0}")]
    NoCodec(HeaderFormat),
    /// A codec registered under a number another codec has.
    #[error("header format {0} is registered already")]
    FormatTaken(HeaderFormat),
    /// Ran off the end of the input.
    #[error("properties truncated")]
    Truncated,
    /// A length or integer that is overlong, overflows, or is not canonical.
    #[error("malformed variable-length integer")]
    BadVarint,
    /// A string that is not UTF-8.
    #[error("invalid UTF-8 in a string")]
    InvalidUtf8,
    /// A value type this build does not know.
    #[error("unknown value tag {0}")]
    UnknownTag(u8),
    /// A field whose value is out of range (names the field).
    #[error("invalid {0}")]
    Invalid(&'static str),
    /// Tables or arrays nested deeper than [`MAX_DEPTH`].
    #[error("tables or arrays nested deeper than {MAX_DEPTH}")]
    TooDeep,
    /// Bytes left after the last field.
    #[error("{0} trailing bytes after properties")]
    TrailingBytes(usize),
}
