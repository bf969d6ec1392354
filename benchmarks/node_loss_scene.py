"""Chaos, node losses: what a client sees when a worker's node or the controller's node dies.

Part of the chaos benchmark, run in a process of its own (`python -m
benchmarks.node_loss_scene OUT.json REPS`: a driver joins one Ray cluster per process).
On several Ray nodes on this machine (benchmarks/node_cluster.py) with Ray's default
node health checks and a journal in a `redis-server`: the chaos benchmark's 16 greedy
streams once undisturbed, then, per scene and repetition, again while a node is removed
(every process on it killed at once) once 4 streams on the lost worker (or any 4 streams,
for the controller's node) have 2 tokens. After a worker node's loss a node joins and the
next repetition waits until the lost worker is back on it; after the controller's node's
loss a new spare controller node joins.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

from benchmarks.node_cluster import (
    CONTROLLER_RESOURCE,
    WORKER_RESOURCE,
    NodeCluster,
    controller_config,
)

NAMESPACE = "tokenflow-chaos-nodes"
WAIT_S = 180.0  # a worker back after Ray's default detection, on a loaded machine


async def _scenes(nodes: NodeCluster, redis_url: str, num_reps: int) -> dict[str, Any]:
    from benchmarks.chaos_bench import PARAMS, PROMPTS
    from benchmarks.chaos_streams import StreamResult, run_streams, summary
    from cluster.controller_client import RayControllerClient
    from controller.actor import get_or_create_controller

    workers = [nodes.add_node(WORKER_RESOURCE) for _ in range(2)]
    controllers = [nodes.add_node(CONTROLLER_RESOURCE) for _ in range(2)]
    config = controller_config(NAMESPACE, redis_url)
    controller = get_or_create_controller(config.controller_options())
    await asyncio.wait_for(controller.model_info.remote(), WAIT_S)
    client = RayControllerClient(controller)
    reference = await run_streams(client, PROMPTS, PARAMS, "ref")
    report: dict[str, Any] = {}

    runs: list[list[StreamResult]] = []
    num_moved = []
    for rep in range(num_reps):
        worker = rep % 2
        node_id = (await controller.model_info.remote())["nodes"][worker]
        (node,) = [n for n in workers if n.node_id == node_id]
        workers.remove(node)
        moved_before = (await controller.stats.remote())["workers"][worker]["num_requests_moved"]
        runs.append(
            await run_streams(
                client,
                PROMPTS,
                PARAMS,
                f"wnode-{rep}",
                kill=lambda node=node: nodes.remove(node),
                kill_after_worker=worker,
            )
        )
        slot = (await controller.stats.remote())["workers"][worker]
        num_moved.append(slot["num_requests_moved"] - moved_before)
        workers.append(nodes.add_node(WORKER_RESOURCE))
        await asyncio.wait_for(controller.wait_workers_up.remote(WAIT_S), WAIT_S + 10)
    report["worker_node_loss"] = {
        **summary([max(r.longest_wait_s for r in run) for run in runs], runs, reference),
        "num_requests_moved": num_moved,
    }

    runs = []
    num_resumed = []
    for rep in range(num_reps):
        node_id = (await controller.stats.remote())["node"]
        (node,) = [n for n in controllers if n.node_id == node_id]
        controllers.remove(node)
        runs.append(
            await run_streams(
                client, PROMPTS, PARAMS, f"cnode-{rep}", kill=lambda node=node: nodes.remove(node)
            )
        )
        num_resumed.append((await controller.stats.remote())["num_resumed"])
        controllers.append(nodes.add_node(CONTROLLER_RESOURCE))
    report["controller_node_loss"] = {
        **summary([max(r.longest_wait_s for r in run) for run in runs], runs, reference),
        "num_requests_resumed": num_resumed,
    }
    await controller.shutdown.remote()
    return report


def main(path: str, num_reps: int) -> int:
    from tests.redis_server import RedisServer

    redis = RedisServer().start()
    try:
        nodes = NodeCluster.start(NAMESPACE)  # Ray's default health checks
        try:
            report = asyncio.run(_scenes(nodes, redis.url, num_reps))
        finally:
            nodes.shutdown()
    finally:
        redis.kill()
    with open(path, "w") as f:
        json.dump(report, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2])))
