#!/usr/bin/env bash
# Start Debian's Mosquitto 2.0 (the MQTT reference broker of conformance/mqtt
# and of the external-broker mode of tests/tests/mqtt.rs) on 127.0.0.1:1884
# unless our instance already runs there, and wait until it accepts MQTT
# connections. Idempotent, like start-rabbitmq.sh.
#
# The instance has its own configuration (conformance/mqtt/mosquitto.conf
# plus the paths below), password file (guest/guest; anonymous clients are
# allowed too) and persistent data in $MOSQUITTO_DIR. A system mosquitto
# service (the package's, on 1883 where Weir's MQTT listener defaults) is
# stopped and disabled if the package started it; install-deps.sh keeps it
# from starting in the first place.
#
#   scripts/start-mosquitto.sh          # start (or keep) the instance
#   scripts/start-mosquitto.sh --stop   # stop our instance (data kept)
#   scripts/start-mosquitto.sh --reset  # stop, wipe the data dir, start fresh
#
# Env: MOSQUITTO_DIR (default /tmp/weir-mosquitto), MOSQUITTO_START_TIMEOUT
# (seconds, default 20).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DIR=${MOSQUITTO_DIR:-/tmp/weir-mosquitto}
TIMEOUT=${MOSQUITTO_START_TIMEOUT:-20}
HOST=127.0.0.1
PORT=1884
BASE_CONF=$ROOT/conformance/mqtt/mosquitto.conf
CONF=$DIR/mosquitto.conf
PIDFILE=$DIR/mosquitto.pid
LOG=$DIR/mosquitto.log

log() { echo "start-mosquitto: $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

command -v mosquitto >/dev/null || die "mosquitto not installed; run scripts/install-deps.sh"
command -v mosquitto_passwd >/dev/null || die "mosquitto_passwd not found (package mosquitto); run scripts/install-deps.sh"
[[ -f $BASE_CONF ]] || die "missing $BASE_CONF"

port_open() { (exec 3<>"/dev/tcp/$HOST/$PORT") 2>/dev/null; }

# The pid of our instance if it runs: the pid file's process must be a
# mosquitto started with our configuration file.
our_pid() {
    local pid
    pid=$(cat "$PIDFILE" 2>/dev/null || true)
    [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null || return 1
    tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -q -- "mosquitto -c $CONF" || return 1
    echo "$pid"
}

stop_ours() {
    local pid
    pid=$(our_pid) || return 0
    log "stopping our mosquitto (pid $pid)"
    kill "$pid" 2>/dev/null || true
    # SIGTERM saves the persistence file; bounded wait, then force.
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
}

# The package's service (pid file of Debian's configuration): stop it and
# keep it from starting at boot. Only that pid, never a broad pkill.
stop_system_service() {
    local pid
    pid=$(cat /run/mosquitto/mosquitto.pid 2>/dev/null || true)
    if [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null; then
        log "stopping the system mosquitto service (pid $pid)"
        if command -v service >/dev/null 2>&1; then
            service mosquitto stop >/dev/null 2>&1 || true
        fi
        kill -0 "$pid" 2>/dev/null && kill "$pid" 2>/dev/null || true
    fi
    if [[ $(id -u) -eq 0 ]]; then
        if command -v systemctl >/dev/null 2>&1 && [[ -d /run/systemd/system ]]; then
            systemctl disable --now mosquitto >/dev/null 2>&1 || true
        fi
        if [[ -x /etc/init.d/mosquitto ]] && command -v update-rc.d >/dev/null 2>&1; then
            update-rc.d mosquitto disable >/dev/null 2>&1 || true
        fi
    fi
}

case "${1:-}" in
    --stop) stop_ours; exit 0 ;;
    --reset) stop_ours; rm -rf "$DIR" ;;
    "") ;;
    *) die "unknown argument $1 (use --stop or --reset)" ;;
esac

stop_system_service

mkdir -p "$DIR/data"
# The configuration this instance runs with: the shared base plus its paths.
want=$(
    cat "$BASE_CONF"
    echo
    echo "# --- added by scripts/start-mosquitto.sh ---"
    echo "password_file $DIR/passwd"
    echo "persistence_location $DIR/data/"
    echo "pid_file $PIDFILE"
    echo "log_dest file $LOG"
    echo "log_type error"
    echo "log_type warning"
    echo "log_type notice"
    echo "log_type information"
    # As root Mosquitto drops to this user; it must own its files.
    if [[ $(id -u) -eq 0 ]]; then echo "user mosquitto"; fi
)

if pid=$(our_pid); then
    if [[ "$(cat "$CONF" 2>/dev/null)" == "$want" ]] && port_open; then
        log "Mosquitto already running (pid $pid) on $HOST:$PORT"
        exit 0
    fi
    log "configuration changed: restarting"
    stop_ours
fi

if port_open; then
    die "port $HOST:$PORT is taken by something that is not our mosquitto ($CONF)"
fi

printf '%s\n' "$want" >"$CONF"
if [[ ! -s $DIR/passwd ]]; then
    : >"$DIR/passwd"
    mosquitto_passwd -b "$DIR/passwd" guest guest
fi
chmod 600 "$DIR/passwd"
if [[ $(id -u) -eq 0 ]]; then
    id mosquitto >/dev/null 2>&1 || die "user mosquitto missing (the Debian package creates it)"
    chown -R mosquitto: "$DIR"
fi

log "starting mosquitto on $HOST:$PORT (config $CONF, log $LOG)"
rm -f "$PIDFILE"
mosquitto -c "$CONF" -d || die "mosquitto -c $CONF -d failed; see $LOG"

# Ready when a CONNECT gets its CONNACK (a bare port probe only shows the
# socket). mosquitto_pub -q 0 to an unused topic is exactly that.
deadline=$((SECONDS + TIMEOUT))
until mosquitto_pub -h "$HOST" -p "$PORT" -u guest -P guest -t 'weir/start-mosquitto/probe' -m '' -q 0 >/dev/null 2>&1; do
    if (( SECONDS >= deadline )); then
        tail -n 30 "$LOG" >&2 || true
        die "mosquitto did not accept MQTT connections within ${TIMEOUT}s"
    fi
    sleep 0.2
done
version=$(mosquitto -h 2>/dev/null | head -n1 | sed 's/^mosquitto version //' || true)
log "Mosquitto ${version:-?} ready on mqtt://guest:guest@$HOST:$PORT (pid $(cat "$PIDFILE" 2>/dev/null))"
