//! Exchanges, bindings and routing.

use super::queue::Queue;
use parking_lot::RwLock;
use serde_json::Value;
use std::collections::HashMap;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

/// The routing algorithm of an exchange.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ExchangeKind {
    /// Exact routing-key match.
    Direct,
    /// Every binding.
    Fanout,
    /// Dotted patterns with `*` (one word) and `#` (zero or more words).
    Topic,
    /// Header values, `x-match` all or any.
    Headers,
}

impl ExchangeKind {
    /// Parses an AMQP exchange type name.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "direct" => ExchangeKind::Direct,
            "fanout" => ExchangeKind::Fanout,
            "topic" => ExchangeKind::Topic,
            "headers" => ExchangeKind::Headers,
            _ => return None,
        })
    }

    /// The AMQP type name.
    pub fn as_str(self) -> &'static str {
        match self {
            ExchangeKind::Direct => "direct",
            ExchangeKind::Fanout => "fanout",
            ExchangeKind::Topic => "topic",
            ExchangeKind::Headers => "headers",
        }
    }
}

/// Definition of an exchange, as declared and as persisted.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ExchangeDef {
    /// Name.
    pub name: String,
    /// Type.
    pub kind: ExchangeKind,
    /// Survives restarts.
    pub durable: bool,
    /// Deleted when its last binding (as a source) goes.
    pub auto_delete: bool,
    /// Cannot be published to directly.
    pub internal: bool,
    /// Arguments.
    pub arguments: Value,
}

/// Where a binding leads.
#[derive(Clone)]
pub enum Destination {
    /// A queue.
    Queue(Arc<Queue>),
    /// Another exchange (exchange-to-exchange binding).
    Exchange(Arc<Exchange>),
}

impl Destination {
    fn same(&self, other: &Destination) -> bool {
        match (self, other) {
            (Destination::Queue(a), Destination::Queue(b)) => Arc::ptr_eq(a, b),
            (Destination::Exchange(a), Destination::Exchange(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }

    /// The destination's name.
    pub fn name(&self) -> &str {
        match self {
            Destination::Queue(q) => q.name(),
            Destination::Exchange(x) => &x.def.name,
        }
    }
}

/// One binding from an exchange.
#[derive(Clone)]
pub struct Binding {
    /// Where it leads.
    pub destination: Destination,
    /// Binding key.
    pub key: String,
    /// Arguments (headers-exchange match spec).
    pub arguments: Value,
    /// Topic pattern split into words (topic exchanges).
    words: Vec<String>,
}

/// An exchange.
pub struct Exchange {
    /// Definition.
    pub def: ExchangeDef,
    bindings: RwLock<Bindings>,
    /// Set once deleted.
    pub deleted: AtomicBool,
}

#[derive(Default)]
struct Bindings {
    all: Vec<Binding>,
    /// Direct exchanges: key → indexes into `all`.
    by_key: HashMap<String, Vec<usize>>,
}

impl Bindings {
    fn reindex(&mut self) {
        self.by_key.clear();
        for (i, b) in self.all.iter().enumerate() {
            self.by_key.entry(b.key.clone()).or_default().push(i);
        }
    }
}

/// What a headers exchange needs to see of a message's headers.
pub trait HeaderLookup {
    /// The header `name` as a JSON value, if present.
    fn header(&self, name: &str) -> Option<Value>;
}

impl Exchange {
    /// A new exchange with no bindings.
    pub fn new(def: ExchangeDef) -> Arc<Self> {
        Arc::new(Exchange {
            def,
            bindings: RwLock::new(Bindings::default()),
            deleted: AtomicBool::new(false),
        })
    }

    /// Adds a binding; returns false if an identical one exists.
    pub fn bind(&self, destination: Destination, key: &str, arguments: Value) -> bool {
        let mut b = self.bindings.write();
        if b.all
            .iter()
            .any(|x| x.destination.same(&destination) && x.key == key && x.arguments == arguments)
        {
            return false;
        }
        let words = key.split('.').map(str::to_string).collect();
        b.all.push(Binding {
            destination,
            key: key.to_string(),
            arguments,
            words,
        });
        b.reindex();
        true
    }

    /// Removes a binding; returns false if there was none.
    pub fn unbind(&self, destination: &Destination, key: &str, arguments: &Value) -> bool {
        let mut b = self.bindings.write();
        let before = b.all.len();
        b.all.retain(|x| {
            !(x.destination.same(destination) && x.key == key && &x.arguments == arguments)
        });
        let removed = b.all.len() != before;
        if removed {
            b.reindex();
        }
        removed
    }

    /// Removes every binding to `destination`; returns them.
    pub fn unbind_all_to(&self, destination: &Destination) -> Vec<Binding> {
        let mut b = self.bindings.write();
        let (gone, kept): (Vec<_>, Vec<_>) = b
            .all
            .drain(..)
            .partition(|x| x.destination.same(destination));
        b.all = kept;
        if !gone.is_empty() {
            b.reindex();
        }
        gone
    }

    /// Removes every binding from this exchange; returns them.
    pub fn unbind_everything(&self) -> Vec<Binding> {
        let mut b = self.bindings.write();
        b.by_key.clear();
        std::mem::take(&mut b.all)
    }

    /// Number of bindings with this exchange as source.
    pub fn binding_count(&self) -> usize {
        self.bindings.read().all.len()
    }

    /// A copy of the bindings.
    pub fn bindings(&self) -> Vec<Binding> {
        self.bindings.read().all.clone()
    }

    /// Adds to `out` every destination a message with `routing_key` (and
    /// `headers`) reaches through this exchange. Exchange destinations are
    /// followed recursively; `seen` breaks cycles.
    pub fn route(
        self: &Arc<Self>,
        routing_key: &str,
        headers: &dyn HeaderLookup,
        out: &mut Vec<Arc<Queue>>,
        seen: &mut Vec<*const Exchange>,
    ) {
        if seen.contains(&Arc::as_ptr(self)) {
            return;
        }
        let mut next: Vec<Arc<Exchange>> = Vec::new();
        {
            let b = self.bindings.read();
            let mut add = |d: &Destination| match d {
                Destination::Queue(q) => {
                    if !out.iter().any(|x| Arc::ptr_eq(x, q)) {
                        out.push(q.clone());
                    }
                }
                Destination::Exchange(x) => next.push(x.clone()),
            };
            match self.def.kind {
                ExchangeKind::Direct => {
                    if let Some(ix) = b.by_key.get(routing_key) {
                        for &i in ix {
                            add(&b.all[i].destination);
                        }
                    }
                }
                ExchangeKind::Fanout => b.all.iter().for_each(|x| add(&x.destination)),
                ExchangeKind::Topic => {
                    let words: Vec<&str> = routing_key.split('.').collect();
                    for x in &b.all {
                        if topic_matches(&x.words, &words) {
                            add(&x.destination);
                        }
                    }
                }
                ExchangeKind::Headers => {
                    for x in &b.all {
                        if headers_match(&x.arguments, headers) {
                            add(&x.destination);
                        }
                    }
                }
            }
        }
        if next.is_empty() {
            // The common case: no exchange-to-exchange hop, nothing to track
            // (and nothing allocated per message).
            return;
        }
        seen.push(Arc::as_ptr(self));
        for x in next {
            x.route(routing_key, headers, out, seen);
        }
    }
}

/// AMQP topic matching: `*` matches exactly one word, `#` zero or more.
pub fn topic_matches<P: AsRef<str>>(pattern: &[P], words: &[&str]) -> bool {
    match pattern.split_first() {
        None => words.is_empty(),
        Some((p, rest)) if p.as_ref() == "#" => {
            // Collapse consecutive '#'.
            if rest.first().is_some_and(|x| x.as_ref() == "#") {
                return topic_matches(rest, words);
            }
            (0..=words.len()).any(|skip| topic_matches(rest, &words[skip..]))
        }
        Some((p, rest)) => match words.split_first() {
            Some((w, wrest)) if p.as_ref() == "*" || p.as_ref() == *w => topic_matches(rest, wrest),
            _ => false,
        },
    }
}

/// Headers-exchange matching: every (`x-match: all`, the default) or any
/// (`x-match: any`) non-`x-` binding argument equals the message header; an
/// argument with no value (void) only requires the header to be present.
pub fn headers_match(binding_args: &Value, headers: &dyn HeaderLookup) -> bool {
    let Some(args) = binding_args.as_object() else {
        return false;
    };
    let any = matches!(
        args.get("x-match").and_then(Value::as_str),
        Some("any" | "any-with-x")
    );
    let with_x = matches!(
        args.get("x-match").and_then(Value::as_str),
        Some("all-with-x" | "any-with-x")
    );
    for (k, v) in args {
        if k == "x-match" || (k.starts_with("x-") && !with_x) {
            continue;
        }
        let ok = match headers.header(k) {
            None => false,
            Some(h) => v.is_null() || &h == v,
        };
        if any && ok {
            return true;
        }
        if !any && !ok {
            return false;
        }
    }
    // `all` matched every argument; `any` matched none.
    !any
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(p: &str, k: &str) -> bool {
        let pat: Vec<&str> = p.split('.').collect();
        let words: Vec<&str> = k.split('.').collect();
        topic_matches(&pat, &words)
    }

    #[test]
    fn topic_patterns() {
        assert!(m("a.b.c", "a.b.c"));
        assert!(!m("a.b.c", "a.b"));
        assert!(m("a.*.c", "a.x.c"));
        assert!(!m("a.*.c", "a.x.y.c"));
        assert!(m("a.#", "a"));
        assert!(m("a.#", "a.b.c"));
        assert!(m("#", "anything.at.all"));
        assert!(m("#.c", "a.b.c"));
        assert!(m("a.#.c", "a.c"));
        assert!(m("a.#.#.c", "a.x.c"));
        assert!(!m("a.#.c", "a.b.d"));
        assert!(m("*", "x"));
        assert!(!m("*", "x.y"));
    }

    struct H(serde_json::Map<String, Value>);
    impl HeaderLookup for H {
        fn header(&self, name: &str) -> Option<Value> {
            self.0.get(name).cloned()
        }
    }

    #[test]
    fn headers_all_and_any() {
        let h = H(serde_json::json!({"a": 1, "b": "x"})
            .as_object()
            .cloned()
            .unwrap_or_default());
        assert!(headers_match(&serde_json::json!({"a": 1, "b": "x"}), &h));
        assert!(!headers_match(&serde_json::json!({"a": 1, "b": "y"}), &h));
        assert!(headers_match(
            &serde_json::json!({"x-match": "any", "a": 2, "b": "x"}),
            &h
        ));
        assert!(!headers_match(
            &serde_json::json!({"x-match": "any", "a": 2}),
            &h
        ));
    }
}
