#!/usr/bin/env python3
"""Writes the seed inputs of the fuzz targets (fuzz/seeds/<target>/): valid
conversations and payloads the fuzzer mutates from, so a short CI run starts
past the handshake. Re-run after changing it; the outputs are committed."""
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))


def short(s):
    return bytes([len(s)]) + s


def long(s):
    return struct.pack(">I", len(s)) + s


def frame(kind, ch, payload):
    return bytes([kind]) + struct.pack(">HI", ch, len(payload)) + payload + b"\xce"


def method(ch, cls, mid, args=b""):
    return frame(1, ch, struct.pack(">HH", cls, mid) + args)


def table(entries):
    body = b"".join(short(k) + v for k, v in entries)
    return long(body)


ARGS = table([(b"x-max-length", b"I" + struct.pack(">i", 10)),
              (b"x-dead-letter-exchange", b"S" + long(b"dlx")),
              (b"nested", b"A" + long(b"t\x01" + b"F" + table([(b"a", b"V")])))])


def header(ch, size, props=b"\x00\x00"):
    return frame(2, ch, struct.pack(">HHQ", 60, 0, size) + props)


def props_with_headers():
    # content-type, headers, delivery-mode 2
    flags = (1 << 15) | (1 << 13) | (1 << 12)
    return struct.pack(">H", flags) + short(b"text/plain") + ARGS + b"\x02"


def publish(ch, ex=b"", rk=b"q"):
    return method(ch, 60, 40, b"\x00\x00" + short(ex) + short(rk) + b"\x00")


def write(target, name, data):
    d = os.path.join(HERE, target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


# amqp_connection: first byte = options (bit 0: canned handshake and channels
# 1..3 open; bits 1-3: chunk size 4^n; bit 4: copy small messages).
conv = (publish(1) + header(1, 5, props_with_headers()) + frame(3, 1, b"hello")
        + publish(2) + header(2, 6) + frame(3, 2, b"abc") + frame(3, 2, b"def")
        + method(1, 60, 80, struct.pack(">QB", 1, 0))
        + method(1, 60, 10, struct.pack(">IHB", 0, 10, 0)))
write("amqp_connection", "publish", b"\x01" + conv)
write("amqp_connection", "publish_chunked", b"\x03" + conv)
write("amqp_connection", "publish_copied", b"\x11" + conv)
defs = (method(1, 50, 10, b"\x00\x00" + short(b"q") + b"\x02" + ARGS)
        + method(1, 40, 10, b"\x00\x00" + short(b"x") + short(b"topic") + b"\x00" + ARGS)
        + method(1, 50, 20, b"\x00\x00" + short(b"q") + short(b"x") + short(b"a.#") + b"\x00" + ARGS)
        + method(1, 60, 20, b"\x00\x00" + short(b"q") + short(b"t") + b"\x00" + ARGS)
        + method(3, 20, 40, struct.pack(">H", 200) + short(b"bye") + b"\x00\x00\x00\x00")
        + method(0, 10, 50, struct.pack(">H", 200) + short(b"bye") + b"\x00\x00\x00\x00"))
write("amqp_connection", "definitions", b"\x01" + defs)
partial = publish(1) + header(1, 40000) + frame(3, 1, b"x" * 3000) + publish(2) + header(2, 40000) + frame(3, 2, b"y" * 3000)
write("amqp_connection", "partial", b"\x01" + partial)
amqplain = short(b"LOGIN") + b"S" + long(b"guest") + short(b"PASSWORD") + b"S" + long(b"guest")
login = method(0, 10, 11, table([(b"product", b"S" + long(b"fuzz"))]) + short(b"AMQPLAIN") + long(amqplain) + short(b"en_US"))
write("amqp_connection", "amqplain_login", b"\x00" + login + method(0, 10, 31, struct.pack(">HIH", 0, 4096, 0)) + method(0, 10, 40, short(b"/") + b"\x00\x00"))

# amqp_method: class id, method id, arguments.
def first_payload(frames):
    size = struct.unpack(">I", frames[3:7])[0]
    return frames[7:7 + size]


for name, m in [("queue_declare", defs), ("start_ok", login)]:
    write("amqp_method", name, first_payload(m))
write("amqp_method", "exchange_declare", struct.pack(">HH", 40, 10) + b"\x00\x00" + short(b"x") + short(b"topic") + b"\x00" + ARGS)
write("amqp_method", "start", struct.pack(">HHBB", 10, 10, 0, 9) + ARGS + long(b"PLAIN AMQPLAIN") + long(b"en_US"))

# field_table: a table with its length prefix; a property block.
write("field_table", "table", ARGS)
write("field_table", "properties", props_with_headers())

# sasl: first byte picks the mechanism (0 PLAIN, 1 AMQPLAIN).
write("sasl", "plain", b"\x00" + b"\x00guest\x00guest")
write("sasl", "amqplain", b"\x01" + amqplain)
