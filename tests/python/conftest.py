"""Fixtures: a broker URL (a real weir started here, or WEIR_TEST_URL) and
connections closed at teardown.

WEIR_TEST_URL=amqp://guest:guest@127.0.0.1:5672/ runs the same tests against
an already running broker (e.g. RabbitMQ, to check the tests themselves).
"""
from __future__ import annotations

import os
import uuid

import pytest

from amqp_helpers import open_connection
from weirproc import Weir

EXTERNAL_URL = os.environ.get("WEIR_TEST_URL")


@pytest.fixture(scope="session")
def amqp_url(tmp_path_factory):
    if EXTERNAL_URL:
        yield EXTERNAL_URL
        return
    base = tmp_path_factory.mktemp("weir")
    (base / "data").mkdir()
    w = Weir(base / "data", base / "weir.log").start()
    try:
        yield w.url
    finally:
        if w.proc.poll() is None:
            try:
                w.stop()
            except RuntimeError:
                pass  # stop() already killed it


@pytest.fixture
def connect(amqp_url):
    """connect(url=None) -> BlockingConnection; all closed at teardown."""
    conns = []

    def _connect(url=None):
        c = open_connection(url or amqp_url)
        conns.append(c)
        return c

    yield _connect
    for c in conns:
        try:
            if c.is_open:
                c.close()
        except Exception:
            pass


@pytest.fixture
def conn(connect):
    return connect()


@pytest.fixture
def names(conn):
    """names("tag") -> unique queue/exchange name; deleted at teardown."""
    made = []
    run = uuid.uuid4().hex[:8]

    def _name(tag: str) -> str:
        n = f"pytest.{run}.{tag}"
        made.append(n)
        return n

    yield _name
    if conn.is_open:
        for n in made:
            for op in ("queue_delete", "exchange_delete"):
                try:
                    getattr(conn.channel(), op)(n)
                except Exception:
                    pass


@pytest.fixture(scope="session")
def weir_mqtt(tmp_path_factory):
    """A weir of its own for the MQTT tests: (mqtt port, websocket port)."""
    base = tmp_path_factory.mktemp("weir-mqtt")
    (base / "data").mkdir()
    w = Weir(base / "data", base / "weir.log").start()
    try:
        yield w
    finally:
        if w.proc.poll() is None:
            try:
                w.stop()
            except RuntimeError:
                pass
