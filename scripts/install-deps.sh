#!/usr/bin/env bash
# Install the Debian packages that the Python conformance suite, the Python
# black-box tests, the MQTT tests and CI need. Idempotent: packages already present are not
# touched, and nothing is installed when everything is there.
#
# Services are never started as a side effect of installing: a package's
# postinst would start rabbitmq-server through invoke-rc.d, so while we install
# we put a policy-rc.d in place that forbids it (exit 101), and restore
# whatever was there before. scripts/start-rabbitmq.sh starts RabbitMQ
# explicitly when a caller wants it. The same holds for mosquitto, whose
# postinst would start a system broker on 1883 (Weir's default MQTT port):
# scripts/start-mosquitto.sh runs its own instance on 127.0.0.1:1884.
set -euo pipefail

PACKAGES=(
    rabbitmq-server   # the reference broker for conformance/
    amqp-tools        # amqp-publish / amqp-consume for quick manual checks
    mosquitto         # the MQTT reference broker for conformance/mqtt (2.0 on bookworm)
    nats-server       # NATS with JetStream for the shovel tests (tests/tests/shovel.rs)
    mosquitto-clients # mosquitto_pub / mosquitto_sub: CLI tests against weir (tests/tests/mqtt.rs)
    python3           # Debian's python: the venv is built on it if no other python3 is on PATH
    python3-venv
    procps            # pgrep/pkill/ps used by service scripts
    netcat-openbsd    # port probes in shell scripts
    ca-certificates
    chromium          # headless browser of tests/python/test_dashboard.py
    chromium-driver   # chromedriver, which Selenium drives it through
    libclang-dev      # bindgen of the foundationdb crate (weir-store-fdb, cargo feature fdb)
    prometheus        # tests/python/test_prometheus.py: scrapes weir; promtool tests deploy/prometheus/alerts.yml
    systemd           # systemd-analyze verify of the packaged unit (scripts/deb-test.sh)
    adduser           # the package's weir user (scripts/deb-test.sh)
    curl              # README commands (scripts/readme-test.sh)
    jq                # README commands (scripts/readme-test.sh)
    iproute2          # `ip link set lo up` in the README test's network namespace
)

log() { echo "install-deps: $*" >&2; }

missing=()
for pkg in "${PACKAGES[@]}"; do
    # dpkg-query prints "install ok installed" only for fully installed packages.
    status=$(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null || true)
    if [[ "$status" != "install ok installed" ]]; then
        missing+=("$pkg")
    fi
done

if [[ ${#missing[@]} -eq 0 ]]; then
    log "all packages present"
    exit 0
fi

if [[ $(id -u) -ne 0 ]]; then
    if command -v sudo >/dev/null 2>&1; then
        SUDO=(sudo)
    else
        log "ERROR: missing packages (${missing[*]}) and not root (no sudo)"
        exit 1
    fi
else
    SUDO=()
fi

log "installing: ${missing[*]}"

POLICY=/usr/sbin/policy-rc.d
backup=""
if [[ -e $POLICY ]]; then
    backup=$(mktemp)
    "${SUDO[@]}" cp -p "$POLICY" "$backup"
fi
restore_policy() {
    if [[ -n "$backup" ]]; then
        "${SUDO[@]}" cp -p "$backup" "$POLICY"
        rm -f "$backup"
    else
        "${SUDO[@]}" rm -f "$POLICY"
    fi
}
trap restore_policy EXIT
printf '#!/bin/sh\n# installed by scripts/install-deps.sh: do not start services on install\nexit 101\n' \
    | "${SUDO[@]}" tee "$POLICY" >/dev/null
"${SUDO[@]}" chmod 755 "$POLICY"

export DEBIAN_FRONTEND=noninteractive
# A clean machine's package lists are empty or stale ("Unable to locate
# package", or a 404 on a superseded version): refresh them before installing.
"${SUDO[@]}" apt-get update -q
"${SUDO[@]}" apt-get install -y --no-install-recommends "${missing[@]}"
log "done"
