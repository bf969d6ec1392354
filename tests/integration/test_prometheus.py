"""A real Prometheus (Debian's `prometheus` package) scrapes the session cluster's /metrics.

A workload that drives the KV pool into cache pressure (a flow-control transition, from
real traffic) runs; then every PromQL expression of every panel of dashboards/tokenflow.json
is evaluated through Prometheus' HTTP API and must return at least one series, and the
TTFT histogram counts exactly the requests served. A second Serve app with two ingress
replicas shows that any replica's /metrics reads the same counters.
Scrapes are awaited, not slept for: the test polls Prometheus until the scrape timestamp
of a series is past the moment it needs, under a bounded deadline.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster.dashboard import load_dashboard
from tests.integration.conftest import Cluster, free_port

PROMETHEUS = shutil.which("prometheus")
pytestmark = pytest.mark.skipif(
    PROMETHEUS is None, reason="prometheus missing: apt-get install prometheus (.ci/run does)")
MODEL = "builtin:tiny"
SCRAPE_INTERVAL_S = 1
# Grafana fills these in; the test uses every worker and a window that covers the workload.
TEMPLATE = {"$worker": ".*", "$__rate_interval": "3m"}


def poll(condition: Callable[[], Any], deadline_s: float, what: str) -> Any:
    end = time.monotonic() + deadline_s
    while not (value := condition()):
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.1)
    return value


class Prometheus:
    def __init__(self, url: str) -> None:
        self.url = url
        self.http = httpx.Client(base_url=url, timeout=30)

    def query(self, expr: str) -> list[dict[str, Any]]:
        body = self.http.get("/api/v1/query", params={"query": expr}).json()
        assert body["status"] == "success", (expr, body)
        return body["data"]["result"]

    def await_scrape_after(self, t: float, deadline_s: float = 60) -> None:
        """Block until a scrape that started after wall time `t` has landed."""
        def landed() -> bool:
            result = self.query("timestamp(tokenflow_worker_up)")
            return bool(result) and min(float(r["value"][1]) for r in result) > t
        poll(landed, deadline_s, f"a scrape after {t:.1f}")


@pytest.fixture(scope="module")
def prometheus(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[Prometheus]:
    assert PROMETHEUS is not None
    work = tmp_path_factory.mktemp("prometheus")
    target = cluster.url.removeprefix("http://")
    config = {"global": {"scrape_interval": f"{SCRAPE_INTERVAL_S}s",
                         "scrape_timeout": f"{SCRAPE_INTERVAL_S}s"},
              "scrape_configs": [{"job_name": "tokenflow", "metrics_path": "/metrics",
                                  "static_configs": [{"targets": [target]}]}]}
    (work / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
    port = free_port()
    log = (work / "prometheus.log").open("w")
    proc = subprocess.Popen(
        [PROMETHEUS, f"--config.file={work / 'prometheus.yml'}",
         f"--storage.tsdb.path={work / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
         "--log.level=warn"], stdout=log, stderr=subprocess.STDOUT)
    prom = Prometheus(f"http://127.0.0.1:{port}")
    try:
        def ready() -> bool:
            assert proc.poll() is None, Path(log.name).read_text()
            try:
                return prom.http.get("/-/ready").status_code == 200
            except httpx.HTTPError:
                return False
        poll(ready, 60, "prometheus to start")
        yield prom
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        log.close()


def scrape(url: str) -> tuple[dict[tuple[str, tuple[tuple[str, str], ...]], float], httpx.Response]:
    resp = httpx.get(f"{url}/metrics", timeout=30)
    assert resp.status_code == 200, resp.text
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(resp.text)
               for s in family.samples}
    return samples, resp


def total(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str) -> float:
    return sum(v for (n, _), v in samples.items() if n == name)


async def _workload(url: str, num: int) -> list[int]:
    """`num` concurrent completions, long enough to fill both small KV pools past 85 %."""
    async with httpx.AsyncClient(base_url=url, timeout=300,
                                 limits=httpx.Limits(max_connections=num)) as http:
        async def one(i: int) -> int:
            prompt = [3 + (11 * i + j) % 500 for j in range(60)]
            resp = await http.post("/v1/completions", headers={"X-Tenant-Id": f"tenant-{i % 3}"},
                                   json={"model": MODEL, "prompt": prompt, "max_tokens": 100,
                                         "ignore_eos": True})
            assert resp.status_code == 200, resp.text
            return resp.json()["usage"]["completion_tokens"]
        return await asyncio.gather(*(one(i) for i in range(num)))


def dashboard_exprs() -> list[tuple[str, str]]:
    out = []
    for panel in load_dashboard()["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for var, value in TEMPLATE.items():
                expr = expr.replace(var, value)
            assert "$" not in expr, f"unsubstituted variable in {panel['title']}: {expr}"
            out.append((panel["title"], expr))
    return out


def test_every_dashboard_query_returns_series_and_ttft_counts_every_request(
        cluster: Cluster, prometheus: Prometheus) -> None:
    num = 24
    before, _ = scrape(cluster.url)
    prometheus.await_scrape_after(time.time())  # a baseline sample of every series
    completions = asyncio.run(_workload(cluster.url, num))
    assert completions == [100] * num
    after, _ = scrape(cluster.url)
    # The workload crossed flow control's cache-pressure threshold and came back.
    transitions = total(after, "tokenflow_flow_transitions_total") \
        - total(before, "tokenflow_flow_transitions_total")
    assert transitions >= 1, "the workload never left NORMAL"
    prometheus.await_scrape_after(time.time())
    # Another scrape: series born during the workload now have two samples for rate().
    prometheus.await_scrape_after(time.time())

    exprs = dashboard_exprs()
    assert len(exprs) >= 30
    empty = [(title, expr) for title, expr in exprs if not prometheus.query(expr)]
    assert not empty, f"dashboard queries with no series: {empty}"
    ttft = prometheus.query("tokenflow_time_to_first_token_seconds_count")
    assert len(ttft) == 1
    served = float(ttft[0]["value"][1]) - before[
        ("tokenflow_time_to_first_token_seconds_count", ())]
    assert served == num
    finished = prometheus.query("sum(tokenflow_request_success_total)")
    assert float(finished[0]["value"][1]) - total(before, "tokenflow_request_success_total") \
        == num
    hits = prometheus.query('tokenflow_flow_transitions_total{to="CACHE_PRESSURE_WAIT"}')
    assert hits, "Prometheus holds no transition into CACHE_PRESSURE_WAIT"


def test_two_ingress_replicas_serve_the_same_counters(cluster: Cluster) -> None:
    from ray import serve

    from cluster.ingress import build_app

    config = cluster.config.model_dump()
    config["cluster"] = {**config["cluster"], "ingress_num_replicas": 2}
    serve.run(build_app(config), name="tokenflow-two", route_prefix="/two")
    try:
        replica_to_samples: dict[str, dict[Any, float]] = {}
        for _ in range(100):  # Serve picks a replica per request: both answer soon
            samples, resp = scrape(f"{cluster.url}/two")
            replica_to_samples.setdefault(resp.headers["x-tokenflow-replica"], samples)
            if len(replica_to_samples) == 2:
                break
        assert len(replica_to_samples) == 2, "only one replica ever answered"
        first, second = replica_to_samples.values()
        # The controller's series; `tokenflow_edge_*` are each replica's own (labelled by
        # replica: grammars compile and tool calls parse where requests are prepared).
        counter = re.compile(r"(?!tokenflow_edge_).*(_total|_bucket|_count|_sum)$")
        counters_1 = {k: v for k, v in first.items() if counter.match(k[0])}
        counters_2 = {k: v for k, v in second.items() if counter.match(k[0])}
        assert counters_1 and counters_1 == counters_2
        # The session's own app reads the controller's numbers too (idle cluster).
        main, _ = scrape(cluster.url)
        assert {k: v for k, v in main.items() if counter.match(k[0])} == counters_1
    finally:
        serve.delete("tokenflow-two")
