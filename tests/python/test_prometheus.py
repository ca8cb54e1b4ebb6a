"""Monitoring with the real tools: Debian's `prometheus` scrapes a real weir,
and the PromQL queries of the Grafana dashboard (deploy/grafana/weir.json)
return what the broker holds; `promtool test rules` runs the alerting rules'
unit tests (deploy/prometheus/alerts_test.yml).

Skipped, saying why, where Debian's prometheus is not installed
(scripts/install-deps.sh installs it).
"""
from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pika
import pytest

from weirproc import REPO_ROOT, Weir, free_port

PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
DEPLOY = REPO_ROOT / "deploy"

# The dashboard's queries (deploy/grafana/weir.json), one queue at a time.
DEPTH = 'rabbitmq_queue_messages_ready{queue="%s"}'
LAG = ('(rabbitmq_queue_messages_ready{queue="%s"} + rabbitmq_queue_messages_unacked{queue="%s"})'
       ' and on (vhost, queue) rabbitmq_queue_consumers > 0')
CONFIRM_P95 = ('histogram_quantile(0.95, sum by (le) '
               '(weir_publish_to_confirm_seconds_bucket{protocol="amqp091"}))')


def query(port: int, expr: str) -> list:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as r:
        body = json.load(r)
    assert body["status"] == "success", body
    return body["data"]["result"]


def wait_for(port: int, expr: str, want, timeout: float = 60.0) -> float:
    """The query's single value once it equals `want` (a number or a predicate),
    polling at scrape speed; fails with the last answer after `timeout`."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            res = query(port, expr)
        except OSError as e:  # prometheus still starting
            last = e
        else:
            last = res
            if len(res) == 1:
                v = float(res[0]["value"][1])
                if (want(v) if callable(want) else v == want):
                    return v
        time.sleep(0.5)
    raise AssertionError(f"{expr}: wanted {want}, last answer {last}")


def p95_from_buckets(text: str) -> float:
    """Prometheus' histogram_quantile over the raw /metrics buckets: linear
    interpolation inside the bucket holding the 95th percentile."""
    buckets = {}
    for line in text.splitlines():
        if line.startswith("weir_publish_to_confirm_seconds_bucket{") and 'protocol="amqp091"' in line:
            le = float(line.split('le="')[1].split('"')[0])  # float("+Inf") is inf
            buckets[le] = buckets.get(le, 0) + float(line.rsplit(" ", 1)[1])
    les = sorted(buckets)
    total = buckets[float("inf")]
    rank = 0.95 * total
    prev_le, prev_c = 0.0, 0.0
    for le in les:
        c = buckets[le]
        if c >= rank:
            if le == float("inf"):
                return prev_le
            return prev_le + (le - prev_le) * (rank - prev_c) / (c - prev_c)
        prev_le, prev_c = le, c
    raise AssertionError("no bucket")


@pytest.fixture
def weir(tmp_path):
    (tmp_path / "data").mkdir()
    w = Weir(tmp_path / "data", tmp_path / "weir.log").start()
    yield w
    if w.proc.poll() is None:
        try:
            w.stop()
        except RuntimeError:
            pass


@pytest.fixture
def prometheus(tmp_path, weir):
    if PROMETHEUS is None:
        pytest.skip("Debian's prometheus is not installed (apt-get install prometheus; scripts/install-deps.sh)")
    port = free_port()
    (tmp_path / "password").write_text("guest")
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{
            "job_name": "weir",
            "metrics_path": "/metrics",
            "basic_auth": {"username": "guest", "password_file": str(tmp_path / "password")},
            "static_configs": [{"targets": [f"127.0.0.1:{weir.http_port}"]}],
        }],
    }
    (tmp_path / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
    log = open(tmp_path / "prometheus.log", "wb")
    proc = subprocess.Popen(
        [PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}",
         f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        # Ready once its target is scraped and up.
        wait_for(port, 'up{job="weir"}', 1)
        yield port
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def test_promql_queue_depth_confirm_p95_and_consumer_lag(weir, prometheus):
    conn = pika.BlockingConnection(pika.URLParameters(weir.url))
    ch = conn.channel()
    ch.confirm_delivery()
    ch.queue_declare("prom-depth", durable=True)
    ch.queue_declare("prom-lag", durable=True)
    for i in range(10):
        ch.basic_publish("", "prom-depth", b"d%d" % i, pika.BasicProperties(delivery_mode=2))
    for i in range(8):
        ch.basic_publish("", "prom-lag", b"l%d" % i, pika.BasicProperties(delivery_mode=2))
    # A consumer that holds 3 deliveries unacknowledged: 5 ready + 3 unacked behind it.
    consumer = conn.channel()
    consumer.basic_qos(prefetch_count=3)
    held = []
    consumer.basic_consume("prom-lag", lambda c, m, p, b: held.append(m.delivery_tag))
    while len(held) < 3:
        conn.process_data_events(time_limit=1)

    assert wait_for(prometheus, DEPTH % "prom-depth", 10) == 10
    assert wait_for(prometheus, DEPTH % "prom-lag", 5) == 5
    assert wait_for(prometheus, LAG % ("prom-lag", "prom-lag"), 8) == 8
    # A queue without a consumer has no lag series (it has depth and a no-consumer alert).
    assert query(prometheus, LAG % ("prom-depth", "prom-depth")) == []

    # Confirm p95: what Prometheus computes from the scraped buckets equals
    # the same interpolation over the broker's own /metrics (no publish since).
    req = urllib.request.Request(f"http://127.0.0.1:{weir.http_port}/metrics")
    req.add_header("Authorization", "Basic Z3Vlc3Q6Z3Vlc3Q=")
    with urllib.request.urlopen(req, timeout=10) as r:
        expected = p95_from_buckets(r.read().decode())
    assert 0 < expected < 10
    got = wait_for(prometheus, CONFIRM_P95, lambda v: abs(v - expected) < 1e-9)
    assert abs(got - expected) < 1e-9
    conn.close()


def test_alerting_rules_pass_promtool():
    if PROMTOOL is None:
        pytest.skip("Debian's promtool (package prometheus) is not installed")
    for args in (["check", "rules", "alerts.yml"], ["test", "rules", "alerts_test.yml"]):
        r = subprocess.run([PROMTOOL, *args], cwd=DEPLOY / "prometheus",
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr


def test_grafana_dashboard_queries_run_on_prometheus(weir, prometheus):
    """Every query of deploy/grafana/weir.json is valid PromQL over weir's
    series (its variables set to "all"), and the depth panel sees a queue."""
    conn = pika.BlockingConnection(pika.URLParameters(weir.url))
    ch = conn.channel()
    ch.confirm_delivery()
    ch.queue_declare("dash", durable=True)
    ch.basic_publish("", "dash", b"x", pika.BasicProperties(delivery_mode=2))
    conn.close()
    dash = json.loads((DEPLOY / "grafana" / "weir.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert len(exprs) >= 10
    for e in exprs:
        e = (e.replace("$instance", ".*").replace("$vhost", ".*").replace("$queue", ".*")
             .replace("$__rate_interval", "1m"))
        query(prometheus, e)  # asserts status success: parses and evaluates
    depth = next(t["expr"] for p in dash["panels"] if p["title"] == "Queue depth (ready)"
                 for t in p["targets"])
    wait_for(prometheus, depth.replace("$instance", ".*").replace("$vhost", ".*")
             .replace("$queue", "dash"), 1)
