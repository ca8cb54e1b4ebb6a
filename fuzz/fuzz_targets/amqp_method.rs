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

/// Nesting allowed here: low, so that a table the check does not walk is
/// caught with a few bytes (the broker uses `MAX_DEPTH`, 32).
const LIMIT: usize = 3;

/// Deepest bracket nesting in a `Debug` string, skipping quoted strings.
fn debug_depth(s: &str) -> usize {
    let (mut depth, mut max, mut in_str, mut escaped) = (0usize, 0usize, false, false);
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
                depth += 1;
                max = max.max(depth);
            }
            ')' | ']' | '}' => depth = depth.saturating_sub(1),
            _ => {}
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
        // Debug nesting: 3 for the method (`Queue(Declare(Declare {`), 2
        // for its table (`FieldTable({`), 3 per further table or array level
        // and up to 3 for a leaf (`LongString(LongString([`): 3·n + 5 for n
        // levels. Beyond that, amq-protocol parsed a table the check did not
        // walk to the limit.
        let d = debug_depth(&format!("{method:?}"));
        assert!(
            d <= 3 * LIMIT + 5,
            "parsed nesting {d} passed the depth check: {method:?}"
        );
    }
});
