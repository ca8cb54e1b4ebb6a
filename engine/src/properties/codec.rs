//! Header formats and their codecs: the tag stored with each message's
//! header, the codec of each format, the set of codecs a conversion goes
//! through, and the cache that makes a fan-out convert once.

use bytes::Bytes;
use parking_lot::Mutex;
use std::sync::{Arc, OnceLock};
use weir_backend::MessageId;

use super::{LazyLookup, Properties, PropertiesError, Table};

/// A header format's number: how a message's raw header bytes are encoded.
/// Stored as one byte with every message ([`HeaderFormat::to_u8`]), so a
/// number, once given to a format, is never given to another (not even after
/// its protocol is removed: stored messages keep their number).
///
/// The set is open. The engine names only its own format
/// ([`HeaderFormat::WEIR`]); an adapter names its format as a constant next to
/// its [`HeaderCodec`], and the gateway's composition root registers that codec
/// under it ([`HeaderCodecs::register`]). Numbers given so far: 1 AMQP 0-9-1,
/// 2 Weir, 3 MQTT (the list lives with the registration, in the gateway's
/// `header_codecs.rs`). 0 is no format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct HeaderFormat(u8);

impl HeaderFormat {
    /// [`Properties`] in the engine's own encoding ([`Properties::encode`]):
    /// what the HTTP API publishes, and what any protocol without a header
    /// block worth keeping can use.
    pub const WEIR: HeaderFormat = HeaderFormat(2);

    /// The format numbered `n`, for an adapter's constant. `n` must not be 0
    /// (checked when the constant is evaluated, at compile time); a byte read
    /// from the store goes through [`HeaderFormat::from_u8`] instead.
    pub const fn new(n: u8) -> Self {
        assert!(n != 0, "header format 0 is reserved (no format)");
        HeaderFormat(n)
    }

    /// The byte stored for this format.
    pub fn to_u8(self) -> u8 {
        self.0
    }

    /// The format stored as `b`. Any number but 0 is a format; whether a
    /// codec for it is registered is the registry's question
    /// ([`HeaderCodecs::get`]): a message of a format this process has no
    /// codec for is kept and delivered as bytes, and only converting it fails
    /// ([`PropertiesError::NoCodec`]).
    pub fn from_u8(b: u8) -> Result<Self, PropertiesError> {
        match b {
            0 => Err(PropertiesError::UnknownFormat(0)),
            n => Ok(HeaderFormat(n)),
        }
    }
}

impl std::fmt::Display for HeaderFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
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

/// Decodes and encodes one format's raw header bytes: the format's bytes to
/// and from the engine's [`Properties`]. Implemented by the adapter that owns
/// the format (the engine implements only [`HeaderFormat::WEIR`]'s,
/// [`WeirCodec`]) and registered under the format's number in a
/// [`HeaderCodecs`]; every conversion between two formats decodes with one
/// codec and encodes with the other, so no codec knows any other format.
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

    /// Whether the headers of `raw` may hold `name`, without decoding: a
    /// cheap check for headers looked up on every publish (`CC`, `BCC`,
    /// [`HeaderLookup::may_have`](super::HeaderLookup::may_have)). False only
    /// when certainly absent; codecs that cannot tell cheaply keep this default.
    fn may_have(&self, _raw: &[u8], _name: &str) -> bool {
        true
    }

    /// [`Properties`] → raw bytes, appended to `out`.
    fn encode(&self, properties: &Properties, out: &mut Vec<u8>) -> Result<(), PropertiesError>;
}

/// The codec of [`HeaderFormat::WEIR`]: [`Properties::encode`]/[`Properties::decode`].
#[derive(Clone, Copy, Debug, Default)]
pub struct WeirCodec;

impl HeaderCodec for WeirCodec {
    fn format(&self) -> HeaderFormat {
        HeaderFormat::WEIR
    }
    fn decode(&self, raw: &[u8]) -> Result<Properties, PropertiesError> {
        Properties::decode(raw)
    }
    fn encode(&self, properties: &Properties, out: &mut Vec<u8>) -> Result<(), PropertiesError> {
        properties.encode(out)
    }
}

/// The header-codec registry: one [`HeaderCodec`] per format number, the
/// engine's own ([`WeirCodec`]) plus those the gateway's composition root
/// registers for its protocols. Every conversion of a header from one format
/// to another goes through it, so neither the engine nor an adapter matches
/// on another protocol's format. Built once at startup, then shared
/// read-only (the engine holds it, `Engine::set_codecs`).
///
/// It also caches recent conversions (see [`HeaderCodecs::convert_cached`]):
/// one cache per registry, so two engines in one process never share
/// entries (message ids are unique per store only).
pub struct HeaderCodecs {
    codecs: Vec<Arc<dyn HeaderCodec>>,
    /// Allocated at the first cached conversion (most registries of a test
    /// never convert).
    cache: OnceLock<ConversionCache>,
}

/// Slots of a registry's conversion cache: enough for the deliveries of a
/// few batches of a fan-out in flight at once.
const CACHE_SLOTS: usize = 1024;

impl Default for HeaderCodecs {
    fn default() -> Self {
        HeaderCodecs::new()
    }
}

impl std::fmt::Debug for HeaderCodecs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.formats()).finish()
    }
}

impl HeaderCodecs {
    /// Only [`WeirCodec`].
    pub fn new() -> Self {
        HeaderCodecs {
            codecs: vec![Arc::new(WeirCodec)],
            cache: OnceLock::new(),
        }
    }

    /// Adds `codec` under its format's number. A number registered already
    /// is refused ([`PropertiesError::FormatTaken`]): two protocols cannot
    /// share a number, and the engine's own cannot be replaced.
    pub fn register(mut self, codec: Arc<dyn HeaderCodec>) -> Result<Self, PropertiesError> {
        let format = codec.format();
        if self.codecs.iter().any(|c| c.format() == format) {
            return Err(PropertiesError::FormatTaken(format));
        }
        self.codecs.push(codec);
        Ok(self)
    }

    /// The registered format numbers, in registration order.
    pub fn formats(&self) -> impl Iterator<Item = HeaderFormat> + '_ {
        self.codecs.iter().map(|c| c.format())
    }

    /// The codec for `format`; [`PropertiesError::NoCodec`] when none is
    /// registered (a format of a protocol this build or configuration does
    /// not serve).
    pub fn get(&self, format: HeaderFormat) -> Result<&dyn HeaderCodec, PropertiesError> {
        // A handful of codecs: a scan is as fast as any map.
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
    /// formats match, else decoded by `format`'s codec and encoded once by
    /// `target`'s.
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

    /// [`HeaderCodecs::convert`] for the header of message `id`, cached: a
    /// message fanned out to many consumers of another protocol converts
    /// once, at its first delivery, not once per consumer. Same format: `raw`
    /// itself, the cache is not touched.
    pub fn convert_cached(
        &self,
        id: MessageId,
        format: HeaderFormat,
        raw: &Bytes,
        target: HeaderFormat,
    ) -> Result<Bytes, PropertiesError> {
        if format == target {
            return Ok(raw.clone());
        }
        self.cache
            .get_or_init(|| ConversionCache::new(CACHE_SLOTS))
            .convert(id, format, raw, target, self)
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
            format: HeaderFormat::WEIR,
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

/// Converted headers of recently delivered messages (a registry's, see
/// [`HeaderCodecs::convert_cached`]). Direct-mapped by (message id, target format): a fixed number of
/// slots, each one lock; a collision just converts again. Message ids are
/// never reused by a store, so a hit is always the same message.
struct ConversionCache {
    slots: Box<[Slot]>,
}

/// One cached conversion: message id, target format, converted bytes.
type Slot = Mutex<Option<(MessageId, HeaderFormat, Bytes)>>;

impl ConversionCache {
    /// A cache of `slots` entries (at least 1).
    fn new(slots: usize) -> Self {
        ConversionCache {
            slots: (0..slots.max(1)).map(|_| Mutex::new(None)).collect(),
        }
    }

    /// The header of message `id` (`raw` in `format`) as `target` expects it.
    fn convert(
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
        let slot =
            &self.slots[(id as usize).wrapping_add(usize::from(target.0)) % self.slots.len()];
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

    /// A foreign format for these tests (the engine names no other).
    const FOREIGN: HeaderFormat = HeaderFormat::new(200);

    #[test]
    fn a_format_is_its_stored_byte_and_zero_is_none() {
        assert_eq!(HeaderFormat::WEIR.to_u8(), 2, "stored data reads back");
        for b in 0..=255u8 {
            match HeaderFormat::try_from(b) {
                Ok(f) => assert_eq!(f.to_u8(), b),
                Err(e) => assert_eq!((b, e), (0, PropertiesError::UnknownFormat(0))),
            }
        }
        assert_eq!(std::mem::size_of::<HeaderFormat>(), 1);
        assert_eq!(
            PropertiesError::NoCodec(FOREIGN).to_string(),
            "no codec registered for header format 200"
        );
    }

    /// A stand-in foreign codec: "raw" is the Weir encoding behind one byte.
    struct Prefixed;
    impl HeaderCodec for Prefixed {
        fn format(&self) -> HeaderFormat {
            FOREIGN
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
    fn a_number_is_registered_once_and_the_engines_own_is_never_replaced() {
        let codecs = HeaderCodecs::new()
            .register(Arc::new(Prefixed))
            .expect("a new number");
        assert_eq!(
            codecs.formats().collect::<Vec<_>>(),
            [HeaderFormat::WEIR, FOREIGN]
        );
        assert_eq!(
            codecs.register(Arc::new(Prefixed)).err(),
            Some(PropertiesError::FormatTaken(FOREIGN))
        );
        assert_eq!(
            HeaderCodecs::new().register(Arc::new(WeirCodec)).err(),
            Some(PropertiesError::FormatTaken(HeaderFormat::WEIR))
        );
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
            weir.encode_as(FOREIGN, &HeaderCodecs::new()),
            Err(PropertiesError::NoCodec(FOREIGN))
        );
        let codecs = HeaderCodecs::new().register(Arc::new(Prefixed)).unwrap();
        let same = weir.encode_as(HeaderFormat::WEIR, &codecs).unwrap();
        assert_eq!(same.as_ptr(), weir.raw.as_ptr(), "same format: no copy");
        let foreign = weir.encode_as(FOREIGN, &codecs).unwrap();
        assert_eq!(foreign[0], 0xee);
        let back = MessageHeader::new(FOREIGN, foreign);
        assert_eq!(back.properties(&codecs).unwrap(), p);

        let convert = |target| {
            codecs
                .convert_cached(7, HeaderFormat::WEIR, &weir.raw, target)
                .unwrap()
        };
        let a = convert(FOREIGN);
        let b = convert(FOREIGN);
        assert_eq!(
            a.as_ptr(),
            b.as_ptr(),
            "second delivery reuses the conversion"
        );
        let c = convert(HeaderFormat::WEIR);
        assert_eq!(c.as_ptr(), weir.raw.as_ptr());
        // Another registry (another engine) has its own cache.
        let other = HeaderCodecs::new().register(Arc::new(Prefixed)).unwrap();
        let d = other
            .convert_cached(7, HeaderFormat::WEIR, &weir.raw, FOREIGN)
            .unwrap();
        assert_ne!(d.as_ptr(), a.as_ptr());
    }
}
