//! Plain-text tables for people: one column per field, padded to width.

use serde_json::Value;

/// The field at a dotted path (`message_stats.publish_details.rate`).
fn field<'a>(v: &'a Value, path: &str) -> Option<&'a Value> {
    path.split('.').try_fold(v, |v, k| v.get(k))
}

/// A value as a table cell: strings bare, rates with one decimal, lists
/// joined, missing as `-`.
fn cell(v: Option<&Value>) -> String {
    match v {
        None | Some(Value::Null) => "-".into(),
        Some(Value::String(s)) => s.clone(),
        Some(Value::Number(n)) if n.is_f64() => format!("{:.1}", n.as_f64().unwrap_or(0.0)),
        Some(Value::Array(a)) => a
            .iter()
            .map(|x| cell(Some(x)))
            .collect::<Vec<_>>()
            .join(","),
        Some(other) => other.to_string(),
    }
}

/// Renders `rows` with the `(header, field path)` columns.
pub fn render(rows: &[Value], cols: &[(&str, &str)]) -> String {
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|r| cols.iter().map(|(_, p)| cell(field(r, p))).collect())
        .collect();
    let widths: Vec<usize> = cols
        .iter()
        .enumerate()
        .map(|(i, (h, _))| {
            cells
                .iter()
                .map(|r| r[i].chars().count())
                .chain([h.len()])
                .max()
                .unwrap_or(0)
        })
        .collect();
    let line = |items: Vec<&str>| {
        let mut s = items
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect::<Vec<_>>()
            .join("  ");
        s.truncate(s.trim_end().len());
        s + "\n"
    };
    let mut out = line(cols.iter().map(|(h, _)| *h).collect());
    for r in &cells {
        out += &line(r.iter().map(String::as_str).collect());
    }
    out
}

/// `weirctl status`: the overview's figures and the alarms.
pub fn status(o: &Value, alarms: &Value) {
    let get = |p: &str| cell(field(o, p));
    println!("{} {}", get("product_name"), get("product_version"));
    let rows = [
        ("uptime ms", "uptime"),
        ("connections", "object_totals.connections"),
        ("channels", "object_totals.channels"),
        ("queues", "object_totals.queues"),
        ("consumers", "object_totals.consumers"),
        ("messages", "queue_totals.messages"),
        ("ready", "queue_totals.messages_ready"),
        ("unacked", "queue_totals.messages_unacknowledged"),
        ("publish/s", "message_stats.publish_details.rate"),
        ("deliver/s", "message_stats.deliver_get_details.rate"),
        ("ack/s", "message_stats.ack_details.rate"),
    ];
    for (label, path) in rows {
        println!("{label:<12} {}", get(path));
    }
    let state = alarms.get("status").and_then(Value::as_str).unwrap_or("ok");
    match alarms.get("reason").and_then(Value::as_str) {
        Some(reason) if state != "ok" => println!("{:<12} {state}: {reason}", "alarms"),
        _ => println!("{:<12} none", "alarms"),
    }
}
