"""A worker that hangs inside `execute` on a real Ray cluster: the step deadline catches
it, the controller kills it, its requests finish on the other worker with exactly the
tokens of an undisturbed run; health reports the worker down while it restarts (the test
holds the restart), and the worker comes back."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from benchmarks.chaos_streams import run_streams
from cluster.config import TokenflowConfig
from cluster.controller_client import RayControllerClient
from controller.messages import SamplingParams
from tests.integration.hang_worker import MARKER, SLOW_START

PARAMS = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
PROMPTS = [[(5 * i + 11 * j + 1) % 480 + 1 for i in range(12 + 2 * j)] for j in range(8)]
DEADLINE_S = 3.0


@pytest.fixture(scope="module")
def controller(cluster):
    import ray

    from controller.actor import get_or_create_controller

    config = TokenflowConfig(
        worker={"model": "builtin:tiny", "num_workers": 2},
        cache={"block_size": 8, "num_kv_blocks": 128},
        scheduler={"max_num_batched_tokens": 64},
        recovery={"step_deadline_min_s": DEADLINE_S, "step_deadline_factor": 1.0},
        cluster={"namespace": "tokenflow-hang", "worker_num_cpus": 0.5,
                 "controller_num_cpus": 0.1})
    options = dataclasses.replace(config.controller_options(),
                                  worker_cls="tests.integration.hang_worker:HangOnceWorker")
    controller = get_or_create_controller(options)
    ray.get(controller.model_info.remote(), timeout=120)
    yield controller
    MARKER.unlink(missing_ok=True)
    SLOW_START.unlink(missing_ok=True)
    ray.get(controller.shutdown.remote(), timeout=60)  # the workers are detached
    ray.kill(controller, no_restart=True)


async def run_scenario(controller) -> None:
    client = RayControllerClient(controller)
    reference = await run_streams(client, PROMPTS, PARAMS, "ref")
    MARKER.touch()  # the next step carrying a `hang` request sleeps
    SLOW_START.touch()  # and its restarted process waits until we let it start
    hung = await run_streams(client, PROMPTS, PARAMS, "hang")
    for j, (got, ref) in enumerate(zip(hung, reference, strict=True)):
        assert got.error is None and got.finish_reason == "length", (j, got.error)
        assert got.token_ids == ref.token_ids, j
    assert not MARKER.exists()  # the hang happened
    # The pause: the deadline, then the requests recompute on the other worker.
    assert max(r.longest_wait_s for r in hung) < DEADLINE_S + 10
    stats = await controller.stats.remote()
    assert sum(w["num_hangs"] for w in stats["workers"]) == 1
    hung_worker = next(w["worker"] for w in stats["workers"] if w["num_hangs"])
    # While it restarts: the service is up on the other worker, and says which is down.
    health = await controller.ping.remote()
    assert health["ok"] and health["num_workers_up"] == 1
    assert [w["up"] for w in health["workers"]] == [w != hung_worker for w in range(2)]
    SLOW_START.unlink()
    assert (await controller.wait_workers_up.remote(120))["num_workers_up"] == 2
    report = await asyncio.wait_for(controller.check_integrity.remote(), 60)
    assert all(w["checked"] for w in report["workers"])


def test_hung_worker_is_killed_and_its_requests_finish_elsewhere(controller) -> None:
    asyncio.run(asyncio.wait_for(run_scenario(controller), 300))
