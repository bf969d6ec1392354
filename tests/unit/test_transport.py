"""The worker transports without Ray: actor calls pass the incarnation and turn a refused
call into a failing awaitable; a compiled-graph transport whose graph cannot be built
(here: a fake worker, which has no Ray method to bind) falls back to actor calls, logs
it once, and the whole controller serves on it."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any

import pytest

from cluster.controller_client import RayControllerClient
from controller.messages import StepPlan, StepResult, decode_plan, encode_message
from controller.options import ClusterConfig
from controller.transport import ACTOR_CALL, ActorCallTransport, CompiledGraphTransport
from tests.unit.fake_runner import FakeRunner
from tests.unit.test_controller_actor import (
    PARAMS,
    FakeWorkerHandle,
    LocalHandle,
    collect,
    make_actor,
    run,
)


class _Refusing:
    def remote(self, *args: Any) -> Any:
        raise RuntimeError("actor handle closed")


def _handle() -> FakeWorkerHandle:
    return FakeWorkerHandle(FakeRunner(vocab_size=100, block_size=4))


class _RecordingExecute:
    """An actor's `execute` that keeps what each call carried and answers as the worker
    does: bytes for a plan sent as bytes."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def remote(self, *args: Any) -> Any:
        self.calls.append(args)
        plan = decode_plan(args[0])

        async def answer() -> bytes:
            return encode_message(StepResult(step_id=plan.step_id, num_tokens=plan.step_id))

        return answer()


def test_actor_calls_carry_the_plan_as_bytes_numbered_per_sender() -> None:
    async def main() -> None:
        handle = _handle()
        handle.execute = _RecordingExecute()
        transport = ActorCallTransport(handle, "fake-0")
        results = [await transport.send(StepPlan(step_id=i)) for i in (4, 5)]
        assert [(r.step_id, r.num_tokens) for r in results] == [(4, 4), (5, 5)]
        await transport.reopen(handle, "fake-1")  # a restarted worker: a new sender
        await transport.send(StepPlan(step_id=6))
        calls = handle.execute.calls
        assert all(isinstance(call[0], bytes) for call in calls)
        assert [decode_plan(call[0]).step_id for call in calls] == [4, 5, 6]
        assert [call[1] for call in calls] == ["fake-0", "fake-0", "fake-1"]
        assert [call[3] for call in calls] == [0, 1, 0]
        assert calls[0][2] == calls[1][2] != calls[2][2]

    run(main())


def test_a_message_of_the_wrong_kind_is_refused() -> None:
    with pytest.raises(TypeError, match="expected a StepPlan"):
        decode_plan(encode_message(StepResult(step_id=1)))


def test_actor_call_names_the_incarnation_and_a_refused_call_fails_when_awaited() -> None:
    async def main() -> None:
        handle = _handle()
        transport = ActorCallTransport(handle, "fake-0")
        assert (await transport.send(StepPlan(step_id=1))).step_id == 1
        await transport.reopen(handle, "fake-old")
        with pytest.raises(Exception, match="is gone"):  # the worker refuses a stale plan
            await transport.send(StepPlan(step_id=2))
        handle.execute = _Refusing()
        refused = transport.send(StepPlan(step_id=3))  # no raise here: where awaited
        with pytest.raises(RuntimeError, match="closed"):
            await refused

    run(main())


def test_compiled_graph_that_cannot_be_built_falls_back_and_logs_once(caplog) -> None:
    async def main() -> None:
        handle = _handle()
        transport = CompiledGraphTransport(handle, "fake-0", probe_timeout_s=1.0)
        with caplog.at_level(logging.INFO, logger="controller.transport"):
            await transport.reopen(handle, "fake-0")
            await transport.reopen(handle, "fake-0")  # after a restart: tried again
        assert transport.kind == ACTOR_CALL
        assert "AttributeError" in (transport.fallback_reason or "")  # no Ray actor
        warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) == 1
        assert (await transport.send(StepPlan(step_id=7))).step_id == 7
        await transport.drain(1.0)
        transport.close()

    run(main())


def test_controller_with_compiled_graph_asked_serves_by_actor_call_on_fake_workers() -> None:
    async def main() -> None:
        actor, _ = make_actor()
        actor.options = dataclasses.replace(
            actor.options, cluster=ClusterConfig(worker_transport="compiled_graph"))
        client = RayControllerClient(LocalHandle(actor))
        results = await asyncio.gather(*(collect(client, [1 + i, 2, 3], f"r{i}")
                                         for i in range(4)))
        assert all(len(done.token_ids) == PARAMS.max_tokens for _, done in results)
        workers = (await actor.stats())["workers"]
        assert [w["transport"] for w in workers] == [ACTOR_CALL, ACTOR_CALL]
        assert all(w["transport_fallback"] for w in workers)

    run(main())


def test_worker_transport_is_validated() -> None:
    with pytest.raises(ValueError, match="worker_transport"):
        ClusterConfig(worker_transport="carrier_pigeon")  # type: ignore[arg-type]
