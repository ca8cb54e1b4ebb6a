#!/usr/bin/env bash
# Issue 21's MQTT reconnect storm: for each session count, a fresh weir (fsync on, its own data
# dir, free port), then `weir-mqtt-bench storm`: that many persistent sessions (clean session off)
# subscribe to a topic each and leave, then all reconnect at once; one JSON line per run with the
# time to the last CONNACK and the broker's CPU over it (docs/BENCHMARKS.md, "Issue 21: MQTT
# reconnect storm"). The ratio of 10,000 sessions to 1,000 shows whether a resume costs the
# session's own subscriptions (~10x) or every session's (~100x).
#
# Usage: scripts/bench-mqtt-storm.sh [SESSIONS ...]          (default: 1000 10000)
#        WEIR_BIN=/path/to/weir     the broker (default: this checkout's release build)
#        BENCH_BIN=/path/to/weir-mqtt-bench   the client (default: this checkout's release build)
#        LABEL=text                 copied into each JSON line
#        STORM_ARGS="..."           extra `storm` flags (e.g. --storm-concurrency 256)
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
WEIR="${WEIR_BIN:-$ROOT/target/release/weir}"
BENCH="${BENCH_BIN:-$ROOT/target/release/weir-mqtt-bench}"
SIZES=("$@")
[ ${#SIZES[@]} -gt 0 ] || SIZES=(1000 10000)
for b in "$WEIR" "$BENCH"; do
  [ -x "$b" ] || { echo "bench-mqtt-storm: $b is not built (cargo build --release -p weir-gateway -p weir-bench)" >&2; exit 2; }
done
# Every session is a socket on both ends.
ulimit -n 65536 2>/dev/null || ulimit -n "$(ulimit -Hn)" 2>/dev/null || true

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

BROKER_PID=""
DIR=""
cleanup() {
  [ -n "$BROKER_PID" ] && kill "$BROKER_PID" 2>/dev/null && wait "$BROKER_PID" 2>/dev/null
  [ -n "$DIR" ] && rm -rf "$DIR"
  BROKER_PID=""; DIR=""
}
trap cleanup EXIT

for n in "${SIZES[@]}"; do
  DIR="$(mktemp -d)"
  mkdir "$DIR/data"
  : >"$DIR/broker.log"
  PORT="$(free_port)"
  # Room for every session at once above the default MQTT connection limit (10,000).
  printf '[mqtt]\nmax_connections = %d\n' $((n + 1000)) >"$DIR/weir.toml"
  "$WEIR" --config "$DIR/weir.toml" --data-dir "$DIR/data" --fsync true \
    --amqp-listen "127.0.0.1:$(free_port)" --mqtt-listen "127.0.0.1:$PORT" \
    --mqtt-ws-listen 127.0.0.1:0 --http-listen 127.0.0.1:0 >"$DIR/broker.log" 2>&1 &
  BROKER_PID=$!
  # The listener is up when the log says so (no MQTT client needed for the probe).
  for _ in $(seq 300); do
    grep -q "MQTT listener ready" "$DIR/broker.log" && break
    kill -0 "$BROKER_PID" 2>/dev/null || { echo "weir exited at start-up:" >&2; tail -5 "$DIR/broker.log" >&2; exit 1; }
    sleep 0.1
  done
  # shellcheck disable=SC2086 # STORM_ARGS is a list of flags
  "$BENCH" --addr "127.0.0.1:$PORT" --broker-pid "$BROKER_PID" --json --label "${LABEL:-}" \
    storm --sessions "$n" ${STORM_ARGS:-}
  cleanup
done
