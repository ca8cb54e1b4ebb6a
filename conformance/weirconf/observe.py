"""Turning what pika shows into stable, broker-independent observations."""
from __future__ import annotations

import re
import time

import pika
import pika.exceptions as px


def reply_name(text: str | None) -> str | None:
    """The symbolic part of an AMQP reply text: "NOT_FOUND - no queue 'x' ..."
    -> "NOT_FOUND". The rest names server objects and differs between brokers
    and versions, so it is not compared."""
    if text is None:
        return None
    return str(text).split(" - ", 1)[0].strip()


def error_record(e: BaseException) -> dict:
    """Class of error plus reply code and symbolic reply name."""
    if isinstance(e, px.ChannelClosedByBroker):
        return {"error": "channel_closed", "code": e.reply_code, "name": reply_name(e.reply_text)}
    if isinstance(e, px.ConnectionClosedByBroker):
        return {"error": "connection_closed", "code": e.reply_code, "name": reply_name(e.reply_text)}
    if isinstance(e, px.ProbableAuthenticationError):
        return {"error": "auth_refused", **_close_in_text(_first_arg(e))}
    if isinstance(e, px.ProbableAccessDeniedError):
        return {"error": "access_denied", **_close_in_text(_first_arg(e))}
    if isinstance(e, px.AMQPConnectionError):
        # BlockingConnection wraps the real cause in args[0] in some paths.
        inner = e.args[0] if e.args and isinstance(e.args[0], BaseException) else None
        if inner is not None:
            return {"error": "connect_failed", "cause": error_record(inner)}
        return {"error": type(e).__name__}
    return {"error": type(e).__name__}


def _first_arg(e: BaseException) -> str | None:
    return str(e.args[0]) if e.args else None


_CLOSE_RE = re.compile(r"\((\d+)\)\s*'([A-Z_]+)")


def _close_in_text(text: str | None) -> dict:
    """pika reports login/vhost refusals as a string such as
    "ConnectionClosedByBroker: (403) 'ACCESS_REFUSED - Login was refused ...'".
    Pull out the code and symbolic name. Brokers that refuse a login by just
    dropping the socket (RabbitMQ before 3.x sent no connection.close) give
    neither; the error class alone is then the observation."""
    m = _CLOSE_RE.search(text or "")
    return {"code": int(m.group(1)), "name": m.group(2)} if m else {}


def expect_error(fn, *args, **kwargs) -> dict:
    """Call fn and return its error record, or {"ok": ...} if it succeeded."""
    try:
        result = fn(*args, **kwargs)
    except Exception as e:
        return error_record(e)
    return {"ok": True, "result": _plain(result)}


def _plain(result):
    # A successful call's return value is only recorded when it is data.
    if isinstance(result, (str, int, float, bool, type(None))):
        return result
    return type(result).__name__


def msg(method, props, body) -> dict:
    """Observation of one delivered or fetched message."""
    rec = {"body": body.decode(errors="replace"), "redelivered": bool(method.redelivered)}
    if props is not None and props.headers:
        rec["headers"] = {k: _decode(v) for k, v in sorted(props.headers.items())}
    return rec


def _decode(v):
    return v.decode(errors="replace") if isinstance(v, bytes) else v


def drain(ch, queue: str) -> list[dict]:
    """Fetch and ack every ready message with basic.get until get-empty.
    Event-driven: each get is a synchronous round trip, no timing involved."""
    out = []
    for _ in range(10_000):
        method, props, body = ch.basic_get(queue, auto_ack=True)
        if method is None:
            return out
        out.append(msg(method, props, body))
    raise AssertionError("drain did not reach get-empty")


def bodies(ch, queue: str) -> list[str]:
    return [m["body"] for m in drain(ch, queue)]


class Collector:
    """Buffers deliveries for one consumer so a scenario can wait for exactly
    n of them (bounded by a deadline, returning early as soon as they arrive)."""

    def __init__(self, conn: pika.BlockingConnection, ch, queue: str, auto_ack=False, **kw):
        self.conn, self.ch = conn, ch
        self.items: list[tuple] = []
        self.cancelled_by_broker = False
        self.tag = ch.basic_consume(queue, self._on_msg, auto_ack=auto_ack, **kw)

    def _on_msg(self, ch, method, props, body):
        self.items.append((method, props, body))

    def wait_for(self, n: int, timeout: float = 10.0) -> list[tuple]:
        """Block until at least n deliveries are buffered or timeout expires;
        return (and forget) the first n (or all if fewer arrived)."""
        deadline = time.monotonic() + timeout
        while len(self.items) < n and time.monotonic() < deadline:
            self.conn.process_data_events(time_limit=min(0.2, max(0.0, deadline - time.monotonic())))
        got, self.items = self.items[:n], self.items[n:]
        return got

    def quiet(self, period: float = 0.5) -> int:
        """How many extra deliveries arrive within `period`. This is the one
        place that waits on time: asserting that nothing *more* arrives has no
        event to await. Only used where a limit (prefetch) is under test."""
        deadline = time.monotonic() + period
        while time.monotonic() < deadline:
            self.conn.process_data_events(time_limit=max(0.0, deadline - time.monotonic()))
        return len(self.items)


def wait_until(pred, timeout: float = 10.0, step: float = 0.05) -> bool:
    """Bounded poll for server-side state that has no client-visible event
    (e.g. an auto-delete queue disappearing)."""
    deadline = time.monotonic() + timeout
    while True:
        if pred():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(step)


def queue_exists(conn: pika.BlockingConnection, queue: str) -> bool:
    ch = conn.channel()
    try:
        ch.queue_declare(queue, passive=True)
    except px.ChannelClosedByBroker as e:
        if e.reply_code == 404:
            return False
        raise
    ch.close()
    return True


def passive_count(conn: pika.BlockingConnection, queue: str) -> dict:
    """(ready message count, consumer count) from a passive declare-ok."""
    ch = conn.channel()
    ok = ch.queue_declare(queue, passive=True)
    ch.close()
    return {"messages": ok.method.message_count, "consumers": ok.method.consumer_count}
