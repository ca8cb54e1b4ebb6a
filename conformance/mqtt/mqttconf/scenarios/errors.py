"""Malformed packets and protocol errors, sent over a raw socket (paho
will not produce them). The server must refuse each and close the
connection; MQTT 5 lets it send a DISCONNECT with a reason code >= 0x80
first (which code, 0x81 or 0x82, varies between readings of the text, so
these scenarios compare the refusal; the codes the specification pins
down are in features.py and connect.py)."""
from __future__ import annotations

from ..harness import V3, V5, differs, scenario
from ..raw import packet, publish_packet, s, subscribe_packet
from .util import refused


def _props0(v):
    return b"\x00" if v == V5 else b""


# name -> fn(ctx, v) -> bytes sent after a successful CONNECT
CASES = {
    # 3.3.1.2: QoS 3 is malformed.
    "publish_qos3": lambda ctx, v: packet(3, 0b0110, s(ctx.topic("x")) + b"\x00\x01" + _props0(v) + b"x"),
    # 3.3.2-2: no wildcards in a topic name.
    "publish_wildcard_in_topic": lambda ctx, v: publish_packet(ctx.topic("a/+/b"), b"x", 0, version=v),
    # 1.5.4-2: no U+0000 in a UTF-8 string.
    "publish_nul_in_topic": lambda ctx, v: publish_packet(ctx.topic("a\x00b"), b"x", 0, version=v),
    # 1.5.4-1: ill-formed UTF-8 is malformed.
    "publish_invalid_utf8_topic": lambda ctx, v: packet(3, 0, s(ctx.topic("x").encode() + b"\xff\xfe")
                                                        + _props0(v) + b"x"),
    # 3.3.2-1 (5: 3.3.2-1 with no alias): a topic name must not be empty.
    "publish_empty_topic": lambda ctx, v: publish_packet("", b"x", 0, version=v),
    # 2.2.1-3 (5: 2.2.1-3): QoS 1 needs a non-zero packet identifier.
    "publish_packet_id_zero": lambda ctx, v: publish_packet(ctx.topic("x"), b"x", 1, pid=0, version=v),
    # 3.8.1-1: SUBSCRIBE's fixed header flags must be 0010.
    "subscribe_bad_header_flags": lambda ctx, v: bytes([0x80]) + subscribe_packet([(ctx.topic("x"), 1)], version=v)[1:],
    # 3.8.3-2: at least one filter.
    "subscribe_without_filters": lambda ctx, v: packet(8, 2, b"\x00\x01" + _props0(v)),
    # 3.8.3-4 / 3.8.3-5: QoS 3 (and reserved option bits) are malformed.
    "subscribe_qos3_option": lambda ctx, v: subscribe_packet([(ctx.topic("x"), 3)], version=v),
    # 3.10.3-2: UNSUBSCRIBE needs at least one filter.
    "unsubscribe_without_filters": lambda ctx, v: packet(10, 2, b"\x00\x01" + _props0(v)),
    # 3.6.1-1: PUBREL's fixed header flags must be 0010.
    "pubrel_bad_header_flags": lambda ctx, v: bytes([0x60, 2, 0, 1]),
    # 2.1.2: packet type 0 is reserved.
    "reserved_packet_type": lambda ctx, v: bytes([0x00, 0]),
    # 1.5.5: a Variable Byte Integer has at most 4 bytes.
    "remaining_length_over_4_bytes": lambda ctx, v: bytes([0x30, 0xFF, 0xFF, 0xFF, 0xFF, 0x7F]),
}


def _register(name, build, v):
    def run(ctx):
        r = ctx.raw(v)
        ack = r.connect(ctx.client_id("m"), username=ctx.username, password=ctx.password)
        assert ack["rc"] == 0, ack
        r.send(build(ctx, v))
        return refused(r.outcome(5))
    run.__doc__ = f"{name.replace('_', ' ')}: refused, connection closed."
    scenario(run, f"malformed_{name}_{'v3' if v == V3 else 'v5'}")


for _name, _build in CASES.items():
    for _v in (V3, V5):
        _register(_name, _build, _v)


INVALID_FILTERS = ["a/#/b", "a/b#", "a+/b", "a/+b", ""]


def _invalid_filters(ctx, v):
    out = {}
    for f in INVALID_FILTERS:
        r = ctx.raw(v)
        r.connect(ctx.client_id("f"), username=ctx.username, password=ctx.password)
        topic_filter = ctx.topic(f) if f else ""
        r.send(subscribe_packet([(topic_filter, 1)], version=v))
        o = refused(r.outcome(5))
        # A negative SUBACK (MQTT 5: 0x8F) and a close both refuse it.
        out[f or "(empty)"] = o["refused"]
    return out


@scenario
def subscribe_invalid_filters_v3(ctx):
    """4.7.1: '#' only last and alone in its level, '+' alone in its level,
    no empty filter: each is refused (SUBACK failure or close)."""
    return _invalid_filters(ctx, V3)


@scenario
def subscribe_invalid_filters_v5(ctx):
    """As subscribe_invalid_filters_v3, over MQTT 5."""
    return _invalid_filters(ctx, V5)


@differs(
    "MQTT 5 4.8.2-1/-2: a shared subscription filter is $share/<ShareName>/<filter>; '$share/<name>' with no "
    "filter is invalid (SUBACK 0x8F or a Protocol Error); Mosquitto 2.0.11 accepts it as a plain filter",
    reference={"no_filter": False, "wildcard_in_share_name": True},
    candidate={"no_filter": True, "wildcard_in_share_name": True},
)
def shared_subscription_invalid_filter_v5(ctx):
    out = {}
    for name, f in (("no_filter", f"$share/g{ctx.run_id}"), ("wildcard_in_share_name", f"$share/g+/{ctx.topic('x')}")):
        r = ctx.raw(V5)
        r.connect(ctx.client_id("f"), username=ctx.username, password=ctx.password)
        r.send(subscribe_packet([(f, 1)]))
        out[name] = refused(r.outcome(5))["refused"]
    return out
