"""Weir-only scenarios: features RabbitMQ 3.10 (the reference) lacks.

Each is registered with ``weir_only(why, expect)``: it runs against Weir
alone and passes when its transcript equals ``expect``. The transcript is
reduced to facts that do not depend on timing (counts, "in publish order",
reasons), never to which consumer got what.

* ordering keys and partitioned queues (``x-partitions``,
  ``x-ordering-key``): per-key order across several consumers that nack;
* TTL without head-of-line blocking (RabbitMQ expires only at the head);
* a delivery limit on classic queues and the quorum default of 20
  (RabbitMQ 4's, not 3.10's);
* delayed delivery (``x-delayed-message`` exchanges, ``x-delayed`` queues)
  and delayed retries (``x-delayed-retry-*``).
"""
import random
import time

import pika

from ..harness import weir_only
from ..observe import bodies, expect_error
from .deadletter import PERSISTENT, _nack_until_dead, await_msgs

def text(v):
    """A header value as text (pika gives long strings as str or bytes)."""
    return v.decode(errors="replace") if isinstance(v, bytes) else v


# --- ordering keys -------------------------------------------------------------

KEYS = 8
PER_KEY = 50
CONSUMERS = 3


@weir_only(
    "RabbitMQ 3.10 has no partitioned queues or ordering keys",
    expect={
        "messages": KEYS * PER_KEY,
        "acked_once_each": True,
        "keys_in_publish_order": KEYS,
        "nacked": True,
        "redelivered_after_nack": True,
    },
)
def ordering_keys_per_key_order_with_nacks(ctx):
    """x-partitions 4, 8 ordering keys, 3 consumers (one connection each,
    prefetch 4) that nack with requeue 10% of the deliveries at random:
    every key's messages are acknowledged in publish order, each exactly
    once. (No order across keys is promised, and none is checked.)"""
    conn = ctx.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    q = ctx.name("q")
    ch.queue_declare(q, arguments={"x-partitions": 4})
    for i in range(PER_KEY):
        for k in range(KEYS):
            ch.basic_publish("", q, f"k{k}:{i}".encode(),
                             pika.BasicProperties(headers={"x-ordering-key": f"key-{k}"}))
    rng = random.Random(7)
    acked: dict[str, list[int]] = {f"k{k}": [] for k in range(KEYS)}
    stats = {"nacks": 0, "redelivered": 0}
    consumers = []
    for _ in range(CONSUMERS):
        c = ctx.connect()
        cch = c.channel()
        cch.basic_qos(prefetch_count=4)

        def on_message(chan, method, props, body, _stats=stats):
            key, i = body.decode().split(":")
            if method.redelivered:
                _stats["redelivered"] += 1
            if rng.random() < 0.1:
                _stats["nacks"] += 1
                chan.basic_nack(method.delivery_tag, requeue=True)
            else:
                acked[key].append(int(i))
                chan.basic_ack(method.delivery_tag)

        cch.basic_consume(q, on_message)
        consumers.append(c)
    total = KEYS * PER_KEY
    deadline = time.monotonic() + 40
    while sum(map(len, acked.values())) < total and time.monotonic() < deadline:
        for c in consumers:
            c.process_data_events(time_limit=0.01)
    for c in consumers:
        c.close()
    conn.close()
    in_order = sum(1 for v in acked.values() if v == list(range(PER_KEY)))
    return {
        "messages": sum(map(len, acked.values())),
        "acked_once_each": all(sorted(v) == list(range(PER_KEY)) for v in acked.values()),
        "keys_in_publish_order": in_order,
        "nacked": stats["nacks"] > 0,
        "redelivered_after_nack": stats["redelivered"] > 0,
    }


@weir_only(
    "RabbitMQ 3.10 ignores x-partitions",
    expect={
        "string": {"code": 406, "error": "channel_closed", "name": "PRECONDITION_FAILED"},
        "zero": {"code": 406, "error": "channel_closed", "name": "PRECONDITION_FAILED"},
        "too_many": {"code": 406, "error": "channel_closed", "name": "PRECONDITION_FAILED"},
        "max": {"ok": True, "result": "Method"},
        "without_key_round_robin": ["m0", "m1", "m2", "m3"],
    },
)
def ordering_partitions_argument(ctx):
    """x-partitions is an integer from 1 to 256 (406 otherwise). Messages
    without an ordering key go round robin over the partitions; a single
    consumer of a partitioned queue still gets all of them."""
    conn = ctx.connect()
    out = {}
    for tag, v in (("string", "4"), ("zero", 0), ("too_many", 257), ("max", 256)):
        out[tag] = expect_error(conn.channel().queue_declare, ctx.name(tag), arguments={"x-partitions": v})
    ch = conn.channel()
    ch.confirm_delivery()
    q = ctx.name("rr")
    ch.queue_declare(q, arguments={"x-partitions": 2})
    for i in range(4):
        ch.basic_publish("", q, f"m{i}".encode())
    out["without_key_round_robin"] = sorted(bodies(ch, q))
    conn.close()
    return out


# --- TTL without head-of-line blocking -----------------------------------------


@weir_only(
    "RabbitMQ 3.10 expires messages only at the head of the queue",
    expect={
        "dead": [{"body": "short", "reason": "expired"}],
        "left": ["long"],
    },
)
def ttl_expires_behind_a_longer_lived_message(ctx):
    """A message with a 100 ms expiration queued behind one with an hour's
    is dead-lettered on time (RabbitMQ would hold it until the first
    leaves); the long-lived one stays."""
    conn = ctx.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    dlx, dlq = ctx.xname("dlx"), ctx.name("dlq")
    ch.exchange_declare(dlx, "fanout")
    ch.queue_declare(dlq)
    ch.queue_bind(dlq, dlx)
    q = ctx.name("q")
    ch.queue_declare(q, arguments={"x-dead-letter-exchange": dlx})
    ch.basic_publish("", q, b"long", pika.BasicProperties(expiration="3600000"))
    ch.basic_publish("", q, b"short", pika.BasicProperties(expiration="100"))
    dead = await_msgs(ctx, conn, dlq, 1)
    out = {"dead": [{"body": d["body"], "reason": d["headers"]["x-first-death-reason"]} for d in dead]}
    out["left"] = bodies(ch, q)
    conn.close()
    return out


# --- delivery limits RabbitMQ 3.10 lacks --------------------------------------


@weir_only(
    "RabbitMQ 3.10 has x-delivery-limit on quorum queues only",
    expect={
        "deliveries": [[False, None], [True, 1], [True, 2]],
        "dead": [{"body": "poison", "reason": "delivery_limit"}],
        "source_after": [],
    },
)
def delivery_limit_on_a_classic_queue(ctx):
    """x-delivery-limit 2 on a classic queue: a message always nacked with
    requeue is delivered 3 times (redeliveries carry x-delivery-count 1,
    2) and then dead-lettered with reason delivery_limit."""
    conn = ctx.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    dlq = ctx.name("dlq")
    ch.queue_declare(dlq)
    q = ctx.name("q")
    ch.queue_declare(q, durable=True, arguments={
        "x-delivery-limit": 2, "x-dead-letter-exchange": "", "x-dead-letter-routing-key": dlq})
    ch.basic_publish("", q, b"poison", PERSISTENT)
    deliveries, dead = _nack_until_dead(ctx, conn, q, dlq)
    out = {
        "deliveries": [[bool(m.redelivered), (p.headers or {}).get("x-delivery-count")]
                       for m, p, _ in deliveries],
        "dead": [{"body": b.decode(), "reason": text(p.headers.get("x-first-death-reason"))}
                 for _, p, b in dead],
        "source_after": bodies(ch, q),
    }
    conn.close()
    return out


@weir_only(
    "RabbitMQ 3.10's quorum queues have no default delivery limit (RabbitMQ 4: 20)",
    expect={"deliveries": 21, "dead": ["poison"]},
)
def quorum_default_delivery_limit_is_20(ctx):
    """A quorum queue without x-delivery-limit: a message nacked with
    requeue every time is delivered 21 times, then dead-lettered."""
    conn = ctx.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    dlq = ctx.name("dlq")
    ch.queue_declare(dlq)
    q = ctx.name("q")
    ch.queue_declare(q, durable=True, arguments={
        "x-queue-type": "quorum", "x-dead-letter-exchange": "", "x-dead-letter-routing-key": dlq})
    ch.basic_publish("", q, b"poison", PERSISTENT)
    deliveries, dead = _nack_until_dead(ctx, conn, q, dlq, limit=30)
    out = {"deliveries": len(deliveries), "dead": [b.decode() for _, _, b in dead]}
    conn.close()
    return out


# --- delayed delivery and delayed retries ----------------------------------------


@weir_only(
    "RabbitMQ 3.10 has no delayed delivery without the delayed-message plugin",
    expect={
        "held_at_first": 0,
        "arrived_in_due_order": ["short", "long"],
        "not_before_delay": True,
        "no_delay_at_once": ["now"],
        "x_delayed_queue": ["queued"],
        "missing_type": 406,
    },
)
def delayed_message_exchange_and_queue(ctx):
    """An x-delayed-message exchange (x-delayed-type direct) holds messages
    for their x-delay and lets them in in due-time order; a message without
    x-delay passes at once; a queue declared x-delayed honours the header on
    the default exchange; a missing x-delayed-type is 406."""
    conn = ctx.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    x = ctx.xname("delays")
    ch.exchange_declare(x, "x-delayed-message", arguments={"x-delayed-type": "direct"})
    q = ctx.name("q")
    ch.queue_declare(q)
    ch.queue_bind(q, x, routing_key="k")
    start = time.monotonic()
    ch.basic_publish(x, "k", b"long", pika.BasicProperties(headers={"x-delay": 600}))
    ch.basic_publish(x, "k", b"short", pika.BasicProperties(headers={"x-delay": 300}))
    out = {"held_at_first": ch.queue_declare(q, passive=True).method.message_count}
    got = await_msgs(ctx, conn, q, 2)
    out["arrived_in_due_order"] = [m["body"] for m in got]
    out["not_before_delay"] = time.monotonic() - start >= 0.6
    ch.basic_publish(x, "k", b"now", pika.BasicProperties(headers={}))
    out["no_delay_at_once"] = bodies(ch, q)
    dq = ctx.name("dq")
    ch.queue_declare(dq, arguments={"x-delayed": True})
    ch.basic_publish("", dq, b"queued", pika.BasicProperties(headers={"x-delay": 200}))
    out["x_delayed_queue"] = [m["body"] for m in await_msgs(ctx, conn, dq, 1)]
    out["missing_type"] = expect_error(conn.channel().exchange_declare, ctx.xname("bad"),
                                       "x-delayed-message").get("code")
    conn.close()
    return out


@weir_only(
    "RabbitMQ 3.10 has no delayed retries (RabbitMQ 4.3's x-delayed-retry-*)",
    expect={
        "back_at_once": False,
        "waited_min": True,
        "redelivered": True,
        "bad_type": 406,
    },
)
def delayed_retry_after_nack(ctx):
    """A queue with x-delayed-retry-type failed and a 300 ms minimum: a
    nacked message does not come back at once, comes back after the
    delay, redelivered; an unknown retry type is 406."""
    conn = ctx.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    q = ctx.name("q")
    ch.queue_declare(q, arguments={"x-delayed-retry-type": "failed", "x-delayed-retry-min": 300})
    ch.basic_publish("", q, b"m")
    m, _, _ = ch.basic_get(q)
    start = time.monotonic()
    ch.basic_nack(m.delivery_tag, requeue=True)
    out = {"back_at_once": ch.basic_get(q, auto_ack=True)[0] is not None}
    c2 = conn.channel()
    got = []
    c2.basic_consume(q, lambda c, meth, p, b: got.append(meth.redelivered), auto_ack=True)
    deadline = time.monotonic() + 10
    while not got and time.monotonic() < deadline:
        conn.process_data_events(time_limit=0.05)
    out["waited_min"] = time.monotonic() - start >= 0.3
    out["redelivered"] = got == [True]
    out["bad_type"] = expect_error(conn.channel().queue_declare, ctx.name("bad"),
                                   arguments={"x-delayed-retry-type": "sometimes"}).get("code")
    conn.close()
    return out
