"""Steps through a Ray Compiled Graph (`cluster.worker_transport: compiled_graph`) on a real
Ray cluster.

A second controller (its own namespace, two workers, async scheduling on, so the next step
is planned and sent while the current one runs) serves greedy streams with exactly
LocalEngine's token ids, every worker's steps going through its graph. The transport on
its own, against a stand-in worker actor: a compile that fails (injected through the
constructor) falls back to actor calls; a graph survives a close and rebuild; a worker
SIGKILLed with a step in flight fails that step at once, not at the step deadline. A
controller SIGKILLed while its workers run in its graphs: the restarted controller serves
the same answers (the workers join a new graph, or fall back to actor calls while a dead
graph still holds them), and a worker restarted afterwards is back on a graph. The worker
SIGKILL mid-stream test (test_worker_restart.py) runs with both transports.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from typing import Any

import pytest

from benchmarks.chaos_streams import run_streams
from cluster.config import TokenflowConfig
from cluster.controller_client import RayControllerClient
from controller.messages import SamplingParams, StepPlan
from controller.transport import ACTOR_CALL, COMPILED_GRAPH, CompiledGraphTransport
from tests.integration.test_openai_api import GREEDY, PROMPTS, local_greedy

PARAMS = SamplingParams(max_tokens=GREEDY["max_tokens"], temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def controller(cluster):
    import ray

    from controller.actor import get_or_create_controller

    config = TokenflowConfig(
        worker={"model": "builtin:tiny", "num_workers": 2},
        cache={"block_size": 8, "num_kv_blocks": 256},
        scheduler={"max_num_batched_tokens": 64, "async_scheduling": True},
        cluster={"namespace": "tokenflow-cgraph", "worker_num_cpus": 0.5,
                 "controller_num_cpus": 0.1, "worker_transport": "compiled_graph"})
    controller = get_or_create_controller(config.controller_options())
    ray.get(controller.model_info.remote(), timeout=120)
    yield controller
    ray.get(controller.shutdown.remote(), timeout=60)  # the workers are detached
    ray.kill(controller, no_restart=True)


async def _greedy(controller: Any, tag: str) -> list[list[int]]:
    client = RayControllerClient(controller)
    results = await run_streams(client, PROMPTS * 2, PARAMS, tag)  # both workers busy
    assert all(r.error is None and r.finish_reason == "length" for r in results)
    return [r.token_ids for r in results]


def test_greedy_ids_through_compiled_graphs_match_local_engine(controller, local_engine
                                                               ) -> None:
    import ray

    workers = ray.get(controller.stats.remote(), timeout=30)["workers"]
    assert [w["transport"] for w in workers] == [COMPILED_GRAPH, COMPILED_GRAPH], [
        w["transport_fallback"] for w in workers]
    got = asyncio.run(asyncio.wait_for(_greedy(controller, "cg"), 300))
    assert got == local_greedy(local_engine, PROMPTS) * 2
    workers = ray.get(controller.stats.remote(), timeout=30)["workers"]
    assert all(w["num_loop_steps"] > 0 and w["num_failures"] == 0 for w in workers)


def _standin(namespace: str) -> Any:
    import ray

    from benchmarks.standin_worker import StandInWorkerActor
    from controller.options import CacheConfig, WorkerConfig

    return ray.remote(StandInWorkerActor).options(
        num_cpus=0.01, max_concurrency=StandInWorkerActor.MAX_CONCURRENCY, max_restarts=-1,
        namespace=namespace
    ).remote(WorkerConfig(), CacheConfig(block_size=8, num_kv_blocks=64))


def _fail_compile(handle: Any, incarnation: str) -> Any:
    raise RuntimeError("no compiled graphs here")


def test_transport_falls_back_rebuilds_and_sees_a_dead_worker_at_once(cluster) -> None:
    import ray

    handle = _standin("tokenflow-cgraph-unit")
    try:
        async def main() -> None:
            info = await handle.info.remote()
            fallback = CompiledGraphTransport(handle, info.incarnation, 5.0,
                                              compile_graph=_fail_compile)
            await fallback.reopen(handle, info.incarnation)
            assert fallback.kind == ACTOR_CALL
            assert "no compiled graphs here" in (fallback.fallback_reason or "")
            assert (await fallback.send(StepPlan(step_id=1))).step_id == 1

            transport = CompiledGraphTransport(handle, info.incarnation, 5.0)
            await transport.reopen(handle, info.incarnation)
            assert transport.kind == COMPILED_GRAPH, transport.fallback_reason
            sent = [transport.send(StepPlan(step_id=i)) for i in (2, 3)]  # two in flight
            assert [(await s).step_id for s in sent] == [2, 3]
            await transport.reopen(handle, info.incarnation)  # torn down, built again
            assert transport.kind == COMPILED_GRAPH, transport.fallback_reason
            assert (await transport.send(StepPlan(step_id=4))).step_id == 4

            step = transport.send(StepPlan(step_id=5))
            os.kill(info.pid, signal.SIGKILL)
            start = time.monotonic()
            with pytest.raises(Exception):  # noqa: B017 - any failure of the call
                await asyncio.wait_for(step, 30)
            assert time.monotonic() - start < 20  # the loop's watch, not a timeout
            transport.close()
            with_new = info
            for _ in range(100):  # Ray restarts the actor: a new incarnation
                with contextlib.suppress(ray.exceptions.RayActorError):
                    with_new = await handle.info.remote()
                if with_new.incarnation != info.incarnation:
                    break
                await asyncio.sleep(0.2)
            await transport.reopen(handle, with_new.incarnation)
            assert transport.kind == COMPILED_GRAPH, transport.fallback_reason
            assert (await transport.send(StepPlan(step_id=6))).step_id == 6
            transport.close()

        asyncio.run(asyncio.wait_for(main(), 120))
    finally:
        ray.kill(handle, no_restart=True)


def test_controller_sigkill_with_compiled_graphs_then_same_answers(controller) -> None:
    import ray

    async def main() -> None:
        reference = await _greedy(controller, "before")
        stats = await controller.stats.remote()
        os.kill(stats["pid"], signal.SIGKILL)
        for _ in range(300):  # Ray restarts the controller; it reattaches to the workers
            try:
                restarted = await asyncio.wait_for(controller.stats.remote(), 10)
                if restarted["pid"] != stats["pid"]:
                    break
            except (ray.exceptions.RayActorError, TimeoutError):
                pass
            await asyncio.sleep(0.2)
        assert await _greedy(controller, "after") == reference
        for w in restarted["workers"]:
            # A worker still held by the dead controller's graph cannot join a new one.
            assert w["transport"] == COMPILED_GRAPH or "graph thread" in w["transport_fallback"]
            assert w["num_failures"] == 0

        # A worker restarted afterwards has no dead graph's loop: it is back on a graph.
        os.kill(restarted["workers"][0]["pid"], signal.SIGKILL)
        assert await _greedy(controller, "worker-restarted") == reference  # noticed here
        assert (await controller.wait_workers_up.remote(120))["ok"]
        worker = (await controller.stats.remote())["workers"][0]
        assert worker["transport"] == COMPILED_GRAPH, worker

    asyncio.run(asyncio.wait_for(main(), 600))
