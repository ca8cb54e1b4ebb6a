#!/usr/bin/env bash
# One command for the MQTT conformance suite: install deps, start Debian's
# Mosquitto (reference, 127.0.0.1:1884), then either
#   * --reference-only: check the scenarios against Mosquitto alone (each runs
#     twice and must give the same transcript; `differs` scenarios must give
#     the transcript recorded for Mosquitto), or
#   * compare with Weir: at $WEIR_MQTT (host:port) if set, else build and
#     start weir on free ports with a fresh data dir and
#     conformance/mqtt/weir.toml (the same client-visible limits as
#     conformance/mqtt/mosquitto.conf), run conformance/mqtt/run.py, stop it.
#
#   conformance/mqtt/run.sh [--reference-only] [run.py args, e.g. -k retain --show]
#
# Env: WEIR_MQTT (candidate host:port, skip starting weir), WEIR_BIN (use this
# binary, skip cargo build), WEIR_START_TIMEOUT (seconds, 60).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT"
log() { echo "conformance-mqtt: $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

bash scripts/install-deps.sh
bash scripts/start-mosquitto.sh
PY=$(bash scripts/python-venv.sh)
RUN=("$PY" conformance/mqtt/run.py --reference 127.0.0.1:1884)

for a in "$@"; do
    if [[ $a == --reference-only || $a == --only-reference || $a == --list ]]; then
        exec "${RUN[@]}" "$@"
    fi
done

if [[ -n "${WEIR_MQTT:-}" ]]; then
    log "candidate: $WEIR_MQTT (WEIR_MQTT)"
    exec "${RUN[@]}" --candidate "$WEIR_MQTT" "$@"
fi

if [[ -z "${WEIR_BIN:-}" ]]; then
    log "building weir (cargo build -p weir-gateway)"
    cargo build -q -p weir-gateway || die "cargo build -p weir-gateway failed"
    WEIR_BIN=$ROOT/${CARGO_TARGET_DIR:-target}/debug/weir
fi
[[ -x $WEIR_BIN ]] || die "weir binary not found at $WEIR_BIN"
# Small temporary data sets: do not let a nearly full build disk raise the
# disk alarm and block publishers (as conformance/run.sh).
export WEIR_DISK_FREE_LIMIT=${WEIR_DISK_FREE_LIMIT:-50MB}

free_port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
AMQP_PORT=$(free_port)
MQTT_PORT=$(free_port)
DATA_DIR=$(mktemp -d -t weir-conformance-mqtt.XXXXXX)
WEIR_LOG=$DATA_DIR.log
WEIR_PID=""

stop_weir() {
    if [[ -n "$WEIR_PID" ]] && kill -0 "$WEIR_PID" 2>/dev/null; then
        kill "$WEIR_PID" 2>/dev/null || true
        for _ in $(seq 1 50); do kill -0 "$WEIR_PID" 2>/dev/null || break; sleep 0.1; done
        kill -9 "$WEIR_PID" 2>/dev/null || true
    fi
    rm -rf "$DATA_DIR"
}
trap stop_weir EXIT

log "starting $WEIR_BIN: MQTT on 127.0.0.1:$MQTT_PORT (data dir $DATA_DIR, log $WEIR_LOG)"
"$WEIR_BIN" --config conformance/mqtt/weir.toml --data-dir "$DATA_DIR" \
    --amqp-listen "127.0.0.1:$AMQP_PORT" --mqtt-listen "127.0.0.1:$MQTT_PORT" --mqtt-ws-listen 127.0.0.1:0 --http-listen 127.0.0.1:0 >"$WEIR_LOG" 2>&1 &
WEIR_PID=$!

deadline=$((SECONDS + ${WEIR_START_TIMEOUT:-60}))
until grep -q "MQTT listener ready" "$WEIR_LOG" 2>/dev/null && (exec 3<>"/dev/tcp/127.0.0.1/$MQTT_PORT") 2>/dev/null; do
    if ! kill -0 "$WEIR_PID" 2>/dev/null; then
        tail -n 30 "$WEIR_LOG" >&2 || true
        die "weir exited before accepting MQTT connections"
    fi
    (( SECONDS < deadline )) || { tail -n 30 "$WEIR_LOG" >&2; die "weir did not accept MQTT on port $MQTT_PORT in time (does it have the MQTT listener, issue 8?)"; }
    sleep 0.1
done

set +e
"${RUN[@]}" --candidate "127.0.0.1:$MQTT_PORT" "$@"
rc=$?
set -e
if (( rc != 0 )); then
    log "weir log (last 40 lines of $WEIR_LOG):"
    tail -n 40 "$WEIR_LOG" >&2 || true
fi
exit $rc
