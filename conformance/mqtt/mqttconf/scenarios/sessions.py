"""Sessions: persistent sessions receive QoS 1/2 messages published while
offline; clean start discards; session expiry; unacknowledged messages
are resent on reconnect (DUP), QoS 2 resumes at PUBREL."""
from __future__ import annotations

import time

from ..harness import V3, V5, both, scenario
from ..raw import PUBCOMP, PUBLISH, PUBREC, PUBREL, SUBACK, ack_packet, subscribe_packet
from .util import msgs


def _persistent(ctx, v, tag="s", **kw):
    """A client whose session outlives its connection."""
    if v == V5:
        return ctx.client(tag, v, clean=kw.pop("clean", False), session_expiry=kw.pop("session_expiry", 300), **kw)
    return ctx.client(tag, v, clean=kw.pop("clean", False), **kw)


@both
def persistent_session_offline_messages(ctx, v):
    """Subscribe at QoS 1 and 2, disconnect; messages published meanwhile at
    QoS 1 and 2 wait and come on reconnect with session_present=1, in order
    per topic. (QoS 0 while offline is left out: the server MAY queue it.)"""
    s = _persistent(ctx, v)
    first = s.connack["session_present"]
    s.subscribe(ctx.topic("p1"), qos=1)
    s.subscribe(ctx.topic("p2"), qos=2)
    s.disconnect()
    pub = ctx.client("p", v)
    for i in range(3):
        pub.publish(ctx.topic("p1"), f"one-{i}", 1)
    for i in range(2):
        pub.publish(ctx.topic("p2"), f"two-{i}", 2)
    s2 = _persistent(ctx, v, client_id=s.id)
    s2.wait_messages(5)
    s2.sync()
    got = s2.take()
    return {"first_session_present": first, "session_present": s2.connack["session_present"],
            "p1": msgs([m for m in got if m["topic"] == "~/p1"], "payload", "qos"),
            "p2": msgs([m for m in got if m["topic"] == "~/p2"], "payload", "qos")}


@both
def clean_start_discards_session(ctx, v):
    """A clean session / Clean Start connect discards the stored session:
    session_present=0 and the old subscription is gone."""
    s = _persistent(ctx, v)
    s.subscribe(ctx.topic("c"), qos=1)
    s.disconnect()
    pub = ctx.client("p", v)
    pub.publish(ctx.topic("c"), "while offline", 1)
    s2 = _persistent(ctx, v, client_id=s.id, clean=True)
    present = s2.connack["session_present"]
    pub.publish(ctx.topic("c"), "after clean start", 1)
    s2.sync()
    got = [m["payload"] for m in s2.take()]
    s2.disconnect()
    s3 = _persistent(ctx, v, client_id=s.id)
    return {"clean_session_present": present, "received": got,
            "later_session_present": s3.connack["session_present"]}


@scenario
def session_expiry_v5(ctx):
    """MQTT 5 3.1.2.11.2: Session Expiry 0 ends the session with the
    connection; a session whose expiry passed while offline is gone; one
    still within its expiry is present."""
    out = {}
    zero = ctx.client("z", V5, clean=False, session_expiry=0)
    zero.subscribe(ctx.topic("z"), qos=1)
    zero.disconnect()
    again = ctx.client("z2", V5, client_id=zero.id, clean=False, session_expiry=0)
    out["expiry_0"] = again.connack["session_present"]
    again.disconnect()

    short = ctx.client("e", V5, clean=False, session_expiry=1)
    short.subscribe(ctx.topic("e"), qos=1)
    short.disconnect()
    long_ = ctx.client("l", V5, clean=False, session_expiry=300)
    long_.subscribe(ctx.topic("l"), qos=1)
    long_.disconnect()
    time.sleep(2.5)  # the time that must pass is what is tested
    out["expiry_1_after_2s"] = ctx.client("e2", V5, client_id=short.id, clean=False,
                                           session_expiry=300).connack["session_present"]
    out["expiry_300_after_2s"] = ctx.client("l2", V5, client_id=long_.id, clean=False,
                                             session_expiry=300).connack["session_present"]
    return out


@scenario
def session_expiry_changed_at_disconnect_v5(ctx):
    """MQTT 5 3.14.2.2.2: DISCONNECT may set a new Session Expiry (here 0:
    the session ends at once)."""
    s = ctx.client("s", V5, clean=False, session_expiry=300)
    s.subscribe(ctx.topic("x"), qos=1)
    s.disconnect(props={"session_expiry_interval": 0})
    s2 = ctx.client("s2", V5, client_id=s.id, clean=False, session_expiry=300)
    return {"session_present": s2.connack["session_present"]}


@scenario
def session_expiry_raised_and_lowered_at_disconnect_v5(ctx):
    """MQTT 5 3.14.2.2.2: a DISCONNECT's Session Expiry Interval replaces
    CONNECT's: raised from 1 s to 300 s the session is still present after
    2.5 s (with what was published meanwhile); lowered from 300 s to 1 s it
    is gone after 2.5 s."""
    t = ctx.topic("ex")
    up = ctx.client("up", V5, clean=False, session_expiry=1)
    up.subscribe(t, qos=1)
    up.disconnect(props={"session_expiry_interval": 300})
    down = ctx.client("down", V5, clean=False, session_expiry=300)
    down.subscribe(ctx.topic("ex2"), qos=1)
    down.disconnect(props={"session_expiry_interval": 1})
    ctx.client("p", V5).publish(t, "kept", 1)
    time.sleep(2.5)  # the time that must pass is what is tested
    up2 = ctx.client("up2", V5, client_id=up.id, clean=False, session_expiry=300)
    up2.wait_messages(1)
    up2.sync()
    down2 = ctx.client("down2", V5, client_id=down.id, clean=False, session_expiry=300)
    return {"raised_session_present": up2.connack["session_present"],
            "raised_received": [m["payload"] for m in up2.take()],
            "lowered_session_present": down2.connack["session_present"]}


@scenario
def session_expiry_set_at_disconnect_after_zero_v5(ctx):
    """MQTT 5 3.14.2.2.2 [MQTT-3.14.2-2]: with Session Expiry 0 in CONNECT a
    non-zero one in DISCONNECT is a Protocol Error: not a valid DISCONNECT
    (so the will is published, 3.1.2.5) and no session is kept."""
    from ..raw import disconnect_packet

    t = ctx.topic("zw")
    obs = ctx.client("o", V5)
    obs.subscribe(t, qos=1)
    cid = ctx.session(ctx.client_id("z"), V5)
    r = ctx.raw(V5)
    will = {"topic": t, "payload": b"not a valid disconnect", "qos": 1}
    ack = r.connect(cid, clean=False, username=ctx.username, password=ctx.password, will=will,
                    properties={"session_expiry_interval": 0})
    assert ack["rc"] == 0, ack
    r.send(disconnect_packet(V5, 0, {"session_expiry_interval": 60}))
    outcome = r.outcome(5)
    obs.wait_messages(1)
    obs.sync()
    again = ctx.client("z2", V5, client_id=cid, clean=False, session_expiry=60)
    return {"outcome": error_class(outcome), "will": msgs(obs.take()),
            "session_present": again.connack["session_present"]}


def error_class(o: dict) -> str:
    """A DISCONNECT with a protocol-error reason, or a plain close."""
    if o.get("disconnect") in (0x81, 0x82):
        return "protocol error"
    if o.get("closed") and "disconnect" not in o:
        return "closed"
    return f"unexpected {o}"


@both
def unacknowledged_qos1_resent_on_reconnect(ctx, v):
    """MQTT 4.4: a QoS 1 message delivered but not acknowledged when the
    connection dropped is sent again on reconnect of the persistent session,
    with DUP=1; once acknowledged it does not come back."""
    t = ctx.topic("u")
    cid = ctx.session(ctx.client_id("r"), v)
    props = {"session_expiry_interval": 300} if v == V5 else None
    r = ctx.raw(v)
    r.connect(cid, clean=(v == V5), username=ctx.username, password=ctx.password, properties=props)
    r.send(subscribe_packet([(t, 1)], version=v))
    r.expect(SUBACK)
    pub = ctx.client("p", v)
    pub.publish(t, "unacked", 1)
    p1 = r.expect(PUBLISH, auto_ack=False)
    r.drop()  # no PUBACK
    r2 = ctx.raw(v)
    ack = r2.connect(cid, clean=False, username=ctx.username, password=ctx.password, properties=props)
    p2 = r2.expect(PUBLISH, auto_ack=False)
    r2.send(ack_packet(4, p2["pid"], v))
    r2.drop()
    r3 = ctx.raw(v)
    r3.connect(cid, clean=False, username=ctx.username, password=ctx.password, properties=props)
    pub.publish(t, "marker", 1)
    p3 = r3.expect(PUBLISH, auto_ack=False)
    return {"first": [p1["payload"].decode(), p1["dup"]], "session_present": ack["session_present"],
            "resent": [p2["payload"].decode(), p2["dup"], p2["pid"] == p1["pid"]],
            "after_ack": p3["payload"].decode()}


@both
def unacknowledged_qos1_resent_with_its_packet_id(ctx, v):
    """MQTT-4.4.0-1: on reconnect of a persistent session the server re-sends
    unacknowledged PUBLISH packets using their original packet identifiers.
    The first of two deliveries is acknowledged, so the one sent again had
    an id a new connection would not pick first."""
    t = ctx.topic("u")
    cid = ctx.session(ctx.client_id("r"), v)
    props = {"session_expiry_interval": 300} if v == V5 else None
    r = ctx.raw(v)
    r.connect(cid, clean=(v == V5), username=ctx.username, password=ctx.password, properties=props)
    r.send(subscribe_packet([(t, 1)], version=v))
    r.expect(SUBACK)
    pub = ctx.client("p", v)
    pub.publish(t, "acked", 1)
    pub.publish(t, "unacked", 1)
    p1 = r.expect(PUBLISH, auto_ack=False)
    p2 = r.expect(PUBLISH, auto_ack=False)
    r.send(ack_packet(4, p1["pid"], v))
    r.drop()  # the second never acknowledged
    r2 = ctx.raw(v)
    r2.connect(cid, clean=False, username=ctx.username, password=ctx.password, properties=props)
    again = r2.expect(PUBLISH, auto_ack=False)
    r2.send(ack_packet(4, again["pid"], v))
    return {"first_ids_differ": p1["pid"] != p2["pid"],
            "resent": [again["payload"].decode(), again["dup"], again["pid"] == p2["pid"]]}


@both
def qos2_delivery_resumes_on_reconnect(ctx, v):
    """MQTT 4.3.3 / 4.4: a QoS 2 delivery interrupted before PUBREC is
    resent as PUBLISH with DUP=1; interrupted after PUBREC it resumes with
    PUBREL (never a second PUBLISH); PUBCOMP completes it."""
    t = ctx.topic("q2")
    cid = ctx.session(ctx.client_id("r"), v)
    props = {"session_expiry_interval": 300} if v == V5 else None

    def connect():
        r = ctx.raw(v)
        ack = r.connect(cid, clean=False, username=ctx.username, password=ctx.password, properties=props)
        return r, ack

    r = ctx.raw(v)
    r.connect(cid, clean=(v == V5), username=ctx.username, password=ctx.password, properties=props)
    r.send(subscribe_packet([(t, 2)], version=v))
    r.expect(SUBACK)
    pub = ctx.client("p", v)
    pub.publish(t, "exactly-once", 2)
    p1 = r.read()
    r.drop()  # before PUBREC
    r, ack = connect()
    p2 = r.read()
    r.send(ack_packet(PUBREC, p2["pid"], v))
    rel = r.read()
    r.drop()  # before PUBCOMP
    r, _ = connect()
    p3 = r.read()
    r.send(ack_packet(PUBCOMP, p3["pid"], v))
    pub.publish(t, "next", 2)
    p4 = r.read()
    return {
        "first": [p1["type"], p1.get("dup")],
        "session_present": ack["session_present"],
        "after_drop_before_pubrec": [p2["type"], p2.get("dup"), p2["payload"].decode(), p2["pid"] == p1["pid"]],
        "pubrel": rel["type"],
        "after_drop_before_pubcomp": [p3["type"], p3["pid"] == p1["pid"]],
        "next": [p4["type"], p4.get("payload", b"").decode()],
    }
