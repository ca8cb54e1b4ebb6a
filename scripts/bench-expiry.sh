#!/usr/bin/env bash
# Issue 7's expiry benchmark: 1,000,000 persistent messages with random per-message TTLs into a
# durable queue nobody consumes, all left to expire, while a probe connection publishes confirmed
# messages to another queue at 1,000 msg/s. Reports Weir's RSS growth per message (peak minus
# the RSS before publishing, / N; issue 7: <= 100 B), whether every message expired (depth 0), and
# the probe's confirm latency and longest gap between confirms per phase (issue 7: no stall > 10 ms
# during the expiry; the baseline phase shows what the disk does with nothing else running).
#
# Usage: scripts/bench-expiry.sh [--out DIR] [--quiet-wait S (60)] [--quiet-max CORES (0.3)]
#                                [-- weir-expiry flags, e.g. --messages 1000000 --ttl-min-ms 10000
#                                    --ttl-max-ms 30000 --size 16 --probe-rate 1000]
#        WEIR_BIN=/path/to/weir runs that broker binary instead of this checkout's release build.
#
# It builds weir-expiry and weir in release, starts a fresh Weir (temporary data dir, free port), waits
# for a quiet machine, runs `weir-expiry --pid <weir>` and stops Weir. Results: result.json and
# result.txt (the human report) in --out (default target/bench-expiry/<time>). ~1 min.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

OUT=""
QUIET_WAIT=60
QUIET_MAX=0.3
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT="$2"; shift 2 ;;
    --quiet-wait) QUIET_WAIT="$2"; shift 2 ;;
    --quiet-max) QUIET_MAX="$2"; shift 2 ;;
    --) shift; break ;;
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1 (weir-expiry flags go after --; try --help)" >&2; exit 2 ;;
  esac
done
OUT="${OUT:-$ROOT/target/bench-expiry/$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$OUT"
log() { printf '\n== %s\n' "$*" >&2; }

WEIR_PID=""
WEIR_DIR=""
cleanup() {
  set +e
  if [ -n "$WEIR_PID" ] && kill -0 "$WEIR_PID" 2>/dev/null; then
    kill "$WEIR_PID"
    for _ in $(seq 100); do kill -0 "$WEIR_PID" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$WEIR_PID" 2>/dev/null
    wait "$WEIR_PID" 2>/dev/null
  fi
  [ -n "$WEIR_DIR" ] && rm -rf "$WEIR_DIR"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

log "building weir-expiry and weir (release)"
cargo build --release -p weir-bench --bin weir-expiry
[ -n "${WEIR_BIN:-}" ] || cargo build --release -p weir-gateway

# Busy cores of the whole machine over one second (from /proc/stat).
busy_cores() {
  local a b
  a="$(head -1 /proc/stat)"; sleep 1; b="$(head -1 /proc/stat)"
  awk -v a="$a" -v b="$b" 'BEGIN {
    split(a, x); split(b, y); t = 0
    for (k = 2; k <= 9; k++) t += y[k] - x[k]
    printf "%.2f", (t - (y[5] - x[5]) - (y[6] - x[6])) / 100 }'
}
wait_quiet() { # three quiet seconds in a row, or QUIET_WAIT seconds
  local waited=0 quiet=0 busy
  while :; do
    busy="$(busy_cores)"
    if awk -v b="$busy" -v m="$QUIET_MAX" 'BEGIN { exit !(b <= m) }'; then
      quiet=$((quiet + 1)); [ "$quiet" -ge 3 ] && return 0; continue
    fi
    quiet=0
    if [ "$waited" -ge "$QUIET_WAIT" ]; then
      echo "   machine still busy ($busy cores) after ${QUIET_WAIT}s; running anyway" >&2
      return 0
    fi
    [ "$waited" = 0 ] && echo "   waiting for the machine to go quiet (busy: $busy cores)" >&2
    waited=$((waited + 1))
  done
}

WEIR_DIR="$(mktemp -d /tmp/weir-expiry-data.XXXXXX)"
PORT="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])' 2>/dev/null || echo 35673)"
log "starting weir on 127.0.0.1:$PORT (data dir $WEIR_DIR)"
"${WEIR_BIN:-$ROOT/target/release/weir}" --data-dir "$WEIR_DIR" --amqp-listen "127.0.0.1:$PORT" --mqtt-listen 127.0.0.1:0 --mqtt-ws-listen 127.0.0.1:0 --http-listen 127.0.0.1:0 \
  >"$OUT/weir.log" 2>&1 &
WEIR_PID=$!
for _ in $(seq 300); do
  kill -0 "$WEIR_PID" 2>/dev/null || { tail -5 "$OUT/weir.log" >&2; echo "weir exited at start-up" >&2; exit 1; }
  (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null && break
  sleep 0.1
done

wait_quiet
log "weir-expiry $*"
"$ROOT/target/release/weir-expiry" --url "amqp://guest:guest@127.0.0.1:$PORT/%2f" --pid "$WEIR_PID" \
  --json "$@" >"$OUT/result.json"
# The human report, from the same JSON (weir-expiry prints one or the other).
jq -r '
  def r(n): . * pow(10; n) | round / pow(10; n);
  "weir-expiry: \(.messages) messages of \(.size) B, TTL \(.ttl_ms[0])..\(.ttl_ms[1]) ms, persistent, durable queue, no consumer",
  "  fill: \(.fill_s | r(2)) s (\(.fill_rate | floor) msg/s), confirmed \(.confirmed), nacked \(.nacked), depth after fill \(.depth_after_fill)",
  "  expired: \(if .emptied then "all" else "NOT ALL" end) (depth at end \(.depth_at_end)); empty \(.empty_after_fill_s // "?" | if type == "number" then r(2) else . end) s after the fill, \(.empty_after_last_deadline_s // "?" | if type == "number" then r(2) else . end) s after the last deadline",
  "  RSS: before \(.rss_before_mb | r(1)) MB, filled \(.rss_filled_mb | r(1)) MB (\((.rss_filled_mb - .rss_before_mb) * 1e6 / .messages | r(1)) B/msg), peak \(.rss_peak_mb | r(1)) MB (\(.rss_growth_bytes_per_msg | r(1)) B/msg), end \(.rss_end_mb | r(1)) MB",
  "  probe (\(.probe_rate) msg/s, confirmed, another queue), confirm latency from the intended send, ms:",
  (.probe as $p | ["baseline", "fill", "waiting", "expiry", "after"][] | {key: ., value: $p[.]} |
    "    \(.key): \(.value.seconds | r(1)) s, n=\(.value.count), p50 \(.value.p50_ms), p99 \(.value.p99_ms), p99.9 \(.value.p999_ms), max \(.value.max_ms), longest gap between confirms \(.value.max_confirm_gap_ms | r(3)); broker \(.value.broker_cores // 0 | r(2)), other \(.value.other_cores // 0 | r(2)) cores"),
  "  per second (t: probe max ms / RSS MB / other cores): \([.timeline[] | "\(.t): \(.probe_max_ms | r(1))/\(.rss_mb | r(0))/\(.other_cores // 0 | r(1))"] | join(", "))"
' "$OUT/result.json" | tee "$OUT/result.txt"
grep -i "compacted" "$OUT/weir.log" | sed 's/\x1b\[[0-9;]*m//g' >"$OUT/compactions.log" || true
echo >&2
echo "results in $OUT (weir.log, compactions.log: Weir's log lines of store compaction rounds)" >&2
