"""Runs the installed package's broker as systemd would and talks to it.

Started by scripts/deb-test.sh after `dpkg -i`: binds a NOTIFY_SOCKET,
starts /usr/bin/weir --config /etc/weir/weir.toml as the `weir` user (the
unit's ExecStart and User=), waits for its READY=1 (Type=notify), then a
pika client publishes with a confirm and reads it back, a paho-mqtt client
subscribes and gets its own QoS 1 publish, and SIGTERM must bring
STOPPING=1 and exit status 0. Only the listen ports are moved (environment
variables) so that a broker already on this machine does not collide.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading

import paho.mqtt.client as mqtt
import pika

CONFIG = "/etc/weir/weir.toml"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def recv_state(sock: socket.socket, want: str, proc: subprocess.Popen, timeout: float) -> str:
    sock.settimeout(timeout)
    while True:
        try:
            msg = sock.recv(4096).decode()
        except socket.timeout:
            raise SystemExit(f"deb-smoke: no {want} within {timeout}s (weir exit: {proc.poll()})")
        if want in msg.split("\n"):
            return msg


def main() -> int:
    tmp = tempfile.mkdtemp(prefix="weir-deb-")
    os.chmod(tmp, 0o755)
    notify_path = os.path.join(tmp, "notify")
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(notify_path)
    os.chmod(notify_path, 0o777)  # the weir user sends to it
    ports = {k: free_port() for k in ("AMQP", "MQTT", "MQTT_WS", "HTTP")}
    env = dict(os.environ, NOTIFY_SOCKET=notify_path,
               # A build machine may have less than the default 1 GB free.
               WEIR_DISK_FREE_LIMIT=os.environ.get("WEIR_DISK_FREE_LIMIT", "50MB"),
               **{f"WEIR_{k}_LISTEN": f"127.0.0.1:{p}" for k, p in ports.items()})
    log = open(os.path.join(tmp, "weir.log"), "w")
    proc = subprocess.Popen(
        ["setpriv", "--reuid=weir", "--regid=weir", "--init-groups",
         "/usr/bin/weir", "--config", CONFIG],
        cwd="/var/lib/weir", env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        ready = recv_state(notify, "READY=1", proc, 60)
        assert f"MAINPID={proc.pid}" in ready, ready
        print(f"deb-smoke: READY=1 from pid {proc.pid}")

        # AMQP: a persistent message confirmed (fsynced into /var/lib/weir) and read back.
        conn = pika.BlockingConnection(pika.URLParameters(
            f"amqp://guest:guest@127.0.0.1:{ports['AMQP']}/%2F"))
        ch = conn.channel()
        ch.confirm_delivery()
        ch.queue_declare("deb-smoke", durable=True)
        ch.basic_publish("", "deb-smoke", b"from the package",
                         pika.BasicProperties(delivery_mode=2))
        method, _props, body = ch.basic_get("deb-smoke")
        assert body == b"from the package", body
        ch.basic_ack(method.delivery_tag)
        ch.queue_delete("deb-smoke")
        conn.close()
        print("deb-smoke: AMQP publish/confirm/get ok")

        # MQTT: subscribe, publish QoS 1 to ourselves, receive it.
        got = threading.Event()
        subscribed = threading.Event()
        c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="deb-smoke")
        c.username_pw_set("guest", "guest")
        c.on_subscribe = lambda *a: subscribed.set()
        c.on_message = lambda _c, _u, m: got.set() if m.payload == b"mqtt ok" else None
        c.connect("127.0.0.1", ports["MQTT"])
        c.loop_start()
        c.subscribe("deb/smoke", qos=1)
        assert subscribed.wait(30), "no SUBACK"
        c.publish("deb/smoke", b"mqtt ok", qos=1).wait_for_publish(30)
        assert got.wait(30), "MQTT message not delivered"
        c.disconnect()
        c.loop_stop()
        print("deb-smoke: MQTT subscribe/publish ok")

        # Files the broker wrote belong to weir.
        owners = {os.stat(os.path.join(d, f)).st_uid
                  for d, _, fs in os.walk("/var/lib/weir") for f in fs}
        import pwd
        assert owners == {pwd.getpwnam("weir").pw_uid}, owners

        proc.send_signal(signal.SIGTERM)
        recv_state(notify, "STOPPING=1", proc, 30)
        rc = proc.wait(60)
        assert rc == 0, f"weir exited {rc}"
        print("deb-smoke: SIGTERM: STOPPING=1, exit 0")
        return 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
        with open(os.path.join(tmp, "weir.log")) as f:
            tail = f.read()[-3000:]
        if sys.exc_info()[0] is not None:
            print("deb-smoke: weir's log:\n" + tail, file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
