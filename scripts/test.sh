#!/usr/bin/env bash
# The one command that runs every test (README: "Run the tests").
#
# Installs what the tests need (Debian packages, a Python venv with pika),
# builds the `weir` binary once, then runs the Rust tests (unit tests, the
# engine's in-process tests, and the black-box tests in tests/ that start the
# real binary with lapin and raw TCP, weirctl's tests) and the Python tests in
# tests/python (pika, paho-mqtt, the dashboard in headless chromium: its
# screenshots go to $WEIR_TEST_ARTIFACTS, default target/test-artifacts/).
# Which behaviour is tested where: tests/README.md. Agreement with RabbitMQ
# (conformance/, pika against both brokers) runs in .ci/run, not here: it
# needs a RabbitMQ node.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

bash scripts/install-deps.sh
PY=$(bash scripts/python-venv.sh)

# The brokers the tests start keep small data sets in temporary directories:
# a build machine with less than the default 1 GB free would set the disk
# alarm and block every publisher. Tests of the alarm pass their own limit.
export WEIR_DISK_FREE_LIMIT=${WEIR_DISK_FREE_LIMIT:-50MB}
echo "test: building weir" >&2
cargo build -p weir-gateway
export WEIR_BIN="$ROOT/${CARGO_TARGET_DIR:-target}/debug/weir"

echo "test: Rust tests" >&2
if cargo nextest --version >/dev/null 2>&1; then
    cargo nextest run --workspace --no-fail-fast
else
    cargo test --workspace --no-fail-fast
fi

echo "test: Python tests (pika, paho-mqtt, dashboard)" >&2
(cd tests/python && "$PY" -m pytest -q)
