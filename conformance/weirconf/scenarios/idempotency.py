"""Idempotent publish (issue 7, item 10): Weir only.

RabbitMQ 3.10 has no idempotent publish (only the third-party
message-deduplication plugin, with other argument names), so these run
against Weir alone and compare with the transcript they expect
(``harness.weir_only``).

A message carrying the header ``x-idempotency-key`` (or its ``message-id``
property in a queue declared with ``x-dedup-on-message-id: true``) is
enqueued at most once per queue within ``x-dedup-window`` ms (default two
minutes); a duplicate is confirmed (basic.ack, never basic.return) and
dropped. Restart and ``kill -9`` are covered by tests/tests/idempotency.rs.
"""
import time

import pika
import pika.exceptions as px

from ..harness import weir_only
from ..observe import bodies, expect_error, passive_count

WHY = "RabbitMQ 3.10 has no idempotent publish (x-idempotency-key, x-dedup-*)"


def keyed(key, **kw):
    return pika.BasicProperties(delivery_mode=2, headers={"x-idempotency-key": key}, **kw)


def confirm(ch, queue, body, props, exchange=""):
    """Publish mandatory with confirms; what the publisher was told."""
    try:
        ch.basic_publish(exchange, queue, body.encode(), props, mandatory=True)
        return "ack"
    except px.UnroutableError:
        return "returned"
    except px.NackError:
        return "nack"


@weir_only(
    WHY,
    expect={
        "same_key_three_times": ["ack", "ack", "ack"],
        "other_key": "ack",
        "without_key_twice": ["ack", "ack"],
        "queued": ["k1", "k2", "plain", "plain"],
        "after_consumed": {"told": "ack", "queued": 0},
    },
)
def idempotency_duplicates_are_confirmed_and_dropped(ctx):
    """Three publishes with one key: all acked (mandatory, never returned),
    one enqueued. The receipt outlives the consumed message."""
    conn = ctx.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    q = ctx.name("q")
    ch.queue_declare(q, durable=True)
    out = {
        "same_key_three_times": [confirm(ch, q, "k1", keyed("k1")) for _ in range(3)],
        "other_key": confirm(ch, q, "k2", keyed("k2")),
        "without_key_twice": [confirm(ch, q, "plain", pika.BasicProperties(delivery_mode=2))
                              for _ in range(2)],
    }
    out["queued"] = sorted(bodies(ch, q))
    told = confirm(ch, q, "k1", keyed("k1"))
    out["after_consumed"] = {"told": told, "queued": passive_count(conn, q)["messages"]}
    conn.close()
    return out


@weir_only(
    WHY,
    expect={
        "by_id": ["m1", "m2", "none", "none"],
        "plain": ["m1", "m1", "m2", "none", "none"],
        "header_wins": {"by_id": 1, "plain": 1},
    },
)
def idempotency_message_id_where_the_queue_asks(ctx):
    """Through a fanout to a queue with x-dedup-on-message-id and one
    without: message-id deduplicates only in the first. The header is a key
    everywhere (and wins over message-id)."""
    conn = ctx.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    x = ctx.xname("fan")
    ch.exchange_declare(x, "fanout")
    by_id, plain = ctx.name("by-id"), ctx.name("plain")
    ch.queue_declare(by_id, durable=True, arguments={"x-dedup-on-message-id": True})
    ch.queue_declare(plain, durable=True)
    for q in (by_id, plain):
        ch.queue_bind(q, x)
    for mid in ("m1", "m1", "m2"):
        confirm(ch, "", mid, pika.BasicProperties(delivery_mode=2, message_id=mid), exchange=x)
    for _ in range(2):
        confirm(ch, "", "none", pika.BasicProperties(delivery_mode=2), exchange=x)
    out = {"by_id": sorted(bodies(ch, by_id)), "plain": sorted(bodies(ch, plain))}
    confirm(ch, "", "h", keyed("h", message_id="x1"), exchange=x)
    confirm(ch, "", "h", keyed("h", message_id="x2"), exchange=x)
    out["header_wins"] = {"by_id": len(bodies(ch, by_id)), "plain": len(bodies(ch, plain))}
    conn.close()
    return out


@weir_only(
    WHY,
    expect={
        "seen_by_a_only": {"told": "ack", "a": 1, "b": 1},
        "duplicate_everywhere": {"told": "ack", "a": 1, "b": 1},
    },
)
def idempotency_is_per_queue(ctx):
    """A key seen by queue a is dropped there and enqueued in b; a
    duplicate in every queue is still acked, never returned (mandatory)."""
    conn = ctx.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    x = ctx.xname("fan")
    ch.exchange_declare(x, "fanout")
    a, b = ctx.name("a"), ctx.name("b")
    for q in (a, b):
        ch.queue_declare(q, durable=True)
        ch.queue_bind(q, x)
    confirm(ch, a, "k", keyed("k"))
    out = {}
    for step in ("seen_by_a_only", "duplicate_everywhere"):
        told = confirm(ch, "", "k", keyed("k"), exchange=x)
        out[step] = {"told": told, "a": passive_count(conn, a)["messages"],
                     "b": passive_count(conn, b)["messages"]}
    conn.close()
    return out


WINDOW_MS = 1000


@weir_only(
    WHY,
    expect={"within_window": 1, "after_window": 2},
)
def idempotency_window_ends(ctx):
    """With x-dedup-window 1000 ms, the key is new again once the window
    has passed."""
    conn = ctx.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    q = ctx.name("q")
    ch.queue_declare(q, arguments={"x-dedup-window": WINDOW_MS})
    start = time.monotonic()
    confirm(ch, q, "k", keyed("k"))
    confirm(ch, q, "k", keyed("k"))
    within = passive_count(conn, q)["messages"]
    if time.monotonic() - start > WINDOW_MS / 1000 * 0.8:
        within = "too slow to tell"
    # Nothing to await but the clock: the window is the feature.
    time.sleep(max(0.0, WINDOW_MS / 1000 + 0.2 - (time.monotonic() - start)))
    confirm(ch, q, "k", keyed("k"))
    out = {"within_window": within, "after_window": passive_count(conn, q)["messages"]}
    conn.close()
    return out


@weir_only(
    WHY,
    expect={
        "window_string": {"code": 406, "error": "channel_closed", "name": "PRECONDITION_FAILED"},
        "window_zero": {"code": 406, "error": "channel_closed", "name": "PRECONDITION_FAILED"},
        "window_negative": {"code": 406, "error": "channel_closed", "name": "PRECONDITION_FAILED"},
        "window_too_long": {"code": 406, "error": "channel_closed", "name": "PRECONDITION_FAILED"},
        "on_message_id_string": {"code": 406, "error": "channel_closed", "name": "PRECONDITION_FAILED"},
        "valid": {"ok": True, "result": "Method"},
    },
)
def idempotency_arguments_are_checked(ctx):
    """x-dedup-window is an integer from 1 to 2^32-1 ms, x-dedup-on-message-id
    a boolean; anything else is refused with 406, as RabbitMQ refuses its
    own arguments of the wrong type or range."""
    conn = ctx.connect()
    out = {}
    for tag, args in (
        ("window_string", {"x-dedup-window": "60000"}),
        ("window_zero", {"x-dedup-window": 0}),
        ("window_negative", {"x-dedup-window": -1}),
        ("window_too_long", {"x-dedup-window": 2 ** 32}),
        ("on_message_id_string", {"x-dedup-on-message-id": "yes"}),
        ("valid", {"x-dedup-window": 5000, "x-dedup-on-message-id": True}),
    ):
        out[tag] = expect_error(conn.channel().queue_declare, ctx.name(tag), arguments=args)
    conn.close()
    return out
