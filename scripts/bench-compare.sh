#!/usr/bin/env bash
# Side-by-side benchmark: RabbitMQ (classic and quorum queues) vs Weir, same client, same machine, same run.
#
# Workloads (DESIGN.md §5), each against every target, one after the other:
#   saturated : 2 publishers with confirms (window 256), 2 consumers acking (prefetch 256), 256-byte bodies,
#               durable queue, persistent messages, as fast as confirms allow
#   rate      : the same shape paced at a fixed total rate (default 1,000 msg/s)
#   mqtt      : issue 8's MQTT benchmarks against Debian's Mosquitto and Weir (QoS 1 to a persistent
#               subscriber, fan-out to 10,000 connections at QoS 0 and 1, 10,000 idle connections):
#               scripts/bench-mqtt.sh, run after the AMQP workloads with --duration, --warmup,
#               --quiet-wait, --quiet-max, --retries passed on, --only rabbitmq meaning its reference
#               broker (mosquitto), and its results in <out>/mqtt
#
# Queue variants (--variants, default plain), each run back to back with the others per target and workload:
#   plain     : a durable queue with no arguments
#   features  : x-dead-letter-exchange (a fanout exchange with a bound queue, declared by weir-bench),
#               x-message-ttl 1 h and x-max-length 10,000,000: nothing expires, overflows or is
#               dead-lettered during a run, so this measures the bookkeeping (issue 7: within 10% of plain)
#   priority  : x-max-priority 10, every message with a random priority 0-9 (issue 7: >= 70% of plain);
#               not on RabbitMQ quorum queues, which have no priorities in 3.10
#
# Usage: scripts/bench-compare.sh [--duration S] [--warmup S] [--rate R] [--only rabbitmq|weir]
#                                 [--workloads saturated,rate,mqtt] [--variants plain,features,priority]
#                                 [--rounds N (1)] [--out DIR] [--bench-args "extra weir-bench flags"]
#                                 [--quiet-wait S (60)] [--quiet-max CORES (0.3)] [--retries N (1)]
#        WEIR_BIN=/path/to/weir runs that broker binary instead of this checkout's release build
#        (e.g. an older commit's, for an A/B of one change in the same conditions).
#        scripts/bench-semantics.sh is this script with --variants plain,features,priority
#        --workloads saturated --rounds 3.
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
WORKLOADS="saturated,rate"
VARIANTS="plain"
ROUNDS=1
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
    --workloads) WORKLOADS="$2"; shift 2 ;;
    --variants) VARIANTS="$2"; shift 2 ;;
    --rounds) ROUNDS="$2"; shift 2 ;;
    -h|--help) sed -n '2,37p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1 (try --help)" >&2; exit 2 ;;
  esac
done
OUT="${OUT:-$ROOT/target/bench-compare/$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$OUT"
IFS=, read -r -a ALL_WORKLOADS <<<"$WORKLOADS"
IFS=, read -r -a VARIANT_LIST <<<"$VARIANTS"
WORKLOAD_LIST=()
MQTT=0
for w in "${ALL_WORKLOADS[@]}"; do
  case "$w" in
    saturated|rate) WORKLOAD_LIST+=("$w") ;;
    mqtt) MQTT=1 ;;
    *) echo "unknown workload: $w (saturated, rate, mqtt)" >&2; exit 2 ;;
  esac
done
# The MQTT benchmarks have their own script (brokers, client and tables of their own).
run_mqtt() {
  local only=""
  case "$ONLY" in rabbitmq) only=mosquitto ;; weir) only=weir ;; esac
  "$ROOT/scripts/bench-mqtt.sh" --duration "$DURATION" --warmup "$WARMUP" --quiet-wait "$QUIET_WAIT" \
    --quiet-max "$QUIET_MAX" --retries "$RETRIES" ${only:+--only "$only"} --out "$1"
}
if [ ${#WORKLOAD_LIST[@]} -eq 0 ]; then
  run_mqtt "$OUT/mqtt"
  exit $?
fi
for v in "${VARIANT_LIST[@]}"; do
  case "$v" in plain|features|priority) ;; *) echo "unknown variant: $v (plain, features, priority)" >&2; exit 2 ;; esac
done
case "$ROUNDS" in ''|*[!0-9]*|0) echo "--rounds must be a positive integer" >&2; exit 2 ;; esac

# weir-bench flags of each queue variant (see the header). The TTL and length limit are far beyond
# what a run reaches (a consumed queue stays a few hundred deep), so nothing is dropped or expires.
variant_args() {
  case "$1" in
    plain) ;;
    features) printf '%s\n' --queue-args \
      '{"x-dead-letter-exchange":"weir-bench.dlx","x-message-ttl":3600000,"x-max-length":10000000}' ;;
    priority) printf '%s\n' --queue-args '{"x-max-priority":10}' --priorities 10 ;;
  esac
}

# The results file of one run.
result_file() { # LABEL WORKLOAD VARIANT ROUND
  echo "$OUT/$1-$2-$3-r$4.json"
}

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

# run_bench LABEL URL QUEUE_TYPE WORKLOAD VARIANT ROUND BROKER_PID: writes the run's JSON (result_file),
# returns non-zero on failure. The broker's PID lets weir-bench report the broker's CPU and, by
# difference, other noise.
run_bench() {
  local label="$1" url="$2" qtype="$3" workload="$4" variant="$5" round="$6" pid="${7:-}" rate=0
  local pidarg=() vargs=() attempt json errf
  json="$(result_file "$label" "$workload" "$variant" "$round")"
  errf="${json%.json}.err"
  [ -n "$pid" ] && pidarg=(--broker-pid "$pid")
  [ "$workload" = rate ] && rate="$RATE"
  mapfile -t vargs < <(variant_args "$variant")
  for attempt in $(seq $((RETRIES + 1))); do
    log "$label / $workload / $variant queue, round $round ($DURATION s + $WARMUP s warm-up)$([ "$attempt" -gt 1 ] && echo ", attempt $attempt")"
    wait_quiet
    # shellcheck disable=SC2086 # EXTRA is deliberately word-split into flags
    if ! "$BENCH" --url "$url" --queue-type "$qtype" --publishers 2 --consumers 2 --size 256 \
        --window 256 --prefetch 256 --rate "$rate" --duration "$DURATION" --warmup "$WARMUP" \
        --durable true --persistent true --label "$label" --json "${pidarg[@]}" "${vargs[@]}" $EXTRA \
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
  for r in $(seq "$ROUNDS"); do
    for qt in classic quorum; do
      for w in "${WORKLOAD_LIST[@]}"; do
        for v in "${VARIANT_LIST[@]}"; do
          # RabbitMQ 3.10's quorum queues have no priorities.
          [ "$qt/$v" = quorum/priority ] && continue
          run_bench "rabbitmq-$qt" "$RURL" "$qt" "$w" "$v" "$r" "$RPID" || true
        done
      done
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
  "${WEIR_BIN:-$ROOT/target/release/weir}" --data-dir "$WEIR_DIR" --amqp-listen "127.0.0.1:$PORT" --mqtt-listen 127.0.0.1:0 --mqtt-ws-listen 127.0.0.1:0 --http-listen 127.0.0.1:0 \
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
    for r in $(seq "$ROUNDS"); do
      for w in "${WORKLOAD_LIST[@]}"; do
        for v in "${VARIANT_LIST[@]}"; do
          run_bench weir "amqp://guest:guest@127.0.0.1:$PORT/%2f" classic "$w" "$v" "$r" "$WEIR_PID" \
            || WEIR_STATUS="running, but a run failed (see $OUT/weir-$w-$v-r$r.err)"
        done
      done
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
"| \($w) | \($t)\($v) | \(.publish_rate | floor) | \(.consume_rate | floor)"
+ " | \(.confirm_latency.p50_ms) / \(.confirm_latency.p95_ms) / \(.confirm_latency.p99_ms)"
+ " | \(.e2e_latency.p50_ms) / \(.e2e_latency.p95_ms) / \(.e2e_latency.p99_ms)"
+ " | \(cpu(.broker_cpu_us_per_msg; .broker_cpu_cores)) | \(cpu(.client_cpu_us_per_msg; .client_cpu_cores))"
+ " | \(.other_cpu_cores | r2)\(if (.other_cpu_cores // 0) > 0.2 then " ⚠" else "" end) |"
JQ
# The median of one field over the rounds of a target/workload/variant (the files given), or nothing.
median_of() { # FIELD FILE...
  local field="$1"; shift
  [ $# -gt 0 ] || return 0
  jq -s "map($field) | sort | if length % 2 == 1 then .[length / 2 | floor] else (.[length / 2 - 1] + .[length / 2]) / 2 end" "$@"
}
rounds_of() { # LABEL WORKLOAD VARIANT: the existing result files over all rounds
  local r f
  for r in $(seq "$ROUNDS"); do
    f="$(result_file "$1" "$2" "$3" "$r")"
    [ -f "$f" ] && echo "$f"
  done
  return 0
}
wl_name() { if [ "$1" = rate ]; then echo "$RATE msg/s"; else echo "$1"; fi; }
{
  echo "# bench-compare $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo
  echo "machine: $(nproc) cores, $(free -g | awk '/Mem:/{print $2}') GiB, kernel $(uname -r); load before report: $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "RabbitMQ: $RABBIT_STATUS; Weir: $WEIR_STATUS"
  echo "each run: 2 publishers (confirms, window 256), 2 consumers (prefetch 256, multi-ack), 256 B, durable+persistent, ${DURATION}s measured after ${WARMUP}s warm-up; variants: $VARIANTS; rounds: $ROUNDS"
  echo
  echo "| workload | target | published msg/s | consumed msg/s | confirm p50 / p95 / p99 ms | end-to-end p50 / p95 / p99 ms | broker µs/msg (cores) | client µs/msg (cores) | other cores |"
  echo "|---|---|---:|---:|---|---|---:|---:|---:|"
  for w in "${WORKLOAD_LIST[@]}"; do
    for t in rabbitmq-classic rabbitmq-quorum weir; do
      for v in "${VARIANT_LIST[@]}"; do
        [ "$t/$v" = rabbitmq-quorum/priority ] && continue
        vl=""; [ "$VARIANTS" != plain ] && vl=" $v"
        for r in $(seq "$ROUNDS"); do
          f="$(result_file "$t" "$w" "$v" "$r")"
          rl="$vl"; [ "$ROUNDS" -gt 1 ] && rl="$vl (round $r)"
          if [ -f "$f" ]; then
            jq -r --arg w "$(wl_name "$w")" --arg t "$t" --arg v "$rl" -f "$OUT/row.jq" "$f"
          else
            echo "| $(wl_name "$w") | $t$rl | — | — | — | — | — | — | — |"
          fi
        done
      done
    done
  done
  echo
  [ "$ROUNDS" -gt 1 ] && echo "(ratios below compare medians over the $ROUNDS rounds)"
  echo "Ratios Weir / best RabbitMQ (throughput: >1 is better; confirm p95: <1 is better):"
  for w in "${WORKLOAD_LIST[@]}"; do
    for v in "${VARIANT_LIST[@]}"; do
      vl=""; [ "$VARIANTS" != plain ] && vl=" ($v queue)"
      mapfile -t wf < <(rounds_of weir "$w" "$v")
      best_tp=""; best_p95=""
      for t in rabbitmq-classic rabbitmq-quorum; do
        mapfile -t rf < <(rounds_of "$t" "$w" "$v")
        [ ${#rf[@]} -gt 0 ] || continue
        tp="$(median_of .publish_rate "${rf[@]}")"; p95="$(median_of .confirm_latency.p95_ms "${rf[@]}")"
        if [ -z "$best_tp" ] || awk -v a="$tp" -v b="$best_tp" 'BEGIN { exit !(a > b) }'; then best_tp="$tp"; fi
        if [ -z "$best_p95" ] || awk -v a="$p95" -v b="$best_p95" 'BEGIN { exit !(a < b) }'; then best_p95="$p95"; fi
      done
      if [ ${#wf[@]} -gt 0 ] && [ -n "$best_tp" ]; then
        tp="$(median_of .publish_rate "${wf[@]}")"; p95="$(median_of .confirm_latency.p95_ms "${wf[@]}")"
        awk -v w="$w$vl" -v tp="$tp" -v btp="$best_tp" -v p="$p95" -v bp="$best_p95" 'BEGIN {
          printf "- %s: throughput %.2fx, confirm p95 %s\n", w, tp / btp, (bp > 0 ? sprintf("%.2fx", p / bp) : "n/a") }'
      elif [ ${#wf[@]} -eq 0 ]; then
        echo "- $w$vl: n/a (no Weir figures; Weir: $WEIR_STATUS)"
      else
        echo "- $w$vl: n/a (no RabbitMQ figures; RabbitMQ: $RABBIT_STATUS)"
      fi
    done
  done
  if [ "$VARIANTS" != plain ] && [[ ",$VARIANTS," == *,plain,* ]]; then
    echo
    echo "Each variant against the plain queue, same target (published msg/s; issue 7 asks features >= 0.90, priority >= 0.70 for Weir):"
    for w in "${WORKLOAD_LIST[@]}"; do
      for t in rabbitmq-classic rabbitmq-quorum weir; do
        mapfile -t pf < <(rounds_of "$t" "$w" plain)
        [ ${#pf[@]} -gt 0 ] || continue
        base="$(median_of .publish_rate "${pf[@]}")"
        for v in "${VARIANT_LIST[@]}"; do
          [ "$v" = plain ] && continue
          mapfile -t vf < <(rounds_of "$t" "$w" "$v")
          [ ${#vf[@]} -gt 0 ] || continue
          tp="$(median_of .publish_rate "${vf[@]}")"
          cpu_v="$(median_of '(.broker_cpu_us_per_msg // 0)' "${vf[@]}")"
          cpu_p="$(median_of '(.broker_cpu_us_per_msg // 0)' "${pf[@]}")"
          dl="$(jq -s 'map(.dead_lettered // 0) | add' "${vf[@]}")"
          awk -v w="$(wl_name "$w")" -v t="$t" -v v="$v" -v tp="$tp" -v b="$base" -v cv="$cpu_v" -v cp="$cpu_p" -v dl="$dl" 'BEGIN {
            printf "- %s, %s: %s %.0f / plain %.0f msg/s = **%.2f**; broker CPU %.2f / %.2f µs/msg%s\n",
              w, t, v, tp, b, tp / b, cv, cp, (v == "features" ? sprintf("; dead-lettered %d", dl) : "") }'
        done
      done
    done
  fi
} | tee "$OUT/results.md"
echo >&2
echo "results in $OUT" >&2
if [ "$MQTT" = 1 ]; then
  # After the AMQP report (and after RabbitMQ was stopped, if this script started it).
  cleanup
  trap - EXIT
  run_mqtt "$OUT/mqtt"
fi
