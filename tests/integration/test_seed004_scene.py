"""The long-prompt scene (docs/architecture.md) on local Ray: users stream, a long prompt lands.

A second controller (its own namespace, one worker, budget 64) on the session's Ray
cluster, driven through the edge's `RayControllerClient` (`submit` + `subscribe`).
Afterwards the controller's plan log says who advanced in which step: no decoder may miss a
step between its tokens while the long prompt is prefilled in chunks, and no step may exceed
the budget.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from cluster.config import TokenflowConfig
from cluster.controller_client import RayControllerClient
from controller.messages import SamplingParams

BUDGET = 64
NUM_USERS = 16
LONG_PROMPT_LEN = 1200


@pytest.fixture(scope="module")
def scene_controller(cluster):
    import ray

    from controller.actor import get_or_create_controller

    config = TokenflowConfig(
        worker={"model": "builtin:tiny", "num_workers": 1},
        cache={"block_size": 16, "num_kv_blocks": 512, "enable_prefix_caching": False},
        scheduler={"max_num_batched_tokens": BUDGET, "max_num_seqs": 64},
        cluster={"namespace": "tokenflow-seed004", "worker_num_cpus": 0.5,
                 "controller_num_cpus": 0.1})
    controller = get_or_create_controller(config.controller_options())
    ray.get(controller.model_info.remote(), timeout=120)
    yield controller
    ray.kill(controller)


async def run_scene(controller) -> dict[str, list[int]]:
    rng = random.Random(4)
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    client = RayControllerClient(controller)
    tokens: dict[str, list[int]] = {}
    num_started = 0
    all_started = asyncio.Event()  # every user has 4 tokens

    async def consume(request_id: str, prompt: list[int], signal: bool) -> None:
        nonlocal num_started
        _, deltas = await client.submit(prompt, params, request_id, 0, "default")
        got = tokens.setdefault(request_id, [])
        async for delta in deltas:
            assert delta.error is None, delta.error
            before = len(got)
            got.extend(delta.token_ids)
            if signal and before < 4 <= len(got):
                num_started += 1
                if num_started == NUM_USERS:
                    all_started.set()

    users = [asyncio.create_task(consume(
        f"user{i}", [rng.randrange(3, 500) for _ in range(32)], True))
        for i in range(NUM_USERS)]
    # Every user is decoding before the long prompt lands (a failed user fails the wait).
    waiter = asyncio.create_task(all_started.wait())
    await asyncio.wait([waiter, *users], return_when=asyncio.FIRST_COMPLETED)
    assert all_started.is_set(), [u.exception() for u in users if u.done()]
    long_prompt = [rng.randrange(3, 500) for _ in range(LONG_PROMPT_LEN)]
    await asyncio.gather(*users, consume("long", long_prompt, False))
    return tokens


def test_no_decoder_stalls_while_a_long_prompt_is_chunked(scene_controller):
    import ray

    tokens = asyncio.run(asyncio.wait_for(run_scene(scene_controller), 300))
    assert all(len(tokens[f"user{i}"]) == 48 for i in range(NUM_USERS))
    assert len(tokens["long"]) == 48

    plans = ray.get(scene_controller.step_plans.remote(0), timeout=30)
    assert all(sum(p.values()) <= BUDGET for _, p in plans)
    long_steps = [i for i, (_, p) in enumerate(plans) if p.get("long", 0) > 1]
    assert len(long_steps) >= LONG_PROMPT_LEN // BUDGET  # chunked, not one step
    first, last = long_steps[0], long_steps[-1]
    for i in range(NUM_USERS):
        rid = f"user{i}"
        steps = [j for j, (_, p) in enumerate(plans) if rid in p]
        # between its first and last token, the user is in every step: never waits
        assert steps == list(range(steps[0], steps[-1] + 1)), rid
        if steps[-1] >= first:  # it was decoding while the long prompt was prefilled
            assert all(plans[j][1][rid] == 1 for j in steps if first <= j <= last)
    ray.get(scene_controller.check_integrity.remote(), timeout=60)
