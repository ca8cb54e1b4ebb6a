//! AMQP 0-9-1's message headers ⇄ the engine: the basic property block to
//! and from the engine's protocol-neutral [`Properties`] ([`AmqpCodec`], the
//! [`HeaderCodec`] of format [`AMQP_091`], registered by the gateway's
//! composition root, `header_codecs.rs`), the headers routing sees of a
//! publish ([`lookup`]), the block of a delivery ([`amqp_properties`]), and
//! field tables to the engine's JSON arguments.
//!
//! The property block is read and written here by hand rather than through
//! `amq-protocol`'s `AMQPProperties`: its `FieldTable` is a sorted map, so it
//! would reorder keys and drop repeated ones, and it reads RabbitMQ's and the
//! specification's type letters into one type. This codec keeps table order
//! and repeats and every value's type, so AMQP → [`Properties`] → AMQP gives
//! back the publisher's bytes, with these normalisations only (each is
//! outside what RabbitMQ and its clients produce, or has one meaning):
//!
//! * flag bits 0–1 (the continuation bit and an unused bit) are cleared;
//!   `amq-protocol`, which accepted the block at publish, ignores them too;
//! * field type `U` (the specification's short int) becomes `s` (RabbitMQ's),
//!   and `L` becomes `l`: `amq-protocol`, which parses publishes and binding
//!   arguments, reads `L` as a signed `l`, so headers-exchange matching stays
//!   as it was (bits are kept; only values above `i64::MAX` read as negative);
//! * a boolean byte other than 0 is written back as 1;
//! * a long string (`S`) that is not UTF-8 becomes a byte array (`x`);
//! * delivery-mode other than 1 or 2 becomes 1 (only 2 means persistent);
//! * `expiration` must be an integer, as RabbitMQ checks it at publish
//!   ([`check_expiration`]; [`parse_expiration`] reads what it admitted),
//!   and is written back without a sign or leading zeros.
//!
//! Properties → AMQP (a message from another protocol delivered to an AMQP
//! consumer) also has to fit AMQP's limits: a short-string property longer
//! than 255 bytes (or a correlation id that is not UTF-8, as MQTT 5
//! correlation data may be) is carried as the header `x-<property-name>`
//! instead (RabbitMQ's mapping for MQTT correlation data); table keys longer
//! than 255 bytes are dropped; `expires_at_ms` and `payload_utf8` have no
//! AMQP property and are not carried (`expiration` is `ttl_ms`, as published).

use serde_json::{Map, Number, Value};
use weir_engine::properties::Reader as Cur;
use weir_engine::properties::{
    DeliveryMode, HeaderCodec, HeaderCodecs, HeaderFormat, LazyLookup, Properties, PropertiesError,
    Table, Value as PValue, MAX_DEPTH,
};

/// The header format of AMQP 0-9-1 messages: the basic property block,
/// flags then values, as published. Stored with every AMQP message; never
/// another format's number.
pub const AMQP_091: HeaderFormat = HeaderFormat::new(1);
use weir_protocols::amqp::types::{AMQPValue, FieldTable};

/// A field table as a JSON object (types collapse to JSON's).
pub fn table_to_json(t: &FieldTable) -> Value {
    let mut m = Map::new();
    for (k, v) in t.inner() {
        m.insert(k.as_str().to_string(), value_to_json(v));
    }
    Value::Object(m)
}

fn value_to_json(v: &AMQPValue) -> Value {
    match v {
        AMQPValue::Boolean(b) => Value::Bool(*b),
        AMQPValue::ShortShortInt(i) => Value::from(*i),
        AMQPValue::ShortShortUInt(i) => Value::from(*i),
        AMQPValue::ShortInt(i) => Value::from(*i),
        AMQPValue::ShortUInt(i) => Value::from(*i),
        AMQPValue::LongInt(i) => Value::from(*i),
        AMQPValue::LongUInt(i) => Value::from(*i),
        AMQPValue::LongLongInt(i) => Value::from(*i),
        AMQPValue::Timestamp(i) => Value::from(*i),
        AMQPValue::Float(f) => Number::from_f64(*f as f64)
            .map(Value::Number)
            .unwrap_or(Value::Null),
        AMQPValue::Double(f) => Number::from_f64(*f)
            .map(Value::Number)
            .unwrap_or(Value::Null),
        AMQPValue::DecimalValue(d) => Number::from_f64(d.value as f64 / 10f64.powi(d.scale as i32))
            .map(Value::Number)
            .unwrap_or(Value::Null),
        AMQPValue::ShortString(s) => Value::String(s.as_str().to_string()),
        AMQPValue::LongString(s) => {
            Value::String(String::from_utf8_lossy(s.as_bytes()).into_owned())
        }
        AMQPValue::ByteArray(b) => {
            Value::String(String::from_utf8_lossy(b.as_slice()).into_owned())
        }
        AMQPValue::FieldArray(a) => Value::Array(a.as_slice().iter().map(value_to_json).collect()),
        AMQPValue::FieldTable(t) => table_to_json(t),
        AMQPValue::Void => Value::Null,
    }
}

/// The headers of a property block being published, as routing sees them
/// (headers exchanges, `CC`/`BCC`, deduplication, delays): the engine's one
/// lookup over this codec, decoding the headers table only if asked.
pub fn lookup(raw: &[u8]) -> LazyLookup<'_> {
    LazyLookup::with_codec(Some(&AmqpCodec), raw)
}

/// The [`HeaderCodec`] of AMQP 0-9-1 property blocks.
#[derive(Clone, Copy, Debug, Default)]
pub struct AmqpCodec;

impl HeaderCodec for AmqpCodec {
    fn format(&self) -> HeaderFormat {
        AMQP_091
    }
    fn decode(&self, raw: &[u8]) -> Result<Properties, PropertiesError> {
        amqp_to_properties(raw)
    }
    fn headers(&self, raw: &[u8]) -> Result<Option<Table>, PropertiesError> {
        amqp_headers(raw)
    }
    /// `CC` and `BCC` are looked up on every publish: ruled out without
    /// parsing when the block has no headers table, or no table key spelled
    /// `name` anywhere (a short string: length byte, then the bytes).
    fn may_have(&self, raw: &[u8], name: &str) -> bool {
        if name.is_empty() || name.len() > 255 {
            return true;
        }
        if let [a, b, ..] = raw {
            if u16::from_be_bytes([*a, *b]) & P_HEADERS == 0 {
                return false;
            }
        }
        let n = name.len();
        raw.windows(n + 1)
            .any(|w| usize::from(w[0]) == n && &w[1..] == name.as_bytes())
    }
    fn encode(&self, properties: &Properties, out: &mut Vec<u8>) -> Result<(), PropertiesError> {
        properties_to_amqp(properties, out)
    }
}

/// A relative TTL in ms from a stored AMQP `expiration`: an optional sign
/// and decimal digits, as [`check_expiration`] admitted it at publish (a
/// negative value is refused there, so only `-0` is). None if it is not one.
pub fn parse_expiration(s: &[u8]) -> Option<u64> {
    let (negative, digits) = match s.split_first() {
        Some((b'+', rest)) => (false, rest),
        Some((b'-', rest)) => (true, rest),
        _ => (false, s),
    };
    if digits.is_empty() || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    // Digits only, so this fails only on overflow.
    let n: u64 = std::str::from_utf8(digits).ok()?.parse().ok()?;
    (!negative || n == 0).then_some(n)
}

/// RabbitMQ's largest `expiration`: ten years in ms (3.10's
/// `MAX_EXPIRY_TIMER`, measured against it; newer versions lowered it to
/// 2^32-1).
pub const MAX_EXPIRATION_MS: u64 = 315_360_000_000;

/// Why a publish's `expiration` is refused, in RabbitMQ's terms (its
/// `rabbit_basic:parse_expiration`: Erlang's `string:to_integer`, then a
/// range check).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExpirationError {
    /// It does not start with an integer.
    NoInteger,
    /// Text after the integer.
    LeftoverString(String),
    /// Below zero.
    ValueNegative(i128),
    /// Above [`MAX_EXPIRATION_MS`].
    ValueTooLarge(i128),
}

impl std::fmt::Display for ExpirationError {
    /// As RabbitMQ prints the reason (`~tp` of its error term).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ExpirationError::NoInteger => f.write_str("no_integer"),
            ExpirationError::LeftoverString(s) => write!(f, "{{leftover_string,{s:?}}}"),
            ExpirationError::ValueNegative(n) => write!(f, "{{value_negative,{n}}}"),
            ExpirationError::ValueTooLarge(n) => write!(f, "{{value_too_large,{n}}}"),
        }
    }
}

/// Checks a publish's `expiration` as RabbitMQ does: an integer (optional
/// sign, decimal digits) with nothing after it, from 0 to
/// [`MAX_EXPIRATION_MS`]. Returns the TTL in ms.
pub fn check_expiration(s: &[u8]) -> Result<u64, ExpirationError> {
    let (negative, rest) = match s.split_first() {
        Some((b'+', rest)) => (false, rest),
        Some((b'-', rest)) => (true, rest),
        _ => (false, s),
    };
    let n_digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
    if n_digits == 0 {
        return Err(ExpirationError::NoInteger);
    }
    let (digits, tail) = rest.split_at(n_digits);
    if !tail.is_empty() {
        return Err(ExpirationError::LeftoverString(
            String::from_utf8_lossy(tail).into_owned(),
        ));
    }
    // Saturates far above the limit: only "too big" needs the value, and
    // then only to print it.
    let magnitude = digits.iter().fold(0i128, |n, d| {
        n.saturating_mul(10).saturating_add(i128::from(d - b'0'))
    });
    let n = if negative { -magnitude } else { magnitude };
    if n < 0 {
        return Err(ExpirationError::ValueNegative(n));
    }
    match u64::try_from(n) {
        Ok(ms) if ms <= MAX_EXPIRATION_MS => Ok(ms),
        _ => Err(ExpirationError::ValueTooLarge(n)),
    }
}

/// The raw `expiration` of an AMQP basic property block, if it has one.
/// Only the fields before it are walked (and only when its flag is set), so
/// a publish without one costs two byte reads.
pub fn amqp_expiration(raw: &[u8]) -> Result<Option<&[u8]>, PropertiesError> {
    let mut c = Cur::new(raw);
    let flags = read_flags(&mut c)?;
    if flags & P_EXPIRATION == 0 {
        return Ok(None);
    }
    if flags & P_CONTENT_TYPE != 0 {
        c.short_bytes()?;
    }
    if flags & P_CONTENT_ENCODING != 0 {
        c.short_bytes()?;
    }
    if flags & P_HEADERS != 0 {
        c.long_bytes()?;
    }
    if flags & P_DELIVERY_MODE != 0 {
        c.u8()?;
    }
    if flags & P_PRIORITY != 0 {
        c.u8()?;
    }
    if flags & P_CORRELATION_ID != 0 {
        c.short_bytes()?;
    }
    if flags & P_REPLY_TO != 0 {
        c.short_bytes()?;
    }
    c.short_bytes().map(Some)
}

/// The raw value of the short-string property `flag` (one of the `P_*`
/// bits: reply-to, user-id, …) of an AMQP basic property block, if set.
/// Only the fields before it are walked, and only when its flag is set.
fn short_property(raw: &[u8], flag: u16) -> Result<Option<&[u8]>, PropertiesError> {
    let mut c = Cur::new(raw);
    let flags = read_flags(&mut c)?;
    if flags & flag == 0 {
        return Ok(None);
    }
    for bit in (0..16).rev() {
        let f = 1u16 << bit;
        if f == flag {
            return c.short_bytes().map(Some);
        }
        if flags & f == 0 {
            continue;
        }
        match f {
            P_HEADERS => {
                c.long_bytes()?;
            }
            P_DELIVERY_MODE | P_PRIORITY => {
                c.u8()?;
            }
            P_TIMESTAMP => {
                let _: [u8; 8] = c.array()?;
            }
            _ => {
                c.short_bytes()?;
            }
        }
    }
    Ok(None)
}

/// The raw `user-id` of an AMQP basic property block, if it has one.
pub fn amqp_user_id(raw: &[u8]) -> Result<Option<&[u8]>, PropertiesError> {
    short_property(raw, P_USER_ID)
}

/// The raw `reply-to` of an AMQP basic property block, if it has one.
pub fn amqp_reply_to(raw: &[u8]) -> Result<Option<&[u8]>, PropertiesError> {
    short_property(raw, P_REPLY_TO)
}

/// The property block `raw` with its `reply-to` replaced by `value` (at
/// most 255 bytes), every other byte as it was; None when it has no
/// reply-to or `value` is too long.
pub fn with_reply_to(raw: &[u8], value: &[u8]) -> Option<bytes::Bytes> {
    let old = amqp_reply_to(raw).ok()??;
    let len = u8::try_from(value.len()).ok()?;
    // `old` is a slice of `raw`, right after its length byte.
    let at = old.as_ptr() as usize - raw.as_ptr() as usize;
    let mut out = Vec::with_capacity(raw.len() + value.len());
    out.extend_from_slice(&raw[..at - 1]);
    out.push(len);
    out.extend_from_slice(value);
    out.extend_from_slice(&raw[at + old.len()..]);
    Some(out.into())
}

// Property flag bits of basic's property block, most significant first.
const P_CONTENT_TYPE: u16 = 1 << 15;
const P_CONTENT_ENCODING: u16 = 1 << 14;
const P_HEADERS: u16 = 1 << 13;
const P_DELIVERY_MODE: u16 = 1 << 12;
const P_PRIORITY: u16 = 1 << 11;
const P_CORRELATION_ID: u16 = 1 << 10;
const P_REPLY_TO: u16 = 1 << 9;
const P_EXPIRATION: u16 = 1 << 8;
const P_MESSAGE_ID: u16 = 1 << 7;
const P_TIMESTAMP: u16 = 1 << 6;
const P_TYPE: u16 = 1 << 5;
const P_USER_ID: u16 = 1 << 4;
const P_APP_ID: u16 = 1 << 3;
const P_CLUSTER_ID: u16 = 1 << 2;

/// AMQP's length-prefixed fields over the engine's bounds-checked cursor.
trait AmqpRead<'a> {
    fn u32(&mut self) -> Result<usize, PropertiesError>;
    fn short_bytes(&mut self) -> Result<&'a [u8], PropertiesError>;
    fn short_str(&mut self) -> Result<String, PropertiesError>;
    fn long_bytes(&mut self) -> Result<&'a [u8], PropertiesError>;
}

impl<'a> AmqpRead<'a> for Cur<'a> {
    fn u32(&mut self) -> Result<usize, PropertiesError> {
        Ok(u32::from_be_bytes(self.array()?) as usize)
    }
    fn short_bytes(&mut self) -> Result<&'a [u8], PropertiesError> {
        let n = self.u8()? as usize;
        self.take(n)
    }
    fn short_str(&mut self) -> Result<String, PropertiesError> {
        utf8(self.short_bytes()?)
    }
    fn long_bytes(&mut self) -> Result<&'a [u8], PropertiesError> {
        let n = self.u32()?;
        self.take(n)
    }
}

fn utf8(b: &[u8]) -> Result<String, PropertiesError> {
    std::str::from_utf8(b)
        .map(str::to_owned)
        .map_err(|_| PropertiesError::InvalidUtf8)
}

/// A field table (length prefix first) at nesting level `depth`.
fn read_table(c: &mut Cur<'_>, depth: usize) -> Result<Table, PropertiesError> {
    if depth > MAX_DEPTH {
        return Err(PropertiesError::TooDeep);
    }
    let mut inner = Cur::new(c.long_bytes()?);
    let mut t = Table::new();
    while !inner.is_empty() {
        let k = inner.short_str()?;
        let v = read_value(&mut inner, depth)?;
        t.push(k, v);
    }
    Ok(t)
}

/// A typed value inside a container at level `depth`. RabbitMQ's letters
/// (`s` is a short int), plus the specification's `U` and `L`, as the
/// `amq-protocol` parser that admitted the block at publish reads them.
fn read_value(c: &mut Cur<'_>, depth: usize) -> Result<PValue, PropertiesError> {
    Ok(match c.u8()? {
        b't' => PValue::Bool(c.u8()? != 0),
        b'b' => PValue::I8(c.u8()? as i8),
        b'B' => PValue::U8(c.u8()?),
        b's' | b'U' => PValue::I16(i16::from_be_bytes(c.array()?)),
        b'u' => PValue::U16(u16::from_be_bytes(c.array()?)),
        b'I' => PValue::I32(i32::from_be_bytes(c.array()?)),
        b'i' => PValue::U32(u32::from_be_bytes(c.array()?)),
        // `L` as `amq-protocol` reads it (binding arguments compare alike).
        b'l' | b'L' => PValue::I64(i64::from_be_bytes(c.array()?)),
        b'f' => PValue::F32(f32::from_bits(u32::from_be_bytes(c.array()?))),
        b'd' => PValue::F64(f64::from_bits(u64::from_be_bytes(c.array()?))),
        b'D' => {
            let scale = c.u8()?;
            PValue::Decimal {
                scale,
                value: u32::from_be_bytes(c.array()?),
            }
        }
        b'S' => {
            let b = c.long_bytes()?;
            match std::str::from_utf8(b) {
                Ok(s) => PValue::String(s.to_owned()),
                Err(_) => PValue::Bytes(b.to_vec()),
            }
        }
        b'x' => PValue::Bytes(c.long_bytes()?.to_vec()),
        b'T' => PValue::Timestamp(u64::from_be_bytes(c.array()?)),
        b'V' => PValue::Void,
        b'F' => PValue::Table(read_table(c, depth + 1)?),
        b'A' => {
            if depth + 1 > MAX_DEPTH {
                return Err(PropertiesError::TooDeep);
            }
            let mut inner = Cur::new(c.long_bytes()?);
            let mut a = Vec::new();
            while !inner.is_empty() {
                a.push(read_value(&mut inner, depth + 1)?);
            }
            PValue::Array(a)
        }
        other => return Err(PropertiesError::UnknownTag(other)),
    })
}

/// Reads the flags and the properties before `headers`.
fn read_flags(c: &mut Cur<'_>) -> Result<u16, PropertiesError> {
    Ok(u16::from_be_bytes(c.array()?))
}

/// Only the `headers` table of a property block (what a headers exchange
/// needs): the fields after it are not read.
pub fn amqp_headers(raw: &[u8]) -> Result<Option<Table>, PropertiesError> {
    let mut c = Cur::new(raw);
    let flags = read_flags(&mut c)?;
    if flags & P_CONTENT_TYPE != 0 {
        c.short_bytes()?;
    }
    if flags & P_CONTENT_ENCODING != 0 {
        c.short_bytes()?;
    }
    if flags & P_HEADERS == 0 {
        return Ok(None);
    }
    read_table(&mut c, 1).map(Some)
}

/// An AMQP basic property block (flags and values, as a content header
/// carries it after the body size) as [`Properties`]. See the module doc for
/// what is normalised.
pub fn amqp_to_properties(raw: &[u8]) -> Result<Properties, PropertiesError> {
    let mut c = Cur::new(raw);
    let flags = read_flags(&mut c)?;
    let has = |bit: u16| flags & bit != 0;
    let mut p = Properties::default();
    if has(P_CONTENT_TYPE) {
        p.content_type = Some(c.short_str()?);
    }
    if has(P_CONTENT_ENCODING) {
        p.content_encoding = Some(c.short_str()?);
    }
    if has(P_HEADERS) {
        p.headers = Some(read_table(&mut c, 1)?);
    }
    if has(P_DELIVERY_MODE) {
        p.delivery_mode = Some(match c.u8()? {
            2 => DeliveryMode::Persistent,
            _ => DeliveryMode::Transient,
        });
    }
    if has(P_PRIORITY) {
        p.priority = Some(c.u8()?);
    }
    if has(P_CORRELATION_ID) {
        p.correlation_id = Some(c.short_bytes()?.to_vec());
    }
    if has(P_REPLY_TO) {
        p.reply_to = Some(c.short_str()?);
    }
    if has(P_EXPIRATION) {
        let e = c.short_bytes()?;
        p.ttl_ms = Some(parse_expiration(e).ok_or(PropertiesError::Invalid("expiration"))?);
    }
    if has(P_MESSAGE_ID) {
        p.message_id = Some(c.short_str()?);
    }
    if has(P_TIMESTAMP) {
        p.timestamp = Some(u64::from_be_bytes(c.array()?));
    }
    if has(P_TYPE) {
        p.kind = Some(c.short_str()?);
    }
    if has(P_USER_ID) {
        p.user_id = Some(c.short_str()?);
    }
    if has(P_APP_ID) {
        p.app_id = Some(c.short_str()?);
    }
    if has(P_CLUSTER_ID) {
        p.cluster_id = Some(c.short_str()?);
    }
    if !c.is_empty() {
        return Err(PropertiesError::TrailingBytes(c.remaining()));
    }
    Ok(p)
}

/// Appends `properties` as an AMQP basic property block (flags and values).
/// See the module doc for what does not fit AMQP and where it goes. Fails
/// only for nesting deeper than [`MAX_DEPTH`] or a table or string over
/// 4 GiB, leaving `out` as it was.
pub fn properties_to_amqp(p: &Properties, out: &mut Vec<u8>) -> Result<(), PropertiesError> {
    let start = out.len();
    let r = write_properties(p, out);
    if r.is_err() {
        out.truncate(start);
    }
    r
}

/// A short-string property: written if it fits, else moved to `overflow`
/// as the header `x-<name>`.
fn short_prop<'p>(
    v: Option<&'p [u8]>,
    name: &'static str,
    overflow: &mut Vec<(&'static str, PValue)>,
) -> Option<&'p [u8]> {
    let v = v?;
    if v.len() <= 255 {
        return Some(v);
    }
    let value = match std::str::from_utf8(v) {
        Ok(s) => PValue::String(s.to_owned()),
        Err(_) => PValue::Bytes(v.to_vec()),
    };
    overflow.push((name, value));
    None
}

fn s(o: &Option<String>) -> Option<&[u8]> {
    o.as_deref().map(str::as_bytes)
}

fn write_properties(p: &Properties, out: &mut Vec<u8>) -> Result<(), PropertiesError> {
    let mut overflow = Vec::new();
    let content_type = short_prop(s(&p.content_type), "x-content-type", &mut overflow);
    let content_encoding = short_prop(s(&p.content_encoding), "x-content-encoding", &mut overflow);
    // Correlation data that is not UTF-8 would make `amq-protocol`-based
    // clients refuse the whole frame: it goes to a header too.
    let correlation_id = match p.correlation_id.as_deref() {
        Some(c) if std::str::from_utf8(c).is_err() => {
            overflow.push(("x-correlation-id", PValue::Bytes(c.to_vec())));
            None
        }
        c => short_prop(c, "x-correlation-id", &mut overflow),
    };
    let reply_to = short_prop(s(&p.reply_to), "x-reply-to", &mut overflow);
    let message_id = short_prop(s(&p.message_id), "x-message-id", &mut overflow);
    let kind = short_prop(s(&p.kind), "x-type", &mut overflow);
    let user_id = short_prop(s(&p.user_id), "x-user-id", &mut overflow);
    let app_id = short_prop(s(&p.app_id), "x-app-id", &mut overflow);
    let cluster_id = short_prop(s(&p.cluster_id), "x-cluster-id", &mut overflow);
    let expiration = p.ttl_ms.map(|t| t.to_string());

    let with_overflow;
    let headers = if overflow.is_empty() {
        p.headers.as_ref()
    } else {
        let mut t = p.headers.clone().unwrap_or_default();
        for (k, v) in overflow {
            t.push(k, v);
        }
        with_overflow = t;
        Some(&with_overflow)
    };

    let mut flags = 0u16;
    for (present, bit) in [
        (content_type.is_some(), P_CONTENT_TYPE),
        (content_encoding.is_some(), P_CONTENT_ENCODING),
        (headers.is_some(), P_HEADERS),
        (p.delivery_mode.is_some(), P_DELIVERY_MODE),
        (p.priority.is_some(), P_PRIORITY),
        (correlation_id.is_some(), P_CORRELATION_ID),
        (reply_to.is_some(), P_REPLY_TO),
        (expiration.is_some(), P_EXPIRATION),
        (message_id.is_some(), P_MESSAGE_ID),
        (p.timestamp.is_some(), P_TIMESTAMP),
        (kind.is_some(), P_TYPE),
        (user_id.is_some(), P_USER_ID),
        (app_id.is_some(), P_APP_ID),
        (cluster_id.is_some(), P_CLUSTER_ID),
    ] {
        if present {
            flags |= bit;
        }
    }
    out.extend_from_slice(&flags.to_be_bytes());
    let short = |out: &mut Vec<u8>, v: Option<&[u8]>| {
        if let Some(v) = v {
            debug_assert!(v.len() <= 255);
            out.push(v.len() as u8);
            out.extend_from_slice(v);
        }
    };
    short(out, content_type);
    short(out, content_encoding);
    if let Some(t) = headers {
        write_table(out, t, 1)?;
    }
    if let Some(m) = p.delivery_mode {
        out.push(match m {
            DeliveryMode::Transient => 1,
            DeliveryMode::Persistent => 2,
        });
    }
    if let Some(pr) = p.priority {
        out.push(pr);
    }
    short(out, correlation_id);
    short(out, reply_to);
    // At most 20 digits: always a short string.
    short(out, expiration.as_deref().map(str::as_bytes));
    short(out, message_id);
    if let Some(t) = p.timestamp {
        out.extend_from_slice(&t.to_be_bytes());
    }
    short(out, kind);
    short(out, user_id);
    short(out, app_id);
    short(out, cluster_id);
    Ok(())
}

/// Reserves a 32-bit length prefix; [`end_len`] fills it in.
fn begin_len(out: &mut Vec<u8>) -> usize {
    out.extend_from_slice(&[0; 4]);
    out.len()
}

fn end_len(out: &mut [u8], at: usize) -> Result<(), PropertiesError> {
    let n = u32::try_from(out.len() - at).map_err(|_| PropertiesError::Invalid("size"))?;
    out[at - 4..at].copy_from_slice(&n.to_be_bytes());
    Ok(())
}

fn write_long(out: &mut Vec<u8>, tag: u8, b: &[u8]) -> Result<(), PropertiesError> {
    let n = u32::try_from(b.len()).map_err(|_| PropertiesError::Invalid("size"))?;
    out.push(tag);
    out.extend_from_slice(&n.to_be_bytes());
    out.extend_from_slice(b);
    Ok(())
}

fn write_table(out: &mut Vec<u8>, t: &Table, depth: usize) -> Result<(), PropertiesError> {
    if depth > MAX_DEPTH {
        return Err(PropertiesError::TooDeep);
    }
    let at = begin_len(out);
    for (k, v) in t.iter() {
        // A key must be a short string; a longer one (an MQTT user property
        // name may be 64 KiB) has no AMQP form.
        if k.len() > 255 {
            continue;
        }
        out.push(k.len() as u8);
        out.extend_from_slice(k.as_bytes());
        write_value(out, v, depth)?;
    }
    end_len(out, at)
}

fn write_value(out: &mut Vec<u8>, v: &PValue, depth: usize) -> Result<(), PropertiesError> {
    match v {
        PValue::Void => out.push(b'V'),
        PValue::Bool(b) => out.extend_from_slice(&[b't', *b as u8]),
        PValue::I8(i) => out.extend_from_slice(&[b'b', *i as u8]),
        PValue::U8(i) => out.extend_from_slice(&[b'B', *i]),
        PValue::I16(i) => {
            out.push(b's');
            out.extend_from_slice(&i.to_be_bytes());
        }
        PValue::U16(i) => {
            out.push(b'u');
            out.extend_from_slice(&i.to_be_bytes());
        }
        PValue::I32(i) => {
            out.push(b'I');
            out.extend_from_slice(&i.to_be_bytes());
        }
        PValue::U32(i) => {
            out.push(b'i');
            out.extend_from_slice(&i.to_be_bytes());
        }
        PValue::I64(i) => {
            out.push(b'l');
            out.extend_from_slice(&i.to_be_bytes());
        }
        PValue::U64(i) => {
            // RabbitMQ and most clients know only `l`: use it whenever the
            // value fits, the specification's unsigned `L` only when it does
            // not (read back here as a negative `l`, like `amq-protocol` does).
            out.push(if *i > i64::MAX as u64 { b'L' } else { b'l' });
            out.extend_from_slice(&i.to_be_bytes());
        }
        PValue::F32(f) => {
            out.push(b'f');
            out.extend_from_slice(&f.to_bits().to_be_bytes());
        }
        PValue::F64(f) => {
            out.push(b'd');
            out.extend_from_slice(&f.to_bits().to_be_bytes());
        }
        PValue::Decimal { scale, value } => {
            out.extend_from_slice(&[b'D', *scale]);
            out.extend_from_slice(&value.to_be_bytes());
        }
        PValue::String(s) => write_long(out, b'S', s.as_bytes())?,
        PValue::Bytes(b) => write_long(out, b'x', b)?,
        PValue::Timestamp(t) => {
            out.push(b'T');
            out.extend_from_slice(&t.to_be_bytes());
        }
        PValue::Array(a) => {
            if depth + 1 > MAX_DEPTH {
                return Err(PropertiesError::TooDeep);
            }
            out.push(b'A');
            let at = begin_len(out);
            for v in a {
                write_value(out, v, depth + 1)?;
            }
            end_len(out, at)?;
        }
        PValue::Table(t) => {
            out.push(b'F');
            write_table(out, t, depth + 1)?;
        }
    }
    Ok(())
}

/// The AMQP property block of a message to deliver: its own when it was
/// published over AMQP (the bytes as published, no copy), else its header
/// converted through the registry `codecs` from whatever format it has
/// (once per message, in the registry's cache). A header that cannot be
/// converted (undecodable, or a format without a codec here) becomes an
/// empty block: the message is delivered without its properties.
pub fn amqp_properties(m: &crate::engine::message::Message, codecs: &HeaderCodecs) -> bytes::Bytes {
    if m.header_format == AMQP_091 {
        return m.properties.clone();
    }
    codecs
        .convert_cached(m.id, m.header_format, &m.properties, AMQP_091)
        .unwrap_or_else(|e| {
            tracing::debug!(error = %e, id = m.id, "delivering to AMQP a message whose header cannot be converted: no properties");
            bytes::Bytes::from_static(&[0, 0])
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use amq_protocol::frame::WriteContext;
    use amq_protocol::protocol::basic::{gen_properties, AMQPProperties};
    use amq_protocol::types::{
        AMQPValue as A, ByteArray, DecimalValue, FieldArray, LongString, ShortString,
    };
    use bytes::Bytes;
    use weir_engine::exchange::headers_match;
    use weir_engine::properties::HeaderLookup;
    use weir_engine::properties::MessageHeader;
    use weir_protocols::amqp::connection::parse_properties;

    /// The gateway's registry, as the composition root builds it.
    fn codecs() -> HeaderCodecs {
        crate::header_codecs::registry()
    }

    /// Builds raw blocks by hand, so tests control order, repeats and letters.
    #[derive(Default)]
    struct Block {
        flags: u16,
        body: Vec<u8>,
    }
    impl Block {
        fn short(mut self, bit: u16, s: &[u8]) -> Self {
            self.flags |= bit;
            self.body.push(s.len() as u8);
            self.body.extend_from_slice(s);
            self
        }
        fn octet(mut self, bit: u16, b: u8) -> Self {
            self.flags |= bit;
            self.body.push(b);
            self
        }
        fn table(mut self, t: &[u8]) -> Self {
            self.flags |= P_HEADERS;
            self.body.extend_from_slice(&(t.len() as u32).to_be_bytes());
            self.body.extend_from_slice(t);
            self
        }
        fn timestamp(mut self, t: u64) -> Self {
            self.flags |= P_TIMESTAMP;
            self.body.extend_from_slice(&t.to_be_bytes());
            self
        }
        fn bytes(&self) -> Vec<u8> {
            let mut v = self.flags.to_be_bytes().to_vec();
            v.extend_from_slice(&self.body);
            v
        }
    }

    /// Table entries: key, then a typed value (letter + payload).
    fn entry(t: &mut Vec<u8>, key: &str, letter: u8, payload: &[u8]) {
        t.push(key.len() as u8);
        t.extend_from_slice(key.as_bytes());
        t.push(letter);
        t.extend_from_slice(payload);
    }

    fn long(b: &[u8]) -> Vec<u8> {
        let mut v = (b.len() as u32).to_be_bytes().to_vec();
        v.extend_from_slice(b);
        v
    }

    /// Every letter RabbitMQ writes, keys unsorted and one repeated, tables
    /// and arrays nested, a non-finite float.
    fn every_type_table() -> Vec<u8> {
        let mut inner = Vec::new();
        entry(&mut inner, "z", b'S', &long(b"inner"));
        entry(&mut inner, "a", b'V', &[]);
        let mut array = Vec::new();
        array.extend_from_slice(&[b'b', 0xff, b'S']);
        array.extend_from_slice(&long("ünï".as_bytes()));
        array.push(b'F');
        array.extend_from_slice(&long(&inner));
        array.extend_from_slice(&[b'A', 0, 0, 0, 0]);

        let mut t = Vec::new();
        entry(&mut t, "zeta", b't', &[1]);
        entry(&mut t, "false", b't', &[0]);
        entry(&mut t, "i8", b'b', &[0x80]);
        entry(&mut t, "u8", b'B', &[0xff]);
        entry(&mut t, "i16", b's', &(-2i16).to_be_bytes());
        entry(&mut t, "u16", b'u', &65535u16.to_be_bytes());
        entry(&mut t, "i32", b'I', &i32::MIN.to_be_bytes());
        entry(&mut t, "u32", b'i', &u32::MAX.to_be_bytes());
        entry(&mut t, "i64", b'l', &i64::MIN.to_be_bytes());
        entry(&mut t, "u64", b'l', &u64::MAX.to_be_bytes());
        entry(&mut t, "f32", b'f', &1.5f32.to_bits().to_be_bytes());
        entry(&mut t, "nan", b'd', &f64::NAN.to_bits().to_be_bytes());
        entry(&mut t, "f64", b'd', &(-0.0f64).to_bits().to_be_bytes());
        let mut d = vec![3];
        d.extend_from_slice(&12345u32.to_be_bytes());
        entry(&mut t, "dec", b'D', &d);
        entry(&mut t, "str", b'S', &long("héllo".as_bytes()));
        entry(&mut t, "empty", b'S', &long(b""));
        entry(&mut t, "bin", b'x', &long(&[0, 0xff, 0xfe]));
        entry(&mut t, "ts", b'T', &1_700_000_000u64.to_be_bytes());
        entry(&mut t, "void", b'V', &[]);
        entry(&mut t, "table", b'F', &long(&inner));
        entry(&mut t, "array", b'A', &long(&array));
        entry(&mut t, "zeta", b'S', &long(b"repeated key, kept in place"));
        t
    }

    fn every_property_block() -> Vec<u8> {
        Block::default()
            .short(P_CONTENT_TYPE, b"application/json")
            .short(P_CONTENT_ENCODING, b"gzip")
            .table(&every_type_table())
            .octet(P_DELIVERY_MODE, 2)
            .octet(P_PRIORITY, 9)
            .short(P_CORRELATION_ID, b"corr-1")
            .short(P_REPLY_TO, b"amq.rabbitmq.reply-to")
            .short(P_EXPIRATION, b"60000")
            .short(P_MESSAGE_ID, b"msg-1")
            .timestamp(1_700_000_000)
            .short(P_TYPE, b"order.created")
            .short(P_USER_ID, b"guest")
            .short(P_APP_ID, "äpp".as_bytes())
            .short(P_CLUSTER_ID, b"c1")
            .bytes()
    }

    fn round_trip(raw: &[u8]) -> Vec<u8> {
        let p = amqp_to_properties(raw).expect("decodes");
        let mut out = Vec::new();
        properties_to_amqp(&p, &mut out).expect("encodes");
        out
    }

    #[test]
    fn every_property_and_value_type_round_trips_byte_identically() {
        let raw = every_property_block();
        // Sanity: the block is one `amq-protocol` (what admits a publish) accepts.
        assert!(parse_properties(&raw).is_some());
        assert_eq!(round_trip(&raw), raw);

        let p = amqp_to_properties(&raw).unwrap();
        assert_eq!(p.content_type.as_deref(), Some("application/json"));
        assert!(p.is_persistent());
        assert_eq!(p.priority, Some(9));
        assert_eq!(p.correlation_id.as_deref(), Some(&b"corr-1"[..]));
        assert_eq!(p.ttl_ms, Some(60_000));
        assert_eq!(p.expires_at_ms, None);
        assert_eq!(p.timestamp, Some(1_700_000_000));
        assert_eq!(p.kind.as_deref(), Some("order.created"));
        assert_eq!(p.app_id.as_deref(), Some("äpp"));
        assert_eq!(p.cluster_id.as_deref(), Some("c1"));
        let h = p.headers.as_ref().unwrap();
        assert_eq!(h.len(), 22);
        assert_eq!(h.0[0].0, "zeta", "publisher's order kept");
        assert_eq!(
            h.get("zeta"),
            Some(&PValue::String("repeated key, kept in place".into()))
        );
        assert_eq!(h.get("u64"), Some(&PValue::I64(-1)));
        assert_eq!(h.get("i16"), Some(&PValue::I16(-2)));
        assert_eq!(h.get("bin"), Some(&PValue::Bytes(vec![0, 0xff, 0xfe])));
        assert_eq!(
            h.get("dec"),
            Some(&PValue::Decimal {
                scale: 3,
                value: 12345
            })
        );

        // And through the store's encoding as well: AMQP → stored → AMQP.
        let stored = MessageHeader::from_properties(&p).unwrap();
        let back = stored.encode_as(AMQP_091, &codecs()).unwrap();
        assert_eq!(&back[..], &raw[..]);
    }

    #[test]
    fn empty_and_partial_blocks_round_trip() {
        for raw in [
            vec![0, 0],
            Block::default().table(&[]).bytes(),
            Block::default().short(P_MESSAGE_ID, b"").bytes(),
            Block::default().octet(P_DELIVERY_MODE, 1).bytes(),
            Block::default().short(P_EXPIRATION, b"0").bytes(),
            Block::default()
                .timestamp(0)
                .short(P_CLUSTER_ID, b"x")
                .bytes(),
        ] {
            assert_eq!(round_trip(&raw), raw, "{raw:?}");
        }
        // Absent headers and an empty table stay different.
        assert_eq!(amqp_to_properties(&[0, 0]).unwrap().headers, None);
        assert_eq!(
            amqp_to_properties(&Block::default().table(&[]).bytes())
                .unwrap()
                .headers,
            Some(Table::new())
        );
    }

    #[test]
    fn documented_normalisations() {
        let norm = |table: &[u8]| round_trip(&Block::default().table(table).bytes());
        let block = |table: &[u8]| Block::default().table(table).bytes();
        let one = |letter: u8, payload: &[u8]| {
            let mut t = Vec::new();
            entry(&mut t, "k", letter, payload);
            t
        };
        // U → s.
        assert_eq!(
            norm(&one(b'U', &[0xff, 0xfe])),
            block(&one(b's', &[0xff, 0xfe]))
        );
        // L → l, bits kept.
        for v in [5u64, u64::MAX] {
            assert_eq!(
                norm(&one(b'L', &v.to_be_bytes())),
                block(&one(b'l', &v.to_be_bytes()))
            );
        }
        // An unsigned 64-bit value from elsewhere: `l` if it fits, else `L`.
        let mut t = Table::new();
        t.push("a", PValue::U64(5));
        t.push("b", PValue::U64(u64::MAX));
        let p = Properties {
            headers: Some(t),
            ..Default::default()
        };
        let mut out = Vec::new();
        properties_to_amqp(&p, &mut out).unwrap();
        let mut expected = one(b'l', &5u64.to_be_bytes());
        expected[1] = b'a';
        let mut b = one(b'L', &u64::MAX.to_be_bytes());
        b[1] = b'b';
        expected.extend_from_slice(&b);
        assert_eq!(out, block(&expected));
        // Boolean 2 → 1.
        assert_eq!(norm(&one(b't', &[2])), block(&one(b't', &[1])));
        // Non-UTF-8 long string → byte array.
        assert_eq!(
            norm(&one(b'S', &long(&[0xff]))),
            block(&one(b'x', &long(&[0xff])))
        );
        // Delivery mode 7 → 1.
        assert_eq!(
            round_trip(&Block::default().octet(P_DELIVERY_MODE, 7).bytes()),
            Block::default().octet(P_DELIVERY_MODE, 1).bytes()
        );
        // Reserved flag bits cleared.
        assert_eq!(round_trip(&[0, 3]), vec![0, 0]);
        // Expiration without leading zeros; a non-number is refused.
        assert_eq!(
            round_trip(&Block::default().short(P_EXPIRATION, b"007").bytes()),
            Block::default().short(P_EXPIRATION, b"7").bytes()
        );
        // A sign, as RabbitMQ's parser takes it: written back without it.
        assert_eq!(
            round_trip(&Block::default().short(P_EXPIRATION, b"+5").bytes()),
            Block::default().short(P_EXPIRATION, b"5").bytes()
        );
        for bad in [
            &b""[..],
            b"-1",
            b"+",
            b"1.5",
            b" 1",
            b"abc",
            b"99999999999999999999",
        ] {
            assert_eq!(
                amqp_to_properties(&Block::default().short(P_EXPIRATION, bad).bytes()),
                Err(PropertiesError::Invalid("expiration")),
                "{bad:?}"
            );
        }
        assert_eq!(parse_expiration(b"18446744073709551615"), Some(u64::MAX));
    }

    #[test]
    fn publish_expiration_is_checked_as_rabbitmq_does() {
        assert_eq!(check_expiration(b"0"), Ok(0));
        assert_eq!(check_expiration(b"60000"), Ok(60_000));
        assert_eq!(check_expiration(b"+5"), Ok(5));
        assert_eq!(check_expiration(b"-0"), Ok(0));
        assert_eq!(check_expiration(b"4294967296"), Ok(1 << 32));
        assert_eq!(check_expiration(b"315360000000"), Ok(MAX_EXPIRATION_MS));
        let e = |s: &[u8]| check_expiration(s).unwrap_err().to_string();
        assert_eq!(e(b""), "no_integer");
        assert_eq!(e(b"abc"), "no_integer");
        assert_eq!(e(b" 1"), "no_integer");
        assert_eq!(e(b"+"), "no_integer");
        assert_eq!(e(b"10s"), "{leftover_string,\"s\"}");
        assert_eq!(e(b"1.5"), "{leftover_string,\".5\"}");
        assert_eq!(e(b"-1"), "{value_negative,-1}");
        assert_eq!(e(b"315360000001"), "{value_too_large,315360000001}");
        // Far past any integer type: still refused, never wrapped.
        assert!(e(&[b'9'; 60]).starts_with("{value_too_large,"));
    }

    #[test]
    fn expiration_is_found_behind_every_earlier_field() {
        assert_eq!(amqp_expiration(&Block::default().bytes()), Ok(None));
        let all = amq_protocol_block(FieldTable::default());
        let props = amqp_to_properties(&all).expect("decodes");
        let raw = amqp_expiration(&all).expect("walks").expect("present");
        assert_eq!(parse_expiration(raw), props.ttl_ms);
        // Cut short: an error, not a panic or a wrong field.
        assert!(amqp_expiration(&all[..all.len() / 2]).is_err());
    }

    /// Builds `amq-protocol` properties with every field set.
    fn amq_protocol_block(headers: FieldTable) -> Vec<u8> {
        let props = AMQPProperties::default()
            .with_content_type(ShortString::from("text/plain"))
            .with_content_encoding(ShortString::from("utf-8"))
            .with_headers(headers)
            .with_delivery_mode(1)
            .with_priority(3)
            .with_correlation_id(ShortString::from("c"))
            .with_reply_to(ShortString::from("r"))
            .with_expiration(ShortString::from("1000"))
            .with_message_id(ShortString::from("m"))
            .with_timestamp(42)
            .with_type(ShortString::from("t"))
            .with_user_id(ShortString::from("u"))
            .with_app_id(ShortString::from("a"))
            .with_cluster_id(ShortString::from("cl"));
        let ctx = gen_properties(&props)(WriteContext::from(Vec::new())).expect("generates");
        ctx.write
    }

    fn amq_protocol_table() -> FieldTable {
        let mut inner = FieldTable::default();
        inner.insert("n".into(), A::LongLongInt(-1));
        let mut t = FieldTable::default();
        t.insert("bool".into(), A::Boolean(true));
        t.insert("i8".into(), A::ShortShortInt(-8));
        t.insert("u8".into(), A::ShortShortUInt(8));
        t.insert("i16".into(), A::ShortInt(-16));
        t.insert("u16".into(), A::ShortUInt(16));
        t.insert("i32".into(), A::LongInt(-32));
        t.insert("u32".into(), A::LongUInt(32));
        t.insert("i64".into(), A::LongLongInt(-64));
        t.insert("f32".into(), A::Float(0.25));
        t.insert("f64".into(), A::Double(0.125));
        t.insert(
            "dec".into(),
            A::DecimalValue(DecimalValue { scale: 2, value: 5 }),
        );
        t.insert("str".into(), A::LongString(LongString::from("s")));
        t.insert("bin".into(), A::ByteArray(ByteArray::from(vec![1u8, 2])));
        t.insert("ts".into(), A::Timestamp(7));
        t.insert("void".into(), A::Void);
        t.insert("tbl".into(), A::FieldTable(inner.clone()));
        t.insert(
            "arr".into(),
            A::FieldArray(FieldArray::from(vec![A::FieldTable(inner), A::Void])),
        );
        t
    }

    #[test]
    fn what_amq_protocol_writes_round_trips_and_what_we_write_it_reads_alike() {
        let raw = amq_protocol_block(amq_protocol_table());
        assert_eq!(round_trip(&raw), raw);
        let ours = round_trip(&raw);
        assert_eq!(parse_properties(&ours), parse_properties(&raw));
    }

    #[test]
    fn header_lookup_matches_the_amq_protocol_lookup_it_replaces() {
        for raw in [
            every_property_block(),
            amq_protocol_block(amq_protocol_table()),
        ] {
            let old = parse_properties(&raw).unwrap();
            let old = table_to_json(old.headers().as_ref().unwrap());
            let new = lookup(&raw);
            for (k, v) in old.as_object().unwrap() {
                assert_eq!(new.header(k).as_ref(), Some(v), "header {k}");
            }
            assert_eq!(new.header("absent"), None);
            // The same headers stored in Weir's format look the same.
            let p = amqp_to_properties(&raw).unwrap();
            let weir = p.to_bytes().unwrap();
            let registry = codecs();
            let stored = LazyLookup::new(HeaderFormat::WEIR, &weir, &registry);
            for (k, v) in old.as_object().unwrap() {
                assert_eq!(stored.header(k).as_ref(), Some(v), "stored header {k}");
            }
        }
        // A headers binding routes an AMQP and a converted message alike.
        let raw = every_property_block();
        let weir = amqp_to_properties(&raw).unwrap().to_bytes().unwrap();
        let binding = serde_json::json!({"x-match": "all", "u8": 255, "str": "héllo"});
        assert!(headers_match(&binding, &lookup(&raw)));
        assert!(headers_match(
            &binding,
            &LazyLookup::new(HeaderFormat::WEIR, &weir, &codecs())
        ));
        let miss = serde_json::json!({"x-match": "all", "u8": 254});
        assert!(!headers_match(&miss, &lookup(&raw)));
        // Headers lookups do not care about a bad expiration (as before).
        let odd = Block::default()
            .table(&every_type_table())
            .short(P_EXPIRATION, b"soon")
            .bytes();
        assert_eq!(lookup(&odd).header("u8"), Some(serde_json::json!(255)));
    }

    #[test]
    fn properties_from_elsewhere_fit_amqp() {
        // An MQTT 5 publish: binary correlation data, a long response topic,
        // repeated string user properties, a key too long for AMQP.
        let mut user = Table::new();
        user.push("region", PValue::String("eu".into()));
        user.push("region", PValue::String("us".into()));
        user.push("k".repeat(300), PValue::String("dropped".into()));
        user.push("small", PValue::U64(5));
        let long_topic = "r/".repeat(200);
        let p = Properties {
            content_type: Some("text/plain".into()),
            headers: Some(user),
            delivery_mode: Some(DeliveryMode::Persistent),
            correlation_id: Some(vec![0xde, 0xad, 0xbe, 0xef]),
            reply_to: Some(long_topic.clone()),
            ttl_ms: Some(30_000),
            expires_at_ms: Some(1_700_000_030_000),
            payload_utf8: Some(true),
            ..Default::default()
        };
        let mut out = Vec::new();
        properties_to_amqp(&p, &mut out).unwrap();
        // `amq-protocol` (so lapin, and the broker's own publish check) reads it.
        let parsed = parse_properties(&out).expect("amq-protocol parses it");
        assert_eq!(
            parsed.content_type().as_ref().map(|s| s.as_str()),
            Some("text/plain")
        );
        assert_eq!(*parsed.delivery_mode(), Some(2));
        assert_eq!(
            parsed.expiration().as_ref().map(|s| s.as_str()),
            Some("30000")
        );
        assert!(parsed.correlation_id().is_none() && parsed.reply_to().is_none());

        let back = amqp_to_properties(&out).unwrap();
        let h = back.headers.unwrap();
        assert_eq!(
            h.0,
            vec![
                ("region".to_string(), PValue::String("eu".into())),
                ("region".to_string(), PValue::String("us".into())),
                ("small".to_string(), PValue::I64(5)),
                (
                    "x-correlation-id".to_string(),
                    PValue::Bytes(vec![0xde, 0xad, 0xbe, 0xef])
                ),
                ("x-reply-to".to_string(), PValue::String(long_topic)),
            ]
        );
        assert_eq!(back.ttl_ms, Some(30_000));
        assert_eq!((back.expires_at_ms, back.payload_utf8), (None, None));

        // Short UTF-8 correlation data stays the property.
        let p = Properties {
            correlation_id: Some(b"req-7".to_vec()),
            ..Default::default()
        };
        let mut out = Vec::new();
        properties_to_amqp(&p, &mut out).unwrap();
        assert_eq!(amqp_to_properties(&out).unwrap(), p);
    }

    #[test]
    fn malformed_blocks_are_typed_errors_never_panics() {
        // Truncations of a valid block.
        let raw = every_property_block();
        for cut in 0..raw.len() {
            assert!(amqp_to_properties(&raw[..cut]).is_err(), "cut at {cut}");
        }
        // Deep nesting: refused at MAX_DEPTH, no stack overflow.
        let mut v = vec![b'V'];
        for _ in 0..10_000 {
            let mut outer = vec![b'A'];
            outer.extend_from_slice(&long(&v));
            v = outer;
        }
        let mut t = vec![1, b'k'];
        t.extend_from_slice(&v);
        let deep = Block::default().table(&t).bytes();
        assert_eq!(amqp_to_properties(&deep), Err(PropertiesError::TooDeep));
        assert_eq!(amqp_headers(&deep), Err(PropertiesError::TooDeep));
        // Unknown letter, bad UTF-8 in a short string, trailing bytes.
        let mut t = Vec::new();
        entry(&mut t, "k", b'?', &[]);
        assert_eq!(
            amqp_to_properties(&Block::default().table(&t).bytes()),
            Err(PropertiesError::UnknownTag(b'?'))
        );
        assert_eq!(
            amqp_to_properties(&Block::default().short(P_TYPE, &[0xff]).bytes()),
            Err(PropertiesError::InvalidUtf8)
        );
        assert_eq!(
            amqp_to_properties(&[0, 0, 1]),
            Err(PropertiesError::TrailingBytes(1))
        );
        // Random bytes, and random bit flips of a valid block.
        let mut x = 0x1234_5678_9abc_def0u64;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for _ in 0..20_000 {
            let n = (next() % 48) as usize;
            let g: Vec<u8> = (0..n).map(|_| next() as u8).collect();
            let _ = amqp_to_properties(&g);
            let _ = amqp_headers(&g);
        }
        for _ in 0..5_000 {
            let mut b = raw.clone();
            let i = (next() % b.len() as u64) as usize;
            b[i] ^= 1 << (next() % 8);
            if let Ok(p) = amqp_to_properties(&b) {
                let mut out = Vec::new();
                properties_to_amqp(&p, &mut out).expect("what decodes encodes");
                assert!(amqp_to_properties(&out).is_ok());
            }
        }
    }

    #[test]
    fn codec_is_registered_and_passes_amqp_through() {
        assert_eq!(codecs().get(AMQP_091).map(|c| c.format()), Ok(AMQP_091));
        let raw = Bytes::from(every_property_block());
        let h = MessageHeader::new(AMQP_091, raw.clone());
        let same = h.encode_as(AMQP_091, &codecs()).unwrap();
        assert_eq!(same.as_ptr(), raw.as_ptr(), "AMQP → AMQP: no copy");
        let weir = h.encode_as(HeaderFormat::WEIR, &codecs()).unwrap();
        assert_eq!(
            Properties::decode(&weir).unwrap(),
            h.properties(&codecs()).unwrap()
        );
    }

    #[test]
    fn may_have_rules_out_headers_cheaply_and_never_misses_one() {
        let mut t = Vec::new();
        entry(&mut t, "CC", b'S', &long(b"k"));
        let with_cc = Block::default()
            .short(P_CONTENT_TYPE, b"text/plain")
            .table(&t)
            .bytes();
        let h = lookup(&with_cc);
        assert!(h.may_have("CC"));
        assert!(h.header("CC").is_some());
        // BCC's bytes contain "CC" but not its length-prefixed key.
        assert!(!h.may_have("BCC"));
        // No headers flag: nothing to find, whatever the other fields say.
        let no_table = Block::default().short(P_CONTENT_TYPE, b"\x02CC").bytes();
        assert!(!lookup(&no_table).may_have("CC"));
        // Hostile blocks (truncated, empty, absurd names) never panic and
        // err on the side of parsing.
        for raw in [&[][..], &[0x20][..], &with_cc[..with_cc.len() / 2]] {
            let h = lookup(raw);
            let _ = h.may_have("CC");
            assert!(h.header("CC").is_none() || raw.len() > 2);
        }
        assert!(lookup(&with_cc).may_have(""));
        assert!(lookup(&with_cc).may_have(&"x".repeat(300)));
    }
}
