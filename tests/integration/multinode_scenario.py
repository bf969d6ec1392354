"""Several Ray nodes on this machine (`ray.cluster_utils.Cluster`), nodes lost mid-stream.

Run by `test_multinode.py` in its own process (`python -m tests.integration.multinode_scenario
OUT.json`): a driver joins one Ray cluster per process, and the suite's session cluster
lives in the pytest process. Prints nothing the test reads; writes what it observed to OUT
(also what it saw before a failure: the test names the phase that did not finish).

The layout (benchmarks/node_cluster.py): a head (the driver only), two worker nodes, two
controller nodes (the controller on one, the other a spare); a `redis-server` of its own
holds the journal; Ray's node health checks shortened so that a dead node is declared dead
in about 2 s. Every phase waits on what it needs to have happened (a stream's tokens, the
GCS's node table, the controller's `wait_workers_up`, its stats), never on time. Then:
1. 16 greedy streams undisturbed: the reference.
2. The same 16 while one worker node is removed once 4 of the streams on its worker have 2
   tokens: the controller moves that worker's requests to the other.
3. A worker node joins: the lost worker is restarted there and takes new requests.
4. The same 16 while the controller's node is removed: Ray restarts the controller on the
   spare, which resumes every request from Redis.
5. Redis's node is lost (the server killed) while the controller lives: the same 16 lose
   nothing. Then, Redis still gone, the controller's node too (a new spare there): the
   restarted controller reads no journal, the edge sends every open request again and
   each runs to the same tokens;
   once Redis is back (empty) the restarted controller serves the same 16 again.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

from benchmarks.node_cluster import (
    CONTROLLER_RESOURCE,
    FAST_DETECTION,
    WORKER_RESOURCE,
    NodeCluster,
    controller_config,
)

NAMESPACE = "tokenflow-multinode"
NUM_TOKENS = 48  # long enough that a kill at 2 tokens lands mid-stream
PROMPTS = [[(7 * i + 13 * j + 3) % 500 + 1 for i in range(17 + 3 * j)] for j in range(16)]
SCENARIO_S = 150.0  # the whole scenario; the test's own bound is above it
WAIT_S = 60.0  # any one wait on the cluster


def _tokens(results: list[Any]) -> list[dict[str, Any]]:
    return [
        {
            "token_ids": r.token_ids,
            "finish_reason": r.finish_reason,
            "error": r.error,
            "longest_wait_s": r.longest_wait_s,
            "worker": r.worker,
        }
        for r in results
    ]


async def _run(nodes: NodeCluster, redis: Any, out: dict[str, Any]) -> None:
    from benchmarks.chaos_streams import run_streams
    from cluster.controller_client import RayControllerClient
    from controller.actor import get_or_create_controller
    from controller.messages import SamplingParams

    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
    workers = [nodes.add_node(WORKER_RESOURCE) for _ in range(2)]
    controllers = [nodes.add_node(CONTROLLER_RESOURCE) for _ in range(2)]
    out["node_ids"] = {
        "workers": [n.node_id for n in workers],
        "controllers": [n.node_id for n in controllers],
    }
    config = controller_config(NAMESPACE, redis.url)
    controller = get_or_create_controller(config.controller_options())
    info = await asyncio.wait_for(controller.model_info.remote(), WAIT_S)
    stats = await controller.stats.remote()
    out["start"] = {
        "num_workers": info["num_workers"],
        "nodes": info["nodes"],
        "controller_node": stats["node"],
    }
    client = RayControllerClient(controller)

    async def streams(
        tag: str, kill: Any = None, on_worker: int | None = None
    ) -> list[dict[str, Any]]:
        return _tokens(
            await run_streams(
                client,
                PROMPTS,
                params,
                tag,
                kill=kill,
                timeout_s=WAIT_S,
                kill_after_worker=on_worker,
            )
        )

    out["phase"] = "reference"
    out["reference"] = await streams("ref")

    out["phase"] = "worker node lost"
    lost = workers[0]
    lost_worker = info["nodes"].index(lost.node_id)
    lost_streams = await streams("wlost", lambda: nodes.remove(lost), lost_worker)
    detected_s = await nodes.wait_node_dead(lost.node_id, WAIT_S)
    slot = (await controller.stats.remote())["workers"][lost_worker]
    out["worker_node_lost"] = {
        "streams": lost_streams,
        "lost_worker": lost_worker,
        "num_failures": slot["num_failures"],
        "num_requests_moved": slot["num_requests_moved"],
        "is_up": slot["is_up"],
        "dead_after_s": detected_s,
    }

    out["phase"] = "worker node joins"
    joined = nodes.add_node(WORKER_RESOURCE)
    await asyncio.wait_for(controller.wait_workers_up.remote(WAIT_S), WAIT_S + 10)
    before = (await controller.stats.remote())["workers"][lost_worker]["num_routed"]
    after_join = await streams("joined")
    slot = (await controller.stats.remote())["workers"][lost_worker]
    out["joined"] = {
        "node_id": joined.node_id,
        "worker_node": slot["node"],
        "num_routed_after_join": slot["num_routed"] - before,
        "streams": after_join,
    }

    out["phase"] = "controller node lost"
    out["controller_node_lost"] = await _lose_the_controller_node(
        nodes, controller, controllers, lambda kill: streams("clost", kill)
    )
    controllers.append(nodes.add_node(CONTROLLER_RESOURCE))  # the next loss's spare

    out["phase"] = "redis lost"
    out["redis_lost"] = await streams("rlost", lambda: asyncio.to_thread(redis.kill))
    out["journal_while_redis_lost"] = (await controller.stats.remote())["journal"]

    out["phase"] = "controller node lost while redis is lost"
    out["controller_and_redis_lost"] = await _lose_the_controller_node(
        nodes, controller, controllers, lambda kill: streams("crlost", kill)
    )
    out["journal_error"] = (await controller.stats.remote())["journal_error"]
    redis.start()  # on its port again, empty: what a replaced Redis node would be
    out["phase"] = "serving after redis is back"
    out["after_redis_back"] = await streams("back")

    out["phase"] = "integrity"
    report = await asyncio.wait_for(controller.check_integrity.remote(), WAIT_S)
    out["integrity_checked"] = [w["checked"] for w in report["workers"]]
    await controller.shutdown.remote()
    out["phase"] = "done"


async def _lose_the_controller_node(
    nodes: NodeCluster, controller: Any, controllers: list[Any], run: Any
) -> dict[str, Any]:
    """Remove the node the controller runs on while `run` streams; what came of it."""
    before = await controller.stats.remote()
    (node,) = [n for n in controllers if n.node_id == before["node"]]
    controllers.remove(node)
    started = time.monotonic()
    results = await run(lambda: nodes.remove(node))
    elapsed = time.monotonic() - started
    after = await asyncio.wait_for(controller.stats.remote(), WAIT_S)
    return {
        "streams": results,
        "lost_node": node.node_id,
        "node": after["node"],
        "spares": [n.node_id for n in controllers],
        "pid_changed": after["pid"] != before["pid"],
        "num_resumed": after["num_resumed"],
        "elapsed_s": elapsed,
    }


def main(path: str) -> int:
    from tests.redis_server import RedisServer

    redis = RedisServer().start()
    out: dict[str, Any] = {}
    try:
        nodes = NodeCluster.start(NAMESPACE, FAST_DETECTION)
        try:
            asyncio.run(asyncio.wait_for(_run(nodes, redis, out), SCENARIO_S))
        finally:
            nodes.shutdown()
    finally:
        with open(path, "w") as f:
            json.dump(out, f)
        redis.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
