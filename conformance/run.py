#!/usr/bin/env python3
"""Run AMQP 0-9-1 conformance scenarios against a reference broker and a
candidate broker and compare what pika observed.

    python conformance/run.py --reference amqp://guest:guest@127.0.0.1:5672/ \
                              --candidate amqp://guest:guest@127.0.0.1:5673/ [-k name]

Prints PASS/FAIL per scenario (with a diff of the transcripts on FAIL) and ends
with "N passed, M failed"; exits 1 on any failure. --show prints transcripts;
--only-reference runs against the reference alone (to check scenarios).
Scenarios of features RabbitMQ 3.10 lacks (harness.weir_only) run against
the candidate alone and are compared with the transcript they expect.
"""
from __future__ import annotations

import argparse
import difflib
import json
import os
import sys
import uuid

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from weirconf import scenarios  # noqa: E402,F401  (registers scenarios)
from weirconf.harness import SCENARIOS, WEIR_ONLY, run_isolated  # noqa: E402


def pretty(t) -> list[str]:
    return json.dumps(t, indent=2, sort_keys=True).splitlines()


def is_broken(t) -> bool:
    """A transcript the scenario author never intends as a reference."""
    return isinstance(t, dict) and ("unexpected" in t or "harness_error" in t)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reference", default=os.environ.get("CONFORMANCE_REFERENCE", "amqp://guest:guest@127.0.0.1:5672/"))
    ap.add_argument("--candidate", default=os.environ.get("CONFORMANCE_CANDIDATE"))
    ap.add_argument("-k", dest="pattern", action="append", default=[],
                    help="run scenarios whose name contains this substring (repeatable)")
    ap.add_argument("--timeout", type=float, default=60.0, help="per-scenario, per-broker limit in seconds")
    ap.add_argument("--show", action="store_true", help="print both transcripts for every scenario")
    ap.add_argument("--only-reference", action="store_true", help="run against the reference only")
    ap.add_argument("--list", action="store_true", help="list scenario names and exit")
    args = ap.parse_args(argv)

    names = sorted(n for n in SCENARIOS if not args.pattern or any(p in n for p in args.pattern))
    if args.list:
        print("\n".join(names))
        return 0
    if not names:
        print(f"no scenario matches {args.pattern}", file=sys.stderr)
        return 2
    if not args.only_reference and not args.candidate:
        ap.error("--candidate is required (or use --only-reference)")

    run_id = uuid.uuid4().hex[:8]
    passed = failed = 0
    skipped = 0
    for name in names:
        if name in WEIR_ONLY:
            # RabbitMQ 3.10 lacks the feature: Weir's transcript is checked
            # against the scenario's expectation instead.
            why, expect = WEIR_ONLY[name]["why"], WEIR_ONLY[name]["expect"]
            if args.only_reference:
                print(f"SKIP {name} (Weir only: {why})")
                skipped += 1
                continue
            cand = run_isolated(name, args.candidate, args.timeout, run_id=f"{run_id}c")
            ok = cand == expect
            print(f"{'PASS' if ok else 'FAIL'} {name} (Weir only: {why})")
            if not ok or args.show:
                diff = difflib.unified_diff(pretty(expect), pretty(cand), "expected", "candidate", lineterm="", n=3)
                print("\n".join("    " + l for l in (diff if not ok else pretty(cand))))
            sys.stdout.flush()
            passed += ok
            failed += not ok
            continue
        ref = run_isolated(name, args.reference, args.timeout, run_id=f"{run_id}r")
        if args.only_reference:
            ok = not is_broken(ref)
            print(f"{'PASS' if ok else 'FAIL'} {name}")
            if args.show or not ok:
                print("\n".join("    " + l for l in pretty(ref)))
        else:
            cand = run_isolated(name, args.candidate, args.timeout, run_id=f"{run_id}c")
            # A scenario that breaks on the reference is a bug in the scenario,
            # not a conformance result, even if the candidate breaks the same way.
            ok = ref == cand and not is_broken(ref)
            print(f"{'PASS' if ok else 'FAIL'} {name}")
            if is_broken(ref):
                print("    reference run broke (scenario bug or reference broker down)")
            if not ok or args.show:
                diff = difflib.unified_diff(pretty(ref), pretty(cand), "reference", "candidate", lineterm="", n=3)
                print("\n".join("    " + l for l in (diff if not ok else pretty(ref))))
        sys.stdout.flush()
        passed += ok
        failed += not ok
    print(f"{passed} passed, {failed} failed" + (f", {skipped} skipped" if skipped else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
