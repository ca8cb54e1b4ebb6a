#!/usr/bin/env python3
"""The `login-flood` attack of scripts/abuse.sh (issue 20, item 5).

FLOOD concurrent wrong-password HTTP requests (`GET /api/overview` as guest) from 127.0.0.1, each on
its own connection; meanwhile a user who never logged in (alice) logs in from 127.0.0.2, and after the
flood (every request answered or given up after GIVE_UP s) plus 5 s, another new user (bob) does.
Prints one line of key=value figures. Standard library only.

    abuse-login-flood.py HTTP_PORT [FLOOD] [GIVE_UP]
"""

import base64
import json
import socket
import sys
import threading
import time

PORT = int(sys.argv[1])
FLOOD = int(sys.argv[2]) if len(sys.argv) > 2 else 400
GIVE_UP = float(sys.argv[3]) if len(sys.argv) > 3 else 30.0
CAP = 60.0  # longest wait for the measured logins


def request(method, path, user, password, body=None, source="127.0.0.1", timeout=CAP):
    """One HTTP/1.1 request on a new connection from `source`: (status, seconds); status 0 = none."""
    start = time.monotonic()
    auth = base64.b64encode(f"{user}:{password}".encode()).decode()
    data = json.dumps(body).encode() if body is not None else b""
    head = (f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
            f"Authorization: Basic {auth}\r\nContent-Length: {len(data)}\r\n")
    if data:
        head += "Content-Type: application/json\r\n"
    try:
        s = socket.create_connection(("127.0.0.1", PORT), timeout=timeout, source_address=(source, 0))
        s.settimeout(max(0.1, timeout - (time.monotonic() - start)))
        s.sendall(head.encode() + b"\r\n" + data)
        raw = b""
        while b"\r\n" not in raw:
            chunk = s.recv(4096)
            if not chunk:
                break
            raw += chunk
        s.close()
        status = int(raw.split(b" ", 2)[1]) if raw.startswith(b"HTTP/") else 0
    except (OSError, ValueError, IndexError):
        status = 0
    return status, time.monotonic() - start


def main():
    for user in ("alice", "bob"):
        st, _ = request("PUT", f"/api/users/{user}", "guest", "guest",
                        {"password": f"{user}-pw", "tags": "management"})
        if st not in (201, 204):
            print(f"setup=failed status={st}")
            return
    codes = {}
    lock = threading.Lock()
    go = threading.Event()

    def flooder(i):
        go.wait()
        st, _ = request("GET", "/api/overview", "guest", f"wrong-{i}", timeout=GIVE_UP)
        with lock:
            codes[st] = codes.get(st, 0) + 1

    threads = [threading.Thread(target=flooder, args=(i,), daemon=True) for i in range(FLOOD)]
    for t in threads:
        t.start()
    t0 = time.monotonic()
    go.set()
    time.sleep(0.5)  # let the flood's requests reach the broker first
    during, during_s = request("GET", "/api/whoami", "alice", "alice-pw", source="127.0.0.2")
    for t in threads:
        t.join()
    flood_s = time.monotonic() - t0
    time.sleep(5)
    after, after_s = request("GET", "/api/whoami", "bob", "bob-pw", source="127.0.0.2")
    answered = ",".join(f"{k or 'none'}:{v}" for k, v in sorted(codes.items()))
    print(f"flood={FLOOD} answers={answered} flood_s={flood_s:.1f} "
          f"first_login_during_ms={during_s * 1000:.0f} during_status={during} "
          f"first_login_5s_after_ms={after_s * 1000:.0f} after_status={after}")


main()
