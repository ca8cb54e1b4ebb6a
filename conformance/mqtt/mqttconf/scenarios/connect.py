"""CONNECT / CONNACK: acceptance, refusals, client identifiers, protocol
levels."""
from __future__ import annotations

from ..harness import V3, V5, both, differs, scenario
from ..raw import SUBACK, connect_packet, disconnect_packet, publish_packet, subscribe_packet
from .util import connack_facts, refused


@both
def connect_accepts(ctx, v):
    """guest/guest with a clean session: rc 0, no session present; MQTT 5
    also the limits the broker announces (equal configuration on both)."""
    r = ctx.raw(v)
    ack = r.connect(ctx.client_id("a"), username=ctx.username, password=ctx.password)
    return connack_facts(ack, v)


@differs(
    "MQTT 5 3.2.2.2 / 3.1.1 3.2.2.3: a wrong password or unknown user name is 0x86 'Bad User Name or "
    "Password' (3.1.1: return code 4); Mosquitto 2.0 answers 0x87 'Not authorized' (3.1.1: 5)",
    reference={"v3": {"rc": 5, "closed": True, "session_present": False},
               "v5": {"rc": 135, "closed": True, "session_present": False},
               "v3_unknown_user": {"rc": 5, "closed": True, "session_present": False},
               "v5_unknown_user": {"rc": 135, "closed": True, "session_present": False}},
    candidate={"v3": {"rc": 4, "closed": True, "session_present": False},
               "v5": {"rc": 134, "closed": True, "session_present": False},
               "v3_unknown_user": {"rc": 4, "closed": True, "session_present": False},
               "v5_unknown_user": {"rc": 134, "closed": True, "session_present": False}},
)
def connect_bad_credentials(ctx):
    out = {}
    for name, v, user in (("v3", V3, ctx.username), ("v5", V5, ctx.username),
                          ("v3_unknown_user", V3, "nobody-" + ctx.run_id),
                          ("v5_unknown_user", V5, "nobody-" + ctx.run_id)):
        r = ctx.raw(v)
        ack = r.connect(ctx.client_id("b"), username=user, password="not-the-password")
        out[name] = {"rc": ack["rc"], "session_present": ack["session_present"], "closed": r.wait_closed()}
    return out


@scenario
def connect_empty_client_id_v3(ctx):
    """3.1.1 3.1.3.1: an empty client id is accepted with CleanSession=1 and
    refused with return code 2 (identifier rejected) with CleanSession=0."""
    out = {}
    r = ctx.raw(V3)
    ack = r.connect("", clean=True, username=ctx.username, password=ctx.password)
    out["clean"] = {"rc": ack["rc"], "session_present": ack["session_present"]}
    r.send(disconnect_packet(V3))
    r2 = ctx.raw(V3)
    ack = r2.connect("", clean=False, username=ctx.username, password=ctx.password)
    out["persistent"] = {"rc": ack["rc"], "session_present": ack["session_present"], "closed": r2.wait_closed()}
    return out


@scenario
def connect_empty_client_id_v5(ctx):
    """MQTT 5 3.2.2.3.7: an empty client id gets an Assigned Client
    Identifier, which then works as any client id (a persistent session
    under it is found again)."""
    r = ctx.raw(V5)
    ack = r.connect("", clean=True, username=ctx.username, password=ctx.password,
                    properties={"session_expiry_interval": 60})
    assigned = ack.get("props", {}).get("assigned_client_identifier", "")
    out = {"rc": ack["rc"], "assigned": bool(assigned)}
    if assigned:
        ctx.session(assigned, V5)
    r.send(disconnect_packet(V5))
    r.wait_closed()
    r2 = ctx.raw(V5)
    ack2 = r2.connect(assigned, clean=False, username=ctx.username, password=ctx.password,
                      properties={"session_expiry_interval": 60})
    out["reconnect"] = {"rc": ack2["rc"], "session_present": ack2["session_present"],
                        "assigned_again": "assigned_client_identifier" in ack2.get("props", {})}
    return out


@both
def connect_unsupported_protocol_level(ctx, v):
    """A protocol level the server does not speak (6): CONNACK 'unacceptable
    protocol level' (3.1.1 rc 1; MQTT 5 0x84) and close. The CONNACK's
    format depends on which level the server answers in, so the code is
    reduced to the fact."""
    r = ctx.raw(v)
    r.send(connect_packet(ctx.client_id("p"), version=6, username=ctx.username, password=ctx.password))
    o = r.outcome(5)
    if o.get("packet") == "CONNACK":
        return {"connack": "unsupported protocol version" if o.get("rc") in (1, 0x84) else o.get("rc"),
                "closed": r.wait_closed()}
    return o


@both
def connect_reserved_flag(ctx, v):
    """The CONNECT flags' reserved bit set: malformed, the server closes
    (MQTT 5 may send CONNACK 0x81 first)."""
    r = ctx.raw(v)
    r.send(connect_packet(ctx.client_id("r"), version=v, reserved_flag=True, username=ctx.username,
                          password=ctx.password))
    o = r.outcome(5)
    if o.get("packet") == "CONNACK" and o.get("rc", 0) >= 0x80:
        return {"refused": True, "closed": r.wait_closed()}
    return refused(o)


@both
def connect_first_packet_not_connect(ctx, v):
    """The first packet must be CONNECT; anything else closes."""
    r = ctx.raw(v)
    r.send(publish_packet(ctx.topic("x"), b"x", 0, version=v))
    return refused(r.outcome(5))


@scenario
def connect_second_connect_v3(ctx):
    """3.1.1 3.1.0-2: a second CONNECT is a protocol violation: close."""
    r = ctx.raw(V3)
    r.connect(ctx.client_id("s"), username=ctx.username, password=ctx.password)
    r.send(connect_packet(ctx.client_id("s"), version=V3, username=ctx.username, password=ctx.password))
    return r.outcome(5)


@differs(
    "MQTT 5 3.1.0-2 and 4.13.1: a second CONNECT is a Protocol Error; the server may send DISCONNECT 0x82 "
    "before closing and issue 8 asks Weir to; Mosquitto 2.0 closes without it",
    reference={"closed": True},
    candidate={"disconnect": 130, "closed": True},
)
def connect_second_connect_v5(ctx):
    r = ctx.raw(V5)
    r.connect(ctx.client_id("s"), username=ctx.username, password=ctx.password)
    r.send(connect_packet(ctx.client_id("s"), version=V5, username=ctx.username, password=ctx.password))
    return r.outcome(5)


@both
def connect_keepalive_ping(ctx, v):
    """PINGREQ is answered by PINGRESP."""
    r = ctx.raw(v)
    r.connect(ctx.client_id("k"), username=ctx.username, password=ctx.password, keepalive=30)
    r.send(bytes([0xC0, 0]))
    return {"answer": r.read()["type"]}


def _takeover(ctx, v):
    cid = ctx.session(ctx.client_id("t"), v)
    props = {"session_expiry_interval": 300} if v == V5 else None
    a = ctx.raw(v)
    # 3.1.1: CleanSession=0 makes the session persistent; 5: the expiry does.
    ack_a = a.connect(cid, clean=(v == V5), username=ctx.username, password=ctx.password, properties=props)
    t = ctx.topic("t")
    a.send(subscribe_packet([(t, 1)], version=v))
    sub = a.expect(SUBACK)["rcs"]
    b = ctx.client("b", v, client_id=cid, clean=False, session_expiry=300 if v == V5 else None, connect=False)
    ack_b = b.connect()
    first = a.outcome(10)
    pub = ctx.client("p", v)
    pub.publish(t, "after takeover", 1)
    got = b.wait_messages(1)
    return {"first_connack": ack_a["rc"], "suback": sub, "second_connack": ack_b["rc"],
            "session_present": ack_b["session_present"], "first_connection": first,
            "second_receives": [[m["topic"], m["payload"]] for m in got]}


_TAKEOVER = {"first_connack": 0, "suback": [1], "second_connack": 0, "session_present": True,
             "second_receives": [["~/t", "after takeover"]]}


@scenario
def session_takeover_v3(ctx):
    """A second CONNECT with the same client id takes the session over: the
    first connection is closed, the newcomer finds the persistent session
    and its subscription."""
    return _takeover(ctx, V3)


@differs(
    "MQTT 5 3.1.4-3 / 4.13: the server sends DISCONNECT 0x8E 'Session taken over' to the existing client "
    "before closing it; Mosquitto 2.0.11 closes it without",
    reference={**_TAKEOVER, "first_connection": {"closed": True}},
    candidate={**_TAKEOVER, "first_connection": {"disconnect": 142, "closed": True}},
)
def session_takeover_v5(ctx):
    """As session_takeover_v3, over MQTT 5."""
    return _takeover(ctx, V5)
