#!/usr/bin/env bash
# Builds the Debian package of Weir with cargo-deb: the binaries (weir,
# weirctl), their man pages and shell completions (scripts/deb-assets.sh),
# the unit and maintainer scripts of deploy/debian/, the configuration
# deploy/weir.toml as /etc/weir/weir.toml. Prints the .deb's path.
#
# Env: WEIR_DEB_PROFILE (cargo profile; default release), WEIR_DEB_OUT
# (default target/debian/weir.deb).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PROFILE=${WEIR_DEB_PROFILE:-release}
case $PROFILE in dev | test) DIR=debug ;; *) DIR=$PROFILE ;; esac
TARGET=${CARGO_TARGET_DIR:-target}
OUT=${WEIR_DEB_OUT:-$TARGET/debian/weir.deb}
if ! command -v cargo-deb >/dev/null; then
    echo "deb-build: installing cargo-deb" >&2
    nice -n 19 cargo install cargo-deb --locked --version 3.8.0 >&2
fi
echo "deb-build: building ($PROFILE)" >&2
cargo build --profile "$PROFILE" -p weir-gateway -p weirctl >&2
bash scripts/deb-assets.sh "$TARGET/$DIR"
mkdir -p "$(dirname "$OUT")"
cargo deb -p weir-gateway --no-build --profile "$PROFILE" -o "$OUT" >&2
echo "$OUT"
