#!/usr/bin/env python3
"""Run MQTT 3.1.1 / 5 conformance scenarios against a reference broker
(Debian's Mosquitto 2.0) and a candidate (Weir) and compare what the
clients (paho-mqtt, raw sockets) observed.

    python conformance/mqtt/run.py --reference 127.0.0.1:1884 --candidate 127.0.0.1:PORT [-k name]
    python conformance/mqtt/run.py --reference-only [-k name] [--show]

Prints PASS/FAIL per scenario (a diff on FAIL) and ends with
"N passed, M failed"; exits 1 on any failure.

--reference-only checks the scenarios themselves: each runs twice against
the reference and both transcripts must be equal and unbroken (so nothing
depends on timing or on names the server makes up); a scenario marked
``differs`` must give the reference transcript it records. Weir-only
scenarios are skipped there.
"""
from __future__ import annotations

import argparse
import difflib
import json
import os
import sys
import uuid

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from mqttconf import scenarios  # noqa: E402,F401  (registers scenarios)
from mqttconf.harness import DIFFERS, SCENARIOS, WEIR_ONLY, run_isolated  # noqa: E402


def pretty(t) -> list[str]:
    return json.dumps(t, indent=2, sort_keys=True).splitlines()


def is_broken(t) -> bool:
    """A transcript the scenario author never intends as a reference."""
    return isinstance(t, dict) and ("unexpected" in t or "harness_error" in t)


def hostport(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host or "127.0.0.1", int(port)


def show_diff(a, b, an: str, bn: str, ok: bool, show: bool) -> None:
    if not ok:
        diff = difflib.unified_diff(pretty(a), pretty(b), an, bn, lineterm="", n=3)
        print("\n".join("    " + line for line in diff))
    elif show:
        print("\n".join("    " + line for line in pretty(b)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reference", default=os.environ.get("MQTT_CONFORMANCE_REFERENCE", "127.0.0.1:1884"),
                    help="host:port of the reference broker (default 127.0.0.1:1884, scripts/start-mosquitto.sh)")
    ap.add_argument("--candidate", default=os.environ.get("WEIR_MQTT"), help="host:port of the candidate (Weir)")
    ap.add_argument("--user", default="guest")
    ap.add_argument("--password", default="guest")
    ap.add_argument("--candidate-user", default=None,
                    help="user name at the candidate (e.g. tenant:guest); default --user")
    ap.add_argument("-k", dest="pattern", action="append", default=[],
                    help="run scenarios whose name contains this substring (repeatable)")
    ap.add_argument("--timeout", type=float, default=60.0, help="per-scenario, per-broker limit in seconds")
    ap.add_argument("--show", action="store_true", help="print the transcripts of passing scenarios too")
    ap.add_argument("--reference-only", "--only-reference", dest="reference_only", action="store_true",
                    help="run against the reference alone, twice, and compare (checks the scenarios)")
    ap.add_argument("--list", action="store_true", help="list scenario names and exit")
    args = ap.parse_args(argv)

    names = sorted(n for n in SCENARIOS if not args.pattern or any(p in n for p in args.pattern))
    if args.list:
        for n in names:
            tag = " (differs)" if n in DIFFERS else " (Weir only)" if n in WEIR_ONLY else ""
            print(n + tag)
        return 0
    if not names:
        print(f"no scenario matches {args.pattern}", file=sys.stderr)
        return 2
    if not args.reference_only and not args.candidate:
        ap.error("--candidate (or WEIR_MQTT) is required, or use --reference-only")

    ref = (*hostport(args.reference), args.user, args.password)
    cand = (*hostport(args.candidate), args.candidate_user or args.user, args.password) if args.candidate else None
    run_id = uuid.uuid4().hex[:8]
    passed = failed = skipped = 0
    for name in names:
        note = ""
        if name in WEIR_ONLY:
            why, expect = WEIR_ONLY[name]["why"], WEIR_ONLY[name]["expect"]
            if args.reference_only:
                print(f"SKIP {name} (Weir only: {why})")
                skipped += 1
                continue
            got = run_isolated(name, cand, args.timeout, run_id=f"{run_id}c")
            ok = got == expect
            print(f"{'PASS' if ok else 'FAIL'} {name} (Weir only: {why})")
            show_diff(expect, got, "expected", "candidate", ok, args.show)
        elif name in DIFFERS:
            d = DIFFERS[name]
            r = run_isolated(name, ref, args.timeout, run_id=f"{run_id}r")
            ok = r == d["reference"]
            if not ok:
                print(f"FAIL {name} (reference departs: {d['why']})")
                print("    the reference no longer gives the transcript the scenario records for it:")
                show_diff(d["reference"], r, "recorded reference", "reference", ok, args.show)
            elif args.reference_only:
                print(f"PASS {name} (reference departs as recorded; candidate must give the specification's)")
                show_diff(d["reference"], r, "recorded reference", "reference", ok, args.show)
            else:
                c = run_isolated(name, cand, args.timeout, run_id=f"{run_id}c")
                ok = c == d["candidate"]
                print(f"{'PASS' if ok else 'FAIL'} {name} (reference departs: {d['why']})")
                show_diff(d["candidate"], c, "specification", "candidate", ok, args.show)
        else:
            r = run_isolated(name, ref, args.timeout, run_id=f"{run_id}r")
            if args.reference_only:
                other, other_name = run_isolated(name, ref, args.timeout, run_id=f"{run_id}s"), "reference (2nd run)"
                note = " (reference, twice)"
            else:
                other, other_name = run_isolated(name, cand, args.timeout, run_id=f"{run_id}c"), "candidate"
            # A scenario that breaks on the reference is a bug in the scenario,
            # not a conformance result, even if the candidate breaks the same way.
            ok = r == other and not is_broken(r)
            print(f"{'PASS' if ok else 'FAIL'} {name}{note}")
            if is_broken(r):
                print("    reference run broke (scenario bug or reference broker down)")
                if r == other:
                    print("\n".join("    " + line for line in pretty(r)))
            show_diff(r, other, "reference", other_name, ok, args.show)
        sys.stdout.flush()
        passed += ok
        failed += not ok
    print(f"{passed} passed, {failed} failed" + (f", {skipped} skipped" if skipped else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
