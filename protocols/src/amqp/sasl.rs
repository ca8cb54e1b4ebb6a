//! Decoding the SASL response of connection.start-ok (PLAIN and AMQPLAIN).
//!
//! This runs before authentication, on bytes anyone can send, so every
//! response is bounded in size and an AMQPLAIN table is walked by
//! [`depth::check_table_body`] before `amq-protocol`'s recursive table parser
//! sees it.

use super::depth::{self, DepthError};
use crate::Secret;
use amq_protocol::types::AMQPValue;

/// Longest response accepted (room for an OAuth 2 token used as a password;
/// far below anything that could hurt).
pub const MAX_RESPONSE: usize = 64 * 1024;

/// A user name and password taken from a response.
#[derive(Debug, PartialEq, Eq)]
pub struct Credentials {
    /// User name.
    pub username: String,
    /// Password (redacted in `Debug`).
    pub password: Secret,
}

/// Why a response was refused.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum SaslError {
    /// Neither PLAIN nor AMQPLAIN.
    #[error("unsupported mechanism")]
    UnsupportedMechanism,
    /// Longer than [`MAX_RESPONSE`].
    #[error("response of {0} bytes exceeds {MAX_RESPONSE}")]
    TooLong(usize),
    /// PLAIN: not `authzid NUL user NUL password`.
    #[error("PLAIN response is not authzid, user and password separated by NUL")]
    PlainShape,
    /// A user name or password that is not UTF-8.
    #[error("credentials are not UTF-8")]
    NotUtf8,
    /// AMQPLAIN: the table is too deep or cannot be walked.
    #[error("AMQPLAIN response: {0}")]
    Table(#[from] DepthError),
    /// AMQPLAIN: `amq-protocol` could not decode the table.
    #[error("AMQPLAIN response is not a field table")]
    TableDecode,
    /// AMQPLAIN: no string LOGIN or PASSWORD field.
    #[error("AMQPLAIN response lacks a LOGIN or PASSWORD string")]
    MissingField,
}

/// Decodes `response` for `mechanism`: PLAIN (`authzid\0user\0pass`) or
/// AMQPLAIN (a field table without its length prefix, with LOGIN and PASSWORD).
pub fn decode(mechanism: &str, response: &[u8]) -> Result<Credentials, SaslError> {
    if response.len() > MAX_RESPONSE {
        return Err(SaslError::TooLong(response.len()));
    }
    match mechanism {
        "PLAIN" => decode_plain(response),
        "AMQPLAIN" => decode_amqplain(response),
        _ => Err(SaslError::UnsupportedMechanism),
    }
}

fn decode_plain(response: &[u8]) -> Result<Credentials, SaslError> {
    let mut parts = response.split(|b| *b == 0);
    let (Some(_authzid), Some(user), Some(pass), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(SaslError::PlainShape);
    };
    Ok(Credentials {
        username: utf8(user)?,
        password: utf8(pass)?.into(),
    })
}

fn decode_amqplain(response: &[u8]) -> Result<Credentials, SaslError> {
    // The bound that keeps amq-protocol's recursion shallow.
    depth::check_table_body(response)?;
    let mut framed = Vec::with_capacity(response.len() + 4);
    // Cannot truncate: response.len() <= MAX_RESPONSE.
    framed.extend_from_slice(&(response.len() as u32).to_be_bytes());
    framed.extend_from_slice(response);
    let (_, table) = amq_protocol::types::parsing::parse_field_table(&framed[..])
        .map_err(|_| SaslError::TableDecode)?;
    let get = |k: &str| -> Result<String, SaslError> {
        match table.inner().get(k) {
            Some(AMQPValue::LongString(s)) => utf8(s.as_bytes()),
            Some(AMQPValue::ShortString(s)) => Ok(s.as_str().to_string()),
            _ => Err(SaslError::MissingField),
        }
    };
    Ok(Credentials {
        username: get("LOGIN")?,
        password: get("PASSWORD")?.into(),
    })
}

fn utf8(b: &[u8]) -> Result<String, SaslError> {
    String::from_utf8(b.to_vec()).map_err(|_| SaslError::NotUtf8)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// AMQPLAIN body: LOGIN and PASSWORD long strings, then `extra`.
    fn amqplain(login: &[u8], pass: &[u8], extra: &[u8]) -> Vec<u8> {
        let mut v = Vec::new();
        for (k, val) in [(&b"LOGIN"[..], login), (&b"PASSWORD"[..], pass)] {
            v.push(k.len() as u8);
            v.extend_from_slice(k);
            v.push(b'S');
            v.extend_from_slice(&(val.len() as u32).to_be_bytes());
            v.extend_from_slice(val);
        }
        v.extend_from_slice(extra);
        v
    }

    /// A table entry "k" holding arrays (`b'A'`) or tables (`b'F'`) nested `levels` deep.
    pub(crate) fn deep_entry(kind: u8, levels: usize) -> Vec<u8> {
        let mut v: Vec<u8> = vec![kind, 0, 0, 0, 0];
        for _ in 1..levels {
            let mut outer = vec![kind];
            let inner = if kind == b'F' {
                // A table's entries are key, value.
                let mut e = vec![1, b'k'];
                e.extend_from_slice(&v);
                e
            } else {
                v
            };
            outer.extend_from_slice(&(inner.len() as u32).to_be_bytes());
            outer.extend_from_slice(&inner);
            v = outer;
        }
        let mut e = vec![1, b'k'];
        e.extend_from_slice(&v);
        e
    }

    #[test]
    fn plain_and_amqplain_decode() {
        let want = Credentials {
            username: "guest".into(),
            password: "pw".into(),
        };
        assert_eq!(decode("PLAIN", b"\0guest\0pw"), Ok(want));
        let got = decode("AMQPLAIN", &amqplain(b"u", b"p", &[])).expect("decodes");
        assert_eq!((got.username.as_str(), got.password.expose()), ("u", "p"));
    }

    #[test]
    fn plain_responses_of_odd_shapes_and_sizes_are_refused() {
        for bad in [
            &b""[..],
            b"\0",
            b"guest",
            b"\0\0\0",
            b"a\0b\0c\0d",
            b"\0\xff\xfe\0pw",
        ] {
            assert!(decode("PLAIN", bad).is_err(), "{bad:?}");
        }
        // Empty user and password are well-formed (authentication refuses them).
        assert!(decode("PLAIN", b"\0\0").is_ok());
        let mut huge = b"\0user\0".to_vec();
        huge.resize(MAX_RESPONSE + 1, b'p');
        assert_eq!(
            decode("PLAIN", &huge),
            Err(SaslError::TooLong(MAX_RESPONSE + 1))
        );
        let mut big = b"\0user\0".to_vec();
        big.resize(MAX_RESPONSE, b'p');
        assert_eq!(
            decode("PLAIN", &big).map(|c| c.password.len()),
            Ok(MAX_RESPONSE - 6)
        );
    }

    #[test]
    fn deep_amqplain_responses_are_refused_before_parsing() {
        // Finding 0 of issue 5: ~2,100 nested arrays or ~1,400 nested tables
        // overflowed a runtime thread's stack in amq-protocol's parser.
        for (kind, levels) in [(b'A', 2_100), (b'F', 1_400), (b'A', 10_000)] {
            let resp = amqplain(b"u", b"p", &deep_entry(kind, levels));
            assert_eq!(
                decode("AMQPLAIN", &resp),
                Err(SaslError::Table(DepthError::TooDeep)),
                "{} levels of {}",
                levels,
                kind as char
            );
        }
        // Shallow nesting is fine.
        let resp = amqplain(b"u", b"p", &deep_entry(b'A', 5));
        assert!(decode("AMQPLAIN", &resp).is_ok());
    }

    #[test]
    fn malformed_amqplain_is_refused() {
        let ok = amqplain(b"u", b"p", &[]);
        for cut in 0..ok.len() {
            assert!(decode("AMQPLAIN", &ok[..cut]).is_err());
        }
        assert_eq!(
            decode("AMQPLAIN", &amqplain(b"u", b"\xff", &[])),
            Err(SaslError::NotUtf8)
        );
        assert_eq!(
            decode("AMQPLAIN", &[1, b'k', b'V']),
            Err(SaslError::MissingField)
        );
        assert_eq!(
            decode("EXTERNAL", b""),
            Err(SaslError::UnsupportedMechanism)
        );
    }
}
