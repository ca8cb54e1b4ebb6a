"""AMQP transactions: tx.select / tx.commit / tx.rollback (issue 7, item 11).

A transacted channel's publishes and acks take effect at tx.commit;
tx.rollback drops them, and a rolled-back ack leaves its message unacked
(still held by the channel: it returns to the queue only when the channel
closes). Counts are read with passive declares on other channels of the
same connection, which the broker handles after every frame sent before."""
import pika

from ..harness import scenario
from ..observe import bodies, expect_error, passive_count, reply_name

PERSISTENT = pika.BasicProperties(delivery_mode=2)


def _fill(ctx, conn, n, tag="q", durable=False):
    """A queue holding m0..m{n-1} (confirmed)."""
    ch = conn.channel()
    ch.confirm_delivery()
    q = ctx.name(tag)
    ch.queue_declare(q, durable=durable)
    for i in range(n):
        ch.basic_publish("", q, f"m{i}".encode(), PERSISTENT if durable else None)
    ch.close()
    return q


@scenario
def tx_commit_publishes(ctx):
    conn = ctx.connect()
    q = ctx.name("q")
    ch = conn.channel()
    ch.queue_declare(q, durable=True)
    out = {"select": expect_error(lambda: ch.tx_select() and "ok")}
    ch.basic_publish("", q, b"a", PERSISTENT)
    ch.basic_publish("", q, b"b")
    out["before_commit"] = passive_count(conn, q)
    out["commit"] = expect_error(lambda: ch.tx_commit() and "ok")
    out["after_commit"] = passive_count(conn, q)
    # Still transacted after a commit.
    ch.basic_publish("", q, b"c")
    out["after_next_publish"] = passive_count(conn, q)
    ch.tx_commit()
    out["queued"] = bodies(conn.channel(), q)
    conn.close()
    return out


@scenario
def tx_rollback_publishes(ctx):
    conn = ctx.connect()
    q = ctx.name("q")
    ch = conn.channel()
    ch.queue_declare(q)
    ch.tx_select()
    ch.basic_publish("", q, b"gone-1")
    ch.basic_publish("", q, b"gone-2")
    out = {"rollback": expect_error(lambda: ch.tx_rollback() and "ok")}
    out["after_rollback"] = passive_count(conn, q)
    ch.basic_publish("", q, b"kept")
    ch.tx_commit()
    out["queued"] = bodies(conn.channel(), q)
    conn.close()
    return out


@scenario
def tx_ack_commit_and_rollback(ctx):
    conn = ctx.connect()
    q = _fill(ctx, conn, 3)
    out = {}

    # Rolled-back ack: the message stays unacked on the channel; acking it
    # again and committing takes it.
    ch = conn.channel()
    ch.tx_select()
    m, _, body = ch.basic_get(q, auto_ack=False)
    out["got"] = body.decode()
    ch.basic_ack(m.delivery_tag)
    out["before_commit"] = passive_count(conn, q)
    ch.tx_rollback()
    out["after_rollback"] = passive_count(conn, q)
    ch.basic_ack(m.delivery_tag)
    ch.tx_commit()
    ch.close()
    out["after_commit_and_close"] = passive_count(conn, q)

    # Acked in a transaction never committed: the close returns it.
    ch = conn.channel()
    ch.tx_select()
    m, _, body = ch.basic_get(q, auto_ack=False)
    ch.basic_ack(m.delivery_tag)
    ch.close()
    out["uncommitted_then_close"] = passive_count(conn, q)

    # Rolled back, then the channel closes: back in the queue, redelivered.
    ch = conn.channel()
    ch.tx_select()
    m, _, body = ch.basic_get(q, auto_ack=False)
    out["second_get"] = {"body": body.decode(), "redelivered": m.redelivered}
    ch.basic_nack(m.delivery_tag, requeue=False)
    ch.tx_rollback()
    ch.close()
    out["rolled_back_nack_then_close"] = passive_count(conn, q)
    out["left"] = bodies(conn.channel(), q)
    conn.close()
    return out


@scenario
def tx_multiple_ack(ctx):
    """A multiple ack in a transaction covers what is unacked when it
    arrives, not what is delivered before the commit."""
    conn = ctx.connect()
    q = _fill(ctx, conn, 3)
    ch = conn.channel()
    ch.tx_select()
    m1, _, _ = ch.basic_get(q, auto_ack=False)
    m2, _, _ = ch.basic_get(q, auto_ack=False)
    ch.basic_ack(m2.delivery_tag, multiple=True)
    m3, _, _ = ch.basic_get(q, auto_ack=False)
    ch.tx_commit()
    ch.close()  # m3 was not covered: it returns
    out = {"left": bodies(conn.channel(), q)}
    conn.close()
    return out


@scenario
def tx_mandatory_return_at_commit(ctx):
    conn = ctx.connect()
    ch = conn.channel()
    returned = []
    ch.add_on_return_callback(
        lambda c, method, props, body: returned.append(
            {"code": method.reply_code, "name": reply_name(method.reply_text), "body": body.decode()}))
    ch.tx_select()
    ch.basic_publish("", ctx.name("nowhere-not-declared"), b"r1", mandatory=True)
    # A round trip on the channel: a return sent at publish would be here.
    ch.tx_rollback()
    conn.process_data_events(time_limit=0)
    out = {"after_rollback": list(returned)}
    ch.basic_publish("", ctx.name("nowhere-not-declared"), b"r2", mandatory=True)
    ch.basic_publish("", ctx.name("nowhere-not-declared"), b"r3", mandatory=False)
    ch.tx_commit()
    conn.process_data_events(time_limit=0)
    out["after_commit"] = list(returned)
    conn.close()
    return out


@scenario
def tx_errors(ctx):
    conn = ctx.connect()
    out = {
        "commit_not_transactional": expect_error(conn.channel().tx_commit),
        "rollback_not_transactional": expect_error(conn.channel().tx_rollback),
    }
    ch = conn.channel()
    ch.confirm_delivery()
    out["select_on_confirm_channel"] = expect_error(ch.tx_select)
    ch = conn.channel()
    ch.tx_select()
    out["select_again"] = expect_error(lambda: ch.tx_select() and "ok")
    out["confirm_on_tx_channel"] = expect_error(ch.confirm_delivery)

    # Acking a tag twice in one transaction: refused at the second ack
    # (asynchronous: surfaces on the next RPC).
    q = _fill(ctx, conn, 1)
    ch = conn.channel()
    ch.tx_select()
    m, _, _ = ch.basic_get(q, auto_ack=False)
    ch.basic_ack(m.delivery_tag)
    ch.basic_ack(m.delivery_tag)
    out["double_ack"] = expect_error(ch.tx_commit)
    out["after_double_ack"] = passive_count(conn, q)

    # A publish to a missing exchange fails when published.
    ch = conn.channel()
    ch.tx_select()
    ch.basic_publish(ctx.xname("missing"), "k", b"x")
    out["missing_exchange"] = expect_error(ch.tx_rollback)
    out["connection_open"] = conn.is_open
    conn.close()
    return out
