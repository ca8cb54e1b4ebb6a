//! The engine's own encoding of [`Properties`] (the bytes of
//! [`HeaderFormat::WEIR`](super::HeaderFormat::WEIR)), and the bounds-checked
//! [`Reader`] the adapters' codecs read with too.

use bytes::Bytes;

use super::{DeliveryMode, Properties, PropertiesError, Table, Value};

/// Version byte leading every [`Properties::encode`] output.
pub const FORMAT_VERSION: u8 = 1;

/// Deepest nesting of tables and arrays accepted (the headers table itself is
/// level 1). The same limit as the AMQP adapter's, so any AMQP header it
/// accepted can be stored in this format.
pub const MAX_DEPTH: usize = 32;

// Presence bits of the encoding, in field order.
const F_CONTENT_TYPE: u16 = 1 << 0;
const F_CONTENT_ENCODING: u16 = 1 << 1;
const F_HEADERS: u16 = 1 << 2;
const F_DELIVERY_MODE: u16 = 1 << 3;
const F_PRIORITY: u16 = 1 << 4;
const F_CORRELATION_ID: u16 = 1 << 5;
const F_REPLY_TO: u16 = 1 << 6;
const F_TTL: u16 = 1 << 7;
const F_EXPIRES_AT: u16 = 1 << 8;
const F_MESSAGE_ID: u16 = 1 << 9;
const F_TIMESTAMP: u16 = 1 << 10;
const F_KIND: u16 = 1 << 11;
const F_USER_ID: u16 = 1 << 12;
const F_APP_ID: u16 = 1 << 13;
const F_CLUSTER_ID: u16 = 1 << 14;
const F_PAYLOAD_UTF8: u16 = 1 << 15;

// Value tags of the encoding. Never renumbered; new types get new tags.
const T_VOID: u8 = 0;
const T_BOOL: u8 = 1;
const T_I8: u8 = 2;
const T_U8: u8 = 3;
const T_I16: u8 = 4;
const T_U16: u8 = 5;
const T_I32: u8 = 6;
const T_U32: u8 = 7;
const T_I64: u8 = 8;
const T_U64: u8 = 9;
const T_F32: u8 = 10;
const T_F64: u8 = 11;
const T_DECIMAL: u8 = 12;
const T_STRING: u8 = 13;
const T_BYTES: u8 = 14;
const T_TIMESTAMP: u8 = 15;
const T_ARRAY: u8 = 16;
const T_TABLE: u8 = 17;

impl Properties {
    /// Appends this in the store's encoding: a version byte
    /// ([`FORMAT_VERSION`]), a 16-bit little-endian presence mask, then each
    /// present field in order (strings and byte strings length-prefixed with
    /// a LEB128 varint; tables and arrays count-prefixed; values tagged).
    /// Fails only for tables nested deeper than [`MAX_DEPTH`], leaving `out`
    /// as it was.
    pub fn encode(&self, out: &mut Vec<u8>) -> Result<(), PropertiesError> {
        let start = out.len();
        let r = self.encode_inner(out);
        if r.is_err() {
            out.truncate(start);
        }
        r
    }

    /// [`Properties::encode`] into a new buffer.
    pub fn to_bytes(&self) -> Result<Bytes, PropertiesError> {
        let mut out = Vec::with_capacity(32);
        self.encode(&mut out)?;
        Ok(Bytes::from(out))
    }

    fn encode_inner(&self, out: &mut Vec<u8>) -> Result<(), PropertiesError> {
        out.push(FORMAT_VERSION);
        let mut flags = 0u16;
        let mut set = |present: bool, bit: u16| {
            if present {
                flags |= bit;
            }
        };
        set(self.content_type.is_some(), F_CONTENT_TYPE);
        set(self.content_encoding.is_some(), F_CONTENT_ENCODING);
        set(self.headers.is_some(), F_HEADERS);
        set(self.delivery_mode.is_some(), F_DELIVERY_MODE);
        set(self.priority.is_some(), F_PRIORITY);
        set(self.correlation_id.is_some(), F_CORRELATION_ID);
        set(self.reply_to.is_some(), F_REPLY_TO);
        set(self.ttl_ms.is_some(), F_TTL);
        set(self.expires_at_ms.is_some(), F_EXPIRES_AT);
        set(self.message_id.is_some(), F_MESSAGE_ID);
        set(self.timestamp.is_some(), F_TIMESTAMP);
        set(self.kind.is_some(), F_KIND);
        set(self.user_id.is_some(), F_USER_ID);
        set(self.app_id.is_some(), F_APP_ID);
        set(self.cluster_id.is_some(), F_CLUSTER_ID);
        set(self.payload_utf8.is_some(), F_PAYLOAD_UTF8);
        out.extend_from_slice(&flags.to_le_bytes());
        let put_str = |out: &mut Vec<u8>, s: &Option<String>| {
            if let Some(s) = s {
                put_bytes(out, s.as_bytes());
            }
        };
        put_str(out, &self.content_type);
        put_str(out, &self.content_encoding);
        if let Some(t) = &self.headers {
            put_table(out, t, 1)?;
        }
        if let Some(m) = self.delivery_mode {
            out.push(match m {
                DeliveryMode::Transient => 1,
                DeliveryMode::Persistent => 2,
            });
        }
        if let Some(p) = self.priority {
            out.push(p);
        }
        if let Some(c) = &self.correlation_id {
            put_bytes(out, c);
        }
        put_str(out, &self.reply_to);
        if let Some(t) = self.ttl_ms {
            put_varint(out, t);
        }
        if let Some(t) = self.expires_at_ms {
            put_varint(out, t);
        }
        put_str(out, &self.message_id);
        if let Some(t) = self.timestamp {
            put_varint(out, t);
        }
        put_str(out, &self.kind);
        put_str(out, &self.user_id);
        put_str(out, &self.app_id);
        put_str(out, &self.cluster_id);
        if let Some(u) = self.payload_utf8 {
            out.push(u as u8);
        }
        Ok(())
    }

    /// Decodes [`Properties::encode`]'s output. Bounds-checked and strict:
    /// every length is checked against the input before anything is
    /// allocated, nesting is limited to [`MAX_DEPTH`], and only the one
    /// canonical encoding of each value is accepted (so decoding then
    /// encoding gives back the input byte for byte).
    pub fn decode(b: &[u8]) -> Result<Properties, PropertiesError> {
        let (&version, rest) = b.split_first().ok_or(PropertiesError::Empty)?;
        if version != FORMAT_VERSION {
            return Err(PropertiesError::UnknownVersion(version));
        }
        let mut r = Reader { b: rest };
        let f = r.take(2)?;
        let flags = u16::from_le_bytes([f[0], f[1]]);
        let has = |bit: u16| flags & bit != 0;
        let mut p = Properties::default();
        if has(F_CONTENT_TYPE) {
            p.content_type = Some(r.string()?);
        }
        if has(F_CONTENT_ENCODING) {
            p.content_encoding = Some(r.string()?);
        }
        if has(F_HEADERS) {
            p.headers = Some(r.table(1)?);
        }
        if has(F_DELIVERY_MODE) {
            p.delivery_mode = Some(match r.u8()? {
                1 => DeliveryMode::Transient,
                2 => DeliveryMode::Persistent,
                _ => return Err(PropertiesError::Invalid("delivery mode")),
            });
        }
        if has(F_PRIORITY) {
            p.priority = Some(r.u8()?);
        }
        if has(F_CORRELATION_ID) {
            p.correlation_id = Some(r.bytes()?.to_vec());
        }
        if has(F_REPLY_TO) {
            p.reply_to = Some(r.string()?);
        }
        if has(F_TTL) {
            p.ttl_ms = Some(r.varint()?);
        }
        if has(F_EXPIRES_AT) {
            p.expires_at_ms = Some(r.varint()?);
        }
        if has(F_MESSAGE_ID) {
            p.message_id = Some(r.string()?);
        }
        if has(F_TIMESTAMP) {
            p.timestamp = Some(r.varint()?);
        }
        if has(F_KIND) {
            p.kind = Some(r.string()?);
        }
        if has(F_USER_ID) {
            p.user_id = Some(r.string()?);
        }
        if has(F_APP_ID) {
            p.app_id = Some(r.string()?);
        }
        if has(F_CLUSTER_ID) {
            p.cluster_id = Some(r.string()?);
        }
        if has(F_PAYLOAD_UTF8) {
            p.payload_utf8 = Some(match r.u8()? {
                0 => false,
                1 => true,
                _ => return Err(PropertiesError::Invalid("payload format indicator")),
            });
        }
        if !r.b.is_empty() {
            return Err(PropertiesError::TrailingBytes(r.b.len()));
        }
        Ok(p)
    }
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    put_varint(out, b.len() as u64);
    out.extend_from_slice(b);
}

fn put_table(out: &mut Vec<u8>, t: &Table, depth: usize) -> Result<(), PropertiesError> {
    if depth > MAX_DEPTH {
        return Err(PropertiesError::TooDeep);
    }
    put_varint(out, t.0.len() as u64);
    for (k, v) in &t.0 {
        put_bytes(out, k.as_bytes());
        put_value(out, v, depth)?;
    }
    Ok(())
}

/// `depth`: the nesting level of the container holding `v`.
fn put_value(out: &mut Vec<u8>, v: &Value, depth: usize) -> Result<(), PropertiesError> {
    match v {
        Value::Void => out.push(T_VOID),
        Value::Bool(b) => out.extend_from_slice(&[T_BOOL, *b as u8]),
        Value::I8(i) => out.extend_from_slice(&[T_I8, *i as u8]),
        Value::U8(i) => out.extend_from_slice(&[T_U8, *i]),
        Value::I16(i) => {
            out.push(T_I16);
            out.extend_from_slice(&i.to_le_bytes());
        }
        Value::U16(i) => {
            out.push(T_U16);
            out.extend_from_slice(&i.to_le_bytes());
        }
        Value::I32(i) => {
            out.push(T_I32);
            out.extend_from_slice(&i.to_le_bytes());
        }
        Value::U32(i) => {
            out.push(T_U32);
            out.extend_from_slice(&i.to_le_bytes());
        }
        Value::I64(i) => {
            out.push(T_I64);
            out.extend_from_slice(&i.to_le_bytes());
        }
        Value::U64(i) => {
            out.push(T_U64);
            out.extend_from_slice(&i.to_le_bytes());
        }
        Value::F32(f) => {
            out.push(T_F32);
            out.extend_from_slice(&f.to_bits().to_le_bytes());
        }
        Value::F64(f) => {
            out.push(T_F64);
            out.extend_from_slice(&f.to_bits().to_le_bytes());
        }
        Value::Decimal { scale, value } => {
            out.extend_from_slice(&[T_DECIMAL, *scale]);
            out.extend_from_slice(&value.to_le_bytes());
        }
        Value::String(s) => {
            out.push(T_STRING);
            put_bytes(out, s.as_bytes());
        }
        Value::Bytes(b) => {
            out.push(T_BYTES);
            put_bytes(out, b);
        }
        Value::Timestamp(t) => {
            out.push(T_TIMESTAMP);
            out.extend_from_slice(&t.to_le_bytes());
        }
        Value::Array(a) => {
            if depth + 1 > MAX_DEPTH {
                return Err(PropertiesError::TooDeep);
            }
            out.push(T_ARRAY);
            put_varint(out, a.len() as u64);
            for v in a {
                put_value(out, v, depth + 1)?;
            }
        }
        Value::Table(t) => {
            out.push(T_TABLE);
            put_table(out, t, depth + 1)?;
        }
    }
    Ok(())
}

/// A bounds-checked cursor over bytes: every read that runs past the end is
/// [`PropertiesError::Truncated`]. The store encoding here and the
/// adapters' header codecs read with it.
pub struct Reader<'a> {
    b: &'a [u8],
}

impl<'a> Reader<'a> {
    /// A cursor at the start of `b`.
    pub fn new(b: &'a [u8]) -> Self {
        Reader { b }
    }

    /// Whether every byte was read.
    pub fn is_empty(&self) -> bool {
        self.b.is_empty()
    }

    /// Bytes not read yet.
    pub fn remaining(&self) -> usize {
        self.b.len()
    }

    /// The next `n` bytes.
    pub fn take(&mut self, n: usize) -> Result<&'a [u8], PropertiesError> {
        if self.b.len() < n {
            return Err(PropertiesError::Truncated);
        }
        let (h, t) = self.b.split_at(n);
        self.b = t;
        Ok(h)
    }

    /// The next `N` bytes as an array.
    pub fn array<const N: usize>(&mut self) -> Result<[u8; N], PropertiesError> {
        let s = self.take(N)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    /// The next byte.
    pub fn u8(&mut self) -> Result<u8, PropertiesError> {
        Ok(self.take(1)?[0])
    }

    /// LEB128, at most 10 bytes, canonical (no trailing zero groups).
    fn varint(&mut self) -> Result<u64, PropertiesError> {
        let mut v = 0u64;
        for i in 0..10 {
            let byte = self.u8()?;
            let group = (byte & 0x7f) as u64;
            if i == 9 && group > 1 {
                return Err(PropertiesError::BadVarint);
            }
            v |= group << (7 * i);
            if byte & 0x80 == 0 {
                if i > 0 && byte == 0 {
                    return Err(PropertiesError::BadVarint);
                }
                return Ok(v);
            }
        }
        Err(PropertiesError::BadVarint)
    }

    /// A count or length, checked against what is left: each counted item
    /// takes at least `min_item` bytes, so nothing larger than the input
    /// itself is ever allocated.
    fn count(&mut self, min_item: usize) -> Result<usize, PropertiesError> {
        let n = self.varint()?;
        let n = usize::try_from(n).map_err(|_| PropertiesError::Truncated)?;
        if n.saturating_mul(min_item) > self.b.len() {
            return Err(PropertiesError::Truncated);
        }
        Ok(n)
    }

    fn bytes(&mut self) -> Result<&'a [u8], PropertiesError> {
        let n = self.count(1)?;
        self.take(n)
    }

    fn string(&mut self) -> Result<String, PropertiesError> {
        let b = self.bytes()?;
        std::str::from_utf8(b)
            .map(str::to_owned)
            .map_err(|_| PropertiesError::InvalidUtf8)
    }

    fn table(&mut self, depth: usize) -> Result<Table, PropertiesError> {
        if depth > MAX_DEPTH {
            return Err(PropertiesError::TooDeep);
        }
        // An entry is at least a key length byte and a tag.
        let n = self.count(2)?;
        let mut t = Vec::with_capacity(n);
        for _ in 0..n {
            let k = self.string()?;
            let v = self.value(depth)?;
            t.push((k, v));
        }
        Ok(Table(t))
    }

    fn value(&mut self, depth: usize) -> Result<Value, PropertiesError> {
        Ok(match self.u8()? {
            T_VOID => Value::Void,
            T_BOOL => match self.u8()? {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                _ => return Err(PropertiesError::Invalid("boolean")),
            },
            T_I8 => Value::I8(self.u8()? as i8),
            T_U8 => Value::U8(self.u8()?),
            T_I16 => Value::I16(i16::from_le_bytes(self.array()?)),
            T_U16 => Value::U16(u16::from_le_bytes(self.array()?)),
            T_I32 => Value::I32(i32::from_le_bytes(self.array()?)),
            T_U32 => Value::U32(u32::from_le_bytes(self.array()?)),
            T_I64 => Value::I64(i64::from_le_bytes(self.array()?)),
            T_U64 => Value::U64(u64::from_le_bytes(self.array()?)),
            T_F32 => Value::F32(f32::from_bits(u32::from_le_bytes(self.array()?))),
            T_F64 => Value::F64(f64::from_bits(u64::from_le_bytes(self.array()?))),
            T_DECIMAL => {
                let scale = self.u8()?;
                Value::Decimal {
                    scale,
                    value: u32::from_le_bytes(self.array()?),
                }
            }
            T_STRING => Value::String(self.string()?),
            T_BYTES => Value::Bytes(self.bytes()?.to_vec()),
            T_TIMESTAMP => Value::Timestamp(u64::from_le_bytes(self.array()?)),
            T_ARRAY => {
                if depth + 1 > MAX_DEPTH {
                    return Err(PropertiesError::TooDeep);
                }
                let n = self.count(1)?;
                let mut a = Vec::with_capacity(n);
                for _ in 0..n {
                    a.push(self.value(depth + 1)?);
                }
                Value::Array(a)
            }
            T_TABLE => Value::Table(self.table(depth + 1)?),
            other => return Err(PropertiesError::UnknownTag(other)),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// xorshift64*: deterministic, seedable, no dependency.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }
        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }
        fn chance(&mut self, one_in: u64) -> bool {
            self.below(one_in) == 0
        }
        fn string(&mut self) -> String {
            let n = self.below(12);
            (0..n)
                .map(|_| match self.below(4) {
                    0 => 'é',
                    1 => '✓',
                    _ => (b'a' + self.below(26) as u8) as char,
                })
                .collect()
        }
        fn bytes(&mut self) -> Vec<u8> {
            let n = self.below(12);
            (0..n).map(|_| self.next() as u8).collect()
        }
        fn opt_string(&mut self) -> Option<String> {
            self.chance(2).then(|| self.string())
        }
    }

    fn random_value(r: &mut Rng, depth: usize) -> Value {
        let kinds = if depth >= 4 { 16 } else { 18 };
        match r.below(kinds) {
            0 => Value::Void,
            1 => Value::Bool(r.chance(2)),
            2 => Value::I8(r.next() as i8),
            3 => Value::U8(r.next() as u8),
            4 => Value::I16(r.next() as i16),
            5 => Value::U16(r.next() as u16),
            6 => Value::I32(r.next() as i32),
            7 => Value::U32(r.next() as u32),
            8 => Value::I64(r.next() as i64),
            9 => Value::U64(r.next()),
            // Any bit pattern, NaNs and infinities included.
            10 => Value::F32(f32::from_bits(r.next() as u32)),
            11 => Value::F64(f64::from_bits(r.next())),
            12 => Value::Decimal {
                scale: r.next() as u8,
                value: r.next() as u32,
            },
            13 => Value::String(r.string()),
            14 => Value::Bytes(r.bytes()),
            15 => Value::Timestamp(r.next()),
            16 => Value::Array(
                (0..r.below(4))
                    .map(|_| random_value(r, depth + 1))
                    .collect(),
            ),
            _ => Value::Table(random_table(r, depth + 1)),
        }
    }

    fn random_table(r: &mut Rng, depth: usize) -> Table {
        let mut t = Table::new();
        for _ in 0..r.below(5) {
            // Few distinct keys, so repeats happen.
            let k = if r.chance(3) {
                "dup".into()
            } else {
                r.string()
            };
            t.push(k, random_value(r, depth));
        }
        t
    }

    fn random_properties(r: &mut Rng) -> Properties {
        let num = |r: &mut Rng| {
            r.chance(2).then(|| match r.below(3) {
                0 => r.below(200),
                1 => u64::MAX,
                _ => r.next(),
            })
        };
        Properties {
            content_type: r.opt_string(),
            content_encoding: r.opt_string(),
            headers: r.chance(2).then(|| random_table(r, 1)),
            delivery_mode: r.chance(2).then(|| {
                if r.chance(2) {
                    DeliveryMode::Persistent
                } else {
                    DeliveryMode::Transient
                }
            }),
            priority: r.chance(2).then(|| r.next() as u8),
            correlation_id: r.chance(2).then(|| r.bytes()),
            reply_to: r.opt_string(),
            ttl_ms: num(r),
            expires_at_ms: num(r),
            message_id: r.opt_string(),
            timestamp: num(r),
            kind: r.opt_string(),
            user_id: r.opt_string(),
            app_id: r.opt_string(),
            cluster_id: r.opt_string(),
            payload_utf8: r.chance(2).then(|| r.chance(2)),
        }
    }

    #[test]
    fn randomized_round_trip() {
        let mut r = Rng(0x9e37_79b9_7f4a_7c15);
        for _ in 0..5_000 {
            let p = random_properties(&mut r);
            let b = p.to_bytes().expect("within depth");
            let back = Properties::decode(&b).expect("decodes");
            assert_eq!(back, p);
            // Canonical: re-encoding gives the same bytes.
            assert_eq!(back.to_bytes().unwrap(), b);
        }
    }

    #[test]
    fn empty_properties_are_three_bytes() {
        let b = Properties::default().to_bytes().unwrap();
        assert_eq!(&b[..], &[FORMAT_VERSION, 0, 0]);
        assert_eq!(Properties::decode(&b).unwrap(), Properties::default());
    }

    /// Garbage, truncations and single-byte corruptions of valid encodings:
    /// never a panic; whatever decodes re-encodes to the same bytes.
    #[test]
    fn garbage_never_panics_and_accepted_input_is_canonical() {
        let mut r = Rng(42);
        let check = |b: &[u8]| {
            if let Ok(p) = Properties::decode(b) {
                assert_eq!(&p.to_bytes().unwrap()[..], b);
            }
        };
        for _ in 0..20_000 {
            let n = r.below(64) as usize;
            let mut g: Vec<u8> = (0..n).map(|_| r.next() as u8).collect();
            if let Some(first) = g.first_mut() {
                // Mostly the right version, so the fields get exercised.
                if !r.chance(8) {
                    *first = FORMAT_VERSION;
                }
            }
            check(&g);
        }
        for _ in 0..500 {
            let valid = random_properties(&mut r).to_bytes().unwrap();
            for cut in 0..valid.len() {
                assert!(Properties::decode(&valid[..cut]).is_err());
            }
            for _ in 0..20 {
                let mut b = valid.to_vec();
                let i = r.below(b.len() as u64) as usize;
                b[i] ^= 1 << r.below(8);
                check(&b);
            }
        }
    }

    #[test]
    fn hostile_lengths_and_nesting_are_refused_without_allocating() {
        // Headers present, table count = u64::MAX-ish.
        let mut b = vec![FORMAT_VERSION];
        b.extend_from_slice(&F_HEADERS.to_le_bytes());
        put_varint(&mut b, u64::MAX);
        assert_eq!(Properties::decode(&b), Err(PropertiesError::Truncated));
        // A string claiming 4 GiB.
        let mut b = vec![FORMAT_VERSION];
        b.extend_from_slice(&F_CONTENT_TYPE.to_le_bytes());
        put_varint(&mut b, 1 << 32);
        assert_eq!(Properties::decode(&b), Err(PropertiesError::Truncated));
        // Overlong and overflowing varints.
        let mut b = vec![FORMAT_VERSION];
        b.extend_from_slice(&F_TTL.to_le_bytes());
        b.extend_from_slice(&[0x80, 0x00]);
        assert_eq!(Properties::decode(&b), Err(PropertiesError::BadVarint));
        let mut b = vec![FORMAT_VERSION];
        b.extend_from_slice(&F_TTL.to_le_bytes());
        b.extend_from_slice(&[0xff; 10]);
        assert_eq!(Properties::decode(&b), Err(PropertiesError::BadVarint));
        // 10,000 nested arrays: refused at MAX_DEPTH, no stack overflow.
        let mut b = vec![FORMAT_VERSION];
        b.extend_from_slice(&F_HEADERS.to_le_bytes());
        b.extend_from_slice(&[1, 1, b'k']);
        for _ in 0..10_000 {
            b.extend_from_slice(&[T_ARRAY, 1]);
        }
        b.push(T_VOID);
        assert_eq!(Properties::decode(&b), Err(PropertiesError::TooDeep));
        // Unknown version, tag, trailing bytes.
        assert_eq!(
            Properties::decode(&[9, 0, 0]),
            Err(PropertiesError::UnknownVersion(9))
        );
        assert_eq!(Properties::decode(&[]), Err(PropertiesError::Empty));
        assert_eq!(
            Properties::decode(&[FORMAT_VERSION, 0, 0, 7]),
            Err(PropertiesError::TrailingBytes(1))
        );
        let mut b = vec![FORMAT_VERSION];
        b.extend_from_slice(&F_HEADERS.to_le_bytes());
        b.extend_from_slice(&[1, 1, b'k', 99]);
        assert_eq!(Properties::decode(&b), Err(PropertiesError::UnknownTag(99)));
    }

    fn nested(levels: usize) -> Value {
        let mut v = Value::Void;
        for _ in 0..levels {
            v = Value::Array(vec![v]);
        }
        v
    }

    #[test]
    fn depth_limit_is_the_same_on_both_sides() {
        // Headers table is level 1; MAX_DEPTH - 1 arrays inside reach the limit.
        let at_limit = Properties {
            headers: Some(Table(vec![("k".into(), nested(MAX_DEPTH - 1))])),
            ..Default::default()
        };
        let b = at_limit.to_bytes().expect("at the limit encodes");
        assert_eq!(Properties::decode(&b).unwrap(), at_limit);
        let over = Properties {
            headers: Some(Table(vec![("k".into(), nested(MAX_DEPTH))])),
            ..Default::default()
        };
        let mut out = vec![0xaa];
        assert_eq!(over.encode(&mut out), Err(PropertiesError::TooDeep));
        assert_eq!(
            out,
            vec![0xaa],
            "a failed encode leaves the buffer as it was"
        );
    }
}
