"""What dead-lettering does to a message's own properties, for every
reason (the x-death scenarios themselves are in deadletter.py).

RabbitMQ removes the ``expiration`` property from every dead-lettered
message, whatever the reason, and keeps it as ``original-expiration`` in
the new x-death entry, so the copy cannot expire again in its new queue.
"""
import pika

from ..harness import scenario
from .deadletter import await_msgs, dl_setup


@scenario
def dlx_expiration_removed_for_every_reason(ctx):
    """A message with an expiration (10 min, so it never expires here)
    dead-lettered by a rejection and by max-length: the copy has no
    expiration property, and x-death keeps original-expiration."""
    conn = ctx.connect()
    ch, q, dlx, dlq = dl_setup(ctx, conn, {"x-max-length": 1})
    props = pika.BasicProperties(expiration="600000")
    ch.basic_publish("", q, b"pushed-out", props)
    ch.basic_publish("", q, b"rejected", props)
    m = ch.basic_get(q)[0]
    ch.basic_reject(m.delivery_tag, requeue=False)
    dead = sorted(await_msgs(ctx, conn, dlq, 2), key=lambda d: d["body"])
    out = {"dlq": [{"body": d["body"], "expiration": d.get("expiration"),
                    "x-death": [{k: e.get(k) for k in ("reason", "original-expiration")}
                                for e in d["headers"]["x-death"]]} for d in dead]}
    conn.close()
    return out
