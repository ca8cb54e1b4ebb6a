#!/usr/bin/env python3
"""Compare client-library test suites run against RabbitMQ and against Weir.

scripts/client-suites.sh runs each suite twice, once per broker, and leaves
one JUnit XML report per run: RESULTS_DIR/<suite>-rabbitmq.xml and
RESULTS_DIR/<suite>-weir.xml (pytest's --junitxml, node's junit reporter).
This prints a table of passed/failed/skipped per suite and broker, the tests
whose outcome differs, and the tests that fail on both brokers with why.

Exit status 1 when a test passes on RabbitMQ but fails (or is missing) on
Weir and is not in ALLOWED below; 0 otherwise.

    compare.py RESULTS_DIR SUITE... [--markdown FILE]
"""
import argparse
import re
import sys
import xml.etree.ElementTree as ET

# Tests that pass on RabbitMQ and may fail on Weir, each with why. Keep this
# short and honest: an entry is a difference Weir has on purpose, or one
# that another branch fixes (remove those once it is merged).
ALLOWED = {
    ("amqplib", "Connect > Connect API > serverProperties"): (
        "asserts that the server's product property is 'RabbitMQ'; Weir "
        "announces itself as 'Weir' on purpose"
    ),
}

# Tests that fail on both brokers, with why (printed next to each; a test
# failing on both with no entry here is printed as 'reason not recorded').
# Keys are (suite, regular expression matched against the test id).
BOTH_FAIL = [
    ("py-amqp", r"\[tls\b|\[tls-|::test_tls_connect_fails$",
     "needs a TLS listener on port 5671 with the upstream repository's test "
     "certificates (not in the sdist); neither broker has one in this run"),
    ("py-amqp", r"::test_tls_(no_)?default_certs(_fails)?$",
     "connects to tls-v1-2.badssl.com on the internet; this machine has no "
     "network but the package registries"),
]


def outcome_of(case):
    """'failed', 'skipped' or 'passed' for one <testcase>."""
    if case.find("failure") is not None or case.find("error") is not None:
        return "failed"
    if case.find("skipped") is not None:
        return "skipped"
    return "passed"


def worse(a, b):
    """Merge two outcomes of the same id (pytest reports a test whose
    teardown errors twice): a failure wins."""
    order = {"failed": 2, "skipped": 1, "passed": 0}
    return a if order[a] >= order[b] else b


def read_report(path, src_prefix):
    """{test id: outcome} from one JUnit report. pytest: classname::name.
    node: the names of the enclosing suites and the test, joined by ' > '
    (a file that failed as a whole reports itself as a case named by its
    path: the prefix of the unpacked source is cut off)."""
    results = {}
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as e:
        print(f"compare: cannot read {path}: {e}", file=sys.stderr)
        return results

    def add(test_id, outcome):
        results[test_id] = worse(outcome, results.get(test_id, "passed"))

    def walk(node, path_names):
        for child in node:
            if child.tag != "testcase":
                # A suite; node's junit reporter writes a cancelled one
                # as <undefined name=...>.
                name = child.get("name", "")
                # pytest wraps everything in one suite named "pytest".
                walk(child, path_names + ([name] if name and name != "pytest" else []))
            elif child.tag == "testcase":
                name = child.get("name", "")
                if src_prefix and name.startswith(src_prefix):
                    name = name[len(src_prefix):].lstrip("/")
                cls = child.get("classname", "")
                if cls and cls != "test":  # pytest
                    test_id = f"{cls}::{name}"
                else:  # node
                    test_id = " > ".join(path_names + [name])
                add(test_id, outcome_of(child))
                # node nests the tests of a file that failed as a whole
                # (a timeout) inside that file's case.
                walk(child, path_names)

    walk(root, [])
    return results


def both_fail_reason(suite, test_id):
    for s, pattern, why in BOTH_FAIL:
        if s == suite and re.search(pattern, test_id):
            return why
    return "reason not recorded"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("results_dir")
    ap.add_argument("suites", nargs="+", help="suite names, each as name=source-dir")
    ap.add_argument("--markdown", help="also write the table as Markdown here")
    args = ap.parse_args()

    rows = []
    regressions = []
    allowed_hits = []
    better = []
    both_failed = []
    for spec in args.suites:
        suite, _, src = spec.partition("=")
        rmq = read_report(f"{args.results_dir}/{suite}-rabbitmq.xml", src)
        weir = read_report(f"{args.results_dir}/{suite}-weir.xml", src)
        counts = {}
        for broker, res in (("rabbitmq", rmq), ("weir", weir)):
            c = {"passed": 0, "failed": 0, "skipped": 0}
            for o in res.values():
                c[o] += 1
            counts[broker] = c
        for test_id in sorted(set(rmq) | set(weir)):
            r = rmq.get(test_id, "missing")
            w = weir.get(test_id, "missing")
            if r == "passed" and w in ("failed", "missing"):
                key = (suite, test_id)
                if key in ALLOWED:
                    allowed_hits.append((suite, test_id, w, ALLOWED[key]))
                else:
                    regressions.append((suite, test_id, w))
            elif w == "passed" and r in ("failed", "missing"):
                better.append((suite, test_id, r))
            elif r in ("failed", "missing") and w in ("failed", "missing"):
                both_failed.append((suite, test_id, both_fail_reason(suite, test_id)))
        rows.append((suite, counts["rabbitmq"], counts["weir"]))

    header = ("suite", "RabbitMQ passed/failed/skipped", "Weir passed/failed/skipped")
    lines = []
    width = max(len(r[0]) for r in rows + [header])
    fmt = lambda c: f"{c['passed']}/{c['failed']}/{c['skipped']}"  # noqa: E731
    lines.append(f"{header[0]:<{width}}  {header[1]:>30}  {header[2]:>26}")
    for suite, r, w in rows:
        lines.append(f"{suite:<{width}}  {fmt(r):>30}  {fmt(w):>26}")
    print("\n".join(lines))

    def section(title, items, show):
        if items:
            print(f"\n{title} ({len(items)}):")
            for it in items:
                print("  " + show(it))

    section("passes on RabbitMQ, fails on Weir (REGRESSION)", regressions,
            lambda t: f"{t[0]}: {t[1]} [{t[2]} on Weir]")
    section("passes on RabbitMQ, fails on Weir (allowed)", allowed_hits,
            lambda t: f"{t[0]}: {t[1]} [{t[2]} on Weir] - {t[3]}")
    section("passes on Weir, fails on RabbitMQ", better,
            lambda t: f"{t[0]}: {t[1]} [{t[2]} on RabbitMQ]")
    section("fails on both", both_failed, lambda t: f"{t[0]}: {t[1]} - {t[2]}")

    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write("| suite | RabbitMQ 3.10 passed / failed / skipped "
                    "| Weir passed / failed / skipped |\n|---|---|---|\n")
            for suite, r, w in rows:
                f.write(f"| {suite} | {r['passed']} / {r['failed']} / {r['skipped']} "
                        f"| {w['passed']} / {w['failed']} / {w['skipped']} |\n")
            for title, items, show in (
                ("Passes on RabbitMQ, fails on Weir", regressions,
                 lambda t: f"`{t[0]}`: {t[1]}"),
                ("Passes on RabbitMQ, fails on Weir, allowed", allowed_hits,
                 lambda t: f"`{t[0]}`: {t[1]} — {t[3]}"),
                ("Passes on Weir, fails on RabbitMQ", better,
                 lambda t: f"`{t[0]}`: {t[1]}"),
                ("Fails on both", both_failed,
                 lambda t: f"`{t[0]}`: {t[1]} — {t[2]}"),
            ):
                if items:
                    f.write(f"\n{title}:\n\n")
                    for it in items:
                        f.write(f"- {show(it)}\n")

    total_w = sum(w["passed"] for _, _, w in rows)
    total_f = sum(w["failed"] for _, _, w in rows)
    print(f"\nclient-suites: {total_w} passed on Weir, {total_f} failed on Weir "
          f"({len(regressions)} only on Weir and not allowed)")
    return 1 if regressions else 0


if __name__ == "__main__":
    sys.exit(main())
