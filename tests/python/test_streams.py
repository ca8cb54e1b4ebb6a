"""Stream queues with pika against the real weir: declared with RabbitMQ's
stream arguments, consumed with every x-stream-offset form (each delivery
carrying x-stream-offset), RabbitMQ's refusal without basic.qos, Weir's
refusal of an offset dropped by retention, and a stream surviving kill -9.

The same calls work against RabbitMQ 3.10+ (WEIR_TEST_URL), except the
retention refusal, which is Weir's own (RabbitMQ starts at the first
retained offset instead): that test is skipped there.
"""
import datetime
import os

import pika
import pika.exceptions as px
import pytest

from amqp_helpers import Consumer, confirming_channel, open_connection
from weirproc import Weir

EXTERNAL = os.environ.get("WEIR_TEST_URL")


def declare_stream(ch, name, **args):
    args = {"x-queue-type": "stream", **args}
    ch.queue_declare(name, durable=True, arguments=args)


def read(conn, stream, n, offset=None):
    """n deliveries from `offset` on: [(x-stream-offset, body)]."""
    ch = conn.channel()
    ch.basic_qos(prefetch_count=100)
    args = {} if offset is None else {"x-stream-offset": offset}
    c = Consumer(conn, ch, stream, arguments=args)
    got = c.wait_for(n)
    for m, _, _ in got:
        ch.basic_ack(m.delivery_tag)
    out = [(p.headers["x-stream-offset"], b.decode()) for _, p, b in got]
    ch.close()
    return out


def offsets(got):
    return [o for o, _ in got]


def test_every_x_stream_offset_form(conn, names):
    ch = confirming_channel(conn)
    s = names("events")
    declare_stream(ch, s, **{"x-max-age": "7D", "x-max-length-bytes": 10**9,
                             "x-stream-max-segment-size-bytes": 10**8})
    for i in range(10):
        ch.basic_publish("", s, f"e{i}".encode())
    everything = list(range(10))
    assert read(conn, s, 10, "first") == [(i, f"e{i}") for i in range(10)]
    assert offsets(read(conn, s, 1, "last")) == [9]
    assert offsets(read(conn, s, 4, 6)) == [6, 7, 8, 9]
    hour_ago = datetime.datetime.now() - datetime.timedelta(hours=1)
    assert offsets(read(conn, s, 10, hour_ago)) == everything  # an AMQP timestamp
    assert offsets(read(conn, s, 10, "1h")) == everything
    assert offsets(read(conn, s, 10, "30m")) == everything
    # `next` (and no argument): only what comes after the consume.
    for offset in ("next", None):
        cch = conn.channel()
        cch.basic_qos(prefetch_count=10)
        c = Consumer(conn, cch, s, arguments={} if offset is None else {"x-stream-offset": offset})
        conn.process_data_events(time_limit=0.2)
        assert c.items == []
        head = read(conn, s, 1, "last")[0][0] + 1
        ch.basic_publish("", s, b"new")
        [(m, p, b)] = c.wait_for(1)
        assert (p.headers["x-stream-offset"], b) == (head, b"new")
        cch.close()


def test_a_stream_consumer_needs_a_prefetch_count(conn, names):
    ch = conn.channel()
    s = names("noqos")
    declare_stream(ch, s)
    cch = conn.channel()
    with pytest.raises(px.ChannelClosedByBroker) as ei:
        cch.basic_consume(s, lambda *a: None)
        conn.process_data_events(time_limit=1)
    assert ei.value.reply_code == 406
    assert "consumer prefetch count is not set" in ei.value.reply_text


@pytest.mark.skipif(EXTERNAL is not None, reason="Weir's own refusal: RabbitMQ skips ahead silently")
def test_an_offset_lost_to_retention_is_refused_with_what_was_lost(conn, names):
    ch = confirming_channel(conn)
    s = names("small")
    declare_stream(ch, s, **{"x-max-length-bytes": 2000})
    for _ in range(100):
        ch.basic_publish("", s, b"x" * 100)
    first = read(conn, s, 1, "first")[0][0]
    assert first > 0
    cch = conn.channel()
    cch.basic_qos(prefetch_count=10)
    with pytest.raises(px.ChannelClosedByBroker) as ei:
        cch.basic_consume(s, lambda *a: None, arguments={"x-stream-offset": 0})
        conn.process_data_events(time_limit=1)
    assert ei.value.reply_code == 406
    text = ei.value.reply_text
    assert "offset out of range" in text
    assert f"oldest available offset is {first}" in text
    assert f"{first} events were lost to retention" in text
    assert offsets(read(conn, s, 100 - first, first)) == list(range(first, 100))


@pytest.mark.skipif(EXTERNAL is not None, reason="needs a weir process of its own to kill")
def test_a_stream_survives_kill_9(tmp_path):
    (tmp_path / "data").mkdir()
    w = Weir(tmp_path / "data", tmp_path / "weir.log").start()
    try:
        conn = open_connection(w.url)
        ch = confirming_channel(conn)
        declare_stream(ch, "log")
        for i in range(50):
            ch.basic_publish("", "log", f"e{i}".encode())
        w.kill()
        w.start()
        conn = open_connection(w.url)
        got = read(conn, "log", 50, "first")
        assert got == [(i, f"e{i}") for i in range(50)]
        assert offsets(read(conn, "log", 19, 31)) == list(range(31, 50))
        conn.close()
    finally:
        if w.proc.poll() is None:
            w.stop()
