"""Will messages: sent when a client vanishes, not after a clean
DISCONNECT; MQTT 5 will delay and DISCONNECT 0x04."""
from __future__ import annotations

import time

from ..harness import V5, both, scenario
from ..raw import disconnect_packet
from .util import msgs


def _will_client(ctx, v, tag, will_topic, payload, qos=1, retain=False, delay=None, expiry=None, keepalive=60):
    """A raw client with a will: it can vanish or DISCONNECT exactly when
    the scenario says."""
    r = ctx.raw(v)
    will = {"topic": will_topic, "payload": payload.encode(), "qos": qos, "retain": retain}
    props = None
    if v == V5:
        if delay is not None:
            will["properties"] = {"will_delay_interval": delay}
        if expiry is not None:
            props = {"session_expiry_interval": expiry}
    cid = ctx.client_id(tag)
    if expiry:
        ctx.session(cid, v)
    ack = r.connect(cid, username=ctx.username, password=ctx.password, will=will, properties=props,
                    keepalive=keepalive)
    assert ack["rc"] == 0, ack
    return r, cid


@both
def will_on_abnormal_close(ctx, v):
    """MQTT 3.1.2.5: the will is published when the network connection
    closes without DISCONNECT (with its QoS; a retained will is retained)."""
    t = ctx.retain_at(ctx.topic("will"))
    obs = ctx.client("o", v)
    obs.subscribe(t, qos=2)
    r, _ = _will_client(ctx, v, "w", t, "gone", qos=2, retain=True)
    r.drop()
    obs.wait_messages(1)
    obs.sync()
    live = msgs(obs.take())
    late = ctx.client("late", v)
    late.subscribe(t, qos=2)
    late.wait_messages(1)
    late.sync()
    return {"live": live, "retained": msgs(late.take())}


@both
def will_not_sent_after_disconnect(ctx, v):
    """MQTT 3.1.2.5 / 3.14.4: a clean DISCONNECT (MQTT 5: reason 0x00)
    discards the will."""
    t = ctx.topic("will")
    obs = ctx.client("o", v)
    obs.subscribe(t, qos=1)
    r, _ = _will_client(ctx, v, "w", t, "gone")
    r.send(disconnect_packet(v, 0 if v == V5 else None))
    closed = r.wait_closed()  # the server has processed the DISCONNECT
    obs.sync()
    return {"closed_by_server": closed, "received": msgs(obs.take())}


@scenario
def will_sent_on_disconnect_with_will_v5(ctx):
    """MQTT 5 3.14.2.1: DISCONNECT with reason 0x04 'Disconnect with Will
    Message' publishes the will."""
    t = ctx.topic("will")
    obs = ctx.client("o", V5)
    obs.subscribe(t, qos=1)
    r, _ = _will_client(ctx, V5, "w", t, "asked for")
    r.send(disconnect_packet(V5, 0x04))
    obs.wait_messages(1)
    obs.sync()
    return msgs(obs.take())


@scenario
def will_delay_v5(ctx):
    """MQTT 5 3.1.3.2.2: with a Will Delay Interval the will is published
    when the delay has passed, not at the close."""
    t = ctx.topic("will")
    obs = ctx.client("o", V5)
    obs.subscribe(t, qos=1)
    r, _ = _will_client(ctx, V5, "w", t, "delayed", delay=2, expiry=60)
    r.drop()
    time.sleep(0.5)  # well inside the delay: the will must not be out yet
    obs.sync()
    early = msgs(obs.take())
    obs.wait_messages(1, timeout=10)
    obs.sync()
    return {"within_delay": early, "after_delay": msgs(obs.take())}


@scenario
def will_delay_cancelled_by_reconnect_v5(ctx):
    """MQTT 5 3.1.3.2.2: a new connection to the session before the will
    delay has passed means the will is never published."""
    t = ctx.topic("will")
    obs = ctx.client("o", V5)
    obs.subscribe(t, qos=1)
    r, cid = _will_client(ctx, V5, "w", t, "cancelled", delay=2, expiry=60)
    r.drop()
    back = ctx.client("back", V5, client_id=cid, clean=False, session_expiry=60)
    time.sleep(3.0)  # past the delay: a will would be out by now
    obs.sync()
    return {"session_present": back.connack["session_present"], "received": msgs(obs.take())}


@scenario
def will_delay_cancelled_by_takeover_v5(ctx):
    """MQTT 5 3.1.3.2.2: a connection taking the session over (same client
    id, clean start 0) is a new connection to the session before the will
    delay has passed: the old connection's delayed will is never published."""
    t = ctx.topic("will")
    obs = ctx.client("o", V5)
    obs.subscribe(t, qos=1)
    r, cid = _will_client(ctx, V5, "w", t, "taken over", delay=2, expiry=60)
    back = ctx.client("back", V5, client_id=cid, clean=False, session_expiry=60)
    closed = r.wait_closed()
    time.sleep(3.0)  # past the delay: a will would be out by now
    obs.sync()
    return {
        "old_closed": closed,
        "session_present": back.connack["session_present"],
        "received": msgs(obs.take()),
    }


@scenario
def will_at_session_end_when_delay_is_longer_v5(ctx):
    """MQTT 5 3.1.3.2.2: the will is published at the earlier of the will
    delay and the end of the session (expiry 1 s, delay 60 s)."""
    t = ctx.topic("will")
    obs = ctx.client("o", V5)
    obs.subscribe(t, qos=1)
    r, _ = _will_client(ctx, V5, "w", t, "session ended", delay=60, expiry=1)
    r.drop()
    obs.wait_messages(1, timeout=15)
    obs.sync()
    return msgs(obs.take())


@both
def will_on_keep_alive_timeout(ctx, v):
    """MQTT 3.1.2.10 [MQTT-3.1.2-24] and 3.1.2.5: a client that sends
    nothing for 1.5 times its keep-alive (1 s here) is disconnected by the
    server, and that is a failure to communicate: its will is published."""
    t = ctx.topic("will")
    obs = ctx.client("o", v)
    obs.subscribe(t, qos=1)
    r, _ = _will_client(ctx, v, "w", t, "silent", keepalive=1)
    closed = r.wait_closed(timeout=10)  # silent: the server ends it after 1.5 s
    obs.wait_messages(1)
    obs.sync()
    return {"closed_by_server": closed, "received": msgs(obs.take())}


@scenario
def will_delay_after_keep_alive_timeout_v5(ctx):
    """MQTT 5 3.1.3.2.2: a will whose connection ended at its keep-alive
    waits for its Will Delay Interval too (2 s here)."""
    t = ctx.topic("will")
    obs = ctx.client("o", V5)
    obs.subscribe(t, qos=1)
    r, _ = _will_client(ctx, V5, "w", t, "silent, delayed", delay=2, expiry=60, keepalive=1)
    closed = r.wait_closed(timeout=10)
    time.sleep(0.5)  # well inside the delay: the will must not be out yet
    obs.sync()
    early = msgs(obs.take())
    obs.wait_messages(1, timeout=10)
    obs.sync()
    return {"closed_by_server": closed, "within_delay": early, "after_delay": msgs(obs.take())}
