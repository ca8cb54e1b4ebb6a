"""MQTT over WebSocket (issue 8): paho-mqtt's websocket transport against
weir's `/mqtt` endpoint, meeting a plain TCP MQTT client on the same broker."""
from __future__ import annotations

import queue
import socket
import uuid

import paho.mqtt.client as mqtt
import pytest

TIMEOUT = 10


def _client(transport: str, version, weir, name: str) -> tuple[mqtt.Client, "queue.Queue"]:
    got: "queue.Queue" = queue.Queue()
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"{name}-{uuid.uuid4().hex[:8]}",
                    transport=transport, protocol=version)
    c.username_pw_set("guest", "guest")
    if transport == "websockets":
        c.ws_set_options(path="/mqtt")
    connected: "queue.Queue" = queue.Queue()
    c.on_connect = lambda cl, ud, flags, rc, props=None: connected.put(rc)
    c.on_message = lambda cl, ud, msg: got.put((msg.topic, msg.payload, msg.qos))
    c.on_subscribe = lambda cl, ud, mid, rcs, props=None: got.put(("suback", mid))
    port = weir.ws_port if transport == "websockets" else weir.mqtt_port
    c.connect("127.0.0.1", port, keepalive=30)
    c.loop_start()
    rc = connected.get(timeout=TIMEOUT)
    assert not rc.is_failure, f"CONNACK {rc}"
    return c, got


@pytest.mark.parametrize("version", [mqtt.MQTTv311, mqtt.MQTTv5])
def test_websocket_client_meets_tcp_client(weir_mqtt, version):
    topic = f"ws/{uuid.uuid4().hex[:8]}/t"
    ws, ws_got = _client("websockets", version, weir_mqtt, "ws")
    tcp, tcp_got = _client("tcp", version, weir_mqtt, "tcp")
    try:
        ws.subscribe(topic, qos=1)
        assert ws_got.get(timeout=TIMEOUT)[0] == "suback"
        tcp.subscribe(topic, qos=1)
        assert tcp_got.get(timeout=TIMEOUT)[0] == "suback"
        # TCP → WebSocket, and a payload larger than one frame's worth.
        big = bytes(range(256)) * 1024
        tcp.publish(topic, big, qos=1).wait_for_publish(TIMEOUT)
        assert ws_got.get(timeout=TIMEOUT) == (topic, big, 1)
        assert tcp_got.get(timeout=TIMEOUT) == (topic, big, 1)
        # WebSocket → TCP.
        ws.publish(topic, b"from-ws", qos=1).wait_for_publish(TIMEOUT)
        assert tcp_got.get(timeout=TIMEOUT) == (topic, b"from-ws", 1)
        assert ws_got.get(timeout=TIMEOUT) == (topic, b"from-ws", 1)
    finally:
        for c in (ws, tcp):
            c.disconnect()
            c.loop_stop()


def test_websocket_other_paths_are_not_found(weir_mqtt):
    req = (
        "GET /other HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
        "Sec-WebSocket-Protocol: mqtt\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", weir_mqtt.ws_port), timeout=TIMEOUT) as s:
        s.sendall(req.encode())
        status = s.recv(4096).split(b"\r\n", 1)[0]
    assert b" 404 " in status, status
