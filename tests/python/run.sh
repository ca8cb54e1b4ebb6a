#!/usr/bin/env bash
# Build weir (unless WEIR_BIN or WEIR_TEST_URL is set) and run the Python
# black-box tests. Extra args go to pytest, e.g. tests/python/run.sh -k durab
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT"
bash scripts/install-deps.sh
PY=$(bash scripts/python-venv.sh)
if [[ -z "${WEIR_TEST_URL:-}" && -z "${WEIR_BIN:-}" ]]; then
    cargo build -q -p weir-gateway
fi
cd tests/python
exec "$PY" -m pytest "$@"
