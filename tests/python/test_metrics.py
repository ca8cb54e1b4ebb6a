"""/metrics (issue 10): the text parses with Prometheus' own parser, holds
every documented series, and its figures follow known traffic.

Runs its own brokers (it needs their HTTP port), so it is skipped with
WEIR_TEST_URL.
"""
from __future__ import annotations

import base64
import os
import urllib.request

import pika
import pytest
from prometheus_client.parser import text_string_to_metric_families

from amqp_helpers import PERSISTENT, confirming_channel, open_connection
from weirproc import Weir

pytestmark = pytest.mark.skipif(
    bool(os.environ.get("WEIR_TEST_URL")), reason="needs a weir started here (its HTTP port)"
)

# Every family docs/metrics.md promises (counters without their `_total`,
# as the parser names families).
SERIES = [
    # per queue
    "rabbitmq_queue_messages_ready",
    "rabbitmq_queue_messages_unacked",
    "weir_queue_messages_delayed",
    "rabbitmq_queue_messages",
    "rabbitmq_queue_messages_ready_bytes",
    "rabbitmq_queue_messages_unacked_bytes",
    "weir_queue_oldest_message_age_seconds",
    "rabbitmq_queue_consumers",
    "rabbitmq_queue_messages_published",
    "rabbitmq_queue_messages_delivered",
    "rabbitmq_queue_messages_acked",
    "rabbitmq_queue_messages_redelivered",
    "rabbitmq_queue_messages_dead_lettered",
    "rabbitmq_queue_messages_expired",
    "weir_queue_delivery_attempts_max",
    "weir_queue_ready_by_attempts",
    "weir_queue_max_length_messages",
    "weir_queue_max_length_bytes",
    "weir_queue_message_ttl_seconds",
    "rabbitmq_queues",
    # per tenant and protocol
    "rabbitmq_connections",
    "rabbitmq_connections_opened",
    "rabbitmq_channels",
    "rabbitmq_channels_opened",
    "rabbitmq_global_messages_received",
    "rabbitmq_global_messages_confirmed",
    "rabbitmq_global_messages_delivered",
    "rabbitmq_connection_incoming_bytes",
    "rabbitmq_connection_outgoing_bytes",
    "weir_protocol_errors",
    "weir_tenant_queued_messages",
    "weir_tenant_queued_bytes",
    # latency
    "weir_publish_to_confirm_seconds",
    "weir_publish_to_deliver_seconds",
    # store
    "weir_store_fsync_seconds",
    "weir_store_group_commit_waiters",
    "weir_store_group_commit_bytes",
    "weir_store_segments",
    "weir_store_disk_bytes",
    "weir_store_appended_bytes",
    "weir_store_fsyncs",
    "weir_store_reclaimed_segments",
    # alarms, process
    "rabbitmq_alarms_memory_used_watermark",
    "rabbitmq_alarms_free_disk_space_watermark",
    "weir_uptime_seconds",
]


def start(tmp_path, name, *args):
    (tmp_path / name).mkdir()
    return Weir(tmp_path / name, tmp_path / f"{name}.log", extra_args=list(args)).start()


@pytest.fixture
def weir(tmp_path):
    w = start(tmp_path, "data")
    yield w
    w.kill()


def scrape(w):
    """The parsed scrape: {family name: family}, and every sample. Logged in
    (guest is an administrator): the per-queue series need a monitoring or
    administrator user ([http] metrics_auth)."""
    req = urllib.request.Request(f"http://127.0.0.1:{w.http_port}/metrics")
    req.add_header("Authorization", "Basic " + base64.b64encode(b"guest:guest").decode())
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = r.read().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    return families


def value(families, family, sample, **labels):
    """The value of the one sample of `family` named `sample` whose labels
    include `labels`."""
    found = [
        s.value
        for s in families[family].samples
        if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    assert len(found) == 1, f"{sample} {labels}: {found}"
    return found[0]


def test_metrics_parse_and_follow_known_traffic(weir):
    n, taken = 50, 20
    conn = open_connection(weir.url)
    ch = confirming_channel(conn)
    ch.queue_declare("metrics.q", durable=True)
    # Retention limits are reported for the queues that have them.
    ch.queue_declare("metrics.limited", durable=True, arguments={
        "x-max-length": 1000, "x-max-length-bytes": 1 << 20, "x-message-ttl": 60000})
    for i in range(n):
        ch.basic_publish("", "metrics.q", b"x" * 100, PERSISTENT)

    m = scrape(weir)
    missing = [s for s in SERIES if s not in m]
    # Some families appear only once something happened (an error); make
    # one: a passive declare of a missing queue closes the channel (404).
    errch = conn.channel()
    with pytest.raises(pika.exceptions.ChannelClosedByBroker):
        errch.queue_declare("metrics.missing", passive=True)
    m = scrape(weir)
    missing = [s for s in SERIES if s not in m]
    assert not missing, f"missing series: {missing}"

    q = {"vhost": "/", "queue": "metrics.q"}
    amqp = {"vhost": "/", "protocol": "amqp091"}
    assert value(m, "rabbitmq_queue_messages_ready", "rabbitmq_queue_messages_ready", **q) == n
    assert value(m, "rabbitmq_queue_messages_ready_bytes", "rabbitmq_queue_messages_ready_bytes", **q) == n * 100
    assert value(m, "rabbitmq_queue_messages_published", "rabbitmq_queue_messages_published_total", **q) == n
    assert value(m, "rabbitmq_queue_messages_unacked", "rabbitmq_queue_messages_unacked", **q) == 0
    assert value(m, "rabbitmq_queues", "rabbitmq_queues", vhost="/") == 2
    lim = {"vhost": "/", "queue": "metrics.limited"}
    assert value(m, "weir_queue_max_length_messages", "weir_queue_max_length_messages", **lim) == 1000
    assert value(m, "weir_queue_max_length_bytes", "weir_queue_max_length_bytes", **lim) == 1 << 20
    assert value(m, "weir_queue_message_ttl_seconds", "weir_queue_message_ttl_seconds", **lim) == 60
    assert not [x for x in m["weir_queue_max_length_messages"].samples if x.labels["queue"] == "metrics.q"]
    assert value(m, "weir_queue_delivery_attempts_max", "weir_queue_delivery_attempts_max", **q) == 0
    # None delivered yet: the queue's attempt buckets are left out (all its
    # ready messages are at 0 attempts, as messages_ready says).
    assert not [x for x in m["weir_queue_ready_by_attempts"].samples if x.labels.get("queue") == "metrics.q"]
    assert value(m, "rabbitmq_connections", "rabbitmq_connections", **amqp) == 1
    assert value(m, "rabbitmq_channels", "rabbitmq_channels", **amqp) == 1  # the failed one is closed
    assert value(m, "rabbitmq_global_messages_received", "rabbitmq_global_messages_received_total", **amqp) == n
    assert value(m, "rabbitmq_global_messages_confirmed", "rabbitmq_global_messages_confirmed_total", **amqp) == n
    assert value(m, "weir_publish_to_confirm_seconds", "weir_publish_to_confirm_seconds_count", **amqp) == n
    assert value(m, "weir_protocol_errors", "weir_protocol_errors_total", kind="channel", **amqp) == 1
    assert value(m, "weir_store_fsync_seconds", "weir_store_fsync_seconds_count") >= 1
    assert value(m, "weir_store_group_commit_waiters", "weir_store_group_commit_waiters_count") >= 1
    assert value(m, "rabbitmq_connection_incoming_bytes", "rabbitmq_connection_incoming_bytes_total", **amqp) > n * 100
    assert value(m, "weir_queue_oldest_message_age_seconds", "weir_queue_oldest_message_age_seconds", **q) >= 0

    # Get `taken` without acking, then ack half of them.
    getter = conn.channel()
    tags = []
    for _ in range(taken):
        method, _props, _body = getter.basic_get("metrics.q", auto_ack=False)
        assert method is not None
        tags.append(method.delivery_tag)
    getter.basic_ack(tags[taken // 2 - 1], multiple=True)
    # A round trip on the same channel: the ack was handled (and committed)
    # before the declare-ok is written.
    getter.queue_declare("metrics.q", passive=True)
    m = scrape(weir)
    assert value(m, "rabbitmq_queue_messages_ready", "rabbitmq_queue_messages_ready", **q) == n - taken
    assert value(m, "rabbitmq_queue_messages_unacked", "rabbitmq_queue_messages_unacked", **q) == taken // 2
    assert value(m, "rabbitmq_queue_messages_unacked_bytes", "rabbitmq_queue_messages_unacked_bytes", **q) == taken // 2 * 100
    assert value(m, "rabbitmq_queue_messages_delivered", "rabbitmq_queue_messages_delivered_total", **q) == taken
    assert value(m, "rabbitmq_queue_messages_acked", "rabbitmq_queue_messages_acked_total", **q) == taken // 2
    assert value(m, "rabbitmq_queue_consumers", "rabbitmq_queue_consumers", **q) == 0

    # A returned delivery counts an attempt: nack one back and look.
    method, _props, _body = getter.basic_get("metrics.q", auto_ack=False)
    getter.basic_nack(method.delivery_tag, requeue=True)
    getter.queue_declare("metrics.q", passive=True)
    m = scrape(weir)
    assert value(m, "weir_queue_delivery_attempts_max", "weir_queue_delivery_attempts_max", **q) == 1
    assert value(m, "weir_queue_ready_by_attempts", "weir_queue_ready_by_attempts", le="0", **q) == n - taken - 1
    assert value(m, "weir_queue_ready_by_attempts", "weir_queue_ready_by_attempts", le="1", **q) == n - taken
    assert value(m, "rabbitmq_queue_messages_redelivered", "rabbitmq_queue_messages_redelivered_total", **q) == 0

    # A consumer: its deliveries are timed from enqueue.
    k = 5
    cons = conn.channel()
    cons.basic_qos(prefetch_count=k)
    got = 0
    for method, _props, _body in cons.consume("metrics.q", inactivity_timeout=10):
        assert method is not None, "deliveries stopped"
        got += 1
        if got == k:
            break
    m = scrape(weir)
    assert value(m, "rabbitmq_queue_consumers", "rabbitmq_queue_consumers", **q) == 1
    assert value(m, "weir_publish_to_deliver_seconds", "weir_publish_to_deliver_seconds_count", **amqp) >= k
    assert value(m, "rabbitmq_global_messages_delivered", "rabbitmq_global_messages_delivered_total", **amqp) >= k
    assert value(m, "rabbitmq_channels", "rabbitmq_channels", **amqp) == 3
    conn.close()

    # The connection is counted closed before its close-ok is sent.
    m = scrape(weir)
    assert value(m, "rabbitmq_connections", "rabbitmq_connections", **amqp) == 0
    assert value(m, "rabbitmq_connections_closed", "rabbitmq_connections_closed_total", **amqp) == 1
    assert value(m, "rabbitmq_channels", "rabbitmq_channels", **amqp) == 0


def test_metrics_aggregated_per_tenant(tmp_path):
    w = start(tmp_path, "agg", "--http-metrics-per-queue", "false")
    try:
        conn = open_connection(w.url)
        ch = confirming_channel(conn)
        for name, count in (("agg.a", 3), ("agg.b", 4)):
            ch.queue_declare(name, durable=True)
            for _ in range(count):
                ch.basic_publish("", name, b"y", PERSISTENT)
        m = scrape(w)
        ready = [s for s in m["rabbitmq_queue_messages_ready"].samples]
        assert all("queue" not in s.labels for s in ready), ready
        assert value(m, "rabbitmq_queue_messages_ready", "rabbitmq_queue_messages_ready", vhost="/") == 7
        assert value(m, "rabbitmq_queues", "rabbitmq_queues", vhost="/") == 2
        assert "weir_queue_max_length_messages" not in m or not m["weir_queue_max_length_messages"].samples
        conn.close()
    finally:
        w.kill()
