"""A raw MQTT 3.1.1 / 5 client over a plain socket.

For what paho hides or refuses to send: the exact CONNACK return code of a
3.1.1 refusal, a client that vanishes without DISCONNECT (wills), DISCONNECT
packets the server sends (takeover 0x8E, protocol errors), and malformed or
forbidden packets (QoS 3, a second CONNECT, wildcards in a topic name, an
unknown topic alias, more QoS 2 publishes in flight than the server allows,
a packet over the server's maximum size).

Only the encodings the scenarios need; every read has a time limit.
"""
from __future__ import annotations

import socket
import struct
import time

# Packet types (high nibble of the fixed header).
CONNECT, CONNACK, PUBLISH, PUBACK, PUBREC, PUBREL, PUBCOMP = 1, 2, 3, 4, 5, 6, 7
SUBSCRIBE, SUBACK, UNSUBSCRIBE, UNSUBACK, PINGREQ, PINGRESP, DISCONNECT, AUTH = 8, 9, 10, 11, 12, 13, 14, 15

TYPE_NAMES = {
    1: "CONNECT", 2: "CONNACK", 3: "PUBLISH", 4: "PUBACK", 5: "PUBREC", 6: "PUBREL", 7: "PUBCOMP",
    8: "SUBSCRIBE", 9: "SUBACK", 10: "UNSUBSCRIBE", 11: "UNSUBACK", 12: "PINGREQ", 13: "PINGRESP",
    14: "DISCONNECT", 15: "AUTH",
}

# MQTT 5 property identifiers -> (name, kind).
PROPS = {
    0x01: ("payload_format_indicator", "byte"),
    0x02: ("message_expiry_interval", "u32"),
    0x03: ("content_type", "str"),
    0x08: ("response_topic", "str"),
    0x09: ("correlation_data", "bin"),
    0x0B: ("subscription_identifier", "varint"),
    0x11: ("session_expiry_interval", "u32"),
    0x12: ("assigned_client_identifier", "str"),
    0x13: ("server_keep_alive", "u16"),
    0x15: ("authentication_method", "str"),
    0x16: ("authentication_data", "bin"),
    0x17: ("request_problem_information", "byte"),
    0x18: ("will_delay_interval", "u32"),
    0x19: ("request_response_information", "byte"),
    0x1A: ("response_information", "str"),
    0x1C: ("server_reference", "str"),
    0x1F: ("reason_string", "str"),
    0x21: ("receive_maximum", "u16"),
    0x22: ("topic_alias_maximum", "u16"),
    0x23: ("topic_alias", "u16"),
    0x24: ("maximum_qos", "byte"),
    0x25: ("retain_available", "byte"),
    0x26: ("user_property", "pair"),
    0x27: ("maximum_packet_size", "u32"),
    0x28: ("wildcard_subscription_available", "byte"),
    0x29: ("subscription_identifier_available", "byte"),
    0x2A: ("shared_subscription_available", "byte"),
}
PROP_IDS = {name: (pid, kind) for pid, (name, kind) in PROPS.items()}


class Closed(Exception):
    """The server closed the connection."""


class Timeout(Exception):
    """Nothing (or not all of a packet) arrived in time."""


class Malformed(Exception):
    """The server sent bytes this decoder cannot read."""


# --------------------------------------------------------------------------
# encoding


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n % 128
        n //= 128
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def s(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("!H", len(raw)) + raw


def props(p: dict | None) -> bytes:
    """Encodes a property dict (names as in PROPS; user_property is a list of
    pairs, subscription_identifier may be an int)."""
    body = bytearray()
    for name, value in (p or {}).items():
        pid, kind = PROP_IDS[name]
        values = value if kind == "pair" else [value]
        for v in values:
            body += varint(pid)
            if kind == "byte":
                body.append(v)
            elif kind == "u16":
                body += struct.pack("!H", v)
            elif kind == "u32":
                body += struct.pack("!I", v)
            elif kind == "varint":
                body += varint(v)
            elif kind in ("str", "bin"):
                body += s(v)
            elif kind == "pair":
                body += s(v[0]) + s(v[1])
    return varint(len(body)) + bytes(body)


def packet(ptype: int, flags: int, body: bytes) -> bytes:
    return bytes([(ptype << 4) | flags]) + varint(len(body)) + body


def connect_packet(client_id: str, version: int = 5, clean: bool = True, keepalive: int = 60,
                   username: str | None = "guest", password: str | None = "guest",
                   will: dict | None = None, properties: dict | None = None,
                   protocol_name: str = "MQTT", reserved_flag: bool = False) -> bytes:
    """CONNECT. ``will``: {topic, payload, qos, retain, properties}."""
    flags = 0
    if reserved_flag:
        flags |= 0x01
    if clean:
        flags |= 0x02
    if will is not None:
        flags |= 0x04 | (will.get("qos", 0) << 3) | (0x20 if will.get("retain") else 0)
    if password is not None:
        flags |= 0x40
    if username is not None:
        flags |= 0x80
    body = s(protocol_name) + bytes([version, flags]) + struct.pack("!H", keepalive)
    if version == 5:
        body += props(properties)
    body += s(client_id)
    if will is not None:
        if version == 5:
            body += props(will.get("properties"))
        body += s(will["topic"]) + s(will.get("payload", b""))
    if username is not None:
        body += s(username)
    if password is not None:
        body += s(password)
    return packet(CONNECT, 0, body)


def publish_packet(topic: str, payload: bytes = b"", qos: int = 0, retain: bool = False, pid: int = 1,
                   version: int = 5, properties: dict | None = None, dup: bool = False) -> bytes:
    flags = (qos << 1) | (1 if retain else 0) | (8 if dup else 0)
    body = s(topic)
    if qos:
        body += struct.pack("!H", pid)
    if version == 5:
        body += props(properties)
    return packet(PUBLISH, flags, body + payload)


def subscribe_packet(filters: list, pid: int = 1, version: int = 5, properties: dict | None = None) -> bytes:
    """``filters``: [(filter, options byte)]; options = qos | nl<<2 | rap<<3 | rh<<4."""
    body = struct.pack("!H", pid)
    if version == 5:
        body += props(properties)
    for f, opts in filters:
        body += s(f) + bytes([opts])
    return packet(SUBSCRIBE, 2, body)


def ack_packet(ptype: int, pid: int, version: int = 5, reason: int | None = None) -> bytes:
    flags = 2 if ptype == PUBREL else 0
    body = struct.pack("!H", pid)
    if version == 5 and reason is not None:
        body += bytes([reason]) + props(None)
    return packet(ptype, flags, body)


def disconnect_packet(version: int = 5, reason: int | None = None, properties: dict | None = None) -> bytes:
    if version == 5 and (reason is not None or properties):
        return packet(DISCONNECT, 0, bytes([reason or 0]) + props(properties))
    return packet(DISCONNECT, 0, b"")


# --------------------------------------------------------------------------
# decoding


def read_varint(buf: bytes, i: int) -> tuple[int, int]:
    mult, value = 1, 0
    for _ in range(4):
        if i >= len(buf):
            raise Malformed("truncated varint")
        b = buf[i]
        i += 1
        value += (b & 0x7F) * mult
        if not b & 0x80:
            return value, i
        mult *= 128
    raise Malformed("varint longer than 4 bytes")


def read_str(buf: bytes, i: int) -> tuple[bytes, int]:
    if i + 2 > len(buf):
        raise Malformed("truncated length")
    n = struct.unpack_from("!H", buf, i)[0]
    if i + 2 + n > len(buf):
        raise Malformed("truncated string")
    return buf[i + 2:i + 2 + n], i + 2 + n


def read_props(buf: bytes, i: int) -> tuple[dict, int]:
    n, i = read_varint(buf, i)
    end = i + n
    out: dict = {}
    while i < end:
        pid, i = read_varint(buf, i)
        if pid not in PROPS:
            raise Malformed(f"unknown property {pid:#x}")
        name, kind = PROPS[pid]
        if kind == "byte":
            v, i = buf[i], i + 1
        elif kind == "u16":
            v, i = struct.unpack_from("!H", buf, i)[0], i + 2
        elif kind == "u32":
            v, i = struct.unpack_from("!I", buf, i)[0], i + 4
        elif kind == "varint":
            v, i = read_varint(buf, i)
        elif kind == "str":
            raw, i = read_str(buf, i)
            v = raw.decode("utf-8", "replace")
        elif kind == "bin":
            v, i = read_str(buf, i)
        else:  # pair
            k, i = read_str(buf, i)
            val, i = read_str(buf, i)
            v = (k.decode("utf-8", "replace"), val.decode("utf-8", "replace"))
        if kind == "pair" or name == "subscription_identifier":
            out.setdefault(name, []).append(v)
        else:
            out[name] = v
    return out, end


def decode(ptype: int, flags: int, body: bytes, version: int) -> dict:
    """The fields of one packet as a dict (``type`` is its name)."""
    p: dict = {"type": TYPE_NAMES.get(ptype, str(ptype))}
    if ptype == CONNACK:
        p["session_present"] = bool(body[0] & 1)
        p["rc"] = body[1]
        if version == 5 and len(body) > 2:
            p["props"], _ = read_props(body, 2)
    elif ptype == PUBLISH:
        qos = (flags >> 1) & 3
        p.update(qos=qos, retain=bool(flags & 1), dup=bool(flags & 8))
        topic, i = read_str(body, 0)
        p["topic"] = topic.decode("utf-8", "replace")
        if qos:
            p["pid"] = struct.unpack_from("!H", body, i)[0]
            i += 2
        if version == 5:
            p["props"], i = read_props(body, i)
        p["payload"] = body[i:]
    elif ptype in (PUBACK, PUBREC, PUBREL, PUBCOMP):
        p["pid"] = struct.unpack_from("!H", body, 0)[0]
        p["rc"] = body[2] if len(body) > 2 else 0
        if version == 5 and len(body) > 3:
            p["props"], _ = read_props(body, 3)
    elif ptype in (SUBACK, UNSUBACK):
        p["pid"] = struct.unpack_from("!H", body, 0)[0]
        i = 2
        if version == 5:
            p["props"], i = read_props(body, i)
        p["rcs"] = list(body[i:])
    elif ptype == DISCONNECT:
        p["rc"] = body[0] if body else 0
        if len(body) > 1:
            p["props"], _ = read_props(body, 1)
    return p


class RawClient:
    """One TCP connection speaking MQTT by hand."""

    def __init__(self, host: str, port: int, version: int = 5, timeout: float = 5.0):
        self.version = version
        self.timeout = timeout
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""
        self.closed = False

    def send(self, data: bytes) -> bool:
        """False when the server already closed the connection."""
        try:
            self.sock.sendall(data)
            return True
        except OSError:
            return False

    def _fill(self, n: int, deadline: float) -> None:
        while len(self.buf) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise Timeout()
            self.sock.settimeout(left)
            try:
                chunk = self.sock.recv(65536)
            except socket.timeout:
                raise Timeout() from None
            except OSError:  # reset by peer counts as closed
                chunk = b""
            if not chunk:
                self.closed = True
                raise Closed()
            self.buf += chunk

    def read(self, timeout: float | None = None) -> dict:
        """The next packet, decoded; raises Closed or Timeout."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        self._fill(2, deadline)
        # Remaining length: up to 4 bytes after the first.
        i = 1
        while True:
            self._fill(i + 1, deadline)
            if not self.buf[i] & 0x80 or i == 4:
                break
            i += 1
        length, start = read_varint(self.buf, 1)
        self._fill(start + length, deadline)
        first = self.buf[0]
        body = self.buf[start:start + length]
        self.buf = self.buf[start + length:]
        return decode(first >> 4, first & 0x0F, body, self.version)

    def expect(self, ptype: int, timeout: float | None = None, auto_ack: bool = True) -> dict:
        """Reads until a packet of ``ptype`` arrives; acknowledges QoS 1/2
        PUBLISHes met on the way (their contents are dropped)."""
        while True:
            p = self.read(timeout)
            if p["type"] == TYPE_NAMES[ptype]:
                return p
            if auto_ack and p["type"] == "PUBLISH":
                self.ack_publish(p)
            if auto_ack and p["type"] == "PUBREL":
                self.send(ack_packet(PUBCOMP, p["pid"], self.version))

    def ack_publish(self, p: dict) -> None:
        if p.get("qos") == 1:
            self.send(ack_packet(PUBACK, p["pid"], self.version))
        elif p.get("qos") == 2:
            self.send(ack_packet(PUBREC, p["pid"], self.version))

    def connect(self, client_id: str, **kw) -> dict:
        """Sends CONNECT and returns the CONNACK (raises Closed if the server
        hangs up instead)."""
        self.send(connect_packet(client_id, version=self.version, **kw))
        return self.expect(CONNACK)

    def outcome(self, timeout: float = 5.0) -> dict:
        """What the server does next after a bad packet: the DISCONNECT it
        sends (type, reason code) and whether it then closed, or that it
        closed at once, or that nothing happened in time."""
        try:
            while True:
                p = self.read(timeout)
                if p["type"] == "DISCONNECT":
                    closed = self.wait_closed(timeout)
                    return {"disconnect": p["rc"], "closed": closed}
                if p["type"] == "PUBLISH":
                    self.ack_publish(p)
                    continue
                return {"packet": p["type"], **({"rc": p["rc"]} if "rc" in p else {}),
                        **({"rcs": p["rcs"]} if "rcs" in p else {})}
        except Closed:
            return {"closed": True}
        except Timeout:
            return {"nothing": True}

    def wait_closed(self, timeout: float = 5.0) -> bool:
        """True when the server closes the connection within ``timeout``
        (anything it sends before is read and dropped)."""
        deadline = time.monotonic() + timeout
        try:
            while True:
                self.read(max(0.0, deadline - time.monotonic()))
        except Closed:
            return True
        except Timeout:
            return False

    def drop(self) -> None:
        """Vanish without DISCONNECT (RST rather than FIN is not needed: the
        server sees the socket close)."""
        try:
            self.sock.close()
        except OSError:
            pass

    def close(self) -> None:
        self.drop()
