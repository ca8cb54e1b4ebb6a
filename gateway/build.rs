//! Embeds the commit `weir --version` prints: `WEIR_COMMIT` if set (a
//! container or package build without `.git`), else `git rev-parse`, else
//! "unknown".

use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    if !out.status.success() {
        return None;
    }
    let s = String::from_utf8(out.stdout).ok()?.trim().to_string();
    (!s.is_empty()).then_some(s)
}

/// A file to watch, only if it exists: cargo reruns the script every build
/// for a missing one.
fn watch(path: Option<String>) {
    if let Some(p) = path.filter(|p| std::path::Path::new(p).exists()) {
        println!("cargo:rerun-if-changed={p}");
    }
}

fn main() {
    println!("cargo:rerun-if-env-changed=WEIR_COMMIT");
    let commit = std::env::var("WEIR_COMMIT")
        .ok()
        .filter(|c| !c.is_empty())
        .or_else(|| git(&["rev-parse", "--short=12", "HEAD"]))
        .unwrap_or_else(|| "unknown".into());
    // Rebuild when HEAD moves: HEAD itself (a branch switch) and the ref it
    // names (a commit on the branch), wherever this checkout keeps them
    // (a worktree's HEAD is outside `.git/`).
    watch(git(&["rev-parse", "--git-path", "HEAD"]));
    if let Some(name) = git(&["symbolic-ref", "-q", "HEAD"]) {
        watch(git(&["rev-parse", "--git-path", &name]));
    }
    watch(git(&["rev-parse", "--git-path", "packed-refs"]));
    println!("cargo:rustc-env=WEIR_COMMIT={commit}");
}
