"""Who receives: single active consumer, consumer priorities (x-priority),
priority queues (x-max-priority and the message priority property)."""
import pika

from ..harness import scenario
from ..observe import Collector, bodies, drain, error_record, expect_error, passive_count


def _body(item) -> str:
    method, _props, body = item
    return body.decode() + ("*" if method.redelivered else "")


def _bodies(items) -> list[str]:
    return [_body(i) for i in items]


def _consume(conn, q, **kw):
    """basic.consume on a fresh channel: "ok" or the error record (the
    generated consumer tag is never recorded)."""
    try:
        conn.channel().basic_consume(q, lambda *a: None, **kw)
    except Exception as e:
        return error_record(e)
    return "ok"


def _publish(conn, q, names, priorities=None):
    """Publish confirmed messages (one by one, so each is enqueued before
    the next), with the given priorities if any."""
    ch = conn.channel()
    ch.confirm_delivery()
    for i, n in enumerate(names):
        props = None
        if priorities is not None:
            props = pika.BasicProperties(priority=priorities[i])
        ch.basic_publish("", q, n.encode(), props)
    ch.close()


# ----- single active consumer -----

SAC = {"x-single-active-consumer": True}


@scenario
def sac_second_consumer_idle_until_first_cancels(ctx):
    conn = ctx.connect()
    q = ctx.name("sac")
    conn.channel().queue_declare(q, arguments=SAC)
    _publish(conn, q, ["m0", "m1", "m2"])
    ch1, ch2 = conn.channel(), conn.channel()
    first = Collector(conn, ch1, q)
    # Accepted although another is active; a higher priority does not take over.
    second = Collector(conn, ch2, q, arguments={"x-priority": 10})
    out = {"first": _bodies(first.wait_for(3))}
    out["second_while_first_active"] = second.quiet(0.5)
    out["declare_ok"] = passive_count(conn, q)
    _publish(conn, q, ["m3"])
    out["first_more"] = _bodies(first.wait_for(1))
    out["second_still"] = second.quiet(0.3)
    # Cancelled with four unacknowledged: the second is active at once.
    ch1.basic_cancel(first.tag)
    _publish(conn, q, ["m4"])
    out["second_after_cancel"] = _bodies(second.wait_for(1))
    # The first channel closes: its unacknowledged messages go to the new
    # active consumer, in their order, redelivered.
    ch1.close()
    out["second_after_close"] = _bodies(second.wait_for(4))
    out["extra"] = second.quiet(0.3)
    conn.close()
    return out


@scenario
def sac_failover_when_the_connection_goes(ctx):
    a = ctx.connect()
    b = ctx.connect()
    q = ctx.name("sac")
    a.channel().queue_declare(q, arguments=SAC)
    cha = a.channel()
    cha.basic_qos(prefetch_count=2)
    first = Collector(a, cha, q)
    second = Collector(b, b.channel(), q)
    _publish(b, q, ["m0", "m1", "m2", "m3"])
    out = {"first": _bodies(first.wait_for(2))}
    # The active one out of credit: the idle one still gets nothing.
    out["second_while_first_blocked"] = second.quiet(0.5)
    cha.basic_ack(0, multiple=True)
    out["first_after_ack"] = _bodies(first.wait_for(2))
    a.close()
    out["second_after_close"] = _bodies(second.wait_for(2))
    out["extra"] = second.quiet(0.3)
    b.close()
    return out


@scenario
def sac_exclusive_consume_refused(ctx):
    conn = ctx.connect()
    q = ctx.name("sac")
    conn.channel().queue_declare(q, arguments=SAC)
    out = {"exclusive_on_empty": _consume(conn, q, exclusive=True)}
    out["plain"] = _consume(conn, q)
    out["exclusive_with_consumer"] = _consume(conn, q, exclusive=True)
    out["declare_ok"] = passive_count(conn, q)
    conn.close()
    return out


# ----- consumer priorities -----

@scenario
def consumer_priority_high_gets_all_while_it_has_credit(ctx):
    conn = ctx.connect()
    q = ctx.name("q")
    conn.channel().queue_declare(q)
    ch_lo = conn.channel()
    lo = Collector(conn, ch_lo, q)  # registered first, default priority 0
    ch_hi = conn.channel()
    ch_hi.basic_qos(prefetch_count=2)
    hi = Collector(conn, ch_hi, q, arguments={"x-priority": 10})
    _publish(conn, q, [f"m{i}" for i in range(5)])
    out = {"hi": _bodies(hi.wait_for(2)), "lo": _bodies(lo.wait_for(3))}
    # Credit back; published on the same channel, so after the ack.
    ch_hi.basic_ack(0, multiple=True)
    ch_hi.basic_publish("", q, b"m5")
    ch_hi.basic_publish("", q, b"m6")
    ch_hi.basic_publish("", q, b"m7")
    out["hi_after_ack"] = _bodies(hi.wait_for(2))
    out["lo_after_ack"] = _bodies(lo.wait_for(1))
    conn.close()
    return out


@scenario
def consumer_priority_round_robin_among_equals(ctx):
    conn = ctx.connect()
    q = ctx.name("q")
    conn.channel().queue_declare(q)
    low = Collector(conn, conn.channel(), q, auto_ack=True, arguments={"x-priority": -1})
    a = Collector(conn, conn.channel(), q, auto_ack=True, arguments={"x-priority": 5})
    b = Collector(conn, conn.channel(), q, auto_ack=True, arguments={"x-priority": 5})
    _publish(conn, q, [f"m{i}" for i in range(6)])
    out = {"a": _bodies(a.wait_for(3)), "b": _bodies(b.wait_for(3))}
    out["low"] = low.quiet(0.3)
    conn.close()
    return out


@scenario
def consumer_priority_must_be_an_integer(ctx):
    conn = ctx.connect()
    q = ctx.name("q")
    conn.channel().queue_declare(q)
    out = {}
    # (pika cannot encode a float in a table.)
    for name, value in [("string", "10"), ("bool", True),
                        ("negative", -7), ("large", 2**40)]:
        out[name] = _consume(conn, q, arguments={"x-priority": value})
    # A missing queue is reported before a bad argument.
    out["missing_queue"] = _consume(conn, ctx.name("absent"), arguments={"x-priority": "x"})
    conn.close()
    return out


# ----- priority queues -----

@scenario
def priority_queue_strict_order_fifo_within_level(ctx):
    conn = ctx.connect()
    q = ctx.name("pq")
    ch = conn.channel()
    ch.queue_declare(q, arguments={"x-max-priority": 10})
    prios = [0, 5, 9, 5, 0, 9, 3, 1, 9, 0, 10, 200, 7]
    _publish(conn, q, [f"p{p}-{i}" for i, p in enumerate(prios)], prios)
    out = {"get_order": bodies(ch, q)}
    # The same through a consumer with prefetch 1.
    _publish(conn, q, [f"p{p}-{i}" for i, p in enumerate(prios)], prios)
    ch.basic_qos(prefetch_count=1)
    col = Collector(conn, ch, q)
    got = []
    for _ in prios:
        item = col.wait_for(1)
        got.extend(_bodies(item))
        if item:
            ch.basic_ack(item[0][0].delivery_tag)
    out["consume_order"] = got
    conn.close()
    return out


@scenario
def priority_queue_above_max_counts_as_max(ctx):
    conn = ctx.connect()
    q = ctx.name("pq")
    ch = conn.channel()
    ch.queue_declare(q, arguments={"x-max-priority": 5})
    _publish(conn, q, ["a5", "b9", "c1", "d255", "e5", "f0"], [5, 9, 1, 255, 5, 0])
    out = {"order": bodies(ch, q)}
    # Without x-max-priority the property is ignored: FIFO.
    plain = ctx.name("plain")
    ch.queue_declare(plain)
    _publish(conn, plain, ["a", "b", "c"], [0, 9, 3])
    out["plain"] = bodies(ch, plain)
    conn.close()
    return out


@scenario
def priority_queue_requeue_returns_to_place_in_level(ctx):
    conn = ctx.connect()
    q = ctx.name("pq")
    ch = conn.channel()
    ch.queue_declare(q, arguments={"x-max-priority": 9})
    _publish(conn, q, ["c1", "c2", "c3", "h1"], [5, 5, 5, 9])
    ch.basic_qos(prefetch_count=3)
    col = Collector(conn, ch, q)
    got = col.wait_for(3)
    out = {"delivered": _bodies(got)}
    tags = {b.decode(): m.delivery_tag for m, _p, b in got}
    ch.basic_cancel(col.tag)
    _publish(conn, q, ["h2", "c4"], [9, 5])
    # Requeued out of order: each goes back to its own place in its level.
    for name in ["c2", "h1", "c1"]:
        ch.basic_nack(tags[name], requeue=True)
    # Gets on the same channel follow the nacks.
    out["after_requeue"] = [m["body"] + ("*" if m["redelivered"] else "") for m in drain(ch, q)]
    conn.close()
    return out


@scenario
def priority_queue_max_priority_argument_checked(ctx):
    conn = ctx.connect()
    out = {}
    for name, value in [("string", "10"), ("negative", -1), ("too_big", 256), ("zero", 0),
                        ("one", 1), ("max", 255)]:
        q = ctx.name(f"pq-{name}")
        out[name] = expect_error(conn.channel().queue_declare, q,
                                 arguments={"x-max-priority": value})
    conn.close()
    return out
