//! One method payload (class id, method id, arguments) through the depth
//! check and then `amq-protocol`'s `parse_class`, as `Connection` does. The
//! invariant that matters: no method the check passes makes `amq-protocol`
//! recurse deeper than the limit. Depth is measured on the parsed value's
//! `Debug` form (bracket nesting outside strings), which needs no list of
//! which methods carry tables, so a table in a method the check forgot fails
//! here too.
#![no_main]

use libfuzzer_sys::fuzz_target;
use weir_protocols::amqp::depth::check_method_limited;

/// Nesting allowed here: tables without tables or arrays inside (the broker
/// uses `MAX_DEPTH`, 32), so that any nested table the check does not walk
/// shows up with a few bytes of input.
const LIMIT: usize = 1;

/// Deepest nesting of field tables and arrays in a `Debug` string: each
/// level prints as `FieldTable(FieldTable({` or `FieldArray(FieldArray([`, so
/// brackets opened right after those names count half a level each. Quoted
/// strings are skipped.
fn debug_depth(s: &str) -> usize {
    let mut stack: Vec<bool> = Vec::new();
    let (mut max, mut in_str, mut escaped) = (0usize, false, false);
    let mut ident = String::new();
    for ch in s.chars() {
        if in_str {
            match (escaped, ch) {
                (true, _) => escaped = false,
                (false, '\\') => escaped = true,
                (false, '"') => in_str = false,
                _ => {}
            }
            continue;
        }
        match ch {
            '"' => in_str = true,
            '(' | '[' | '{' => {
                stack.push(ch == '(' && (ident == "FieldTable" || ident == "FieldArray"));
                max = max.max(stack.iter().filter(|c| **c).count() / 2);
            }
            ')' | ']' | '}' => {
                stack.pop();
            }
            _ => {}
        }
        if ch.is_alphanumeric() || ch == '_' {
            ident.push(ch);
        } else {
            ident.clear();
        }
    }
    max
}

fuzz_target!(|data: &[u8]| {
    if data.len() < 4 {
        return;
    }
    let class_id = u16::from_be_bytes([data[0], data[1]]);
    let method_id = u16::from_be_bytes([data[2], data[3]]);
    if check_method_limited(class_id, method_id, &data[4..], LIMIT).is_err() {
        return;
    }
    if let Ok((_, method)) = amq_protocol::protocol::parse_class(data) {
        let d = debug_depth(&format!("{method:?}"));
        assert!(
            d <= LIMIT,
            "amq-protocol parsed tables {d} deep past a check limited to {LIMIT}: {method:?}"
        );
    }
});
