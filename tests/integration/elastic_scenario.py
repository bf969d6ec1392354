"""The elastic pool on a real multi-node Ray cluster on this machine: workers added and
drained while streams run, through `tokenflow workers` and the controller actor.

Run by `test_elastic.py` in its own process (`python -m tests.integration.elastic_scenario
OUT.json`): a driver joins one Ray cluster per process. Writes what it observed to OUT.

The layout (`ray.cluster_utils.Cluster`, loopback only): a head with the controller and
the driver, worker node A declaring `tokenflow_worker: 1` (the pool at start: one worker).
1. 16 greedy streams on the one worker: the reference.
2. `tokenflow workers add` (a process of its own) while no node has a unit free: the new
   worker waits, loading. Node B joins with `tokenflow_worker: 1`: the worker lands there
   and serves; the 16 streams again, some on the new worker.
3. The 16 again while `tokenflow workers drain` drains the new worker mid-stream: its
   requests finish there, it is removed and B's unit is free again.
4. A worker is added again (on B) and drained mid-stream with a zero timeout: its requests
   move to worker 0 and end with the same tokens.
5. A second controller with load-driven scaling on short windows shrinks its idle pool and
   grows it back under a queue (`_scale_with_load`).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# Before Ray is imported: keep "127.0.0.1" as every node's address (loopback only).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

ROOT = Path(__file__).resolve().parents[2]
WORKER_RESOURCE = "tokenflow_worker"
NAMESPACE = "tokenflow-elastic"
NUM_TOKENS = 128
PROMPTS = [[(5 * i + 11 * j + 2) % 500 + 1 for i in range(15 + 3 * j)] for j in range(16)]


def _node_args(**resources: float) -> dict[str, Any]:
    return {"num_cpus": 1, "resources": resources, "node_ip_address": "127.0.0.1",
            "object_store_memory": 80 * 1024 * 1024}


def _cli_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "TOKENFLOW_CLUSTER__NAMESPACE": NAMESPACE}


async def _cli_run(address: str, *args: str) -> subprocess.CompletedProcess[str]:
    """`tokenflow workers ...` as an operator runs it: a process of its own."""
    env = _cli_env()
    return await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "cluster.cli", "workers", "--address", address,
                         *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)


async def _cli(address: str, *args: str) -> Any:
    proc = await _cli_run(address, *args)
    if proc.returncode != 0:
        raise RuntimeError(f"tokenflow workers {args}: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# `tokenflow workers ARGS` (cluster.cli's main) in a process that first joins the cluster and
# finds the controller, says "ready", and runs the command once it reads a line.
_READY_CLI = """
import sys
from cluster.cli import main
from cluster.config import TokenflowConfig
from cluster.workers_cli import connect
assert connect(sys.argv[1], TokenflowConfig().cluster.namespace) is not None
print("ready", flush=True)
sys.stdin.readline()
sys.exit(main(["workers", "--address", *sys.argv[1:]]))
"""


class ReadyCli:
    """`tokenflow workers ARGS` from a process of its own, started (Python, Ray and the
    cluster joined: seconds on 2 cores) before the moment it must land at: `run` then
    reaches the controller at once, mid-stream and not after the streams ended."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    @classmethod
    async def start(cls, address: str, *args: str) -> ReadyCli:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _READY_CLI, address, *args, cwd=ROOT, env=_cli_env(),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 120)
        if line.strip() != b"ready":
            _, err = await proc.communicate()
            raise RuntimeError(f"tokenflow workers {args} did not start: {err[-2000:]!r}")
        return cls(proc)

    async def run(self, timeout_s: float = 180.0) -> Any:
        out, err = await asyncio.wait_for(self.proc.communicate(b"go\n"), timeout_s)
        if self.proc.returncode != 0:
            raise RuntimeError(f"tokenflow workers: {err.decode()[-2000:]}")
        return json.loads(out.decode().strip().splitlines()[-1])


async def _unit_freed(node_id: str, timeout_s: float = 30.0) -> float:
    """The worker resource free on `node_id` once Ray has taken the killed actor's back."""
    from ray._private.state import available_resources_per_node

    deadline = time.monotonic() + timeout_s
    free = 0.0
    while time.monotonic() < deadline:
        free = available_resources_per_node().get(node_id, {}).get(WORKER_RESOURCE, 0.0)
        if free >= 1:
            break
        await asyncio.sleep(0.2)  # a poll of Ray's resource view, bounded by the deadline
    return free


async def _until_serving(controller: Any, name: str, timeout_s: float = 150.0
                         ) -> list[dict[str, Any]]:
    """`workers()` once worker `name` serves (its node joined and its model loaded)."""
    deadline = time.monotonic() + timeout_s
    while True:
        rows = await controller.workers.remote()
        if any(w["name"] == name and w["state"] == "serving" for w in rows):
            return rows
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name} does not serve: {rows}")
        await asyncio.sleep(0.2)  # a poll of the controller's state, bounded by the deadline


async def _run(cluster: Any, out: dict[str, Any]) -> None:
    import ray

    from benchmarks.chaos_streams import run_streams
    from cluster.config import TokenflowConfig
    from cluster.controller_client import RayControllerClient
    from controller.actor import get_or_create_controller
    from controller.messages import SamplingParams
    from controller.startup import can_place_worker, request_worker_resources

    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
    node_a = cluster.add_node(**_node_args(**{WORKER_RESOURCE: 1}))
    cluster.wait_for_nodes()
    config = TokenflowConfig(
        # No prefix caching: the same prompts again would all go where their blocks are
        # (worker 0), and the new worker must be chosen by load.
        worker={"model": "builtin:tiny"},
        cache={"block_size": 8, "num_kv_blocks": 512, "enable_prefix_caching": False},
        scheduler={"max_num_batched_tokens": 64},
        cluster={"namespace": NAMESPACE, "worker_num_cpus": 0.5, "controller_num_cpus": 0.1,
                 "worker_resource": WORKER_RESOURCE})
    controller = get_or_create_controller(config.controller_options())
    info = await asyncio.wait_for(controller.model_info.remote(), 180)
    out["start"] = {"nodes": info["nodes"], "node_a": node_a.node_id}
    out["phase_at_s"] = phases = {"started": time.monotonic()}
    client = RayControllerClient(controller)

    def tokens(results: list[Any]) -> list[dict[str, Any]]:
        return [{"token_ids": r.token_ids, "finish_reason": r.finish_reason, "error": r.error}
                for r in results]

    out["reference"] = tokens(await run_streams(client, PROMPTS, params, "ref"))
    phases["reference"] = time.monotonic()

    # 2. An operator adds a worker while no node has a unit free: it waits, loading; a node
    #    with the resource joins and the worker lands there and takes new requests.
    options = config.controller_options()
    could_place_before = can_place_worker(options)
    added = await _cli(cluster.address, "add")
    loading = [w["state"] for w in await controller.workers.remote()]
    pending = (await controller.metrics_snapshot.remote()).pool_states
    node_b = cluster.add_node(**_node_args(**{WORKER_RESOURCE: 1}))
    cluster.wait_for_nodes()
    rows = await _until_serving(controller, added["name"])
    new = next(w["worker"] for w in rows if w["name"] == added["name"])
    request_worker_resources(options, 2)  # what the autoscaler would be told: no error
    after_add = tokens(await run_streams(client, PROMPTS, params, "added"))
    stats = await controller.stats.remote()
    phases["added"] = time.monotonic()
    out["added"] = {**added, "worker": new, "node": stats["workers"][new]["node"],
                    "states_before_join": loading, "pool_states_before_join": pending,
                    "could_place_before": could_place_before, "node_b": node_b.node_id,
                    "streams": after_add, "num_routed_new": stats["workers"][new]["num_routed"]}

    # 3. Drained mid-stream: its requests finish, then it is removed and B's unit freed.
    report: dict[str, Any] = {}
    drain_cli = await ReadyCli.start(cluster.address, "drain", str(new), "--timeout", "120")

    async def drain() -> None:
        report.update(await drain_cli.run())

    drained = tokens(await run_streams(client, PROMPTS, params, "drain", kill=drain))
    listing = await _cli(cluster.address, "list", "--json")
    phases["drained"] = time.monotonic()
    out["drained"] = {"report": report, "streams": drained,
                      "states": {str(w["worker"]): w["state"] for w in listing},
                      "free_on_b": await _unit_freed(node_b.node_id),
                      "health": await controller.ping.remote()}

    # 4. Added again and drained with no time to finish: its requests move, same tokens.
    again = await asyncio.wait_for(controller.add_worker.remote(True, 150), 180)
    moved: dict[str, Any] = {}

    async def drain_now() -> None:
        moved.update(await controller.drain_worker.remote(again["worker"], 0.0))

    after_move = tokens(await run_streams(client, PROMPTS, params, "moved", kill=drain_now))
    refused = await _cli_run(cluster.address, "drain", "0")  # the last serving worker
    phases["moved"] = time.monotonic()
    out["moved"] = {"added": again, "report": moved, "streams": after_move,
                    "refusal": [refused.returncode, refused.stderr.strip().splitlines()[-1:]]}
    integrity = await asyncio.wait_for(controller.check_integrity.remote(), 120)
    out["integrity_checked"] = [w["checked"] for w in integrity["workers"]]
    snap = await controller.metrics_snapshot.remote()
    out["metrics"] = {"pool_states": snap.pool_states,
                      "scale_events": [[d, r, n] for (d, r), n in snap.scale_events.items()]}
    await controller.shutdown.remote()
    ray.kill(controller, no_restart=True)
    await _scale_with_load(client_params=params, out=out)
    phases["scaling"] = time.monotonic()


async def _until(what: str, check: Any, timeout_s: float = 60.0) -> Any:
    """The first truthy `await check()`, polled (a state, not a sleep as synchronisation)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = await check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen in {timeout_s:.0f} s")
        await asyncio.sleep(0.2)


async def _scale_with_load(client_params: Any, out: dict[str, Any]) -> None:
    """5. A controller with load-driven scaling (short windows): it starts with a worker per
    free unit (2), drains one that stays idle past the cool-down, and adds one back when
    the queue stays over its threshold; the streams meanwhile keep their tokens."""
    import ray

    from benchmarks.chaos_streams import run_streams
    from cluster.config import TokenflowConfig
    from cluster.controller_client import RayControllerClient
    from controller.actor import get_or_create_controller

    config = TokenflowConfig(
        worker={"model": "builtin:tiny"},
        cache={"block_size": 8, "num_kv_blocks": 512, "enable_prefix_caching": False},
        scheduler={"max_num_batched_tokens": 64, "max_num_seqs": 4},
        cluster={"namespace": NAMESPACE + "-scaling", "worker_num_cpus": 0.5,
                 "controller_num_cpus": 0.1, "worker_resource": WORKER_RESOURCE},
        scaling={"enabled": True, "min_workers": 1, "max_workers": 2, "waiting_per_worker": 2,
                 "window_s": 1.0, "sample_interval_s": 0.2, "idle_cooldown_s": 2.0,
                 "drain_timeout_s": 30})
    controller = get_or_create_controller(config.controller_options())
    info = await asyncio.wait_for(controller.model_info.remote(), 180)

    async def events() -> dict[tuple[str, str], int]:
        return (await controller.metrics_snapshot.remote()).scale_events

    async def shrunk() -> bool:
        return (await events())[("down", "idle")] >= 1 and \
            (await controller.metrics_snapshot.remote()).pool_states["serving"] == 1

    await _until("an idle worker drained", shrunk)
    client = RayControllerClient(controller)

    async def grown() -> bool:
        return (await events())[("up", "queue")] >= 1

    # Waves of load until the queue has held long enough for a worker to be added: on a
    # fast CPU one wave of builtin:tiny streams is done before the policy's window ends.
    results: list[Any] = []
    deadline = time.monotonic() + 60.0
    while not await grown():
        if time.monotonic() > deadline:
            raise TimeoutError("a worker added under the queue did not happen in 60 s")
        results += await run_streams(client, PROMPTS + PROMPTS, client_params,
                                     f"load{len(results)}")
    listing = await controller.workers.remote()
    out["scaling"] = {
        "num_workers_at_start": info["num_workers"],
        "events": [[d, r, n] for (d, r), n in (await events()).items()],
        "states": [w["state"] for w in listing],
        "num_waves": len(results) // (2 * len(PROMPTS)),
        "streams": [{"token_ids": r.token_ids, "finish_reason": r.finish_reason,
                     "error": r.error} for r in results]}
    await controller.shutdown.remote()
    ray.kill(controller, no_restart=True)


def main(path: str) -> int:
    import ray
    from ray.cluster_utils import Cluster

    from tests.redis_server import free_port

    started = time.monotonic()
    # The head's agent on a free port: Ray's default may be another local cluster's.
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "node_ip_address": "127.0.0.1", "include_dashboard": False,
        "dashboard_agent_listen_port": free_port(),
        "object_store_memory": 80 * 1024 * 1024})
    out: dict[str, Any] = {}
    try:
        ray.init(address=cluster.address, namespace=NAMESPACE, logging_level="WARNING",
                 log_to_driver=False)
        asyncio.run(asyncio.wait_for(_run(cluster, out), 300))
    finally:
        out["elapsed_s"] = time.monotonic() - started
        with open(path, "w") as f:
            json.dump(out, f)
        ray.shutdown()
        cluster.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
