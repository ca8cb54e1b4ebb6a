//! Header lookup: what routing (headers exchanges, sender-selected
//! distribution, deduplication, delays) sees of a message's headers.

use std::cell::OnceCell;

use super::{HeaderCodecs, HeaderFormat, Properties, Table, Value};
use crate::exchange::HeaderLookup;

impl HeaderLookup for Properties {
    fn header(&self, name: &str) -> Option<serde_json::Value> {
        self.headers.as_ref()?.get(name).map(Value::to_json)
    }
}

/// Headers of a raw header of any format, decoded (headers table only) the
/// first time a headers exchange asks, at most once; most routes never look.
/// An undecodable header has no headers.
pub struct LazyLookup<'a> {
    format: HeaderFormat,
    raw: &'a [u8],
    codecs: &'a HeaderCodecs,
    parsed: OnceCell<Option<Table>>,
}

impl<'a> LazyLookup<'a> {
    /// The headers of `raw`, encoded as `format`.
    pub fn new(format: HeaderFormat, raw: &'a [u8], codecs: &'a HeaderCodecs) -> Self {
        LazyLookup {
            format,
            raw,
            codecs,
            parsed: OnceCell::new(),
        }
    }
}

impl HeaderLookup for LazyLookup<'_> {
    fn header(&self, name: &str) -> Option<serde_json::Value> {
        self.parsed
            .get_or_init(|| {
                self.codecs
                    .get(self.format)
                    .and_then(|c| c.headers(self.raw))
                    .ok()
                    .flatten()
            })
            .as_ref()?
            .get(name)
            .map(Value::to_json)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use super::super::MessageHeader;
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
        let garbage = MessageHeader::new(HeaderFormat::Weir, Bytes::from_static(&[1, 4]));
        assert_eq!(garbage.lookup(&codecs).header("a"), None);
    }

}
