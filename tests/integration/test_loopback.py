"""`make serve` listens on loopback only: every TCP listener and bound UDP socket of its
process tree (the driver, Serve, Ray's GCS, raylet, agents and workers) is on 127.0.0.1 or
::1, apart from the ones Ray cannot move (`ray_cannot_move`, with the reason). The same
server takes its API key from `--api-key`, through the environment of Ray's processes, and
SIGTERM stops it cleanly with exit status 0. The port is the ingress replica's own (Serve's
direct ingress), and a killed replica comes back on it.

Read from /proc (Linux): the session's processes, their socket inodes, /proc/net/{tcp,udp}.
"""

from __future__ import annotations

import ipaddress
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.integration.conftest import free_port

# Ray's C++ gRPC servers bind every interface ("::"), hard-coded in Ray 2.60 whatever the
# node address: the GCS, the raylet, and the core worker of every Ray process (the driver,
# each actor and agent). Ray's token authentication (on) guards them.
RAY_GRPC_PROCESSES = ("/ray/gcs/gcs_server", "/ray/raylet/raylet", "ray::", "cluster.serve")


@dataclass(frozen=True)
class Listener:
    pid: int
    cmdline: str
    proto: str
    ip: str
    port: int


def _session_pids(sid: int) -> dict[int, str]:
    pids: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.getsid(int(entry.name)) != sid:
                continue
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ProcessLookupError):
            continue  # gone meanwhile, or not ours
        pids[int(entry.name)] = cmdline.strip()
    return pids


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    try:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[len("socket:["):-1])
    except OSError:
        pass
    return inodes


def _decode_address(hex_address: str) -> tuple[str, int]:
    hex_ip, hex_port = hex_address.split(":")
    raw = bytes.fromhex(hex_ip)
    if len(raw) == 4:
        ip = socket.inet_ntop(socket.AF_INET, raw[::-1])
    else:  # four little-endian 32-bit words
        ip = socket.inet_ntop(socket.AF_INET6, b"".join(
            raw[i:i + 4][::-1] for i in range(0, 16, 4)))
    return ip, int(hex_port, 16)


def listeners(sid: int) -> list[Listener]:
    """TCP sockets in LISTEN and unconnected UDP sockets of the session's processes."""
    inode_to_socket: dict[str, tuple[str, str, int]] = {}
    for proto, state in [("tcp", "0A"), ("tcp6", "0A"), ("udp", "07"), ("udp6", "07")]:
        for line in Path(f"/proc/net/{proto}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == state:
                ip, port = _decode_address(fields[1])
                inode_to_socket[fields[9]] = (proto, ip, port)
    found = []
    for pid, cmdline in _session_pids(sid).items():
        for inode in _socket_inodes(pid):
            if inode in inode_to_socket:
                proto, ip, port = inode_to_socket[inode]
                found.append(Listener(pid, cmdline, proto, ip, port))
    return found


def ray_cannot_move(listener: Listener, http_port: int) -> bool:
    return (listener.proto == "tcp6" and listener.ip == "::" and listener.port != http_port
            and any(name in listener.cmdline for name in RAY_GRPC_PROCESSES))


def is_loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip)
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


def ingress_listener(found: list[Listener], port: int) -> Listener:
    owners = [s for s in found if s.port == port and s.proto.startswith("tcp")]
    assert owners and all("ServeReplica:tokenflow" in s.cmdline for s in owners), owners
    return owners[0]


def wait_healthy(port: int, timeout_s: float) -> bool:
    """Poll /health until it answers 200 (connection refused while the replica restarts)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                return True
        except httpx.TransportError:
            pass
        time.sleep(0.5)  # a poll interval: the restart has no event to wait on
    return False


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads Linux /proc")
def test_make_serve_listens_on_loopback_only_and_stops_cleanly_on_sigterm() -> None:
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENFLOW_CLUSTER__NAMESPACE": "loopback"}
    env.pop("TOKENFLOW_API_KEYS", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "cluster.serve", "--port", str(port), "--model", "builtin:tiny",
         "--api-key", "sk-loopback:team-l"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True,
        start_new_session=True)
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if "OpenAI API at" in line:
                break
        else:
            raise AssertionError("serve exited before serving:\n" + "".join(lines))
        # Every worker is up and has served: their listeners are open by now.
        health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=60)
        assert health.status_code == 200
        url = f"http://127.0.0.1:{port}/v1/models"
        assert httpx.get(url, timeout=60).status_code == 401
        ok = httpx.get(url, timeout=60, headers={"Authorization": "Bearer sk-loopback"})
        assert ok.status_code == 200, ok.text
        found = listeners(os.getsid(proc.pid))
        assert any(s.port == port and s.proto == "tcp" for s in found), found  # sees them
        exposed = [s for s in found
                   if not is_loopback(s.ip) and not ray_cannot_move(s, port)]
        assert exposed == [], "\n".join(f"{s.proto} {s.ip}:{s.port} pid {s.pid} {s.cmdline[:120]}"
                                        for s in exposed)
        # Direct ingress (cluster.direct_ingress): the ingress replica owns the port, no
        # proxy in between; killed, Serve restarts it on the same port at once.
        replica = ingress_listener(found, port)
        os.kill(replica.pid, signal.SIGKILL)
        assert wait_healthy(port, timeout_s=120), "the ingress did not come back"
        again = ingress_listener(listeners(os.getsid(proc.pid)), port)
        assert again.pid != replica.pid
        # SIGTERM (docker stop, systemd) shuts Serve and Ray down cleanly: exit status 0
        # (Ray's own handler, if installed last, would abort the process: -6).
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
        lines.append(out)
        assert proc.returncode == 0, "".join(lines)
        assert "stopping" in out
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
