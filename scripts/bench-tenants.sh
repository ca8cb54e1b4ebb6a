#!/usr/bin/env bash
# Issue 9's tenant benchmarks on Weir (RabbitMQ 3.10 has no per-vhost rate quota to compare with):
#
#   noisy    : tenant "noisy" has publish-rate = QUOTA msg/s and floods at FLOOD x QUOTA (weir-bench
#              --rate, 2 publishers with confirms, 2 consumers draining); tenant "steady" publishes at
#              STEADY msg/s (1 publisher, 1 consumer). First steady alone (unloaded), then both at once
#              (loaded), each on a fresh broker. Reported: steady's confirm p50/p95/p99 unloaded and
#              loaded (issue 9: loaded p95 <= 2x unloaded) and noisy's achieved publish rate against
#              its quota (issue 9: within +-10%).
#   flood    : the store's fair share: tenant "noisy" has no quota and floods at full speed with
#              FLOOD_SIZE-byte messages (2 publishers with confirms, window 256, 2 consumers: up to
#              8 MiB unconfirmed at the default 16 kB) while "steady" publishes at STEADY msg/s;
#              steady alone first. Then the same flood inside steady's own tenant: one owner of
#              the store's writer, so no fair share applies (the control). Reported: steady's rate
#              and confirm p95 in each.
#   overhead : the #2 saturated workload (weir-bench defaults: 2 publishers, window 256, 2 consumers,
#              256 B, durable, persistent) on a tenant with every quota configured far above what the
#              run reaches, against the same on a broker without quotas, alternated ROUNDS times
#              (issue 9: within 5%).
#
# Usage: scripts/bench-tenants.sh [--duration S (20)] [--warmup S (3)] [--quota N (2000)]
#                                 [--flood X (10)] [--steady N (1000)] [--rounds N (2)]
#                                 [--flood-size BYTES (16384)]
#                                 [--workloads noisy,flood,overhead] [--out DIR]
#        WEIR_BIN=/path/to/weir runs that broker instead of this checkout's release build;
#        WEIR_BENCH_BIN=/path/to/weir-bench that load generator (e.g. a debug build, to try the script).
# Results: JSON per run and results.md in --out (default target/bench-tenants/<time>). ~5 min.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

DURATION=20
WARMUP=3
QUOTA=2000
FLOOD=10
STEADY=1000
ROUNDS=2
FLOOD_SIZE=16384
WORKLOADS="noisy,flood,overhead"
OUT=""
while [ $# -gt 0 ]; do
  case "$1" in
    --duration) DURATION="$2"; shift 2 ;;
    --warmup) WARMUP="$2"; shift 2 ;;
    --quota) QUOTA="$2"; shift 2 ;;
    --flood) FLOOD="$2"; shift 2 ;;
    --steady) STEADY="$2"; shift 2 ;;
    --rounds) ROUNDS="$2"; shift 2 ;;
    --workloads) WORKLOADS="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --flood-size) FLOOD_SIZE="$2"; shift 2 ;;
    -h|--help) sed -n '2,30p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1 (try --help)" >&2; exit 2 ;;
  esac
done
OUT="${OUT:-$ROOT/target/bench-tenants/$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$OUT"

log() { printf '\n== %s\n' "$*" >&2; }

command -v jq >/dev/null 2>&1 || DEBIAN_FRONTEND=noninteractive apt-get install -y -q jq >/dev/null

log "building weir-bench and weir (release)"
if [ -z "${WEIR_BENCH_BIN:-}" ]; then
  cargo build --release -p weir-bench --bin weir-bench
fi
BENCH="${WEIR_BENCH_BIN:-$ROOT/target/release/weir-bench}"
if [ -z "${WEIR_BIN:-}" ]; then
  cargo build --release -p weir-gateway
fi
WEIR="${WEIR_BIN:-$ROOT/target/release/weir}"

BROKER_PID=""
BROKER_DIR=""
stop_broker() {
  set +e
  if [ -n "$BROKER_PID" ] && kill -0 "$BROKER_PID" 2>/dev/null; then
    kill "$BROKER_PID"
    for _ in $(seq 200); do kill -0 "$BROKER_PID" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$BROKER_PID" 2>/dev/null
    wait "$BROKER_PID" 2>/dev/null
  fi
  BROKER_PID=""
  [ -n "$BROKER_DIR" ] && rm -rf "$BROKER_DIR"
  BROKER_DIR=""
  set -e
}
trap stop_broker EXIT
trap 'exit 130' INT TERM

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

# The tenants and their users. QUOTAS=limited|high|none.
write_config() { # FILE QUOTAS
  local noisy_limits=""
  case "$2" in
    limited) noisy_limits="publish-rate = $QUOTA" ;;
    high) noisy_limits="publish-rate = 10000000
publish-bytes-rate = \"2GB\"
max-connections = 100000
max-channels-per-connection = 2047
max-queues = 100000
max-exchanges = 100000
max-consumers = 100000
max-queued-messages = 1000000000
max-queued-bytes = \"100GB\"
max-message-size = \"16MB\"" ;;
    none) ;;
  esac
  cat >"$1" <<EOF
[[tenants]]
name = "noisy"
$noisy_limits

[[tenants]]
name = "steady"

[[auth.users]]
name = "noisy"
password = "noisy"
permissions = [{ vhost = "noisy", configure = ".*", write = ".*", read = ".*" }]

[[auth.users]]
name = "steady"
password = "steady"
permissions = [{ vhost = "steady", configure = ".*", write = ".*", read = ".*" }]
EOF
}

# start_broker QUOTAS: a fresh broker; sets BROKER_PID, BROKER_DIR, PORT.
start_broker() {
  PORT="$(free_port)"
  BROKER_DIR="$(mktemp -d /tmp/weir-bench-tenants.XXXXXX)"
  write_config "$BROKER_DIR/weir.toml" "$1"
  "$WEIR" --config "$BROKER_DIR/weir.toml" --data-dir "$BROKER_DIR/data" --fsync true \
    --amqp-listen "127.0.0.1:$PORT" --mqtt-listen 127.0.0.1:0 --mqtt-ws-listen 127.0.0.1:0 --http-listen 127.0.0.1:0 \
    >"$OUT/broker-$1-$(date +%H%M%S).log" 2>&1 &
  BROKER_PID=$!
  for _ in $(seq 300); do
    if (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null; then return 0; fi
    kill -0 "$BROKER_PID" 2>/dev/null || { echo "broker exited at start-up" >&2; return 1; }
    sleep 0.1
  done
  echo "broker not listening within 30 s" >&2; return 1
}

url() { echo "amqp://$1:$1@127.0.0.1:$PORT/$1"; }

steady_run() { # JSON
  "$BENCH" --url "$(url steady)" --publishers 1 --consumers 1 --rate "$STEADY" --queue steady \
    --duration "$DURATION" --warmup "$WARMUP" --broker-pid "$BROKER_PID" --json --label steady >"$1"
}

if [[ ",$WORKLOADS," == *",noisy,"* ]]; then
  log "noisy: steady alone (unloaded)"
  start_broker limited
  steady_run "$OUT/noisy-unloaded-steady.json"
  stop_broker
  log "noisy: noisy floods at $FLOOD x its quota of $QUOTA msg/s while steady publishes"
  start_broker limited
  "$BENCH" --url "$(url noisy)" --publishers 2 --consumers 2 --rate $((QUOTA * FLOOD)) --queue noisy \
    --duration $((DURATION + 2)) --warmup "$WARMUP" --json --label noisy >"$OUT/noisy-loaded-noisy.json" &
  NOISY=$!
  steady_run "$OUT/noisy-loaded-steady.json"
  wait "$NOISY"
  stop_broker
fi

if [[ ",$WORKLOADS," == *",flood,"* ]]; then
  log "flood: steady alone (unloaded)"
  start_broker none
  steady_run "$OUT/flood-unloaded-steady.json"
  stop_broker
  log "flood: noisy floods without a quota while steady publishes"
  start_broker none
  "$BENCH" --url "$(url noisy)" --queue noisy --size "$FLOOD_SIZE" --duration $((DURATION + 2)) \
    --warmup "$WARMUP" --json --label noisy >"$OUT/flood-loaded-noisy.json" &
  NOISY=$!
  steady_run "$OUT/flood-loaded-steady.json"
  wait "$NOISY"
  stop_broker
  log "flood: the same flood in steady's own tenant (one owner: no fair share)"
  start_broker none
  "$BENCH" --url "$(url steady)" --queue noisy --size "$FLOOD_SIZE" --duration $((DURATION + 2)) \
    --warmup "$WARMUP" --json --label noisy >"$OUT/flood-sametenant-noisy.json" &
  NOISY=$!
  steady_run "$OUT/flood-sametenant-steady.json"
  wait "$NOISY"
  stop_broker
fi

if [[ ",$WORKLOADS," == *",overhead,"* ]]; then
  for r in $(seq "$ROUNDS"); do
    for q in none high; do
      log "overhead: round $r, quotas $q"
      start_broker "$q"
      "$BENCH" --url "$(url noisy)" --queue "bench-$q" --duration "$DURATION" --warmup "$WARMUP" \
        --broker-pid "$BROKER_PID" --json --label "$q" >"$OUT/overhead-$q-$r.json"
      stop_broker
    done
  done
fi

# ---------------------------------------------------------------- results
{
  echo "# Tenant benchmarks ($(date -u +%Y-%m-%dT%H:%MZ), $(nproc) cores)"
  if [ -f "$OUT/noisy-loaded-steady.json" ]; then
    echo
    echo "## noisy neighbour: noisy floods at ${FLOOD}x its publish-rate quota ($QUOTA msg/s), steady publishes $STEADY msg/s"
    echo
    echo "| run | tenant | target msg/s | published msg/s | confirm p50 / p95 / p99 ms |"
    echo "|---|---|---:|---:|---|"
    for f in noisy-unloaded-steady noisy-loaded-steady noisy-loaded-noisy; do
      jq -r --arg f "$f" '"| \($f | split("-")[1]) | \(.label) | \(.rate) | \(.publish_rate|floor) | \(.confirm_latency.p50_ms) / \(.confirm_latency.p95_ms) / \(.confirm_latency.p99_ms) |"' "$OUT/$f.json"
    done
    u="$(jq '.confirm_latency.p95_ms' "$OUT/noisy-unloaded-steady.json")"
    l="$(jq '.confirm_latency.p95_ms' "$OUT/noisy-loaded-steady.json")"
    n="$(jq '.publish_rate' "$OUT/noisy-loaded-noisy.json")"
    echo
    awk -v u="$u" -v l="$l" -v n="$n" -v q="$QUOTA" 'BEGIN {
      printf "- steady confirm p95 loaded / unloaded: %.2f (target <= 2: %s)\n", l / u, (l <= 2 * u ? "met" : "MISSED")
      printf "- noisy held to %.0f msg/s = %.1f%% of its quota (target within +-10%%: %s)\n", n, 100 * n / q, (n >= 0.9 * q && n <= 1.1 * q ? "met" : "MISSED") }'
  fi
  if [ -f "$OUT/flood-loaded-steady.json" ]; then
    echo
    echo "## flood: noisy floods without a quota ($FLOOD_SIZE B messages, saturated), steady publishes $STEADY msg/s"
    echo
    echo "| run | tenant | target msg/s | published msg/s | confirm p50 / p95 / p99 ms |"
    echo "|---|---|---:|---:|---|"
    for f in flood-unloaded-steady flood-loaded-steady flood-loaded-noisy flood-sametenant-steady \
      flood-sametenant-noisy; do
      jq -r --arg f "$f" '"| \($f | split("-")[1]) | \(.label) | \(.rate // "max") | \(.publish_rate|floor) | \(.confirm_latency.p50_ms) / \(.confirm_latency.p95_ms) / \(.confirm_latency.p99_ms) |"' "$OUT/$f.json"
    done
    u="$(jq '.confirm_latency.p95_ms' "$OUT/flood-unloaded-steady.json")"
    l="$(jq '.confirm_latency.p95_ms' "$OUT/flood-loaded-steady.json")"
    echo
    awk -v u="$u" -v l="$l" 'BEGIN { printf "- steady confirm p95 loaded / unloaded: %.2f\n", l / u }'
  fi
  if ls "$OUT"/overhead-*.json >/dev/null 2>&1; then
    echo
    echo "## quota overhead: saturated workload, quotas configured far above the load vs none"
    echo
    echo "| quotas | round | published msg/s | confirm p95 ms |"
    echo "|---|---:|---:|---:|"
    for f in "$OUT"/overhead-*.json; do
      b="$(basename "$f" .json)"
      jq -r --arg r "${b##*-}" '"| \(.label) | \($r) | \(.publish_rate|floor) | \(.confirm_latency.p95_ms) |"' "$f"
    done
    none="$(jq -s 'map(.publish_rate) | add / length' "$OUT"/overhead-none-*.json)"
    high="$(jq -s 'map(.publish_rate) | add / length' "$OUT"/overhead-high-*.json)"
    echo
    awk -v a="$none" -v b="$high" 'BEGIN { printf "- with quotas / without: %.3f (target >= 0.95: %s)\n", b / a, (b >= 0.95 * a ? "met" : "MISSED") }'
  fi
} >"$OUT/results.md"
cat "$OUT/results.md"
echo "results in $OUT"
