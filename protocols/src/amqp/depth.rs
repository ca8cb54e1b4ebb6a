//! A bounded pre-check of field-table nesting.
//!
//! `amq-protocol` parses field tables and arrays recursively with no depth
//! limit, so a few kilobytes of nested arrays in a start-ok (before login) or
//! in message headers would overflow the stack and abort the broker. Before a
//! method, content header or SASL response that carries a table is handed to
//! `amq-protocol`, its tables are walked here with a depth limit. The walk is
//! itself recursive but bounded by [`MAX_DEPTH`].
//!
//! The walker reads the same grammar as `amq-protocol-types` (RabbitMQ's type
//! letters: `s` is a short int, not a short string), so a payload it accepts
//! is parsed there to the same extent and no deeper; a payload it cannot walk
//! is refused. Every method `amq-protocol` parses a table from is listed in
//! [`check_method`] (connection.start and start-ok, exchange.declare, bind,
//! unbind, queue.declare, bind, unbind, basic.consume), plus the content
//! header's `headers` ([`check_properties`]) and the AMQPLAIN response
//! ([`check_table_body`]).

/// Deepest nesting of tables and arrays accepted (RabbitMQ clients never come
/// close; x-death headers nest three levels).
pub const MAX_DEPTH: usize = 32;

/// Why a payload was refused.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum DepthError {
    /// Nested deeper than [`MAX_DEPTH`].
    #[error("field tables or arrays nested deeper than {MAX_DEPTH}")]
    TooDeep,
    /// Ran off the end or met an unknown field type.
    #[error("malformed field table")]
    Malformed,
}

struct Cur<'a> {
    b: &'a [u8],
}

impl<'a> Cur<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], DepthError> {
        if self.b.len() < n {
            return Err(DepthError::Malformed);
        }
        let (h, t) = self.b.split_at(n);
        self.b = t;
        Ok(h)
    }
    fn u8(&mut self) -> Result<u8, DepthError> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> Result<usize, DepthError> {
        let s = self.take(4)?;
        Ok(u32::from_be_bytes([s[0], s[1], s[2], s[3]]) as usize)
    }
    fn short_str(&mut self) -> Result<&'a [u8], DepthError> {
        let n = self.u8()? as usize;
        self.take(n)
    }
    fn long_str(&mut self) -> Result<&'a [u8], DepthError> {
        let n = self.u32()?;
        self.take(n)
    }
}

fn table(c: &mut Cur<'_>, depth: usize) -> Result<(), DepthError> {
    if depth > MAX_DEPTH {
        return Err(DepthError::TooDeep);
    }
    let len = c.u32()?;
    table_entries(c.take(len)?, depth)
}

/// The entries of a table whose length prefix was already read.
fn table_entries(b: &[u8], depth: usize) -> Result<(), DepthError> {
    let mut inner = Cur { b };
    while !inner.b.is_empty() {
        inner.short_str()?;
        value(&mut inner, depth)?;
    }
    Ok(())
}

fn array(c: &mut Cur<'_>, depth: usize) -> Result<(), DepthError> {
    if depth > MAX_DEPTH {
        return Err(DepthError::TooDeep);
    }
    let len = c.u32()?;
    let mut inner = Cur { b: c.take(len)? };
    while !inner.b.is_empty() {
        value(&mut inner, depth)?;
    }
    Ok(())
}

fn value(c: &mut Cur<'_>, depth: usize) -> Result<(), DepthError> {
    let n = match c.u8()? {
        b't' | b'b' | b'B' => 1,
        b's' | b'U' | b'u' => 2,
        b'I' | b'i' | b'f' => 4,
        b'L' | b'l' | b'd' | b'T' => 8,
        b'D' => 5,
        b'V' => 0,
        b'S' | b'x' => return c.long_str().map(|_| ()),
        b'F' => return table(c, depth + 1),
        b'A' => return array(c, depth + 1),
        _ => return Err(DepthError::Malformed),
    };
    c.take(n).map(|_| ())
}

/// Checks the tables in a method's arguments (`args`: the payload after class
/// and method ids). Methods without tables always pass.
pub fn check_method(class_id: u16, method_id: u16, args: &[u8]) -> Result<(), DepthError> {
    check_method_limited(class_id, method_id, args, MAX_DEPTH)
}

/// [`check_method`] with a lower nesting limit (at most [`MAX_DEPTH`]): the
/// fuzz target uses 1 so that a table the check fails to walk shows up as
/// parsed nesting beyond the limit with a few bytes of input.
pub fn check_method_limited(
    class_id: u16,
    method_id: u16,
    args: &[u8],
    limit: usize,
) -> Result<(), DepthError> {
    // Starting deeper makes the walk refuse nesting beyond `limit`.
    let d = MAX_DEPTH - limit.min(MAX_DEPTH) + 1;
    let mut c = Cur { b: args };
    match (class_id, method_id) {
        // connection.start: version-major, version-minor, server-properties.
        // Only a server sends it, but `amq-protocol` parses whatever arrives,
        // so a client sending one must not reach its recursive parser either.
        (10, 10) => {
            c.take(2)?;
            table(&mut c, d)
        }
        // connection.start-ok: client-properties, mechanism, response,
        // locale. An AMQPLAIN response is a table body without its length
        // prefix, parsed as a table when the credentials are decoded.
        (10, 11) => {
            table(&mut c, d)?;
            let mechanism = c.short_str()?;
            let response = c.long_str()?;
            if mechanism == b"AMQPLAIN" {
                table_entries(response, d)?;
            }
            Ok(())
        }
        // exchange.declare: ticket, exchange, type, bits, arguments.
        (40, 10) => {
            c.take(2)?;
            c.short_str()?;
            c.short_str()?;
            c.take(1)?;
            table(&mut c, d)
        }
        // exchange.bind / unbind: ticket, destination, source, key, bits, arguments.
        (40, 30) | (40, 40) => {
            c.take(2)?;
            c.short_str()?;
            c.short_str()?;
            c.short_str()?;
            c.take(1)?;
            table(&mut c, d)
        }
        // queue.declare: ticket, queue, bits, arguments.
        (50, 10) => {
            c.take(2)?;
            c.short_str()?;
            c.take(1)?;
            table(&mut c, d)
        }
        // queue.bind: ticket, queue, exchange, key, bits, arguments.
        (50, 20) => {
            c.take(2)?;
            c.short_str()?;
            c.short_str()?;
            c.short_str()?;
            c.take(1)?;
            table(&mut c, d)
        }
        // queue.unbind: ticket, queue, exchange, key, arguments.
        (50, 50) => {
            c.take(2)?;
            c.short_str()?;
            c.short_str()?;
            c.short_str()?;
            table(&mut c, d)
        }
        // basic.consume: ticket, queue, tag, bits, arguments.
        (60, 20) => {
            c.take(2)?;
            c.short_str()?;
            c.short_str()?;
            c.take(1)?;
            table(&mut c, d)
        }
        _ => Ok(()),
    }
}

/// Checks a field table with its length prefix at the front of `b`; returns
/// the bytes it spans (prefix included), as `amq-protocol` would consume them.
pub fn check_field_table(b: &[u8]) -> Result<usize, DepthError> {
    let mut c = Cur { b };
    table(&mut c, 1)?;
    Ok(b.len() - c.b.len())
}

/// Checks the entries of a field table given without its length prefix, as
/// an AMQPLAIN response carries them.
pub fn check_table_body(b: &[u8]) -> Result<(), DepthError> {
    table_entries(b, 1)
}

/// Checks the `headers` table of a basic property block (flags first).
pub fn check_properties(props: &[u8]) -> Result<(), DepthError> {
    let mut c = Cur { b: props };
    let s = c.take(2)?;
    let flags = u16::from_be_bytes([s[0], s[1]]);
    if flags & (1 << 15) != 0 {
        c.short_str()?;
    }
    if flags & (1 << 14) != 0 {
        c.short_str()?;
    }
    if flags & (1 << 13) != 0 {
        table(&mut c, 1)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nested_arrays(levels: usize) -> Vec<u8> {
        // Innermost: an empty array.
        let mut v = vec![b'A', 0, 0, 0, 0];
        for _ in 1..levels {
            let mut outer = vec![b'A'];
            outer.extend_from_slice(&(v.len() as u32).to_be_bytes());
            outer.extend_from_slice(&v);
            v = outer;
        }
        // A table with one key "k" holding it.
        let mut t = vec![1, b'k'];
        t.extend_from_slice(&v);
        let mut out = (t.len() as u32).to_be_bytes().to_vec();
        out.extend_from_slice(&t);
        out
    }

    #[test]
    fn shallow_tables_pass_and_deep_ones_are_refused() {
        let mut args = nested_arrays(5);
        args.extend_from_slice(&[5, b'P', b'L', b'A', b'I', b'N']);
        args.extend_from_slice(&[0, 0, 0, 4, 0, b'u', 0, b'p', 0]);
        assert_eq!(check_method(10, 11, &args), Ok(()));
        let deep = nested_arrays(10_000);
        assert_eq!(check_method(10, 11, &deep), Err(DepthError::TooDeep));
    }

    #[test]
    fn field_table_span_matches_amq_protocol() {
        let t = nested_arrays(5);
        let mut b = t.clone();
        b.extend_from_slice(b"rest");
        assert_eq!(check_field_table(&b), Ok(t.len()));
        let (rest, _) =
            amq_protocol::types::parsing::parse_field_table(&b[..]).expect("amq-protocol parses");
        assert_eq!(rest, b"rest");
    }

    #[test]
    fn truncated_input_is_malformed_not_a_panic() {
        let deep = nested_arrays(10);
        for cut in 0..deep.len() {
            let _ = check_method(10, 11, &deep[..cut]);
        }
        assert_eq!(
            check_method(50, 10, &[0, 0, 3, b'a']),
            Err(DepthError::Malformed)
        );
    }
}
