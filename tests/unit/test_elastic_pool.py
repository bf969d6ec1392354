"""The elastic pool in the controller actor, without Ray: fake worker handles (as in
test_controller_actor.py) whose tokens are a function of the context, as greedy decoding's
are. Shows: an added worker joins once it answers and takes new requests; a drained worker
takes none, finishes its running ones, and is removed (killed for good, left out of the
metrics, health still ok); past the drain timeout its requests move to another worker and
end with the same tokens as an undisturbed run; the last worker cannot be drained."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from cluster.controller_client import RayControllerClient, run_request
from controller.actor import ControllerActor
from controller.messages import FinishReason, SamplingParams
from controller.options import ControllerOptions, WorkerConfig
from controller.scheduler import SchedulerConfig
from controller.worker_loop import RecoveryConfig
from tests.unit.fake_runner import FakeRunner
from tests.unit.test_controller_actor import VOCAB, FakeWorkerHandle, LocalHandle

PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def greedy_like(token_ids: list[int]) -> int:
    return (31 * sum(token_ids) + len(token_ids)) % VOCAB


def fake_handle() -> FakeWorkerHandle:
    return FakeWorkerHandle(FakeRunner(vocab_size=VOCAB, block_size=4, sample=greedy_like))


class Pool:
    """A controller over fake workers that records every worker added and removed."""

    def __init__(self, num_workers: int) -> None:
        self.handles = [fake_handle() for _ in range(num_workers)]
        self.spawned: list[int] = []  # name indices of added workers
        self.removed: list[FakeWorkerHandle] = []
        options = ControllerOptions(
            worker=WorkerConfig(num_workers=num_workers),
            scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8),
            recovery=RecoveryConfig(step_deadline_min_s=5.0, restart_backoff_s=0.001))
        self.actor = ControllerActor(options, worker_factory=lambda _: self.handles[:],
                                     kill_worker=FakeWorkerHandle.kill,
                                     spawn_worker=self._spawn, remove_worker=self.removed.append)
        self.client = RayControllerClient(LocalHandle(self.actor))

    def _spawn(self, _: ControllerOptions, index: int) -> FakeWorkerHandle:
        self.spawned.append(index)
        handle = fake_handle()
        self.handles.append(handle)
        return handle

    async def request(self, prompt: list[int], request_id: str) -> tuple[Any, Any]:
        return await run_request(self.client, prompt, PARAMS, request_id)


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 10))


async def undisturbed(prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    pool = Pool(1)
    done = await asyncio.gather(*(pool.request(p, r) for r, p in prompts.items()))
    return {r: d.token_ids for r, (_, d) in zip(prompts, done, strict=True)}


def test_an_added_worker_joins_once_loaded_and_takes_new_requests() -> None:
    async def main() -> None:
        pool = Pool(1)
        await pool.request([1, 2, 3], "warm")
        await pool.actor.check_integrity()  # parked: the worker heard of every finished id
        pool.handles[0].gate.clear()  # worker 0 busy: the next request goes to the new one
        pool.handles[0].entered.clear()
        busy = asyncio.create_task(pool.request([4, 5, 6], "busy"))
        await pool.handles[0].entered.wait()
        answer = await pool.actor.add_worker(wait=True)
        assert answer["worker"] == 1 and answer["state"] == "serving"
        assert pool.spawned == [1]  # the next name: worker 0 keeps its own
        ack, done = await pool.request([7, 8, 9], "new")
        assert ack.worker == done.worker == 1 and done.finish_reason == FinishReason.LENGTH
        assert "new" in pool.handles[1].runner.request_to_num_chunks
        pool.handles[0].gate.set()
        await busy
        snap = await pool.actor.metrics_snapshot()
        assert snap.pool_states == {"loading": 0, "serving": 2, "draining": 0}
        assert snap.scale_events[("up", "operator")] == 1 and snap.worker_ids == [0, 1]
        assert [w["state"] for w in await pool.actor.workers()] == ["serving", "serving"]

    run(main())


async def hold_worker_1(prompts: dict[str, list[int]], answers_cancel: bool = False
                        ) -> tuple[dict[str, list[int]], Pool, Any, list[asyncio.Task[Any]]]:
    """The undisturbed tokens of `prompts`, then a 2-worker pool serving them with worker 1
    held in its first step: (expected, pool, worker 1's handle, the running requests)."""
    expected = await undisturbed(prompts)
    pool = Pool(2)
    held = pool.handles[1]
    held.gate.clear()
    held.answers_cancel = answers_cancel
    running = [asyncio.create_task(pool.request(p, r)) for r, p in prompts.items()]
    await held.entered.wait()
    return expected, pool, held, running


def test_a_drained_worker_finishes_its_requests_takes_no_new_one_and_is_removed() -> None:
    async def main() -> None:
        prompts = {f"r{i}": [1 + i, 2, 3, 4] for i in range(4)}
        expected, pool, slow, running = await hold_worker_1(prompts)
        on_slow = {r for r, w in pool.actor.core.request_to_worker.items() if w == 1}
        assert on_slow  # the drain has requests to finish
        answer = await pool.actor.drain_worker(1, timeout_s=60, wait=False)
        assert answer["state"] == "draining"
        drain = pool.actor.pool.draining[1]
        ack, _ = await pool.request([9, 9, 9], "after")
        assert ack.worker == 0  # a draining worker takes no new request
        slow.gate.set()
        results = await asyncio.gather(*running)
        report = await asyncio.wait_for(drain, 5)
        assert report["finished"] and report["num_moved"] == 0
        assert {a.request_id: d.token_ids for a, d in results} == expected
        assert on_slow <= set(slow.runner.request_to_num_chunks)  # finished where it ran
        assert 1 in pool.actor.pool.removed
        assert pool.removed == [slow]  # killed for good: its resources go back to Ray
        health = await pool.actor.ping()
        assert health["ok"] and [w["worker"] for w in health["workers"]] == [0]
        snap = await pool.actor.metrics_snapshot()
        assert snap.worker_ids == [0] and snap.pool_states["serving"] == 1
        assert snap.scale_events[("down", "operator")] == 1
        _, again = await pool.request([5, 5, 5], "later")
        assert again.worker == 0 and again.finish_reason == FinishReason.LENGTH
        assert all(w["checked"] for w in (await pool.actor.check_integrity())["workers"])
        pool.actor.core.check_integrity()

    run(main())


def test_past_the_drain_timeout_requests_move_and_keep_their_tokens() -> None:
    async def main() -> None:
        prompts = {f"m{i}": [3 + i, 1, 4, 1, 5] for i in range(4)}
        # Worker 1 never finishes a step while draining.
        expected, pool, stuck, running = await hold_worker_1(prompts)
        on_stuck = {r for r, w in pool.actor.core.request_to_worker.items() if w == 1}
        report = await pool.actor.drain_worker(1, timeout_s=0.05)
        assert not report["finished"] and report["num_moved"] == len(on_stuck) > 0
        assert report["moved_to"] == [0] and report["num_ended"] == 0
        results = await asyncio.gather(*running)
        assert {a.request_id: d.token_ids for a, d in results} == expected
        assert all(d.error is None for _, d in results)
        assert pool.removed == [stuck]
        assert all(w["checked"] for w in (await pool.actor.check_integrity())["workers"])

    run(main())


def test_a_drain_ends_the_step_loop_even_when_its_cancel_is_answered() -> None:
    # The drained worker's step answers as the drain cancels it, so the cancel never
    # reaches the loop; the loop must end all the same, or the drain waits for ever.
    async def main() -> None:
        prompts = {f"c{i}": [2 + i, 7, 1, 8] for i in range(4)}
        expected, pool, _, running = await hold_worker_1(prompts, answers_cancel=True)
        report = await pool.actor.drain_worker(1, timeout_s=0.05)
        assert not report["finished"] and 1 in pool.actor.pool.removed
        assert pool.actor.slots[1].task is not None and pool.actor.slots[1].task.done()
        results = await asyncio.gather(*running)
        assert {a.request_id: d.token_ids for a, d in results} == expected
        assert all(w["checked"] for w in (await pool.actor.check_integrity())["workers"])

    run(main())


def test_a_cancel_that_lands_as_the_worker_answers_is_not_lost() -> None:
    # asyncio.wait_for (Python 3.11) returns the answer when it is cancelled in the tick
    # the answer arrives; the slot's worker call must raise CancelledError instead.
    async def main() -> None:
        pool = Pool(1)
        await pool.request([1, 2, 3], "warm")
        slot = pool.actor.slots[0]
        answer: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        called = asyncio.Event()

        def call() -> asyncio.Future[str]:
            called.set()
            return answer

        waiting = asyncio.create_task(slot._call_worker(call, 5.0, "step"))
        await called.wait()  # the call is awaiting its answer
        answer.set_result("tokens")
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting

    run(main())


def test_the_last_worker_and_an_unknown_one_cannot_be_drained() -> None:
    async def main() -> None:
        pool = Pool(1)
        with pytest.raises(ValueError, match="last serving worker"):
            await pool.actor.drain_worker(0)
        with pytest.raises(ValueError, match="no worker 3"):
            await pool.actor.drain_worker(3)
        await pool.actor.add_worker(wait=True)
        await pool.actor.drain_worker(0, timeout_s=1)
        with pytest.raises(ValueError, match="removed"):
            await pool.actor.drain_worker(0)

    run(main())


def test_the_workers_cli_parses_its_actions_and_lists_one_row_per_worker() -> None:
    from cluster.cli import build_parser
    from cluster.workers_cli import format_rows

    args = build_parser().parse_args(["workers", "--address", "h:6380", "drain", "2",
                                      "--timeout", "30"])
    assert (args.command, args.action, args.address) == ("workers", "drain", "h:6380")
    assert (args.worker, args.timeout, args.no_wait) == (2, 30.0, False)
    assert build_parser().parse_args(["workers", "add", "--wait"]).wait

    async def main() -> str:
        pool = Pool(1)
        await pool.actor.add_worker(wait=True)
        await pool.actor.drain_worker(1, timeout_s=1)
        return format_rows(await pool.actor.workers())

    lines = run(main()).splitlines()
    assert len(lines) == 3 and lines[0].split()[:2] == ["worker", "state"]
    assert lines[1].split()[:2] == ["0", "serving"] and lines[2].split()[:2] == ["1", "removed"]
    assert lines[2].split()[-1] == "tokenflow-controller-worker-1"
