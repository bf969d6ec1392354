"""A real `redis-server` a test owns, on a free loopback port, so it can kill and restart it.

No persistence (`--save '' --appendonly no`): a restarted server is empty, as a Redis that
lost its data would be, which is what the journal's catch-up must survive.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import threading


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RedisServer:
    def __init__(self, port: int | None = None) -> None:
        self.binary = shutil.which("redis-server") or "/usr/bin/redis-server"
        self.port = port or free_port()
        self.proc: subprocess.Popen[str] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--loglevel", "notice"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert self.proc.stdout is not None
        # Ready once it says so (its log goes to stdout); no polling.
        for line in self.proc.stdout:
            if "Ready to accept connections" in line:
                # Keep draining its log, or a full pipe would block the server.
                threading.Thread(target=self.proc.stdout.read, daemon=True).start()
                return self
        raise RuntimeError(f"redis-server on port {self.port} exited: {self.proc.wait()}")

    def kill(self) -> None:
        """SIGKILL: gone at once, without a goodbye to its clients."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.proc = None
