"""Small pika helpers shared by the tests: synchronous ways to observe a
queue so that no test waits on a clock where an event exists."""
from __future__ import annotations

import time

import pika
import pika.exceptions as px

PERSISTENT = pika.BasicProperties(delivery_mode=2)


def open_connection(url):
    p = pika.URLParameters(url)
    # Bound connection setup against a broker that accepts but stays silent.
    p.socket_timeout = 5
    p.stack_timeout = 10
    p.connection_attempts = 1
    return pika.BlockingConnection(p)


def confirming_channel(conn):
    ch = conn.channel()
    ch.confirm_delivery()  # basic_publish now returns only after basic.ack
    return ch


def publish_all(ch, exchange, key, bodies, props=None):
    for b in bodies:
        ch.basic_publish(exchange, key, b.encode() if isinstance(b, str) else b, props)


def drain(ch, queue):
    """[(body, redelivered)] via basic.get (auto-ack) until get-empty."""
    out = []
    while True:
        method, _, body = ch.basic_get(queue, auto_ack=True)
        if method is None:
            return out
        out.append((body.decode(), method.redelivered))


def bodies(ch, queue):
    return [b for b, _ in drain(ch, queue)]


class Consumer:
    """Buffers deliveries so a test can wait for exactly n of them."""

    def __init__(self, conn, ch, queue, auto_ack=False, **kw):
        self.conn, self.ch, self.items = conn, ch, []
        self.tag = ch.basic_consume(queue, lambda c, m, p, b: self.items.append((m, p, b)), auto_ack=auto_ack, **kw)

    def wait_for(self, n, timeout=10.0):
        deadline = time.monotonic() + timeout
        while len(self.items) < n and time.monotonic() < deadline:
            self.conn.process_data_events(time_limit=0.1)
        assert len(self.items) >= n, f"expected {n} deliveries, got {len(self.items)} within {timeout}s"
        got, self.items = self.items[:n], self.items[n:]
        return got

    def none_within(self, period=0.5):
        """True if no further delivery arrives within `period` — the only way
        to observe that a limit (prefetch) holds; there is no event for it."""
        deadline = time.monotonic() + period
        while time.monotonic() < deadline:
            self.conn.process_data_events(time_limit=max(0.0, deadline - time.monotonic()))
        return not self.items


def channel_error(fn, *args, **kwargs):
    """Run fn, expecting the broker to close the channel; return reply_code."""
    try:
        fn(*args, **kwargs)
    except px.ChannelClosedByBroker as e:
        return e.reply_code
    raise AssertionError(f"{getattr(fn, '__name__', fn)} succeeded; expected a channel error")


def queue_exists(conn, queue):
    ch = conn.channel()
    try:
        ch.queue_declare(queue, passive=True)
    except px.ChannelClosedByBroker as e:
        assert e.reply_code == 404, e
        return False
    ch.close()
    return True


def wait_until(pred, timeout=10.0):
    """Bounded poll for server state that no client event announces."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True
