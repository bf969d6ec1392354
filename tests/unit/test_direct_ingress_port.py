"""`make serve` checks its port before Ray starts (cluster.serve.enable_direct_ingress): a port
another server listens on is refused; one whose only sockets are a stopped server's
connections in TIME_WAIT is not (the replica's server binds it with SO_REUSEADDR)."""

from __future__ import annotations

import os
import socket

import pytest

from cluster import serve


@pytest.fixture
def environ(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    env = dict(os.environ)  # what enable_direct_ingress sets stays in this test
    monkeypatch.setattr(serve.os, "environ", env)
    return env


def _time_wait_port() -> int:
    """A port whose listener (SO_REUSEADDR, as uvicorn's) is closed and whose one accepted
    connection the server side closed first: the server's end of it is in TIME_WAIT on that
    port."""
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        conn, _ = listener.accept()
        conn.close()  # the active close: TIME_WAIT is on the server's side
        client.recv(1)  # the FIN arrived
        client.close()
    return port


def test_a_port_left_in_time_wait_by_a_stopped_server_is_free(environ: dict[str, str]) -> None:
    port = _time_wait_port()
    with socket.socket() as plain, pytest.raises(OSError):
        plain.bind(("127.0.0.1", port))  # the check as it was: refused for ~60 s
    proxy_port = serve.enable_direct_ingress("127.0.0.1", port)
    assert environ["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"] == str(port)
    assert proxy_port != port


def test_a_port_another_server_listens_on_is_refused(environ: dict[str, str]) -> None:
    before = dict(environ)
    with socket.socket() as other:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        other.bind(("127.0.0.1", 0))
        other.listen()
        with pytest.raises(OSError):
            serve.enable_direct_ingress("127.0.0.1", other.getsockname()[1])
    assert environ == before  # nothing set up for a server that cannot start
