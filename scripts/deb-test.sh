#!/usr/bin/env bash
# Builds the Debian package (`cargo deb`), installs it with dpkg on this
# machine, checks what it installed (user, directories, config, unit with
# `systemd-analyze verify`, man pages, completions), runs the packaged
# broker as its unit would (scripts/deb-smoke.py: Type=notify readiness,
# pika and paho-mqtt clients, SIGTERM), then `dpkg -r` and `dpkg -P`.
# Needs root (dpkg). CI runs it (.ci/run).
#
# Env: WEIR_DEB_PROFILE (cargo profile of the packaged binaries; default
# release; CI uses dev to reuse its test build).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
log() { echo "deb-test: $*" >&2; }
fail() { log "FAILED: $*"; exit 1; }

[[ $(id -u) == 0 ]] || fail "needs root (dpkg -i)"
if dpkg -s weir >/dev/null 2>&1; then fail "a weir package is already installed; not touching it"; fi

DEB=$(WEIR_DEB_OUT="${CARGO_TARGET_DIR:-target}/debian/weir-test.deb" bash scripts/deb-build.sh)
dpkg-deb --info "$DEB" | sed -n '/Package:/,$p' >&2

cleanup() { dpkg -P weir >/dev/null 2>&1 || true; }
trap cleanup EXIT

log "dpkg -i"
dpkg -i "$DEB"
/usr/bin/weir --version | grep -q "(commit " || fail "weir --version has no commit"
getent passwd weir >/dev/null || fail "no weir user"
[[ $(stat -c '%U:%G %a' /var/lib/weir) == "weir:weir 750" ]] || fail "/var/lib/weir: $(stat -c '%U:%G %a' /var/lib/weir)"
[[ $(stat -c '%U:%G %a' /etc/weir/weir.toml) == "root:weir 640" ]] || fail "/etc/weir/weir.toml: $(stat -c '%U:%G %a' /etc/weir/weir.toml)"
dpkg-query -W -f='${Conffiles}\n' weir | grep -q /etc/weir/weir.toml || fail "weir.toml is not a conffile"
setpriv --reuid=weir --regid=weir --init-groups /usr/bin/weir check-config /etc/weir/weir.toml
for f in /lib/systemd/system/weir.service /usr/share/man/man1/weir.1.gz /usr/share/man/man1/weirctl.1.gz \
    /usr/share/bash-completion/completions/weir /usr/share/bash-completion/completions/weirctl \
    /usr/share/zsh/vendor-completions/_weir /usr/share/fish/vendor_completions.d/weirctl.fish /usr/bin/weirctl; do
    [[ -s $f ]] || fail "missing $f"
done
log "systemd-analyze verify"
out=$(systemd-analyze verify /lib/systemd/system/weir.service 2>&1) || fail "systemd-analyze verify: $out"
# verify exits 0 on some warnings; any line naming the unit is a finding.
if grep -q "weir.service" <<<"$out"; then fail "systemd-analyze verify: $out"; fi

log "running the packaged broker"
PY=$(bash scripts/python-venv.sh)
"$PY" scripts/deb-smoke.py

log "dpkg -r"
dpkg -r weir
[[ ! -e /usr/bin/weir ]] || fail "/usr/bin/weir left after dpkg -r"
[[ -e /etc/weir/weir.toml ]] || fail "dpkg -r removed the configuration (a conffile stays until purge)"
dpkg -P weir
[[ ! -e /etc/weir/weir.toml && ! -e /var/lib/weir ]] || fail "dpkg -P left /etc/weir/weir.toml or /var/lib/weir"
trap - EXIT
log "ok"
