"""Retained messages: set, receive on subscribe, replace, clear; MQTT 5
retain handling and retain-as-published; retained expiry."""
from __future__ import annotations

import time

from ..harness import V5, both, scenario
from .util import msgs


@both
def retained_set_replace_clear(ctx, v):
    """A retained message reaches each new subscriber with RETAIN=1 at
    min(QoS); an established subscriber gets it live with RETAIN=0; a new
    one replaces it; an empty retained publish clears it (and is itself
    delivered live, not retained)."""
    t = ctx.retain_at(ctx.topic("r"))
    pub = ctx.client("p", v)
    live = ctx.client("live", v)
    live.subscribe(t, qos=2)
    pub.publish(t, "first", 2, retain=True)
    out = {}
    late = ctx.client("late1", v)
    late.subscribe(t, qos=1)
    late.wait_messages(1)
    late.sync()
    out["new_subscriber"] = msgs(late.take())
    pub.publish(t, "second", 1, retain=True)
    late2 = ctx.client("late2", v)
    late2.subscribe(t, qos=2)
    late2.wait_messages(1)
    late2.sync()
    out["after_replace"] = msgs(late2.take())
    pub.publish(t, "", 1, retain=True)
    late3 = ctx.client("late3", v)
    late3.subscribe(t, qos=1)
    late3.sync()
    out["after_clear"] = msgs(late3.take())
    live.wait_messages(3)
    live.sync()
    out["live_subscriber"] = msgs(live.take())
    return out


@both
def retained_wildcard_subscribe(ctx, v):
    """A wildcard subscription receives every matching retained message
    (sorted: their order is not specified)."""
    topics = [ctx.retain_at(ctx.topic(f"rw/{x}")) for x in ("a", "b", "c/d")]
    pub = ctx.client("p", v)
    for tp in topics:
        pub.publish(tp, tp.rsplit("/", 1)[1], 1, retain=True)
    s = ctx.client("s", v)
    s.subscribe(ctx.topic("rw/#"), qos=1)
    s.wait_messages(3)
    s.sync()
    return sorted(msgs(s.take()))


@scenario
def retain_handling_v5(ctx):
    """MQTT 5 3.8.3.1: Retain Handling 0 sends retained messages at every
    subscribe, 1 only when the subscription is new, 2 never."""
    t = ctx.retain_at(ctx.topic("rh"))
    pub = ctx.client("p", V5)
    pub.publish(t, "kept", 1, retain=True)
    out = {}
    for rh in (0, 1, 2):
        s = ctx.client(f"s{rh}", V5)
        s.subscribe(t, qos=1, rh=rh)
        s.sync()
        first = [m["payload"] for m in s.take()]
        s.subscribe(t, qos=1, rh=rh)  # the same subscription again
        s.sync()
        again = [m["payload"] for m in s.take()]
        out[f"rh{rh}"] = {"first_subscribe": first, "resubscribe": again}
    return out


@scenario
def retain_as_published_v5(ctx):
    """MQTT 5 3.8.3.1: with Retain As Published a live retained message
    keeps RETAIN=1; without it the flag is 0."""
    t = ctx.retain_at(ctx.topic("rap"))
    keep = ctx.client("keep", V5)
    keep.subscribe(t, qos=1, rap=True)
    clear = ctx.client("clear", V5)
    clear.subscribe(t, qos=1, rap=False)
    pub = ctx.client("p", V5)
    pub.publish(t, "r", 1, retain=True)
    pub.publish(t, "n", 1, retain=False)
    out = {}
    for name, s in (("rap1", keep), ("rap0", clear)):
        s.wait_messages(2)
        s.sync()
        out[name] = msgs(s.take(), "payload", "retain")
    return out


@scenario
def retained_message_expiry_v5(ctx):
    """MQTT 5 3.3.2.3.3: a retained message whose expiry passed is no
    longer sent to new subscribers; one that has not expired is, with the
    remaining interval."""
    short = ctx.retain_at(ctx.topic("rx/short"))
    long_ = ctx.retain_at(ctx.topic("rx/long"))
    pub = ctx.client("p", V5)
    pub.publish(short, "short", 1, retain=True, props={"message_expiry_interval": 1})
    pub.publish(long_, "long", 1, retain=True, props={"message_expiry_interval": 100})
    time.sleep(2.2)  # the time that must pass is what is tested
    s = ctx.client("s", V5)
    s.subscribe(ctx.topic("rx/#"), qos=1)
    s.wait_messages(1)
    s.sync()
    got = s.take(keep_props=True)
    return [{"payload": m["payload"], "retain": m["retain"],
             "expiry_counted_down": 90 <= m["props"].get("message_expiry_interval", -1) < 100} for m in got]
