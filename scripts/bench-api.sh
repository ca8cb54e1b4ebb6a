#!/usr/bin/env bash
# Management API at scale: declares N queues (default 100,000) in one
# definitions import, then times `GET /api/queues?page=1&page_size=100`
# (and a few variants) with curl. Figures go to docs/BENCHMARKS.md.
#
#   WEIR_BIN=target/release/weir scripts/bench-api.sh [N]
#
# Env: WEIR_BIN (default target/release/weir, else target/debug/weir),
# REPEAT (timed requests per variant, default 5).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
N=${1:-100000}
REPEAT=${REPEAT:-5}
BIN=${WEIR_BIN:-$ROOT/target/release/weir}
[[ -x $BIN ]] || BIN=$ROOT/target/debug/weir
[[ -x $BIN ]] || { echo "no weir binary (build it or set WEIR_BIN)" >&2; exit 1; }
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
DIR=$(mktemp -d)
HTTP=$(port)
"$BIN" --data-dir "$DIR/data" --amqp-listen 127.0.0.1:$(port) --mqtt-listen 127.0.0.1:$(port) \
    --mqtt-ws-listen 127.0.0.1:$(port) --http-listen 127.0.0.1:$HTTP --log warn >"$DIR/weir.log" 2>&1 &
PID=$!
trap 'kill $PID 2>/dev/null; wait $PID 2>/dev/null; rm -rf "$DIR"' EXIT
for _ in $(seq 100); do curl -s -o /dev/null "http://127.0.0.1:$HTTP/" && break; sleep 0.1; done
API="http://127.0.0.1:$HTTP/api"
python3 - "$N" >"$DIR/defs.json" <<'PY'
import json, sys
n = int(sys.argv[1])
print(json.dumps({"queues": [{"name": f"bench-{i:06d}", "vhost": "/", "durable": False,
                               "auto_delete": False, "arguments": {}} for i in range(n)]}))
PY
t0=$(date +%s.%N)
curl -sf -u guest:guest -H 'content-type: application/json' --data-binary @"$DIR/defs.json" "$API/definitions" >/dev/null
t1=$(date +%s.%N)
echo "binary: $BIN"
printf 'declared %d queues (one definitions import) in %.1f s\n' "$N" "$(echo "$t1 - $t0" | bc)"
time_get() {
    local path=$1 best=999 worst=0 t
    for _ in $(seq "$REPEAT"); do
        t=$(curl -sf -o /dev/null -w '%{time_total}' -u guest:guest "$API$path")
        best=$(echo "if ($t < $best) $t else $best" | bc)
        worst=$(echo "if ($t > $worst) $t else $worst" | bc)
    done
    printf '%-60s best %6.3f s  worst %6.3f s\n' "GET /api$path" "$best" "$worst"
}
time_get '/queues?page=1&page_size=100'
time_get "/queues?page=$(( (N + 99) / 100 ))&page_size=100"
time_get '/queues/%2F?page=1&page_size=100&sort=messages&sort_reverse=true'
time_get '/queues?page=1&page_size=100&name=bench-09&use_regex=false'
time_get '/overview'
echo "RSS of weir: $(awk '/VmRSS/ {print $2, $3}' /proc/$PID/status)"
