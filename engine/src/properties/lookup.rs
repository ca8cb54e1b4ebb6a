//! Header lookup, the one way routing sees a message's headers (headers
//! exchanges, sender-selected distribution, deduplication, delays), whatever
//! protocol published it: the engine's routing asks a [`HeaderLookup`]; the
//! adapters hand it a [`LazyLookup`] over the raw header they already own
//! (decoded through its format's codec only if something asks), or
//! [`NoHeaders`].

use serde_json::Value as Json;
use std::cell::OnceCell;

use super::{HeaderCodec, HeaderCodecs, HeaderFormat, Properties, Table, Value};

/// What routing needs to see of a message's headers.
pub trait HeaderLookup {
    /// The header `name` as a JSON value, if present.
    fn header(&self, name: &str) -> Option<Json>;

    /// Whether the headers may hold `name`: a cheap check before
    /// [`Self::header`] parses anything, for headers looked up on every
    /// publish (`CC`, `BCC`). False only when certainly absent.
    fn may_have(&self, _name: &str) -> bool {
        true
    }
}

/// A message without headers, or whose headers routing does not look at
/// (MQTT publishes: their user properties are not routing headers).
#[derive(Clone, Copy, Debug, Default)]
pub struct NoHeaders;

impl HeaderLookup for NoHeaders {
    fn header(&self, _name: &str) -> Option<Json> {
        None
    }
    fn may_have(&self, _name: &str) -> bool {
        false
    }
}

impl HeaderLookup for Properties {
    fn header(&self, name: &str) -> Option<Json> {
        self.headers.as_ref()?.get(name).map(Value::to_json)
    }
}

/// The headers of a raw header of any format, decoded (headers table only)
/// through its format's codec the first time something asks, at most once;
/// most routes never look. An undecodable header, or one of a format without
/// a codec, has no headers.
pub struct LazyLookup<'a> {
    codec: Option<&'a dyn HeaderCodec>,
    raw: &'a [u8],
    parsed: OnceCell<Option<Table>>,
}

impl<'a> LazyLookup<'a> {
    /// The headers of `raw`, encoded as `format` (its codec found in `codecs`).
    pub fn new(format: HeaderFormat, raw: &'a [u8], codecs: &'a HeaderCodecs) -> Self {
        LazyLookup::with_codec(codecs.get(format).ok(), raw)
    }

    /// The headers of `raw`, encoded in `codec`'s format: for an adapter
    /// publishing in its own format (no registry lookup on the publish path).
    pub fn with_codec(codec: Option<&'a dyn HeaderCodec>, raw: &'a [u8]) -> Self {
        LazyLookup {
            codec,
            raw,
            parsed: OnceCell::new(),
        }
    }
}

impl HeaderLookup for LazyLookup<'_> {
    fn header(&self, name: &str) -> Option<Json> {
        self.parsed
            .get_or_init(|| self.codec?.headers(self.raw).ok().flatten())
            .as_ref()?
            .get(name)
            .map(Value::to_json)
    }

    fn may_have(&self, name: &str) -> bool {
        self.codec.is_some_and(|c| c.may_have(self.raw, name))
    }
}

#[cfg(test)]
mod tests {
    use super::super::MessageHeader;
    use super::*;
    use bytes::Bytes;

    #[test]
    fn header_lookup_takes_the_last_repeat_and_collapses_to_json() {
        let mut t = Table::new();
        t.push("a", Value::String("first".into()));
        t.push("n", Value::U8(7));
        t.push("a", Value::String("second".into()));
        t.push("f", Value::F64(f64::NAN));
        t.push(
            "d",
            Value::Decimal {
                scale: 2,
                value: 150,
            },
        );
        t.push("x", Value::Bytes(b"hi".to_vec()));
        let p = Properties {
            headers: Some(t),
            ..Default::default()
        };
        assert_eq!(p.header("a"), Some(serde_json::json!("second")));
        assert_eq!(p.header("n"), Some(serde_json::json!(7)));
        assert_eq!(p.header("f"), Some(serde_json::Value::Null));
        assert_eq!(p.header("d"), Some(serde_json::json!(1.5)));
        assert_eq!(p.header("x"), Some(serde_json::json!("hi")));
        assert_eq!(p.header("missing"), None);
        // Through the lazy lookup of a stored header too.
        let codecs = HeaderCodecs::new();
        let h = MessageHeader::from_properties(&p).unwrap();
        assert_eq!(
            h.lookup(&codecs).header("a"),
            Some(serde_json::json!("second"))
        );
        let garbage = MessageHeader::new(HeaderFormat::WEIR, Bytes::from_static(&[1, 4]));
        assert_eq!(garbage.lookup(&codecs).header("a"), None);
        // A format without a codec: no headers, and certainly not `CC`.
        let unknown = MessageHeader::new(HeaderFormat::new(250), h.raw.clone());
        assert_eq!(unknown.lookup(&codecs).header("a"), None);
        assert!(!unknown.lookup(&codecs).may_have("CC"));
        assert!(!NoHeaders.may_have("CC"));
    }
}
