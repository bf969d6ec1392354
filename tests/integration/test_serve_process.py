"""`python -m cluster.serve` (what `make serve` runs) as a process: it serves, and SIGTERM
shuts it down cleanly with exit status 0 (docker stop, systemd)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx

from tests.integration.conftest import free_port


def test_serve_answers_then_sigterm_exits_cleanly(tmp_path):
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENFLOW_CLUSTER__NAMESPACE": "serve-proc"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "cluster.serve", "--port", str(port), "--model", "builtin:tiny"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True,
        start_new_session=True)
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # blocks until the server says it is up (or dies)
            lines.append(line)
            if "OpenAI API at" in line:
                break
        else:
            raise AssertionError("serve exited before serving:\n" + "".join(lines))
        health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=60)
        assert health.status_code == 200 and health.json()["num_workers_up"] >= 1
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
        lines.append(out)
        assert proc.returncode == 0, "".join(lines)
        assert "stopping" in out
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
