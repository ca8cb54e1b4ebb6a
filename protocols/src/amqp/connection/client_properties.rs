//! The client properties of connection.start-ok (product, version,
//! platform, capabilities, connection_name, ...), kept for the management
//! API as a bounded copy: the frame is bounded by frame-max, but a client
//! may fill it with thousands of entries or deep tables, and the copy lives
//! as long as the connection. What does not fit is left out, not cut.

use amq_protocol::types::{AMQPValue, FieldArray, FieldTable};

/// Longest string (or byte array) value kept, bytes; longer ones are left
/// out.
pub const MAX_STRING: usize = 1024;
/// Nesting kept: the properties table and the tables and arrays in it
/// (`capabilities`); tables and arrays deeper than this are left out.
pub const MAX_DEPTH: usize = 2;
/// Entries (table fields and array elements) looked at, over every level.
pub const MAX_ENTRIES: usize = 64;
/// Bytes of keys and string values kept, over every level.
pub const MAX_BYTES: usize = 8 * 1024;

/// What is left to keep.
struct Budget {
    entries: usize,
    bytes: usize,
}

impl Budget {
    /// Takes `n` bytes if they fit.
    fn take(&mut self, n: usize) -> bool {
        if n > self.bytes {
            return false;
        }
        self.bytes -= n;
        true
    }
}

/// A copy of `t` within [`MAX_DEPTH`], [`MAX_ENTRIES`], [`MAX_BYTES`] and
/// [`MAX_STRING`].
pub(super) fn bounded(t: &FieldTable) -> FieldTable {
    let mut budget = Budget {
        entries: MAX_ENTRIES,
        bytes: MAX_BYTES,
    };
    table(t, 1, &mut budget)
}

fn table(t: &FieldTable, depth: usize, budget: &mut Budget) -> FieldTable {
    let mut out = FieldTable::default();
    for (k, v) in t.inner() {
        if budget.entries == 0 {
            break;
        }
        budget.entries -= 1;
        if !budget.take(k.as_str().len()) {
            continue;
        }
        if let Some(v) = value(v, depth, budget) {
            out.insert(k.clone(), v);
        }
    }
    out
}

/// `v` (found at `depth`) within the budget, or `None` if it does not fit.
fn value(v: &AMQPValue, depth: usize, budget: &mut Budget) -> Option<AMQPValue> {
    match v {
        AMQPValue::FieldTable(t) => {
            (depth < MAX_DEPTH).then(|| AMQPValue::FieldTable(table(t, depth + 1, budget)))
        }
        AMQPValue::FieldArray(a) => (depth < MAX_DEPTH).then(|| {
            let mut out = FieldArray::default();
            for v in a.as_slice() {
                if budget.entries == 0 {
                    break;
                }
                budget.entries -= 1;
                if let Some(v) = value(v, depth + 1, budget) {
                    out.push(v);
                }
            }
            AMQPValue::FieldArray(out)
        }),
        AMQPValue::LongString(s) => {
            (s.len() <= MAX_STRING && budget.take(s.len())).then(|| v.clone())
        }
        AMQPValue::ByteArray(b) => {
            (b.len() <= MAX_STRING && budget.take(b.len())).then(|| v.clone())
        }
        AMQPValue::ShortString(s) => budget.take(s.as_str().len()).then(|| v.clone()),
        _ => Some(v.clone()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn long(n: usize) -> AMQPValue {
        AMQPValue::LongString("x".repeat(n).into())
    }

    #[test]
    fn keeps_what_clients_send() {
        let mut caps = FieldTable::default();
        caps.insert("publisher_confirms".into(), AMQPValue::Boolean(true));
        caps.insert("connection.blocked".into(), AMQPValue::Boolean(true));
        let mut t = FieldTable::default();
        t.insert("product".into(), AMQPValue::LongString("lapin".into()));
        t.insert("version".into(), AMQPValue::ShortString("2.5".into()));
        t.insert("capabilities".into(), AMQPValue::FieldTable(caps));
        t.insert("port".into(), AMQPValue::LongInt(5672));
        assert_eq!(bounded(&t), t);
    }

    #[test]
    fn leaves_out_deep_long_and_many() {
        let mut deep = FieldTable::default();
        deep.insert("x".into(), AMQPValue::Boolean(true));
        let mut mid = FieldTable::default();
        mid.insert("deep".into(), AMQPValue::FieldTable(deep.clone()));
        mid.insert(
            "arr".into(),
            AMQPValue::FieldArray(vec![AMQPValue::FieldTable(deep)].into()),
        );
        mid.insert("ok".into(), AMQPValue::Boolean(false));
        let mut t = FieldTable::default();
        t.insert("mid".into(), AMQPValue::FieldTable(mid));
        t.insert("big".into(), long(MAX_STRING + 1));
        t.insert("fits".into(), long(MAX_STRING));
        let b = bounded(&t);
        let Some(AMQPValue::FieldTable(m)) = b.inner().get("mid") else {
            panic!("mid kept: {b:?}");
        };
        assert!(!m.contains_key("deep") && !m.contains_key("arr"), "{m:?}");
        assert_eq!(m.inner().get("ok"), Some(&AMQPValue::Boolean(false)));
        assert!(!b.contains_key("big") && b.contains_key("fits"), "{b:?}");

        // Thousands of entries: the first MAX_ENTRIES are looked at.
        let mut many = FieldTable::default();
        for i in 0..5000 {
            many.insert(format!("k{i:05}").into(), AMQPValue::Boolean(true));
        }
        assert_eq!(bounded(&many).inner().len(), MAX_ENTRIES);
        // Many long strings: at most MAX_BYTES of them.
        let mut wide = FieldTable::default();
        for i in 0..MAX_ENTRIES {
            wide.insert(format!("k{i:02}").into(), long(MAX_STRING));
        }
        let kept = bounded(&wide).inner().len();
        assert!(kept < MAX_BYTES / MAX_STRING, "{kept}");
    }
}
