#!/usr/bin/env bash
# Installs cargo-fuzz from crates.io if it is not already on PATH. Idempotent:
# does nothing when `cargo fuzz` answers. The toolchain is stable, so the fuzz
# build itself runs with RUSTC_BOOTSTRAP=1 (see scripts/fuzz.sh); installing
# cargo-fuzz needs no nightly.
set -euo pipefail

log() { echo "install-cargo-fuzz: $*" >&2; }

if cargo fuzz --version >/dev/null 2>&1; then
    log "present: $(cargo fuzz --version)"
    exit 0
fi
log "installing cargo-fuzz (a few minutes)"
cargo install cargo-fuzz --locked
log "installed: $(cargo fuzz --version)"
