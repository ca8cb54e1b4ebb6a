//! Time is an input to the engine: no engine code reads a clock except the
//! `Clock` implementations (`src/clock.rs`). Every deadline (TTL,
//! `x-expires`, delays, retries, idempotency windows, retained expiry)
//! comes from the clock given to `Engine::open`, so tests move time by hand
//! instead of sleeping. This test reads the engine's sources and fails on
//! any clock read elsewhere (the engine's own `#[cfg(test)]` modules may
//! time themselves: they are not the engine).

use std::path::{Path, PathBuf};

/// The one file allowed to read clocks.
const CLOCK_IMPL: &str = "clock.rs";

/// What reads a clock, or waits on one: std's and tokio's `Instant::now`,
/// `SystemTime::now`, any other `::now()` (chrono, time, quanta), an
/// `elapsed()` (a read of now minus a start), and sleeping.
const READS: &[&str] = &[
    "::now(",
    "::now)",
    "::now,",
    "::now;",
    "now_utc(",
    ".elapsed(",
    "::sleep(",
    "::sleep_until(",
    "::interval(",
    "::interval_at(",
    "UNIX_EPOCH",
];

/// Every `.rs` file under `dir`.
fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    let entries = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("reading {dir:?}: {e}"));
    for entry in entries {
        let path = entry.expect("a directory entry").path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|x| x == "rs") {
            out.push(path);
        }
    }
}

/// The engine's code in `text`: line comments removed and top-level
/// `#[cfg(test)] mod … { … }` blocks skipped (rustfmt closes those with a
/// `}` at column 0). Keeps line numbers: a skipped line becomes empty.
fn code_lines(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut in_tests = false;
    let mut lines = text.lines().peekable();
    while let Some(line) = lines.next() {
        if in_tests {
            if line == "}" {
                in_tests = false;
            }
            out.push(String::new());
            continue;
        }
        if line == "#[cfg(test)]" && lines.peek().is_some_and(|next| next.starts_with("mod ")) {
            in_tests = true;
            out.push(String::new());
            continue;
        }
        let code = match line.find("//") {
            Some(i) => &line[..i],
            None => line,
        };
        out.push(code.to_string());
    }
    out
}

/// `file:line: text` for each clock read in `text`.
fn reads_in(name: &str, text: &str) -> Vec<String> {
    code_lines(text)
        .iter()
        .enumerate()
        .filter(|(_, l)| READS.iter().any(|r| l.contains(r)))
        .map(|(i, l)| format!("{name}:{}: {}", i + 1, l.trim()))
        .collect()
}

#[test]
fn only_the_clock_implementations_read_the_clock() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&src, &mut files);
    assert!(files.len() > 20, "found the engine's sources: {files:?}");
    let mut found = Vec::new();
    let mut impl_reads = 0;
    for f in &files {
        let text = std::fs::read_to_string(f).unwrap_or_else(|e| panic!("reading {f:?}: {e}"));
        let name = f.strip_prefix(&src).unwrap_or(f).display().to_string();
        let reads = reads_in(&name, &text);
        if name == CLOCK_IMPL {
            impl_reads = reads.len();
        } else {
            found.extend(reads);
        }
    }
    assert!(
        impl_reads > 0,
        "src/{CLOCK_IMPL} holds the clock implementations (moved? update CLOCK_IMPL)"
    );
    assert!(
        found.is_empty(),
        "engine code reads the clock; take \"now\" from the engine's `Clock` \
         (`Engine::clock`, a partition's or client's clock) instead:\n{}",
        found.join("\n")
    );
}

/// The scanner itself: it finds each kind of read, and ignores comments
/// and the engine's unit-test modules.
#[test]
fn the_scanner_finds_reads_and_skips_comments_and_test_modules() {
    for read in [
        "let t = std::time::Instant::now();",
        "let t = SystemTime::now().duration_since(UNIX_EPOCH);",
        "let t = tokio::time::Instant::now();",
        "let d = started.elapsed();",
        "let at = chrono::Utc::now();",
        "let at = time::OffsetDateTime::now_utc();",
        "std::thread::sleep(d);",
        "let f = Instant::now;",
        "x.map_or_else(Instant::now, |t| t)",
    ] {
        let text = format!("fn f() {{\n    {read}\n}}\n");
        assert_eq!(reads_in("x.rs", &text).len(), 1, "{read}");
    }
    let clean = "\
//! Uses `Instant::now()` in prose only.
fn f(now_ms: u64) -> u64 {
    // not SystemTime::now() either
    clock.now_ms() + now_ms // self.clock.now()
}

#[cfg(test)]
mod tests {
    fn timed() {
        let t = std::time::Instant::now();
        assert!(t.elapsed().as_secs() < 1);
    }
}
";
    assert_eq!(reads_in("x.rs", clean), Vec::<String>::new());
    // Code after a test module is checked again.
    let after = format!("{clean}\nfn g() {{ let _ = Instant::now(); }}\n");
    assert_eq!(reads_in("x.rs", &after).len(), 1);
}
