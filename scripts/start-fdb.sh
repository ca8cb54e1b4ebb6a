#!/usr/bin/env bash
# A local FoundationDB cluster on loopback, for tests, CI and benchmarks.
#
#   scripts/start-fdb.sh start DIR [N]   N fdbserver processes (default 3) in DIR,
#                                        DIR/fdb.cluster; waits until available
#   scripts/start-fdb.sh status DIR      fdbcli status
#   scripts/start-fdb.sh stop DIR        stops them (SIGTERM, then SIGKILL)
#
# FoundationDB is looked up on PATH and the system library path first
# (the official packages), else in $WEIR_FDB_DIR (bin/, lib/); `.ci/run`
# points it at ../shared/fdb. Environment:
#   WEIR_FDB_ENGINE   memory (default) or ssd
#   WEIR_FDB_PORT     first port (default 4500 + a hash of DIR, so that
#                     clusters in different directories do not collide)
# `start` prints the lines to source: WEIR_FDB_CLUSTER_FILE and
# LD_LIBRARY_PATH (they are also written to DIR/env).
set -euo pipefail

usage() { echo "usage: $0 start|stop|status DIR [N]" >&2; exit 2; }
[ $# -ge 2 ] || usage
cmd=$1
dir=$2
n=${3:-3}

find_fdb() {
  FDBSERVER=$(command -v fdbserver || true)
  FDBCLI=$(command -v fdbcli || true)
  # The official packages put fdbserver in /usr/sbin, often off PATH.
  [ -n "$FDBSERVER" ] || { [ -x /usr/sbin/fdbserver ] && FDBSERVER=/usr/sbin/fdbserver; } || true
  FDBLIB=""
  if [ -z "$FDBSERVER" ] || [ -z "$FDBCLI" ]; then
    local d=${WEIR_FDB_DIR:-}
    if [ -n "$d" ] && [ -x "$d/bin/fdbserver" ] && [ -x "$d/bin/fdbcli" ]; then
      FDBSERVER=$(cd "$d/bin" && pwd)/fdbserver
      FDBCLI=$(cd "$d/bin" && pwd)/fdbcli
      FDBLIB=$(cd "$d/lib" && pwd)
    else
      echo "start-fdb: no FoundationDB found (fdbserver/fdbcli on PATH, or WEIR_FDB_DIR with bin/ and lib/)" >&2
      exit 3
    fi
  fi
}

cli() { "$FDBCLI" -C "$dir/fdb.cluster" --timeout 10 --exec "$1"; }

case $cmd in
  start)
    find_fdb
    mkdir -p "$dir"
    dir=$(cd "$dir" && pwd)
    if [ -f "$dir/pids" ]; then
      echo "start-fdb: $dir/pids exists: stop it first" >&2
      exit 1
    fi
    engine=${WEIR_FDB_ENGINE:-memory}
    base=${WEIR_FDB_PORT:-$((4500 + $(printf '%s' "$dir" | cksum | cut -d' ' -f1) % 400 * 10))}
    redundancy=double
    [ "$n" -ge 2 ] || redundancy=single
    echo "weir$base:weir$base@127.0.0.1:$base" > "$dir/fdb.cluster"
    : > "$dir/pids"
    for ((i = 0; i < n; i++)); do
      mkdir -p "$dir/p$i"
      "$FDBSERVER" -C "$dir/fdb.cluster" -p "127.0.0.1:$((base + i))" -d "$dir/p$i" -L "$dir/p$i" \
        --locality-zoneid "z$i" --locality-machineid "m$i" > "$dir/p$i/out.log" 2>&1 &
      echo $! >> "$dir/pids"
    done
    cli "configure new $redundancy $engine" > "$dir/configure.log" 2>&1 || {
      cat "$dir/configure.log" >&2; exit 1; }
    if [ "$n" -ge 3 ]; then
      # Three coordinators: losing any one process keeps a majority.
      coords=""
      for ((i = 0; i < 3; i++)); do coords="$coords 127.0.0.1:$((base + i))"; done
      cli "coordinators$coords" >> "$dir/configure.log" 2>&1 || true
    fi
    # Available: a write commits (with double redundancy, once both copies can be made).
    ok=""
    for _ in $(seq 1 120); do
      if cli "writemode on; set weir-start-fdb-probe 1; clear weir-start-fdb-probe" > /dev/null 2>&1; then
        ok=1; break
      fi
      sleep 1
    done
    [ -n "$ok" ] || { echo "start-fdb: the cluster did not become available" >&2; cli status >&2 || true; exit 1; }
    {
      echo "export WEIR_FDB_CLUSTER_FILE=$dir/fdb.cluster"
      [ -z "$FDBLIB" ] || echo "export LD_LIBRARY_PATH=$FDBLIB\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
    } > "$dir/env"
    cat "$dir/env"
    ;;
  status)
    find_fdb
    cli status
    ;;
  stop)
    [ -f "$dir/pids" ] || { echo "start-fdb: nothing running in $dir" >&2; exit 0; }
    pids=$(cat "$dir/pids")
    # shellcheck disable=SC2086
    kill $pids 2>/dev/null || true
    for _ in $(seq 1 50); do
      alive=""
      for p in $pids; do kill -0 "$p" 2>/dev/null && alive=1; done
      [ -n "$alive" ] || break
      sleep 0.1
    done
    for p in $pids; do kill -9 "$p" 2>/dev/null || true; done
    rm -f "$dir/pids"
    ;;
  *) usage ;;
esac
