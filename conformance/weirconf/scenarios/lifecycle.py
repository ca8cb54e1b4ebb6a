"""Queue lifecycle: purge, delete, server-named, auto-delete, exclusive,
consumer cancel notifications."""
import pika.exceptions as px

from ..harness import scenario
from ..observe import Collector, bodies, error_record, expect_error, queue_exists, wait_until


@scenario
def purge_returns_count(ctx):
    conn = ctx.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    q = ctx.name("q")
    ch.queue_declare(q)
    for i in range(4):
        ch.basic_publish("", q, f"m{i}".encode())
    unacked = ch.basic_get(q)[0]  # unacked messages are not purged
    ok = ch.queue_purge(q)
    out = {"purged": ok.method.message_count}
    ch.basic_reject(unacked.delivery_tag, requeue=True)
    out["after"] = bodies(ch, q)
    out["purge_empty"] = ch.queue_purge(q).method.message_count
    conn.close()
    return out


@scenario
def queue_delete_returns_count(ctx):
    conn = ctx.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    q = ctx.name("q")
    ch.queue_declare(q)
    for i in range(3):
        ch.basic_publish("", q, f"m{i}".encode())
    out = {"deleted_count": ch.queue_delete(q).method.message_count}
    out["exists_after"] = queue_exists(conn, q)
    # Deleting a queue that does not exist is not an error in RabbitMQ >= 3.x.
    out["delete_missing"] = expect_error(lambda: ch.queue_delete(q).method.message_count)
    conn.close()
    return out


@scenario
def queue_delete_if_empty_if_unused(ctx):
    conn = ctx.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    q = ctx.name("q")
    ch.queue_declare(q)
    ch.basic_publish("", q, b"m")
    out = {"if_empty_nonempty": expect_error(conn.channel().queue_delete, q, if_empty=True)}
    cch = conn.channel()
    Collector(conn, cch, q, auto_ack=False)
    out["if_unused_with_consumer"] = expect_error(conn.channel().queue_delete, q, if_unused=True)
    out["still_exists"] = queue_exists(conn, q)
    cch.close()
    c2 = conn.channel()
    bodies(c2, q)
    ok = c2.queue_delete(q, if_empty=True, if_unused=True)
    out["delete_when_empty_unused"] = ok.method.message_count
    conn.close()
    return out


@scenario
def server_named_queue(ctx):
    conn = ctx.connect()
    ch = conn.channel()
    ok = ch.queue_declare("", exclusive=True)
    name = ok.method.queue
    out = {"prefix_amq_gen": name.startswith("amq.gen-"), "long_enough": len(name) > len("amq.gen-")}
    ok2 = ch.queue_declare("", exclusive=True)
    out["distinct"] = ok2.method.queue != name
    ch.basic_publish("", name, b"to-server-named")
    out["received"] = bodies(ch, name)
    # (Server-generated consumer tags are not checked here: pika always
    # generates its own consumer tag client-side.)
    conn.close()
    return out


@scenario
def queue_delete_cancels_consumers(ctx):
    conn = ctx.connect()
    ch = conn.channel()
    q = ctx.name("q")
    ch.queue_declare(q)
    cancels = []
    ch.add_on_cancel_callback(lambda frame: cancels.append(frame.method.NAME))
    tag = ch.basic_consume(q, lambda *a: None)
    other = conn.channel()
    other.queue_delete(q)
    # The broker sends basic.cancel to the consumer's channel; wait for it.
    wait_until(lambda: (conn.process_data_events(time_limit=0.1), bool(cancels))[1], timeout=10)
    out = {
        "cancel_notifications": cancels,
        "consumer_gone": tag not in ch.consumer_tags,
        "channel_open": ch.is_open,
    }
    conn.close()
    return out


@scenario
def auto_delete_after_last_consumer(ctx):
    conn = ctx.connect()
    ch = conn.channel()
    q = ctx.name("q")
    ch.queue_declare(q, auto_delete=True)
    out = {"exists_before_any_consumer": queue_exists(conn, q)}
    t1 = ch.basic_consume(q, lambda *a: None)
    t2 = ch.basic_consume(q, lambda *a: None)
    ch.basic_cancel(t1)
    out["exists_with_one_consumer"] = queue_exists(conn, q)
    ch.basic_cancel(t2)
    # RabbitMQ deletes the queue after cancel-ok; poll bounded for it to vanish.
    out["deleted_after_last_cancel"] = wait_until(lambda: not queue_exists(conn, q), timeout=10)
    conn.close()
    return out


@scenario
def exclusive_queue_other_connection(ctx):
    owner = ctx.connect()
    q = ctx.name("q")
    owner.channel().queue_declare(q, exclusive=True)
    other = ctx.connect()
    out = {
        "redeclare": expect_error(other.channel().queue_declare, q, exclusive=True),
        "passive": expect_error(other.channel().queue_declare, q, passive=True),
        "consume": expect_error(other.channel().basic_consume, q, lambda *a: None),
        "get": expect_error(lambda: other.channel().basic_get(q)),
        "other_conn_open": other.is_open,
    }
    other.close()
    owner.close()
    # An exclusive queue dies with its connection.
    check = ctx.connect()
    out["gone_after_owner_closes"] = wait_until(lambda: not queue_exists(check, q), timeout=10)
    check.close()
    return out
