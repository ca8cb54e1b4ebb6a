//! Topics, in one place: AMQP topic patterns, MQTT topic filters, and the
//! mapping between the two that lets MQTT and AMQP clients meet on one
//! exchange. The topic exchange's trie ([`crate::exchange`]), the retained
//! messages' trie ([`crate::retained`]), the permission checks of retained
//! messages ([`crate::Client::retain`]) and the MQTT adapter (which
//! delivers to a session only what its own filters match) all use these;
//! nothing else implements a topic rule.
//!
//! * **AMQP** routing keys and binding patterns are words separated by `.`;
//!   in a pattern `*` matches exactly one word and `#` zero or more
//!   ([`amqp_matches`]). Empty words are words: the empty key is one empty
//!   word.
//! * **MQTT** topic names and filters are levels separated by `/`; in a
//!   filter `+` matches exactly one level (an empty one too) and `#` (last)
//!   the parent level and everything under it; a filter whose first level
//!   is a wildcard does not match a topic starting with `$`
//!   (MQTT-4.7.2-1, [`wildcard_skips`]). Validation of names and filters is
//!   the protocol adapter's (`weir-protocols`); these functions assume
//!   valid ones.
//! * **The mapping** (MQTT publishes route through [`MQTT_EXCHANGE`]):
//!   `/` and `.` swap, so a topic `sensors/7/temp` is the routing key
//!   `sensors.7.temp`, a `.` inside a level becomes `/`
//!   (`spBv1.0/g` ⇄ `spBv1/0.g`), and the mapping is its own inverse;
//!   a filter maps to a binding key the same way, with `+` → `*`. Through
//!   it AMQP matching agrees with MQTT matching on every topic not starting
//!   with `$` (AMQP's wildcards match those too, hence MQTT's own check
//!   before a delivery).
//!
//! The engine never depends on the protocol crates (`engine/tests/layers.rs`),
//! so all of this works on plain strings.

/// The exchange MQTT topics route through (RabbitMQ's MQTT plugin's
/// default), and whose permissions guard retained messages.
pub const MQTT_EXCHANGE: &str = "amq.topic";

/// MQTT's level separator.
pub const MQTT_SEPARATOR: char = '/';

/// AMQP's word separator.
pub const AMQP_SEPARATOR: char = '.';

/// AMQP topic matching: `*` matches exactly one word, `#` zero or more.
///
/// A dynamic program over (pattern words × key words), O(p·w) time and
/// O(w) space: no backtracking. Routing uses the exchange's trie (an
/// automaton with the same rules over many patterns at once); this is the
/// reference it is tested against.
pub fn amqp_matches<P: AsRef<str>>(pattern: &[P], words: &[&str]) -> bool {
    // ok[j]: the pattern words seen so far match exactly words[..j].
    let mut ok = vec![false; words.len() + 1];
    ok[0] = true;
    for p in pattern {
        match p.as_ref() {
            "#" => {
                // Zero or more words: reachable from any earlier j.
                for j in 1..=words.len() {
                    ok[j] = ok[j] || ok[j - 1];
                }
            }
            p => {
                for j in (1..=words.len()).rev() {
                    ok[j] = ok[j - 1] && (p == "*" || p == words[j - 1]);
                }
                ok[0] = false;
            }
        }
    }
    ok[words.len()]
}

/// Whether an MQTT filter level is a wildcard (`+` or `#`).
pub fn is_wildcard(level: &str) -> bool {
    matches!(level, "+" | "#")
}

/// MQTT-4.7.2-1: a filter whose first level is `first_filter_level` skips
/// a topic whose first level is `first_topic_level` even where its
/// wildcards would match it: wildcards at the root do not reach `$` topics
/// (`$SYS/...`), which only a filter naming them matches.
pub fn wildcard_skips(first_filter_level: &str, first_topic_level: &str) -> bool {
    is_wildcard(first_filter_level) && first_topic_level.starts_with('$')
}

/// Whether MQTT topic filter `filter` matches topic name `topic` (both
/// valid; a shared subscription's `$share/group/` prefix is the caller's
/// to strip): `+` matches one level (an empty one too), `#` (last) the
/// parent level and everything under it; see [`wildcard_skips`].
pub fn mqtt_matches(filter: &str, topic: &str) -> bool {
    let mut f = filter.split(MQTT_SEPARATOR).peekable();
    let mut t = topic.split(MQTT_SEPARATOR).peekable();
    if let (Some(fl), Some(tl)) = (f.peek(), t.peek()) {
        if wildcard_skips(fl, tl) {
            return false;
        }
    }
    loop {
        match (f.next(), t.next()) {
            // `#` also matches the parent level: `a/#` matches `a`.
            (Some("#"), _) => return true,
            (Some("+"), Some(_)) => {}
            (Some(fl), Some(tl)) if fl == tl => {}
            (None, None) => return true,
            _ => return false,
        }
    }
}

/// `/` ⇄ `.`; every other character is kept.
fn swap_separators(s: &str) -> String {
    s.chars()
        .map(|c| match c {
            MQTT_SEPARATOR => AMQP_SEPARATOR,
            AMQP_SEPARATOR => MQTT_SEPARATOR,
            c => c,
        })
        .collect()
}

/// MQTT topic name → AMQP routing key: `/` → `.`, and a `.` inside a level
/// → `/`.
pub fn topic_to_routing_key(topic: &str) -> String {
    swap_separators(topic)
}

/// AMQP routing key → MQTT topic name: the inverse of
/// [`topic_to_routing_key`] (`.` → `/`, `/` → `.`).
pub fn routing_key_to_topic(key: &str) -> String {
    swap_separators(key)
}

/// MQTT topic filter → AMQP binding key: levels joined by `.`, `+` → `*`,
/// `#` → `#`, a `.` inside a level → `/`. A shared subscription's
/// `$share/group/` prefix is the caller's to strip first.
pub fn filter_to_binding_key(filter: &str) -> String {
    let mut out = String::with_capacity(filter.len());
    for (i, level) in filter.split(MQTT_SEPARATOR).enumerate() {
        if i > 0 {
            out.push(AMQP_SEPARATOR);
        }
        match level {
            "+" => out.push('*'),
            l => out.extend(l.chars().map(|c| {
                if c == AMQP_SEPARATOR {
                    MQTT_SEPARATOR
                } else {
                    c
                }
            })),
        }
    }
    out
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
        fn from(&mut self, alphabet: &[&str], max_len: u64) -> String {
            (0..self.below(max_len + 1))
                .map(|_| alphabet[self.below(alphabet.len() as u64) as usize])
                .collect()
        }
    }

    #[test]
    fn mqtt_filter_matching() {
        let yes = [
            ("a/b", "a/b"),
            ("a/+", "a/b"),
            ("a/+", "a/"),
            ("+/+", "/a"),
            ("a/#", "a"),
            ("a/#", "a/b/c"),
            ("#", "a/b"),
            ("#", "/"),
            ("+", "a"),
            ("+/b/#", "x/b"),
            ("$SYS/#", "$SYS/broker"),
            ("$SYS/+", "$SYS/x"),
            ("a/$x", "a/$x"),
            ("+/$x", "a/$x"),
            ("+", ""),
            ("a/+/c", "a//c"),
            ("+/b", "/b"),
        ];
        for (f, t) in yes {
            assert!(mqtt_matches(f, t), "{f} should match {t}");
        }
        let no = [
            ("a/b", "a/c"),
            ("a/+", "a"),
            ("a/+", "a/b/c"),
            ("+", "/a"),
            ("a", "a/b"),
            ("a/b", "a"),
            ("#", "$SYS/x"),
            ("+/broker", "$SYS/broker"),
            ("+", "$x"),
            ("a/#", "ab"),
            ("a/b/#", "a"),
            ("a/b/#", "a/c"),
            ("+", "a/b"),
        ];
        for (f, t) in no {
            assert!(!mqtt_matches(f, t), "{f} should not match {t}");
        }
    }

    #[test]
    fn amqp_pattern_matching() {
        let m = |p: &str, k: &str| {
            let p: Vec<&str> = p.split('.').collect();
            let k: Vec<&str> = k.split('.').collect();
            amqp_matches(&p, &k)
        };
        assert!(m("a.*.c", "a.x.c"));
        assert!(!m("a.*.c", "a.x.y.c"));
        assert!(m("a.#", "a"));
        assert!(m("#.#.a.#.#", "x.a.y"));
        assert!(!m("*.#.*", "a"));
        assert!(m("*", ""));
        assert!(!m("a..b", "a.b"));
    }

    #[test]
    fn topics_map_as_documented() {
        for (topic, key) in [
            ("sensors/7/temp", "sensors.7.temp"),
            ("a", "a"),
            ("/a", ".a"),
            ("a/", "a."),
            ("a//b", "a..b"),
            ("spBv1.0/group/NBIRTH/node", "spBv1/0.group.NBIRTH.node"),
            ("v1.2", "v1/2"),
            ("$SYS/broker", "$SYS.broker"),
            ("a*b/é", "a*b.é"),
        ] {
            assert_eq!(topic_to_routing_key(topic), key, "{topic}");
            assert_eq!(routing_key_to_topic(key), topic, "{key}");
        }
        for (filter, key) in [
            ("sensors/+/temp", "sensors.*.temp"),
            ("sensors/#", "sensors.#"),
            ("#", "#"),
            ("+", "*"),
            ("+/+", "*.*"),
            ("/+", ".*"),
            ("spBv1.0/+/#", "spBv1/0.*.#"),
            ("a/b", "a.b"),
        ] {
            assert_eq!(filter_to_binding_key(filter), key, "{filter}");
        }
    }

    #[test]
    fn the_topic_mapping_is_reversible() {
        let mut r = Rng(7);
        for _ in 0..5_000 {
            let t = r.from(&["a", "b", "/", ".", "$", "é", "*"], 12);
            assert_eq!(routing_key_to_topic(&topic_to_routing_key(&t)), t);
        }
    }

    /// Through the mapping, AMQP topic matching agrees with MQTT's on every
    /// topic not starting with `$` (which MQTT wildcards exclude).
    #[test]
    fn amqp_routing_agrees_with_mqtt_matching() {
        let mut r = Rng(11);
        let levels = ["a", "b", "", "a.b", "c.d"];
        let mut checked = 0;
        for _ in 0..20_000 {
            let n = 1 + r.below(4);
            let topic: Vec<&str> = (0..n)
                .map(|_| levels[r.below(levels.len() as u64) as usize])
                .collect();
            let topic = topic.join("/");
            let m = 1 + r.below(4);
            let mut filter: Vec<&str> = (0..m)
                .map(|_| match r.below(4) {
                    0 => "+",
                    _ => levels[r.below(levels.len() as u64) as usize],
                })
                .collect();
            if r.chance(3) {
                filter.push("#");
            }
            let filter = filter.join("/");
            let key = topic_to_routing_key(&topic);
            let binding = filter_to_binding_key(&filter);
            let words: Vec<&str> = key.split('.').collect();
            let pattern: Vec<&str> = binding.split('.').collect();
            assert_eq!(
                amqp_matches(&pattern, &words),
                mqtt_matches(&filter, &topic),
                "filter {filter} topic {topic} (binding {binding}, key {key})"
            );
            checked += usize::from(mqtt_matches(&filter, &topic));
        }
        assert!(checked > 1_000, "enough matching pairs: {checked}");
        // `$` topics: AMQP's `#` and `*` match them, MQTT's wildcards not.
        assert!(amqp_matches(&["#"], &["$SYS", "x"]));
        assert!(!mqtt_matches("#", "$SYS/x"));
    }
}
