#!/usr/bin/env bash
# Builds and runs every fuzz target in fuzz/ for a short time each (issue 5:
# every decoder that reads client- or disk-controlled bytes is fuzzed).
#
#   FUZZ_SECONDS      seconds per target (default 20)
#   FUZZ_SANITIZER    cargo-fuzz sanitizer (default none: these targets are
#                     safe Rust, so the fuzzer is after panics, stack
#                     overflows and broken invariants; ASan only slows them)
#   FUZZ_TARGETS      space-separated subset (default: every [[bin]] in
#                     fuzz/Cargo.toml whose source file exists)
#
# The toolchain is stable: cargo-fuzz's -Z flags are allowed through
# RUSTC_BOOTSTRAP=1. A target listed in fuzz/Cargo.toml whose source file is
# missing is skipped (another branch may add it). Exits non-zero if any target
# crashes; the crashing input is left under fuzz/artifacts/<target>/ and must
# become a regression test.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

SECS=${FUZZ_SECONDS:-20}
SANITIZER=${FUZZ_SANITIZER:-none}
log() { echo "fuzz: $*" >&2; }
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

bash scripts/install-cargo-fuzz.sh
export RUSTC_BOOTSTRAP=1

if [[ -n "${FUZZ_TARGETS:-}" ]]; then
    read -r -a ALL <<<"$FUZZ_TARGETS"
else
    mapfile -t ALL < <(sed -n 's/^name = "\(.*\)"$/\1/p' fuzz/Cargo.toml | grep -v '^weir-fuzz$')
fi

# Larger inputs where a whole conversation is one input.
max_len() {
    case "$1" in
        amqp_connection | mqtt_connection) echo 16384 ;;
        store_*) echo 65536 ;;
        *) echo 4096 ;;
    esac
}

failed=()
summary=()
for t in "${ALL[@]}"; do
    src=$(awk -v n="$t" '$0 ~ "^name = \"" n "\"$" {f=1; next} f && /^path = / {gsub(/^path = "|"$/, ""); print; exit}' fuzz/Cargo.toml)
    if [[ -z "$src" || ! -f "fuzz/$src" ]]; then
        log "skip $t: fuzz/${src:-?} not present"
        continue
    fi
    log "build $t"
    cargo fuzz build -s "$SANITIZER" "$t"
    mkdir -p "fuzz/corpus/$t"
    # New inputs go to corpus/ (not committed); committed seeds are read too.
    dirs=("fuzz/corpus/$t")
    [[ -d "fuzz/seeds/$t" ]] && dirs+=("fuzz/seeds/$t")
    out=$TMP/$t.log
    log "run $t for ${SECS}s"
    if cargo fuzz run -s "$SANITIZER" "$t" "${dirs[@]}" -- \
        -max_total_time="$SECS" -max_len="$(max_len "$t")" -rss_limit_mb=2048 \
        -print_final_stats=1 >"$out" 2>&1; then
        status=ok
    else
        status=CRASH
        failed+=("$t")
        tail -n 60 "$out" >&2
    fi
    runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$out" | tail -1 || true)
    rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$out" | tail -1 || true)
    cov=$({ grep -o 'cov: [0-9]*' "$out" || true; } | tail -1 | tr -d 'cov: ')
    summary+=("$(printf '%-16s %-5s %3ss %10s execs %8s execs/s  cov %s' "$t" "$status" "$SECS" "${runs:-?}" "${rate:-?}" "${cov:-?}")")
done

log "summary:"
for line in "${summary[@]}"; do echo "fuzz: $line" >&2; done
if [[ ${#failed[@]} -gt 0 ]]; then
    log "FAILED: ${failed[*]} (inputs under fuzz/artifacts/)"
    exit 1
fi
