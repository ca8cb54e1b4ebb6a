"""pika against Weir: the basics a pika application relies on, once.

Which behaviour is checked where (see tests/README.md): routing and error
semantics in engine/tests (in process), agreement with RabbitMQ in
conformance/ (pika scenarios against both brokers, run by .ci/run), crash
and restart in tests/tests. This file keeps `scripts/test.sh` running pika
against the real binary: that the client's handshake, confirms, consumer
callbacks, basic.get, returns and channel errors work with our framing.
"""
import pika
import pika.exceptions as px
import pytest

from amqp_helpers import PERSISTENT, Consumer, bodies, confirming_channel


def test_pika_basics(conn, names):
    ch = confirming_channel(conn)
    q = names("q")
    ok = ch.queue_declare(q, durable=True)
    assert (ok.method.message_count, ok.method.consumer_count) == (0, 0)

    # Confirmed publishes (basic_publish raises NackError on a nack), one
    # with properties pika must encode and decode.
    for i in range(3):
        ch.basic_publish("", q, f"m{i}".encode(), PERSISTENT)
    props = pika.BasicProperties(content_type="text/plain", headers={"k": "v", "n": 7})
    ch.basic_publish("", q, b"m3", props)

    # basic.get reports what is left; a consumer gets the rest in order.
    method, got_props, body = ch.basic_get(q)
    assert (body, method.message_count, method.redelivered) == (b"m0", 3, False)
    assert got_props.delivery_mode == 2
    ch.basic_ack(method.delivery_tag)
    cch = conn.channel()
    got = Consumer(conn, cch, q).wait_for(3)
    assert [b for _, _, b in got] == [b"m1", b"m2", b"m3"]
    assert (got[2][1].content_type, got[2][1].headers) == ("text/plain", {"k": "v", "n": 7})
    cch.basic_ack(got[-1][0].delivery_tag, multiple=True)
    cch.close()  # close-ok: the acks before it were handled
    assert bodies(ch, q) == []

    # A mandatory publish nobody receives comes back (312) before its ack.
    x = names("x")
    ch.exchange_declare(x, "direct")
    with pytest.raises(px.UnroutableError) as ei:
        ch.basic_publish(x, "nobody", b"r", mandatory=True)
    assert [(m.method.reply_code, m.body) for m in ei.value.messages] == [(312, b"r")]

    # A channel error closes only the channel, with the code pika expects.
    with pytest.raises(px.ChannelClosedByBroker) as ei:
        conn.channel().queue_declare(names("missing"), passive=True)
    assert ei.value.reply_code == 404
    assert conn.is_open
