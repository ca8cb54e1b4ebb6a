"""A synchronous wrapper around a paho-mqtt 2.x client for scenarios.

Every operation waits for the broker's answer (CONNACK, SUBACK, PUBACK /
PUBCOMP, UNSUBACK) with a time limit. Received messages are kept in
arrival order, normalized (topic relative to the scenario prefix, payload
as text, MQTT 5 properties by name).

``sync()`` is the ordering fence of the scenarios: the client publishes a
marker to a topic only it subscribes to and waits for it. The broker
forwards a client's messages in order, so when the marker is back,
everything the broker delivered to this client before it has arrived too;
a message that did not come by then was not sent. A publisher calls
``sync()`` after QoS 0 publishes so they are processed before a subscriber
checks. No sleeps stand in for that.

The network loop is our own thread calling ``client.loop()`` rather than
paho's ``loop_start()``, whose thread reconnects after an unexpected
disconnect (it would fight a session takeover and resend wills).
"""
from __future__ import annotations

import threading
import time

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.subscribeoptions import SubscribeOptions

from .harness import V3, V5

WAIT = 10.0  # seconds any single broker answer may take

# paho property attribute -> transcript name
PROP_NAMES = {
    "PayloadFormatIndicator": "payload_format_indicator",
    "MessageExpiryInterval": "message_expiry_interval",
    "ContentType": "content_type",
    "ResponseTopic": "response_topic",
    "CorrelationData": "correlation_data",
    "SubscriptionIdentifier": "subscription_identifier",
    "UserProperty": "user_property",
    "TopicAlias": "topic_alias",
}
# transcript/keyword name -> paho attribute, for properties we send
ATTR = {v: k for k, v in PROP_NAMES.items()} | {
    "session_expiry_interval": "SessionExpiryInterval",
    "receive_maximum": "ReceiveMaximum",
    "maximum_packet_size": "MaximumPacketSize",
    "topic_alias_maximum": "TopicAliasMaximum",
    "will_delay_interval": "WillDelayInterval",
    "request_response_information": "RequestResponseInformation",
    "request_problem_information": "RequestProblemInformation",
}


class BrokerTimeout(Exception):
    """The broker did not answer within WAIT seconds."""


def make_props(packet_type: int, values: dict | None) -> Properties | None:
    if not values:
        return None
    p = Properties(packet_type)
    for k, v in values.items():
        setattr(p, ATTR[k], v)
    return p


def read_props(props) -> dict:
    out = {}
    if props is None:
        return out
    for attr, name in PROP_NAMES.items():
        if hasattr(props, attr):
            v = getattr(props, attr)
            if attr == "CorrelationData":
                v = bytes(v).hex()  # binary: every byte value is legal
            elif isinstance(v, (bytes, bytearray)):
                v = bytes(v).decode("utf-8", "replace")
            elif attr == "UserProperty":
                v = [list(kv) for kv in v]
            elif attr == "SubscriptionIdentifier":
                v = sorted(v) if isinstance(v, list) else [v]
            out[name] = v
    return out


class MqttClient:
    def __init__(self, ctx, client_id: str, version: int = V5, clean: bool = True,
                 session_expiry: int | None = None, will: dict | None = None,
                 username: str | None = None, password: str | None = None, keepalive: int = 60,
                 manual_ack: bool = False, connect_props: dict | None = None):
        self.ctx = ctx
        self.id = client_id
        self.version = version
        self.clean = clean
        self.session_expiry = session_expiry
        self.keepalive = keepalive
        self.connect_props = dict(connect_props or {})
        if version == V5 and session_expiry is not None:
            self.connect_props["session_expiry_interval"] = session_expiry
        self.c = mqtt.Client(
            CallbackAPIVersion.VERSION2,
            client_id=client_id,
            protocol=mqtt.MQTTv5 if version == V5 else mqtt.MQTTv311,
            clean_session=clean if version == V3 else None,
            manual_ack=manual_ack,
            reconnect_on_failure=False,
        )
        self.c.username_pw_set(username or ctx.username, password if password is not None else ctx.password)
        if will:
            self.c.will_set(will["topic"], will.get("payload", b""), will.get("qos", 0), will.get("retain", False),
                            make_props(PacketTypes.WILLMESSAGE, will.get("properties")))
        self.cond = threading.Condition()
        self.connack = None
        self.disconnected = None  # reason code int (v5 DISCONNECT / connection lost) once gone
        self.server_disconnect = None  # reason code of a DISCONNECT the server sent (v5)
        self.acks: dict[int, int] = {}
        self.subacks: dict[int, list] = {}
        self.unsubacks: dict[int, list] = {}
        self.messages: list[dict] = []
        self._sync_n = 0
        self._sync_topic = None
        self._stop = False
        self._thread = None
        self.c.on_connect = self._on_connect
        self.c.on_disconnect = self._on_disconnect
        self.c.on_message = self._on_message
        self.c.on_publish = self._on_publish
        self.c.on_subscribe = self._on_subscribe
        self.c.on_unsubscribe = self._on_unsubscribe

    # -- callbacks (network thread) ---------------------------------------

    def _on_connect(self, client, userdata, flags, rc, props):
        with self.cond:
            self.connack = {"rc": rc.value, "session_present": bool(flags.session_present), "props": props}
            self.cond.notify_all()

    def _on_disconnect(self, client, userdata, flags, rc, props):
        with self.cond:
            self.disconnected = rc.value if hasattr(rc, "value") else int(rc)
            self.cond.notify_all()

    def _on_message(self, client, userdata, m):
        rec = {
            "topic": self.ctx.rel(m.topic),
            "payload": m.payload.decode("utf-8", "replace"),
            "qos": m.qos,
            "retain": bool(m.retain),
        }
        if self.version == V5:
            rec["props"] = read_props(getattr(m, "properties", None))
        rec["_mid"] = m.mid
        rec["_dup"] = bool(m.dup)
        with self.cond:
            self.messages.append(rec)
            self.cond.notify_all()

    def _on_publish(self, client, userdata, mid, rc, props):
        with self.cond:
            self.acks[mid] = rc.value if hasattr(rc, "value") else int(rc)
            self.cond.notify_all()

    def _on_subscribe(self, client, userdata, mid, rcs, props):
        with self.cond:
            self.subacks[mid] = [r.value for r in rcs]
            self.cond.notify_all()

    def _on_unsubscribe(self, client, userdata, mid, rcs, props):
        with self.cond:
            self.unsubacks[mid] = [r.value for r in (rcs if isinstance(rcs, list) else [rcs])]
            self.cond.notify_all()

    # -- plumbing ---------------------------------------------------------

    def _loop(self):
        while not self._stop:
            rc = self.c.loop(timeout=0.05)
            if rc != mqtt.MQTT_ERR_SUCCESS:
                break
        with self.cond:
            if self.disconnected is None:
                self.disconnected = -1
            self.cond.notify_all()

    def _wait(self, pred, what: str, timeout: float = WAIT):
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                v = pred()
                if v is not None and v is not False:
                    return v
                left = deadline - time.monotonic()
                if left <= 0:
                    raise BrokerTimeout(f"no {what} within {timeout:.0f}s")
                self.cond.wait(left)

    # -- operations -------------------------------------------------------

    def connect(self) -> dict:
        """Connects and returns {rc, session_present} (+ the CONNACK's paho
        properties under "props", not JSON)."""
        kw = {}
        if self.version == V5:
            kw["clean_start"] = self.clean
            kw["properties"] = make_props(PacketTypes.CONNECT, self.connect_props)
        self.connack = None
        self.disconnected = None
        self._stop = False
        self.c.connect(self.ctx.host, self.ctx.port, self.keepalive, **kw)
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        ack = self._wait(lambda: self.connack or (self.disconnected is not None and {"rc": -1}), "CONNACK")
        if self.clean is False or (self.session_expiry or 0) > 0:
            self.ctx.session(self.id, self.version)
        return ack

    def subscribe(self, filt, qos: int = 1, no_local: bool = False, rap: bool = False, rh: int = 0,
                  sub_id: int | None = None) -> list:
        """Subscribes one filter (or a list of (filter, qos)); returns the
        SUBACK's reason codes."""
        if self.version == V5:
            if isinstance(filt, list):
                topics = [(f, SubscribeOptions(qos=q)) for f, q in filt]
            else:
                topics = [(filt, SubscribeOptions(qos=qos, noLocal=no_local, retainAsPublished=rap,
                                                  retainHandling=rh))]
            props = make_props(PacketTypes.SUBSCRIBE, {"subscription_identifier": sub_id} if sub_id else None)
            rc, mid = self.c.subscribe(topics, properties=props)
        else:
            rc, mid = self.c.subscribe(filt if isinstance(filt, list) else [(filt, qos)])
        assert rc == mqtt.MQTT_ERR_SUCCESS, f"subscribe not sent: {rc}"
        return self._wait(lambda: self.subacks.get(mid), "SUBACK")

    def unsubscribe(self, filt) -> list:
        """Returns the UNSUBACK's reason codes (MQTT 5; [] for 3.1.1)."""
        rc, mid = self.c.unsubscribe(filt)
        assert rc == mqtt.MQTT_ERR_SUCCESS, f"unsubscribe not sent: {rc}"
        self._wait(lambda: mid in self.unsubacks, "UNSUBACK")
        return self.unsubacks[mid] if self.version == V5 else []

    def publish(self, topic: str, payload="", qos: int = 0, retain: bool = False, props: dict | None = None,
                wait: bool = True):
        """Publishes; for QoS 1/2 waits for PUBACK / PUBCOMP and returns its
        reason code (0 for QoS 0 once sent)."""
        info = self.c.publish(topic, payload, qos, retain, make_props(PacketTypes.PUBLISH, props))
        if not wait:
            return info.mid
        return self._wait(lambda: self.acks.get(info.mid) if info.mid in self.acks else None,
                          f"acknowledgement of publish qos {qos}")

    def sync(self, timeout: float = WAIT) -> None:
        """Ordering fence: see the module doc."""
        if self._sync_topic is None:
            self._sync_topic = self.ctx.topic(f"sync/{self.id}")
            self.subscribe(self._sync_topic, qos=1)
        self._sync_n += 1
        marker = f"sync-{self._sync_n}"
        self.c.publish(self._sync_topic, marker, 1)
        rel = self.ctx.rel(self._sync_topic)
        self._wait(lambda: any(m["topic"] == rel and m["payload"] == marker for m in self.messages),
                   "sync marker", timeout)
        with self.cond:
            self.messages = [m for m in self.messages if m["topic"] != rel]

    def wait_messages(self, n: int, timeout: float = WAIT) -> list[dict]:
        """Waits until at least n messages arrived (raises on timeout)."""
        self._wait(lambda: len(self.messages) >= n, f"{n} messages (have {len(self.messages)})", timeout)
        return self.received()

    def received(self, keep_props: bool = True, dup: bool = False) -> list[dict]:
        """Messages so far, in arrival order (the DUP flag only if asked)."""
        with self.cond:
            out = []
            for m in self.messages:
                if dup:
                    m = {**m, "dup": m["_dup"]}
                m = {k: v for k, v in m.items() if not k.startswith("_")}
                if not keep_props:
                    m.pop("props", None)
                out.append(m)
            return out

    def take(self, keep_props: bool = False) -> list[dict]:
        """received(), then forget them."""
        out = self.received(keep_props)
        with self.cond:
            self.messages = []
        return out

    def ack(self, index: int) -> None:
        """Acknowledge the index-th received message (manual_ack clients)."""
        with self.cond:
            m = self.messages[index]
        self.c.ack(m["_mid"], m["qos"])

    def wait_disconnected(self, timeout: float = WAIT):
        """The disconnect reason once the broker closed us (raises on timeout)."""
        return self._wait(lambda: self.disconnected is not None and {"rc": self.disconnected}, "disconnect",
                          timeout)["rc"]

    def disconnect(self, reason: int | None = None, props: dict | None = None) -> None:
        """A clean DISCONNECT (v5: with an optional reason code)."""
        from paho.mqtt.reasoncodes import ReasonCode

        rc = ReasonCode(PacketTypes.DISCONNECT, identifier=reason) if reason is not None else None
        self.c.disconnect(reasoncode=rc, properties=make_props(PacketTypes.DISCONNECT, props))
        self._wait(lambda: self.disconnected is not None, "local disconnect")
        self._halt()

    def drop(self) -> None:
        """Vanish without DISCONNECT: close the socket under paho."""
        self._stop = True
        if self._thread:
            self._thread.join(2)
        sock = self.c.socket()
        if sock is not None:
            try:
                sock.close()
            except OSError:
                pass

    def _halt(self):
        self._stop = True
        if self._thread and self._thread is not threading.current_thread():
            self._thread.join(2)

    def close(self) -> None:
        if self.disconnected is None and self.connack is not None:
            try:
                self.c.disconnect()
            except Exception:
                pass
        self._halt()
        try:
            sock = self.c.socket()
            if sock is not None:
                sock.close()
        except Exception:
            pass
