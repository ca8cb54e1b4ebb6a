#!/usr/bin/env bash
# One command for the AMQP conformance suite: install deps, start RabbitMQ
# (reference), build and start Weir (candidate) on a free port with a fresh
# data dir, run conformance/run.py against both, stop Weir.
#
# Policies (scenarios/policies.py): conformance/policies.toml is Weir's
# configuration file for the run (its [[policies]]), and the same policies
# are set on RabbitMQ with rabbitmqctl before the scenarios run.
#
#   conformance/run.sh [run.py args, e.g. -k topic --show]
#
# Env: WEIR_BIN (use this binary, skip cargo build), CONFORMANCE_REFERENCE
# (reference URL, default local RabbitMQ), WEIR_START_TIMEOUT (seconds, 60).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
log() { echo "conformance: $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

bash scripts/install-deps.sh
bash scripts/start-rabbitmq.sh
PY=$(bash scripts/python-venv.sh)
REFERENCE=${CONFORMANCE_REFERENCE:-amqp://guest:guest@127.0.0.1:5672/}
POLICIES=$ROOT/conformance/policies.toml
if [[ -z "${CONFORMANCE_REFERENCE:-}" ]]; then
    "$PY" conformance/rabbitmq_policies.py "$POLICIES" || die "setting the policies on RabbitMQ failed"
else
    log "CONFORMANCE_REFERENCE is set: the policies of $POLICIES must already be set there"
fi

if [[ -z "${WEIR_BIN:-}" ]]; then
    log "building weir (cargo build -p weir-gateway)"
    cargo build -q -p weir-gateway || die "cargo build -p weir-gateway failed"
    WEIR_BIN=$ROOT/target/debug/weir
fi
[[ -x $WEIR_BIN ]] || die "weir binary not found at $WEIR_BIN"
# The brokers the tests start keep small data sets in temporary directories:
# a build machine with less than the default 1 GB free would set the disk
# alarm and block every publisher. Tests of the alarm pass their own limit.
export WEIR_DISK_FREE_LIMIT=${WEIR_DISK_FREE_LIMIT:-50MB}

# Ask the kernel for a free port. There is a small window before weir binds
# it; acceptable for a single local run.
PORT=$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
DATA_DIR=$(mktemp -d -t weir-conformance.XXXXXX)
WEIR_LOG=$DATA_DIR.log
WEIR_PID=""

stop_weir() {
    if [[ -n "$WEIR_PID" ]] && kill -0 "$WEIR_PID" 2>/dev/null; then
        kill "$WEIR_PID" 2>/dev/null || true
        # Bounded wait for a clean exit, then force.
        for _ in $(seq 1 50); do kill -0 "$WEIR_PID" 2>/dev/null || break; sleep 0.1; done
        kill -9 "$WEIR_PID" 2>/dev/null || true
    fi
    rm -rf "$DATA_DIR"
}
trap stop_weir EXIT

log "starting $WEIR_BIN on 127.0.0.1:$PORT (data dir $DATA_DIR, log $WEIR_LOG)"
"$WEIR_BIN" --config "$POLICIES" --data-dir "$DATA_DIR" --amqp-listen "127.0.0.1:$PORT" --mqtt-listen 127.0.0.1:0 --mqtt-ws-listen 127.0.0.1:0 --http-listen 127.0.0.1:0 >"$WEIR_LOG" 2>&1 &
WEIR_PID=$!

deadline=$((SECONDS + ${WEIR_START_TIMEOUT:-60}))
until (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null; do
    if ! kill -0 "$WEIR_PID" 2>/dev/null; then
        tail -n 30 "$WEIR_LOG" >&2 || true
        die "weir exited before accepting connections"
    fi
    (( SECONDS < deadline )) || { tail -n 30 "$WEIR_LOG" >&2; die "weir did not accept on port $PORT in time"; }
    sleep 0.1
done

set +e
"$PY" conformance/run.py --reference "$REFERENCE" --candidate "amqp://guest:guest@127.0.0.1:$PORT/" "$@"
rc=$?
set -e
if (( rc != 0 )); then
    log "weir log (last 40 lines of $WEIR_LOG):"
    tail -n 40 "$WEIR_LOG" >&2 || true
fi
exit $rc
