"""Routing through the default, direct, fanout, topic and headers exchanges
and exchange-to-exchange bindings. Publishes are confirmed, so routing is
complete when basic_publish returns; queues are then read with basic.get."""
import pika
import pytest

from amqp_helpers import Consumer, bodies, confirming_channel, publish_all


def test_default_exchange_consume_with_acks(conn, names):
    ch = confirming_channel(conn)
    q = names("q")
    ok = ch.queue_declare(q)
    assert (ok.method.message_count, ok.method.consumer_count) == (0, 0)
    publish_all(ch, "", q, [f"m{i}" for i in range(5)])
    cch = conn.channel()
    got = Consumer(conn, cch, q).wait_for(5)
    assert [b for _, _, b in got] == [f"m{i}".encode() for i in range(5)]
    assert [m.delivery_tag for m, _, _ in got] == [1, 2, 3, 4, 5]
    assert not any(m.redelivered for m, _, _ in got)
    for m, _, _ in got:
        cch.basic_ack(m.delivery_tag)
    cch.close()  # acked messages must not come back
    assert bodies(ch, q) == []


def test_direct_exchange(conn, names):
    ch = confirming_channel(conn)
    x = names("x")
    ch.exchange_declare(x, "direct")
    qa, qb, qab = names("a"), names("b"), names("ab")
    for q, keys in ((qa, ["a"]), (qb, ["b"]), (qab, ["a", "b"])):
        ch.queue_declare(q)
        for k in keys:
            ch.queue_bind(q, x, routing_key=k)
    for key in ("a", "b", "c", "a"):
        ch.basic_publish(x, key, key.encode())
    assert bodies(ch, qa) == ["a", "a"]
    assert bodies(ch, qb) == ["b"]
    assert bodies(ch, qab) == ["a", "b", "a"]
    ch.queue_unbind(qab, x, routing_key="a")
    publish_all(ch, x, "a", ["a2"])
    assert bodies(ch, qab) == []
    assert bodies(ch, qa) == ["a2"]


def test_fanout_exchange(conn, names):
    ch = confirming_channel(conn)
    x = names("x")
    ch.exchange_declare(x, "fanout")
    qs = [names(f"q{i}") for i in range(3)]
    for i, q in enumerate(qs):
        ch.queue_declare(q)
        ch.queue_bind(q, x, routing_key=f"ignored{i}")
    publish_all(ch, x, "whatever", ["f0", "f1"])
    for q in qs:
        assert bodies(ch, q) == ["f0", "f1"]


@pytest.mark.parametrize("pattern,matching", [
    ("*.orange.*", ["quick.orange.rabbit", "lazy.orange.elephant", "quick.orange.fox", ".orange."]),
    ("*.*.rabbit", ["quick.orange.rabbit", "lazy.pink.rabbit"]),
    ("lazy.#", ["lazy.orange.elephant", "lazy.brown.fox", "lazy.pink.rabbit", "lazy.orange.male.rabbit", "lazy"]),
    ("#.end", ["end", "x.y.end"]),
    ("a.#.b", ["a.b", "a.x.y.b"]),
    ("quick.orange.rabbit", ["quick.orange.rabbit"]),
])
def test_topic_exchange(conn, names, pattern, matching):
    keys = ["quick.orange.rabbit", "lazy.orange.elephant", "quick.orange.fox", "lazy.brown.fox",
            "lazy.pink.rabbit", "quick.brown.fox", "orange", "quick.orange.male.rabbit",
            "lazy.orange.male.rabbit", "lazy", "end", "x.y.end", "a.b", "a.x.y.b", "ab", "", ".orange."]
    ch = confirming_channel(conn)
    x, q = names("x"), names("q")
    ch.exchange_declare(x, "topic")
    ch.queue_declare(q)
    ch.queue_bind(q, x, routing_key=pattern)
    for k in keys:
        ch.basic_publish(x, k, k.encode())
    assert bodies(ch, q) == matching


def test_topic_hash_matches_everything(conn, names):
    ch = confirming_channel(conn)
    x, q = names("x"), names("q")
    ch.exchange_declare(x, "topic")
    ch.queue_declare(q)
    ch.queue_bind(q, x, routing_key="#")
    publish_all(ch, x, "", ["empty-key"])
    publish_all(ch, x, "a.b.c", ["abc"])
    assert bodies(ch, q) == ["empty-key", "abc"]


@pytest.mark.parametrize("binding,matching", [
    ({"x-match": "all", "a": "1", "b": "2"}, ["both", "extra"]),
    ({"x-match": "any", "a": "1", "b": "2"}, ["both", "only_a", "only_b", "a_wrong", "extra", "int_a"]),
    ({"a": "1", "b": "2"}, ["both", "extra"]),  # x-match defaults to all
])
def test_headers_exchange(conn, names, binding, matching):
    messages = [("both", {"a": "1", "b": "2"}), ("only_a", {"a": "1"}), ("only_b", {"b": "2"}),
                ("a_wrong", {"a": "9", "b": "2"}), ("extra", {"a": "1", "b": "2", "c": "3"}),
                ("none", None), ("int_a", {"a": 1, "b": "2"})]  # int 1 != string "1"
    ch = confirming_channel(conn)
    x, q = names("x"), names("q")
    ch.exchange_declare(x, "headers")
    ch.queue_declare(q)
    ch.queue_bind(q, x, arguments=binding)
    for body, headers in messages:
        ch.basic_publish(x, "ignored", body.encode(), pika.BasicProperties(headers=headers))
    assert bodies(ch, q) == matching


def test_exchange_to_exchange_bindings(conn, names):
    ch = confirming_channel(conn)
    src, mid, top = names("src"), names("mid"), names("top")
    ch.exchange_declare(src, "direct")
    ch.exchange_declare(mid, "fanout")
    ch.exchange_declare(top, "topic")
    ch.exchange_bind(destination=mid, source=src, routing_key="k")
    ch.exchange_bind(destination=top, source=src, routing_key="k2")
    q1, q2 = names("q1"), names("q2")
    ch.queue_declare(q1)
    ch.queue_declare(q2)
    ch.queue_bind(q1, mid)
    ch.queue_bind(q2, top, routing_key="#")
    for key in ("k", "k2", "other"):
        ch.basic_publish(src, key, key.encode())
    assert bodies(ch, q1) == ["k"]
    assert bodies(ch, q2) == ["k2"]
    ch.exchange_unbind(destination=mid, source=src, routing_key="k")
    publish_all(ch, src, "k", ["k-again"])
    assert bodies(ch, q1) == []
