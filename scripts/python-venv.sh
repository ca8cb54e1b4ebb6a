#!/usr/bin/env bash
# Create (if missing) the repo-root .venv with the pinned Python test deps
# from tests/python/requirements.txt, and print the venv's python path on
# stdout (all other output goes to stderr, so callers can do
# PY=$(scripts/python-venv.sh)).
#
# Env: PYTHON (interpreter to build the venv from; default python3).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=$ROOT/.venv
REQ=$ROOT/tests/python/requirements.txt
STAMP=$VENV/.requirements.sha256
PY=${PYTHON:-python3}

log() { echo "python-venv: $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

[[ -f $REQ ]] || die "missing $REQ"
command -v "$PY" >/dev/null || die "$PY not found; run scripts/install-deps.sh"

if [[ ! -x $VENV/bin/python ]]; then
    log "creating $VENV with $("$PY" --version 2>&1)"
    "$PY" -m venv "$VENV" >&2 || die "venv creation failed (Debian needs python3-venv: scripts/install-deps.sh)"
fi

# Reinstall only when requirements.txt changed since the last successful install.
want=$(sha256sum "$REQ" | cut -d' ' -f1)
have=$(cat "$STAMP" 2>/dev/null || true)
if [[ "$want" != "$have" ]]; then
    log "installing $(grep -v '^#' "$REQ" | xargs)"
    "$VENV/bin/python" -m pip install --disable-pip-version-check -q -r "$REQ" >&2 \
        || die "pip install failed"
    echo "$want" > "$STAMP"
fi

echo "$VENV/bin/python"
