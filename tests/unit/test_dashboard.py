"""The Grafana dashboard file and `tokenflow dashboard push`.

No Grafana server can be installed on these machines, so the push goes to a local HTTP
stand-in that records each request and answers as Grafana's `POST /api/dashboards/db`
does (or with the error a test asks for). The dashboard's queries are checked against a
real Prometheus in tests/integration/test_prometheus.py.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from cluster.cli import main
from cluster.dashboard import DASHBOARD_PATH, load_dashboard


class GrafanaStandIn(ThreadingHTTPServer):
    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.requests: list[tuple[str, str, dict[str, str], Any]] = []
        self.status = 200

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    server: GrafanaStandIn

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests.append(("POST", self.path, dict(self.headers), body))
        status = self.server.status
        if status == 200:
            uid = body["dashboard"]["uid"]
            answer = {"id": 1, "uid": uid, "url": f"/d/{uid}/tokenflow", "status": "success",
                      "version": len(self.server.requests), "slug": "tokenflow"}
        else:
            answer = {"message": "Unauthorized" if status == 401 else "database is locked"}
        data = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def grafana() -> Iterator[GrafanaStandIn]:
    server = GrafanaStandIn()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def test_push_posts_the_dashboard_with_overwrite_and_is_idempotent(
        grafana: GrafanaStandIn, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["dashboard", "push", "--grafana-url", grafana.url, "--token", "glsa_secret"]
    assert main(args) == 0
    assert main(args) == 0
    assert len(grafana.requests) == 2
    method, path, headers, body = grafana.requests[0]
    assert (method, path) == ("POST", "/api/dashboards/db")
    assert headers["Authorization"] == "Bearer glsa_secret"
    assert body["overwrite"] is True
    expected = load_dashboard()
    assert body["dashboard"] == {**expected, "id": None}
    # Idempotent: the same uid both times, so Grafana overwrites rather than adds.
    assert grafana.requests[1][3] == body
    assert "pushed dashboard tokenflow-ops" in capsys.readouterr().out


@pytest.mark.parametrize(("status", "words"), [(401, "credentials"), (500, "failed (500)")])
def test_a_grafana_error_is_one_clear_line_and_exit_1(
        grafana: GrafanaStandIn, capsys: pytest.CaptureFixture[str], status: int,
        words: str) -> None:
    grafana.status = status
    assert main(["dashboard", "push", "--grafana-url", grafana.url]) == 1
    err = capsys.readouterr().err
    assert words in err and grafana.url in err and "Traceback" not in err


def test_unreachable_grafana_is_exit_1(capsys: pytest.CaptureFixture[str]) -> None:
    server = GrafanaStandIn()  # bound, then closed: nothing listens on the port
    url = server.url
    server.server_close()
    assert main(["dashboard", "push", "--grafana-url", url]) == 1
    assert "cannot reach Grafana" in capsys.readouterr().err


def test_the_dashboard_has_the_variables_rows_and_a_state_timeline() -> None:
    dash = json.loads(DASHBOARD_PATH.read_text())
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["worker"]["type"] == "query"
    rows = [p["title"] for p in dash["panels"] if p["type"] == "row"]
    assert rows == ["Latency", "Throughput", "Controller", "KV cache", "Protections",
                    "Tenants", "Worker pool"]
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    assert any(p["type"] == "state-timeline" for p in panels)
    for panel in panels:
        assert panel["targets"] and panel["datasource"]["uid"] == "${datasource}"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))


def docker_grafana_lines() -> list[str]:
    """The Grafana container commands of README.md and dashboards/README.md."""
    root = DASHBOARD_PATH.parents[1]
    return [line for doc in (root / "README.md", root / "dashboards" / "README.md")
            for line in doc.read_text(encoding="utf-8").splitlines()
            if line.startswith("docker run ") and "grafana/grafana" in line]


def test_grafana_provisioning_needs_no_edit_and_stays_on_loopback() -> None:
    """What Grafana would read, resolved as it resolves it (environment variables expanded in
    provisioning files; a bind mount). Grafana itself does not run here: no Grafana server
    or Docker on this machine."""
    import os
    import shlex

    import yaml

    root = DASHBOARD_PATH.parent
    provisioning = root / "provisioning"
    provider = yaml.safe_load((provisioning / "dashboards" / "tokenflow.yml").read_text())
    path = provider["providers"][0]["options"]["path"]
    assert path == "${TOKENFLOW_DASHBOARDS}"  # from the environment, never hard-coded
    source = yaml.safe_load((provisioning / "datasources" / "tokenflow.yml").read_text())
    assert source["datasources"][0]["url"] == "http://127.0.0.1:9090"
    lines = docker_grafana_lines()
    assert len(lines) == 2 and lines[0] == lines[1]  # the README and dashboards/README agree
    words = shlex.split(lines[0])
    mounts = [words[i + 1] for i, w in enumerate(words) if w == "-v"]
    env = dict(words[i + 1].split("=", 1) for i, w in enumerate(words) if w == "-e")
    ((host, inside),) = [m.rsplit(":ro", 1)[0].split(":") for m in mounts]
    assert host == "$PWD/dashboards"

    def on_host(container_path: str) -> str:
        assert container_path.startswith(inside)
        return str(root) + container_path[len(inside):]

    assert env["GF_SERVER_HTTP_ADDR"] == "127.0.0.1"
    assert os.path.isdir(os.path.join(on_host(env["GF_PATHS_PROVISIONING"]), "datasources"))
    resolved = path.replace("${TOKENFLOW_DASHBOARDS}", on_host(env["TOKENFLOW_DASHBOARDS"]))
    assert os.path.samefile(os.path.join(resolved, "tokenflow.json"), DASHBOARD_PATH)
    prometheus = yaml.safe_load((root / "prometheus.yml").read_text())
    assert prometheus["scrape_configs"][0]["static_configs"][0]["targets"] == ["127.0.0.1:8000"]
