"""The controller SIGKILLed on a real Ray cluster, mid-stream: a pause, then every stream goes on.

A second controller (its own namespace, two workers, a journal in a `redis-server` this
module starts) on the session's Ray cluster. 16 greedy streams run undisturbed once for
reference, then again while the controller process is killed with SIGKILL, three times in
the cluster's life. Ray restarts the controller, which reattaches to the workers (they
outlive it), resets them, and resumes every journaled request by recompute; the client's
subscription reconnects and resumes each stream from the last token it delivered. Every
stream finishes with exactly the reference's token ids and no error; the longest pause a
stream saw is measured and stays under 10 s; no block leaks.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator

import pytest

from benchmarks.chaos_streams import run_streams
from cluster.config import TokenflowConfig
from cluster.controller_client import RayControllerClient
from controller.messages import SamplingParams
from tests.redis_server import RedisServer

PARAMS = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
PROMPTS = [[(11 * i + 7 * j + 5) % 480 + 1 for i in range(15 + 3 * j)] for j in range(16)]
MAX_PAUSE_S = 10.0
# The longest pause per kill, for the README's "When things die" (printed with -s).
PAUSES: list[float] = []


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer().start()
    yield server
    server.kill()


@pytest.fixture(scope="module")
def controller(cluster, redis_server):
    import ray

    from controller.actor import get_or_create_controller

    config = TokenflowConfig(
        worker={"model": "builtin:tiny", "num_workers": 2},
        cache={"block_size": 8, "num_kv_blocks": 256, "enable_prefix_caching": True},
        scheduler={"max_num_batched_tokens": 64},
        cluster={"namespace": "tokenflow-recovery", "worker_num_cpus": 0.5,
                 "controller_num_cpus": 0.1, "redis_url": redis_server.url})
    assert config.cluster.controller_max_restarts == -1  # unlimited by default
    controller = get_or_create_controller(config.controller_options())
    ray.get(controller.model_info.remote(), timeout=120)
    yield controller
    ray.get(controller.shutdown.remote(), timeout=60)  # the workers are detached
    ray.kill(controller, no_restart=True)


async def _kill_controller(controller) -> None:
    pid = (await controller.stats.remote())["pid"]
    os.kill(pid, signal.SIGKILL)


async def run_scenario(controller) -> None:
    client = RayControllerClient(controller)
    reference = await run_streams(client, PROMPTS, PARAMS, "ref")
    assert all(r.finish_reason == "length" and r.error is None
               and len(r.token_ids) == PARAMS.max_tokens for r in reference)
    pids = {(await controller.stats.remote())["pid"]}
    for kill in range(3):  # the service recovers every time, not only the first
        disturbed = await run_streams(client, PROMPTS, PARAMS, f"kill{kill}",
                                      kill=lambda: _kill_controller(controller))
        for j, (got, ref) in enumerate(zip(disturbed, reference, strict=True)):
            assert got.error is None and got.finish_reason == "length", (kill, j, got.error)
            assert got.token_ids == ref.token_ids, (kill, j)
        pause = max(r.longest_wait_s for r in disturbed)
        PAUSES.append(pause)
        assert pause < MAX_PAUSE_S, f"kill {kill}: a stream paused {pause:.1f} s"
        assert client.num_reconnects == kill + 1

        stats = await controller.stats.remote()
        assert stats["pid"] not in pids  # a restarted controller served the rest
        pids.add(stats["pid"])
        # It resumed requests from the journal, and the client claimed every one of them.
        assert stats["num_resumed"] > 0
        assert stats["num_resumed_streams"] == stats["num_resumed"]
        assert stats["num_unclaimed"] == 0 and stats["num_streams"] == 0
        assert stats["journal"]["num_unfinished"] == 0 and not stats["journal"]["is_paused"]
        assert (await controller.wait_workers_up.remote(120))["ok"]
        report = await asyncio.wait_for(controller.check_integrity.remote(), 60)
        assert all(w["checked"] for w in report["workers"])
        # The workers outlived every controller: no worker restarted.
        assert all(w["num_failures"] == 0 for w in stats["workers"])
    print(f"controller SIGKILL, longest stream pause per kill: "
          f"{', '.join(f'{p:.2f} s' for p in PAUSES)}")


def test_controller_sigkill_mid_stream_is_a_pause_not_an_error(controller) -> None:
    asyncio.run(asyncio.wait_for(run_scenario(controller), 600))


# A constrained variant: the grammar travels in the journal's params; the workers' matchers
# are rebuilt from the resumed requests' tokens.
CONSTRAINED = SamplingParams(
    max_tokens=32, temperature=0.0, grammar_kind="json_schema",
    grammar_spec='{"properties":{"a":{"maxLength":40,"type":"string"},"b":{"type":"integer"}},'
                 '"required":["a","b"],"type":"object"}')


def test_constrained_requests_survive_a_controller_kill(controller) -> None:
    async def scenario() -> None:
        client = RayControllerClient(controller)
        reference = await run_streams(client, PROMPTS[:8], CONSTRAINED, "cref")
        assert all(r.error is None for r in reference)
        assert all(r.token_ids[:2] == [3 + ord("{"), 3 + ord('"')] for r in reference)
        disturbed = await run_streams(client, PROMPTS[:8], CONSTRAINED, "ckill",
                                      kill=lambda: _kill_controller(controller))
        for j, (got, ref) in enumerate(zip(disturbed, reference, strict=True)):
            assert got.error is None and got.finish_reason == ref.finish_reason, (j, got.error)
            assert got.token_ids == ref.token_ids, j
        assert client.num_reconnects == 1
        assert (await controller.wait_workers_up.remote(120))["ok"]

    asyncio.run(asyncio.wait_for(scenario(), 600))


# Log-probabilities across a resume: journaled tokens' come from the journal (exact), those
# recomputed or generated after the restart from a prefill of the prompt and the journaled
# tokens (the same model, another kernel order: equal within float noise).
WITH_LOGPROBS = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, logprobs=3)
LOGPROB_TOLERANCE = 1e-4


class LateClient(RayControllerClient):
    """Resumes its streams only once the restarted controller has run every resumed request
    to its end: their tokens (the journaled ones and all recomputed after them) wait
    unclaimed, and come back in one output with their log-probabilities."""

    async def _resume(self, subscriber: str, request_ids: list[str]) -> None:
        deadline = asyncio.get_running_loop().time() + 120
        while True:  # a condition on the restarted controller, polled
            stats = await self.handle.stats.remote()
            if stats["num_unclaimed"] and \
                    stats["num_unclaimed_finished"] == stats["num_unclaimed"]:
                break
            assert asyncio.get_running_loop().time() < deadline, stats
            await asyncio.sleep(0.05)
        await super()._resume(subscriber, request_ids)


def test_logprobs_survive_a_controller_kill(controller) -> None:
    async def scenario() -> None:
        client = LateClient(controller)
        reference = await run_streams(client, PROMPTS[:8], WITH_LOGPROBS, "lref")
        disturbed = await run_streams(client, PROMPTS[:8], WITH_LOGPROBS, "lkill",
                                      kill=lambda: _kill_controller(controller))
        for j, (got, ref) in enumerate(zip(disturbed, reference, strict=True)):
            assert got.error is None and got.finish_reason == "length", (j, got.error)
            assert got.token_ids == ref.token_ids, j
            assert got.logprobs is not None and ref.logprobs is not None
            assert len(got.logprobs) == len(ref.logprobs) == WITH_LOGPROBS.max_tokens, j
            for pos, (a, b) in enumerate(zip(got.logprobs, ref.logprobs, strict=True)):
                assert a.token_id == b.token_id and a.top_ids == b.top_ids, (j, pos)
                assert abs(a.logprob - b.logprob) < LOGPROB_TOLERANCE, (j, pos)
                assert all(abs(x - y) < LOGPROB_TOLERANCE
                           for x, y in zip(a.top_logprobs, b.top_logprobs, strict=True))
        assert client.num_reconnects == 1
        stats = await controller.stats.remote()
        assert stats["num_resumed"] > 0 and stats["num_unclaimed"] == 0
        assert (await controller.wait_workers_up.remote(120))["ok"]

    asyncio.run(asyncio.wait_for(scenario(), 600))
