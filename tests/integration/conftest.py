"""One local Ray cluster with the tokenflow Serve app for the whole integration session.

Two CPU workers on builtin:tiny with a small KV pool and a small prefill cap, so every
limit the tests probe is reachable with short prompts. Ray binds to 127.0.0.1 and picks
its own free ports (6379 may be taken); Serve's HTTP port is a free one found here.
"""

from __future__ import annotations

import random
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from cluster.config import TokenflowConfig

# Small on purpose: 160 blocks x 8 tokens per worker, prompts over 76 tokens get 422.
CLUSTER_CONFIG: dict[str, Any] = {
    # check_kv_provenance: a step that would read KV of other tokens fails the worker, which
    # the session's end asserts never happened (workers/kv_provenance.py).
    "worker": {"model": "builtin:tiny", "num_workers": 2, "max_model_len": 1024,
               "default_max_tokens": 16, "check_kv_provenance": True},
    "cache": {"block_size": 8, "num_kv_blocks": 160},
    "scheduler": {"max_num_batched_tokens": 256, "max_num_seqs": 64},
    "protections": {"max_prefill_tokens": 64},
    "cluster": {"namespace": "tokenflow-test", "worker_num_cpus": 0.5,
                "controller_num_cpus": 0.25, "ingress_num_cpus": 0.25},
}


@dataclass
class Cluster:
    url: str  # http://127.0.0.1:PORT
    config: TokenflowConfig
    controller: Any  # the controller actor handle

    def stats(self) -> dict[str, Any]:
        import ray

        return ray.get(self.controller.stats.remote(), timeout=30)

    def check_integrity(self) -> dict[str, Any]:
        import ray

        return ray.get(self.controller.check_integrity.remote(), timeout=60)


# Ports for servers a test starts: below the kernel's ephemeral range (32768-60999 by
# default) and above Ray's worker ports (10002-19999), so that no socket Ray's processes
# open while the server starts can take the port first. One did (an ephemeral port from
# bind(0)): Serve then blocked the port for the ingress replica and every retry failed.
TEST_PORTS = range(20000, 32000)


def free_port() -> int:
    """A port in TEST_PORTS that is free now (random, so parallel runs rarely collide)."""
    rng = random.Random()
    for _ in range(200):
        port = rng.choice(TEST_PORTS)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {TEST_PORTS}")


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    import ray
    from ray import serve

    from cluster.ingress import build_app
    from controller.actor import CONTROLLER_NAME

    config = TokenflowConfig(**CLUSTER_CONFIG)
    ray.init(address="local", num_cpus=4, _node_ip_address="127.0.0.1",
             include_dashboard=False, namespace=config.cluster.namespace,
             logging_level="WARNING", log_to_driver=False)
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(config.model_dump()), name="tokenflow", route_prefix="/")
        controller = ray.get_actor(CONTROLLER_NAME, namespace=config.cluster.namespace)
        ray.get(controller.model_info.remote(), timeout=120)  # workers are up
        yield Cluster(f"http://127.0.0.1:{port}", config, controller)
        # No test fails these workers on purpose: a failure is a step the KV check refused
        # (its error is in the worker's log), or a crash, and either is a bug.
        workers = ray.get(controller.stats.remote(), timeout=30)["workers"]
        assert [w["num_failures"] for w in workers] == [0] * len(workers), workers
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="session")
def local_engine() -> Any:
    """The in-process twin with the same configuration, for greedy comparisons."""
    from cluster.engine import LocalEngine

    return LocalEngine(TokenflowConfig(**CLUSTER_CONFIG))
