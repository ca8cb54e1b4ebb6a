"""TLS (issue 9): pika and paho-mqtt against weir's AMQPS and MQTTS
listeners, with certificates this module makes (the `cryptography`
package): a test CA, a server certificate for localhost/127.0.0.1, client
certificates. Covers a plain TLS connection, SASL EXTERNAL and MQTT
`ssl_cert_login` by client certificate (over MQTTS and secure WebSocket),
and an untrusted client certificate refused in the handshake."""
from __future__ import annotations

import datetime
import ipaddress
import queue
import ssl
import uuid
from pathlib import Path

import paho.mqtt.client as mqtt
import pika
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from weirproc import Weir, free_port

TIMEOUT = 10


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _pem_key(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


class Ca:
    """A certificate authority for one test module."""

    def __init__(self, cn: str):
        self.key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(_name(cn)).issuer_name(_name(cn))
            .public_key(self.key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False,
                                         encipher_only=False, decipher_only=False), critical=True)
            .sign(self.key, hashes.SHA256())
        )

    def pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def issue(self, cn: str, server: bool, dir: Path, stem: str) -> tuple[Path, Path]:
        """A leaf certificate and key written to dir/stem.pem and dir/stem.key."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        b = (
            x509.CertificateBuilder()
            .subject_name(_name(cn)).issuer_name(self.cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False)
        )
        if server:
            b = b.add_extension(x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False)
        cert = b.sign(self.key, hashes.SHA256())
        cert_path, key_path = dir / f"{stem}.pem", dir / f"{stem}.key"
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_path.write_bytes(_pem_key(key))
        return cert_path, key_path


@pytest.fixture(scope="module")
def tls_weir(tmp_path_factory):
    base = tmp_path_factory.mktemp("weir-tls")
    ca, rogue = Ca("Weir test CA"), Ca("Rogue CA")
    (base / "ca.pem").write_bytes(ca.pem())
    server = ca.issue("localhost", True, base, "server")
    alice = ca.issue("alice", False, base, "alice")
    rogue_alice = rogue.issue("alice", False, base, "rogue-alice")
    config = base / "weir.toml"
    config.write_text(
        "[tls]\n"
        f"cert_file = \"{server[0]}\"\nkey_file = \"{server[1]}\"\nca_file = \"{base / 'ca.pem'}\"\n"
        "[mqtt]\nssl_cert_login = true\n"
        "[[auth.users]]\nname = \"alice\"\npassword = \"not-used-by-certificate-logins\"\n"
    )
    amqps, mqtts, wss = free_port(), free_port(), free_port()
    (base / "data").mkdir()
    w = Weir(base / "data", base / "weir.log", extra_args=[
        "--config", str(config), "--amqps-listen", f"127.0.0.1:{amqps}",
        "--mqtts-listen", f"127.0.0.1:{mqtts}", "--mqtt-wss-listen", f"127.0.0.1:{wss}"]).start()
    w.amqps_port, w.mqtts_port, w.wss_port = amqps, mqtts, wss
    w.ca_file, w.alice, w.rogue_alice = base / "ca.pem", alice, rogue_alice
    try:
        yield w
    finally:
        if w.proc.poll() is None:
            w.stop()


def _context(w, client: tuple[Path, Path] | None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(w.ca_file))
    if client:
        ctx.load_cert_chain(str(client[0]), str(client[1]))
    return ctx


def _pika(w, client=None, credentials=None) -> pika.BlockingConnection:
    params = pika.ConnectionParameters(
        host="localhost", port=w.amqps_port,
        credentials=credentials or pika.PlainCredentials("guest", "guest"),
        ssl_options=pika.SSLOptions(_context(w, client), "localhost"),
        connection_attempts=1, socket_timeout=TIMEOUT, blocked_connection_timeout=TIMEOUT)
    return pika.BlockingConnection(params)


def _round_trip(conn: pika.BlockingConnection) -> None:
    ch = conn.channel()
    ch.confirm_delivery()
    q = f"tls.{uuid.uuid4().hex[:8]}"
    ch.queue_declare(q)
    ch.basic_publish("", q, b"over tls")
    method, _props, body = ch.basic_get(q, auto_ack=True)
    assert method is not None and body == b"over tls"
    ch.queue_delete(q)


def test_pika_over_tls(tls_weir):
    conn = _pika(tls_weir)
    try:
        _round_trip(conn)
    finally:
        conn.close()


def test_pika_external_login_by_client_certificate(tls_weir):
    conn = _pika(tls_weir, client=tls_weir.alice, credentials=pika.credentials.ExternalCredentials())
    try:
        _round_trip(conn)
    finally:
        conn.close()


def test_pika_untrusted_client_certificate_refused(tls_weir):
    with pytest.raises(pika.exceptions.AMQPConnectionError):
        conn = _pika(tls_weir, client=tls_weir.rogue_alice)
        conn.close()


def _paho(w, client=None, username=None, password=None, websocket=False):
    connected: "queue.Queue" = queue.Queue()
    got: "queue.Queue" = queue.Queue()
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"tls-{uuid.uuid4().hex[:8]}",
                    protocol=mqtt.MQTTv311, transport="websockets" if websocket else "tcp")
    if websocket:
        c.ws_set_options(path="/mqtt")
    c.tls_set_context(_context(w, client))
    if username is not None:
        c.username_pw_set(username, password)
    c.on_connect = lambda cl, ud, flags, rc, props=None: connected.put(rc)
    c.on_message = lambda cl, ud, msg: got.put((msg.topic, msg.payload))
    c.on_subscribe = lambda cl, ud, mid, rcs, props=None: got.put(("suback", mid))
    c.connect("localhost", w.wss_port if websocket else w.mqtts_port, keepalive=30)
    c.loop_start()
    return c, connected.get(timeout=TIMEOUT), got


def _mqtt_round_trip(c, got, payload: bytes = b"over mqtts") -> None:
    topic = f"tls/{uuid.uuid4().hex[:8]}"
    c.subscribe(topic, qos=1)
    assert got.get(timeout=TIMEOUT)[0] == "suback"
    c.publish(topic, payload, qos=1).wait_for_publish(TIMEOUT)
    assert got.get(timeout=TIMEOUT) == (topic, payload)


def test_paho_over_tls_with_password(tls_weir):
    c, rc, got = _paho(tls_weir, username="guest", password="guest")
    try:
        assert not rc.is_failure, f"CONNACK {rc}"
        _mqtt_round_trip(c, got)
        # Larger than the socket and TLS buffers: written in many steps.
        _mqtt_round_trip(c, got, bytes(range(256)) * 16384)
    finally:
        c.loop_stop()
        c.disconnect()


def test_paho_ssl_cert_login(tls_weir):
    # No user name or password: the certificate's CN (alice) is the user.
    c, rc, got = _paho(tls_weir, client=tls_weir.alice)
    try:
        assert not rc.is_failure, f"CONNACK {rc}"
        _mqtt_round_trip(c, got)
    finally:
        c.loop_stop()
        c.disconnect()


def test_paho_over_secure_websocket_with_ssl_cert_login(tls_weir):
    # MQTT over wss (TLS, then the WebSocket upgrade on /mqtt): the same
    # certificate login as MQTTS.
    c, rc, got = _paho(tls_weir, client=tls_weir.alice, websocket=True)
    try:
        assert not rc.is_failure, f"CONNACK {rc}"
        _mqtt_round_trip(c, got)
    finally:
        c.loop_stop()
        c.disconnect()
