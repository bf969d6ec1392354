"""Async scheduling (`scheduler.async_scheduling`): a worker's next step is planned and
sent while its current one runs, without Ray.

`OrderedWorkerHandle` stands for a Ray worker actor: each `execute.remote(plan)` starts at
once and runs after the calls sent before it (one at a time, in order), on a `FakeRunner`
that checks every plan diff against its own per-request state (a `num_computed_tokens` the
worker did not reach, a diff for a request it never got, a block table too small). Tokens
are a function of the tokens so far, as greedy and seeded sampling are, so the same
requests must give the same tokens whatever the planning. Shows: with async scheduling
steps overlap (two calls outstanding), every request gets exactly the tokens of the
synchronous run, including requests that end early on a stop token (unpredictable when the
next step is planned) and under KV pressure, and no block is leaked.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from cluster.controller_client import RayControllerClient, run_request
from controller.actor import ControllerActor
from controller.messages import (
    FinishReason,
    SamplingParams,
    StepPlan,
    StepResult,
    decode_plan,
    encode_message,
)
from controller.options import ControllerOptions, WorkerConfig
from controller.scheduler import SchedulerConfig
from controller.step_cost import LinearFit, StepCost
from tests.unit.fake_runner import FakeRunner
from tests.unit.test_controller_actor import VOCAB, FakeWorkerHandle, LocalHandle


def next_token(token_ids: list[int]) -> int:
    return (31 * sum(token_ids) + 7 * len(token_ids)) % VOCAB


class OrderedWorkerHandle(FakeWorkerHandle):
    """`FakeWorkerHandle` whose calls start when sent and run one at a time, in order."""

    def __init__(self) -> None:
        super().__init__(FakeRunner(vocab_size=VOCAB, block_size=4, sample=next_token,
                                    check_kv=True))
        self._last: asyncio.Task[StepResult] | None = None
        self.num_outstanding = self.max_outstanding = 0

    def _execute(self, sent: StepPlan | bytes,  # type: ignore[override]
                 incarnation: str | None = None, sender: str | None = None,
                 seq: int | None = None) -> asyncio.Task[StepResult | bytes]:
        self.check_seq(sender, seq)  # numbered in the order sent
        plan = decode_plan(sent)
        previous = self._last
        self.num_outstanding += 1
        self.max_outstanding = max(self.max_outstanding, self.num_outstanding)

        async def run() -> StepResult | bytes:
            if previous is not None:
                await asyncio.wait({previous})  # one at a time, in the order sent
            await asyncio.sleep(0)  # the device's time: the controller runs meanwhile
            await asyncio.sleep(0)
            self.num_outstanding -= 1
            result = self.runner.execute(plan)
            return encode_message(result) if isinstance(sent, bytes) else result

        self._last = asyncio.ensure_future(run())
        return self._last


def workload() -> list[tuple[str, list[int], SamplingParams]]:
    """Prompts of 3-19 tokens, 4-12 outputs, every other one stopping early at the token
    it would sample third: over the pool of 32 blocks of 4 tokens (make_info) with 8
    running at once."""
    out = []
    for i in range(12):
        prompt = [(7 * i + j) % 90 + 1 for j in range(3 + (5 * i) % 17)]
        ids = list(prompt)
        for _ in range(3):
            ids.append(next_token(ids))
        params = SamplingParams(max_tokens=4 + (3 * i) % 9, temperature=0.0, ignore_eos=True,
                                stop_token_ids=(ids[-1],) if i % 2 else ())
        out.append((f"r{i}", prompt, params))
    return out


Outputs = dict[str, tuple[list[int], FinishReason | None]]


def run_all(is_async: bool | None, decode_steps: int | None = None,
            chunk_steps: int = 1,
            requests: list[tuple[str, list[int], SamplingParams]] | None = None,
            step_cost: StepCost | None = None
            ) -> tuple[Outputs, OrderedWorkerHandle, dict[str, Any]]:
    handle = OrderedWorkerHandle()
    options = ControllerOptions(
        worker=WorkerConfig(num_workers=1),
        scheduler=SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=8,
                                  max_chunk_tokens=8, async_scheduling=is_async,
                                  decode_steps=decode_steps, chunk_steps=chunk_steps),
        step_cost=step_cost, itl_slo_s=None if step_cost is None else 1e6)

    async def main() -> tuple[dict[str, tuple[list[int], FinishReason | None]],
                              dict[str, Any]]:
        actor = ControllerActor(options, worker_factory=lambda opts: [handle],
                                kill_worker=lambda h: None)
        client = RayControllerClient(LocalHandle(actor))
        results = await asyncio.gather(*(run_request(client, prompt, params, rid)
                                         for rid, prompt, params in requests or workload()))
        report = await actor.check_integrity()
        assert all(w["checked"] for w in report["workers"]), report
        assert actor.core is not None
        actor.core.check_integrity()
        return ({ack.request_id: (done.token_ids, done.finish_reason)
                 for ack, done in results}, await actor.stats())

    got, stats = asyncio.run(asyncio.wait_for(main(), 30))
    return got, handle, stats


def test_async_scheduling_overlaps_steps_and_changes_no_token() -> None:
    sync, sync_handle, _ = run_all(False)
    assert sync_handle.max_outstanding == 1
    assert any(reason == FinishReason.STOP for _, reason in sync.values()), \
        "the workload must have requests that end early on the stop token"
    overlapped, handle, stats = run_all(True)
    assert handle.max_outstanding == 2  # planned and sent while the previous step ran
    assert overlapped == sync
    for rid, prompt, params in workload():
        expected = list(prompt)
        for _ in range(params.max_tokens):
            expected.append(next_token(expected))
            if expected[-1] in params.stop_token_ids:
                break
        assert overlapped[rid][0] == expected[len(prompt):], rid
    assert stats["num_unfinished"] == 0


def test_by_default_a_worker_actor_is_planned_ahead_and_an_in_process_worker_is_not() -> None:
    # The actor's round trip is what planning ahead hides; in process there is none, and on
    # a CPU the planning would take the model's cores (SchedulerConfig.is_async).
    default = SchedulerConfig()
    assert default.async_scheduling is None
    assert default.is_async(is_actor=True) and not default.is_async(is_actor=False)
    assert not SchedulerConfig(async_scheduling=False).is_async(is_actor=True)
    assert SchedulerConfig(async_scheduling=True).is_async(is_actor=False)
    got, handle, _ = run_all(None)
    assert handle.max_outstanding == 2  # the Ray step loop sent a step ahead
    assert got == run_all(False)[0]


class GatedWorkerHandle(OrderedWorkerHandle):
    """`OrderedWorkerHandle` whose steps, once the first has started, wait for `release`;
    it records the request ids of every plan, in the order sent."""

    def __init__(self) -> None:
        super().__init__()
        self.started = asyncio.Event()
        self.release = asyncio.Event()
        self.plan_ids: list[set[str]] = []

    def _execute(self, sent: StepPlan | bytes,  # type: ignore[override]
                 incarnation: str | None = None, sender: str | None = None,
                 seq: int | None = None) -> asyncio.Task[StepResult | bytes]:
        self.plan_ids.append(set(decode_plan(sent).num_scheduled_tokens))
        inner = super()._execute(sent, incarnation, sender, seq)

        async def gated() -> StepResult | bytes:
            self.started.set()
            await self.release.wait()
            return await inner

        return asyncio.ensure_future(gated())


def first_step_of_late_arrival(plan_ahead_at: float, predicted_s: float) -> int:
    """Request a prefills in step 0, which the worker holds until b has arrived; the index
    of the first step that carries b."""
    handle = GatedWorkerHandle()
    fit = LinearFit(predicted_s, 0.0, 0.0)
    options = ControllerOptions(
        worker=WorkerConfig(num_workers=1),
        scheduler=SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=8,
                                  async_scheduling=True, plan_ahead_at=plan_ahead_at),
        step_cost=StepCost(fit, fit), itl_slo_s=1e6)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

    async def main() -> int:
        actor = ControllerActor(options, worker_factory=lambda opts: [handle],
                                kill_worker=lambda h: None)
        client = RayControllerClient(LocalHandle(actor))
        first = asyncio.ensure_future(run_request(client, [1, 2, 3, 4], params, "a"))
        await handle.started.wait()  # step 0 runs
        _, deltas = await client.submit([5, 6, 7], params, "b", 0, "default")
        handle.release.set()
        tokens = [t for delta in [d async for d in deltas] for t in delta.token_ids]
        assert len(tokens) == 4 and len((await first)[1].token_ids) == 4
        return next(i for i, ids in enumerate(handle.plan_ids) if "b" in ids)

    return asyncio.run(asyncio.wait_for(main(), 30))


def test_the_next_step_is_planned_late_so_that_a_new_request_rides_in_it() -> None:
    # Planned at once (vLLM's way), step 1 was sent before b arrived: b waits for step 2.
    assert first_step_of_late_arrival(plan_ahead_at=0.0, predicted_s=100.0) == 2
    assert first_step_of_late_arrival(plan_ahead_at=0.7, predicted_s=1e-9) == 2
    # Planned once step 0 is 70 % done by its predicted 100 s: it ended first, and step 1
    # was planned knowing of b.
    assert first_step_of_late_arrival(plan_ahead_at=0.7, predicted_s=100.0) == 1


def test_a_long_step_is_planned_a_lead_before_its_end_a_short_one_by_the_share() -> None:
    config = SchedulerConfig(plan_ahead_at=0.7, plan_ahead_lead_ms=10.0)
    assert config.plan_ahead_s(0.030) == pytest.approx(0.021)  # 9 ms before a decode step ends
    # A 250 ms chunk step: 10 ms before its end, not 75 (a request arriving 200 ms in
    # still rides in the next step).
    assert config.plan_ahead_s(0.250) == pytest.approx(0.240)
    assert SchedulerConfig(plan_ahead_at=0.7, plan_ahead_lead_ms=None).plan_ahead_s(
        0.250) == pytest.approx(0.175)
    assert SchedulerConfig(plan_ahead_at=0.0).plan_ahead_s(0.250) == 0.0  # at once


def expected_tokens(prompt: list[int], params: SamplingParams) -> list[int]:
    ids = list(prompt)
    for _ in range(params.max_tokens):
        ids.append(next_token(ids))
        if ids[-1] in params.stop_token_ids:
            break
    return ids[len(prompt):]


def churn(seed: int, plan_ahead_at: float) -> dict[str, Any]:
    """Requests that share prefixes (prefix hits), over a pool too small for them all (hit
    blocks evicted and reused, defragmentation), a third of them aborted at a random
    token, some stopping early; the worker checks every KV slot it attends over
    (`FakeRunner(check_kv=True)`). Returns the controller's stats."""
    import random

    rng = random.Random(seed)
    handle = OrderedWorkerHandle()
    fit = LinearFit(1e-4, 0.0, 0.0)  # about the fake's own step time: late and at once
    options = ControllerOptions(
        worker=WorkerConfig(num_workers=1),
        scheduler=SchedulerConfig(max_num_batched_tokens=24, max_num_seqs=6,
                                  max_chunk_tokens=8, async_scheduling=True,
                                  plan_ahead_at=plan_ahead_at, defrag_threshold=0.1,
                                  defrag_every_steps=1),
        step_cost=StepCost(fit, fit), itl_slo_s=1e6)
    stems = [[rng.randrange(1, 90) for _ in range(rng.randrange(4, 14))] for _ in range(4)]
    requests = []
    for i in range(40):
        prompt = rng.choice(stems) + [rng.randrange(1, 90) for _ in range(rng.randrange(1, 6))]
        stop = (next_token(prompt),) if i % 5 == 0 else ()  # ends at its first token
        params = SamplingParams(max_tokens=rng.randrange(1, 10), temperature=0.0,
                                ignore_eos=True, stop_token_ids=stop)
        abort_at = rng.randrange(0, 4) if i % 3 == 0 else None
        requests.append((f"c{i}", prompt, params, abort_at))

    async def one(client: RayControllerClient, rid: str, prompt: list[int],
                  params: SamplingParams, abort_at: int | None) -> None:
        _, deltas = await client.submit(prompt, params, rid, 0, "default")
        tokens: list[int] = []
        if abort_at == 0:
            client.abort(rid)
        async for delta in deltas:
            tokens.extend(delta.token_ids)
            if abort_at is not None and len(tokens) >= abort_at:
                client.abort(rid)
        want = expected_tokens(prompt, params)
        assert tokens == want[:len(tokens)], rid  # an aborted one ends early, never wrong
        if abort_at is None:
            assert tokens == want, rid

    async def main() -> dict[str, Any]:
        actor = ControllerActor(options, worker_factory=lambda opts: [handle],
                                kill_worker=lambda h: None)
        client = RayControllerClient(LocalHandle(actor))
        tasks = []
        for rid, prompt, params, abort_at in requests:
            tasks.append(asyncio.ensure_future(one(client, rid, prompt, params, abort_at)))
            for _ in range(rng.randrange(0, 6)):  # arrivals spread over the steps
                await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        report = await actor.check_integrity()
        assert all(w["checked"] for w in report["workers"]), report
        stats = await actor.stats()
        await actor.shutdown()
        return stats

    stats = asyncio.run(asyncio.wait_for(main(), 60))
    assert handle.max_outstanding == 2 and handle.runner.num_kv_checked > 0
    return stats


@pytest.mark.parametrize("plan_ahead_at", [0.0, 0.7])
def test_planned_ahead_steps_never_read_kv_that_is_not_their_own(plan_ahead_at: float) -> None:
    hits = defrags = 0
    for seed in range(6):
        worker = churn(seed, plan_ahead_at)["workers"][0]
        hits += worker["num_prefix_hit_tokens"]
        defrags += worker["num_defrag_moves"]
    assert hits > 0 and defrags > 0  # the paths under test were taken
