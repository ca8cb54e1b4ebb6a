"""Scenario registry, per-run context and isolated execution.

A scenario is a function ``fn(ctx) -> transcript`` where ``ctx.url`` is the
broker URL and ``ctx.name(tag)`` hands out a queue/exchange name unique to this
run. The transcript must be JSON-able and contain only what a client observes
that does not depend on timing or on server-generated names.
"""
from __future__ import annotations

import json
import multiprocessing
import traceback
import uuid
from dataclasses import dataclass, field
from typing import Callable

import pika

from .observe import error_record

SCENARIOS: dict[str, Callable] = {}

# Scenarios of features RabbitMQ 3.10 (the reference) lacks: name ->
# {"why": what the reference lacks, "expect": the transcript Weir must give}.
WEIR_ONLY: dict[str, dict] = {}


def scenario(fn: Callable) -> Callable:
    """Register ``fn`` under its function name (the name used by ``-k``)."""
    if fn.__name__ in SCENARIOS:
        raise ValueError(f"duplicate scenario {fn.__name__}")
    SCENARIOS[fn.__name__] = fn
    return fn


def weir_only(why: str, expect):
    """Register a scenario of a feature RabbitMQ 3.10 lacks (``why`` says
    which). It runs against the candidate alone and passes when its
    transcript equals ``expect``: the scenario reduces what it saw to facts
    (counts, "in order", booleans) that do not depend on timing."""

    def register(fn: Callable) -> Callable:
        scenario(fn)
        WEIR_ONLY[fn.__name__] = {"why": why, "expect": expect}
        return fn

    return register


@dataclass
class Ctx:
    url: str
    run_id: str
    scenario: str
    queues: list[str] = field(default_factory=list)
    exchanges: list[str] = field(default_factory=list)

    def name(self, tag: str, kind: str = "q") -> str:
        """A name unique to this run and scenario; remembered for cleanup.

        kind is "q" for queues and "x" for exchanges. Names never appear in
        transcripts, so the reference and the candidate can use different ones.
        """
        n = f"conf.{self.run_id}.{self.scenario}.{tag}"
        (self.queues if kind == "q" else self.exchanges).append(n)
        return n

    def xname(self, tag: str) -> str:
        return self.name(tag, "x")

    def named(self, name: str, kind: str = "q") -> str:
        """Remembers a name the scenario built itself (one a policy pattern
        must match, say) for cleanup, and returns it."""
        (self.queues if kind == "q" else self.exchanges).append(name)
        return name

    def connect(self, **overrides) -> pika.BlockingConnection:
        return pika.BlockingConnection(params(self.url, **overrides))


def params(url: str, **overrides) -> pika.URLParameters:
    p = pika.URLParameters(url)
    # Bound how long a dead or silent broker can stall connection setup; a
    # broker that accepts but never answers an RPC is caught by the per-
    # scenario process timeout in run_isolated.
    p.socket_timeout = 5
    p.stack_timeout = 10
    p.blocked_connection_timeout = 10
    p.connection_attempts = 1
    for k, v in overrides.items():
        setattr(p, k, v)
    return p


def cleanup(ctx: Ctx) -> None:
    """Delete everything the scenario named, each on its own channel because
    a failing delete (already gone) closes the channel."""
    try:
        conn = ctx.connect()
    except Exception:
        return
    try:
        for q in ctx.queues:
            try:
                conn.channel().queue_delete(q)
            except Exception:
                pass
        for x in ctx.exchanges:
            try:
                conn.channel().exchange_delete(x)
            except Exception:
                pass
    finally:
        try:
            conn.close()
        except Exception:
            pass


def _child(fn_name: str, url: str, run_id: str, out) -> None:
    from . import scenarios  # noqa: F401  (registers scenarios in the child too)

    ctx = Ctx(url=url, run_id=run_id, scenario=fn_name)
    try:
        result = SCENARIOS[fn_name](ctx)
    except Exception as e:  # an error the scenario did not expect is itself an observation
        result = {"unexpected": error_record(e), "trace": traceback.format_exc(limit=3).splitlines()[-3:]}
    finally:
        cleanup(ctx)
    out.send(json.dumps(result, sort_keys=True))
    out.close()


def run_isolated(fn_name: str, url: str, timeout: float = 60.0, run_id: str | None = None):
    """Run one scenario in a child process so that a broker that never answers
    (pika's BlockingConnection has no RPC timeout) cannot hang the whole run."""
    run_id = run_id or uuid.uuid4().hex[:8]
    mp = multiprocessing.get_context("fork")
    recv, send = mp.Pipe(duplex=False)
    proc = mp.Process(target=_child, args=(fn_name, url, run_id, send), daemon=True)
    proc.start()
    send.close()
    result = None
    if recv.poll(timeout):
        try:
            result = json.loads(recv.recv())
        except EOFError:
            pass
    proc.join(5)
    if proc.is_alive():
        proc.kill()
        proc.join()
    if result is None:
        reason = "timeout" if proc.exitcode in (None, -9) else f"child exit {proc.exitcode}"
        result = {"harness_error": f"scenario did not finish ({reason}, limit {timeout:.0f}s)"}
    return result
