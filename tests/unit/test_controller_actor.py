"""The controller actor's logic without Ray: per-worker step loops over fake worker handles.

A fake handle's `execute.remote(plan)` returns a coroutine, which is what awaiting a Ray
ObjectRef amounts to inside the actor. The edge's own `RayControllerClient` talks to the actor
through `LocalHandle`, which runs its methods in this event loop the way Ray would run them
remotely. Shows: a slow worker does not stall the other one, deltas carry every token, abort
and a dropped subscriber free blocks, a failing worker fails only its own requests, an
exception in the controller's own part of a step fails that step's requests but never the
worker, and the loops park (no polling) when idle.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from cluster.controller_client import RayControllerClient, run_request
from controller.actor import ControllerActor
from controller.messages import (
    Ack,
    Delta,
    FinishReason,
    RequestOutput,
    SamplingParams,
    StepPlan,
    StepResult,
    decode_plan,
    encode_message,
)
from controller.options import ControllerOptions, WorkerConfig
from controller.routing import NoWorkerUpError
from controller.scheduler import SchedulerConfig
from controller.worker_loop import RecoveryConfig
from tests.unit.fake_runner import FakeRunner
from workers.actor import WorkerInfo, WorkerRestartedError

VOCAB = 100
PARAMS = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)


class _Method:
    def __init__(self, fn: Callable[..., Awaitable[Any]]) -> None:
        self._fn = fn

    def remote(self, *args: Any) -> Awaitable[Any]:
        return self._fn(*args)


class FakeWorkerHandle:
    def __init__(self, runner: FakeRunner) -> None:
        self.runner = runner
        self.gate = asyncio.Event()
        self.gate.set()
        self.entered = asyncio.Event()  # set once a step is in flight
        self.fail_next = False
        self.num_steps = 0
        self.incarnation = "fake-0"
        self.num_refused = 0  # plans addressed to an earlier incarnation
        self.num_restarts = 0
        self.hung = False  # the next step never returns (until a kill)
        # A step cancelled by the caller answers all the same: what a caller sees when the
        # answer is already on its way as it gives up.
        self.answers_cancel = False
        self.seen_computed: list[int] = []  # num_computed_tokens of every new request
        self.sender_to_next_seq: dict[str | None, int] = {}  # the step gate's numbering
        self.last_sender: str | None = None
        self.retired_senders: set[str] = set()  # a reset retires the last one, as the gate
        self.execute = _Method(self._execute)
        self.held_block_ids = _Method(self._held)
        self.info = _Method(self._info)
        self.reset = _Method(self._reset)

    def restart(self) -> None:
        """What a SIGKILL plus Ray's restart does: a new process with no KV and no state."""
        self.incarnation = f"fake-{int(self.incarnation.split('-')[1]) + 1}"
        self.runner.requests.clear()
        if self.runner.kv is not None:
            self.runner.kv.clear()
        self.num_restarts += 1

    def kill(self) -> None:
        """The controller's kill: Ray restarts the actor; a hung call never returns."""
        self.restart()
        self.hung = False
        self.gate.set()

    async def _info(self) -> WorkerInfo:
        return make_info(self.incarnation)

    def check_seq(self, sender: str | None, seq: int | None) -> None:
        """Steps are numbered by their sender 0, 1, 2, ... in the order sent, which is the
        order the real worker's gate runs them in."""
        if seq is None:
            return
        if sender in self.retired_senders:  # the real gate refuses it: a worker failure
            raise RuntimeError(f"step {seq} of {sender}, a sender retired by a reset")
        self.last_sender = sender
        expected = self.sender_to_next_seq.get(sender, 0)
        if seq != expected:
            raise AssertionError(f"step numbered {seq} by {sender}, expected {expected}")
        self.sender_to_next_seq[sender] = seq + 1

    async def _execute(self, sent: StepPlan | bytes, incarnation: str | None = None,
                       sender: str | None = None, seq: int | None = None
                       ) -> StepResult | bytes:
        result = await self._run(decode_plan(sent), incarnation, sender, seq)
        return encode_message(result) if isinstance(sent, bytes) else result

    async def _run(self, plan: StepPlan, incarnation: str | None, sender: str | None,
                   seq: int | None) -> StepResult:
        self.check_seq(sender, seq)
        if incarnation is not None and incarnation != self.incarnation:
            self.num_refused += 1
            raise WorkerRestartedError(f"{incarnation} is gone")
        self.seen_computed.extend(new.num_computed_tokens for new in plan.new_requests)
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("boom")
        result = self.runner.execute(plan)  # the runner keeps its own per-request state
        self.entered.set()
        if self.hung:
            await asyncio.Event().wait()  # cancelled by the controller's deadline
        try:
            await asyncio.sleep(0)  # a real actor call always suspends the loop
            await self.gate.wait()
        except asyncio.CancelledError:
            if not self.answers_cancel:
                raise
        self.num_steps += 1
        return result

    async def _reset(self) -> int:
        num_requests = len(self.runner.requests)
        self.runner.requests.clear()
        if self.last_sender is not None:
            self.retired_senders.add(self.last_sender)
        return num_requests

    async def _held(self) -> set[int]:
        return {b for blocks in self.runner.held.values() for b in blocks}


def make_info(incarnation: str) -> WorkerInfo:
    # A device that is no CPU: one step a plan, as these tests count them, unless
    # scheduler.decode_steps asks for bursts (tests/unit/test_decode_burst.py).
    return WorkerInfo(32, 4, VOCAB, (), 1024, "/nowhere", "fake", 0, 1, incarnation)


def make_actor(num_workers: int = 2, deadline_s: float = 5.0
               ) -> tuple[ControllerActor, list[FakeWorkerHandle]]:
    """A controller whose injected factory starts fake workers (32 blocks of 4 tokens)."""
    handles = [FakeWorkerHandle(FakeRunner(vocab_size=VOCAB, block_size=4))
               for _ in range(num_workers)]

    def start_workers(opts: ControllerOptions) -> list[FakeWorkerHandle]:
        assert opts.worker.num_workers == num_workers
        return handles

    options = ControllerOptions(
        worker=WorkerConfig(num_workers=num_workers),
        scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8),
        recovery=RecoveryConfig(step_deadline_min_s=deadline_s, restart_backoff_s=0.001))
    actor = ControllerActor(options, worker_factory=start_workers,
                            kill_worker=FakeWorkerHandle.kill)
    return actor, handles


class _LocalMethod:
    """`handle.method.remote(...)` of an actor living in this event loop: a task, as a Ray
    call is a task on the actor; an async generator method streams already-resolved refs."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self._fn = fn

    def options(self, **_: Any) -> _LocalMethod:
        return self

    def remote(self, *args: Any) -> Any:
        if inspect.isasyncgenfunction(self._fn):
            return self._refs(self._fn(*args))
        return asyncio.ensure_future(self._fn(*args))

    @staticmethod
    async def _refs(items: AsyncIterator[Any]) -> AsyncIterator[Awaitable[Any]]:
        async for item in items:
            ref = asyncio.get_running_loop().create_future()
            ref.set_result(item)
            yield ref


class LocalHandle:
    def __init__(self, actor: ControllerActor) -> None:
        self._actor = actor

    def __getattr__(self, name: str) -> _LocalMethod:
        return _LocalMethod(getattr(self._actor, name))


async def collect(client: RayControllerClient, prompt: list[int], request_id: str,
                  params: SamplingParams = PARAMS) -> tuple[Ack, Delta]:
    return await run_request(client, prompt, params, request_id)


def run(coro: Awaitable[Any]) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 10))


def test_deltas_carry_every_token_and_pools_end_free() -> None:
    async def main() -> None:
        actor, _ = make_actor()
        client = RayControllerClient(LocalHandle(actor))
        results = await asyncio.gather(*(collect(client, [1 + i, 2, 3], f"r{i}")
                                         for i in range(6)))
        for i, (ack, done) in enumerate(results):
            assert ack == Ack(f"r{i}", done.worker, 3)
            assert len(done.token_ids) == PARAMS.max_tokens == done.num_output_tokens
            assert done.finish_reason == FinishReason.LENGTH and done.error is None
        stats = await actor.stats()
        assert [w["num_routed"] for w in stats["workers"]] == [3, 3]
        assert stats["num_streams"] == 0 and client._queues == {}
        report = await actor.check_integrity()
        assert all(w["checked"] for w in report["workers"])
        assert all(w["parked"] for w in (await actor.stats())["workers"])

    run(main())


def test_slow_worker_does_not_stall_the_other() -> None:
    async def main() -> None:
        actor, handles = make_actor()
        client = RayControllerClient(LocalHandle(actor))
        handles[0].gate.clear()  # worker 0 hangs inside its step
        first = asyncio.create_task(collect(client, [1, 2, 3], "slow"))
        await handles[0].entered.wait()
        ack, fast = await collect(client, [4, 5, 6], "fast")  # routed to the idle worker 1
        assert ack.worker == fast.worker == 1 and fast.finish_reason == FinishReason.LENGTH
        assert not first.done() and handles[0].num_steps == 0
        handles[0].gate.set()
        assert (await first)[1].finish_reason == FinishReason.LENGTH

    run(main())


def test_abort_and_dropped_subscriber_free_blocks() -> None:
    async def main() -> None:
        actor, handles = make_actor(1)
        client = RayControllerClient(LocalHandle(actor))
        handles[0].gate.clear()
        long = SamplingParams(max_tokens=50, ignore_eos=True)
        ack, deltas = await client.submit([1, 2, 3], long, "a", 0, "t")
        assert ack.worker == 0
        await handles[0].entered.wait()
        assert await actor.abort("a")  # while its first step runs on the worker
        handles[0].gate.set()
        delta = await anext(deltas)
        assert delta.finish_reason == FinishReason.ABORT and delta.token_ids == []
        assert not await actor.abort("a")  # already finished
        # A second edge process whose subscription breaks mid-request (it went away).
        other = RayControllerClient(LocalHandle(actor))
        _, dropped = await other.submit([7, 8, 9], long, "b", 0, "t")
        assert (await anext(dropped)).finish_reason is None
        assert other._pump_task is not None
        other._pump_task.cancel()
        last = await anext(dropped)  # the client fails its open requests
        assert last.finish_reason == FinishReason.ABORT and "stream ended" in last.error
        assert (await actor.check_integrity())["workers"][0]["checked"]
        stats = await actor.stats()
        assert stats["num_aborted"] == 2 and stats["num_unfinished"] == 0
        assert stats["num_subscribers"] == 1  # the first client's subscription stays
        assert stats["workers"][0]["num_cache_evict"] == 2  # consumed before parking

    run(main())


def test_failing_worker_moves_its_requests_to_the_other_one() -> None:
    async def main() -> None:
        actor, handles = make_actor()
        client = RayControllerClient(LocalHandle(actor))
        handles[0].fail_next = True
        results = await asyncio.gather(collect(client, [1, 2, 3], "x"),
                                       collect(client, [4, 5, 6], "y"))
        for _, done in results:  # no error, every token, no duplicate
            assert done.finish_reason == FinishReason.LENGTH and done.error is None
            assert len(done.token_ids) == PARAMS.max_tokens == done.num_output_tokens
        assert handles[0].num_restarts == 1  # killed, so it restarts with clean state
        stats = await actor.stats()
        assert [w["num_failures"] for w in stats["workers"]] == [1, 0]
        assert all(w["is_up"] for w in stats["workers"])
        _, again = await collect(client, [1, 2, 3], "z")  # the loop survived the failure
        assert again.finish_reason == FinishReason.LENGTH
        assert all(w["checked"] for w in (await actor.check_integrity())["workers"])
        actor.core.check_integrity()

    run(main())


def test_hung_worker_is_killed_and_its_requests_finish_on_the_other() -> None:
    async def main() -> None:
        actor, handles = make_actor(deadline_s=0.2)
        client = RayControllerClient(LocalHandle(actor))
        await collect(client, [9, 9, 9], "warm")  # both loops started
        target = actor.core._next_tie  # an idle cluster rotates: the next request's worker
        handles[target].hung = True
        ack, done = await collect(client, [1, 2, 3], "hung")
        assert ack.worker == target and done.error is None
        assert len(done.token_ids) == PARAMS.max_tokens
        assert "hung" in handles[1 - target].runner.request_to_num_chunks  # moved there
        assert handles[target].num_restarts == 1
        stats = await actor.stats()
        assert stats["workers"][target]["num_hangs"] == 1
        assert all(w["is_up"] for w in stats["workers"])

    run(main())


def test_requests_wait_for_the_only_worker_and_health_says_so() -> None:
    async def main() -> None:
        actor, handles = make_actor(num_workers=1)
        client = RayControllerClient(LocalHandle(actor))
        await collect(client, [9, 9, 9], "warm")
        assert (await actor.ping())["ok"]
        handles[0].fail_next = True
        _, done = await collect(client, [1, 2, 3], "a")  # re-queued here, runs once back
        assert done.finish_reason == FinishReason.LENGTH and done.error is None
        assert len(done.token_ids) == PARAMS.max_tokens
        assert (await actor.ping())["num_workers_up"] == 1

    run(main())


def test_no_worker_up_refuses_new_requests() -> None:
    async def main() -> None:
        actor, _ = make_actor(num_workers=1)
        client = RayControllerClient(LocalHandle(actor))
        await collect(client, [9, 9, 9], "warm")
        actor.core.workers[0].is_up = False  # as between a failure and the restart
        with pytest.raises(NoWorkerUpError):
            await client.submit([1, 2], PARAMS, "refused", 0, "t")
        assert not (await actor.ping())["ok"]

    run(main())


def test_unrunnable_requests_are_refused_by_submit() -> None:
    async def main() -> None:
        actor, _ = make_actor()
        client = RayControllerClient(LocalHandle(actor))
        for i, prompt in enumerate(([], [VOCAB])):
            with pytest.raises(ValueError):
                await client.submit(prompt, PARAMS, f"bad{i}", 0, "t")
        with pytest.raises(ValueError):  # more tokens than a whole pool holds
            await client.submit([1], SamplingParams(max_tokens=500), "big", 0, "t")
        assert client._queues == {} and (await actor.stats())["num_unfinished"] == 0

    run(main())


def test_merge_joins_tokens_keeps_the_last_state_and_the_first_error() -> None:
    outputs = [RequestOutput("r", [1], None, 3, 1),
               RequestOutput("r", [], None, 3, 1, error="slow chunk"),
               RequestOutput("r", [2, 3], FinishReason.STOP, 3, 3)]
    merged = Delta.merge([Delta.from_output(out, worker=1) for out in outputs])
    assert merged == Delta("r", 1, [1, 2, 3], FinishReason.STOP, 3, 3, 0, "slow chunk")
    assert merged.is_finished and merged.finish_reason == "stop"  # as OpenAI spells it


def test_subscriber_gets_all_its_requests_in_batches_and_aborts_on_leaving() -> None:
    async def main() -> None:
        actor, _ = make_actor()
        acks = [await actor.submit([1 + i, 2, 3], PARAMS, f"s{i}", 0, "t", "sub")
                for i in range(4)]
        assert sorted(a.worker for a in acks) == [0, 0, 1, 1]
        tokens: dict[str, list[int]] = {f"s{i}": [] for i in range(4)}
        finished: set[str] = set()
        batches = 0
        sub = actor.subscribe("sub")
        async for batch in sub:
            batches += 1
            for delta in batch:
                tokens[delta.request_id] += delta.token_ids
                if delta.is_finished:
                    finished.add(delta.request_id)
            if len(finished) == 4:
                break
        assert all(len(t) == PARAMS.max_tokens for t in tokens.values())
        assert batches < 4 * PARAMS.max_tokens  # deltas of several requests share items
        long = SamplingParams(max_tokens=50, ignore_eos=True)
        await actor.submit([9, 9, 9], long, "left", 0, "t", "sub")
        await anext(sub)
        await sub.aclose()  # the ingress went away: its unfinished request is aborted
        stats = await actor.stats()
        assert stats["num_aborted"] == 1 and stats["num_subscribers"] == 0
        assert all(w["checked"] for w in (await actor.check_integrity())["workers"])
        assert (await actor.stats())["num_streams"] == 0

    run(main())


def test_restarted_worker_never_serves_a_prefix_cached_before_it_died() -> None:
    """A worker restart zeroes its KV: the controller must drop the pool's prefix hashes,
    else a greedy request whose prefix was cached gets wrong tokens with no error."""
    async def main() -> None:
        actor, handles = make_actor(num_workers=1)
        client = RayControllerClient(LocalHandle(actor))
        prompt = list(range(1, 14))  # 3 full blocks of 4, cached after the first run
        await collect(client, prompt, "before")
        await collect(client, prompt, "hit")
        assert handles[0].seen_computed == [0, 12]  # the prefix cache serves 3 blocks
        handles[0].restart()
        # The first step after the restart is refused (it was planned for the old process);
        # the request is re-queued and recomputed once the new process answers.
        _, during = await collect(client, prompt, "during")
        assert during.finish_reason == FinishReason.LENGTH and during.error is None
        # With async scheduling (the actor path's default) the step planned ahead was
        # for the old process too: refused as well.
        assert handles[0].num_refused in (1, 2)
        assert handles[0].seen_computed[-1] == 0  # computed anew, not read from dead KV
        _, after = await collect(client, prompt, "after")
        assert after.finish_reason == FinishReason.LENGTH
        assert actor.core.scheduler(0).kv.pool.stats().num_used == 0
        actor.core.check_integrity()
        assert (await actor.stats())["workers"][0]["incarnation"] == "fake-2"

    run(main())


def test_a_stream_nobody_reads_is_aborted_not_run_to_max_tokens() -> None:
    """A response body that never started drops its delta iterator unread; the client must
    abort the request at the first orphaned delta, or it holds its blocks to max_tokens."""
    async def main() -> None:
        actor, handles = make_actor(num_workers=1)
        client = RayControllerClient(LocalHandle(actor))
        long = SamplingParams(max_tokens=100, ignore_eos=True)
        _, deltas = await client.submit([1, 2, 3], long, "orphan", 0, "t")
        del deltas  # never iterated: its `finally` never runs
        client._queues.pop("orphan")  # what the ingress's dropped response leaves behind
        while actor.core.has_unfinished():
            await asyncio.sleep(0)  # yield to the step loop; no wall-clock wait
        stats = await actor.stats()
        assert stats["num_aborted"] == 1
        assert handles[0].num_steps < 10  # aborted early, not 100 decode steps
        assert (await actor.check_integrity())["workers"][0]["checked"]

    run(main())


def test_a_request_on_too_many_failed_workers_is_aborted_and_the_loop_lives() -> None:
    import dataclasses

    async def main() -> None:
        actor, handles = make_actor(num_workers=1)
        actor.options = dataclasses.replace(actor.options, recovery=dataclasses.replace(
            actor.options.recovery, max_worker_failures_per_request=1))
        client = RayControllerClient(LocalHandle(actor))
        handles[0].fail_next = True
        _, poisoned = await collect(client, [1, 2, 3], "poison")
        assert poisoned.finish_reason == FinishReason.ABORT and "failed workers" in (
            poisoned.error or "")
        assert (await actor.wait_workers_up(10))["num_workers_up"] == 1  # restarted
        _, after = await collect(client, [4, 5, 6], "after")  # the loop survived
        assert after.finish_reason == FinishReason.LENGTH and after.error is None
        snap = await actor.metrics_snapshot()
        assert snap.requests.finished_reason_to_count.get("error") == 1  # as the client saw it

    run(main())


class ControllerBug(RuntimeError):
    """An exception in the controller's own part of a step, injected by a test."""


def raise_once_after(fn: Callable[..., Any], request_ids: Callable[..., Any], victim: str,
                     nth: int) -> Callable[..., Any]:
    """`fn`, which raises ControllerBug after it ran for the `nth` step carrying `victim`
    (what `request_ids(*args)` lists): its effects stand, its return value is lost."""
    num_seen = 0

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        nonlocal num_seen
        value = fn(*args, **kwargs)
        if victim in request_ids(*args):
            num_seen += 1
            if num_seen == nth:
                raise ControllerBug(f"injected on step {num_seen} of {victim}")
        return value

    return wrapper


async def assert_worker_kept_and_clean(actor: ControllerActor, handle: FakeWorkerHandle,
                                       worker: int, num_controller_errors: int) -> None:
    """No recovery ran (no kill, no new incarnation), the error was counted, and neither
    the pool nor the worker holds a block once the loop parked."""
    stats = (await actor.stats())["workers"][worker]
    assert handle.num_restarts == 0 and stats["incarnation"] == "fake-0"
    assert stats["num_failures"] == 0 and stats["is_up"]
    assert stats["num_controller_errors"] == num_controller_errors
    report = await actor.check_integrity()
    assert all(w["checked"] for w in report["workers"])
    assert actor.core.scheduler(worker).kv.pool.stats().num_used == 0
    actor.core.check_integrity()


# The step of the victim that fails: mid-stream, or the one that samples its last token
# (the core already finished it, and the output that says so is lost with the exception);
# `on_step` fails after the step's outputs were delivered, so its token reached the client.
@pytest.mark.parametrize(("hook", "nth", "num_tokens"), [
    ("finish_step", 2, 1), ("finish_step", 5, 4), ("on_step", 2, 2)])
def test_a_controller_error_finishing_a_step_fails_its_requests_not_the_worker(
        hook: str, nth: int, num_tokens: int) -> None:
    async def main() -> None:
        actor, handles = make_actor(num_workers=2)
        client = RayControllerClient(LocalHandle(actor))
        await collect(client, [9, 9, 9], "warm")  # the core and both loops are up
        worker = actor.core._next_tie  # an idle cluster rotates: the victim's worker
        slot = actor.slots[worker]
        if hook == "finish_step":
            actor.core.finish_step = raise_once_after(  # type: ignore[method-assign]
                actor.core.finish_step, lambda w, plan, result: plan.num_scheduled_tokens,
                "victim", nth)
        else:  # the journal's step boundary, after the outputs were delivered
            slot.listener.on_step = raise_once_after(  # type: ignore[method-assign]
                slot.listener.on_step, lambda result: result.sampled_token_ids, "victim", nth)
        victim, bystander = await asyncio.gather(collect(client, [1, 2, 3], "victim"),
                                                 collect(client, [4, 5, 6], "bystander"))
        assert victim[0].worker == worker and bystander[0].worker != worker
        failed = victim[1]
        assert failed.finish_reason == FinishReason.ABORT
        assert "controller error" in (failed.error or "") and "ControllerBug" in failed.error
        assert len(failed.token_ids) == num_tokens  # and none after the failed step
        assert bystander[1].finish_reason == FinishReason.LENGTH
        assert bystander[1].error is None
        _, after = await collect(client, [1, 2, 3], "after")  # the same loop serves on
        assert after.finish_reason == FinishReason.LENGTH and after.error is None
        assert len(after.token_ids) == PARAMS.max_tokens
        await assert_worker_kept_and_clean(actor, handles[worker], worker, 1)
        assert "victim" not in handles[worker].runner.requests  # told it was aborted

    run(main())


def test_a_controller_error_planning_a_step_resets_the_worker_without_a_restart() -> None:
    async def main() -> None:
        actor, handles = make_actor(num_workers=1)
        client = RayControllerClient(LocalHandle(actor))
        await collect(client, [9, 9, 9], "warm")
        # The plan of the victim's second step is built (blocks allocated, diffs marked
        # sent) and lost: the worker never sees it.
        actor.core.begin_step = raise_once_after(  # type: ignore[method-assign]
            actor.core.begin_step, lambda w: actor.core.scheduler(w).requests, "victim", 2)
        results = await asyncio.gather(collect(client, [1, 2, 3], "victim"),
                                       collect(client, [4, 5, 6, 7], "neighbour"))
        for _, done in results:  # every request on the worker fails, with the error
            assert done.finish_reason == FinishReason.ABORT
            assert "controller error while planning" in (done.error or "")
        assert handles[0].runner.requests == {}  # the worker dropped its state (reset)
        # A new request plans from a clean slate: the fake runner checks every diff.
        _, after = await collect(client, [1, 2, 3], "after")
        assert after.finish_reason == FinishReason.LENGTH and after.error is None
        assert len(after.token_ids) == PARAMS.max_tokens
        await assert_worker_kept_and_clean(actor, handles[0], 0, 1)

    run(main())


def test_a_delta_batch_carries_every_field_and_pickles_as_columns() -> None:
    """What `subscribe` yields: iterating it gives the deltas back, field for field; it
    pickles without one object per delta (a Ray item is pickled on the step loop)."""
    import pickle

    from controller.messages import DeltaBatch

    deltas = [Delta(f"r{i}", i % 2, [i, i + 1], None, 3, i, 1) for i in range(3)]
    deltas += [Delta("done", 1, [], FinishReason.LENGTH, 4, 5, 0),
               Delta.failed("gone", "the worker died")]
    batch = DeltaBatch.of(deltas)
    assert list(batch) == deltas and len(batch) == 5
    assert batch.finished_ids() == ["done", "gone"]
    again = pickle.loads(pickle.dumps(batch))
    assert list(again) == deltas
    assert b"Delta\\n" not in pickle.dumps(batch, protocol=0)  # columns, not Delta objects
