"""Scrape cost of `/metrics`: 4 workers, 256 running requests, many tenants.

A real `ControllerCore` (4 pools, real schedulers) is stepped against the stand-in worker
until 256 requests decode; `RequestMetrics` has tracked all of them. One scrape is what
the ingress does: the controller builds its `MetricsSnapshot`, the snapshot crosses the
process boundary (pickled as Ray would), and the FastAPI route renders it. Measured
through a Starlette `TestClient` (HTTP semantics, no socket); the Ray call itself is not
in the figure (its round trip is in the cluster benchmark).

    python -m benchmarks.run --only metrics [--quick]
"""

from __future__ import annotations

import asyncio
import pickle
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.standin_worker import StandInWorkerActor
from cluster.config import TokenflowConfig
from controller.core import ControllerCore
from controller.messages import SamplingParams
from controller.request_metrics import MetricsSnapshot, RequestMetrics
from controller.step_loop import StepLoop

NUM_WORKERS = 4
NUM_RUNNING = 256
NUM_TENANTS = 40  # over the default label cap of 16: folding is part of the cost
TARGET_MS = 50.0


def _loaded_core() -> tuple[ControllerCore, RequestMetrics]:
    options = TokenflowConfig(
        cache={"block_size": 16, "num_kv_blocks": 4096},
        scheduler={"max_num_batched_tokens": 8192, "max_num_seqs": 128},
        calibration={"auto": False}).controller_options()  # the stand-in's step is fixed
    workers = [StandInWorkerActor(options.worker, options.cache) for _ in range(NUM_WORKERS)]
    core = ControllerCore.for_workers(options, [w.info() for w in workers], time.monotonic)
    metrics = RequestMetrics()
    params = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)
    for i in range(NUM_RUNNING):
        request = core.add_request([3 + (i * 7 + j) % 400 for j in range(64)], params,
                                   tenant=f"tenant-{i % NUM_TENANTS}")
        metrics.on_admit(request)
    loops = [StepLoop.serial(core, w, worker.execute) for w, worker in enumerate(workers)]

    def num_decoding() -> int:
        return sum(r.is_decoding for w in range(NUM_WORKERS)
                   for r in core.scheduler(w).running)

    for _ in range(500):  # prefill (a few chunks a step) until every request decodes
        for loop in loops:
            for out in loop.step().outputs:
                metrics.on_output(out, core.clock())
        if num_decoding() == NUM_RUNNING:
            break
    assert num_decoding() == NUM_RUNNING, num_decoding()
    return core, metrics


def run(quick: bool, out_dir: Path) -> dict[str, Any]:
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from cluster.config import TokenflowConfig
    from cluster.ingress import OpenAIServer

    core, metrics = _loaded_core()

    class _Client:  # the controller's side of one scrape, with Ray's pickling
        async def metrics_snapshot(self) -> MetricsSnapshot:
            snap = MetricsSnapshot([core.worker_stats(w) for w in range(NUM_WORKERS)],
                                   metrics.snapshot())
            return pickle.loads(pickle.dumps(snap))

    server = OpenAIServer(TokenflowConfig(), _Client())  # type: ignore[arg-type]
    app = FastAPI()
    app.get("/metrics")(server.metrics)
    client = TestClient(app)
    num_iters = 20 if quick else 200
    times_ms, size = [], 0
    for _ in range(num_iters + 3):
        start = time.perf_counter()
        resp = client.get("/metrics")
        times_ms.append(1e3 * (time.perf_counter() - start))
        assert resp.status_code == 200
        size = len(resp.content)
    times_ms = sorted(times_ms[3:])  # the first scrapes warm imports and caches
    snapshot_ms = []
    for _ in range(num_iters):
        start = time.perf_counter()
        asyncio.run(_Client().metrics_snapshot())
        snapshot_ms.append(1e3 * (time.perf_counter() - start))
    p50 = statistics.median(times_ms)
    p99 = times_ms[min(len(times_ms) - 1, int(0.99 * len(times_ms)))]
    report = {"num_workers": NUM_WORKERS, "num_running": NUM_RUNNING,
              "num_tenants": NUM_TENANTS, "num_scrapes": num_iters,
              "scrape_ms_p50": round(p50, 3), "scrape_ms_p99": round(p99, 3),
              "controller_snapshot_ms_p50": round(statistics.median(snapshot_ms), 3),
              "body_bytes": size, "target_ms": TARGET_MS, "meets_target": p99 < TARGET_MS}
    print(f"[metrics] /metrics with {NUM_RUNNING} running on {NUM_WORKERS} workers: "
          f"p50 {p50:.2f} ms, p99 {p99:.2f} ms ({size} bytes; target < {TARGET_MS:g} ms)")
    return report
