"""Several Ray nodes on this machine (`ray.cluster_utils.Cluster`, loopback only) with the
tokenflow controller on them, and nodes lost the hard way.

Shared by the multi-node test (tests/integration/multinode_scenario.py) and the chaos
benchmark's node-loss scenes. The layout: a head that runs only the driver, worker nodes
that declare `tokenflow_worker: 1` (one worker each) and controller nodes that declare
`tokenflow_controller: 1` (the controller runs on one, the others are spares). A removed
node loses its raylet and every process on it at once (SIGKILL), as a machine that dies.

Ray notices a dead node by its health checks: every `health_check_period_ms`, dead after
`health_check_failure_threshold` failures in a row (Ray's defaults: 3 s and 5, about 15 s).
`detection` shortens that for the test; the benchmark keeps Ray's defaults.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from dataclasses import dataclass
from typing import Any

# Before Ray is imported: "127.0.0.1" stays every node's address (loopback only). Where Ray
# came first, `_node_ip_address` below does the same for the driver.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

WORKER_RESOURCE = "tokenflow_worker"
CONTROLLER_RESOURCE = "tokenflow_controller"
# A dead raylet refuses the check at once, so a short period finds it fast; a live one
# slowed down by load still has Ray's full timeout to answer each check.
FAST_DETECTION = {"health_check_period_ms": 500, "health_check_failure_threshold": 3}
_OBJECT_STORE_BYTES = 80 * 1024 * 1024
_POLL_S = 0.1


def node_args(**resources: float) -> dict[str, Any]:
    return {
        "num_cpus": 1,
        "resources": resources,
        "node_ip_address": "127.0.0.1",
        "object_store_memory": _OBJECT_STORE_BYTES,
    }


def controller_config(namespace: str, redis_url: str | None) -> Any:
    """builtin:tiny, one worker per `tokenflow_worker` unit, the controller pinned to the
    nodes that declare `tokenflow_controller`, a journal when `redis_url` is given."""
    from cluster.config import TokenflowConfig

    return TokenflowConfig(
        worker={"model": "builtin:tiny"},
        cache={"block_size": 8, "num_kv_blocks": 256},
        scheduler={"max_num_batched_tokens": 64},
        calibration={"auto": False},
        cluster={
            "namespace": namespace,
            "worker_num_cpus": 0.5,
            "controller_num_cpus": 0.1,
            "worker_resource": WORKER_RESOURCE,
            "controller_resource": CONTROLLER_RESOURCE,
            "redis_url": redis_url,
        },
    )


@dataclass
class NodeCluster:
    cluster: Any  # ray.cluster_utils.Cluster

    @classmethod
    def start(cls, namespace: str, detection: dict[str, int] | None = None) -> NodeCluster:
        """A head (the driver's node, no tokenflow part) and the driver connected to it."""
        import ray
        from ray.cluster_utils import Cluster

        from tests.redis_server import free_port

        head = {
            **node_args(),
            "include_dashboard": False,
            # A free port: Ray's default (52365) may be another local cluster's agent.
            "dashboard_agent_listen_port": free_port(),
        }
        if detection:
            head["_system_config"] = detection
        cluster = Cluster(initialize_head=True, head_node_args=head)
        try:
            ray.init(
                address=cluster.address,
                namespace=namespace,
                _node_ip_address="127.0.0.1",
                logging_level="WARNING",
                log_to_driver=False,
            )
        except BaseException:
            cluster.shutdown()
            raise
        return cls(cluster)

    def add_node(self, resource: str) -> Any:
        """A node declaring one unit of `resource`; returns once the cluster lists it."""
        return self.cluster.add_node(**node_args(**{resource: 1}))

    async def remove(self, node: Any) -> None:
        """Kill every process of the node at once, then let the cluster forget it; off the
        event loop, so streams keep being read (the pause they see is the cluster's)."""
        await asyncio.to_thread(self._remove, node)

    def _remove(self, node: Any) -> None:
        import psutil

        # The raylet's children too: the actors' worker processes, which Ray's own removal
        # leaves to exit when they notice their raylet is gone (a dying machine takes
        # them at once, mid-step).
        processes = []
        for infos in node.all_processes.values():
            for info in infos:
                with contextlib.suppress(psutil.NoSuchProcess):
                    process = psutil.Process(info.process.pid)
                    processes += [process, *process.children(recursive=True)]
        for process in processes:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        self.cluster.remove_node(node, allow_graceful=False)  # reaps what it started

    async def wait_node_dead(self, node_id: str, timeout_s: float) -> float:
        """Until the GCS lists `node_id` as dead (its health checks failed); returns the
        seconds waited. A condition on the GCS's node table, polled."""
        import ray

        started = time.monotonic()
        while True:
            nodes = await asyncio.to_thread(ray.nodes)
            if any(n["NodeID"] == node_id and not n["Alive"] for n in nodes):
                return time.monotonic() - started
            if time.monotonic() - started > timeout_s:
                raise TimeoutError(
                    f"the GCS still lists node {node_id} as alive after {timeout_s:.0f} s"
                )
            await asyncio.sleep(_POLL_S)  # a poll interval

    def shutdown(self) -> None:
        import ray

        ray.shutdown()
        self.cluster.shutdown()
