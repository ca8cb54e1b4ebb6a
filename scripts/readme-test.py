"""Runs every shell command of README.md, in order, as a newcomer would.

Every ```sh block is run, in one bash session (so `export PATH=...` in one
block holds for the next), with `set -euo pipefail`: a command that fails
fails the test. A comment line right before a block changes that:

    <!-- readme-test: background: WHY -->   run it in the background (the
        broker); the next block starts once AMQP (5672) and HTTP (15672)
        accept connections, and it is stopped with SIGTERM at the end
    <!-- readme-test: skip: WHY -->         not run (needs another machine,
        a Docker engine, the network, or is the test suite itself); the
        reason is printed

Run through scripts/readme-test.sh, which gives it a network namespace of
its own (the README's ports are the defaults: 5672, 15672, ...).

Env: WEIR_README_PROFILE=dev replaces `--release`/`target/release` by the
debug build (CI: reuses the test build; printed when it applies).
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARK = re.compile(r"<!--\s*readme-test:\s*(background|skip)\s*:\s*(.*?)\s*-->")


def blocks(text: str):
    """(line, directive, reason, body) for each ```sh block."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].strip() == "```sh":
            start = i
            j = i + 1
            while lines[j].strip() != "```":
                j += 1
            body = "\n".join(lines[i + 1:j])
            directive, reason = "run", ""
            k = start - 1
            while k >= 0 and not lines[k].strip():
                k -= 1
            m = MARK.search(lines[k]) if k >= 0 else None
            if m:
                directive, reason = m.group(1), m.group(2)
            yield start + 1, directive, reason, body
            i = j
        i += 1


def main() -> int:
    text = (ROOT / "README.md").read_text()
    dev = os.environ.get("WEIR_README_PROFILE") == "dev"
    work = Path(tempfile.mkdtemp(prefix="weir-readme-"))
    script = [
        "set -euo pipefail",
        f"cd {shlex.quote(str(ROOT))}",
        "BG=()",
        "stop_bg() { for p in \"${BG[@]}\"; do kill -TERM \"$p\" 2>/dev/null || true; done;"
        " for p in \"${BG[@]}\"; do wait \"$p\" 2>/dev/null || true; done; }",
        "trap stop_bg EXIT",
        "wait_port() { local deadline=$((SECONDS + 600)); "
        "until (exec 3<>/dev/tcp/127.0.0.1/$1) 2>/dev/null; do "
        "if ((SECONDS > deadline)); then echo \"readme-test: nothing on port $1\" >&2; "
        f"tail -n 30 {shlex.quote(str(work))}/bg-*.log >&2; exit 1; fi; "
        "for p in \"${BG[@]}\"; do kill -0 \"$p\" 2>/dev/null || { echo \"readme-test: background command exited\" >&2; "
        f"tail -n 30 {shlex.quote(str(work))}/bg-*.log >&2; exit 1; }}; done; sleep 0.2; done; }}",
    ]
    ran = skipped = 0
    for line, directive, reason, body in blocks(text):
        if dev:
            new = body.replace("--release ", "").replace("target/release", "target/debug")
            if new != body:
                print(f"readme-test: README.md:{line}: run with the debug build (WEIR_README_PROFILE=dev)",
                      file=sys.stderr)
            body = new
        if directive == "skip":
            print(f"readme-test: README.md:{line}: skipped: {reason}", file=sys.stderr)
            skipped += 1
            continue
        ran += 1
        script.append(f"echo {shlex.quote(f'== README.md:{line}')} >&2")
        if directive == "background":
            log = work / f"bg-{line}.log"
            script.append(f"{{\n{body}\n}} > {shlex.quote(str(log))} 2>&1 &\nBG+=($!)")
            script.append("wait_port 5672; wait_port 15672")
        else:
            # Echo each command as it runs (set -x), quietly again after.
            script.append(f"set -x\n{body}\n{{ set +x; }} 2>/dev/null")
    print(f"readme-test: {ran} blocks to run, {skipped} skipped", file=sys.stderr)
    env = dict(os.environ)
    # The broker keeps its data in a scratch directory (the README's
    # ./weir-data would land in the checkout) and, on a build machine with
    # little free disk, must not block publishers.
    env.setdefault("WEIR_DATA_DIR", str(work / "weir-data"))
    env.setdefault("WEIR_DISK_FREE_LIMIT", "50MB")
    before = set(os.listdir(ROOT))
    try:
        r = subprocess.run(["bash", "-c", "\n".join(script)], env=env)
    finally:
        # Files the commands wrote into the checkout (defs.json, ...).
        for name in set(os.listdir(ROOT)) - before:
            print(f"readme-test: removing {name} (written by a README command)", file=sys.stderr)
            subprocess.run(["rm", "-rf", str(ROOT / name)])
    if r.returncode != 0:
        print(f"readme-test: FAILED (exit {r.returncode})", file=sys.stderr)
        return 1
    print(f"readme-test: ok ({ran} blocks run, {skipped} skipped)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
