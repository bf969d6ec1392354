"""A worker SIGKILLed on a real Ray cluster: once Ray restarts it, a greedy request whose
prefix was cached before the crash returns the very tokens it returned before.

The restarted process has zeroed KV tensors; a controller that kept the pool's prefix
hashes would serve the prefix from them and answer wrongly with no error. A second
controller (its own namespace, one worker) on the session's Ray cluster, so the shared
cluster's workers keep their restart budget.
"""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from cluster.config import TokenflowConfig
from cluster.controller_client import RayControllerClient, run_request
from controller.messages import SamplingParams

PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPT = [(7 * i + 3) % 500 + 1 for i in range(41)]  # 5 full blocks of 8 cached


@pytest.fixture(scope="module")
def restart_controller(cluster):
    import ray

    from controller.actor import get_or_create_controller

    config = TokenflowConfig(model="builtin:tiny", num_workers=1, worker_num_cpus=0.5,
                             block_size=8, num_kv_blocks=128, max_num_batched_tokens=64,
                             namespace="tokenflow-restart", controller_num_cpus=0.1,
                             worker_max_restarts=2, enable_prefix_caching=True)
    controller = get_or_create_controller(config.controller_options())
    ray.get(controller.model_info.remote(), timeout=120)
    yield controller
    ray.kill(controller)


async def run_scenario(controller) -> None:
    client = RayControllerClient(controller)

    async def generate(request_id: str) -> tuple[list[int], str | None]:
        _, done = await asyncio.wait_for(run_request(client, PROMPT, PARAMS, request_id), 180)
        return done.token_ids, done.error

    before, error = await generate("before")
    assert error is None and len(before) == PARAMS.max_tokens
    hit, _ = await generate("hit")  # served from the prefix cache
    assert hit == before
    worker = (await controller.stats.remote())["workers"][0]
    os.kill(worker["pid"], signal.SIGKILL)

    # The first request after the kill may fail (its step was meant for the dead
    # process); a later one runs on the restarted worker and must not read dead KV.
    attempts: list[tuple[list[int], str | None]] = []
    for attempt in range(5):
        attempts.append(await generate(f"after-{attempt}"))
        if attempts[-1][1] is None:
            break
    tokens, error = attempts[-1]
    assert error is None, attempts
    assert tokens == before, "a restarted worker served a prefix cached before the crash"
    after = (await controller.stats.remote())["workers"][0]
    assert after["pid"] != worker["pid"] and after["incarnation"] != worker["incarnation"]
    report = await asyncio.wait_for(controller.check_integrity.remote(), 60)
    assert all(w["checked"] for w in report["workers"])


def test_cached_prefix_is_recomputed_after_a_worker_restart(restart_controller):
    asyncio.run(asyncio.wait_for(run_scenario(restart_controller), 600))
