#!/usr/bin/env python3
"""HTTP clients of scripts/abuse.sh's publish-door attacks (issue 20, items 4,
7 and 9): each prints one line of key=value figures.

  abuse-publish.py publish-alarm  --http HOST:PORT            # HTTP publishes under a disk alarm
  abuse-publish.py publish-rate   --http HOST:PORT --secs 5   # against publish-rate = 10
  abuse-publish.py publish-queued --http HOST:PORT            # against max-queued-messages = 100
  abuse-publish.py big-arguments  --http HOST:PORT --pid PID  # 200 queues with 1.9 MB arguments
  abuse-publish.py import         --http HOST:PORT --queues N [--no-wait]
  abuse-publish.py count-imported --http HOST:PORT

Standard library only (urllib, threads); guest/guest.
"""
import argparse
import base64
import json
import sys
import threading
import time
import urllib.error
import urllib.request

AUTH = "Basic " + base64.b64encode(b"guest:guest").decode()


def req(base, method, path, body=None, timeout=120):
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    r = urllib.request.Request(base + path, data=data, method=method)
    r.add_header("Authorization", AUTH)
    if data is not None:
        r.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(r, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except Exception as e:  # connection refused or reset: the broker died
        return 0, str(e).encode()


def rss_mb(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) // 1024
    except OSError:
        return -1
    return -1


def depth(base, q, vhost="%2F"):
    s, b = req(base, "GET", f"/api/queues/{vhost}/{q}")
    return json.loads(b).get("messages", 0) if s == 200 else "?"


def publish(base, q, payload, vhost="%2F"):
    body = {"properties": {"delivery_mode": 2}, "routing_key": q,
            "payload": payload, "payload_encoding": "string"}
    return req(base, "POST", f"/api/exchanges/{vhost}/amq.default/publish", body)


def publish_alarm(a):
    """4 threads publish 512 KB messages for --secs or until 500 MB went in."""
    base = a.http
    req(base, "PUT", "/api/queues/%2F/abuse.alarm", {"durable": True})
    deadline = time.time() + 15
    while time.time() < deadline and req(base, "GET", "/api/health/checks/alarms")[0] == 200:
        time.sleep(0.2)
    alarmed = req(base, "GET", "/api/health/checks/alarms")[0] != 200
    payload = "x" * (512 * 1024)
    stats = {"ok": 0, "codes": {}}
    lock = threading.Lock()
    stop = time.time() + a.secs

    def run():
        while time.time() < stop:
            with lock:
                if stats["ok"] * 0.5 >= 500:
                    return
            s, _ = publish(base, "abuse.alarm", payload)
            with lock:
                if s == 200:
                    stats["ok"] += 1
                else:
                    stats["codes"][s] = stats["codes"].get(s, 0) + 1

    ts = [threading.Thread(target=run) for _ in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    refused = " ".join(f"refused_{k}={v}" for k, v in sorted(stats["codes"].items())) or "refused=0"
    print(f"alarm={'on' if alarmed else 'off'} accepted={stats['ok']} "
          f"accepted_mb={stats['ok'] // 2} {refused} depth={depth(base, 'abuse.alarm')}")


def publish_rate(a):
    base = a.http
    req(base, "PUT", "/api/queues/%2F/abuse.rate", {})
    ok, codes, start = 0, {}, time.time()
    while time.time() - start < a.secs:
        s, _ = publish(base, "abuse.rate", "r")
        if s == 200:
            ok += 1
        else:
            codes[s] = codes.get(s, 0) + 1
    took = time.time() - start
    sent = ok + sum(codes.values())
    refused = " ".join(f"refused_{k}={v}" for k, v in sorted(codes.items())) or "refused=0"
    print(f"sent={sent} accepted={ok} accepted_per_s={ok / took:.0f} {refused}")


def publish_queued(a):
    base = a.http
    req(base, "PUT", "/api/queues/%2F/abuse.queued", {})
    ok, codes = 0, {}
    for _ in range(300):
        s, _ = publish(base, "abuse.queued", "q")
        if s == 200:
            ok += 1
        else:
            codes[s] = codes.get(s, 0) + 1
    refused = " ".join(f"refused_{k}={v}" for k, v in sorted(codes.items())) or "refused=0"
    print(f"sent=300 accepted={ok} {refused} depth={depth(base, 'abuse.queued')}")


def big_arguments(a):
    base = a.http
    big = "a" * (1900 * 1000)
    ok, codes, peak = 0, {}, 0
    for i in range(200):
        s, _ = req(base, "PUT", f"/api/queues/%2F/abuse.big-{i}",
                   {"durable": True, "arguments": {"x-big": big}})
        if s in (200, 201, 204):
            ok += 1
        else:
            codes[s] = codes.get(s, 0) + 1
        peak = max(peak, rss_mb(a.pid))
    refused = " ".join(f"refused_{k}={v}" for k, v in sorted(codes.items())) or "refused=0"
    print(f"declared={ok}/200 {refused} rss_peak_mb={peak} rss_after_mb={rss_mb(a.pid)}")


def document(n):
    return {
        "exchanges": [{"name": "imp-x", "vhost": "/", "type": "direct", "durable": True,
                       "auto_delete": False, "internal": False, "arguments": {}}],
        "queues": [{"name": f"imp-{i}", "vhost": "/", "durable": True, "auto_delete": False,
                    "arguments": {}} for i in range(n)],
        "bindings": [{"source": "imp-x", "vhost": "/", "destination": f"imp-{i}",
                      "destination_type": "queue", "routing_key": f"k{i}", "arguments": {}}
                     for i in range(n)],
    }


def do_import(a):
    base = a.http
    body = json.dumps(document(a.queues)).encode()
    if a.no_wait:
        # Send and leave: the caller kills the broker once queues show.
        t = threading.Thread(target=req, args=(base, "POST", "/api/definitions", body),
                             daemon=True)
        t.start()
        deadline = time.time() + 120
        while time.time() < deadline:
            s, b = req(base, "GET", "/api/overview")
            if s == 200 and json.loads(b)["object_totals"]["queues"] > 0:
                break
            time.sleep(0.05)
        print("started=1")
        return
    start = time.time()
    s, _ = req(base, "POST", "/api/definitions", body, timeout=600)
    print(f"status={s} items={2 * a.queues + 1} import_s={time.time() - start:.2f}")


def count_imported(a):
    s, b = req(a.http, "GET", "/api/definitions")
    if s != 200:
        print(f"error={s}")
        return
    d = json.loads(b)
    q = sum(1 for x in d.get("queues", []) if x["name"].startswith("imp-"))
    bnd = sum(1 for x in d.get("bindings", []) if x.get("source") == "imp-x")
    print(f"queues={q} bindings={bnd}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("what")
    p.add_argument("--http", required=True, help="host:port of the HTTP listener")
    p.add_argument("--secs", type=float, default=10)
    p.add_argument("--pid", type=int, default=0)
    p.add_argument("--queues", type=int, default=10000)
    p.add_argument("--no-wait", action="store_true")
    a = p.parse_args()
    a.http = "http://" + a.http
    {"publish-alarm": publish_alarm, "publish-rate": publish_rate,
     "publish-queued": publish_queued, "big-arguments": big_arguments,
     "import": do_import, "count-imported": count_imported}[a.what](a)


if __name__ == "__main__":
    sys.exit(main())
