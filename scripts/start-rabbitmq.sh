#!/usr/bin/env bash
# Start Debian's RabbitMQ (the conformance reference broker) on 127.0.0.1:5672
# unless it is already running, wait until it has fully booted, and make sure
# guest/guest can log in from localhost on vhost "/".
#
# There is no systemd on the dev/CI machines, so the node is started detached
# with the Debian wrapper (which drops to the rabbitmq user).
#
# Env: RABBITMQ_START_TIMEOUT (seconds, default 120).
set -euo pipefail

TIMEOUT=${RABBITMQ_START_TIMEOUT:-120}
HOST=127.0.0.1
PORT=5672

log() { echo "start-rabbitmq: $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

command -v rabbitmq-server >/dev/null || die "rabbitmq-server not installed; run scripts/install-deps.sh"
[[ $(id -u) -eq 0 ]] || die "must run as root (the Debian wrapper switches to the rabbitmq user)"

port_open() { (exec 3<>"/dev/tcp/$HOST/$PORT") 2>/dev/null; }

# rabbitmqctl talks to the node over Erlang distribution, so "ping" answers
# only when our node (not merely something on port 5672) is up.
node_running() { timeout 20 rabbitmqctl -q ping >/dev/null 2>&1; }

if node_running; then
    log "RabbitMQ node already running"
else
    if port_open; then
        die "port $HOST:$PORT is taken by something that is not the local RabbitMQ node"
    fi
    log "starting rabbitmq-server (detached) on $HOST:$PORT"
    # The wrapper runs `su rabbitmq` without a login shell, so these
    # variables reach the server: bind only to loopback.
    export RABBITMQ_NODE_IP_ADDRESS=$HOST RABBITMQ_NODE_PORT=$PORT
    # -detached returns at once; a bad start shows up in await_startup below.
    rabbitmq-server -detached || die "rabbitmq-server -detached failed; see /var/log/rabbitmq/"
fi

# await_startup waits until the boot sequence has finished (plugins, vhosts,
# listeners), which a bare port probe does not guarantee. The node may not be
# reachable for the first moments after -detached, so retry within the budget.
deadline=$((SECONDS + TIMEOUT))
until timeout "$TIMEOUT" rabbitmqctl -q await_startup --timeout "$TIMEOUT" >/dev/null 2>&1; do
    if (( SECONDS >= deadline )); then
        log "last lines of the RabbitMQ logs:"
        tail -n 30 /var/log/rabbitmq/*.log 2>/dev/null >&2 || true
        die "RabbitMQ did not finish booting within ${TIMEOUT}s"
    fi
    sleep 1
done

# Bounded wait for the AMQP listener itself (it is up once await_startup
# returns, but be explicit about what callers rely on).
for _ in $(seq 1 50); do port_open && break; sleep 0.2; done
port_open || die "RabbitMQ booted but nothing accepts on $HOST:$PORT (check RABBITMQ_NODE_PORT / config)"

# Make guest/guest usable on "/". Debian's package creates it on first boot,
# but a reused data dir may have lost or changed it. guest is restricted to
# loopback by RabbitMQ's default loopback_users, which is what we want.
if ! rabbitmqctl -q authenticate_user guest guest >/dev/null 2>&1; then
    log "guest/guest does not authenticate; (re)creating user guest"
    rabbitmqctl -q add_user guest guest >/dev/null 2>&1 || rabbitmqctl -q change_password guest guest >/dev/null
    rabbitmqctl -q set_user_tags guest administrator >/dev/null
fi
rabbitmqctl -q list_vhosts | grep -qx / || rabbitmqctl -q add_vhost / >/dev/null
rabbitmqctl -q set_permissions -p / guest '.*' '.*' '.*' >/dev/null

version=$(rabbitmqctl -q version 2>/dev/null || echo unknown)
log "RabbitMQ $version ready on amqp://guest:guest@$HOST:$PORT/"
