"""A controller crash and restart without Ray: the journal (a real `redis-server`), the
restarted controller's `resume`, and the edge's `RayControllerClient` reconnecting.

Fake workers sample deterministically (the next token is a function of the tokens so far),
as the real ones do for greedy and seeded requests, so recomputation after a restart
reproduces every token. `RestartableHandle` stands for the Ray handle of a restarted actor:
`crash()` stops the old controller dead (its loops and its journal writer stop, its
subscribe streams break) and puts a fresh one behind the same handle. Shows: streams
continue with no gap and no duplicate, also when the consumer already had tokens the
journal had not written yet; a request the journal never held, or every request without a
journal, is submitted again by the edge and runs to the same tokens (one refused then ends
with a clear error instead of hanging).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from cluster.config import EdgeConfig
from cluster.controller_client import RayControllerClient
from controller.actor import ControllerActor
from controller.journal import JournalConfig
from controller.messages import Delta, SamplingParams
from controller.options import ClusterConfig, ControllerOptions, WorkerConfig
from controller.routing import QueueFullError
from controller.scheduler import SchedulerConfig
from controller.worker_loop import RecoveryConfig
from tests.redis_server import RedisServer
from tests.unit.fake_runner import FakeRunner
from tests.unit.test_controller_actor import VOCAB, FakeWorkerHandle, _LocalMethod

PARAMS = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def next_token(token_ids: list[int]) -> int:
    return (31 * sum(token_ids) + 7 * len(token_ids)) % VOCAB


def expected_tokens(prompt: list[int]) -> list[int]:
    ids = list(prompt)
    for _ in range(PARAMS.max_tokens):
        ids.append(next_token(ids))
    return ids[len(prompt):]


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    server = RedisServer().start()
    yield server
    server.kill()


class RestartableHandle:
    def __init__(self, make_actor: Any) -> None:
        self.make_actor = make_actor
        self.actor: ControllerActor = make_actor()
        self.dead = asyncio.Event()

    def __getattr__(self, name: str) -> _LocalMethod:
        if name == "subscribe":
            return _LocalMethod(self._subscribe)
        return _LocalMethod(getattr(self.actor, name))

    async def _subscribe(self, subscriber: str) -> AsyncIterator[list[Delta]]:
        stream, dead = self.actor.subscribe(subscriber).__aiter__(), self.dead
        while True:
            item = asyncio.ensure_future(stream.__anext__())
            died = asyncio.ensure_future(dead.wait())
            await asyncio.wait({item, died}, return_when=asyncio.FIRST_COMPLETED)
            died.cancel()
            if not item.done():
                item.cancel()
                raise ConnectionError("the controller actor died")
            try:
                yield item.result()
            except StopAsyncIteration:
                return

    def crash(self) -> None:
        """SIGKILL and Ray's restart: nothing of the old controller runs any more."""
        old = self.actor
        if old.journal is not None:
            old.journal.close()  # its writer stops: nothing it does from now on is written
        for slot in old.slots:
            assert slot.task is not None
            slot.task.cancel()
        dead, self.dead = self.dead, asyncio.Event()
        self.actor = self.make_actor()
        dead.set()


def make_handle(redis_url: str | None, key_prefix: str) -> tuple[RestartableHandle,
                                                                  list[FakeWorkerHandle]]:
    workers = [FakeWorkerHandle(FakeRunner(vocab_size=VOCAB, block_size=4, sample=next_token))
               for _ in range(2)]
    options = ControllerOptions(
        worker=WorkerConfig(num_workers=2),
        # One step at a time: the checkpoints hold the workers after a counted number of
        # tokens, which a step planned ahead would run past (async scheduling's restarts
        # are tests/integration/test_controller_restart.py's, on a real cluster).
        scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8,
                                  async_scheduling=False),
        recovery=RecoveryConfig(step_deadline_min_s=5.0, restart_backoff_s=0.001),
        cluster=ClusterConfig(redis_url=redis_url),
        journal=JournalConfig(key_prefix=key_prefix))
    return RestartableHandle(lambda: ControllerActor(
        options, worker_factory=lambda opts: workers, kill_worker=FakeWorkerHandle.kill)), workers


class Stream:
    def __init__(self, client: RayControllerClient, prompt: list[int], request_id: str,
                 on_delta: Any = None) -> None:
        self.prompt, self.request_id = prompt, request_id
        self.tokens: list[int] = []
        self.deltas: list[Delta] = []
        self.on_delta = on_delta or (lambda: None)
        self.task = asyncio.ensure_future(self._run(client))

    async def _run(self, client: RayControllerClient) -> None:
        _, deltas = await client.submit(self.prompt, PARAMS, self.request_id, 0, "default")
        async for delta in deltas:
            self.deltas.append(delta)
            self.tokens.extend(delta.token_ids)
            self.on_delta()


def hold(workers: list[FakeWorkerHandle], held: bool) -> None:
    for worker in workers:
        (worker.gate.clear if held else worker.gate.set)()


class Checkpoint:
    """Holds the workers (their steps wait at the gate) as soon as every stream has
    `num_tokens` tokens: checked in the consumer's own callback, so at most the steps
    already in flight finish after it."""

    def __init__(self, workers: list[FakeWorkerHandle]) -> None:
        self.workers = workers
        self.streams: list[Stream] = []
        self.num_tokens = 0
        self.reached = asyncio.Event()

    def arm(self, streams: list[Stream], num_tokens: int) -> None:
        self.streams, self.num_tokens = streams, num_tokens
        self.reached.clear()
        hold(self.workers, False)
        self.check()

    def check(self) -> None:
        if self.streams and all(len(s.tokens) >= self.num_tokens for s in self.streams):
            hold(self.workers, True)
            self.streams = []
            self.reached.set()


def test_streams_resume_without_gap_or_duplicate_after_a_restart(server) -> None:
    async def main() -> None:
        handle, workers = make_handle(server.url, "resume:")
        client = RayControllerClient(handle, EdgeConfig(reconnect_backoff_s=0.001))
        prompts = [[1 + i, 2 + i, 3, 4, 5 + i] for i in range(4)]
        checkpoint = Checkpoint(workers)
        streams = [Stream(client, p, f"r{i}", checkpoint.check) for i, p in enumerate(prompts)]
        checkpoint.arm(streams, 3)
        await checkpoint.reached.wait()
        old = handle.actor
        assert old.journal is not None
        assert await asyncio.to_thread(old.journal.flush, 10.0)
        journaled = {r.request_id: len(r.output_token_ids)
                     for r in await asyncio.to_thread(old.journal.load_unfinished)}
        # From here on the journal lags: its writer is stopped before the crash, while the
        # consumers get 3 more tokens each (the restart recomputes them, they are not resent).
        old.journal.close()
        late = Stream(client, [9, 9, 9], "late", checkpoint.check)  # never journaled
        checkpoint.arm([*streams, late], 6)
        await checkpoint.reached.wait()
        # Acked while the workers are held: no token, never journaled.
        unstarted = Stream(client, [8, 8], "unstarted")
        while "unstarted" not in client._acked:  # its ack is the condition
            await asyncio.sleep(0)
        assert all(len(s.tokens) < PARAMS.max_tokens for s in streams)
        num_delivered = [len(s.tokens) for s in streams]
        assert len(late.tokens) >= 6 and unstarted.tokens == []
        handle.crash()
        hold(workers, False)
        await asyncio.gather(*(s.task for s in [*streams, late, unstarted]))

        # The journaled ones resumed; the two it never held were submitted again and ran
        # to the same tokens (their seeds come from their ids), none sent twice.
        everyone = [*zip(streams, prompts, strict=True), (late, [9, 9, 9]), (unstarted, [8, 8])]
        for stream, prompt in everyone:
            assert stream.tokens == expected_tokens(prompt), stream.request_id
            assert stream.deltas[-1].finish_reason == "length"
            assert all(d.error is None for d in stream.deltas)
        # Tokens the consumers had but the journal had not: recomputed, not resent.
        assert all(num > journaled[s.request_id]
                   for num, s in zip(num_delivered, streams, strict=True))
        assert client.num_reconnects == 1 and client.num_submitted_again == 2
        new = handle.actor
        stats = await new.stats()
        assert stats["num_resumed"] == 4 == stats["num_resumed_streams"]
        assert stats["num_unclaimed"] == 0 and stats["num_streams"] == 0
        report = await new.check_integrity()
        assert all(w["checked"] for w in report["workers"])
        assert new.journal is not None and await asyncio.to_thread(new.journal.flush, 10.0)
        assert new.journal.load_unfinished() == []  # every resumed request finished
        await new.shutdown()

    asyncio.run(asyncio.wait_for(main(), 30))


class RefusingHandle(RestartableHandle):
    """Refuses the submits sent again after a restart (those with a `num_delivered`) of
    the ids in `refuse`, as a controller whose queues are full does."""

    def __init__(self, make_actor: Any, refuse: set[str]) -> None:
        super().__init__(make_actor)
        self.refuse = refuse
        self.refused: list[str] = []

    def __getattr__(self, name: str) -> _LocalMethod:
        if name == "submit":
            return _LocalMethod(self._submit)
        return super().__getattr__(name)

    async def _submit(self, *args: Any) -> Any:
        if len(args) > 6 and args[2] in self.refuse:
            self.refused.append(args[2])
            raise QueueFullError("all request queues are full")
        return await self.actor.submit(*args)


def test_without_a_journal_open_streams_run_again_to_the_same_tokens() -> None:
    async def main() -> None:
        made, workers = make_handle(None, "")
        handle = RefusingHandle(made.make_actor, {"r2"})
        client = RayControllerClient(handle, EdgeConfig(reconnect_backoff_s=0.001))
        checkpoint = Checkpoint(workers)
        streams = [Stream(client, [1 + i, 2, 3], f"r{i}", checkpoint.check) for i in range(3)]
        checkpoint.arm(streams, 2)
        await checkpoint.reached.wait()
        handle.crash()
        hold(workers, False)
        await asyncio.gather(*(s.task for s in streams))
        # Each consumer had 2+ tokens: the requests ran again from their prompts and the
        # consumers got the rest, none twice.
        for stream in streams[:2]:
            assert stream.tokens == expected_tokens(stream.prompt), stream.request_id
            assert stream.deltas[-1].finish_reason == "length"
            assert all(d.error is None for d in stream.deltas)
        # One refused when sent again ends with a clear error, no hang.
        assert handle.refused == ["r2"]
        refused = streams[2]
        assert refused.deltas[-1].finish_reason == "abort"
        assert "could not run this request again: all request queues are full" in \
            (refused.deltas[-1].error or "")
        assert client.num_submitted_again == 2
        # The restarted controller serves new requests.
        fresh = Stream(client, [4, 5, 6], "fresh")
        await fresh.task
        assert fresh.tokens == expected_tokens([4, 5, 6])

    asyncio.run(asyncio.wait_for(main(), 30))


class CrashingSubmitHandle(RestartableHandle):
    """The controller dies while a `submit` is in flight: before admitting it, or after
    (admitted and journaled, its reply lost). Either way the caller sees what Ray raises
    for a dead actor and cannot know which."""

    def __init__(self, make_actor: Any, crash_on: dict[str, str]) -> None:
        super().__init__(make_actor)
        # request id -> "before" | "after" | "streamed" (after, once the client has
        # dispatched tokens of it: they came through the stream before the reply)
        self.crash_on = crash_on
        self.num_submits: dict[str, int] = {}
        self.dispatched: dict[str, asyncio.Event] = {}  # request id -> its tokens were

    async def _subscribe(self, subscriber: str) -> AsyncIterator[list[Delta]]:
        async for batch in super()._subscribe(subscriber):
            yield batch
            # The consumer asks for the next batch once it has dispatched this one.
            for delta in batch:
                event = self.dispatched.get(delta.request_id)
                if event is not None and delta.token_ids:
                    event.set()

    def __getattr__(self, name: str) -> _LocalMethod:
        if name == "submit":
            return _LocalMethod(self._submit)
        return super().__getattr__(name)

    async def _submit(self, *args: Any) -> Any:
        from ray.exceptions import RayActorError

        request_id = args[2]
        self.num_submits[request_id] = self.num_submits.get(request_id, 0) + 1
        when = self.crash_on.pop(request_id, None)
        if when == "before":
            self.crash()
            raise RayActorError()
        if when == "streamed":
            self.dispatched[request_id] = asyncio.Event()
        ack = await self.actor.submit(*args)
        if when == "streamed":
            await self.dispatched[request_id].wait()
        if when in ("after", "streamed"):
            if self.actor.journal is not None:
                assert await asyncio.to_thread(self.actor.journal.flush, 10.0)
            self.crash()
            raise RayActorError()
        return ack


@pytest.mark.parametrize(("when", "journaled"), [
    ("before", True), ("after", True), ("streamed", True),
    # The restarted controller has no journal to resume from: it runs the request anew.
    ("streamed", False)])
def test_a_submit_cut_by_a_controller_crash_is_sent_again_and_changes_no_token(
        server, when: str, journaled: bool) -> None:
    async def main() -> None:
        # Its first actor never starts.
        made, workers = make_handle(server.url if journaled else None, f"cut-{when}:")
        handle = CrashingSubmitHandle(made.make_actor, {"cut": when})
        client = RayControllerClient(handle, EdgeConfig(reconnect_backoff_s=0.001))
        # No step of the first controller ends, so the crash cuts it short; "streamed":
        # its tokens reach the client before the reply, and the restarted controller
        # sends them again from the first (the consumer must get each once).
        hold(workers, when != "streamed")
        try:
            ack, deltas = await client.submit([4, 5, 6, 7], PARAMS, "cut", 0, "default")
            assert ack.request_id == "cut"
            hold(workers, False)
            tokens = [t async for d in deltas for t in d.token_ids]
            assert tokens == expected_tokens([4, 5, 6, 7])
            assert handle.num_submits["cut"] == 2  # sent again, admitted once
            stats = await handle.actor.stats()
            if when != "streamed":  # there it may have finished before the crash
                assert stats["num_resumed_streams"] == (1 if when == "after" else 0)
            # "streamed": had the first controller finished it, the client already holds its
            # whole answer; the request sent again is then aborted (fire and forget), and
            # ends within a few turns of the loop.
            for _ in range(100):
                if stats["num_unfinished"] == 0:
                    break
                await asyncio.sleep(0)
                stats = await handle.actor.stats()
            assert stats["num_unfinished"] == 0
        finally:
            await handle.actor.shutdown()

    asyncio.run(asyncio.wait_for(main(), 30))
