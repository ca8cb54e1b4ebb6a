"""Routing through each exchange type. Publishes use confirms, so by the time
basic_publish returns the broker has routed the message; queues are then
drained with basic.get (synchronous, no timing)."""
import pika

from ..harness import scenario
from ..observe import bodies, Collector


def _confirming_channel(conn):
    ch = conn.channel()
    ch.confirm_delivery()
    return ch


@scenario
def default_exchange_consume_ack(ctx):
    """Publish via the default exchange, consume with manual acks; acked
    messages are gone after the consumer's channel closes."""
    conn = ctx.connect()
    ch = _confirming_channel(conn)
    q = ctx.name("q")
    ok = ch.queue_declare(q)
    out = {"declare_ok": {"messages": ok.method.message_count, "consumers": ok.method.consumer_count}}
    for i in range(5):
        ch.basic_publish("", q, f"m{i}".encode())
    cch = conn.channel()
    col = Collector(conn, cch, q)
    got = col.wait_for(5)
    out["received"] = [{"body": b.decode(), "redelivered": m.redelivered, "tag": m.delivery_tag} for m, _, b in got]
    for m, _, _ in got:
        cch.basic_ack(m.delivery_tag)
    cch.close()  # close-ok implies the acks before it were processed
    out["after"] = bodies(ch, q)
    conn.close()
    return out


@scenario
def direct_exchange(ctx):
    conn = ctx.connect()
    ch = _confirming_channel(conn)
    x = ctx.xname("x")
    ch.exchange_declare(x, "direct")
    qa, qb, qab = ctx.name("a"), ctx.name("b"), ctx.name("ab")
    for q, keys in ((qa, ["a"]), (qb, ["b"]), (qab, ["a", "b"])):
        ch.queue_declare(q)
        for k in keys:
            ch.queue_bind(q, x, routing_key=k)
    for key in ("a", "b", "c", "a"):
        ch.basic_publish(x, key, f"{key}-msg".encode())
    out = {"a": bodies(ch, qa), "b": bodies(ch, qb), "ab": bodies(ch, qab)}
    # Unbinding stops routing for that key only.
    ch.queue_unbind(qab, x, routing_key="a")
    ch.basic_publish(x, "a", b"after-unbind-a")
    ch.basic_publish(x, "b", b"after-unbind-b")
    out["after_unbind"] = {"a": bodies(ch, qa), "ab": bodies(ch, qab)}
    conn.close()
    return out


@scenario
def fanout_exchange(ctx):
    conn = ctx.connect()
    ch = _confirming_channel(conn)
    x = ctx.xname("x")
    ch.exchange_declare(x, "fanout")
    qs = [ctx.name(f"q{i}") for i in range(3)]
    for q in qs:
        ch.queue_declare(q)
        ch.queue_bind(q, x, routing_key=f"ignored-{q[-1]}")
    for i in range(3):
        ch.basic_publish(x, "any.key", f"f{i}".encode())
    out = {f"q{i}": bodies(ch, q) for i, q in enumerate(qs)}
    conn.close()
    return out


TOPIC_BINDINGS = {
    "star_orange_star": "*.orange.*",
    "star_star_rabbit": "*.*.rabbit",
    "lazy_hash": "lazy.#",
    "hash": "#",
    "hash_end": "#.end",
    "exact": "quick.orange.rabbit",
    "a_hash_b": "a.#.b",
}
TOPIC_KEYS = [
    "quick.orange.rabbit", "lazy.orange.elephant", "quick.orange.fox", "lazy.brown.fox",
    "lazy.pink.rabbit", "quick.brown.fox", "orange", "quick.orange.male.rabbit",
    "lazy.orange.male.rabbit", "lazy", "end", "x.y.end", "a.b", "a.x.y.b", "ab", "", ".orange.",
]


@scenario
def topic_exchange(ctx):
    conn = ctx.connect()
    ch = _confirming_channel(conn)
    x = ctx.xname("x")
    ch.exchange_declare(x, "topic")
    queues = {}
    for tag, pattern in TOPIC_BINDINGS.items():
        q = ctx.name(tag)
        ch.queue_declare(q)
        ch.queue_bind(q, x, routing_key=pattern)
        queues[tag] = q
    for key in TOPIC_KEYS:
        ch.basic_publish(x, key, f"<{key}>".encode())
    out = {f"{tag} ({TOPIC_BINDINGS[tag]})": bodies(ch, q) for tag, q in queues.items()}
    conn.close()
    return out


HEADER_BINDINGS = {
    "all_ab": {"x-match": "all", "a": "1", "b": "2"},
    "any_ab": {"x-match": "any", "a": "1", "b": "2"},
    "default_is_all": {"a": "1", "b": "2"},
    "all_empty": {"x-match": "all"},
}
HEADER_MESSAGES = [
    ("both", {"a": "1", "b": "2"}),
    ("only_a", {"a": "1"}),
    ("only_b", {"b": "2"}),
    ("a_wrong", {"a": "9", "b": "2"}),
    ("extra", {"a": "1", "b": "2", "c": "3"}),
    ("none", None),
    ("int_a", {"a": 1, "b": "2"}),
]


@scenario
def headers_exchange(ctx):
    conn = ctx.connect()
    ch = _confirming_channel(conn)
    x = ctx.xname("x")
    ch.exchange_declare(x, "headers")
    queues = {}
    for tag, args in HEADER_BINDINGS.items():
        q = ctx.name(tag)
        ch.queue_declare(q)
        ch.queue_bind(q, x, routing_key="", arguments=args)
        queues[tag] = q
    for body, headers in HEADER_MESSAGES:
        ch.basic_publish(x, "rk-ignored", body.encode(), pika.BasicProperties(headers=headers))
    out = {tag: bodies(ch, q) for tag, q in queues.items()}
    conn.close()
    return out


@scenario
def exchange_to_exchange(ctx):
    """direct src --(key k)--> fanout mid --> q1; src --(key k2)--> topic t --(#)--> q2."""
    conn = ctx.connect()
    ch = _confirming_channel(conn)
    src, mid, top = ctx.xname("src"), ctx.xname("mid"), ctx.xname("topic")
    ch.exchange_declare(src, "direct")
    ch.exchange_declare(mid, "fanout")
    ch.exchange_declare(top, "topic")
    ch.exchange_bind(destination=mid, source=src, routing_key="k")
    ch.exchange_bind(destination=top, source=src, routing_key="k2")
    q1, q2, qdirect = ctx.name("q1"), ctx.name("q2"), ctx.name("direct")
    for q in (q1, q2, qdirect):
        ch.queue_declare(q)
    ch.queue_bind(q1, mid)
    ch.queue_bind(q2, top, routing_key="#")
    ch.queue_bind(qdirect, src, routing_key="k")
    for key in ("k", "k2", "other", "k"):
        ch.basic_publish(src, key, f"via-{key}".encode())
    out = {"q1": bodies(ch, q1), "q2": bodies(ch, q2), "direct": bodies(ch, qdirect)}
    ch.exchange_unbind(destination=mid, source=src, routing_key="k")
    ch.basic_publish(src, "k", b"after-unbind")
    out["after_unbind"] = {"q1": bodies(ch, q1), "direct": bodies(ch, qdirect)}
    conn.close()
    return out
