#!/usr/bin/env bash
# The FoundationDB tests: builds with `--features fdb`, runs clippy with it,
# starts a local cluster (scripts/start-fdb.sh) in a temporary directory,
# runs the store's contract suite against it and the gateway's black-box
# smoke test, and stops the cluster. Used by .ci/run.
#
# FoundationDB comes from the system, else from $WEIR_FDB_DIR (default:
# ../shared/fdb next to the repository). Needs libclang (Debian:
# libclang-dev) for the foundationdb crate's bindgen. Without FoundationDB
# it says "skipped" and why, and exits 0.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
if [ -z "${WEIR_FDB_DIR:-}" ] && [ -d "$ROOT/../shared/fdb" ]; then
  WEIR_FDB_DIR=$(cd "$ROOT/../shared/fdb" && pwd)
fi
export WEIR_FDB_DIR=${WEIR_FDB_DIR:-}
if ! command -v fdbcli > /dev/null && { [ -z "$WEIR_FDB_DIR" ] || [ ! -x "$WEIR_FDB_DIR/bin/fdbserver" ]; }; then
  echo "skipped: FoundationDB tests: no fdbserver/fdbcli on PATH and no WEIR_FDB_DIR (../shared/fdb)" >&2
  exit 0
fi
if [ -n "$WEIR_FDB_DIR" ] && [ -d "$WEIR_FDB_DIR/lib" ]; then
  # cargo links libfdb_c from here (the crate emits no search path).
  export LIBRARY_PATH="$WEIR_FDB_DIR/lib${LIBRARY_PATH:+:$LIBRARY_PATH}"
fi

echo "== fdb: build and clippy with --features fdb" >&2
cargo build -p weir-gateway --features fdb
# The fdb build links libfdb_c: keep it aside, and put the default binary
# back at target/debug/weir on exit (cargo keeps both builds: no rebuild).
cp target/debug/weir target/debug/weir-fdb
cargo clippy -p weir-store-fdb -p weir-gateway --all-targets --features weir-store-fdb/fdb,weir-gateway/fdb -- -D warnings

dir=$(mktemp -d)
cleanup() {
  bash scripts/start-fdb.sh stop "$dir" || true
  rm -rf "$dir"
  cargo build -p weir-gateway
}
trap cleanup EXIT
echo "== fdb: a three-process cluster in $dir" >&2
bash scripts/start-fdb.sh start "$dir" 3 > /dev/null
# shellcheck disable=SC1091
source "$dir/env"

echo "== fdb: the store contract against the cluster" >&2
cargo test -p weir-store-fdb --features fdb --test contract -- --nocapture
echo "== fdb: the gateway on the cluster (lapin, kill -9, restart)" >&2
WEIR_BIN="$ROOT/target/debug/weir-fdb" cargo test -p weir-tests --test fdb_store -- --nocapture
