"""Confirms, returns, basic.get, ack/nack/reject, prefetch, requeue on close."""
import pika.exceptions as px
import pytest

from amqp_helpers import (PERSISTENT, Consumer, bodies, channel_error, confirming_channel,
                          drain, publish_all)


@pytest.fixture
def filled(conn, names):
    """fill(n) -> (confirming channel, queue holding m0..m{n-1})."""
    def fill(n, tag="q"):
        ch = confirming_channel(conn)
        q = names(tag)
        ch.queue_declare(q)
        publish_all(ch, "", q, [f"m{i}" for i in range(n)])
        return ch, q
    return fill


def test_publisher_confirms_ack_each_publish(conn, names):
    ch = conn.channel()
    ch.confirm_delivery()
    q = names("q")
    ch.queue_declare(q, durable=True)
    for i in range(3):
        ch.basic_publish("", q, f"p{i}".encode(), PERSISTENT)  # raises NackError on nack
    # Unroutable without mandatory is dropped but still acked.
    ch.basic_publish("", names("undeclared"), b"lost")
    assert bodies(ch, q) == ["p0", "p1", "p2"]


def test_mandatory_unroutable_is_returned_with_312(conn, names):
    x = names("x")
    ch = conn.channel()
    ch.exchange_declare(x, "direct")
    returned = []
    ch.add_on_return_callback(lambda c, m, p, b: returned.append((m.reply_code, m.reply_text, m.exchange, m.routing_key, b)))
    ch.basic_publish(x, "nobody", b"r1", mandatory=True)
    ch.exchange_declare(x, "direct", passive=True)  # round trip: the return precedes its reply
    conn.process_data_events(time_limit=0)
    assert returned == [(312, "NO_ROUTE", x, "nobody", b"r1")]

    cch = confirming_channel(conn)
    with pytest.raises(px.UnroutableError) as ei:
        cch.basic_publish(x, "nobody", b"r2", mandatory=True)
    assert [(m.method.reply_code, m.body) for m in ei.value.messages] == [(312, b"r2")]


def test_basic_get_message_count_and_empty(filled):
    ch, q = filled(3)
    counts = []
    for expected in ("m0", "m1", "m2"):
        method, _, body = ch.basic_get(q)
        assert body.decode() == expected and not method.redelivered
        counts.append(method.message_count)
    assert counts == [2, 1, 0]
    assert ch.basic_get(q) == (None, None, None)


def test_nack_and_reject_requeue_to_original_position(filled):
    ch, q = filled(4)
    m0, m1, m2 = (ch.basic_get(q)[0] for _ in range(3))
    ch.basic_reject(m2.delivery_tag, requeue=True)
    ch.basic_nack(m0.delivery_tag, requeue=True)
    ch.basic_ack(m1.delivery_tag)
    assert drain(ch, q) == [("m0", True), ("m2", True), ("m3", False)]


def test_consumer_nack_redelivers_flagged(conn, filled):
    _, q = filled(2)
    ch = conn.channel()
    ch.basic_qos(prefetch_count=1)
    c = Consumer(conn, ch, q)
    (m, _, b), = c.wait_for(1)
    assert (b, m.redelivered) == (b"m0", False)
    ch.basic_nack(m.delivery_tag, requeue=True)
    (m, _, b), = c.wait_for(1)
    assert (b, m.redelivered) == (b"m0", True)
    ch.basic_ack(m.delivery_tag)
    (m, _, b), = c.wait_for(1)
    assert (b, m.redelivered) == (b"m1", False)


def test_reject_without_requeue_drops(conn, filled):
    ch, q = filled(3)
    a, b = ch.basic_get(q)[0], ch.basic_get(q)[0]
    ch.basic_reject(a.delivery_tag, requeue=False)
    ch.basic_nack(b.delivery_tag, requeue=False)
    ch.close()
    assert drain(conn.channel(), q) == [("m2", False)]


def test_ack_multiple(conn, filled):
    _, q = filled(5)
    ch = conn.channel()
    got = Consumer(conn, ch, q).wait_for(5)
    ch.basic_ack(got[2][0].delivery_tag, multiple=True)
    ch.close()  # m3, m4 were not covered by the multiple ack
    assert drain(conn.channel(), q) == [("m3", True), ("m4", True)]


def test_prefetch_limits_unacked_deliveries(conn, filled):
    _, q = filled(5)
    ch = conn.channel()
    ch.basic_qos(prefetch_count=2)
    c = Consumer(conn, ch, q)
    first = c.wait_for(2)
    assert c.none_within(0.5)
    ok = conn.channel().queue_declare(q, passive=True)
    assert (ok.method.message_count, ok.method.consumer_count) == (3, 1)
    ch.basic_ack(first[0][0].delivery_tag)
    (m, _, b), = c.wait_for(1)
    assert b == b"m2"
    assert c.none_within(0.3)


def test_channel_close_requeues_unacked_as_redelivered(conn, filled):
    _, q = filled(3)
    ch = conn.channel()
    got = Consumer(conn, ch, q).wait_for(3)
    ch.basic_ack(got[1][0].delivery_tag)
    ch.close()
    ch2 = conn.channel()
    again = Consumer(conn, ch2, q, auto_ack=True).wait_for(2)
    assert [(b, m.redelivered) for m, _, b in again] == [(b"m0", True), (b"m2", True)]


def test_connection_close_requeues_unacked(connect, conn, filled):
    _, q = filled(2)
    other = connect()
    Consumer(other, other.channel(), q).wait_for(2)
    other.close()
    again = Consumer(conn, conn.channel(), q, auto_ack=True).wait_for(2)
    assert [(b, m.redelivered) for m, _, b in again] == [(b"m0", True), (b"m1", True)]


def test_ack_unknown_delivery_tag_is_406(conn, filled):
    ch, q = filled(1)
    ch.basic_ack(999)
    assert channel_error(ch.queue_declare, q, passive=True) == 406
    assert conn.is_open  # a channel error leaves the connection up
    assert bodies(conn.channel(), q) == ["m0"]
