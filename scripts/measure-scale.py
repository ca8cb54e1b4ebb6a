#!/usr/bin/env python3
"""Measure Weir's memory and restart cost at scale (docs/BENCHMARKS.md, "Scale").

Two experiments, each on a fresh data directory and a fresh broker:

1. messages: N persistent 256-byte messages queued in one durable queue.
   Reports the broker's RSS growth per message, the data directory's size per
   message, and the restart time with the queue full (SIGTERM, start, until
   the listener is ready) plus the RSS after restart.
2. queues: Q durable queues declared (K connections in parallel). Reports the
   declare rate, the RSS growth per queue, and the restart time with Q queues.

Usage: .venv/bin/python scripts/measure-scale.py [--weir target/release/weir]
       [--messages 1000000] [--queues 100000] [--only messages|queues]

Publishing uses pika without confirms from several processes (fast enough to
queue a million messages in well under a minute); the script then waits until
the queue reports every message, so nothing is measured while in flight.
"""

import argparse
import multiprocessing as mp
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import pika

BODY = b"x" * 256


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def rss_bytes(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def dir_bytes(path):
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            total += os.path.getsize(os.path.join(root, name))
    return total


class Weir:
    """The real broker on a free port with its own data directory."""

    def __init__(self, binary, data_dir):
        self.binary = binary
        self.data_dir = data_dir
        self.port = free_port()
        self.proc = None

    def start(self):
        """Starts the broker; returns seconds until it logs that it listens."""
        t0 = time.monotonic()
        env = dict(os.environ, NO_COLOR="1", WEIR_LOG="info")
        self.proc = subprocess.Popen(
            [self.binary, "--data-dir", self.data_dir, "--amqp-listen", f"127.0.0.1:{self.port}"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            text=True,
        )
        for line in self.proc.stdout:
            if "AMQP listener ready" in line:
                elapsed = time.monotonic() - t0
                # Keep draining the log so the broker never blocks on a full pipe.
                threading.Thread(target=lambda: [None for _ in self.proc.stdout], daemon=True).start()
                return elapsed
        raise RuntimeError(f"weir exited with {self.proc.wait()} before listening")

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout=60)
        if code != 0:
            raise RuntimeError(f"weir exited with {code} on SIGTERM")

    def rss(self):
        return rss_bytes(self.proc.pid)

    def url(self):
        return f"amqp://guest:guest@127.0.0.1:{self.port}/%2F"


def connect(url):
    return pika.BlockingConnection(pika.URLParameters(url))


def queue_depth(url, queue):
    conn = connect(url)
    try:
        return conn.channel().queue_declare(queue, passive=True).method.message_count
    finally:
        conn.close()


def publisher(url, queue, count):
    conn = connect(url)
    ch = conn.channel()
    props = pika.BasicProperties(delivery_mode=2)
    for i in range(count):
        ch.basic_publish("", queue, BODY, props)
        if i % 5000 == 0:
            conn.process_data_events(time_limit=0)
    conn.close()


def wait_for_depth(url, queue, n, timeout=600):
    deadline = time.monotonic() + timeout
    while True:
        depth = queue_depth(url, queue)
        if depth >= n:
            return depth
        if time.monotonic() > deadline:
            raise RuntimeError(f"queue holds {depth} of {n} after {timeout} s")
        time.sleep(0.5)


def measure_messages(binary, n, procs):
    data = tempfile.mkdtemp(prefix="weir-scale-msgs.")
    try:
        w = Weir(binary, data)
        w.start()
        conn = connect(w.url())
        conn.channel().queue_declare("scale", durable=True)
        base = w.rss()
        t0 = time.monotonic()
        per = n // procs
        ps = [mp.Process(target=publisher, args=(w.url(), "scale", per)) for _ in range(procs)]
        for p in ps:
            p.start()
        for p in ps:
            p.join()
        depth = wait_for_depth(w.url(), "scale", per * procs)
        elapsed = time.monotonic() - t0
        conn.close()
        full = w.rss()
        disk = dir_bytes(data)
        w.stop()
        restart = w.start()
        after = w.rss()
        depth_after = queue_depth(w.url(), "scale")
        w.stop()
        return {
            "messages": depth,
            "publish_s": elapsed,
            "rss_base_mb": base / 2**20,
            "rss_full_mb": full / 2**20,
            "rss_added_mb": (full - base) / 2**20,
            "rss_bytes_per_msg": (full - base) / depth,
            "disk_mb": disk / 2**20,
            "disk_bytes_per_msg": disk / depth,
            "restart_s": restart,
            "rss_after_restart_mb": after / 2**20,
            "messages_after_restart": depth_after,
        }
    finally:
        shutil.rmtree(data, ignore_errors=True)


def declarer(url, names, errors):
    try:
        conn = connect(url)
        ch = conn.channel()
        for name in names:
            ch.queue_declare(name, durable=True)
        conn.close()
    except Exception as e:  # reported by the caller
        errors.append(repr(e))


def measure_queues(binary, q, threads):
    data = tempfile.mkdtemp(prefix="weir-scale-queues.")
    try:
        w = Weir(binary, data)
        w.start()
        base = w.rss()
        names = [f"q-{i:06d}" for i in range(q)]
        errors = []
        t0 = time.monotonic()
        ts = [threading.Thread(target=declarer, args=(w.url(), names[i::threads], errors)) for i in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        elapsed = time.monotonic() - t0
        if errors:
            raise RuntimeError(f"declare failed: {errors[:3]}")
        full = w.rss()
        disk = dir_bytes(data)
        w.stop()
        restart = w.start()
        after = w.rss()
        # Every queue is back: spot-check a spread of them passively.
        conn = connect(w.url())
        ch = conn.channel()
        for name in names[:: max(1, q // 1000)]:
            ch.queue_declare(name, passive=True)
        conn.close()
        w.stop()
        return {
            "queues": q,
            "declare_s": elapsed,
            "declares_per_s": q / elapsed,
            "rss_base_mb": base / 2**20,
            "rss_full_mb": full / 2**20,
            "rss_bytes_per_queue": (full - base) / q,
            "disk_mb": disk / 2**20,
            "restart_s": restart,
            "rss_after_restart_mb": after / 2**20,
            "rss_after_restart_bytes_per_queue": (after - base) / q,
        }
    finally:
        shutil.rmtree(data, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weir", default="target/release/weir")
    ap.add_argument("--messages", type=int, default=1_000_000)
    ap.add_argument("--queues", type=int, default=100_000)
    ap.add_argument("--publishers", type=int, default=2)
    ap.add_argument("--declarers", type=int, default=16)
    ap.add_argument("--only", choices=["messages", "queues"])
    a = ap.parse_args()
    if not os.access(a.weir, os.X_OK):
        sys.exit(f"no weir binary at {a.weir}: cargo build --release -p weir-gateway")
    if a.only in (None, "messages"):
        r = measure_messages(a.weir, a.messages, a.publishers)
        print("messages:", " ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))
    if a.only in (None, "queues"):
        r = measure_queues(a.weir, a.queues, a.declarers)
        print("queues:", " ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))


if __name__ == "__main__":
    main()
