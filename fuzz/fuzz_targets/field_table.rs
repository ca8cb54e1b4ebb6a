//! A field table (length prefix first) or a basic property block through the
//! depth check, then `amq-protocol`. Invariants: whatever the check accepts,
//! `amq-protocol` parses no deeper than `MAX_DEPTH` and, when it parses,
//! spans exactly the bytes the check walked.
#![no_main]

use amq_protocol::types::{parsing::parse_field_table, AMQPValue, FieldTable};
use libfuzzer_sys::fuzz_target;
use weir_protocols::amqp::connection::parse_properties;
use weir_protocols::amqp::depth::{check_field_table, check_table_body, MAX_DEPTH};

fn table_depth(t: &FieldTable) -> usize {
    1 + t.inner().values().map(value_depth).max().unwrap_or(0)
}

fn value_depth(v: &AMQPValue) -> usize {
    match v {
        AMQPValue::FieldTable(t) => table_depth(t),
        AMQPValue::FieldArray(a) => 1 + a.as_slice().iter().map(value_depth).max().unwrap_or(0),
        _ => 0,
    }
}

fuzz_target!(|data: &[u8]| {
    if let Ok(span) = check_field_table(data) {
        if let Ok((rest, table)) = parse_field_table(data) {
            assert_eq!(
                data.len() - rest.len(),
                span,
                "check and parser disagree on the span"
            );
            assert!(
                table_depth(&table) <= MAX_DEPTH,
                "parsed deeper than the check allows"
            );
        }
    }
    // The same bytes as a table body (AMQPLAIN) and as a property block.
    let _ = check_table_body(data);
    if let Some(props) = parse_properties(data) {
        if let Some(h) = props.headers() {
            assert!(table_depth(h) <= MAX_DEPTH);
        }
    }
});
