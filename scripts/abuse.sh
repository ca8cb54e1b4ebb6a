#!/usr/bin/env bash
# Replays the attacks of issue 5 against a real `weir`, each on a fresh broker (fresh data dir and
# port), and prints one line of figures per attack. See docs/reliability.md.
#
#   scripts/abuse.sh [attack...]          # default: every attack, in order (~4-5 minutes)
#   WEIR_BIN=/path/to/weir scripts/abuse.sh topic-backtrack disk-full
#
# Attacks: login-arrays login-tables topic-backtrack bind-burst corruption second-process disk-full
#          corruption-last-record
#          memory-64k memory-256b amplification stalled-consumer partial-content fanout login-rate trim
#          login-flood
#          mqtt-prelogin mqtt-will-props ws-ping-flood (issue 20: MQTT before login, WebSocket pongs)
#          mqtt-sub-dup mqtt-sub-wildcards retained-budget
#          http-publish-alarm http-publish-rate big-arguments import-kill (HTTP clients: abuse-publish.py)
#          noack-drain
#          http-slowloris http-idle-fds http-metrics-unread http-list-scrapers (issue 20, item 3)
#
# Environment:
#   WEIR_BIN         broker binary (default: build the release `weir` of this checkout)
#   ABUSE_BIN        the client (default: build the release `weir-abuse` of this checkout)
#   ABUSE_OUT        also append the figure lines to this file
#   ABUSE_KEEP=1     keep the work dir (broker logs, data dirs) and print its path
#   MEMORY_LIMIT     passed as --memory-limit when the broker has that flag (default 512MB)
#   DISK_FREE_LIMIT  passed as --disk-free-limit when the broker has that flag (default 128MB)
#   DISK_MB          size of the tmpfs for disk-full (default 400)
#   BIND_COUNT       binds in the bind-burst write (default 20000; the issue also tried 100000)
#   RETAINED         retained messages set up by mqtt-sub-dup and mqtt-sub-wildcards (default 100000)
#   WEIR_REPAIR      how to run the repair subcommand, the data dir appended
#                    (default "repair --data-dir"; used only if `weir repair --help` succeeds)
#
# Columns: rss_peak_mb = highest VmRSS sampled every 50 ms (and VmHWM); probe_wait_ms = longest round
# of a second client that keeps connecting + opening a channel + passive-declaring (capped at 30 s);
# lost = confirmed messages missing after a restart; broker = alive/dead after the attack.
# Needs root for the tmpfs of disk-full (otherwise that attack prints "skipped").
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
ALL=(login-arrays login-tables topic-backtrack bind-burst corruption second-process disk-full
     memory-64k memory-256b amplification stalled-consumer partial-content fanout login-rate trim
     login-flood
     mqtt-prelogin mqtt-will-props ws-ping-flood
     mqtt-sub-dup mqtt-sub-wildcards retained-budget
     corruption-last-record
     http-publish-alarm http-publish-rate big-arguments import-kill
     noack-drain
     http-slowloris http-idle-fds http-metrics-unread http-list-scrapers)

if [ -z "${WEIR_BIN:-}" ]; then
  (cd "$ROOT" && cargo build --release -q -p weir-gateway --bin weir) || exit 1
  WEIR_BIN=$ROOT/target/release/weir
fi
if [ -z "${ABUSE_BIN:-}" ]; then
  (cd "$ROOT" && cargo build --release -q -p weir-bench --bin weir-abuse) || exit 1
  ABUSE_BIN=$ROOT/target/release/weir-abuse
fi
[ -x "$WEIR_BIN" ] || { echo "abuse.sh: WEIR_BIN=$WEIR_BIN is not executable" >&2; exit 1; }
[ -x "$ABUSE_BIN" ] || { echo "abuse.sh: ABUSE_BIN=$ABUSE_BIN is not executable" >&2; exit 1; }

# New flags are passed only to a broker that has them, so the same script measures before and after.
HELP=$("$WEIR_BIN" --help 2>&1)
has() { grep -q -- "$1" <<<"$HELP"; }
FLAGS=()
has --memory-limit && FLAGS+=(--memory-limit "${MEMORY_LIMIT:-512MB}")
DISK_FLAGS=()
has --disk-free-limit && DISK_FLAGS+=(--disk-free-limit "${DISK_FREE_LIMIT:-128MB}")

WORK=$(mktemp -d /tmp/weir-abuse.XXXXXX) || exit 1
PIDS=()    # brokers and background clients, killed on exit
MOUNTS=()  # tmpfs mounts, unmounted on exit
mounted() { grep -qs " $1 " /proc/self/mounts; }
cleanup() {
  local p m keep=${ABUSE_KEEP:-0}
  for p in "${PIDS[@]}"; do kill -9 "$p" 2>/dev/null; wait "$p" 2>/dev/null; done
  for m in "${MOUNTS[@]}"; do
    mounted "$m" || continue
    umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null
    # Never rm -rf into a mount that is still there.
    mounted "$m" && { echo "abuse.sh: could not unmount $m" >&2; keep=1; }
  done
  if [ "$keep" = 1 ]; then echo "abuse.sh: work dir kept: $WORK" >&2; else rm -rf "$WORK"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

# start_broker DATA_DIR LOG [extra flags...]: sets PID and PORT; returns 1 if it exited or never
# became ready within 30 s (its log says why; one that never became ready is killed).
start_broker() {
  local dir=$1 log=$2 from; shift 2
  # Only this run's lines count: restarts append to the same log.
  from=$(( $(cat "$log" 2>/dev/null | wc -c) + 1 ))
  PORT=$(free_port)
  "$WEIR_BIN" --data-dir "$dir" --amqp-listen "127.0.0.1:$PORT" --mqtt-listen 127.0.0.1:0 --mqtt-ws-listen 127.0.0.1:0 --http-listen 127.0.0.1:0 "${FLAGS[@]}" "$@" >>"$log" 2>&1 &
  PID=$!
  PIDS+=("$PID")
  local i
  for i in $(seq 300); do
    tail -c +"$from" "$log" 2>/dev/null | grep -q "AMQP listener ready" && return 0
    kill -0 "$PID" 2>/dev/null || { wait "$PID" 2>/dev/null; return 1; }
    sleep 0.1
  done
  kill9 "$PID"
  return 1
}

kill9() { kill -9 "$1" 2>/dev/null; wait "$1" 2>/dev/null; }

# Graceful stop (SIGTERM, at most 15 s), then kill -9.
stop() {
  local i
  kill -TERM "$1" 2>/dev/null
  for i in $(seq 150); do kill -0 "$1" 2>/dev/null || break; sleep 0.1; done
  kill9 "$1"
}

url() { echo "amqp://guest:guest@127.0.0.1:$PORT/%2f"; }
abuse() { "$ABUSE_BIN" --url "$(url)" "$@" 2>>"$DIR/abuse.err"; }
# Value of key=value in a figures line.
val() { grep -o "\b$1=[^ ]*" <<<"$2" | head -1 | cut -d= -f2-; }
# A log line, quoted for a figures line (no double quotes, at most 160 chars, ANSI colours stripped).
quote() {
  sed -e 's/\x1b\[[0-9;]*m//g' -e 's/"/'"'"'/g' -e 's/^[0-9T:.-]*Z *//' -e "s|$WORK/[0-9]*/|…/|g" <<<"$1" |
    cut -c1-180
}
# Why the broker died, from its log (the last line that says so).
death() {
  local l
  l=$(grep -aE "overflowed|panicked|abort|memory allocation|error" "$1" | tail -1)
  [ -n "$l" ] && echo " died=\"$(quote "$l")\""
}
# Messages in QUEUE on the running broker: a number, 0 if the queue is gone (404), "?" otherwise.
count() {
  local out c
  out=$(abuse count --queue "$1")
  c=$(val count "$out")
  if [ -n "$c" ]; then echo "$c"; elif grep -q 404 <<<"$out"; then echo 0; else echo "?"; fi
}
# lost CONFIRMED RECOVERED: confirmed messages missing (never negative), "?" if unknown.
lost() {
  if [[ "$1" =~ ^[0-9]+$ && "$2" =~ ^[0-9]+$ ]]; then echo $(( $1 > $2 ? $1 - $2 : 0 )); else echo "?"; fi
}
emit() {
  local line
  line=$(printf '%-17s %s' "$1" "$2")
  echo "$line"
  [ -n "${ABUSE_OUT:-}" ] && echo "$line" >>"$ABUSE_OUT"
  return 0
}

# finish NAME OUT: the attack's figures line once its client is done; the broker is killed.
finish() {
  local out=$2
  sleep 0.5
  if ! kill -0 "$PID" 2>/dev/null; then
    out="${out/broker=alive/broker=dead}$(death "$DIR/weir.log")"
  fi
  kill9 "$PID"
  emit "$1" "$out"
}

# run_simple NAME TOOL-ARGS...: fresh broker, the tool with RSS sampling and the probe, kill.
run_simple() {
  local name=$1; shift
  if ! start_broker "$DIR/data" "$DIR/weir.log"; then
    emit "$name" "skipped: broker did not start: $(quote "$(tail -1 "$DIR/weir.log")")"; return
  fi
  local out
  out=$(abuse --pid "$PID" "$@")
  finish "$name" "$out"
}

# The address the running broker's LISTENER logged ("MQTT listener ready addr=…"), within 5 s.
listener() {
  local a i
  for i in $(seq 50); do
    a=$(sed -e 's/\x1b\[[0-9;]*m//g' "$DIR/weir.log" | grep -a "$1 listener ready" | tail -1 |
      grep -o 'addr=[0-9.:]*' | cut -d= -f2)
    [ -n "$a" ] && { echo "$a"; return; }
    sleep 0.1
  done
}

# run_mqtt NAME SUBCOMMAND [ARGS...]: run_simple for the MQTT attacks of issue 20; in ARGS, @MQTT
# and @WS stand for the broker's MQTT and MQTT-over-WebSocket listeners.
run_mqtt() {
  local name=$1 a args=() mqtt ws out; shift
  if ! start_broker "$DIR/data" "$DIR/weir.log"; then
    emit "$name" "skipped: broker did not start: $(quote "$(tail -1 "$DIR/weir.log")")"; return
  fi
  mqtt=$(listener MQTT) ws=$(listener "MQTT WebSocket")
  for a in "$@"; do a=${a/@MQTT/$mqtt}; args+=("${a/@WS/$ws}"); done
  out=$(abuse --pid "$PID" "${args[@]}")
  finish "$name" "$out"
}

attack_corruption() {
  local q=abuse.durable D=$DIR/data L=$DIR/weir.log out pub confirmed seg flip rec
  start_broker "$D" "$L" || { emit corruption "skipped: broker did not start"; return; }
  # ~48 × 1 KB confirmed: a ~53 KB head segment; byte 5,000 is in an early record.
  pub=$(abuse --probe false publish --queue "$q" --count 48 --size 1000)
  confirmed=$(val confirmed "$pub")
  kill9 "$PID"
  seg=$(ls "$D"/log/*.seg 2>/dev/null | sort | tail -1)
  [ -n "$seg" ] || { emit corruption "skipped: no segment file in $D/log"; return; }
  flip=$(abuse flip --file "$seg" --offset 5000)
  out="confirmed=$confirmed flip=$(basename "$seg")@5000"
  if start_broker "$D" "$L"; then
    rec=$(count "$q")
    out+=" restart=started recovered=$rec lost=$(lost "$confirmed" "$rec")"
    local warn
    warn=$(grep -aiE "torn|corrupt|truncat|checksum|crc" "$L" | tail -1)
    [ -n "$warn" ] && out+=" log=\"$(quote "$warn")\""
    kill9 "$PID"
  else
    out+=" restart=refused reason=\"$(quote "$(grep -aiE "error|corrupt" "$L" | tail -1)")\""
    if "$WEIR_BIN" repair --help >/dev/null 2>&1; then
      local rep
      # shellcheck disable=SC2086 # WEIR_REPAIR is a list of words
      rep=$("$WEIR_BIN" ${WEIR_REPAIR:-repair --data-dir} "$D" 2>&1 | tail -3 | tr '\n' ' ')
      out+=" repair=\"$(quote "$rep")\""
      if start_broker "$D" "$L"; then
        rec=$(count "$q")
        out+=" after_repair=started recovered=$rec lost=$(lost "$confirmed" "$rec")"
        kill9 "$PID"
      else
        out+=" after_repair=refused"
      fi
    else
      out+=" repair=unavailable lost=$confirmed(until repaired)"
    fi
  fi
  emit corruption "$out"
}

# Issue 20, item 8: the same 48 confirmed messages, but a clean stop (SIGTERM) and one bit flipped
# inside the LAST record of the head segment (100 bytes before its end, in the last body). Before, that
# record passed for an unconfirmed torn tail and was dropped with a WARN (and repair found nothing).
attack_corruption_last_record() {
  local name=corruption-last-record q=abuse.durable D=$DIR/data L=$DIR/weir.log out pub confirmed seg at rec
  start_broker "$D" "$L" || { emit $name "skipped: broker did not start"; return; }
  pub=$(abuse --probe false publish --queue "$q" --count 48 --size 1000)
  confirmed=$(val confirmed "$pub")
  stop "$PID"
  seg=$(ls "$D"/log/*.seg 2>/dev/null | sort | tail -1)
  [ -n "$seg" ] || { emit $name "skipped: no segment file in $D/log"; return; }
  at=$(( $(stat -c %s "$seg") - 100 ))
  abuse flip --file "$seg" --offset "$at" >/dev/null
  out="confirmed=$confirmed stop=sigterm flip=$(basename "$seg")@$at(last record)"
  if start_broker "$D" "$L"; then
    rec=$(count "$q")
    out+=" restart=started recovered=$rec lost=$(lost "$confirmed" "$rec")"
    local warn
    warn=$(grep -aiE "torn|corrupt|truncat|checksum|crc" "$L" | tail -1)
    [ -n "$warn" ] && out+=" log=\"$(quote "$warn")\""
    if "$WEIR_BIN" repair --help >/dev/null 2>&1; then
      stop "$PID"
      # shellcheck disable=SC2086 # WEIR_REPAIR is a list of words
      out+=" repair_after=\"$(quote "$("$WEIR_BIN" ${WEIR_REPAIR:-repair --data-dir} "$D" 2>&1 | tail -1)")\""
    else
      kill9 "$PID"
    fi
  else
    out+=" restart=refused reason=\"$(quote "$(grep -aiE "error|corrupt" "$L" | tail -1)")\""
    local rep
    # shellcheck disable=SC2086 # WEIR_REPAIR is a list of words
    rep=$("$WEIR_BIN" ${WEIR_REPAIR:-repair --data-dir} "$D" 2>&1 | tail -1)
    out+=" repair=\"$(quote "$rep")\""
    if start_broker "$D" "$L"; then
      rec=$(count "$q")
      out+=" after_repair=started recovered=$rec lost=$(lost "$confirmed" "$rec")"
      kill9 "$PID"
    else
      out+=" after_repair=refused"
    fi
  fi
  emit $name "$out"
}

# A second broker started on the data dir of a first one that is taking confirmed publishes; then
# the second is killed, the first stopped, and the first restarted: confirmed messages missing.
# (Before the data-dir lock, the second one's recovery truncates the first one's head segment at
# whatever it takes for a torn tail, while the first keeps writing past that point.)
attack_second_process() {
  local D=$DIR/data q=abuse.durable out first first_port second pa ca rec
  start_broker "$D" "$DIR/weir.log" || { emit second-process "skipped: broker did not start"; return; }
  first=$PID first_port=$PORT
  abuse --probe false publish --queue "$q" --count 10 --size 1000 >/dev/null
  abuse --probe false publish --queue "$q" --count 100000 --size 1000 --window 32 --limit 20 --stall 5 \
    >"$DIR/pa" &
  pa=$!
  PIDS+=("$pa")
  sleep 0.5
  if start_broker "$D" "$DIR/weir2.log"; then
    second=$PID
    out="second=started"
    local w
    w=$(grep -aiE "truncat|torn" "$DIR/weir2.log" | head -1)
    [ -n "$w" ] && out+=" second_log=\"$(quote "$w")\""
  else
    second=""
    out="second=refused reason=\"$(quote "$(grep -aiE "error|lock" "$DIR/weir2.log" | tail -1)")\""
    kill9 "$PID"
  fi
  PORT=$first_port
  wait "$pa"
  ca=$(( $(val confirmed "$(cat "$DIR/pa")") + 10 ))
  [ -n "$second" ] && kill9 "$second"
  stop "$first"
  out+=" confirmed=$ca"
  [ -n "$(val closed "$(cat "$DIR/pa")")" ] && out+=" first_closed=$(val closed "$(cat "$DIR/pa")")"
  if start_broker "$D" "$DIR/weir3.log"; then
    rec=$(count "$q")
    out+=" restart=started recovered=$rec lost=$(lost "$ca" "$rec")"
    kill9 "$PID"
  else
    out+=" restart=refused reason=\"$(quote "$(grep -aiE "error" "$DIR/weir3.log" | tail -1)")\""
    out+=" lost=$ca(unreadable)"
  fi
  emit second-process "$out"
}

attack_disk_full() {
  local mnt=$DIR/mnt q=abuse.disk out fill ops after
  mkdir -p "$mnt"
  MOUNTS+=("$mnt")  # before mounting: an interrupt right after the mount still unmounts it
  if ! mount -t tmpfs -o "size=${DISK_MB:-400}m" tmpfs "$mnt" 2>"$DIR/mount.err"; then
    emit disk-full "skipped: cannot mount a tmpfs: $(quote "$(cat "$DIR/mount.err")")"; return
  fi
  if ! start_broker "$mnt/data" "$DIR/weir.log" "${DISK_FLAGS[@]}"; then
    emit disk-full "skipped: broker did not start on a ${DISK_MB:-400} MB tmpfs: $(quote "$(tail -1 "$DIR/weir.log")")"
    umount "$mnt" 2>/dev/null; return
  fi
  # Fill with confirmed 64 KB persistent messages until blocked, refused or stalled.
  fill=$(abuse --pid "$PID" publish --queue "$q" --count 100000 --size 65536 --window 64 --limit 40 --stall 5)
  # Then whatever space is left, with a file, as another process on the same disk would.
  dd if=/dev/zero of="$mnt/filler" bs=1M status=none 2>/dev/null
  ops=$(abuse --probe false disk-ops --queue "$q")
  rm -f "$mnt/filler"
  sleep 2
  after=$(abuse --probe false publish --queue "$q" --count 20 --size 1000 --limit 10 --stall 5)
  out="$fill | full: $ops | space freed: publish"
  if [ -n "$(val confirmed "$after")" ]; then
    out+=" confirmed=$(val confirmed "$after")/20"
  else
    out+=" error=$(val error "$after")"
  fi
  [ -n "$(val closed "$after")" ] && out+=" closed=$(val closed "$after")"
  [ -n "$(val blocked "$after")" ] && out+=" blocked=$(val blocked "$after")"
  kill -0 "$PID" 2>/dev/null || out+=" broker=dead$(death "$DIR/weir.log")"
  kill9 "$PID"
  umount "$mnt" 2>/dev/null
  emit disk-full "$out"
}

# Issue 20 item 5: 400 concurrent wrong-password HTTP logins from 127.0.0.1; how long a new user's
# first login from 127.0.0.2 takes during the flood and 5 s after it (scripts/abuse-login-flood.py).
attack_login_flood() {
  if ! start_broker "$DIR/data" "$DIR/weir.log"; then
    emit login-flood "skipped: broker did not start: $(quote "$(tail -1 "$DIR/weir.log")")"; return
  fi
  local http out
  http=$(listener HTTP); http=${http##*:}
  if [ -z "$http" ]; then
    emit login-flood "skipped: no HTTP listener address in the log"; kill9 "$PID"; return
  fi
  out=$(python3 "$ROOT/scripts/abuse-login-flood.py" "$http" 400 30 2>>"$DIR/abuse.err")
  kill -0 "$PID" 2>/dev/null && out+=" broker=alive" || out+=" broker=dead$(death "$DIR/weir.log")"
  kill9 "$PID"
  emit login-flood "$out"
}

# Issue 20 #6/#7: retained messages and subscriptions (MQTT). The broker's MQTT port is chosen at
# start, so the client is told it from the log; retained-budget needs tenants a and b (a file).
attack_retained() {
  local name=$1; shift
  local extra=()
  if [ "$name" = retained-budget ]; then
    cat >"$DIR/weir.toml" <<'TOML'
[[tenants]]
name = "a"
[[tenants]]
name = "b"
[[auth.users]]
name = "u"
password = "guest"
permissions = [
  { vhost = "a", configure = ".*", write = ".*", read = ".*" },
  { vhost = "b", configure = ".*", write = ".*", read = ".*" },
]
TOML
    extra=(--config "$DIR/weir.toml")
  fi
  if ! start_broker "$DIR/data" "$DIR/weir.log" "${extra[@]}"; then
    emit "$name" "skipped: broker did not start: $(quote "$(tail -1 "$DIR/weir.log")")"; return
  fi
  local out
  out=$(abuse --pid "$PID" "$@" --mqtt "$(listener MQTT)")
  finish "$name" "$out"
}

# run_http NAME [--nofile N] TOOL-ARGS...: run_simple with @HTTP@ and @MQTT@ in the arguments
# replaced by the broker's HTTP and MQTT addresses; --nofile lowers the broker's `ulimit -n` first
# (prlimit), so an attack on file descriptors needs fewer than the client's own limit.
run_http() {
  local name=$1 nofile="" http mqtt out; shift
  if [ "$1" = --nofile ]; then nofile=$2; shift 2; fi
  if ! start_broker "$DIR/data" "$DIR/weir.log"; then
    emit "$name" "skipped: broker did not start: $(quote "$(tail -1 "$DIR/weir.log")")"; return
  fi
  [ -n "$nofile" ] && prlimit --pid "$PID" --nofile="$nofile:$nofile"
  http=$(listener HTTP) mqtt=$(listener MQTT)
  local args=("${@//@HTTP@/$http}")
  args=("${args[@]//@MQTT@/$mqtt}")
  out=$(abuse --pid "$PID" --timeout 600 "${args[@]}")
  [ -n "$nofile" ] && out="broker_nofile=$nofile $out"
  finish "$name" "$out"
}

PUBLISH_PY=$ROOT/scripts/abuse-publish.py
# A config file for the default tenant's quotas (the default guest keeps its permissions).
tenant_config() { printf '[[tenants]]\nname = "/"\n%s\n' "$2" >"$1"; }

attack_http_publish_alarm() {
  start_broker "$DIR/data" "$DIR/weir.log" --disk-free-limit 1PB ||
    { emit http-publish-alarm "skipped: broker did not start"; return; }
  local out
  out=$(python3 "$PUBLISH_PY" publish-alarm --http "$(listener HTTP)" --secs 20)
  kill -0 "$PID" 2>/dev/null || out+=" broker=dead$(death "$DIR/weir.log")"
  kill9 "$PID"
  emit http-publish-alarm "disk alarm, 4 HTTP publishers of 512 KB: $out"
}

attack_http_publish_rate() {
  local out rate queued
  tenant_config "$DIR/rate.toml" "publish-rate = 10"
  start_broker "$DIR/data" "$DIR/weir.log" --config "$DIR/rate.toml" ||
    { emit http-publish-rate "skipped: broker did not start"; return; }
  rate=$(python3 "$PUBLISH_PY" publish-rate --http "$(listener HTTP)" --secs 5)
  kill9 "$PID"
  tenant_config "$DIR/queued.toml" "max-queued-messages = 100"
  start_broker "$DIR/data2" "$DIR/weir.log" --config "$DIR/queued.toml" ||
    { emit http-publish-rate "skipped: broker did not start"; return; }
  queued=$(python3 "$PUBLISH_PY" publish-queued --http "$(listener HTTP)")
  kill9 "$PID"
  emit http-publish-rate "publish-rate=10: $rate | max-queued-messages=100: $queued"
}

attack_big_arguments() {
  local out
  start_broker "$DIR/data" "$DIR/weir.log" ||
    { emit big-arguments "skipped: broker did not start"; return; }
  out=$(python3 "$PUBLISH_PY" big-arguments --http "$(listener HTTP)" --pid "$PID")
  kill -0 "$PID" 2>/dev/null || out+=" broker=dead$(death "$DIR/weir.log")"
  stop "$PID"
  emit big-arguments "$out data_mb=$(du -sm "$DIR/data" | cut -f1)"
}

attack_import_kill() {
  local n=${IMPORT_QUEUES:-10000} timed after
  start_broker "$DIR/data" "$DIR/weir.log" ||
    { emit import-kill "skipped: broker did not start"; return; }
  timed=$(python3 "$PUBLISH_PY" import --http "$(listener HTTP)" --queues "$n")
  kill9 "$PID"
  # Again on a fresh broker, killed -9 once the first imported queue shows.
  start_broker "$DIR/data2" "$DIR/weir.log" ||
    { emit import-kill "skipped: broker did not start"; return; }
  python3 "$PUBLISH_PY" import --http "$(listener HTTP)" --queues "$n" --no-wait >/dev/null
  kill9 "$PID"
  start_broker "$DIR/data2" "$DIR/weir.log" ||
    { emit import-kill "skipped: broker did not restart"; return; }
  after=$(python3 "$PUBLISH_PY" count-imported --http "$(listener HTTP)")
  kill9 "$PID"
  emit import-kill "$timed | kill -9 once queues show, restart: $after (of $n each; all or none)"
}

run_attack() {
  case $1 in
    login-arrays)     run_simple "$1" login-nesting --kind arrays --depth 2100 ;;
    login-tables)     run_simple "$1" login-nesting --kind tables --depth 1400 ;;
    topic-backtrack)  run_simple "$1" topic-backtrack --words 30,32 --limit 20 ;;
    bind-burst)       run_simple "$1" bind-burst --count "${BIND_COUNT:-20000}" --limit 45 ;;
    corruption)       attack_corruption ;;
    corruption-last-record) attack_corruption_last_record ;;
    second-process)   attack_second_process ;;
    disk-full)        attack_disk_full ;;
    memory-64k)       run_simple "$1" publish --queue abuse.mem --durable false --persistent false \
                        --count 32768 --size 65536 --window 64 --limit 60 --stall 10 ;;
    memory-256b)      run_simple "$1" publish --queue abuse.mem --durable false --persistent false \
                        --count 2100000 --size 256 --window 2000 --limit 60 --stall 10 ;;
    amplification)    run_simple "$1" amplify --count 10000 --big 122880 ;;
    stalled-consumer) run_simple "$1" stalled-consumer --count 1000000 --size 1000 --hold 15 ;;
    partial-content)  run_simple "$1" partial --conns 20 --body-mb 60 --send-mb 59 --hold 45 ;;
    fanout)           run_simple "$1" fanout --queues 1000,4000,8000 --publishes 200 ;;
    login-rate)       run_simple "$1" login-rate --secs 5 ;;
    trim)             run_simple "$1" trim --count 2100000 --size 256 ;;
    login-flood)      attack_login_flood ;;
    mqtt-prelogin)    run_mqtt "$1" mqtt-prelogin --mqtt @MQTT --ws @WS --clients 80 --secs 40 ;;
    mqtt-will-props)  run_mqtt "$1" mqtt-will-props --mqtt @MQTT --props 3300000 ;;
    ws-ping-flood)    run_mqtt "$1" ws-ping-flood --mqtt @MQTT --ws @WS --pings 16000000 --secs 60 ;;
    mqtt-sub-dup)     attack_retained "$1" mqtt-sub-dup --retained "${RETAINED:-100000}" --copies 60 --limit 90 ;;
    mqtt-sub-wildcards) attack_retained "$1" mqtt-sub-wildcards --retained "${RETAINED:-100000}" \
                        --filters 1000 --subscribers 2 --limit 120 ;;
    retained-budget)  attack_retained "$1" retained-budget --size 600000 --max 200 ;;
    http-publish-alarm) attack_http_publish_alarm ;;
    http-publish-rate)  attack_http_publish_rate ;;
    big-arguments)      attack_big_arguments ;;
    import-kill)        attack_import_kill ;;
    # Issue 20/1: 200,000 persistent 300 B messages, one no-ack consumer reading at most 2 MB/s
    # (pika's pace) for 60 s: received, longest pause between deliveries, ready left.
    noack-drain)      run_simple "$1" noack-drain --count 200000 --size 300 --secs 60 --read-mbps 2 ;;
    http-slowloris)   run_http "$1" http-slowloris --http @HTTP@ --conns 2000 --secs 30 ;;
    http-idle-fds)    run_http "$1" --nofile 4096 http-idle-fds --http @HTTP@ --mqtt @MQTT@ \
                        --conns 6000 --secs 5 ;;
    http-metrics-unread) run_http "$1" http-metrics-unread --http @HTTP@ --queues 12000 --conns 150 \
                        --secs 30 ;;
    http-list-scrapers) run_http "$1" http-list-scrapers --http @HTTP@ --queues 12000 \
                        --scrapers 0,4,32 --secs 15 ;;
    *) echo "abuse.sh: unknown attack '$1' (known: ${ALL[*]})" >&2; return 1 ;;
  esac
}

[ $# -gt 0 ] || set -- "${ALL[@]}"
echo "# weir-abuse: $WEIR_BIN ${FLAGS[*]} ${DISK_FLAGS[*]} ($(date -u +%FT%TZ), $(nproc) CPUs)"
i=0
for a in "$@"; do
  # Numbered, not named: a path containing "corruption" would match the log greps.
  i=$((i + 1)); DIR=$WORK/$i
  mkdir -p "$DIR"
  run_attack "$a"
done
