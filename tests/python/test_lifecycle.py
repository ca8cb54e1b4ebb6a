"""Queue lifecycle: purge, delete (with guards), server-named, auto-delete,
consumer cancel notification on delete."""
from amqp_helpers import Consumer, bodies, channel_error, confirming_channel, publish_all, queue_exists, wait_until


def test_purge_returns_count_and_spares_unacked(conn, names):
    ch = confirming_channel(conn)
    q = names("q")
    ch.queue_declare(q)
    publish_all(ch, "", q, ["m0", "m1", "m2", "m3"])
    unacked = ch.basic_get(q)[0]
    assert ch.queue_purge(q).method.message_count == 3
    ch.basic_reject(unacked.delivery_tag, requeue=True)
    assert bodies(ch, q) == ["m0"]
    assert ch.queue_purge(q).method.message_count == 0


def test_queue_delete_returns_count(conn, names):
    ch = confirming_channel(conn)
    q = names("q")
    ch.queue_declare(q)
    publish_all(ch, "", q, ["a", "b", "c"])
    assert ch.queue_delete(q).method.message_count == 3
    assert not queue_exists(conn, q)


def test_queue_delete_if_empty_and_if_unused_406(conn, names):
    ch = confirming_channel(conn)
    q = names("q")
    ch.queue_declare(q)
    publish_all(ch, "", q, ["m"])
    assert channel_error(conn.channel().queue_delete, q, if_empty=True) == 406
    cch = conn.channel()
    Consumer(conn, cch, q)
    assert channel_error(conn.channel().queue_delete, q, if_unused=True) == 406
    assert queue_exists(conn, q)
    cch.close()
    c2 = conn.channel()
    bodies(c2, q)
    assert c2.queue_delete(q, if_empty=True, if_unused=True).method.message_count == 0


def test_server_named_queue_has_amq_gen_prefix(conn):
    ch = conn.channel()
    a = ch.queue_declare("", exclusive=True).method.queue
    b = ch.queue_declare("", exclusive=True).method.queue
    assert a.startswith("amq.gen-") and len(a) > len("amq.gen-")
    assert a != b
    ch.basic_publish("", a, b"hello")
    assert bodies(ch, a) == ["hello"]


def test_queue_delete_sends_consumer_cancel(conn, names):
    ch = conn.channel()
    q = names("q")
    ch.queue_declare(q)
    cancels = []
    ch.add_on_cancel_callback(lambda frame: cancels.append(frame.method.consumer_tag))
    tag = ch.basic_consume(q, lambda *a: None)
    conn.channel().queue_delete(q)
    # Wait for the broker's basic.cancel (an event), bounded.
    assert wait_until(lambda: conn.process_data_events(time_limit=0.1) or cancels)
    assert cancels == [tag]
    assert tag not in ch.consumer_tags and ch.is_open


def test_auto_delete_queue_removed_after_last_consumer(conn, names):
    ch = conn.channel()
    q = names("q")
    ch.queue_declare(q, auto_delete=True)
    assert queue_exists(conn, q)  # no consumer yet: not deleted
    t1 = ch.basic_consume(q, lambda *a: None)
    t2 = ch.basic_consume(q, lambda *a: None)
    ch.basic_cancel(t1)
    assert queue_exists(conn, q)
    ch.basic_cancel(t2)
    assert wait_until(lambda: not queue_exists(conn, q))
