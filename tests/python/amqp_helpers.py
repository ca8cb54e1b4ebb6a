"""Small pika helpers for the smoke test: synchronous ways to observe a
queue so that no test waits on a clock where an event exists."""
from __future__ import annotations

import time

import pika

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


def bodies(ch, queue):
    """Bodies via basic.get (auto-ack) until get-empty."""
    out = []
    while True:
        method, _, body = ch.basic_get(queue, auto_ack=True)
        if method is None:
            return out
        out.append(body.decode())


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
