"""Start and stop the real `weir` binary for the pika smoke test."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def weir_bin() -> Path:
    return Path(os.environ.get("WEIR_BIN") or REPO_ROOT / "target" / "debug" / "weir")


def free_port() -> int:
    # The kernel picks an unused port; weir binds it right after. The race
    # with other processes is tolerable for tests on one machine.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


class Weir:
    """One weir process on a data dir. Can be stopped and started again on
    the same data dir."""

    def __init__(self, data_dir: Path, log_path: Path, start_timeout: float = 30.0,
                 extra_args: list[str] | None = None):
        self.data_dir = Path(data_dir)
        # More flags (e.g. --config with [tls]); kept across restarts.
        self.extra_args = list(extra_args or [])
        self.log_path = Path(log_path)
        self.start_timeout = start_timeout
        self.proc: subprocess.Popen | None = None
        self.port: int | None = None
        self.mqtt_port: int | None = None
        self.ws_port: int | None = None
        self.http_port: int | None = None

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}/"

    def start(self) -> "Weir":
        binary = weir_bin()
        if not binary.exists():
            raise RuntimeError(f"weir binary not found at {binary}: run `cargo build -p weir-gateway` or set WEIR_BIN")
        # A fresh port each start: after kill -9 the old one may linger.
        self.port = free_port()
        self.mqtt_port = free_port()
        self.ws_port = free_port()
        self.http_port = free_port()
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [str(binary), "--data-dir", str(self.data_dir), "--amqp-listen", f"127.0.0.1:{self.port}",
             "--mqtt-listen", f"127.0.0.1:{self.mqtt_port}", "--mqtt-ws-listen", f"127.0.0.1:{self.ws_port}", "--http-listen", f"127.0.0.1:{self.http_port}",
             *self.extra_args],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )
        log.close()
        # Bounded poll: the only readiness signal weir gives is the listener.
        deadline = time.monotonic() + self.start_timeout
        while not port_accepts(self.port):
            if self.proc.poll() is not None:
                raise RuntimeError(f"weir exited with {self.proc.returncode} before listening; log:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"weir did not listen on {self.port} within {self.start_timeout}s; log:\n{self.log_tail()}")
            time.sleep(0.05)
        return self

    def stop(self, timeout: float = 20.0) -> int:
        """Graceful stop (SIGTERM); returns the exit code."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise RuntimeError(f"weir did not exit within {timeout}s of SIGTERM")

    def kill(self) -> None:
        """Crash stop (SIGKILL)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"
