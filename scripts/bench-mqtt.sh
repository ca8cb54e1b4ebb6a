#!/usr/bin/env bash
# Issue 8's MQTT benchmarks: Debian's Mosquitto 2.0 vs Weir, same client (weir-mqtt-bench), same
# machine, same run. `scripts/bench-compare.sh --workloads mqtt` runs this script.
#
# Workloads (--workloads, default all four), each against every target, one after the other:
#   qos1     : 2 publishers, QoS 1, window 256 unacknowledged each, 256-byte payloads, one topic; one
#              persistent-session subscriber (clean session off) at QoS 1 acking everything.
#              Publish msg/s, PUBACK p50/p95/p99 (publish -> PUBACK), publish -> deliver latency.
#              (issue 8: Weir >= 1.5x Mosquitto's throughput with a lower PUBACK p95, fsync on)
#   fanout0  : 10,000 subscriber connections on one topic at QoS 0, one QoS 0 publisher keeping 4
#              publishes in fan-out (not yet at every subscriber); 64-byte payloads.
#              Delivered msg/s, publish -> deliver latency, publish -> last subscriber latency.
#   fanout1  : the same at QoS 1 (publisher and subscriptions; every subscriber PUBACKs).
#   idle     : 10,000 connections (keep-alive 60 s) that connect and do nothing; the broker's RSS
#              growth per connection (VmRSS before / after). (issue 8: <= 4 KB each)
#   idlesub  : (not in the default list) idle, but each connection first subscribes to a topic of its
#              own at QoS 1, as a device waiting for commands would.
#
# Each workload gets a freshly started broker (RSS and state of one run never leak into the next):
#   mosquitto : Debian's mosquitto on a free port with its own config and data dir (persistence on,
#               so the persistent session is kept as Weir keeps it; Mosquitto writes its database on
#               autosave and shutdown, never per message). Limits that would drop or throttle
#               deliveries are lifted to match Weir's: max_queued_messages 0 (no limit; Weir keeps
#               1,000,000 per session), max_inflight_messages 0 (no limit; Weir's window towards a
#               3.1.1 client is 65,535). Users guest/guest, TCP_NODELAY on.
#   weir      : this checkout's release build (or WEIR_BIN), fresh data dir, free port, fsync on
#               (every PUBACK of a message for the persistent session waits for the fsync).
#
# Usage: scripts/bench-mqtt.sh [--duration S (20)] [--warmup S (3)] [--only mosquitto|weir]
#                              [--workloads qos1,fanout0,fanout1,idle[,idlesub]] [--connections N (10000)]
#                              [--out DIR] [--bench-args "extra weir-mqtt-bench flags"]
#                              [--quiet-wait S (60)] [--quiet-max CORES (0.3)] [--retries N (1)]
#        WEIR_BIN=/path/to/weir runs that broker binary instead of this checkout's release build.
#
# 10,000 connections need file descriptors: the script raises `ulimit -n` to 65536 (root can) for
# itself, the client and both brokers; the client spreads its connections over the source addresses
# 127.0.0.2-251 so the ephemeral ports of one address (and their TIME_WAIT) never run out.
# Results: one JSON file per run plus results.md (the tables) in --out (default
# target/bench-mqtt/<time>). Whatever it started is stopped on exit (trap). ~6 min.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

DURATION=20
WARMUP=3
ONLY=""
OUT=""
EXTRA=""
QUIET_WAIT=60
QUIET_MAX=0.3
RETRIES=1
WORKLOADS="qos1,fanout0,fanout1,idle"
CONNECTIONS=10000
while [ $# -gt 0 ]; do
  case "$1" in
    --duration) DURATION="$2"; shift 2 ;;
    --warmup) WARMUP="$2"; shift 2 ;;
    --only) ONLY="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --bench-args) EXTRA="$2"; shift 2 ;;
    --quiet-wait) QUIET_WAIT="$2"; shift 2 ;;
    --quiet-max) QUIET_MAX="$2"; shift 2 ;;
    --retries) RETRIES="$2"; shift 2 ;;
    --workloads) WORKLOADS="$2"; shift 2 ;;
    --connections) CONNECTIONS="$2"; shift 2 ;;
    -h|--help) sed -n '2,39p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1 (try --help)" >&2; exit 2 ;;
  esac
done
OUT="${OUT:-$ROOT/target/bench-mqtt/$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$OUT"
IFS=, read -r -a WORKLOAD_LIST <<<"$WORKLOADS"
for w in "${WORKLOAD_LIST[@]}"; do
  case "$w" in qos1|fanout0|fanout1|idle|idlesub) ;; *) echo "unknown workload: $w (qos1, fanout0, fanout1, idle, idlesub)" >&2; exit 2 ;; esac
done
case "$ONLY" in ""|mosquitto|weir) ;; *) echo "--only takes mosquitto or weir" >&2; exit 2 ;; esac
TARGETS=()
[ "$ONLY" != weir ] && TARGETS+=(mosquitto)
[ "$ONLY" != mosquitto ] && TARGETS+=(weir)

log() { printf '\n== %s\n' "$*" >&2; }

# ---------------------------------------------------------------- file descriptors
# Both brokers and the client inherit this limit. Raising the hard limit needs root; without it
# the soft limit goes as high as the hard one allows and the run says what it got.
ulimit -n 65536 2>/dev/null || ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
FDS="$(ulimit -n)"
if [ "$FDS" != unlimited ] && [ "$FDS" -lt $((CONNECTIONS + 1000)) ]; then
  echo "bench-mqtt: ulimit -n is $FDS, too low for $CONNECTIONS connections (run as root or raise it)" >&2
  exit 1
fi

# ---------------------------------------------------------------- cleanup of what we start
BROKER_PID=""
BROKER_DIR=""
stop_broker() {
  set +e
  if [ -n "$BROKER_PID" ] && kill -0 "$BROKER_PID" 2>/dev/null; then
    # SIGTERM: Weir closes its store, Mosquitto saves its database; SIGKILL after 20 s.
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

# ---------------------------------------------------------------- tools
need_pkg() { # need_pkg COMMAND PACKAGE
  command -v "$1" >/dev/null 2>&1 && return 0
  log "installing $2"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$2" >/dev/null 2>&1 || {
    apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$2" >/dev/null
  }
}
need_pkg jq jq
[ "$ONLY" != weir ] && need_pkg mosquitto mosquitto

log "building weir-mqtt-bench (release)"
cargo build --release -p weir-bench --bin weir-mqtt-bench
BENCH="$ROOT/target/release/weir-mqtt-bench"
WEIR_STATUS="not run"
if [ "$ONLY" != mosquitto ]; then
  if [ -n "${WEIR_BIN:-}" ]; then
    WEIR_STATUS="built"
  else
    log "building weir (release)"
    if cargo build --release -p weir-gateway 2>"$OUT/weir-build.log"; then
      WEIR_STATUS="built"
    else
      WEIR_STATUS="build failed (see $OUT/weir-build.log)"
      tail -5 "$OUT/weir-build.log" >&2
    fi
  fi
fi
MOSQ_STATUS="not run"
if [ "$ONLY" != weir ]; then
  MOSQ_STATUS="Mosquitto $({ mosquitto -h 2>/dev/null || true; } | head -n1 | sed 's/^mosquitto version //')"
fi

# ---------------------------------------------------------------- brokers
free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

# Wait until something accepts MQTT on PORT: a CONNECT gets its CONNACK (mosquitto_pub is the
# MQTT client at hand; a bare port probe would only show the socket).
await_mqtt() { # PORT LOG
  for _ in $(seq 300); do
    if ! kill -0 "$BROKER_PID" 2>/dev/null; then
      echo "   broker exited at start-up:" >&2; tail -5 "$2" >&2; BROKER_PID=""; return 1
    fi
    if mosquitto_pub -h 127.0.0.1 -p "$1" -u guest -P guest -t weir-bench/probe -m '' -q 0 >/dev/null 2>&1; then
      return 0
    fi
    sleep 0.1
  done
  echo "   broker not accepting MQTT within 30 s" >&2; return 1
}

# start_broker TARGET RUN: a fresh broker; sets BROKER_PID, BROKER_DIR, PORT.
start_broker() {
  local target="$1" run="$2" blog
  PORT="$(free_port)"
  BROKER_DIR="$(mktemp -d "/tmp/weir-bench-mqtt-$target.XXXXXX")"
  blog="$OUT/$target-$run.log"
  case "$target" in
    mosquitto)
      mkdir -p "$BROKER_DIR/data"
      : >"$BROKER_DIR/passwd"
      mosquitto_passwd -b "$BROKER_DIR/passwd" guest guest
      cat >"$BROKER_DIR/mosquitto.conf" <<EOF
per_listener_settings false
listener $PORT 127.0.0.1
allow_anonymous false
password_file $BROKER_DIR/passwd
persistence true
persistence_location $BROKER_DIR/data/
max_queued_messages 0
max_inflight_messages 0
set_tcp_nodelay true
log_dest stderr
EOF
      if [ "$(id -u)" = 0 ]; then
        # As root Mosquitto drops to this user, which must own its files.
        echo "user mosquitto" >>"$BROKER_DIR/mosquitto.conf"
        chown -R mosquitto: "$BROKER_DIR"
        chmod 600 "$BROKER_DIR/passwd"
      fi
      mosquitto -c "$BROKER_DIR/mosquitto.conf" >"$blog" 2>&1 &
      BROKER_PID=$!
      ;;
    weir)
      [ "$WEIR_STATUS" = built ] || return 1
      # Room for every bench connection above the default MQTT connection limit (10,000).
      printf '[mqtt]\nmax_connections = %d\n' $((CONNECTIONS + 1000)) >"$BROKER_DIR/weir.toml"
      "${WEIR_BIN:-$ROOT/target/release/weir}" --config "$BROKER_DIR/weir.toml" --data-dir "$BROKER_DIR" --fsync true \
        --amqp-listen "127.0.0.1:$(free_port)" --mqtt-listen "127.0.0.1:$PORT" --mqtt-ws-listen 127.0.0.1:0 --http-listen 127.0.0.1:0 >"$blog" 2>&1 &
      BROKER_PID=$!
      ;;
  esac
  await_mqtt "$PORT" "$blog"
}

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

# Wait, up to QUIET_WAIT seconds, for three idle seconds in a row (see bench-compare.sh).
wait_quiet() {
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

# weir-mqtt-bench arguments of a workload.
workload_args() {
  case "$1" in
    qos1) printf '%s\n' qos1 --publishers 2 --subscribers 1 --window 256 --size 256 ;;
    fanout0) printf '%s\n' fanout --subscribers "$CONNECTIONS" --qos 0 --window 4 --size 64 ;;
    fanout1) printf '%s\n' fanout --subscribers "$CONNECTIONS" --qos 1 --window 4 --size 64 ;;
    idle) printf '%s\n' idle --connections "$CONNECTIONS" --keep-alive 60 --hold 10 ;;
    idlesub) printf '%s\n' idle --connections "$CONNECTIONS" --keep-alive 60 --hold 10 --subscribe ;;
  esac
}

result_file() { echo "$OUT/$1-$2.json"; } # TARGET WORKLOAD

# run_one TARGET WORKLOAD: a fresh broker, the run, the broker stopped. Non-zero on failure.
run_one() {
  local target="$1" w="$2" json errf attempt wargs=() rc=0
  json="$(result_file "$target" "$w")"
  errf="${json%.json}.err"
  mapfile -t wargs < <(workload_args "$w")
  for attempt in $(seq $((RETRIES + 1))); do
    log "$target / $w$([ "$attempt" -gt 1 ] && echo ", attempt $attempt")"
    if ! start_broker "$target" "$w"; then
      echo "   FAILED: $target did not start" >&2; stop_broker; return 1
    fi
    wait_quiet
    # shellcheck disable=SC2086 # EXTRA is deliberately word-split into flags
    if "$BENCH" --addr "127.0.0.1:$PORT" --user guest --pass guest --duration "$DURATION" \
        --warmup "$WARMUP" --broker-pid "$BROKER_PID" --label "$target" --json "${wargs[@]}" $EXTRA \
        >"$json" 2>"$errf"; then
      rc=0
    else
      rc=1
      echo "   FAILED: $(tail -1 "$errf")" >&2
      rm -f "$json"
    fi
    stop_broker
    [ "$rc" = 0 ] || return 1
    case "$w" in
      qos1) jq -r '"   \(.publish_rate|floor) msg/s published, PUBACK p95 \(.puback_latency.p95_ms) ms, delivered \(.deliver_rate|floor) msg/s, other CPU \(.other_cpu_cores // "?") cores"' "$json" >&2 ;;
      fanout*) jq -r '"   \(.deliver_rate|floor) deliveries/s, \(.fanouts_complete) fan-outs complete, \(.fanouts_incomplete) incomplete, deliver p95 \(.e2e_latency.p95_ms) ms, other CPU \(.other_cpu_cores // "?") cores"' "$json" >&2 ;;
      idle*) jq -r '"   \(.alive_at_end) of \(.connections) alive, \(.rss_per_conn_bytes|floor) B of RSS per connection"' "$json" >&2 ;;
    esac
    # Disturbed by other work (idle has no CPU window): run again; the last attempt is kept.
    jq -e --argjson m "$QUIET_MAX" '(.other_cpu_cores // 0) <= $m' "$json" >/dev/null && return 0
    [ "$attempt" -le "$RETRIES" ] && echo "   disturbed by other work; running again" >&2
  done
  return 0
}

for w in "${WORKLOAD_LIST[@]}"; do
  for t in "${TARGETS[@]}"; do
    if ! run_one "$t" "$w"; then
      [ "$t" = weir ] && WEIR_STATUS="built, but a run failed (see $OUT/weir-$w.err)"
    fi
  done
done

# ---------------------------------------------------------------- report
{
  echo "# bench-mqtt $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo
  echo "machine: $(nproc) cores, $(free -g | awk '/Mem:/{print $2}') GiB, kernel $(uname -r); load before report: $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "Mosquitto: $MOSQ_STATUS; Weir: $WEIR_STATUS (fsync on); client: weir-mqtt-bench (MQTT 3.1.1), ${DURATION}s measured after ${WARMUP}s warm-up, fresh broker per workload"
  cat >"$OUT/cpu.jq" <<'JQ'
def r2: if type == "number" then (. * 100 | round / 100) else "?" end;
def cpu(us; cores): "\(us | r2) (\(cores | r2))";
def p(x): "\(x.p50_ms) / \(x.p95_ms) / \(x.p99_ms)";
def other: "\(.other_cpu_cores | r2)\(if (.other_cpu_cores // 0) > 0.2 then " ⚠" else "" end)";
JQ
  if [[ ",$WORKLOADS," == *,qos1,* ]]; then
    echo
    echo "## qos1: 2 publishers (QoS 1, window 256), 1 persistent-session QoS 1 subscriber, 256 B"
    echo
    echo "| target | published msg/s | delivered msg/s | PUBACK p50 / p95 / p99 ms | publish→deliver p50 / p95 / p99 ms | backlog at end | broker µs/msg (cores) | client µs/msg (cores) | other cores |"
    echo "|---|---:|---:|---|---|---:|---:|---:|---:|"
    for t in "${TARGETS[@]}"; do
      f="$(result_file "$t" qos1)"
      if [ -f "$f" ]; then
        jq -r --arg t "$t" "$(cat "$OUT/cpu.jq")"'
          "| \($t) | \(.publish_rate | floor) | \(.deliver_rate | floor) | \(p(.puback_latency)) | \(p(.e2e_latency)) | \(.backlog_at_end)"
          + " | \(cpu(.broker_cpu_us_per_msg; .broker_cpu_cores)) | \(cpu(.client_cpu_us_per_msg; .client_cpu_cores)) | \(other) |"' "$f"
      else
        echo "| $t | — | — | — | — | — | — | — | — |"
      fi
    done
  fi
  if [[ ",$WORKLOADS," == *,fanout* ]]; then
    echo
    echo "## fanout: 1 publisher (4 publishes in fan-out), $CONNECTIONS subscriber connections, 64 B"
    echo
    echo "| target | QoS | delivered msg/s | fan-outs complete / incomplete | publish→deliver p50 / p95 / p99 ms | publish→last subscriber p50 / p95 / p99 ms | broker µs/delivery (cores) | client µs/delivery (cores) | other cores | setup s |"
    echo "|---|---:|---:|---|---|---|---:|---:|---:|---:|"
    for w in fanout0 fanout1; do
      [[ ",$WORKLOADS," == *,$w,* ]] || continue
      for t in "${TARGETS[@]}"; do
        f="$(result_file "$t" "$w")"
        if [ -f "$f" ]; then
          jq -r --arg t "$t" "$(cat "$OUT/cpu.jq")"'
            "| \($t) | \(.qos) | \(.deliver_rate | floor) | \(.fanouts_complete) / \(.fanouts_incomplete) | \(p(.e2e_latency)) | \(p(.fanout_latency))"
            + " | \(cpu(.broker_cpu_us_per_msg; .broker_cpu_cores)) | \(cpu(.client_cpu_us_per_msg; .client_cpu_cores)) | \(other) | \(.setup_s | r2) |"' "$f"
        else
          echo "| $t | ${w#fanout} | — | — | — | — | — | — | — | — |"
        fi
      done
    done
  fi
  for w in idle idlesub; do
    [[ ",$WORKLOADS," == *,$w,* ]] || continue
    echo
    if [ "$w" = idle ]; then
      echo "## idle: $CONNECTIONS connections (keep-alive 60 s), broker RSS"
    else
      echo "## idlesub: $CONNECTIONS connections (keep-alive 60 s), each subscribed to a topic of its own (QoS 1), broker RSS"
    fi
    echo
    echo "| target | alive at end | RSS before MB | RSS with all connected MB | per connection B | RSS after closing MB | connect s |"
    echo "|---|---:|---:|---:|---:|---:|---:|"
    for t in "${TARGETS[@]}"; do
      f="$(result_file "$t" "$w")"
      if [ -f "$f" ]; then
        jq -r --arg t "$t" '
          def mb: . / 1e6 * 10 | round / 10;
          "| \($t) | \(.alive_at_end) / \(.connections) | \(.rss_before_bytes | mb) | \(.rss_after_bytes | mb) | \(.rss_per_conn_bytes | round) | \(.rss_after_close_bytes | mb) | \(.connect_s * 10 | round / 10) |"' "$f"
      else
        echo "| $t | — | — | — | — | — | — |"
      fi
    done
  done
  echo
  echo "Against issue 8's targets:"
  m="$(result_file mosquitto qos1)"; wq="$(result_file weir qos1)"
  if [ -f "$m" ] && [ -f "$wq" ]; then
    jq -r -s '.[0] as $m | .[1] as $w
      | ($w.publish_rate / $m.publish_rate) as $tp
      | ($w.puback_latency.p95_ms / ($m.puback_latency.p95_ms + 1e-9)) as $p
      | "- qos1: Weir / Mosquitto throughput \($tp * 100 | round / 100)x (target >= 1.5: \(if $tp >= 1.5 then "met" else "MISSED" end)), PUBACK p95 \($w.puback_latency.p95_ms) vs \($m.puback_latency.p95_ms) ms (target lower: \(if $p < 1 then "met" else "MISSED" end))"' "$m" "$wq"
  fi
  for w in fanout0 fanout1; do
    f="$(result_file weir "$w")"
    [ -f "$f" ] && jq -r --arg w "$w" '"- \($w): Weir fanned out \(.fanouts_complete) publishes to all \(.subscribers) subscribers (\(.fanouts_incomplete) incomplete), \(.deliver_rate | floor) deliveries/s"' "$f"
  done
  f="$(result_file weir idle)"
  [ -f "$f" ] && jq -r '"- idle: Weir \(.rss_per_conn_bytes | round) B per connection (target <= 4 KB = 4096 B: \(if .rss_per_conn_bytes <= 4096 then "met" else "MISSED" end)), \(.alive_at_end) of \(.connections) alive at the end"' "$f"
  true
} | tee "$OUT/results.md"
echo >&2
echo "results in $OUT" >&2
