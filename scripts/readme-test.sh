#!/usr/bin/env bash
# Runs every shell command of README.md (scripts/readme-test.py) in a network
# namespace of its own, so that the README's default ports (5672, 1883,
# 8083, 15672) are free whatever else runs on the machine. Needs root or
# unprivileged user namespaces for `unshare`; without either it runs in the
# machine's own network and says so.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [[ ${WEIR_README_NETNS:-} != inside ]]; then
    if unshare --net --map-root-user true 2>/dev/null || unshare --net true 2>/dev/null; then
        flags=(--net)
        [[ $(id -u) == 0 ]] || flags+=(--map-root-user)
        exec unshare "${flags[@]}" env WEIR_README_NETNS=inside bash "$0" "$@"
    fi
    echo "readme-test: no network namespace (unshare refused): using this machine's ports" >&2
else
    ip link set lo up
fi
exec python3 "$ROOT/scripts/readme-test.py" "$@"
