"""Dead-lettering (x-death for each reason), TTL, length limits with each
overflow mode, delivery limit on quorum queues, and the 406 refusals of
badly typed or out-of-range queue arguments.

What is compared: bodies and their order, where each dead-lettered message
arrived, the exchange and routing key it was republished with, and its
x-death / x-first-death-* / x-last-death-* headers with the names of this
run's queues and exchanges reduced to their tags (``<q>``) and ``time``
reduced to its type. Waiting is event-driven: a dead-lettered message is
awaited with a consumer on the dead-letter queue (bounded by a deadline),
never with a sleep.

RabbitMQ 3.10 lacks some of what Weir does (TTL without head-of-line
blocking, a delivery limit on classic queues, quorum queues' default limit
of 20 from RabbitMQ 4); those are tested against Weir alone in
tests/tests/delivery_semantics.rs and engine/tests/delivery.rs.
"""
import datetime
import decimal
import re
import time

import pika
import pika.exceptions as px

from ..harness import scenario
from ..observe import Collector, bodies, expect_error, passive_count, wait_until

PERSISTENT = pika.BasicProperties(delivery_mode=2)


def norm(ctx, v):
    """Replaces this run's object names by their tags (``<tag>``) so the
    reference and the candidate, which use different names, compare; a
    timestamp becomes its type (time is never compared)."""
    prefix = f"conf.{ctx.run_id}.{ctx.scenario}."
    if isinstance(v, bytes):
        v = v.decode(errors="replace")
    if isinstance(v, str):
        return re.sub(re.escape(prefix) + r"([\w.-]+)", r"<\1>", v)
    if isinstance(v, datetime.datetime):
        return "<timestamp>"
    if isinstance(v, dict):
        return {k: ("<time>" if k == "time" else norm(ctx, x)) for k, x in sorted(v.items())}
    if isinstance(v, (list, tuple)):
        return [norm(ctx, x) for x in v]
    return v


def dead_msg(ctx, method, props, body) -> dict:
    """A (dead-lettered) message as the client sees it: body, the exchange
    and routing key it was delivered with, headers and kept properties."""
    rec = {
        "body": body.decode(errors="replace"),
        "exchange": norm(ctx, method.exchange),
        "routing_key": norm(ctx, method.routing_key),
        "redelivered": bool(method.redelivered),
    }
    if props is not None:
        if props.headers:
            # RabbitMQ 3.10 does not set x-last-death-* (added in 3.13);
            # Weir does, as RabbitMQ 4. They are checked against Weir in
            # tests/tests/delivery_semantics.rs.
            h = {k: v for k, v in props.headers.items() if not k.startswith("x-last-death-")}
            if h:
                rec["headers"] = norm(ctx, h)
        for k in ("delivery_mode", "expiration", "message_id", "priority"):
            v = getattr(props, k)
            if v is not None:
                rec[k] = v
    return rec


def get_all(ctx, ch, queue) -> list[dict]:
    """Every ready message of `queue` (basic.get until get-empty, acked)."""
    out = []
    for _ in range(1000):
        m, p, b = ch.basic_get(queue, auto_ack=True)
        if m is None:
            return out
        out.append(dead_msg(ctx, m, p, b))
    raise AssertionError("get_all did not reach get-empty")


def await_msgs(ctx, conn, queue, n, timeout=10.0) -> list[dict]:
    """Consumes (auto-ack) until n messages arrived on `queue` or the
    deadline passed; used for messages that arrive on a broker timer
    (expiry), so there is no reply to wait for."""
    ch = conn.channel()
    col = Collector(conn, ch, queue, auto_ack=True)
    got = col.wait_for(n, timeout)
    ch.basic_cancel(col.tag)
    ch.close()
    return [dead_msg(ctx, m, p, b) for m, p, b in got]


def dl_setup(ctx, conn, src_args, dlx_type="fanout", dlq_key=""):
    """A dead-letter exchange ``dlx`` with a queue ``dlq`` bound to it and a
    source queue ``q`` with ``x-dead-letter-exchange: dlx`` plus src_args.
    Returns (confirm channel, q, dlx, dlq)."""
    ch = conn.channel()
    ch.confirm_delivery()
    dlx = ctx.xname("dlx")
    dlq = ctx.name("dlq")
    ch.exchange_declare(dlx, dlx_type)
    ch.queue_declare(dlq)
    ch.queue_bind(dlq, dlx, routing_key=dlq_key)
    q = ctx.name("q")
    ch.queue_declare(q, arguments={"x-dead-letter-exchange": dlx, **src_args})
    return ch, q, dlx, dlq


# --- x-death for each reason ----------------------------------------------


@scenario
def dlx_rejected_reject_and_nack(ctx):
    """basic.reject and basic.nack without requeue dead-letter with reason
    "rejected"; the message keeps its routing key and headers; requeue=True
    does not dead-letter."""
    conn = ctx.connect()
    ch, q, dlx, dlq = dl_setup(ctx, conn, {})
    src = ctx.xname("src")
    ch.exchange_declare(src, "direct")
    ch.queue_bind(q, src, routing_key="rk")
    props = pika.BasicProperties(delivery_mode=2, message_id="id-1", headers={"app": "kept"})
    for b in ("m0", "m1", "m2"):
        ch.basic_publish(src, "rk", b.encode(), props)
    m0 = ch.basic_get(q)[0]
    m1 = ch.basic_get(q)[0]
    m2 = ch.basic_get(q)[0]
    ch.basic_reject(m0.delivery_tag, requeue=False)
    ch.basic_nack(m1.delivery_tag, requeue=False)
    ch.basic_nack(m2.delivery_tag, requeue=True)
    out = {"dlq": await_msgs(ctx, conn, dlq, 2)}
    out["source_after"] = [m["body"] for m in get_all(ctx, ch, q)]
    out["dlq_extra"] = get_all(ctx, ch, dlq)
    conn.close()
    return out


@scenario
def dlx_rejected_routing_key_override(ctx):
    """x-dead-letter-routing-key replaces the routing key; routing-keys in
    x-death keeps the original one."""
    conn = ctx.connect()
    ch, q, dlx, dlq = dl_setup(ctx, conn, {"x-dead-letter-routing-key": "dead"},
                               dlx_type="direct", dlq_key="dead")
    ch.basic_publish("", q, b"m0")
    m = ch.basic_get(q)[0]
    ch.basic_reject(m.delivery_tag, requeue=False)
    out = {"dlq": await_msgs(ctx, conn, dlq, 1)}
    conn.close()
    return out


@scenario
def dlx_rejected_twice_counts(ctx):
    """A queue that dead-letters into itself (default exchange, its own name
    as routing key): a rejection is never a cycle, and the second death in
    the same queue for the same reason increments count."""
    conn = ctx.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    q = ctx.name("q")
    ch.queue_declare(q, arguments={"x-dead-letter-exchange": "", "x-dead-letter-routing-key": q})
    ch.basic_publish("", q, b"m0")
    cch = conn.channel()
    col = Collector(conn, cch, q)
    seen = []
    for i in range(3):
        got = col.wait_for(1)
        if not got:
            seen.append("timeout")
            break
        m, p, b = got[0]
        seen.append(dead_msg(ctx, m, p, b))
        if i < 2:
            cch.basic_reject(m.delivery_tag, requeue=False)
        else:
            cch.basic_ack(m.delivery_tag)
    conn.close()
    return {"deliveries": seen}


@scenario
def dlx_rejected_cc_routing_keys(ctx):
    """A message routed with a CC header: x-death routing-keys lists the
    routing key and the CC keys; BCC never leaves the broker."""
    conn = ctx.connect()
    ch, q, dlx, dlq = dl_setup(ctx, conn, {})
    src = ctx.xname("src")
    ch.exchange_declare(src, "direct")
    ch.queue_bind(q, src, routing_key="k1")
    ch.queue_bind(q, src, routing_key="k2")
    ch.basic_publish(src, "k1", b"m0", pika.BasicProperties(headers={"CC": ["k2"], "BCC": ["k3"]}))
    m = ch.basic_get(q)[0]
    ch.basic_reject(m.delivery_tag, requeue=False)
    out = {"dlq": await_msgs(ctx, conn, dlq, 1), "source_after": passive_count(conn, q)["messages"]}
    conn.close()
    return out


@scenario
def sender_selected_cc_bcc_routing(ctx):
    """CC and BCC headers route the message with their keys too (direct
    exchange and default exchange); consumers see CC, never BCC; a queue
    reached twice gets one copy."""
    conn = ctx.connect()
    ch = conn.channel()
    src = ctx.xname("src")
    ch.exchange_declare(src, "direct")
    qs = {k: ctx.name(k) for k in ("main", "cc", "bcc", "named")}
    for k, q in qs.items():
        ch.queue_declare(q)
    ch.queue_bind(qs["main"], src, routing_key="main")
    ch.queue_bind(qs["cc"], src, routing_key="cc")
    ch.queue_bind(qs["bcc"], src, routing_key="bcc")
    ch.queue_bind(qs["main"], src, routing_key="again")
    ch.basic_publish(src, "main", b"x", pika.BasicProperties(
        headers={"CC": ["cc", "again", "nobody"], "BCC": ["bcc"], "other": 1}))
    # Default exchange: CC names queues directly.
    ch.basic_publish("", qs["named"], b"y", pika.BasicProperties(headers={"CC": [qs["cc"]]}))
    out = {}
    for k, q in qs.items():
        got = []
        while True:
            m = ch.basic_get(q, auto_ack=True)
            if m[0] is None:
                break
            got.append({"body": m[2].decode(), "headers": sorted((m[1].headers or {}).keys())})
        out[k] = got
    conn.close()
    return out


@scenario
def dlx_expired_queue_ttl(ctx):
    """x-message-ttl expiry dead-letters with reason "expired" (no
    original-expiration for a queue TTL), published through a direct
    exchange so x-death names it and the routing key."""
    conn = ctx.connect()
    ch, q, dlx, dlq = dl_setup(ctx, conn, {"x-message-ttl": 50})
    src = ctx.xname("src")
    ch.exchange_declare(src, "direct")
    ch.queue_bind(q, src, routing_key="rk")
    ch.basic_publish(src, "rk", b"m0", PERSISTENT)
    ch.basic_publish(src, "rk", b"m1", PERSISTENT)
    out = {"dlq": await_msgs(ctx, conn, dlq, 2)}
    out["source_after"] = get_all(ctx, ch, q)
    conn.close()
    return out


@scenario
def dlx_expired_message_expiration(ctx):
    """Per-message expiration: dead-lettered with reason "expired", the
    expiration property removed and kept as x-death original-expiration."""
    conn = ctx.connect()
    ch, q, dlx, dlq = dl_setup(ctx, conn, {})
    ch.basic_publish("", q, b"short", pika.BasicProperties(expiration="50"))
    out = {"dlq": await_msgs(ctx, conn, dlq, 1)}
    # A message with an expiration that has not passed is delivered with it.
    ch.basic_publish("", q, b"long", pika.BasicProperties(expiration="600000"))
    out["source_after"] = get_all(ctx, ch, q)
    conn.close()
    return out


@scenario
def dlx_maxlen_drop_head(ctx):
    """x-max-length with the default overflow (drop-head) dead-letters the
    oldest messages with reason "maxlen"."""
    conn = ctx.connect()
    ch, q, dlx, dlq = dl_setup(ctx, conn, {"x-max-length": 2})
    for i in range(4):
        ch.basic_publish("", q, f"m{i}".encode())
    out = {"dlq": await_msgs(ctx, conn, dlq, 2)}
    out["source"] = [m["body"] for m in get_all(ctx, ch, q)]
    conn.close()
    return out


@scenario
def dlx_chain_x_death_order(ctx):
    """Two deaths in two queues: x-death is newest first, x-first-death-*
    keeps the first, x-last-death-* the latest."""
    conn = ctx.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    q1, q2, q3 = ctx.name("q1"), ctx.name("q2"), ctx.name("q3")
    ch.queue_declare(q3)
    ch.queue_declare(q2, arguments={"x-dead-letter-exchange": "", "x-dead-letter-routing-key": q3})
    ch.queue_declare(q1, arguments={"x-message-ttl": 50, "x-dead-letter-exchange": "",
                                    "x-dead-letter-routing-key": q2})
    ch.basic_publish("", q1, b"m0")
    # Wait (consumer, no ack) for the expired copy in q2, then reject it.
    cch = conn.channel()
    col = Collector(conn, cch, q2)
    got = col.wait_for(1)
    out = {"in_q2": [dead_msg(ctx, *g) for g in got]}
    if got:
        cch.basic_reject(got[0][0].delivery_tag, requeue=False)
    out["in_q3"] = await_msgs(ctx, conn, q3, 1)
    conn.close()
    return out


@scenario
def dlx_expiry_cycle_is_dropped(ctx):
    """A queue whose expired messages would dead-letter back into itself:
    RabbitMQ's cycle rule drops that copy; the other target (a witness
    queue on the same fanout) still gets it."""
    conn = ctx.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    dlx = ctx.xname("dlx")
    ch.exchange_declare(dlx, "fanout")
    q, w = ctx.name("q"), ctx.name("witness")
    ch.queue_declare(q, arguments={"x-message-ttl": 50, "x-dead-letter-exchange": dlx})
    ch.queue_declare(w)
    ch.queue_bind(q, dlx)
    ch.queue_bind(w, dlx)
    ch.basic_publish("", q, b"m0")
    out = {"witness": await_msgs(ctx, conn, w, 1)}
    # The copy for q was filtered when the witness copy was routed.
    out["source_after"] = passive_count(conn, q)["messages"]
    conn.close()
    return out


@scenario
def dlx_missing_exchange_drops(ctx):
    """A dead-letter exchange that does not exist: the rejected message is
    dropped, the queue keeps working."""
    conn = ctx.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    q = ctx.name("q")
    ch.queue_declare(q, arguments={"x-dead-letter-exchange": ctx.xname("never-declared")})
    ch.basic_publish("", q, b"m0")
    ch.basic_publish("", q, b"m1")
    m = ch.basic_get(q)[0]
    ch.basic_reject(m.delivery_tag, requeue=False)
    out = {"source_after": bodies(ch, q), "connection_open": conn.is_open}
    conn.close()
    return out


# --- TTL ---------------------------------------------------------------------


@scenario
def ttl_queue_without_dlx_drops(ctx):
    """Expired messages without a DLX are dropped; those published later
    (fresh TTL) are still there."""
    conn = ctx.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    q = ctx.name("q")
    ch.queue_declare(q, arguments={"x-message-ttl": 50})
    ch.basic_publish("", q, b"old")
    gone = wait_until(lambda: passive_count(conn, q)["messages"] == 0, timeout=10)
    out = {"expired_count_reached_zero": gone, "get_after": bodies(ch, q)}
    conn.close()
    return out


@scenario
def ttl_zero_delivers_only_to_waiting_consumer(ctx):
    """x-message-ttl 0: a message no consumer can take at once expires
    (dead-lettered), one published while a consumer waits is delivered."""
    conn = ctx.connect()
    ch, q, dlx, dlq = dl_setup(ctx, conn, {"x-message-ttl": 0})
    ch.basic_publish("", q, b"nobody-waiting")
    out = {"dlq": await_msgs(ctx, conn, dlq, 1)}
    cch = conn.channel()
    col = Collector(conn, cch, q, auto_ack=True)
    ch.basic_publish("", q, b"consumer-waiting")
    out["consumer"] = [b.decode() for _, _, b in col.wait_for(1)]
    cch.basic_cancel(col.tag)
    out["dlq_after"] = [m["body"] for m in get_all(ctx, ch, dlq)]
    conn.close()
    return out


@scenario
def ttl_redeclare_equivalence(ctx):
    """Redeclaring with a different x-message-ttl is inequivalent (406)."""
    conn = ctx.connect()
    q = ctx.name("q")
    conn.channel().queue_declare(q, arguments={"x-message-ttl": 1000})
    out = {
        "same": expect_error(lambda: conn.channel().queue_declare(q, arguments={"x-message-ttl": 1000}) and "ok"),
        "different": expect_error(conn.channel().queue_declare, q, arguments={"x-message-ttl": 2000}),
    }
    conn.close()
    return out


# --- length limits -----------------------------------------------------------


def _publish_all(ch, q, n, prefix="m"):
    """Confirmed publishes; "ack" or "nack" for each."""
    res = []
    for i in range(n):
        try:
            ch.basic_publish("", q, f"{prefix}{i}".encode())
            res.append("ack")
        except px.NackError:
            res.append("nack")
    return res


@scenario
def maxlen_drop_head_without_dlx(ctx):
    conn = ctx.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    q = ctx.name("q")
    ch.queue_declare(q, arguments={"x-max-length": 2, "x-overflow": "drop-head"})
    out = {"confirms": _publish_all(ch, q, 5), "queue": bodies(ch, q)}
    conn.close()
    return out


@scenario
def maxlen_zero_drop_head(ctx):
    """x-max-length 0: every message is pushed out at once (dead-lettered)."""
    conn = ctx.connect()
    ch, q, dlx, dlq = dl_setup(ctx, conn, {"x-max-length": 0})
    out = {"confirms": _publish_all(ch, q, 2)}
    out["dlq"] = await_msgs(ctx, conn, dlq, 2)
    out["queue"] = bodies(ch, q)
    conn.close()
    return out


@scenario
def maxlen_reject_publish_nacks(ctx):
    """reject-publish: publishes beyond the limit are nacked (with confirms)
    and not dead-lettered; room made by a consume is usable again."""
    conn = ctx.connect()
    ch, q, dlx, dlq = dl_setup(ctx, conn, {"x-max-length": 2, "x-overflow": "reject-publish"})
    out = {"confirms": _publish_all(ch, q, 4)}
    m = ch.basic_get(q, auto_ack=True)[0]
    out["got"] = m is not None
    out["confirms_after_get"] = _publish_all(ch, q, 2, prefix="n")
    out["queue"] = bodies(ch, q)
    out["dlq"] = get_all(ctx, ch, dlq)
    # Without confirms the refused publish is silently dropped.
    plain = conn.channel()
    for i in range(3):
        plain.basic_publish("", q, f"p{i}".encode())
    out["unconfirmed_queue"] = bodies(plain, q)
    conn.close()
    return out


@scenario
def maxlen_reject_publish_dlx(ctx):
    """reject-publish-dlx: the refused publish is nacked and dead-lettered
    with reason "maxlen"."""
    conn = ctx.connect()
    ch, q, dlx, dlq = dl_setup(ctx, conn, {"x-max-length": 1, "x-overflow": "reject-publish-dlx"})
    out = {"confirms": _publish_all(ch, q, 3)}
    out["dlq"] = await_msgs(ctx, conn, dlq, 2)
    out["queue"] = bodies(ch, q)
    conn.close()
    return out


@scenario
def maxlen_bytes_drop_head(ctx):
    """x-max-length-bytes counts message bodies: 10-byte bodies and a
    25-byte limit keep two."""
    conn = ctx.connect()
    ch, q, dlx, dlq = dl_setup(ctx, conn, {"x-max-length-bytes": 25})
    for i in range(4):
        ch.basic_publish("", q, f"body-{i:05d}".encode(),
                         pika.BasicProperties(headers={"padding": "x" * 200}))
    dead = await_msgs(ctx, conn, dlq, 2)
    out = {"dlq": [m["body"] for m in dead],
           "dlq_reason": [m.get("headers", {}).get("x-first-death-reason") for m in dead]}
    out["queue"] = bodies(ch, q)
    conn.close()
    return out


@scenario
def maxlen_bytes_reject_publish(ctx):
    conn = ctx.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    q = ctx.name("q")
    ch.queue_declare(q, arguments={"x-max-length-bytes": 20, "x-overflow": "reject-publish"})
    out = {"confirms": [_publish_all(ch, q, 1, prefix=f"ten-bytes{i}")[0] for i in range(3)]}
    out["queue"] = bodies(ch, q)
    conn.close()
    return out


# --- delivery limit (quorum queues) ------------------------------------------


def _nack_until_dead(ctx, conn, q, dlq, limit=10):
    """Consumes q, nacking every delivery with requeue, until the message
    shows up on dlq (both consumers on one connection, so the wait is for
    whichever event comes next). Returns (deliveries on q, dlq messages)."""
    qch = conn.channel()
    qch.basic_qos(prefetch_count=1)
    qcol = Collector(conn, qch, q)
    dch = conn.channel()
    dcol = Collector(conn, dch, dlq, auto_ack=True)
    deliveries = []
    deadline = time.monotonic() + 20
    while not dcol.items and time.monotonic() < deadline and len(deliveries) <= limit:
        conn.process_data_events(time_limit=0.2)
        while qcol.items:
            m, p, b = qcol.items.pop(0)
            deliveries.append((m, p, b))
            qch.basic_nack(m.delivery_tag, requeue=True)
    return deliveries, dcol.items


@scenario
def quorum_delivery_limit_dead_letters(ctx):
    """x-delivery-limit 3 on a quorum queue: a message always nacked with
    requeue is delivered 4 times (3 redeliveries) and then dead-lettered.

    RabbitMQ 3.10 records the reason as "delivery_limit" too (rabbit_fifo
    discards it with that reason); the x-delivery-count header of the
    redeliveries is compared in quorum_delivery_count_header."""
    conn = ctx.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    dlq = ctx.name("dlq")
    ch.queue_declare(dlq)
    q = ctx.name("q")
    ch.queue_declare(q, durable=True, arguments={
        "x-queue-type": "quorum", "x-delivery-limit": 3,
        "x-dead-letter-exchange": "", "x-dead-letter-routing-key": dlq})
    ch.basic_publish("", q, b"poison", PERSISTENT)
    deliveries, dead = _nack_until_dead(ctx, conn, q, dlq)
    out = {"deliveries": [{"body": b.decode(), "redelivered": bool(m.redelivered)} for m, _, b in deliveries]}
    dead_recs = [dead_msg(ctx, *d) for d in dead]
    # x-delivery-count is carried on into the dead-lettered copy by
    # RabbitMQ; it is compared in its own scenario.
    for d in dead_recs:
        d.get("headers", {}).pop("x-delivery-count", None)
    out["dlq"] = dead_recs
    out["source_after"] = passive_count(conn, q)["messages"]
    conn.close()
    return out


@scenario
def quorum_delivery_count_header(ctx):
    """Quorum queues add x-delivery-count to redeliveries (not to the
    first delivery)."""
    conn = ctx.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    dlq = ctx.name("dlq")
    ch.queue_declare(dlq)
    q = ctx.name("q")
    ch.queue_declare(q, durable=True, arguments={
        "x-queue-type": "quorum", "x-delivery-limit": 2,
        "x-dead-letter-exchange": "", "x-dead-letter-routing-key": dlq})
    ch.basic_publish("", q, b"m0", PERSISTENT)
    deliveries, dead = _nack_until_dead(ctx, conn, q, dlq)
    out = {"delivery_count": [(p.headers or {}).get("x-delivery-count") for _, p, _ in deliveries],
           "dead_delivery_count": [(p.headers or {}).get("x-delivery-count") for _, p, _ in dead]}
    conn.close()
    return out


@scenario
def quorum_reject_without_requeue(ctx):
    """basic.reject without requeue on a quorum queue: reason "rejected",
    the delivery limit is not involved."""
    conn = ctx.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    dlq = ctx.name("dlq")
    ch.queue_declare(dlq)
    q = ctx.name("q")
    ch.queue_declare(q, durable=True, arguments={
        "x-queue-type": "quorum", "x-delivery-limit": 3,
        "x-dead-letter-exchange": "", "x-dead-letter-routing-key": dlq})
    ch.basic_publish("", q, b"m0", PERSISTENT)
    m = None
    for _ in range(100):  # a quorum queue's ready count lags the confirm
        m = ch.basic_get(q)[0]
        if m is not None:
            break
        time.sleep(0.05)
    if m is not None:
        ch.basic_reject(m.delivery_tag, requeue=False)
    out = {"got": m is not None, "dlq": await_msgs(ctx, conn, dlq, 1)}
    conn.close()
    return out


# --- invalid arguments --------------------------------------------------------


@scenario
def invalid_queue_arguments_406(ctx):
    """Wrong type or range of a queue argument: 406 PRECONDITION_FAILED at
    declare, channel closed, connection open."""
    conn = ctx.connect()
    cases = {
        "message_ttl_negative": {"x-message-ttl": -1},
        "message_ttl_string": {"x-message-ttl": "abc"},
        # pika cannot send a float; a decimal is the non-integer number it has.
        "message_ttl_decimal": {"x-message-ttl": decimal.Decimal("1.5")},
        "max_length_negative": {"x-max-length": -1},
        "max_length_string": {"x-max-length": "10"},
        "max_length_bytes_negative": {"x-max-length-bytes": -1},
        "overflow_bogus": {"x-overflow": "bogus"},
        "overflow_not_string": {"x-overflow": 1},
        "dlrk_without_dlx": {"x-dead-letter-routing-key": "k"},
        "dlx_not_string": {"x-dead-letter-exchange": 5},
        "expires_zero": {"x-expires": 0},
        "expires_negative": {"x-expires": -5},
        "queue_type_bogus": {"x-queue-type": "bogus"},
    }
    out = {}
    for label, args in cases.items():
        out[label] = expect_error(conn.channel().queue_declare, ctx.name(label), arguments=args)
    # Boundary values that are valid.
    out["message_ttl_zero"] = expect_error(lambda: conn.channel().queue_declare(
        ctx.name("ttl0"), arguments={"x-message-ttl": 0}) and "ok")
    out["max_length_zero"] = expect_error(lambda: conn.channel().queue_declare(
        ctx.name("len0"), arguments={"x-max-length": 0}) and "ok")
    out["connection_open"] = conn.is_open
    conn.close()
    return out


@scenario
def invalid_quorum_arguments_406(ctx):
    conn = ctx.connect()
    base = {"x-queue-type": "quorum"}
    # Not compared: x-delivery-limit "abc". RabbitMQ 3.10 accepts any type
    # there (and then has no limit); Weir refuses it with 406 like every
    # other mistyped argument (issue 7 item 6).
    cases = {
        "overflow_bogus": {"x-overflow": "bogus"},
        "non_durable": dict(durable=False),
        "exclusive": dict(durable=True, exclusive=True),
        "auto_delete": dict(durable=True, auto_delete=True),
    }
    out = {}
    for label, args in cases.items():
        if "durable" in args:
            out[label] = expect_error(conn.channel().queue_declare, ctx.name(label), arguments=base, **args)
        else:
            out[label] = expect_error(conn.channel().queue_declare, ctx.name(label), durable=True,
                                      arguments={**base, **args})
    out["connection_open"] = conn.is_open
    conn.close()
    return out
