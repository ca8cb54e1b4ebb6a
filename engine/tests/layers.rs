//! The layering invariants of docs/ARCHITECTURE.md, checked over
//! `cargo metadata` so a dependency that breaks them fails CI:
//!
//! * `weir-engine` depends on `weir-backend` and `weir-quota`, never on
//!   `weir-protocols`, the gateway, a socket crate or tokio's `net`/`rt`;
//! * `weir-backend` (the store) never depends on the engine, a protocol or
//!   the gateway;
//! * `weir-protocols` (sans-IO adapters) never depends on the engine, the
//!   store, the gateway or tokio.

use serde_json::Value;
use std::process::Command;

fn metadata() -> Value {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .args([
            "metadata",
            "--format-version",
            "1",
            "--no-deps",
            "--offline",
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("cargo metadata runs");
    assert!(
        out.status.success(),
        "cargo metadata failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("cargo metadata prints JSON")
}

/// The normal (non-dev) dependencies of a workspace package: (name, features,
/// default features on).
fn deps(meta: &Value, package: &str) -> Vec<(String, Vec<String>, bool)> {
    let pkg = meta["packages"]
        .as_array()
        .expect("packages")
        .iter()
        .find(|p| p["name"] == package)
        .unwrap_or_else(|| panic!("package {package} is in the workspace"));
    pkg["dependencies"]
        .as_array()
        .expect("dependencies")
        .iter()
        .filter(|d| d["kind"].is_null())
        .map(|d| {
            let features = d["features"]
                .as_array()
                .map(|f| {
                    f.iter()
                        .filter_map(|x| x.as_str().map(String::from))
                        .collect()
                })
                .unwrap_or_default();
            (
                d["name"].as_str().unwrap_or_default().to_string(),
                features,
                d["uses_default_features"].as_bool().unwrap_or(true),
            )
        })
        .collect()
}

fn assert_not_on(meta: &Value, package: &str, forbidden: &[&str]) {
    for (name, _, _) in deps(meta, package) {
        assert!(
            !forbidden.contains(&name.as_str()),
            "{package} must not depend on {name} (docs/ARCHITECTURE.md, layers)"
        );
    }
}

#[test]
fn engine_depends_on_the_store_and_quota_never_on_protocols_or_sockets() {
    let meta = metadata();
    let engine = deps(&meta, "weir-engine");
    let names: Vec<&str> = engine.iter().map(|(n, _, _)| n.as_str()).collect();
    assert!(
        names.contains(&"weir-backend"),
        "the engine runs over the store"
    );
    assert!(
        names.contains(&"weir-quota"),
        "the engine uses quota's credit"
    );
    assert_not_on(
        &meta,
        "weir-engine",
        &[
            "weir-protocols",
            "weir-gateway",
            "amq-protocol",
            "lapin",
            "mio",
            "socket2",
        ],
    );
    if let Some((_, features, default)) = engine.iter().find(|(n, _, _)| n == "tokio") {
        assert!(!default, "the engine takes tokio without default features");
        for f in features {
            assert!(
                f == "sync",
                "the engine may use tokio's sync primitives only, not `{f}`"
            );
        }
    }
}

#[test]
fn store_and_protocols_stay_below_the_engine() {
    let meta = metadata();
    assert_not_on(
        &meta,
        "weir-backend",
        &[
            "weir-engine",
            "weir-protocols",
            "weir-gateway",
            "amq-protocol",
            "tokio",
        ],
    );
    assert_not_on(
        &meta,
        "weir-protocols",
        &["weir-engine", "weir-backend", "weir-gateway", "tokio"],
    );
}
