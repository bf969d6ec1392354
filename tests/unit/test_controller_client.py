"""`RayControllerClient`'s shared subscription against a scripted controller handle: the
test decides when each call answers and when each `subscribe` stream breaks, so the
interleavings of a request's `submit` with the pump's end decision are played out exactly
(no sleeps: every step waits for the call it needs to have happened)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

from cluster.config import EdgeConfig
from cluster.controller_client import RayControllerClient
from controller.messages import Ack, Delta, FinishReason, SamplingParams

PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
END = object()  # a stream item: the controller closes the stream


class Stream:
    """One `subscribe` stream: Ray's streaming generator of refs, fed by the test."""

    def __init__(self, subscriber: str) -> None:
        self.subscriber = subscriber
        self._items: asyncio.Queue[Any] = asyncio.Queue()

    def push(self, batch: list[Delta]) -> None:
        self._items.put_nowait(batch)

    def fail(self, err: Exception) -> None:
        self._items.put_nowait(err)

    def end(self) -> None:
        self._items.put_nowait(END)

    def __aiter__(self) -> AsyncIterator[Awaitable[list[Delta]]]:
        return self._refs()

    async def _refs(self) -> AsyncIterator[Awaitable[list[Delta]]]:
        while True:
            item = await self._items.get()
            if item is END:
                return
            if isinstance(item, Exception):
                raise item
            ref: asyncio.Future[list[Delta]] = asyncio.get_running_loop().create_future()
            ref.set_result(item)
            yield ref


class _Method:
    def __init__(self, fn: Callable[..., Any]) -> None:
        self._fn = fn

    def options(self, **_: Any) -> _Method:
        return self

    def remote(self, *args: Any) -> Any:
        return self._fn(*args)


class ScriptedHandle:
    """The controller actor's handle; every call is recorded, `submit` and `resume` wait for
    the test where it says so."""

    def __init__(self) -> None:
        self.streams: asyncio.Queue[Stream] = asyncio.Queue()
        self.request_to_subscriber: dict[str, str] = {}
        self.submit_gates: dict[str, asyncio.Event] = {}
        self.submit_called: dict[str, asyncio.Event] = {}
        self.resume_calls: list[dict[str, int]] = []
        self.resume_called = asyncio.Event()
        self.resume_gate: asyncio.Event | None = None
        self.resume_error: Exception | None = None
        self.aborted: list[str] = []
        self.abort_reasons: list[FinishReason] = []
        self.abort_called = asyncio.Event()

    def __getattr__(self, name: str) -> _Method:
        return _Method({"submit": self._submit, "subscribe": self._subscribe,
                        "resume": self._resume, "abort": self._abort}[name])

    def _abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> None:
        self.aborted.append(request_id)
        self.abort_reasons.append(reason)
        self.abort_called.set()

    def _submit(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str,
                priority: int, tenant: str, subscriber: str) -> Coroutine[Any, Any, Ack]:
        self.request_to_subscriber[request_id] = subscriber
        self.submit_called.setdefault(request_id, asyncio.Event()).set()
        gate = self.submit_gates.get(request_id)

        async def answer() -> Ack:
            if gate is not None:
                await gate.wait()
            return Ack(request_id, 0, len(prompt_token_ids))

        return answer()

    def _subscribe(self, subscriber: str) -> Stream:
        stream = Stream(subscriber)
        self.streams.put_nowait(stream)
        return stream

    async def _resume(self, subscriber: str, positions: dict[str, int]) -> dict[str, bool]:
        self.resume_calls.append(positions)
        self.resume_called.set()
        if self.resume_gate is not None:
            await self.resume_gate.wait()
        if self.resume_error is not None:
            raise self.resume_error
        return dict.fromkeys(positions, True)  # as a controller whose journal held each

    async def next_stream(self) -> Stream:
        return await asyncio.wait_for(self.streams.get(), 10)


def run(coro: Awaitable[Any]) -> Any:
    async def bounded() -> Any:
        return await asyncio.wait_for(coro, 30)

    return asyncio.run(bounded())


def test_a_request_submitted_during_a_reconnect_keeps_the_stream_alive() -> None:
    """The stream breaks with `a` open; while the pump's resume is in flight, `r` is
    submitted on the same subscriber and `a`'s consumer leaves; the resume fails. `r` is
    open, so the pump subscribes again and `r` gets its tokens: it is neither failed nor
    left on a subscriber nobody reads."""

    async def main() -> None:
        handle = ScriptedHandle()
        client = RayControllerClient(handle, EdgeConfig(reconnect_backoff_s=0.001))
        _, a_deltas = await client.submit([1], PARAMS, "a", 0, "t")
        first = await handle.next_stream()
        first.push([Delta("a", 0, [5], None, 1, 1)])
        assert (await anext(a_deltas)).token_ids == [5]

        handle.resume_gate, handle.resume_error = asyncio.Event(), ConnectionError("restarting")
        first.fail(ConnectionError("the controller actor died"))
        await handle.resume_called.wait()  # the pump awaits its resume of `a`
        _, r_deltas = await client.submit([2], PARAMS, "r", 0, "t")
        assert handle.request_to_subscriber["r"] == first.subscriber
        await a_deltas.aclose()  # `a`'s client went away
        handle.resume_gate.set()  # ...and the resume fails

        r_first = asyncio.ensure_future(anext(r_deltas))
        resubscribed = asyncio.ensure_future(handle.next_stream())
        await asyncio.wait({r_first, resubscribed}, return_when=asyncio.FIRST_COMPLETED)
        assert not r_first.done(), f"r ended before any token: {r_first.result()}"
        second = await resubscribed
        assert second.subscriber == first.subscriber  # where `r`'s deltas are parked
        second.push([Delta("r", 0, [7], FinishReason.LENGTH, 1, 1)])
        delta = await r_first
        assert (delta.token_ids, delta.error) == ([7], None)
        assert handle.resume_calls == [{"a": 1}]  # `r` is not resumed: it was submitted anew
        second.end()

    run(main())


def test_a_submit_in_flight_when_the_stream_ends_for_good_is_aborted() -> None:
    """`r` is registered and its `submit` in flight when the stream breaks past
    reconnect_timeout_s: the pump's end fails `r`'s queue, and the controller admits `r`
    for a subscriber nobody reads any more, so the client aborts it once acked."""

    async def main() -> None:
        handle = ScriptedHandle()
        client = RayControllerClient(handle, EdgeConfig(reconnect_backoff_s=0.001,
                                                        reconnect_timeout_s=0))
        _, a_deltas = await client.submit([1], PARAMS, "a", 0, "t")
        first = await handle.next_stream()
        handle.submit_gates["r"] = asyncio.Event()
        handle.submit_called["r"] = asyncio.Event()
        submitting = asyncio.ensure_future(client.submit([2], PARAMS, "r", 0, "t"))
        await handle.submit_called["r"].wait()

        first.fail(ConnectionError("the controller actor died"))
        second = await handle.next_stream()  # resubscribed after the backoff...
        second.fail(ConnectionError("the controller actor died"))  # ...past the timeout
        a_end = await anext(a_deltas)
        assert a_end.is_finished and a_end.error is not None  # the pump has ended

        handle.submit_gates["r"].set()
        _, r_deltas = await submitting
        r_end = await anext(r_deltas)
        assert r_end.is_finished and r_end.error is not None  # failed, not hanging
        assert handle.aborted == ["r"]

    run(main())


async def _two_reading() -> tuple[ScriptedHandle, RayControllerClient, Stream,
                                  AsyncIterator[Delta], AsyncIterator[Delta]]:
    """A client with requests `a` and `b` open on one stream, each consumer past its first
    token (5 and 9)."""
    handle = ScriptedHandle()
    client = RayControllerClient(handle, EdgeConfig(reconnect_backoff_s=0.001))
    _, a_deltas = await client.submit([1], PARAMS, "a", 0, "t")
    _, b_deltas = await client.submit([2], PARAMS, "b", 0, "t")
    stream = await handle.next_stream()
    stream.push([Delta("a", 0, [5], None, 1, 1), Delta("b", 0, [9], None, 1, 1)])
    assert (await anext(a_deltas)).token_ids == [5]
    assert (await anext(b_deltas)).token_ids == [9]
    return handle, client, stream, a_deltas, b_deltas


def test_a_stop_strings_abort_is_not_followed_by_a_plain_one() -> None:
    """The edge matches a stop string in `a`'s deltas, aborts it as STOP and its consumer
    leaves; a delta of `a` already in flight then finds no queue. No second, plain abort
    goes out: Ray may run it before the first, and `a` would count as aborted, not stopped
    (seen once in CI). `b`, whose consumer left without a word, is still aborted there."""

    async def main() -> None:
        handle, client, stream, a_deltas, b_deltas = await _two_reading()
        client.abort("a", FinishReason.STOP)  # the stop string matched in these tokens
        await a_deltas.aclose()
        await b_deltas.aclose()
        assert handle.aborted == ["a"]
        handle.abort_called.clear()
        stream.push([Delta("a", 0, [6], None, 1, 2), Delta("b", 0, [7], None, 1, 2)])
        await handle.abort_called.wait()  # b's abort: the batch has been dispatched
        assert list(zip(handle.aborted, handle.abort_reasons, strict=True)) == [
            ("a", FinishReason.STOP), ("b", FinishReason.ABORT)]
        stream.push([Delta("a", 0, [], FinishReason.STOP, 1, 2),
                     Delta("b", 0, [], FinishReason.ABORT, 1, 2)])
        stream.push([Delta("c", 0, [8], None, 1, 1)])  # unknown here: aborted, once
        handle.abort_called.clear()
        await handle.abort_called.wait()
        assert handle.aborted == ["a", "b", "c"]
        assert not client._aborted  # each finished delta let its request go
        stream.end()

    run(main())


def test_an_aborted_id_is_let_go_when_its_finished_delta_dies_with_the_stream() -> None:
    """`a` is aborted as STOP and its consumer leaves; the stream breaks before `a`'s
    finished delta comes (a restarted controller sends none). The client keeps no id of `a`
    after the break, nor any once the stream ends for good."""

    async def main() -> None:
        handle, client, first, a_deltas, b_deltas = await _two_reading()
        client.abort("a", FinishReason.STOP)  # a stop string matched in `a`'s tokens
        await a_deltas.aclose()
        assert client._aborted == {"a"}
        first.fail(ConnectionError("the controller actor died"))
        second = await handle.next_stream()  # `b` is open: resumed, subscribed again
        assert handle.resume_calls == [{"b": 1}] and not client._aborted
        client.abort("b", FinishReason.STOP)
        assert client._aborted == {"b"}
        second.end()  # the controller closes the stream: `b` fails, nothing is kept
        b_end = await anext(b_deltas)
        assert b_end.is_finished and b_end.error is not None
        assert not client._aborted

    run(main())
