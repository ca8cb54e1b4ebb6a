"""Policies: RabbitMQ-style policies applied to queues by name.

The policies are set once for the run on both brokers (conformance/
policies.toml: Weir's configuration file, and the same policies set on
RabbitMQ with rabbitmqctl by conformance/run.sh). Each pattern matches
only queues named ``pol.<policy>.…``, which only these scenarios declare:
``pname`` builds such a name from this run's id and registers it for
cleanup.

What is compared: which messages a queue keeps, which publishes are
nacked, where dead-lettered messages arrive and their x-death headers
(with this run's names reduced to tags), and whether an idle queue is
deleted. How RabbitMQ merges a policy with a queue's own arguments is what
Weir must match: for the numeric limits (message-ttl, expires,
max-length, max-length-bytes, delivery-limit) the lower value wins; for
the rest (overflow, dead-letter-exchange, dead-letter-routing-key) the
queue's argument wins. Only the matching policy with the highest priority
applies. Changing a policy at run time (and across a restart) is tested
against Weir alone in tests/tests/policies.rs: Weir sets policies from its
configuration file at startup.
"""
import re

import pika
import pika.exceptions as px

from ..harness import scenario
from ..observe import Collector, bodies, expect_error, wait_until
from .deadletter import PERSISTENT, _nack_until_dead, _publish_all


def pname(ctx, policy: str, tag: str, kind: str = "q") -> str:
    """A queue (or exchange) name that policy ``conf-pol-<policy>``
    matches, unique to this run; cleaned up after the scenario."""
    return ctx.named(f"pol.{policy}.{ctx.run_id}.{tag}", kind)


def norm(ctx, v):
    """This run's names reduced to tags (``<policy:tag>``, ``<tag>``) and
    times to their type, so both brokers' transcripts compare."""
    if isinstance(v, bytes):
        v = v.decode(errors="replace")
    if isinstance(v, str):
        v = re.sub(r"pol\.(\w+)\." + re.escape(ctx.run_id) + r"\.([\w-]+)", r"<\1:\2>", v)
        return re.sub(re.escape(f"conf.{ctx.run_id}.{ctx.scenario}.") + r"([\w-]+)", r"<\1>", v)
    if isinstance(v, dict):
        return {k: ("<time>" if k == "time" else norm(ctx, x)) for k, x in sorted(v.items())}
    if isinstance(v, (list, tuple)):
        return [norm(ctx, x) for x in v]
    if hasattr(v, "isoformat"):
        return "<timestamp>"
    return v


def dead(ctx, method, props, body) -> dict:
    """A dead-lettered message: body, exchange and routing key it arrived
    with, and its death headers (x-last-death-* left out: RabbitMQ 3.10
    does not set them; Weir does, as RabbitMQ 3.13+)."""
    rec = {"body": body.decode(errors="replace"), "exchange": norm(ctx, method.exchange),
           "routing_key": norm(ctx, method.routing_key)}
    h = {k: v for k, v in (props.headers or {}).items() if not k.startswith("x-last-death-")}
    if h:
        rec["headers"] = norm(ctx, h)
    return rec


def await_dead(ctx, conn, queue, n, timeout=10.0) -> list[dict]:
    """Consumes (auto-ack) until n messages arrived on ``queue`` or the
    deadline passed (expiry has no reply to wait for), sorted by body."""
    ch = conn.channel()
    col = Collector(conn, ch, queue, auto_ack=True)
    got = col.wait_for(n, timeout)
    ch.basic_cancel(col.tag)
    ch.close()
    return sorted((dead(ctx, *g) for g in got), key=lambda r: r["body"])


def dlx_queue(ctx, ch, tag="dlx"):
    """A per-run fanout exchange with a queue bound to it: (exchange, queue)."""
    x = ctx.xname(tag)
    q = ctx.name(tag + "-q")
    ch.exchange_declare(x, "fanout")
    ch.queue_declare(q)
    ch.queue_bind(q, x)
    return x, q


# --- message-ttl ---------------------------------------------------------------


@scenario
def pol_message_ttl_applies_to_matching_queue(ctx):
    """Policy message-ttl 100 ms on ``pol.ttl.*``: a queue declared without
    arguments expires its messages (dead-lettered through the queue's own
    x-dead-letter-exchange: arguments and policy combine); a queue the
    pattern does not match keeps its message."""
    conn = ctx.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    dlx, dlq = dlx_queue(ctx, ch)
    q = pname(ctx, "ttl", "q")
    other = ctx.name("unmatched")
    for name, body in ((q, b"matched"), (other, b"unmatched")):
        ch.queue_declare(name, arguments={"x-dead-letter-exchange": dlx})
        ch.basic_publish("", name, body, PERSISTENT)
    out = {"dlq": await_dead(ctx, conn, dlq, 1)}
    out["matched_after"] = bodies(ch, q)
    out["unmatched_after"] = bodies(ch, other)
    conn.close()
    return out


@scenario
def pol_message_ttl_lower_wins(ctx):
    """message-ttl from a policy and from x-message-ttl: the lower one
    applies, whichever sets it (a 100 ms policy beats a 10 min argument;
    a 100 ms argument beats a 10 min policy)."""
    conn = ctx.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    dlx, dlq = dlx_queue(ctx, ch)
    short_policy = pname(ctx, "ttl", "long-arg")
    short_arg = pname(ctx, "ttlhigh", "short-arg")
    ch.queue_declare(short_policy, arguments={"x-message-ttl": 600000, "x-dead-letter-exchange": dlx})
    ch.queue_declare(short_arg, arguments={"x-message-ttl": 100, "x-dead-letter-exchange": dlx})
    ch.basic_publish("", short_policy, b"policy-ttl-wins")
    ch.basic_publish("", short_arg, b"argument-ttl-wins")
    out = {"dlq": await_dead(ctx, conn, dlq, 2)}
    out["left"] = [bodies(ch, short_policy), bodies(ch, short_arg)]
    conn.close()
    return out


# --- length limits -------------------------------------------------------------


@scenario
def pol_max_length_lower_wins(ctx):
    """Policy max-length 3 (drop-head): a queue without arguments keeps the
    newest 3; with x-max-length 5 the policy's 3 is lower and wins; with
    x-max-length 1 the argument is lower and wins."""
    conn = ctx.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    out = {}
    for tag, args in (("plain", {}), ("arg5", {"x-max-length": 5}), ("arg1", {"x-max-length": 1})):
        q = pname(ctx, "len", tag)
        ch.queue_declare(q, arguments=args)
        out[tag] = {"confirms": _publish_all(ch, q, 6), "queue": bodies(ch, q)}
    conn.close()
    return out


@scenario
def pol_overflow_argument_wins(ctx):
    """Policy {max-length 2, overflow reject-publish}: publishes past the
    limit are nacked; a queue declaring x-overflow drop-head keeps its own
    overflow (non-numeric keys: the argument wins) and the policy's
    max-length."""
    conn = ctx.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    out = {}
    for tag, args in (("plain", {}), ("drop-head", {"x-overflow": "drop-head"})):
        q = pname(ctx, "reject", tag)
        ch.queue_declare(q, arguments=args)
        out[tag] = {"confirms": _publish_all(ch, q, 4), "queue": bodies(ch, q)}
    conn.close()
    return out


@scenario
def pol_max_length_bytes(ctx):
    """Policy max-length-bytes 10 counts bodies: three 4-byte bodies keep
    the newest two (headers do not count); x-max-length-bytes 4 is lower
    and wins."""
    conn = ctx.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    out = {}
    for tag, args in (("plain", {}), ("arg4", {"x-max-length-bytes": 4})):
        q = pname(ctx, "bytes", tag)
        ch.queue_declare(q, arguments=args)
        for b in (b"aaaa", b"bbbb", b"cccc"):
            ch.basic_publish("", q, b, pika.BasicProperties(headers={"padding": "x" * 100}))
        out[tag] = bodies(ch, q)
    conn.close()
    return out


@scenario
def pol_highest_priority_applies_alone(ctx):
    """Two policies match ``pol.prio.*``: only the higher-priority one
    (max-length 3) applies; the other's max-length 1 and reject-publish are
    not merged in. A policy with apply-to exchanges never touches a queue."""
    conn = ctx.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    q = pname(ctx, "prio", "q")
    ch.queue_declare(q)
    out = {"prio": {"confirms": _publish_all(ch, q, 5), "queue": bodies(ch, q)}}
    x = pname(ctx, "applyx", "q")
    ch.queue_declare(x)
    out["apply_to_exchanges"] = {"confirms": _publish_all(ch, x, 3), "queue": bodies(ch, x)}
    conn.close()
    return out


# --- dead-lettering ------------------------------------------------------------


@scenario
def pol_dead_letter_exchange(ctx):
    """Policy dead-letter-exchange amq.direct: a rejected message of a queue
    without arguments goes there with its routing key (the queue's name);
    a queue declaring its own x-dead-letter-exchange uses its own (the
    argument wins). x-dead-letter-routing-key without an exchange argument
    is still refused at declare, policy or not."""
    conn = ctx.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    plain = pname(ctx, "dlx", "plain")
    own = pname(ctx, "dlx", "own")
    via_policy = ctx.name("via-policy")
    ch.queue_declare(via_policy)
    ch.queue_bind(via_policy, "amq.direct", routing_key=plain)
    ch.queue_bind(via_policy, "amq.direct", routing_key=own)
    own_x, own_q = dlx_queue(ctx, ch, "own-dlx")
    ch.queue_declare(plain)
    ch.queue_declare(own, arguments={"x-dead-letter-exchange": own_x})
    for q in (plain, own):
        ch.basic_publish("", q, f"from-{q.rsplit('.', 1)[1]}".encode())
        m = ch.basic_get(q)[0]
        ch.basic_reject(m.delivery_tag, requeue=False)
    out = {"via_policy": await_dead(ctx, conn, via_policy, 1),
           "via_argument": await_dead(ctx, conn, own_q, 1)}
    out["via_policy_extra"] = bodies(ch, via_policy)
    rk_only = pname(ctx, "dlx", "rk-only")
    out["routing_key_without_exchange_arg"] = expect_error(
        conn.channel().queue_declare, rk_only, arguments={"x-dead-letter-routing-key": "k"})
    conn.close()
    return out


@scenario
def pol_dead_letter_routing_key(ctx):
    """Policy {dead-letter-exchange amq.direct, dead-letter-routing-key
    pol.dlrk.dead}: an expired message of a queue without arguments is
    republished with the policy's routing key; a queue with its own
    x-dead-letter-routing-key (and exchange) keeps its key."""
    conn = ctx.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    plain = pname(ctx, "dlrk", "plain")
    own = pname(ctx, "dlrk", "own")
    own_key = ctx.name("own-key")  # a per-run routing key
    by_policy_key = ctx.name("by-policy-key")
    by_own_key = ctx.name("by-own-key")
    for q, key in ((by_policy_key, "pol.dlrk.dead"), (by_own_key, own_key)):
        ch.queue_declare(q)
        ch.queue_bind(q, "amq.direct", routing_key=key)
    ch.queue_declare(plain, arguments={"x-message-ttl": 50})
    ch.queue_declare(own, arguments={"x-message-ttl": 50, "x-dead-letter-exchange": "amq.direct",
                                     "x-dead-letter-routing-key": own_key})
    ch.basic_publish("", plain, b"policy-key")
    ch.basic_publish("", own, b"own-key")
    out = {"by_policy_key": await_dead(ctx, conn, by_policy_key, 1),
           "by_own_key": await_dead(ctx, conn, by_own_key, 1)}
    conn.close()
    return out


# --- expires -------------------------------------------------------------------


def exists_unused(conn, queue: str, key: str) -> bool:
    """Whether ``queue`` exists, probed without using it: a passive declare
    (or a get) counts as a use and would restart its x-expires clock, a
    binding does not. Binding again with the same key is a no-op; a
    deleted queue answers 404."""
    ch = conn.channel()
    try:
        ch.queue_bind(queue, "amq.direct", routing_key=key)
    except px.ChannelClosedByBroker as e:
        if e.reply_code == 404:
            return False
        raise
    ch.close()
    return True


@scenario
def pol_expires_deletes_idle_queues(ctx):
    """Policy expires 300 ms: an unused queue without arguments is deleted,
    and so is one declaring x-expires 10 min (the policy is lower); an
    unmatched queue stays."""
    conn = ctx.connect()
    ch = conn.channel()
    plain = pname(ctx, "expires", "plain")
    longer = pname(ctx, "expires", "long-arg")
    other = ctx.name("unmatched")
    ch.queue_declare(plain)
    ch.queue_declare(longer, arguments={"x-expires": 600000})
    ch.queue_declare(other)
    probe = ctx.name("probe-key")  # a per-run binding key
    out = {
        "plain_deleted": wait_until(lambda: not exists_unused(conn, plain, probe), timeout=10),
        "long_arg_deleted": wait_until(lambda: not exists_unused(conn, longer, probe), timeout=10),
        "unmatched_exists": exists_unused(conn, other, probe),
    }
    conn.close()
    return out


# --- delivery-limit (quorum queues) --------------------------------------------


@scenario
def pol_quorum_delivery_limit(ctx):
    """Policy {delivery-limit 2, dead-letter-exchange amq.direct} on quorum
    queues: a message always nacked with requeue is delivered 3 times and
    dead-lettered with reason delivery_limit; x-delivery-limit 5 is higher,
    so the policy's 2 applies there too."""
    conn = ctx.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    out = {}
    for tag, args in (("plain", {}), ("arg5", {"x-delivery-limit": 5})):
        q = pname(ctx, "qdl", tag)
        dlq = ctx.name(f"dlq-{tag}")
        ch.queue_declare(dlq)
        ch.queue_bind(dlq, "amq.direct", routing_key=q)
        ch.queue_declare(q, durable=True, arguments={"x-queue-type": "quorum", **args})
        ch.basic_publish("", q, f"poison-{tag}".encode(), PERSISTENT)
        deliveries, dead_msgs = _nack_until_dead(ctx, conn, q, dlq)
        recs = [dead(ctx, *d) for d in dead_msgs]
        for r in recs:
            # Compared in deadletter.quorum_delivery_count_header.
            r.get("headers", {}).pop("x-delivery-count", None)
        out[tag] = {"deliveries": [bool(m.redelivered) for m, _, _ in deliveries], "dlq": recs}
    conn.close()
    return out


# --- redeclare -----------------------------------------------------------------


@scenario
def pol_redeclare_compares_declared_arguments(ctx):
    """A queue under a policy (max-length 3) is redeclared against its own
    declared arguments, never the policy's: the same (empty) arguments are
    equivalent, an x-max-length equal to the policy's is not (406)."""
    conn = ctx.connect()
    q = pname(ctx, "len", "redeclared")
    conn.channel().queue_declare(q)
    out = {
        "same": expect_error(lambda: conn.channel().queue_declare(q) and "ok"),
        "policy_value_as_argument": expect_error(conn.channel().queue_declare, q,
                                                 arguments={"x-max-length": 3}),
    }
    conn.close()
    return out
