"""Helpers that turn what a client saw into stable transcript facts."""
from __future__ import annotations

from ..harness import V5

# MQTT 5 CONNACK properties and the value a client assumes when absent
# (MQTT 5 section 3.2.2.3): a broker that sends the default explicitly and
# one that leaves it out announce the same thing.
CONNACK_DEFAULTS = {
    "receive_maximum": 65535,
    "maximum_packet_size": "unlimited",
    "topic_alias_maximum": 0,
    "maximum_qos": 2,
    "retain_available": 1,
    "wildcard_subscription_available": 1,
    "subscription_identifier_available": 1,
    "shared_subscription_available": 1,
}

# The specification separates Malformed Packet (0x81) from Protocol Error
# (0x82), but for several faults (a bad topic filter, a SUBSCRIBE without
# filters, a wildcard in a topic name) either reading of the text is
# defensible and brokers differ; the scenarios compare the class.
ERROR_CLASS = {0x81: "malformed or protocol error", 0x82: "malformed or protocol error",
               0x90: "malformed or protocol error"}


def connack_facts(ack: dict, version: int, keepalive: int = 60) -> dict:
    """rc and session_present, and for MQTT 5 the effective limits."""
    out = {"rc": ack["rc"], "session_present": ack["session_present"]}
    if version == V5:
        p = ack.get("props", {})
        out["limits"] = {k: p.get(k, d) for k, d in CONNACK_DEFAULTS.items()}
        out["limits"]["server_keep_alive"] = p.get("server_keep_alive", keepalive)
        out["assigned_client_identifier"] = bool(p.get("assigned_client_identifier"))
    return out


def error_outcome(o: dict, classes: dict | None = None) -> dict:
    """A raw client's outcome() with DISCONNECT reason codes grouped by
    ``classes`` (default ERROR_CLASS); codes outside it stay as numbers."""
    classes = ERROR_CLASS if classes is None else classes
    if "disconnect" in o:
        rc = o["disconnect"]
        return {"disconnect": classes.get(rc, rc), "closed": o["closed"]}
    return o


def refused(o: dict) -> dict:
    """A server may answer a bad packet with a negative SUBACK code, a
    DISCONNECT with a reason, or by just closing: all refuse it."""
    if o.get("disconnect") is not None and o["disconnect"] < 0x80:
        return {"refused": False, "disconnect": o["disconnect"]}  # a success code is no refusal
    if o.get("closed") or o.get("disconnect") is not None:
        return {"refused": True, "closed": bool(o.get("closed"))}
    if o.get("packet") == "SUBACK":
        return {"refused": all(rc >= 0x80 for rc in o.get("rcs", [])), "closed": False}
    return {"refused": False, **o}


def msgs(ms: list[dict], *keys) -> list:
    """Messages reduced to (topic, payload, qos, retain) lists, or the keys
    given."""
    keys = keys or ("topic", "payload", "qos", "retain")
    return [[m[k] for k in keys] for m in ms]
