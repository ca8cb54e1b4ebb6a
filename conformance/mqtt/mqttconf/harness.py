"""Scenario registry, per-run context and isolated execution (MQTT).

A scenario is ``fn(ctx) -> transcript``: ``ctx.host``/``ctx.port`` is the
broker, ``ctx.topic(tag)`` a topic unique to this run and scenario,
``ctx.client(...)`` a connected paho client, ``ctx.raw(...)`` a raw socket
client. The transcript is JSON-able and holds only what a client observes
that depends neither on timing nor on server-generated names: topics are
shown relative to the scenario's prefix (``~/tag``), client ids never.

Registration:

* ``@scenario`` runs against the reference (Mosquitto) and the candidate
  (Weir); their transcripts must be equal.
* ``@both`` registers ``fn(ctx, version)`` twice, as ``name_v3`` (MQTT 3.1.1)
  and ``name_v5`` (MQTT 5).
* ``@differs(why, reference=..., candidate=...)`` for a behaviour where
  Mosquitto 2.0 departs from the MQTT 5 specification (or from what issue 8
  asks of Weir where the specification leaves a choice): the reference
  transcript must equal ``reference`` (so a change in Mosquitto is noticed)
  and the candidate's must equal ``candidate`` (what the specification
  says). ``why`` names the clause.
* ``@weir_only(why, expect)`` for a feature Mosquitto lacks: it runs against
  the candidate alone.
"""
from __future__ import annotations

import hashlib
import json
import multiprocessing
import traceback
import uuid
from dataclasses import dataclass, field
from typing import Callable

SCENARIOS: dict[str, Callable] = {}
DIFFERS: dict[str, dict] = {}
WEIR_ONLY: dict[str, dict] = {}

V3, V5 = 4, 5  # protocol levels: MQTT 3.1.1 is level 4


def scenario(fn: Callable, name: str | None = None) -> Callable:
    """Register ``fn`` under its function name (the name used by ``-k``)."""
    name = name or fn.__name__
    if name in SCENARIOS:
        raise ValueError(f"duplicate scenario {name}")
    SCENARIOS[name] = fn
    return fn


def both(fn: Callable) -> Callable:
    """Register ``fn(ctx, version)`` as ``<name>_v3`` and ``<name>_v5``."""
    for suffix, version in (("v3", V3), ("v5", V5)):
        def run(ctx, _v=version):
            return fn(ctx, _v)
        scenario(run, f"{fn.__name__}_{suffix}")
    return fn


def differs(why: str, reference, candidate):
    """A scenario where the reference departs from the specification: see
    the module doc."""

    def register(fn: Callable) -> Callable:
        scenario(fn)
        DIFFERS[fn.__name__] = {"why": why, "reference": reference, "candidate": candidate}
        return fn

    return register


def weir_only(why: str, expect):
    def register(fn: Callable) -> Callable:
        scenario(fn)
        WEIR_ONLY[fn.__name__] = {"why": why, "expect": expect}
        return fn

    return register


@dataclass
class Ctx:
    host: str
    port: int
    run_id: str
    scenario: str
    username: str = "guest"
    password: str = "guest"
    retained: set = field(default_factory=set)
    sessions: dict = field(default_factory=dict)  # client id -> protocol level
    clients: list = field(default_factory=list)
    _ids: int = 0

    @property
    def prefix(self) -> str:
        # Short, no '.', so it survives Weir's '/' <-> '.' mapping onto
        # amq.topic routing keys unchanged.
        h = hashlib.sha1(self.scenario.encode()).hexdigest()[:6]
        return f"wc/{self.run_id}/{h}"

    def topic(self, tag: str) -> str:
        return f"{self.prefix}/{tag}"

    def rel(self, topic: str) -> str:
        """A topic as the transcript shows it: the run's prefix is '~'."""
        for p in (self.prefix, "$" + self.prefix):
            if topic.startswith(p):
                return ("$~" if p.startswith("$") else "~") + topic[len(p):]
        return topic

    def client_id(self, tag: str) -> str:
        """A client id unique to this run and scenario, at most 23
        characters (the length every 3.1.1 server must accept)."""
        self._ids += 1
        h = hashlib.sha1(self.scenario.encode()).hexdigest()[:5]
        return f"w{self.run_id[:6]}{h}{self._ids:02d}{tag}"[:23]

    def retain_at(self, topic: str) -> str:
        """Remembers a topic that gets a retained message (cleared after)."""
        self.retained.add(topic)
        return topic

    def session(self, client_id: str, version: int) -> str:
        """Remembers a persistent session (ended after the scenario)."""
        self.sessions[client_id] = version
        return client_id

    def client(self, tag: str = "c", version: int = V5, connect: bool = True, **kw):
        from .client import MqttClient

        c = MqttClient(self, kw.pop("client_id", None) or self.client_id(tag), version, **kw)
        self.clients.append(c)
        if connect:
            c.connect()
        return c

    def raw(self, version: int = V5, timeout: float = 5.0):
        from .raw import RawClient

        r = RawClient(self.host, self.port, version, timeout)
        self.clients.append(r)
        return r


def cleanup(ctx: Ctx) -> None:
    """Close every client, clear retained messages, end persistent sessions."""
    from .raw import RawClient, connect_packet, disconnect_packet, publish_packet

    for c in ctx.clients:
        try:
            c.close()
        except Exception:
            pass
    for cid, version in ctx.sessions.items():
        try:
            r = RawClient(ctx.host, ctx.port, version, 3.0)
            # Clean start with no session expiry: the old session is
            # discarded and this one ends with the connection.
            r.send(connect_packet(cid, version=version, clean=True, username=ctx.username, password=ctx.password))
            r.expect(2)
            r.send(disconnect_packet(version))
            r.close()
        except Exception:
            pass
    if ctx.retained:
        try:
            r = RawClient(ctx.host, ctx.port, 4, 3.0)
            r.connect(ctx.client_id("clean"), username=ctx.username, password=ctx.password)
            for t in sorted(ctx.retained):
                r.send(publish_packet(t, b"", 1, retain=True, pid=1, version=4))
                r.expect(4)
            r.send(disconnect_packet(4))
            r.close()
        except Exception:
            pass


def _child(fn_name: str, target: tuple, run_id: str, out) -> None:
    from . import scenarios  # noqa: F401  (registers scenarios in the child too)

    host, port, user, password = target
    ctx = Ctx(host=host, port=port, run_id=run_id, scenario=fn_name, username=user, password=password)
    try:
        result = SCENARIOS[fn_name](ctx)
    except Exception as e:  # an error the scenario did not expect is itself an observation
        result = {"unexpected": f"{type(e).__name__}: {e}",
                  "trace": traceback.format_exc(limit=4).splitlines()[-4:]}
    finally:
        cleanup(ctx)
    out.send(json.dumps(result, sort_keys=True))
    out.close()


def run_isolated(fn_name: str, target: tuple, timeout: float = 60.0, run_id: str | None = None):
    """Run one scenario in a child process with a time limit, so that a
    broker that never answers cannot hang the whole run. ``target`` is
    (host, port, username, password)."""
    run_id = run_id or uuid.uuid4().hex[:8]
    mp = multiprocessing.get_context("fork")
    recv, send = mp.Pipe(duplex=False)
    proc = mp.Process(target=_child, args=(fn_name, target, run_id, send), daemon=True)
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
