#!/usr/bin/env bash
# Issue 7's throughput benchmarks, Weir and RabbitMQ in the same run: the saturated workload of
# scripts/bench-compare.sh on a plain durable queue, on a queue with the delivery-semantics
# bookkeeping switched on (x-dead-letter-exchange, x-message-ttl, x-max-length, none of which
# fires) and on a 10-level priority queue (random priorities 0-9), the variants back to back per
# target, three rounds (medians compared). The report ends with each variant's throughput against
# the plain queue's (issue 7: features >= 0.90, priority >= 0.70 for Weir).
#
# Usage: scripts/bench-semantics.sh [any scripts/bench-compare.sh flag, e.g. --rounds 5, --only weir,
#                                    --duration 30, --variants plain,priority]
# ~12 min on a quiet machine with the defaults (24 runs of 23 s plus quiet waits).
set -euo pipefail
exec "$(dirname "${BASH_SOURCE[0]}")/bench-compare.sh" --variants plain,features,priority \
  --workloads saturated --rounds 3 "$@"
