"""Publish / subscribe: QoS 0/1/2 round trips, QoS 2 exactly once,
wildcards, $-topics, unsubscribe."""
from __future__ import annotations

from ..harness import V3, V5, both, differs, scenario
from ..raw import PUBCOMP, PUBREC, PUBREL, ack_packet, publish_packet
from .util import msgs


@both
def qos_round_trip(ctx, v):
    """Three subscribers at QoS 0, 1, 2 on one topic; one publisher sends at
    QoS 0, 1, 2. Each message arrives once at min(publish QoS, granted
    QoS); QoS 1/2 publishes are acknowledged with a success code."""
    t = ctx.topic("q")
    subs = {}
    granted = {}
    for q in (0, 1, 2):
        subs[q] = ctx.client(f"s{q}", v)
        granted[q] = subs[q].subscribe(t, qos=q)
    pub = ctx.client("p", v)
    acks = {}
    for q in (0, 1, 2):
        rc = pub.publish(t, f"m{q}", q)
        acks[q] = "success" if rc < 0x80 else rc
    pub.sync()
    out = {"granted": granted, "acks": acks, "received": {}}
    for q, s in subs.items():
        s.wait_messages(3)
        s.sync()
        # Ordering is only promised within one QoS: sort.
        out["received"][q] = sorted(msgs(s.take(), "payload", "qos", "retain"))
    return out


@both
def qos2_duplicate_publish_delivered_once(ctx, v):
    """MQTT 4.3.3: a QoS 2 PUBLISH sent again with DUP before PUBREL (its
    PUBREC was lost, say) is acknowledged again but delivered once; PUBREL
    gets PUBCOMP."""
    t = ctx.topic("x")
    sub = ctx.client("s", v)
    sub.subscribe(t, qos=2)
    r = ctx.raw(v)
    r.connect(ctx.client_id("p"), username=ctx.username, password=ctx.password)
    r.send(publish_packet(t, b"once", 2, pid=7, version=v))
    first = r.expect(PUBREC)
    r.send(publish_packet(t, b"once", 2, pid=7, version=v, dup=True))
    second = r.expect(PUBREC)
    r.send(ack_packet(PUBREL, 7, v))
    comp = r.expect(PUBCOMP)
    # A second message after the exchange: once it is in, the first would be too.
    r.send(publish_packet(t, b"after", 2, pid=8, version=v))
    r.expect(PUBREC)
    r.send(ack_packet(PUBREL, 8, v))
    r.expect(PUBCOMP)
    sub.wait_messages(2)
    sub.sync()
    return {"pubrec": [first["pid"], second["pid"]], "pubcomp": comp["pid"],
            "received": msgs(sub.take(), "payload", "qos")}


WILDCARD_TOPICS = ["a", "a/b", "a/b/c", "a/c/c", "a//c", "b/b/c", "a/b/c/d"]
WILDCARD_FILTERS = ["a/+/c", "a/#", "+/+", "+/b/c", "a/b/#", "a/+", "+", "a/b/c", "#"]


@both
def wildcards(ctx, v):
    """`+` matches one level (also an empty one), `#` any number of levels
    including the parent; each filter gets exactly its topics."""
    subs = {}
    for i, f in enumerate(WILDCARD_FILTERS):
        subs[f] = ctx.client(f"w{i}", v)
        # Filters under the scenario's prefix: '+' and '#' then span the
        # topics below it only.
        subs[f].subscribe(ctx.topic("w/" + f), qos=1)
    pub = ctx.client("p", v)
    for tp in WILDCARD_TOPICS:
        pub.publish(ctx.topic("w/" + tp), tp, 1)
    out = {}
    for f, s in subs.items():
        s.sync()
        out[f] = sorted(m["payload"] for m in s.take())
    return out


@both
def dollar_topics_not_matched_by_wildcards(ctx, v):
    """MQTT 4.7.2: a filter starting with a wildcard does not match topics
    starting with '$'; a filter spelling out the '$' level does."""
    # $-topic of this run: "$wc/<run>/<scenario>/d"
    dollar = "$" + ctx.topic("d")
    _, _, rest = dollar.partition("/")
    # "$wc/<run>/<scenario>/#" rather than "$wc/#": concurrent runs stay apart.
    filters = {"#": "#", "+/...": "+/" + rest, "$.../#": "$" + ctx.prefix + "/#", "exact": dollar}
    subs = {}
    for i, (name, f) in enumerate(filters.items()):
        subs[name] = ctx.client(f"d{i}", v)
        subs[name].subscribe(f, qos=1)
    pub = ctx.client("p", v)
    pub.publish(dollar, "dollar", 1)
    out = {}
    for name, s in subs.items():
        s.sync()
        # '#' sees every other client's traffic too: keep only ours.
        out[name] = sorted(m["topic"] for m in s.take()
                           if m["payload"] == "dollar" and m["topic"].startswith(("~", "$~")))
    return out


@both
def unsubscribe(ctx, v):
    """UNSUBACK (MQTT 5: 0x00, and 0x11 'No subscription existed' for a
    filter that had none), and no delivery after it."""
    t = ctx.topic("u")
    s = ctx.client("s", v)
    s.subscribe(t, qos=1)
    pub = ctx.client("p", v)
    pub.publish(t, "before", 1)
    s.wait_messages(1)
    rcs = s.unsubscribe(t)
    rcs_none = s.unsubscribe(ctx.topic("never"))
    pub.publish(t, "after", 1)
    s.sync()
    return {"unsuback": rcs, "unsuback_unknown": rcs_none, "received": [m["payload"] for m in s.take()]}


def _overlap(ctx, v):
    s = ctx.client("s", v)
    s.subscribe(ctx.topic("o/+"), qos=0)
    s.subscribe(ctx.topic("o/#"), qos=2)
    pub = ctx.client("p", v)
    pub.publish(ctx.topic("o/x"), "m", 2)
    s.wait_messages(1)
    s.sync()
    got = s.take()
    return {"copies_at_least_one": len(got) >= 1, "highest_qos": max(m["qos"] for m in got)}


@scenario
def overlapping_subscriptions_qos_v5(ctx):
    """Two overlapping subscriptions at QoS 0 and 2: the client gets the
    message at least once, and a copy at QoS 2 (MQTT 5 3.3.4: one copy at
    the highest QoS, or one per subscription)."""
    return _overlap(ctx, V5)


@differs(
    "MQTT 3.1.1 3.3.5-1: with overlapping subscriptions the server MUST deliver respecting the maximum QoS "
    "of all matching subscriptions; Mosquitto 2.0.11 sends a 3.1.1 client one copy at the QoS of the "
    "first subscription (0)",
    reference={"copies_at_least_one": True, "highest_qos": 0},
    candidate={"copies_at_least_one": True, "highest_qos": 2},
)
def overlapping_subscriptions_qos_v3(ctx):
    """As overlapping_subscriptions_qos_v5, over MQTT 3.1.1."""
    return _overlap(ctx, V3)
