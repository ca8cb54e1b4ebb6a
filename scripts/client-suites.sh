#!/usr/bin/env bash
# Run the integration test suites of widely used AMQP client libraries, as
# their authors ship them, against Debian's RabbitMQ and against Weir, and
# compare (issue 11). Each suite's source comes from its package registry
# at a pinned version:
#
#   amqplib 2.2.0 (Node; npm tarball, test/)        node --test, URL=...
#   amqp 5.4.2   (py-amqp, Celery's client; PyPI sdist, t/integration)
#   kombu 5.7.0  (Celery's messaging layer; PyPI sdist,
#                 t/integration/test_py_amqp.py)
#
# Each suite is pointed at one broker at a time: RabbitMQ on 127.0.0.1:5672
# (scripts/start-rabbitmq.sh), then a fresh `weir` on free ports with an
# empty data dir. scripts/client-suites/compare.py prints passed/failed/
# skipped per suite and broker and the tests whose outcome differs, and
# fails the run when a test passes on RabbitMQ but not on Weir, unless its
# ALLOWED list says why.
#
#   scripts/client-suites.sh [suite...]     (default: amqplib py-amqp kombu)
#
# Env: WEIR_BIN (use this binary, skip cargo build), CLIENT_SUITES_DIR
# (downloads, sources, venv and reports; default target/client-suites),
# CLIENT_SUITES_TIMEOUT (seconds per suite run, default 600),
# CLIENT_SUITES_MARKDOWN (also write the table as Markdown to this file).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
log() { echo "client-suites: $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

AMQPLIB_VERSION=2.2.0   # the last amqplib tarball on npm that ships test/
CLAIRE_VERSION=0.4.1    # amqplib's one devDependency its tests load
PY_AMQP_VERSION=5.4.2
KOMBU_VERSION=5.7.0
SUITES=("$@")
[[ ${#SUITES[@]} -gt 0 ]] || SUITES=(amqplib py-amqp kombu)
TIMEOUT=${CLIENT_SUITES_TIMEOUT:-600}
DIR=${CLIENT_SUITES_DIR:-$ROOT/target/client-suites}
HERE=$ROOT/scripts/client-suites
mkdir -p "$DIR/dl" "$DIR/src"
DIR=$(cd "$DIR" && pwd)
RESULTS=$DIR/results
rm -rf "$RESULTS"
mkdir -p "$RESULTS"

bash scripts/install-deps.sh
bash scripts/start-rabbitmq.sh
command -v node >/dev/null && command -v npm >/dev/null || die "node and npm are needed for amqplib"

# ---- the suites' Python environment (separate from the repo's .venv: the
# suites pin their own pytest and client versions)
VENV=$DIR/venv
REQ=$HERE/requirements.txt
if [[ ! -x $VENV/bin/python ]]; then
    log "creating $VENV"
    python3 -m venv "$VENV" >&2 || die "venv creation failed (python3-venv: scripts/install-deps.sh)"
fi
want=$(sha256sum "$REQ" | cut -d' ' -f1)
if [[ "$(cat "$VENV/.requirements.sha256" 2>/dev/null || true)" != "$want" ]]; then
    log "installing $REQ into $VENV"
    "$VENV/bin/python" -m pip install --disable-pip-version-check -q -r "$REQ" >&2 || die "pip install failed"
    echo "$want" >"$VENV/.requirements.sha256"
fi
PY=$VENV/bin/python

# ---- the suites' sources, from the registries
# sdist NAME VERSION: unpack PyPI's source distribution (which carries the
# tests) under $DIR/src and print its directory.
sdist() {
    local name=$1 version=$2 file
    local dest=$DIR/src/$name-$version
    if [[ ! -d $dest ]]; then
        # --no-binary NAME: the sdist of this package only (its build
        # backend may come as a wheel).
        "$PY" -m pip download --disable-pip-version-check -q --no-deps \
            --no-binary "$name" -d "$DIR/dl" "$name==$version" >&2 \
            || die "pip download $name==$version failed"
        file=$(ls "$DIR"/dl/"${name//-/_}"-"$version".tar.gz "$DIR"/dl/"$name"-"$version".tar.gz 2>/dev/null | head -n1)
        [[ -n $file ]] || die "no sdist of $name $version in $DIR/dl"
        mkdir -p "$dest.tmp"
        tar -xzf "$file" -C "$dest.tmp" --strip-components=1
        mv "$dest.tmp" "$dest"
    fi
    echo "$dest"
}

# amqplib: the npm tarball, with its test-only dependency.
amqplib_src() {
    local dest=$DIR/src/amqplib-$AMQPLIB_VERSION
    if [[ ! -d $dest ]]; then
        (cd "$DIR/dl" && npm pack --silent "amqplib@$AMQPLIB_VERSION" >/dev/null) \
            || die "npm pack amqplib@$AMQPLIB_VERSION failed"
        mkdir -p "$dest.tmp"
        tar -xzf "$DIR/dl/amqplib-$AMQPLIB_VERSION.tgz" -C "$dest.tmp" --strip-components=1
        (cd "$dest.tmp" && npm install --silent --no-save --no-package-lock --ignore-scripts \
            --no-audit --no-fund "claire@$CLAIRE_VERSION" >&2) || die "npm install claire failed"
        mv "$dest.tmp" "$dest"
    fi
    echo "$dest"
}

declare -A SRC
for s in "${SUITES[@]}"; do
    case $s in
        amqplib) SRC[$s]=$(amqplib_src) ;;
        py-amqp) SRC[$s]=$(sdist amqp "$PY_AMQP_VERSION") ;;
        kombu) SRC[$s]=$(sdist kombu "$KOMBU_VERSION") ;;
        *) die "unknown suite '$s' (amqplib, py-amqp, kombu)" ;;
    esac
done

# ---- Weir
if [[ -z "${WEIR_BIN:-}" ]]; then
    log "building weir (cargo build -p weir-gateway)"
    cargo build -q -p weir-gateway || die "cargo build -p weir-gateway failed"
    WEIR_BIN=$ROOT/target/debug/weir
fi
[[ -x $WEIR_BIN ]] || die "weir binary not found at $WEIR_BIN"
export WEIR_DISK_FREE_LIMIT=${WEIR_DISK_FREE_LIMIT:-50MB}

free_port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

WEIR_PID=""
WEIR_DATA=""
stop_weir() {
    if [[ -n "$WEIR_PID" ]] && kill -0 "$WEIR_PID" 2>/dev/null; then
        kill "$WEIR_PID" 2>/dev/null || true
        for _ in $(seq 1 50); do kill -0 "$WEIR_PID" 2>/dev/null || break; sleep 0.1; done
        kill -9 "$WEIR_PID" 2>/dev/null || true
    fi
    WEIR_PID=""
    [[ -z "$WEIR_DATA" ]] || rm -rf "$WEIR_DATA"
    WEIR_DATA=""
}
trap stop_weir EXIT

# start_weir LOG: a fresh weir on a free AMQP port (printed in WEIR_PORT).
start_weir() {
    local wlog=$1
    WEIR_PORT=$(free_port)
    WEIR_DATA=$(mktemp -d -t weir-client-suites.XXXXXX)
    "$WEIR_BIN" --data-dir "$WEIR_DATA" --amqp-listen "127.0.0.1:$WEIR_PORT" \
        --mqtt-listen 127.0.0.1:0 --mqtt-ws-listen 127.0.0.1:0 >"$wlog" 2>&1 &
    WEIR_PID=$!
    local deadline=$((SECONDS + ${WEIR_START_TIMEOUT:-60}))
    until (exec 3<>"/dev/tcp/127.0.0.1/$WEIR_PORT") 2>/dev/null; do
        kill -0 "$WEIR_PID" 2>/dev/null || { tail -n 30 "$wlog" >&2; die "weir exited before accepting connections"; }
        (( SECONDS < deadline )) || { tail -n 30 "$wlog" >&2; die "weir did not accept on port $WEIR_PORT in time"; }
        sleep 0.1
    done
}

# run_suite SUITE BROKER PORT: one run of one suite against the broker on
# 127.0.0.1:PORT, its JUnit report in $RESULTS/SUITE-BROKER.xml and its
# output in $RESULTS/SUITE-BROKER.log. A failing run is not an error here:
# compare.py judges the reports.
run_suite() {
    local suite=$1 broker=$2 port=$3
    local xml=$RESULTS/$suite-$broker.xml out=$RESULTS/$suite-$broker.log
    local src=${SRC[$suite]} t0=$SECONDS rc=0
    # A port nothing listens on: the suites' TLS tests (5671) fail the
    # same way on both brokers instead of reaching a stray listener.
    local no_tls
    no_tls=$(free_port)
    log "$suite against $broker (127.0.0.1:$port)"
    case $suite in
        amqplib)
            # channel_api takes URL; connect and callback_api use the
            # default amqp://localhost, which amqplib-redirect.cjs sends to
            # the same broker. --test-timeout: upstream's 1 s per test is
            # tight for a debug build on a shared 2-core machine, and node
            # applies it to each test file as a whole too.
            (cd "$src" && CLIENT_SUITES_AMQP_PORT=$port URL="amqp://guest:guest@127.0.0.1:$port" \
                timeout "$TIMEOUT" node --require "$HERE/amqplib-redirect.cjs" --test \
                --test-timeout=120000 --test-reporter=spec --test-reporter-destination=stdout \
                --test-reporter=junit --test-reporter-destination="$xml" test/) >"$out" 2>&1 || rc=$?
            ;;
        py-amqp | kombu)
            local paths=t/integration
            [[ $suite == kombu ]] && paths=t/integration/test_py_amqp.py
            # -p no:rerunfailures: upstream re-runs a failing test up to 5
            # times (its CI brokers are containers); here a failure counts.
            (cd "$src" && RABBITMQ_HOST=127.0.0.1 RABBITMQ_5672_TCP=$port RABBITMQ_5671_TCP=$no_tls \
                timeout "$TIMEOUT" "$PY" -m pytest $paths -p no:cacheprovider -p no:rerunfailures \
                -o addopts= -q --junitxml="$xml") >"$out" 2>&1 || rc=$?
            ;;
    esac
    log "$suite against $broker: exit $rc in $((SECONDS - t0)) s (output: $out)"
}

specs=()
for s in "${SUITES[@]}"; do
    run_suite "$s" rabbitmq 5672
    start_weir "$RESULTS/$s-weir-broker.log"
    run_suite "$s" weir "$WEIR_PORT"
    kill -0 "$WEIR_PID" 2>/dev/null || log "WARNING: weir exited during $s (see $RESULTS/$s-weir-broker.log)"
    stop_weir
    specs+=("$s=${SRC[$s]}")
done

md=()
[[ -z "${CLIENT_SUITES_MARKDOWN:-}" ]] || md=(--markdown "$CLIENT_SUITES_MARKDOWN")
"$PY" "$HERE/compare.py" "$RESULTS" "${specs[@]}" "${md[@]}"
