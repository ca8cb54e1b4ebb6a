#!/usr/bin/env bash
# Side-by-side benchmark: RabbitMQ (classic and quorum queues) vs Weir, same client, same machine, same run.
#
# Workloads (DESIGN.md §5), each against every target, one after the other:
#   saturated : 2 publishers with confirms (window 256), 2 consumers acking (prefetch 256), 256-byte bodies,
#               durable queue, persistent messages, as fast as confirms allow
#   rate      : the same shape paced at a fixed total rate (default 1,000 msg/s)
#
# Usage: scripts/bench-compare.sh [--duration S] [--warmup S] [--rate R] [--only rabbitmq|weir]
#                                 [--out DIR] [--bench-args "extra weir-bench flags"]
#                                 [--quiet-wait S (60)] [--quiet-max CORES (0.3)] [--retries N (1)]
#        WEIR_BIN=/path/to/weir runs that broker binary instead of this checkout's release build
#        (e.g. an older commit's, for an A/B of one change in the same conditions).
#
# What it does: installs Debian's rabbitmq-server if missing and starts it if it isn't running; builds
# weir-bench and the weir broker in release; runs the RabbitMQ targets; stops RabbitMQ if this script
# started it (so the idle Erlang VM doesn't share the 2 cores with Weir); starts Weir on a temporary data
# dir and a free port and runs the Weir target. Weir may not build or start yet: the script then reports
# why and still prints RabbitMQ's figures. Whatever it started is stopped on exit (trap).
#
# Results: one JSON file per run plus results.md (the table) in --out (default target/bench-compare/<time>).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

DURATION=20
WARMUP=3
RATE=1000
ONLY=""
OUT=""
EXTRA=""
QUIET_WAIT=60    # seconds to wait for an idle machine before each run
QUIET_MAX=0.3    # "idle": at most this many busy cores
RETRIES=1        # re-runs of a run that other work disturbed (other CPU above QUIET_MAX)
while [ $# -gt 0 ]; do
  case "$1" in
    --duration) DURATION="$2"; shift 2 ;;
    --warmup) WARMUP="$2"; shift 2 ;;
    --rate) RATE="$2"; shift 2 ;;
    --only) ONLY="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --bench-args) EXTRA="$2"; shift 2 ;;
    --quiet-wait) QUIET_WAIT="$2"; shift 2 ;;
    --quiet-max) QUIET_MAX="$2"; shift 2 ;;
    --retries) RETRIES="$2"; shift 2 ;;
    -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1 (try --help)" >&2; exit 2 ;;
  esac
done
OUT="${OUT:-$ROOT/target/bench-compare/$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$OUT"

log() { printf '\n== %s\n' "$*" >&2; }

# ---------------------------------------------------------------- cleanup of what we start
STARTED_RABBIT=0
WEIR_PID=""
WEIR_DIR=""
cleanup() {
  set +e
  if [ -n "$WEIR_PID" ] && kill -0 "$WEIR_PID" 2>/dev/null; then
    # SIGTERM for a clean store close; SIGKILL if it hasn't exited within 10 s.
    kill "$WEIR_PID"
    for _ in $(seq 100); do kill -0 "$WEIR_PID" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$WEIR_PID" 2>/dev/null
    wait "$WEIR_PID" 2>/dev/null
  fi
  [ -n "$WEIR_DIR" ] && rm -rf "$WEIR_DIR"
  if [ "$STARTED_RABBIT" = 1 ]; then stop_rabbit; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

stop_rabbit() {
  log "stopping the RabbitMQ this script started"
  rabbitmqctl stop >/dev/null 2>&1 || true
  STARTED_RABBIT=0
}

# ---------------------------------------------------------------- tools
need_pkg() { # need_pkg COMMAND PACKAGE
  command -v "$1" >/dev/null 2>&1 && return 0
  log "installing $2"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$2" >/dev/null 2>&1 || {
    apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$2" >/dev/null
  }
}
need_pkg jq jq

# ---------------------------------------------------------------- build
log "building weir-bench (release)"
cargo build --release -p weir-bench
BENCH="$ROOT/target/release/weir-bench"

WEIR_STATUS="not run"
if [ "$ONLY" != "rabbitmq" ]; then
  log "building weir (release)"
  # Separate from weir-bench so a broker that doesn't compile yet still leaves us RabbitMQ's figures.
  if cargo build --release -p weir-gateway 2>"$OUT/weir-build.log"; then
    WEIR_STATUS="built"
  else
    WEIR_STATUS="build failed (see $OUT/weir-build.log)"
    tail -5 "$OUT/weir-build.log" >&2
  fi
fi

# ---------------------------------------------------------------- runs
# Busy cores of the whole machine over one second (from /proc/stat), e.g. "0.12".
busy_cores() {
  local a b
  a="$(head -1 /proc/stat)"; sleep 1; b="$(head -1 /proc/stat)"
  awk -v a="$a" -v b="$b" 'BEGIN {
    split(a, x); split(b, y); t = 0; i = 0
    for (k = 2; k <= 9; k++) t += y[k] - x[k]
    i = (y[5] - x[5]) + (y[6] - x[6])
    printf "%.2f", (t - i) / 100 }'
}

# The machine may be shared (e.g. other people's cargo builds): before each run wait, up to
# QUIET_WAIT seconds, until it is nearly idle, so the brokers don't compete with unrelated work.
# Each run's JSON also records machine_busy_cores, which shows whether a run was disturbed anyway.
wait_quiet() {
  local waited=0 quiet=0 busy
  while :; do
    busy="$(busy_cores)"
    # Builds pause between crates, so one idle second proves little: ask for three in a row.
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

# run_bench LABEL URL QUEUE_TYPE WORKLOAD BROKER_PID: writes $OUT/LABEL-WORKLOAD.json, returns non-zero
# on failure. The broker's PID lets weir-bench report the broker's CPU and, by difference, other noise.
run_bench() {
  local label="$1" url="$2" qtype="$3" workload="$4" pid="${5:-}" rate=0 pidarg=() attempt
  local json="$OUT/$label-$workload.json" errf="$OUT/$label-$workload.err"
  [ -n "$pid" ] && pidarg=(--broker-pid "$pid")
  [ "$workload" = rate ] && rate="$RATE"
  for attempt in $(seq $((RETRIES + 1))); do
    log "$label / $workload ($DURATION s + $WARMUP s warm-up)$([ "$attempt" -gt 1 ] && echo ", attempt $attempt")"
    wait_quiet
    # shellcheck disable=SC2086 # EXTRA is deliberately word-split into flags
    if ! "$BENCH" --url "$url" --queue-type "$qtype" --publishers 2 --consumers 2 --size 256 \
        --window 256 --prefetch 256 --rate "$rate" --duration "$DURATION" --warmup "$WARMUP" \
        --durable true --persistent true --label "$label" --json "${pidarg[@]}" $EXTRA \
        >"$json" 2>"$errf"; then
      echo "   FAILED: $(tail -1 "$errf")" >&2
      rm -f "$json"
      return 1
    fi
    jq -r '"   \(.publish_rate|floor) msg/s published, confirm p95 \(.confirm_latency.p95_ms) ms, other CPU \(.other_cpu_cores // "?") cores"' \
      "$json" >&2
    # Something else used the CPU during the run: its figures are suspect, so try again (the table
    # keeps the last attempt and still flags it if it was disturbed too).
    jq -e --argjson m "$QUIET_MAX" '(.other_cpu_cores // 0) <= $m' "$json" >/dev/null && return 0
    [ "$attempt" -le "$RETRIES" ] && echo "   disturbed by other work; running again" >&2
  done
  return 0
}

RABBIT_STATUS="not run"
if [ "$ONLY" != "weir" ]; then
  need_pkg rabbitmq-server rabbitmq-server
  if ! rabbitmqctl status >/dev/null 2>&1; then
    log "starting rabbitmq-server"
    # No systemd in the sandbox: the service script or a detached node both work.
    service rabbitmq-server start >/dev/null 2>&1 || rabbitmq-server -detached
    STARTED_RABBIT=1
  fi
  # await_startup fails outright while the node hasn't registered with epmd yet: retry for up to 2 min.
  for i in $(seq 60); do
    rabbitmqctl await_startup >/dev/null 2>&1 && break
    [ "$i" = 60 ] && { echo "RabbitMQ did not start (see /var/log/rabbitmq/)" >&2; exit 1; }
    sleep 2
  done
  RABBIT_VERSION="$(rabbitmqctl version 2>/dev/null || echo '?')"
  RABBIT_STATUS="RabbitMQ $RABBIT_VERSION"
  RURL="amqp://guest:guest@127.0.0.1:5672/%2f"
  RPID="$(rabbitmqctl eval 'os:getpid().' 2>/dev/null | tr -dc 0-9)"
  for qt in classic quorum; do
    for w in saturated rate; do
      run_bench "rabbitmq-$qt" "$RURL" "$qt" "$w" "$RPID" || true
    done
  done
  # Free the cores and memory before Weir runs (only if the node is ours to stop).
  if [ "$STARTED_RABBIT" = 1 ] && [ "$ONLY" != "rabbitmq" ]; then stop_rabbit; fi
fi

if [ "$WEIR_STATUS" = built ]; then
  WEIR_DIR="$(mktemp -d /tmp/weir-bench-data.XXXXXX)"
  # A free port: bind to 0 and read back what the kernel picked.
  PORT="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])' 2>/dev/null || echo 35672)"
  log "starting weir on 127.0.0.1:$PORT (data dir $WEIR_DIR)"
  "${WEIR_BIN:-$ROOT/target/release/weir}" --data-dir "$WEIR_DIR" --amqp-listen "127.0.0.1:$PORT" \
    >"$OUT/weir.log" 2>&1 &
  WEIR_PID=$!
  WEIR_STATUS="did not start listening within 30 s (see $OUT/weir.log)"
  for _ in $(seq 300); do
    if ! kill -0 "$WEIR_PID" 2>/dev/null; then
      WEIR_STATUS="exited at start-up (see $OUT/weir.log)"; WEIR_PID=""; break
    fi
    if (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null; then WEIR_STATUS="running"; break; fi
    sleep 0.1
  done
  if [ "$WEIR_STATUS" = running ]; then
    # Weir maps classic and quorum alike onto its durable work queue; classic is the plain declaration.
    for w in saturated rate; do
      run_bench weir "amqp://guest:guest@127.0.0.1:$PORT/%2f" classic "$w" "$WEIR_PID" \
        || WEIR_STATUS="running, but a run failed (see $OUT/weir-$w.err)"
    done
  else
    tail -5 "$OUT/weir.log" >&2 || true
  fi
fi

# ---------------------------------------------------------------- report
# One table row per run. "other cores" is machine CPU used by neither broker nor client during the
# measured window: above ~0.2 the run competed with something else (⚠) and its latency tail is suspect.
cat >"$OUT/row.jq" <<'JQ'
def r2: if type == "number" then (. * 100 | round / 100) else "?" end;
def cpu(us; cores): "\(us | r2) (\(cores | r2))";
"| \($w) | \($t) | \(.publish_rate | floor) | \(.consume_rate | floor)"
+ " | \(.confirm_latency.p50_ms) / \(.confirm_latency.p95_ms) / \(.confirm_latency.p99_ms)"
+ " | \(.e2e_latency.p50_ms) / \(.e2e_latency.p95_ms) / \(.e2e_latency.p99_ms)"
+ " | \(cpu(.broker_cpu_us_per_msg; .broker_cpu_cores)) | \(cpu(.client_cpu_us_per_msg; .client_cpu_cores))"
+ " | \(.other_cpu_cores | r2)\(if (.other_cpu_cores // 0) > 0.2 then " ⚠" else "" end) |"
JQ
{
  echo "# bench-compare $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo
  echo "machine: $(nproc) cores, $(free -g | awk '/Mem:/{print $2}') GiB, kernel $(uname -r); load before report: $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "RabbitMQ: $RABBIT_STATUS; Weir: $WEIR_STATUS"
  echo "each run: 2 publishers (confirms, window 256), 2 consumers (prefetch 256, multi-ack), 256 B, durable+persistent, ${DURATION}s measured after ${WARMUP}s warm-up"
  echo
  echo "| workload | target | published msg/s | consumed msg/s | confirm p50 / p95 / p99 ms | end-to-end p50 / p95 / p99 ms | broker µs/msg (cores) | client µs/msg (cores) | other cores |"
  echo "|---|---|---:|---:|---|---|---:|---:|---:|"
  for w in saturated rate; do
    for t in rabbitmq-classic rabbitmq-quorum weir; do
      f="$OUT/$t-$w.json"
      wl="$w"; [ "$w" = rate ] && wl="$RATE msg/s"
      if [ -f "$f" ]; then
        jq -r --arg w "$wl" --arg t "$t" -f "$OUT/row.jq" "$f"
      else
        echo "| $wl | $t | — | — | — | — | — | — | — |"
      fi
    done
  done
  echo
  echo "Ratios Weir / best RabbitMQ (throughput: >1 is better; confirm p95: <1 is better):"
  for w in saturated rate; do
    files=()
    for t in rabbitmq-classic rabbitmq-quorum; do [ -f "$OUT/$t-$w.json" ] && files+=("$OUT/$t-$w.json"); done
    if [ -f "$OUT/weir-$w.json" ] && [ ${#files[@]} -gt 0 ]; then
      jq -rs --arg w "$w" '
        (.[0]) as $weir | (.[1:]) as $rmq
        | ($rmq | map(.publish_rate) | max) as $best_tp
        | ($rmq | map(.confirm_latency.p95_ms) | min) as $best_p95
        | "- \($w): throughput \($weir.publish_rate / $best_tp * 100 | round / 100)x, confirm p95 \(if $best_p95 > 0 then ($weir.confirm_latency.p95_ms / $best_p95 * 100 | round / 100 | tostring) + "x" else "n/a" end)"' \
        "$OUT/weir-$w.json" "${files[@]}"
    else
      if [ ! -f "$OUT/weir-$w.json" ]; then
        echo "- $w: n/a (no Weir figures; Weir: $WEIR_STATUS)"
      else
        echo "- $w: n/a (no RabbitMQ figures; RabbitMQ: $RABBIT_STATUS)"
      fi
    fi
  done
} | tee "$OUT/results.md"
echo >&2
echo "results in $OUT" >&2
