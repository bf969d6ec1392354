"""Chaos: what a client sees when a worker or the controller is SIGKILLed mid-stream.

On a local Ray cluster with a journal in a `redis-server` this benchmark starts: 16 greedy
streams run once undisturbed for reference, then, per scenario and repetition, again while
a worker process (or the controller process) is killed once 4 streams have 2 tokens. For
each scenario: the recovery pause (the longest wait between two deltas of any stream,
P50 / max over the repetitions), requests lost (errors or unfinished; goal 0) and outputs
identical to the reference (goal: all). The node-loss scenes (benchmarks/node_loss_scene.py)
do the same on several Ray nodes while a worker's node or the controller's node dies, with
Ray's default node health checks. The journal's cost on the step loop comes from the
journal benchmark, measured in the same run.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import journal_bench
from benchmarks.chaos_streams import StreamResult, run_streams, summary
from cluster.config import TokenflowConfig
from cluster.controller_client import RayControllerClient
from controller.messages import SamplingParams

PARAMS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
PROMPTS = [[(13 * i + 7 * j + 3) % 480 + 1 for i in range(15 + 3 * j)] for j in range(16)]
ROOT = Path(__file__).resolve().parents[1]
NODE_LOSS_TIMEOUT_S = 900
NODE_LOSSES = ("a head, two worker nodes, two controller nodes (ray.cluster_utils.Cluster on "
               "this machine); every process of the lost node SIGKILLed at once; Ray's default "
               "node health checks (every 3 s, dead after 5 failures)")


async def _scenarios(controller: Any, num_reps: int) -> dict[str, Any]:
    client = RayControllerClient(controller)
    reference = await run_streams(client, PROMPTS, PARAMS, "ref")

    async def kill_worker(worker: int) -> None:
        pid = (await controller.stats.remote())["workers"][worker]["pid"]
        os.kill(pid, signal.SIGKILL)

    async def kill_controller() -> None:
        os.kill((await controller.stats.remote())["pid"], signal.SIGKILL)

    report: dict[str, Any] = {}
    for name in ("worker_sigkill", "controller_sigkill"):
        pauses: list[float] = []
        runs: list[list[StreamResult]] = []
        for rep in range(num_reps):
            kill = ((lambda w=rep % 2: kill_worker(w)) if name == "worker_sigkill"
                    else kill_controller)
            run = await run_streams(client, PROMPTS, PARAMS, f"{name}-{rep}", kill=kill)
            runs.append(run)
            pauses.append(max(r.longest_wait_s for r in run))
            await controller.wait_workers_up.remote(120)  # the next kill finds all up
        report[name] = summary(pauses, runs, reference)
    return report


def _node_losses(num_reps: int) -> dict[str, Any]:
    """The node-loss scenes (benchmarks/node_loss_scene.py), in a process of their own: a
    driver joins one Ray cluster per process."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "node_losses.json"
        subprocess.run([sys.executable, "-m", "benchmarks.node_loss_scene", str(path),
                        str(num_reps)], cwd=ROOT, check=True, timeout=NODE_LOSS_TIMEOUT_S)
        return json.loads(path.read_text())


def run(quick: bool, out_dir: Path) -> dict[str, Any]:
    import ray

    from controller.actor import get_or_create_controller
    from tests.redis_server import RedisServer

    num_reps = 1 if quick else 3
    started = time.perf_counter()
    server = RedisServer().start()
    ray.init(address="local", num_cpus=4, _node_ip_address="127.0.0.1",
             include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:
        config = TokenflowConfig(
            worker={"model": "builtin:tiny", "num_workers": 2},
            cache={"block_size": 8, "num_kv_blocks": 256},
            scheduler={"max_num_batched_tokens": 64},
            calibration={"auto": False},
            cluster={"namespace": "tokenflow-chaos", "worker_num_cpus": 0.5,
                     "controller_num_cpus": 0.1, "redis_url": server.url})
        controller = get_or_create_controller(config.controller_options())
        ray.get(controller.model_info.remote(), timeout=120)
        try:
            scenarios = asyncio.run(_scenarios(controller, num_reps))
        finally:
            ray.get(controller.shutdown.remote(), timeout=60)
            ray.kill(controller, no_restart=True)
    finally:
        ray.shutdown()
        server.kill()
    scenarios.update(_node_losses(num_reps))
    journal = journal_bench.run(quick, out_dir)
    targets = {
        "requests_lost": {"value": sum(s["num_requests_lost"] for s in scenarios.values()),
                          "target": 0},
        "outputs_identical": {"value": all(s["all_identical"] for s in scenarios.values()),
                              "target": True},
        "journal_overhead_share": {"value": journal["overhead_share_of_step"],
                                   "target": 0.05},
    }
    targets["requests_lost"]["met"] = targets["requests_lost"]["value"] == 0
    targets["outputs_identical"]["met"] = targets["outputs_identical"]["value"]
    targets["journal_overhead_share"]["met"] = journal["overhead_share_of_step"] <= 0.05
    return {"benchmark": "chaos", "model": "builtin:tiny", "num_streams": len(PROMPTS),
            "max_tokens": PARAMS.max_tokens, "scenarios": scenarios,
            "node_losses": NODE_LOSSES,
            "journal": {k: journal[k] for k in ("overhead_ms_per_step", "overhead_share_of_step",
                                                "round_trips_per_step", "cpu_per_step_ms")},
            "targets": targets, "wall_s": time.perf_counter() - started}
