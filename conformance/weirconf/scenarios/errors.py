"""Channel and connection errors: codes and classes the client sees."""
import urllib.parse

import pika
import pika.exceptions as px

from ..harness import scenario
from ..observe import error_record, expect_error


@scenario
def passive_declare_missing(ctx):
    conn = ctx.connect()
    out = {
        "queue": expect_error(conn.channel().queue_declare, ctx.name("missing"), passive=True),
        "exchange": expect_error(conn.channel().exchange_declare, ctx.xname("missing"), passive=True),
        "connection_open": conn.is_open,
    }
    conn.close()
    return out


@scenario
def redeclare_inequivalent(ctx):
    conn = ctx.connect()
    q = ctx.name("q")
    conn.channel().queue_declare(q, durable=True, arguments={"x-max-length": 10})
    x = ctx.xname("x")
    conn.channel().exchange_declare(x, "direct", durable=False)
    out = {
        "same": expect_error(lambda: conn.channel().queue_declare(q, durable=True, arguments={"x-max-length": 10}).method.message_count),
        "queue_durable": expect_error(conn.channel().queue_declare, q, durable=False, arguments={"x-max-length": 10}),
        "queue_args": expect_error(conn.channel().queue_declare, q, durable=True, arguments={"x-max-length": 20}),
        "queue_exclusive": expect_error(conn.channel().queue_declare, q, durable=True, exclusive=True, arguments={"x-max-length": 10}),
        "exchange_type": expect_error(conn.channel().exchange_declare, x, "fanout"),
        "exchange_durable": expect_error(conn.channel().exchange_declare, x, "direct", durable=True),
        "exchange_same": expect_error(lambda: conn.channel().exchange_declare(x, "direct") and "ok"),
    }
    conn.close()
    return out


@scenario
def publish_to_missing_exchange(ctx):
    conn = ctx.connect()
    ch = conn.channel()
    ch.basic_publish(ctx.xname("missing"), "rk", b"x")
    # Asynchronous channel error: surfaces on the next RPC.
    out = {"next_rpc": expect_error(ch.queue_declare, "", exclusive=True)}
    ch2 = conn.channel()
    ch2.confirm_delivery()
    out["with_confirms"] = expect_error(ch2.basic_publish, ctx.xname("missing2"), "rk", b"x")
    out["connection_open"] = conn.is_open
    conn.close()
    return out


@scenario
def reserved_exchange_names(ctx):
    conn = ctx.connect()
    out = {
        "declare_amq_prefix": expect_error(conn.channel().exchange_declare, f"amq.{ctx.run_id}.custom", "direct"),
        # Predeclared exchanges exist and can be passively declared.
        "passive_amq_direct": expect_error(lambda: conn.channel().exchange_declare("amq.direct", "direct", passive=True) and "ok"),
        "passive_amq_topic": expect_error(lambda: conn.channel().exchange_declare("amq.topic", "topic", passive=True) and "ok"),
        "delete_amq_direct": expect_error(conn.channel().exchange_delete, "amq.direct"),
        "publish_default_exchange_bind": expect_error(conn.channel().queue_bind, ctx.name("q_unused"), ""),
    }
    conn.close()
    return out


def _with_url(url, user=None, password=None, vhost=None):
    p = urllib.parse.urlsplit(url)
    host = p.hostname + (f":{p.port}" if p.port else "")
    user = user if user is not None else urllib.parse.unquote(p.username or "guest")
    password = password if password is not None else urllib.parse.unquote(p.password or "guest")
    path = p.path if vhost is None else "/" + urllib.parse.quote(vhost, safe="")
    return urllib.parse.urlunsplit((p.scheme, f"{user}:{password}@{host}", path, p.query, ""))


@scenario
def wrong_credentials(ctx):
    from ..harness import params
    out = {}
    for label, url in (("bad_password", _with_url(ctx.url, password="definitely-wrong")),
                       ("unknown_user", _with_url(ctx.url, user="no-such-user", password="x"))):
        try:
            pika.BlockingConnection(params(url)).close()
            out[label] = "connected"
        except px.AMQPConnectionError as e:
            out[label] = error_record(e)
    return out


@scenario
def wrong_vhost(ctx):
    from ..harness import params
    try:
        pika.BlockingConnection(params(_with_url(ctx.url, vhost=f"no-such-vhost-{ctx.run_id}"))).close()
        return {"result": "connected"}
    except px.AMQPConnectionError as e:
        return {"result": error_record(e)}


@scenario
def unknown_exchange_type(ctx):
    """An unknown exchange type is a connection error (503 COMMAND_INVALID);
    a passive declare does not look at the type."""
    out = {}
    for label, kind in (("bogus", "bogus"), ("x_foo", "x-foo")):
        conn = ctx.connect()
        out[label] = expect_error(conn.channel().exchange_declare, ctx.xname(label), kind)
        out[f"{label}_connection_open"] = conn.is_open
        if conn.is_open:
            conn.close()
    conn = ctx.connect()
    out["passive_existing"] = expect_error(
        lambda: conn.channel().exchange_declare("amq.direct", "bogus", passive=True) and "ok")
    conn.close()
    return out


@scenario
def invalid_expiration(ctx):
    """A publish whose `expiration` is not a non-negative integer (at most
    ten years in ms in RabbitMQ 3.10) closes its channel with 406; the
    exchange is checked first."""
    conn = ctx.connect()
    q = ctx.name("q")
    conn.channel().queue_declare(q)
    out = {}
    for value in ("abc", "-1", "1.5", "10s", "", "0", "+5", "-0",
                  "4294967296", "315360000000", "315360000001"):
        ch = conn.channel()
        ch.basic_publish("", q, b"x", pika.BasicProperties(expiration=value))
        out[repr(value)] = expect_error(lambda: ch.queue_declare(q, passive=True) and "ok")
    ch = conn.channel()
    ch.basic_publish(ctx.xname("missing"), "k", b"x", pika.BasicProperties(expiration="abc"))
    out["missing_exchange_first"] = expect_error(ch.queue_declare, q, passive=True)
    out["connection_open"] = conn.is_open
    conn.close()
    return out
