"""RabbitMQ's extensions and spec differences (issue 11), one scenario per
item of docs/compatibility.md: idempotent teardown, direct reply-to,
alternate exchanges, sender-selected distribution with an alternate,
validated user-id, the queue arguments RabbitMQ accepts, headers
``x-match: all-with-x / any-with-x``, and connection.update-secret.

Server-generated names (reply addresses, consumer tags) never appear in a
transcript: only facts about them (a prefix, equality) do.
"""
import pika
import pika.exceptions as px

from ..harness import scenario
from ..observe import Collector, bodies, error_record, expect_error

REPLY_TO = "amq.rabbitmq.reply-to"


def _publish(ch, exchange, key, body, props=None, mandatory=False) -> str:
    """Publish on a confirming channel; what the publisher was told."""
    try:
        ch.basic_publish(exchange, key, body.encode(), props or pika.BasicProperties(), mandatory=mandatory)
        return "ack"
    except px.UnroutableError:
        return "returned"
    except px.NackError:
        return "nack"


@scenario
def compat_idempotent_teardown(ctx):
    """queue.unbind / exchange.unbind of a missing queue, exchange or
    binding answer unbind-ok; queue.delete / exchange.delete of a missing
    one answer delete-ok; the default exchange stays refused (403)."""
    conn = ctx.connect()
    x, q = ctx.xname("x"), ctx.name("q")
    missing_q, missing_x = ctx.name("missing"), ctx.xname("missing")
    ch = conn.channel()
    ch.exchange_declare(x, "direct")
    ch.queue_declare(q)
    ch.queue_bind(q, x, routing_key="k")

    def fresh(fn, *a, **kw):
        return expect_error(lambda: fn(conn.channel())(*a, **kw))

    out = {
        "unbind_missing_queue": fresh(lambda c: c.queue_unbind, missing_q, x, routing_key="k"),
        "unbind_missing_exchange": fresh(lambda c: c.queue_unbind, q, missing_x, routing_key="k"),
        "unbind_missing_binding": fresh(lambda c: c.queue_unbind, q, x, routing_key="never-bound"),
        "unbind_missing_both": fresh(lambda c: c.queue_unbind, missing_q, missing_x),
        "x_unbind_missing_destination": fresh(lambda c: c.exchange_unbind, missing_x, x, routing_key="k"),
        "x_unbind_missing_source": fresh(lambda c: c.exchange_unbind, x, missing_x, routing_key="k"),
        "delete_missing_queue": fresh(lambda c: c.queue_delete, missing_q),
        "delete_missing_exchange": fresh(lambda c: c.exchange_delete, missing_x),
        "unbind_default_exchange": fresh(lambda c: c.queue_unbind, q, "", routing_key=q),
    }
    # The real binding still routes, and unbinding it twice is fine.
    ch.confirm_delivery()
    ch.basic_publish(x, "k", b"m")
    out["routed_before"] = bodies(ch, q)
    out["unbind_twice"] = [fresh(lambda c: c.queue_unbind, q, x, routing_key="k") for _ in range(2)]
    ch.basic_publish(x, "k", b"m")
    out["routed_after"] = bodies(ch, q)
    conn.close()
    return out


@scenario
def compat_direct_reply_to(ctx):
    """amq.rabbitmq.reply-to: no-ack consumers only, one per channel; a
    request's reply-to is rewritten to the channel's reply address; a reply
    published to the default exchange with that key reaches the consumer
    (from another connection and from the same channel); a reply to a
    cancelled or closed consumer, or to an unknown address, is unroutable."""
    conn = ctx.connect()
    out = {}
    ch = conn.channel()
    out["ack_mode"] = expect_error(ch.basic_consume, REPLY_TO, lambda *a: None, auto_ack=False)
    ch = conn.channel()
    out["request_without_consumer"] = expect_error(
        lambda: (ch.basic_publish("", "nowhere", b"x", pika.BasicProperties(reply_to=REPLY_TO)),
                 ch.queue_declare("", exclusive=True)))
    ch = conn.channel()
    col = Collector(conn, ch, REPLY_TO, auto_ack=True)
    # A second reply consumer on the same channel closes that channel, so
    # it is tried on a channel of its own.
    other_ch = conn.channel()
    Collector(conn, other_ch, REPLY_TO, auto_ack=True)
    out["second_consumer"] = expect_error(other_ch.basic_consume, REPLY_TO, lambda *a: None, auto_ack=True)

    # A request through a real queue; the server reads its reply-to.
    server = ctx.connect()
    sch = server.channel()
    sch.confirm_delivery()
    requests = ctx.name("requests")
    sch.queue_declare(requests)
    ch.basic_publish("", requests, b"request", pika.BasicProperties(reply_to=REPLY_TO, correlation_id="c1"))
    m = (None,)
    for _ in range(200):
        m = sch.basic_get(requests, auto_ack=True)
        if m[0] is not None:
            break
        server.process_data_events(time_limit=0.05)
    address = m[1].reply_to
    out["rewritten"] = {
        "prefix": address.startswith(REPLY_TO + "."),
        "longer": len(address) > len(REPLY_TO) + 1,
        "correlation_id": m[1].correlation_id,
    }
    pch = conn.channel()
    out["passive_declare_address"] = expect_error(lambda: pch.queue_declare(address, passive=True).method.message_count)
    out["reply_from_other_connection"] = _publish(sch, "", address, "reply-1", pika.BasicProperties(correlation_id="c1"))
    ch.basic_publish("", address, b"reply-2")
    got = col.wait_for(2)
    out["replies"] = [{
        "body": b.decode(),
        "exchange": mm.exchange,
        "routing_key_is_address": mm.routing_key == address,
        "consumer_tag_matches": mm.consumer_tag == col.tag,
        "redelivered": mm.redelivered,
        "correlation_id": pp.correlation_id,
    } for mm, pp, b in got]
    out["unknown_address_mandatory"] = _publish(sch, "", REPLY_TO + ".not-a-real-one", "x", mandatory=True)
    out["unknown_address"] = _publish(sch, "", REPLY_TO + ".not-a-real-one", "x")
    ch.basic_cancel(col.tag)
    out["after_cancel_mandatory"] = _publish(sch, "", address, "late", mandatory=True)
    conn.close()
    out["after_close_mandatory"] = _publish(sch, "", address, "gone", mandatory=True)
    server.close()
    return out


@scenario
def compat_alternate_exchange(ctx):
    """alternate-exchange: what the exchange cannot route goes to its
    alternate (mandatory is then not returned); returned only when the
    alternate cannot route it either, or does not exist; alternates chain."""
    conn = ctx.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    x, ae, ae2, dangling = ctx.xname("x"), ctx.xname("ae"), ctx.xname("ae2"), ctx.xname("dangling")
    main, lost, lost2 = ctx.name("main"), ctx.name("lost"), ctx.name("lost2")
    ch.exchange_declare(ae2, "fanout")
    ch.exchange_declare(ae, "direct", arguments={"alternate-exchange": ae2})
    ch.exchange_declare(x, "direct", arguments={"alternate-exchange": ae})
    ch.exchange_declare(dangling, "direct", arguments={"alternate-exchange": ctx.xname("never-declared")})
    for q in (main, lost, lost2):
        ch.queue_declare(q)
    ch.queue_bind(main, x, routing_key="main")
    ch.queue_bind(lost, ae, routing_key="lost")
    out = {
        "routable": _publish(ch, x, "main", "m1", mandatory=True),
        "to_alternate": _publish(ch, x, "lost", "m2", mandatory=True),
        "cc_routes_so_no_alternate": _publish(ch, x, "nothing", "m3",
                                               pika.BasicProperties(headers={"CC": ["main"]}), mandatory=True),
    }
    out["queues"] = {"main": bodies(ch, main), "lost": bodies(ch, lost), "lost2": bodies(ch, lost2)}
    # ae2 has no bindings yet: nothing can route this.
    out["nowhere"] = _publish(ch, x, "nowhere", "m4", mandatory=True)
    ch.queue_bind(lost2, ae2)
    out["chained"] = _publish(ch, x, "nowhere", "m5", mandatory=True)
    out["dangling_alternate"] = _publish(ch, dangling, "k", "m6", mandatory=True)
    out["queues_after"] = {"lost2": bodies(ch, lost2)}
    conn.close()
    return out


@scenario
def compat_validated_user_id(ctx):
    """user_id must name the connection's user: guest may say guest, not
    anyone else (406 closes the channel); RabbitMQ looks the exchange up
    first, so a wrong user_id to a missing exchange is a 404."""
    conn = ctx.connect()
    q = ctx.name("q")
    ch = conn.channel()
    ch.confirm_delivery()
    ch.queue_declare(q)
    out = {"own": _publish(ch, "", q, "mine", pika.BasicProperties(user_id="guest"))}
    ch2 = conn.channel()
    ch2.confirm_delivery()
    out["other"] = expect_error(ch2.basic_publish, "", q, b"forged", pika.BasicProperties(user_id="mallory"))
    ch3 = conn.channel()
    ch3.confirm_delivery()
    out["other_missing_exchange"] = expect_error(
        ch3.basic_publish, ctx.xname("missing"), "k", b"forged", pika.BasicProperties(user_id="mallory"))
    got = ch.basic_get(q, auto_ack=True)
    out["queued"] = {"body": got[2].decode(), "user_id": got[1].user_id}
    out["after"] = bodies(ch, q)
    conn.close()
    return out


# Each declare on a channel of its own: a refusal closes the channel.
QUEUE_ARGS = [
    ("lazy", {"x-queue-mode": "lazy"}),
    ("default_mode", {"x-queue-mode": "default"}),
    ("bad_mode", {"x-queue-mode": "bogus"}),
    ("mode_not_string", {"x-queue-mode": 5}),
    ("master_locator", {"x-queue-master-locator": "min-masters"}),
    ("leader_locator_on_classic", {"x-queue-leader-locator": "balanced"}),
    ("group_size_on_classic", {"x-quorum-initial-group-size": 3}),
    ("dl_strategy_on_classic", {"x-dead-letter-strategy": "at-least-once"}),
    ("in_memory_on_classic", {"x-max-in-memory-length": 10}),
    ("q_leader_locator", {"x-queue-type": "quorum", "x-queue-leader-locator": "balanced"}),
    ("q_leader_locator_legacy", {"x-queue-type": "quorum", "x-queue-leader-locator": "least-leaders"}),
    ("q_bad_leader_locator", {"x-queue-type": "quorum", "x-queue-leader-locator": "bogus"}),
    ("q_group_size", {"x-queue-type": "quorum", "x-quorum-initial-group-size": 3}),
    ("q_group_size_zero", {"x-queue-type": "quorum", "x-quorum-initial-group-size": 0}),
    ("q_group_size_negative", {"x-queue-type": "quorum", "x-quorum-initial-group-size": -1}),
    ("q_group_size_string", {"x-queue-type": "quorum", "x-quorum-initial-group-size": "x"}),
    ("q_at_least_once", {"x-queue-type": "quorum", "x-dead-letter-strategy": "at-least-once",
                         "x-overflow": "reject-publish", "x-dead-letter-exchange": "dlx"}),
    ("q_at_most_once", {"x-queue-type": "quorum", "x-dead-letter-strategy": "at-most-once"}),
    ("q_bad_strategy", {"x-queue-type": "quorum", "x-dead-letter-strategy": "bogus"}),
    ("q_strategy_not_string", {"x-queue-type": "quorum", "x-dead-letter-strategy": 1}),
    ("q_in_memory", {"x-queue-type": "quorum", "x-max-in-memory-length": 5, "x-max-in-memory-bytes": 1000}),
    ("q_in_memory_negative", {"x-queue-type": "quorum", "x-max-in-memory-length": -1}),
    ("q_lazy", {"x-queue-type": "quorum", "x-queue-mode": "lazy"}),
    ("q_master_locator", {"x-queue-type": "quorum", "x-queue-master-locator": "min-masters"}),
]

# (tag, first declare, redeclare)
REDECLARES = [
    ("mode_dropped", {"x-queue-mode": "lazy"}, {}),
    ("mode_changed", {"x-queue-mode": "lazy"}, {"x-queue-mode": "default"}),
    ("mode_added", {}, {"x-queue-mode": "lazy"}),
    ("mode_same", {"x-queue-mode": "lazy"}, {"x-queue-mode": "lazy"}),
    ("master_locator_dropped", {"x-queue-master-locator": "min-masters"}, {}),
    ("q_leader_locator_dropped", {"x-queue-type": "quorum", "x-queue-leader-locator": "balanced"},
     {"x-queue-type": "quorum"}),
    ("q_strategy_changed", {"x-queue-type": "quorum", "x-dead-letter-strategy": "at-least-once"},
     {"x-queue-type": "quorum", "x-dead-letter-strategy": "at-most-once"}),
    ("q_group_size_changed", {"x-queue-type": "quorum", "x-quorum-initial-group-size": 1},
     {"x-queue-type": "quorum", "x-quorum-initial-group-size": 2}),
    ("q_in_memory_dropped", {"x-queue-type": "quorum", "x-max-in-memory-length": 1}, {"x-queue-type": "quorum"}),
    ("q_same", {"x-queue-type": "quorum", "x-max-in-memory-length": 1, "x-quorum-initial-group-size": 1},
     {"x-queue-type": "quorum", "x-max-in-memory-length": 1, "x-quorum-initial-group-size": 1}),
]


@scenario
def compat_queue_arguments(ctx):
    """x-queue-mode, x-queue-master-locator (classic queues),
    x-queue-leader-locator, x-quorum-initial-group-size,
    x-dead-letter-strategy, x-max-in-memory-length/-bytes (quorum queues):
    accepted with RabbitMQ's validation, refused on the other queue type,
    and compared on redeclare."""
    conn = ctx.connect()
    out = {}
    for tag, args in QUEUE_ARGS:
        q = ctx.name(tag)
        out[tag] = expect_error(lambda: conn.channel().queue_declare(q, durable=True, arguments=args) and None)
    for tag, first, again in REDECLARES:
        q = ctx.name("re." + tag)
        conn.channel().queue_declare(q, durable=True, arguments=first)
        out["redeclare_" + tag] = expect_error(lambda: conn.channel().queue_declare(q, durable=True, arguments=again) and None)
    conn.close()
    return out


HEADERS_WITH_X = {
    "all": {"x-match": "all", "x-tenant": "a", "kind": "order"},
    "all_with_x": {"x-match": "all-with-x", "x-tenant": "a", "kind": "order"},
    "any": {"x-match": "any", "x-tenant": "a"},
    "any_with_x": {"x-match": "any-with-x", "x-tenant": "a", "kind": "nothing-sends-this"},
}

HEADERS_X_MESSAGES = [
    ("order-a", {"x-tenant": "a", "kind": "order"}),
    ("order-b", {"x-tenant": "b", "kind": "order"}),
    ("only-x-a", {"x-tenant": "a"}),
    ("none", {}),
]


@scenario
def compat_headers_match_with_x(ctx):
    """x-match all-with-x / any-with-x compare x- headers too; all / any
    ignore them (RabbitMQ 3.10+)."""
    conn = ctx.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    x = ctx.xname("x")
    ch.exchange_declare(x, "headers")
    queues = {}
    for tag, args in HEADERS_WITH_X.items():
        q = ctx.name(tag)
        ch.queue_declare(q)
        ch.queue_bind(q, x, arguments=args)
        queues[tag] = q
    for body, headers in HEADERS_X_MESSAGES:
        ch.basic_publish(x, "", body.encode(), pika.BasicProperties(headers=headers))
    out = {tag: bodies(ch, q) for tag, q in queues.items()}
    conn.close()
    return out


@scenario
def compat_update_secret(ctx):
    """connection.update-secret answers update-secret-ok (RabbitMQ's
    internal users keep their login whatever the new secret), and the
    connection works on."""
    conn = ctx.connect()
    q = ctx.name("q")
    out = {}
    for label, secret in (("same", "guest"), ("other", "a-rotated-token")):
        try:
            conn.update_secret(secret, "rotation")
            out[label] = "ok"
        except Exception as e:  # noqa: BLE001 - the class of error is the observation
            out[label] = error_record(e)
    ch = conn.channel()
    ch.confirm_delivery()
    ch.queue_declare(q)
    ch.basic_publish("", q, b"still-works")
    out["after"] = bodies(ch, q)
    conn.close()
    return out
