"""Workers SIGKILLed on a real Ray cluster, mid-stream: nothing lost, nothing wrong.

A second controller (its own namespace, two workers, prefix caching on) on the session's
Ray cluster. 16 greedy streams run undisturbed once for reference, then again while a
worker is killed with SIGKILL, three times in the controller's life: every stream finishes
with a finish reason and exactly the reference's token ids (the dead worker's requests are
recomputed on the other one and continue without a gap or a duplicate). Afterwards a
request whose prefix was cached before a crash returns the very same tokens: a restarted
worker's KV is zeros, and a pool that kept its prefix hashes would serve them. Run with
each worker transport: with a compiled graph, the dead worker's graph is torn down and a
new one is built for the restarted worker.
"""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from benchmarks.chaos_streams import run_streams, stream
from cluster.config import TokenflowConfig
from cluster.controller_client import RayControllerClient
from controller.messages import SamplingParams

PARAMS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
PROMPTS = [[(7 * i + 13 * j + 3) % 500 + 1 for i in range(17 + 3 * j)] for j in range(16)]
CACHED_PROMPT = [(5 * i + 1) % 400 + 1 for i in range(41)]  # 5 full blocks of 8


@pytest.fixture(scope="module", params=["actor_call", "compiled_graph"])
def controller(cluster, request):
    import ray

    from controller.actor import get_or_create_controller

    config = TokenflowConfig(
        worker={"model": "builtin:tiny", "num_workers": 2},
        cache={"block_size": 8, "num_kv_blocks": 256, "enable_prefix_caching": True},
        scheduler={"max_num_batched_tokens": 64},
        cluster={"namespace": f"tokenflow-restart-{request.param}", "worker_num_cpus": 0.5,
                 "controller_num_cpus": 0.1, "worker_max_restarts": -1,
                 "worker_transport": request.param})
    controller = get_or_create_controller(config.controller_options())
    ray.get(controller.model_info.remote(), timeout=120)
    yield controller
    ray.get(controller.shutdown.remote(), timeout=60)  # the workers are detached
    ray.kill(controller)


async def _stream(client: RayControllerClient, prompt: list[int], request_id: str
                  ) -> tuple[list[int], str | None, str | None]:
    result = await stream(client, prompt, PARAMS, request_id)
    return result.token_ids, result.finish_reason, result.error


async def _kill_worker(controller, worker: int) -> None:
    pid = (await controller.stats.remote())["workers"][worker]["pid"]
    os.kill(pid, signal.SIGKILL)


async def run_scenario(controller) -> None:
    client = RayControllerClient(controller)
    transports = [w["transport"] for w in (await controller.stats.remote())["workers"]]
    reference = await run_streams(client, PROMPTS, PARAMS, "ref")
    assert all(r.finish_reason == "length" and r.error is None
               and len(r.token_ids) == PARAMS.max_tokens for r in reference)
    cached_before, _, _ = await _stream(client, CACHED_PROMPT, "cached-0")
    assert (await _stream(client, CACHED_PROMPT, "cached-1"))[0] == cached_before  # a hit

    pids = set()
    for kill in range(3):  # the service recovers every time, not only the first
        worker = kill % 2
        before = (await controller.stats.remote())["workers"][worker]
        pids.add(before["pid"])
        disturbed = await run_streams(client, PROMPTS, PARAMS, f"kill{kill}",
                                      kill=lambda w=worker: _kill_worker(controller, w))
        for j, (got, ref) in enumerate(zip(disturbed, reference, strict=True)):
            assert got.error is None and got.finish_reason == "length", (kill, j, got.error)
            assert got.token_ids == ref.token_ids, (kill, j)
        # A request after the crash whose prefix was cached before it: same tokens.
        again, _, error = await _stream(client, CACHED_PROMPT, f"cached-after-{kill}")
        assert error is None and again == cached_before
        assert (await controller.wait_workers_up.remote(120))["ok"]
        stats = await controller.stats.remote()
        assert stats["workers"][worker]["num_failures"] == before["num_failures"] + 1
        assert stats["workers"][worker]["pid"] not in pids
        # Back on the transport it started with (a new graph for the new process).
        assert stats["workers"][worker]["transport"] == transports[worker]

    health = await controller.ping.remote()
    assert health["ok"] and health["num_workers_up"] == 2
    report = await asyncio.wait_for(controller.check_integrity.remote(), 60)
    assert all(w["checked"] for w in report["workers"])


def test_worker_sigkill_mid_stream_loses_nothing_and_changes_nothing(controller):
    import ray

    workers = ray.get(controller.stats.remote(), timeout=30)["workers"]
    assert all(w["transport_fallback"] is None for w in workers), workers  # as configured
    asyncio.run(asyncio.wait_for(run_scenario(controller), 900))


# A constrained variant: the worker's matchers are rebuilt from the tokens on the new worker.
CONSTRAINED = SamplingParams(
    max_tokens=24, temperature=0.0, grammar_kind="json_schema",
    grammar_spec='{"properties":{"a":{"maxLength":30,"type":"string"},"b":{"type":"integer"}},'
                 '"required":["a","b"],"type":"object"}')


def test_constrained_requests_survive_a_worker_kill(controller) -> None:
    async def scenario() -> None:
        client = RayControllerClient(controller)
        plain = await run_streams(client, PROMPTS[:8], PARAMS, "cplain")
        reference = await run_streams(client, PROMPTS[:8], CONSTRAINED, "cref")
        assert all(r.error is None for r in reference)
        # The grammar acts: every output starts an object (the unconstrained ones do not).
        assert all(r.token_ids[:2] == [3 + ord("{"), 3 + ord('"')] for r in reference)
        assert any(p.token_ids[:2] != r.token_ids[:2] for p, r in zip(plain, reference,
                                                                     strict=True))
        disturbed = await run_streams(client, PROMPTS[:8], CONSTRAINED, "ckill",
                                      kill=lambda: _kill_worker(controller, 0))
        for j, (got, ref) in enumerate(zip(disturbed, reference, strict=True)):
            assert got.error is None and got.finish_reason == ref.finish_reason, (j, got.error)
            assert got.token_ids == ref.token_ids, j
        assert (await controller.wait_workers_up.remote(120))["ok"]

    asyncio.run(asyncio.wait_for(scenario(), 600))


def test_a_worker_ray_restarts_is_not_killed_again() -> None:
    """Ray's own errors for a dead or restarting process spare the worker the controller's
    kill (it could land on the new incarnation and fail the worker twice, as this module's
    scenario did in 2 of 3 runs); a hang or an error the worker raised still gets it."""
    import ray.exceptions

    from controller.worker_loop import WorkerCallError, WorkerHungError, is_process_gone

    def wrapped(cause: BaseException | None) -> WorkerCallError:
        err = WorkerCallError("step 7")
        err.__cause__ = cause
        return err

    assert is_process_gone(wrapped(ray.exceptions.ActorUnavailableError("restarting", None)))
    assert is_process_gone(wrapped(ray.exceptions.ActorDiedError()))
    assert not is_process_gone(wrapped(ray.exceptions.RayTaskError("execute", "tb", ValueError())))
    assert not is_process_gone(wrapped(ValueError("raised by the worker")))
    assert not is_process_gone(WorkerHungError("step 7 took over 30.0s"))
