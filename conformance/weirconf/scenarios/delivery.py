"""Publisher confirms, returns, basic.get, acknowledgement modes, prefetch."""
import pika
import pika.exceptions as px

from ..harness import scenario
from ..observe import Collector, bodies, drain, error_record, msg, reply_name

PERSISTENT = pika.BasicProperties(delivery_mode=2)


def _setup_queue(ctx, conn, n=0, tag="q"):
    """Declare a queue and put n messages m0..m{n-1} in it (confirmed)."""
    ch = conn.channel()
    ch.confirm_delivery()
    q = ctx.name(tag)
    ch.queue_declare(q)
    for i in range(n):
        ch.basic_publish("", q, f"m{i}".encode())
    return ch, q


@scenario
def publisher_confirms(ctx):
    conn = ctx.connect()
    ch = conn.channel()
    ok = ch.confirm_delivery()
    q = ctx.name("q")
    ch.queue_declare(q, durable=True)
    out = {"confirm_select": "ok" if ok is None else str(ok)}
    results = []
    for i in range(3):
        # BlockingChannel.basic_publish returns once basic.ack arrives and
        # raises NackError on basic.nack.
        try:
            ch.basic_publish("", q, f"p{i}".encode(), PERSISTENT)
            results.append("ack")
        except px.NackError:
            results.append("nack")
    # Unroutable without mandatory is still confirmed (acked) by the broker.
    ch.basic_publish("", ctx.name("nowhere-not-declared"), b"lost")
    results.append("unroutable-ack")
    out["results"] = results
    out["queued"] = bodies(ch, q)
    conn.close()
    return out


@scenario
def mandatory_unroutable_returns(ctx):
    """basic.return 312 NO_ROUTE, observed both with and without confirms."""
    conn = ctx.connect()
    x = ctx.xname("x")
    out = {}

    ch = conn.channel()
    ch.exchange_declare(x, "direct")
    returned = []
    ch.add_on_return_callback(
        lambda c, method, props, body: returned.append(
            {"code": method.reply_code, "name": reply_name(method.reply_text),
             "exchange_is_x": method.exchange == x, "routing_key": method.routing_key,
             "body": body.decode()}))
    ch.basic_publish(x, "no-binding", b"ret-1", mandatory=True)
    # A synchronous round trip on the same channel: the broker sends the
    # return before the reply, and pika dispatches buffered returns on the
    # next process_data_events.
    ch.exchange_declare(x, "direct", passive=True)
    conn.process_data_events(time_limit=0)
    out["without_confirms"] = returned

    cch = conn.channel()
    cch.confirm_delivery()
    try:
        cch.basic_publish(x, "no-binding", b"ret-2", mandatory=True)
        out["with_confirms"] = "no error"
    except px.UnroutableError as e:
        out["with_confirms"] = [
            {"code": m.method.reply_code, "name": reply_name(m.method.reply_text), "body": m.body.decode()}
            for m in e.messages]
    # Routable + mandatory: no return.
    q = ctx.name("q")
    cch.queue_declare(q)
    cch.queue_bind(q, x, routing_key="bound")
    cch.basic_publish(x, "bound", b"routed", mandatory=True)
    out["routed"] = bodies(cch, q)
    conn.close()
    return out


@scenario
def basic_get_counts(ctx):
    conn = ctx.connect()
    ch, q = _setup_queue(ctx, conn, n=3)
    out = {"gets": []}
    for _ in range(4):
        method, props, body = ch.basic_get(q, auto_ack=False)
        if method is None:
            out["gets"].append("get-empty")
        else:
            rec = msg(method, props, body)
            rec["message_count"] = method.message_count
            rec["tag"] = method.delivery_tag
            out["gets"].append(rec)
    ch.basic_ack(0, multiple=True)  # tag 0 + multiple = everything outstanding
    ch.close()
    ch2 = conn.channel()
    m, _, _ = ch2.basic_get(q)
    out["after_ack_all"] = "get-empty" if m is None else "not empty"
    conn.close()
    return out


@scenario
def reject_nack_requeue_order(ctx):
    """Requeued messages come back redelivered, in their original positions
    (ahead of never-delivered ones), whatever order they were requeued in."""
    conn = ctx.connect()
    ch, q = _setup_queue(ctx, conn, n=4)
    gets = [ch.basic_get(q) for _ in range(3)]  # m0, m1, m2 unacked
    ch.basic_reject(gets[2][0].delivery_tag, requeue=True)          # m2
    ch.basic_nack(gets[0][0].delivery_tag, multiple=False, requeue=True)  # m0
    ch.basic_ack(gets[1][0].delivery_tag)                             # m1
    out = {"after_requeue": drain(ch, q)}
    conn.close()
    return out


@scenario
def consumer_nack_redelivers(ctx):
    conn = ctx.connect()
    _, q = _setup_queue(ctx, conn, n=2)
    ch = conn.channel()
    ch.basic_qos(prefetch_count=1)
    col = Collector(conn, ch, q)
    seen = []
    # nack the first delivery once, then ack everything.
    for _ in range(3):
        got = col.wait_for(1)
        if not got:
            seen.append("timeout")
            break
        m, p, b = got[0]
        rec = msg(m, p, b)
        seen.append(rec)
        if b == b"m0" and not m.redelivered:
            ch.basic_nack(m.delivery_tag, requeue=True)
        else:
            ch.basic_ack(m.delivery_tag)
    conn.close()
    return {"deliveries": seen}


@scenario
def reject_without_requeue_drops(ctx):
    conn = ctx.connect()
    ch, q = _setup_queue(ctx, conn, n=3)
    m0 = ch.basic_get(q)[0]
    m1 = ch.basic_get(q)[0]
    ch.basic_reject(m0.delivery_tag, requeue=False)
    ch.basic_nack(m1.delivery_tag, requeue=False)
    ch.close()  # anything still unacked would be requeued here
    ch2 = conn.channel()
    out = {"remaining": drain(ch2, q)}
    conn.close()
    return out


@scenario
def ack_multiple(ctx):
    conn = ctx.connect()
    _, q = _setup_queue(ctx, conn, n=5)
    ch = conn.channel()
    col = Collector(conn, ch, q)
    got = col.wait_for(5)
    out = {"delivered": [b.decode() for _, _, b in got]}
    ch.basic_ack(got[2][0].delivery_tag, multiple=True)  # m0..m2
    ch.close()  # m3, m4 go back to the queue
    ch2 = conn.channel()
    out["requeued_after_close"] = drain(ch2, q)
    conn.close()
    return out


@scenario
def prefetch_limits_unacked(ctx):
    conn = ctx.connect()
    _, q = _setup_queue(ctx, conn, n=5)
    ch = conn.channel()
    ch.basic_qos(prefetch_count=2)
    col = Collector(conn, ch, q)
    first = col.wait_for(2)
    out = {"first": [b.decode() for _, _, b in first]}
    out["extra_while_full"] = col.quiet(0.5)
    out["passive_while_full"] = _passive(conn, q)
    ch.basic_ack(first[0][0].delivery_tag)
    nxt = col.wait_for(1)
    out["after_one_ack"] = [b.decode() for _, _, b in nxt]
    out["extra_after_one_ack"] = col.quiet(0.3)
    conn.close()
    return out


def _passive(conn, q):
    c = conn.channel()
    ok = c.queue_declare(q, passive=True)
    c.close()
    return {"messages": ok.method.message_count, "consumers": ok.method.consumer_count}


@scenario
def channel_close_requeues_unacked(ctx):
    conn = ctx.connect()
    _, q = _setup_queue(ctx, conn, n=3)
    ch = conn.channel()
    col = Collector(conn, ch, q)
    got = col.wait_for(3)
    out = {"first": [msg(m, p, b) for m, p, b in got]}
    ch.basic_ack(got[1][0].delivery_tag)  # m1 settled, m0 and m2 not
    ch.close()
    # A fresh consumer sees the unacked ones again, redelivered, in order.
    ch2 = conn.channel()
    col2 = Collector(conn, ch2, q, auto_ack=True)
    out["second"] = [msg(m, p, b) for m, p, b in col2.wait_for(2)]
    conn.close()
    return out


@scenario
def connection_close_requeues_unacked(ctx):
    conn = ctx.connect()
    _, q = _setup_queue(ctx, conn, n=2)
    conn2 = ctx.connect()
    ch = conn2.channel()
    col = Collector(conn2, ch, q)
    out = {"first": [msg(m, p, b) for m, p, b in col.wait_for(2)]}
    conn2.close()
    ch3 = conn.channel()
    col2 = Collector(conn, ch3, q, auto_ack=True)
    out["second"] = [msg(m, p, b) for m, p, b in col2.wait_for(2)]
    conn.close()
    return out


@scenario
def ack_unknown_delivery_tag(ctx):
    conn = ctx.connect()
    ch, q = _setup_queue(ctx, conn, n=1)
    ch.basic_ack(999)
    # basic.ack has no reply; the channel error surfaces on the next RPC.
    try:
        ch.queue_declare(q, passive=True)
        out = {"error": "none"}
    except px.ChannelClosedByBroker as e:
        out = error_record(e)
    # The connection survives a channel error.
    out["connection_open"] = conn.is_open
    out["message_still_there"] = bodies(conn.channel(), q)
    conn.close()
    return out


@scenario
def double_ack_is_error(ctx):
    conn = ctx.connect()
    ch, q = _setup_queue(ctx, conn, n=1)
    m = ch.basic_get(q)[0]
    ch.basic_ack(m.delivery_tag)
    ch.basic_ack(m.delivery_tag)
    try:
        ch.queue_declare(q, passive=True)
        out = {"error": "none"}
    except px.ChannelClosedByBroker as e:
        out = error_record(e)
    conn.close()
    return out
