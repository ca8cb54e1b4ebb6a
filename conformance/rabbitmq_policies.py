#!/usr/bin/env python3
"""Set the conformance run's policies on the local RabbitMQ node.

    python conformance/rabbitmq_policies.py [conformance/policies.toml]

Reads the ``[[policies]]`` of a Weir configuration file (the one
conformance/run.sh starts Weir with) and sets each on RabbitMQ with
``rabbitmqctl set_policy``, so both brokers run the policy scenarios under
the same policies. Setting a policy again is idempotent. Needs to run where
``rabbitmqctl`` reaches the node (root on the dev/CI machines, as
scripts/start-rabbitmq.sh).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib


def main(argv: list[str]) -> int:
    path = argv[1] if len(argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "policies.toml")
    with open(path, "rb") as f:
        policies = tomllib.load(f).get("policies", [])
    for p in policies:
        cmd = [
            "rabbitmqctl", "-q", "set_policy",
            "-p", p.get("vhost", "/"),
            "--priority", str(p.get("priority", 0)),
            "--apply-to", p.get("apply-to", "all"),
            p["name"], p["pattern"], json.dumps(p["definition"]),
        ]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        if r.returncode != 0:
            print(f"rabbitmq_policies: {' '.join(cmd)} failed: {r.stderr.strip() or r.stdout.strip()}",
                  file=sys.stderr)
            return 1
    print(f"rabbitmq_policies: {len(policies)} policies set from {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
