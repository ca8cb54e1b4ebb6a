"""rabbitmqadmin (the CLI shipped with RabbitMQ's management plugin) against
Weir's management API: it lists, declares and deletes queues, exchanges and
bindings unchanged.

The script is Debian's (rabbitmq-server ships it as /usr/bin/rabbitmqadmin
and in the management plugin's priv/www/cli/); RABBITMQADMIN overrides the
path. Skipped when none is installed.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys

import pytest

from weirproc import Weir


def find_rabbitmqadmin() -> str | None:
    cands = [os.environ.get("RABBITMQADMIN"), shutil.which("rabbitmqadmin")]
    cands += glob.glob("/usr/lib/rabbitmq/lib/rabbitmq_server-*/plugins/rabbitmq_management-*/priv/www/cli/rabbitmqadmin")
    return next((c for c in cands if c and os.path.exists(c)), None)


ADMIN = find_rabbitmqadmin()
pytestmark = pytest.mark.skipif(ADMIN is None, reason="rabbitmqadmin not installed")


@pytest.fixture(scope="module")
def weir(tmp_path_factory):
    base = tmp_path_factory.mktemp("weir-admin")
    (base / "data").mkdir()
    w = Weir(base / "data", base / "weir.log").start()
    yield w
    if w.proc.poll() is None:
        try:
            w.stop()
        except RuntimeError:
            pass


def admin(weir, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    cmd = [sys.executable, ADMIN, "-H", "127.0.0.1", "-P", str(weir.http_port),
           "-u", "guest", "-p", "guest", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    if check:
        assert r.returncode == 0, f"{args}: {r.stdout}\n{r.stderr}"
    return r


def listed(weir, what: str, *cols: str) -> list[dict]:
    r = admin(weir, "-f", "raw_json", "list", what, *cols)
    return json.loads(r.stdout)


def test_queues(weir):
    admin(weir, "declare", "queue", "name=adm-q", "durable=true", 'arguments={"x-max-length": 10}')
    qs = {q["name"]: q for q in listed(weir, "queues", "name", "durable", "messages", "arguments")}
    assert qs["adm-q"]["durable"] is True
    assert qs["adm-q"]["arguments"] == {"x-max-length": 10}
    admin(weir, "publish", "exchange=amq.default", "routing_key=adm-q", "payload=hello")
    got = json.loads(admin(weir, "-f", "raw_json", "get", "queue=adm-q", "ackmode=ack_requeue_true").stdout)
    assert got[0]["payload"] == "hello"
    admin(weir, "purge", "queue", "name=adm-q")
    assert {q["name"]: q for q in listed(weir, "queues", "name", "messages")}["adm-q"]["messages"] == 0
    # The tool's table output works too.
    assert "adm-q" in admin(weir, "list", "queues").stdout
    admin(weir, "delete", "queue", "name=adm-q")
    assert "adm-q" not in [q["name"] for q in listed(weir, "queues", "name")]


def test_exchanges_and_bindings(weir):
    admin(weir, "declare", "exchange", "name=adm-x", "type=topic")
    admin(weir, "declare", "queue", "name=adm-bq")
    admin(weir, "declare", "binding", "source=adm-x", "destination=adm-bq", "routing_key=a.*")
    xs = {x["name"]: x for x in listed(weir, "exchanges", "name", "type")}
    assert xs["adm-x"]["type"] == "topic"
    bs = [b for b in listed(weir, "bindings") if b["source"] == "adm-x"]
    assert [(b["destination"], b["routing_key"]) for b in bs] == [("adm-bq", "a.*")]
    admin(weir, "delete", "binding", "source=adm-x", "destination=adm-bq", "destination_type=queue",
          f"properties_key={bs[0]['properties_key']}")
    assert not [b for b in listed(weir, "bindings") if b["source"] == "adm-x"]
    admin(weir, "delete", "exchange", "name=adm-x")
    assert "adm-x" not in [x["name"] for x in listed(weir, "exchanges", "name")]
    admin(weir, "delete", "queue", "name=adm-bq")


def test_vhosts_users_overview(weir):
    admin(weir, "declare", "vhost", "name=adm-v")
    admin(weir, "declare", "user", "name=adm-u", "password=pw", "tags=monitoring")
    admin(weir, "declare", "permission", "vhost=adm-v", "user=adm-u", "configure=.*", "write=.*", "read=.*")
    assert "adm-v" in [v["name"] for v in listed(weir, "vhosts", "name")]
    assert "adm-u" in [u["name"] for u in listed(weir, "users", "name")]
    admin(weir, "--vhost=adm-v", "declare", "queue", "name=in-v")
    assert [q["vhost"] for q in listed(weir, "queues", "name", "vhost") if q["name"] == "in-v"] == ["adm-v"]
    assert "product_name" not in admin(weir, "show", "overview").stderr
    admin(weir, "delete", "vhost", "name=adm-v")
    admin(weir, "delete", "user", "name=adm-u")
    # Errors come back as the tool's error output, exit code non-zero.
    r = admin(weir, "delete", "queue", "name=missing", check=False)
    assert r.returncode != 0
