//! Header formats and their codecs: the tag stored with each message's
//! header, the codec of each format, the set of codecs a conversion goes
//! through, and the cache that makes a fan-out convert once.

use bytes::Bytes;
use parking_lot::Mutex;
use std::sync::Arc;
use weir_backend::MessageId;

use super::{LazyLookup, Properties, PropertiesError, Table};

/// How a message's raw header bytes are encoded. Stored as one byte in the
/// store's records ([`HeaderFormat::to_u8`]); values are never reused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum HeaderFormat {
    /// AMQP 0-9-1's basic property block (flags, then values), as published.
    Amqp091 = 1,
    /// [`Properties`] in this module's encoding ([`Properties::encode`]).
    Weir = 2,
    /// An MQTT publish's QoS, retain flag and MQTT 5 properties, in the
    /// MQTT adapter's compact encoding (its codec lives in the gateway,
    /// `gateway/src/mqtt/convert.rs`).
    Mqtt = 3,
}

impl HeaderFormat {
    /// The byte stored for this format.
    pub fn to_u8(self) -> u8 {
        self as u8
    }

    /// The format stored as `b`, if known.
    pub fn from_u8(b: u8) -> Result<Self, PropertiesError> {
        match b {
            1 => Ok(HeaderFormat::Amqp091),
            2 => Ok(HeaderFormat::Weir),
            3 => Ok(HeaderFormat::Mqtt),
            other => Err(PropertiesError::UnknownFormat(other)),
        }
    }
}

impl TryFrom<u8> for HeaderFormat {
    type Error = PropertiesError;
    fn try_from(b: u8) -> Result<Self, PropertiesError> {
        HeaderFormat::from_u8(b)
    }
}

impl From<HeaderFormat> for u8 {
    fn from(f: HeaderFormat) -> u8 {
        f.to_u8()
    }
}

/// Decodes and encodes one format's raw header bytes. Implemented by the
/// adapter that owns the format (the engine knows only [`HeaderFormat::Weir`]).
pub trait HeaderCodec: Send + Sync {
    /// The format this codec reads and writes.
    fn format(&self) -> HeaderFormat;

    /// Raw bytes → [`Properties`].
    fn decode(&self, raw: &[u8]) -> Result<Properties, PropertiesError>;

    /// Only the headers table (for headers-exchange routing); codecs that can
    /// skip the other fields override this.
    fn headers(&self, raw: &[u8]) -> Result<Option<Table>, PropertiesError> {
        Ok(self.decode(raw)?.headers)
    }

    /// [`Properties`] → raw bytes, appended to `out`.
    fn encode(&self, properties: &Properties, out: &mut Vec<u8>) -> Result<(), PropertiesError>;
}

/// The codec of [`HeaderFormat::Weir`]: [`Properties::encode`]/[`Properties::decode`].
#[derive(Clone, Copy, Debug, Default)]
pub struct WeirCodec;

impl HeaderCodec for WeirCodec {
    fn format(&self) -> HeaderFormat {
        HeaderFormat::Weir
    }
    fn decode(&self, raw: &[u8]) -> Result<Properties, PropertiesError> {
        Properties::decode(raw)
    }
    fn encode(&self, properties: &Properties, out: &mut Vec<u8>) -> Result<(), PropertiesError> {
        properties.encode(out)
    }
}

/// The codecs available to convert between header formats: the engine's own
/// ([`WeirCodec`]) plus whatever the adapters register.
#[derive(Clone)]
pub struct HeaderCodecs {
    codecs: Vec<Arc<dyn HeaderCodec>>,
}

impl Default for HeaderCodecs {
    fn default() -> Self {
        HeaderCodecs::new()
    }
}

impl std::fmt::Debug for HeaderCodecs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.codecs.iter().map(|c| c.format()))
            .finish()
    }
}

impl HeaderCodecs {
    /// Only [`WeirCodec`].
    pub fn new() -> Self {
        HeaderCodecs {
            codecs: vec![Arc::new(WeirCodec)],
        }
    }

    /// Adds `codec`, replacing any codec registered for its format.
    pub fn with(mut self, codec: Arc<dyn HeaderCodec>) -> Self {
        self.codecs.retain(|c| c.format() != codec.format());
        self.codecs.push(codec);
        self
    }

    /// The codec for `format`.
    pub fn get(&self, format: HeaderFormat) -> Result<&dyn HeaderCodec, PropertiesError> {
        self.codecs
            .iter()
            .find(|c| c.format() == format)
            .map(|c| c.as_ref())
            .ok_or(PropertiesError::NoCodec(format))
    }

    /// Decodes `raw` of `format`.
    pub fn decode(&self, format: HeaderFormat, raw: &[u8]) -> Result<Properties, PropertiesError> {
        self.get(format)?.decode(raw)
    }

    /// `raw` of `format` as `target`: the same bytes (no copy) when the
    /// formats match, else decoded and re-encoded once.
    pub fn convert(
        &self,
        format: HeaderFormat,
        raw: &Bytes,
        target: HeaderFormat,
    ) -> Result<Bytes, PropertiesError> {
        if format == target {
            return Ok(raw.clone());
        }
        let target = self.get(target)?;
        let p = self.decode(format, raw)?;
        let mut out = Vec::with_capacity(raw.len() + 16);
        target.encode(&p, &mut out)?;
        Ok(Bytes::from(out))
    }
}

/// A message's raw header and its format: what the store keeps and what a
/// delivery carries. See the module doc for how `Message` holds it without
/// growing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MessageHeader {
    /// How `raw` is encoded.
    pub format: HeaderFormat,
    /// The encoded header.
    pub raw: Bytes,
}

impl MessageHeader {
    /// A header of `format`.
    pub fn new(format: HeaderFormat, raw: Bytes) -> Self {
        MessageHeader { format, raw }
    }

    /// `properties` in the engine's own format.
    pub fn from_properties(properties: &Properties) -> Result<Self, PropertiesError> {
        Ok(MessageHeader {
            format: HeaderFormat::Weir,
            raw: properties.to_bytes()?,
        })
    }

    /// The decoded properties (through the codec of this header's format).
    pub fn properties(&self, codecs: &HeaderCodecs) -> Result<Properties, PropertiesError> {
        codecs.decode(self.format, &self.raw)
    }

    /// The raw header as `target` expects it: the same bytes when the
    /// formats match (the AMQP → AMQP fast path), else converted.
    pub fn encode_as(
        &self,
        target: HeaderFormat,
        codecs: &HeaderCodecs,
    ) -> Result<Bytes, PropertiesError> {
        codecs.convert(self.format, &self.raw, target)
    }

    /// A header lookup for headers exchanges, decoding only if asked.
    pub fn lookup<'a>(&'a self, codecs: &'a HeaderCodecs) -> LazyLookup<'a> {
        LazyLookup::new(self.format, &self.raw, codecs)
    }
}

/// Converted headers of recently delivered messages, so a message fanned out
/// to many consumers of another protocol is converted once, not once per
/// consumer. Direct-mapped by (message id, target format): a fixed number of
/// slots, each one lock; a collision just converts again. Message ids are
/// never reused by a store, so a hit is always the same message.
pub struct ConversionCache {
    slots: Box<[Slot]>,
}

/// One cached conversion: message id, target format, converted bytes.
type Slot = Mutex<Option<(MessageId, HeaderFormat, Bytes)>>;

impl ConversionCache {
    /// A cache of `slots` entries (at least 1).
    pub fn new(slots: usize) -> Self {
        ConversionCache {
            slots: (0..slots.max(1)).map(|_| Mutex::new(None)).collect(),
        }
    }

    /// The header of message `id` (`raw` in `format`) as `target` expects it.
    /// Same format: `raw` itself, the cache is not touched.
    pub fn convert(
        &self,
        id: MessageId,
        format: HeaderFormat,
        raw: &Bytes,
        target: HeaderFormat,
        codecs: &HeaderCodecs,
    ) -> Result<Bytes, PropertiesError> {
        if format == target {
            return Ok(raw.clone());
        }
        // Consecutive ids spread over consecutive slots; the target format
        // offsets the slot so two targets of one message do not evict each other.
        let slot = &self.slots[(id as usize).wrapping_add(target as usize) % self.slots.len()];
        if let Some((i, t, b)) = &*slot.lock() {
            if *i == id && *t == target {
                return Ok(b.clone());
            }
        }
        // Converted outside the lock: a racing delivery converts too, harmlessly.
        let b = codecs.convert(format, raw, target)?;
        *slot.lock() = Some((id, target, b.clone()));
        Ok(b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_format_bytes_are_fixed() {
        assert_eq!(HeaderFormat::Amqp091.to_u8(), 1);
        assert_eq!(HeaderFormat::Weir.to_u8(), 2);
        assert_eq!(HeaderFormat::Mqtt.to_u8(), 3);
        for b in 0..=255u8 {
            match HeaderFormat::try_from(b) {
                Ok(f) => assert_eq!(f.to_u8(), b),
                Err(e) => assert_eq!(e, PropertiesError::UnknownFormat(b)),
            }
        }
        assert_eq!(std::mem::size_of::<HeaderFormat>(), 1);
    }

    /// A stand-in foreign codec: "raw" is the Weir encoding behind one byte.
    struct Prefixed;
    impl HeaderCodec for Prefixed {
        fn format(&self) -> HeaderFormat {
            HeaderFormat::Amqp091
        }
        fn decode(&self, raw: &[u8]) -> Result<Properties, PropertiesError> {
            Properties::decode(raw.get(1..).ok_or(PropertiesError::Truncated)?)
        }
        fn encode(&self, p: &Properties, out: &mut Vec<u8>) -> Result<(), PropertiesError> {
            out.push(0xee);
            p.encode(out)
        }
    }

    #[test]
    fn same_format_passes_through_and_others_convert_once() {
        let p = Properties {
            message_id: Some("m1".into()),
            ..Default::default()
        };
        let weir = MessageHeader::from_properties(&p).unwrap();
        // Without a codec for the target: a typed error.
        assert_eq!(
            weir.encode_as(HeaderFormat::Amqp091, &HeaderCodecs::new()),
            Err(PropertiesError::NoCodec(HeaderFormat::Amqp091))
        );
        let codecs = HeaderCodecs::new().with(Arc::new(Prefixed));
        let same = weir.encode_as(HeaderFormat::Weir, &codecs).unwrap();
        assert_eq!(same.as_ptr(), weir.raw.as_ptr(), "same format: no copy");
        let foreign = weir.encode_as(HeaderFormat::Amqp091, &codecs).unwrap();
        assert_eq!(foreign[0], 0xee);
        let back = MessageHeader::new(HeaderFormat::Amqp091, foreign);
        assert_eq!(back.properties(&codecs).unwrap(), p);

        let cache = ConversionCache::new(8);
        let a = cache
            .convert(
                7,
                HeaderFormat::Weir,
                &weir.raw,
                HeaderFormat::Amqp091,
                &codecs,
            )
            .unwrap();
        let b = cache
            .convert(
                7,
                HeaderFormat::Weir,
                &weir.raw,
                HeaderFormat::Amqp091,
                &codecs,
            )
            .unwrap();
        assert_eq!(
            a.as_ptr(),
            b.as_ptr(),
            "second delivery reuses the conversion"
        );
        let c = cache
            .convert(
                7,
                HeaderFormat::Weir,
                &weir.raw,
                HeaderFormat::Weir,
                &codecs,
            )
            .unwrap();
        assert_eq!(c.as_ptr(), weir.raw.as_ptr());
    }
}
