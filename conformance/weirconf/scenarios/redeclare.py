"""Redeclaring a queue with issue 7's arguments: which differences are
inequivalent (406 PRECONDITION_FAILED) and which are accepted.

RabbitMQ compares a redeclare's arguments with the declared ones (never
with what a policy adds) for a fixed list of keys; the rest are ignored.
"""
from ..harness import scenario
from ..observe import expect_error


def _redeclare(ctx, conn, tag, first: dict, then: dict, durable=False) -> dict:
    q = ctx.name(tag)
    conn.channel().queue_declare(q, durable=durable, arguments=first)
    return {
        "same": expect_error(lambda: conn.channel().queue_declare(q, durable=durable, arguments=first) and "ok"),
        "different": expect_error(conn.channel().queue_declare, q, durable=durable, arguments=then),
    }


@scenario
def redeclare_limit_and_dead_letter_arguments(ctx):
    """x-max-length, x-max-length-bytes, x-overflow, x-dead-letter-exchange,
    x-dead-letter-routing-key, x-expires, x-max-priority and
    x-single-active-consumer: a different value (or a missing one) is 406."""
    conn = ctx.connect()
    dlx = {"x-dead-letter-exchange": "a"}
    out = {
        "max_length": _redeclare(ctx, conn, "len", {"x-max-length": 1}, {"x-max-length": 2}),
        "max_length_bytes": _redeclare(ctx, conn, "bytes", {"x-max-length-bytes": 1}, {"x-max-length-bytes": 2}),
        "overflow": _redeclare(ctx, conn, "ovf", {"x-overflow": "drop-head"}, {"x-overflow": "reject-publish"}),
        "dlx": _redeclare(ctx, conn, "dlx", dlx, {"x-dead-letter-exchange": "b"}),
        "dlrk": _redeclare(ctx, conn, "dlrk", {**dlx, "x-dead-letter-routing-key": "k"}, dlx),
        "expires": _redeclare(ctx, conn, "exp", {"x-expires": 60000}, {"x-expires": 70000}),
        "max_priority": _redeclare(ctx, conn, "prio", {"x-max-priority": 5}, {"x-max-priority": 6}),
        "sac": _redeclare(ctx, conn, "sac", {"x-single-active-consumer": True}, {}),
    }
    conn.close()
    return out


@scenario
def redeclare_quorum_delivery_limit(ctx):
    """A quorum queue redeclared with another x-delivery-limit is
    inequivalent (406), as RabbitMQ 3.10 checks it."""
    conn = ctx.connect()
    qq = {"x-queue-type": "quorum"}
    out = _redeclare(ctx, conn, "qq", {**qq, "x-delivery-limit": 3}, {**qq, "x-delivery-limit": 5}, durable=True)
    conn.close()
    return out
