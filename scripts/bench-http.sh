#!/usr/bin/env bash
# Issue 10: what observing Weir costs.
#
#   scale : Q durable queues declared (default 100,000; 16 pika connections in parallel), then
#           GET /metrics timed 5 times (per-queue series, then after a restart with
#           --http-metrics-per-queue false, aggregated per tenant), and
#           GET /api/queues?page=1&page_size=100 timed 5 times if the endpoint answers 200.
#   ab    : bench-compare's saturated AMQP workload (2 publishers with confirms, window 256, 2 consumers
#           acking, prefetch 256, 256-byte persistent messages, durable queue; weir-bench, release build)
#           in alternated rounds A (nothing scrapes) and B (curl GET /metrics every second for the whole
#           run), on one broker: A B, B A, A B, ... so drift and other sessions' load hit both sides.
#           With --ab-queues N the broker first gets N more durable queues (every scrape then walks them).
#
# Usage: scripts/bench-http.sh [--queues N (100000)] [--rounds N (3)] [--duration S (20)] [--warmup S (3)]
#                              [--ab-queues N (0)] [--only scale|ab] [--out DIR]
#        WEIR_BIN=/path/to/weir runs that binary instead of this checkout's release build.
#
# The machine is shared: every run records `uptime`'s load average beside its figure, and the A/B
# verdict is the ratio of medians (B / A). Results: <out>/results.md (default target/bench-http/<time>).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

QUEUES=100000
ROUNDS=3
DURATION=20
WARMUP=3
AB_QUEUES=0
ONLY=""
OUT=""
while [ $# -gt 0 ]; do
  case "$1" in
    --queues) QUEUES="$2"; shift 2 ;;
    --rounds) ROUNDS="$2"; shift 2 ;;
    --duration) DURATION="$2"; shift 2 ;;
    --warmup) WARMUP="$2"; shift 2 ;;
    --ab-queues) AB_QUEUES="$2"; shift 2 ;;
    --only) ONLY="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1 (try --help)" >&2; exit 2 ;;
  esac
done
OUT="${OUT:-$ROOT/target/bench-http/$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$OUT"
log() { echo "== $*" >&2; }
load() { cut -d' ' -f1-3 /proc/loadavg; }

command -v jq >/dev/null || { echo "jq is needed (apt-get install jq)" >&2; exit 1; }
PY="$(bash scripts/python-venv.sh)"
log "building weir and weir-bench (release)"
cargo build --release -p weir-gateway -p weir-bench
WEIR="${WEIR_BIN:-$ROOT/target/release/weir}"
BENCH="$ROOT/target/release/weir-bench"

free_port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

WEIR_PID=""
SCRAPER_PID=""
cleanup() {
  [ -n "$SCRAPER_PID" ] && kill "$SCRAPER_PID" 2>/dev/null || true
  [ -n "$WEIR_PID" ] && kill "$WEIR_PID" 2>/dev/null && wait "$WEIR_PID" 2>/dev/null || true
}
trap cleanup EXIT

# start_weir DATA_DIR [extra flags]: sets WEIR_PID, AMQP_PORT, HTTP_PORT; waits until /metrics answers.
start_weir() {
  local dir="$1"; shift
  AMQP_PORT="$(free_port)"; HTTP_PORT="$(free_port)"
  WEIR_DISK_FREE_LIMIT="${WEIR_DISK_FREE_LIMIT:-50MB}" "$WEIR" --data-dir "$dir" \
    --amqp-listen "127.0.0.1:$AMQP_PORT" --mqtt-listen 127.0.0.1:0 --mqtt-ws-listen 127.0.0.1:0 \
    --http-listen "127.0.0.1:$HTTP_PORT" "$@" >>"$OUT/weir.log" 2>&1 &
  WEIR_PID=$!
  for _ in $(seq 600); do
    curl -sf -o /dev/null "http://127.0.0.1:$HTTP_PORT/metrics" && return 0
    kill -0 "$WEIR_PID" 2>/dev/null || { echo "weir exited (see $OUT/weir.log)" >&2; exit 1; }
    sleep 0.1
  done
  echo "weir did not answer on /metrics within 60 s" >&2; exit 1
}
stop_weir() { kill "$WEIR_PID"; wait "$WEIR_PID" 2>/dev/null || true; WEIR_PID=""; }

# declare N: N durable queues bench-http-NNNNNN over 16 connections.
declare_queues() {
  "$PY" - "$AMQP_PORT" "$1" <<'PY'
import sys, threading, time, pika
port, n = int(sys.argv[1]), int(sys.argv[2])
names = [f"bench-http-{i:06d}" for i in range(n)]
errors = []
def work(part):
    try:
        c = pika.BlockingConnection(pika.URLParameters(f"amqp://guest:guest@127.0.0.1:{port}/%2f"))
        ch = c.channel()
        for q in part:
            ch.queue_declare(q, durable=True)
        c.close()
    except Exception as e:
        errors.append(repr(e))
t0 = time.monotonic()
ts = [threading.Thread(target=work, args=(names[i::16],)) for i in range(16)]
[t.start() for t in ts]; [t.join() for t in ts]
if errors:
    sys.exit(f"declare failed: {errors[:3]}")
print(f"{n} queues declared in {time.monotonic() - t0:.1f} s", file=sys.stderr)
PY
}

# time_get URL LABEL: 5 GETs; prints "LABEL | status | median s | max s | bytes" as a table row.
time_get() {
  local url="$1" label="$2" times=() code size t
  for _ in 1 2 3 4 5; do
    read -r code t size < <(curl -s -o /dev/null -w '%{http_code} %{time_total} %{size_download}\n' "$url")
    times+=("$t")
  done
  local sorted; sorted="$(printf '%s\n' "${times[@]}" | sort -n)"
  echo "| $label | $code | $(echo "$sorted" | sed -n 3p) | $(echo "$sorted" | tail -1) | $size | $(load) |"
}

{
  echo "# bench-http $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD), $(nproc) cores"
  echo
} >"$OUT/results.md"

if [ "$ONLY" != ab ]; then
  DATA="$(mktemp -d /tmp/weir-bench-http.XXXXXX)"
  log "scale: $QUEUES durable queues"
  start_weir "$DATA"
  declare_queues "$QUEUES"
  {
    echo "## $QUEUES queues"
    echo
    echo "| request | status | median s (5) | max s | bytes | load avg (1/5/15 min) |"
    echo "|---|---|---:|---:|---:|---|"
    time_get "http://guest:guest@127.0.0.1:$HTTP_PORT/metrics" "GET /metrics (per queue)"
    time_get "http://guest:guest@127.0.0.1:$HTTP_PORT/api/queues?page=1&page_size=100" \
      "GET /api/queues?page=1&page_size=100"
  } >>"$OUT/results.md.part"
  stop_weir
  start_weir "$DATA" --http-metrics-per-queue false
  time_get "http://guest:guest@127.0.0.1:$HTTP_PORT/metrics" "GET /metrics (aggregated per tenant)" >>"$OUT/results.md.part"
  stop_weir
  rm -rf "$DATA"
  cat "$OUT/results.md.part" >>"$OUT/results.md"; rm -f "$OUT/results.md.part"
  echo >>"$OUT/results.md"
  echo "(a status other than 200 for /api/queues: that endpoint is not built in this checkout)" >>"$OUT/results.md"
  echo >>"$OUT/results.md"
fi

if [ "$ONLY" != scale ]; then
  DATA="$(mktemp -d /tmp/weir-bench-http.XXXXXX)"
  log "A/B: saturated AMQP, without (A) and with (B) a /metrics scrape every second"
  start_weir "$DATA"
  [ "$AB_QUEUES" -gt 0 ] && declare_queues "$AB_QUEUES"
  URL="amqp://guest:guest@127.0.0.1:$AMQP_PORT/%2f"
  run() { # run SIDE ROUND
    local side="$1" r="$2" json="$OUT/ab-$1-r$2.json" before after
    before="$(load)"
    if [ "$side" = B ]; then
      ( while true; do curl -s -o /dev/null "http://guest:guest@127.0.0.1:$HTTP_PORT/metrics"; sleep 1; done ) &
      SCRAPER_PID=$!
    fi
    "$BENCH" --url "$URL" --queue-type classic --publishers 2 --consumers 2 --size 256 --window 256 \
      --prefetch 256 --rate 0 --duration "$DURATION" --warmup "$WARMUP" --durable true --persistent true \
      --label "weir-$side" --json --broker-pid "$WEIR_PID" >"$json" 2>"${json%.json}.err"
    if [ -n "$SCRAPER_PID" ]; then kill "$SCRAPER_PID"; wait "$SCRAPER_PID" 2>/dev/null || true; SCRAPER_PID=""; fi
    after="$(load)"
    jq -r --arg s "$side" --arg r "$r" --arg b "$before" --arg a "$after" \
      '"| \($r) | \($s) | \(.publish_rate|floor) | \(.confirm_latency.p95_ms) | \(.other_cpu_cores // "?") | \($b) → \($a) |"' \
      "$json" | tee -a "$OUT/ab.rows" >&2
  }
  for r in $(seq "$ROUNDS"); do
    if [ $((r % 2)) = 1 ]; then run A "$r"; run B "$r"; else run B "$r"; run A "$r"; fi
  done
  stop_weir
  rm -rf "$DATA"
  {
    echo "## saturated AMQP with and without scraping ($ROUNDS rounds, $DURATION s + $WARMUP s warm-up each$([ "$AB_QUEUES" -gt 0 ] && echo ", $AB_QUEUES extra queues"))"
    echo
    echo "| round | side | msg/s | confirm p95 ms | other CPU cores | load avg before → after |"
    echo "|---|---|---:|---:|---:|---|"
    cat "$OUT/ab.rows"
    echo
    "$PY" - "$OUT" <<'PY'
import glob, json, statistics, sys
out = sys.argv[1]
rate = {s: [json.load(open(f))["publish_rate"] for f in sorted(glob.glob(f"{out}/ab-{s}-r*.json"))] for s in "AB"}
a, b = statistics.median(rate["A"]), statistics.median(rate["B"])
print(f"Median A (no scraping) {a:,.0f} msg/s, B (scrape every second) {b:,.0f} msg/s: B/A = {b / a:.3f}.")
PY
  } >>"$OUT/results.md"
fi

cat "$OUT/results.md"
