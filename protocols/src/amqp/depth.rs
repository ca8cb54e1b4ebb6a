//! A bounded pre-check of field-table nesting.
//!
//! `amq-protocol` parses field tables and arrays recursively with no depth
//! limit, so a few kilobytes of nested arrays in a start-ok (before login) or
//! in message headers would overflow the stack and abort the broker. Before a
//! method or content header that carries a table is handed to the codec, its
//! tables are walked here with a depth limit. The walk is itself recursive but
//! bounded by [`MAX_DEPTH`].

/// Deepest nesting of tables and arrays accepted (RabbitMQ clients never come
/// close; x-death headers nest three levels).
pub const MAX_DEPTH: usize = 32;

/// Why a payload was refused.
#[derive(Debug, PartialEq, Eq)]
pub enum DepthError {
    /// Nested deeper than [`MAX_DEPTH`].
    TooDeep,
    /// Ran off the end or met an unknown field type.
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
    fn short_str(&mut self) -> Result<(), DepthError> {
        let n = self.u8()? as usize;
        self.take(n).map(|_| ())
    }
    fn long_str(&mut self) -> Result<(), DepthError> {
        let n = self.u32()?;
        self.take(n).map(|_| ())
    }
}

fn table(c: &mut Cur<'_>, depth: usize) -> Result<(), DepthError> {
    if depth > MAX_DEPTH {
        return Err(DepthError::TooDeep);
    }
    let len = c.u32()?;
    let mut inner = Cur { b: c.take(len)? };
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
        b'S' | b'x' => return c.long_str(),
        b'F' => return table(c, depth + 1),
        b'A' => return array(c, depth + 1),
        _ => return Err(DepthError::Malformed),
    };
    c.take(n).map(|_| ())
}

/// Checks the tables in a method's arguments (`args`: the payload after class
/// and method ids). Methods without tables always pass.
pub fn check_method(class_id: u16, method_id: u16, args: &[u8]) -> Result<(), DepthError> {
    let mut c = Cur { b: args };
    match (class_id, method_id) {
        // connection.start-ok: client-properties first.
        (10, 11) => table(&mut c, 1),
        // exchange.declare: ticket, exchange, type, bits, arguments.
        (40, 10) => {
            c.take(2)?;
            c.short_str()?;
            c.short_str()?;
            c.take(1)?;
            table(&mut c, 1)
        }
        // exchange.bind / unbind: ticket, destination, source, key, bits, arguments.
        (40, 30) | (40, 40) => {
            c.take(2)?;
            c.short_str()?;
            c.short_str()?;
            c.short_str()?;
            c.take(1)?;
            table(&mut c, 1)
        }
        // queue.declare: ticket, queue, bits, arguments.
        (50, 10) => {
            c.take(2)?;
            c.short_str()?;
            c.take(1)?;
            table(&mut c, 1)
        }
        // queue.bind: ticket, queue, exchange, key, bits, arguments.
        (50, 20) => {
            c.take(2)?;
            c.short_str()?;
            c.short_str()?;
            c.short_str()?;
            c.take(1)?;
            table(&mut c, 1)
        }
        // queue.unbind: ticket, queue, exchange, key, arguments.
        (50, 50) => {
            c.take(2)?;
            c.short_str()?;
            c.short_str()?;
            c.short_str()?;
            table(&mut c, 1)
        }
        // basic.consume: ticket, queue, tag, bits, arguments.
        (60, 20) => {
            c.take(2)?;
            c.short_str()?;
            c.short_str()?;
            c.take(1)?;
            table(&mut c, 1)
        }
        _ => Ok(()),
    }
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
        assert_eq!(check_method(10, 11, &args), Ok(()));
        let deep = nested_arrays(10_000);
        assert_eq!(check_method(10, 11, &deep), Err(DepthError::TooDeep));
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
