"""How the edge talks to the controller actor: `ControllerClient` and its Ray form.

`RayControllerClient` speaks the controller's one streaming protocol: one long-lived
`subscribe` stream per process carries the `Delta`s of all its requests, a list per
controller step, and each request is one plain `submit` call answered by an `Ack`. A Ray
streaming item costs an object plus a report RPC on both ends; per request and token that
ate as much CPU as the model on a small node (benchmarks/cluster_bench.py).
The HTTP ingress, the remote batch runner, the benchmarks and the integration tests all use
it. It unwraps Ray's task errors, so callers catch `QueueFullError` / `ValueError` as such.

When the `subscribe` stream breaks (the controller died and Ray restarts it), the client
subscribes again with backoff and calls `resume` with how many tokens of each open request
it has delivered: the restarted controller sends the rest (from its journal, then new
ones), so a consumer sees a pause, not an error, a gap or a duplicate. A request the
controller cannot resume (admitted too shortly before the crash to be journaled, or no
journal at all) is submitted again with that count: its seed comes from its id, so it
runs to the same tokens, and those the consumer has are not sent twice.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterable
from typing import Any, Protocol

from cluster.config import EdgeConfig
from controller.backoff import Backoff
from controller.messages import Ack, Delta, FinishReason, SamplingParams
from controller.request_metrics import MetricsSnapshot

logger = logging.getLogger(__name__)


class ControllerClient(Protocol):
    async def model_info(self) -> dict[str, Any]: ...

    async def ping(self) -> dict[str, Any]: ...

    async def submit(self, prompt_token_ids: list[int], params: SamplingParams,
                     request_id: str, priority: int, tenant: str
                     ) -> tuple[Ack, AsyncIterator[Delta]]:
        """Admit a request: its `Ack` and its deltas, the last one finished. Raises
        QueueFullError or ValueError when the controller refuses it."""
        ...

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> None:
        """End a request where it runs; STOP: a stop string matched at the edge."""
        ...

    async def metrics_snapshot(self) -> MetricsSnapshot: ...

    def record_rejection(self, kind: str) -> None: ...


def _unwrap(err: Exception) -> Exception:
    cause = getattr(err, "cause", None)
    return cause if isinstance(cause, Exception) else err


class RayControllerClient:
    def __init__(self, handle: Any, edge: EdgeConfig | None = None) -> None:
        """`edge`: the `edge:` section, whose reconnect_* settings this client follows."""
        edge = edge or EdgeConfig()
        self.handle = handle
        self._queues: dict[str, asyncio.Queue[Delta]] = {}  # unfinished request -> deltas
        self._num_delivered: dict[str, int] = {}  # unfinished request -> tokens queued
        # Requests whose `submit` was answered: only these are resumed after a broken
        # stream (one still being submitted is sent again by its own `submit`).
        self._acked: set[str] = set()
        # Each acked request as submitted: one the restarted controller cannot resume (not
        # journaled yet, or no journal) is submitted again from it.
        self._submitted: dict[str, tuple[list[int], SamplingParams, int, str]] = {}
        # Acked requests this edge has aborted (a stop string, a consumer gone), until their
        # finished delta arrives or the stream breaks: a delta of theirs still in flight,
        # which finds no queue, must not abort them again. Ray runs an async actor's calls
        # out of order, so that second, plain abort could overtake a stop string's and count
        # the request as aborted, not stopped.
        self._aborted: set[str] = set()
        self._subscriber = ""
        self._pump_task: asyncio.Task[None] | None = None
        # Built here so that a bad value fails the constructor, not a later pump. One pump
        # runs at a time (a new one only once the last is done): it may own this state.
        self.reconnect_backoff = Backoff(edge.reconnect_backoff_s, edge.reconnect_backoff_max_s)
        self.reconnect_timeout_s = edge.reconnect_timeout_s  # then every open request fails
        self.num_reconnects = 0
        self.num_submitted_again = 0  # after a restart: not journaled, run again

    async def model_info(self) -> dict[str, Any]:
        return await self.handle.model_info.remote()

    async def ping(self) -> dict[str, Any]:
        return await self.handle.ping.remote()

    async def metrics_snapshot(self) -> MetricsSnapshot:
        return await self.handle.metrics_snapshot.remote()

    def record_rejection(self, kind: str) -> None:
        # Fire and forget: counting must never delay or fail the refusal itself.
        contextvars.Context().run(self.handle.record_rejection.remote, kind)

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> None:
        # Fire and forget: this runs in `finally` blocks of cancelled tasks, which must not
        # await. Submitted from a fresh context: in the cancelled request's own context Ray
        # would count the call as a child of the cancelled task and cancel it too.
        if request_id in self._acked:  # a finished (forgotten) one ends nothing more here
            self._aborted.add(request_id)
        contextvars.Context().run(self.handle.abort.remote, request_id, reason)

    async def submit(self, prompt_token_ids: list[int], params: SamplingParams,
                     request_id: str, priority: int, tenant: str
                     ) -> tuple[Ack, AsyncIterator[Delta]]:
        from ray.exceptions import RayActorError, RayTaskError

        # Subscriber choice and registration are one synchronous step: the pump decides to
        # end and fails its queues without awaiting in between, and its task is done as
        # soon as it returns, so this queue is either failed by that pump's `finally` or
        # read by a live pump (a new one when the last one had ended).
        subscriber = self._subscribe()
        pump = self._pump_task
        # Registered before `submit`: the first deltas may overtake its reply.
        queue = self._queues[request_id] = asyncio.Queue()
        backoff = Backoff(self.reconnect_backoff.first_s, self.reconnect_backoff.max_s)
        give_up_at = time.monotonic() + self.reconnect_timeout_s
        try:
            while True:
                try:
                    ack = await self.handle.submit.remote(prompt_token_ids, params,
                                                          request_id, priority, tenant,
                                                          subscriber)
                    break
                except RayActorError:
                    # The controller died or restarts with this call in flight: it may or
                    # may not have admitted the request. `submit` is idempotent by id (a
                    # journaled one is resumed from its first token), so send it again.
                    if time.monotonic() > give_up_at:
                        raise
                    await asyncio.sleep(backoff.next_s())  # a retry interval
                    self._start_over(request_id, queue, pump)
        except BaseException as err:
            self._queues.pop(request_id, None)
            if isinstance(err, RayTaskError):  # refused: nothing was admitted
                raise _unwrap(err) from None
            # Cancelled (the client went away) or lost on the way: the controller may have
            # admitted it already, and nobody would read its deltas.
            self.abort(request_id)
            raise
        if pump is not None and pump.done():
            # The stream this request was sent to ended while `submit` was in flight: the
            # pump's `finally` failed its queue, and the controller would park its deltas
            # for a subscriber nobody reads until max_tokens. Sent after the ack, so the
            # abort cannot overtake the admission (a no-op if it had already finished).
            self.abort(request_id)
        self._acked.add(request_id)
        self._submitted[request_id] = (prompt_token_ids, params, priority, tenant)
        return ack, self._deltas(request_id, queue)

    def _start_over(self, request_id: str, queue: asyncio.Queue[Delta],
                    pump: asyncio.Task[None] | None) -> None:
        """Before a cut `submit` is sent again: the controller that answers it sends the
        request's tokens from the first one (resumed from its journal, or run anew when it
        has none), so what the lost one streamed before it died is dropped. Nobody has
        read it: the consumer gets the deltas only once `submit` returns. Left as it is
        once the stream it was sent to has ended (its queue holds that failure)."""
        if pump is None or pump.done() or pump is not self._pump_task:
            return
        while not queue.empty():
            queue.get_nowait()
        self._queues[request_id] = queue  # again, if a finished delta had popped it
        self._num_delivered.pop(request_id, None)

    async def _deltas(self, request_id: str, queue: asyncio.Queue[Delta]
                      ) -> AsyncIterator[Delta]:
        try:
            while True:
                delta = await queue.get()
                yield delta
                if delta.is_finished:
                    return
        finally:
            self._queues.pop(request_id, None)  # the consumer went away: drop the rest
            self._forget(request_id)

    def _forget(self, request_id: str) -> None:
        self._num_delivered.pop(request_id, None)
        self._acked.discard(request_id)
        self._submitted.pop(request_id, None)

    def _subscribe(self) -> str:
        if self._pump_task is None or self._pump_task.done():
            self._subscriber = f"sub-{uuid.uuid4().hex}"
            # A fresh context: no request's cancellation may reach the shared stream.
            self._pump_task = asyncio.get_running_loop().create_task(
                self._pump(self._subscriber), context=contextvars.Context())
        return self._subscriber

    async def _pump(self, subscriber: str) -> None:
        to_resume: list[str] = []  # requests open when the stream broke
        backoff = self.reconnect_backoff
        backoff.reset()
        broken_since = 0.0
        try:
            while True:
                try:
                    if to_resume:
                        # Resume first (it creates the subscriber and parks the deltas there),
                        # then subscribe: a failed resume must not leave a second stream
                        # reading the same subscriber.
                        await self._resume(subscriber, to_resume)
                        to_resume = []
                    refs = self.handle.subscribe.options(num_returns="streaming").remote(
                        subscriber)
                    async for ref in refs:
                        self._dispatch(await ref)
                        backoff.reset()
                        broken_since = 0.0
                    return  # the controller closed the stream
                except Exception as err:
                    # To resume: the requests open when the stream first broke (or, after a
                    # failed resume, those of them still open); a request registered since
                    # was submitted for this subscriber anew, not resumed, and one whose
                    # submit is unanswered is sent again by that submit.
                    to_resume = [rid for rid in to_resume or self._queues
                                 if rid in self._queues and rid in self._acked]
                    # An aborted request's finished delta may have died with the stream (a
                    # restarted controller has no stream for it): its id is let go here,
                    # long after its abort reached the controller.
                    self._aborted.clear()
                    # The end decision counts every open request, those registered during
                    # the backoff or a failed resume too: ending now would fail them
                    # although they are running.
                    if not self._queues:
                        return  # nothing open: the next request subscribes again
                    now = time.monotonic()
                    broken_since = broken_since or now
                    if now - broken_since > self.reconnect_timeout_s:
                        logger.exception("the controller's delta stream broke for good")
                        return
                    logger.warning("the controller's delta stream broke (%s: %s), %d requests "
                                   "open: subscribing again", type(err).__name__, err,
                                   len(self._queues))
                    await asyncio.sleep(backoff.next_s())  # a retry interval
        finally:
            # Every open request fails; the next request subscribes again. No await from the
            # end decision to here: `submit` cannot register a queue in between.
            queues, self._queues = self._queues, {}
            self._num_delivered.clear()
            self._acked.clear()
            self._submitted.clear()
            self._aborted.clear()
            for request_id, queue in queues.items():
                queue.put_nowait(Delta.failed(request_id, "the controller's delta stream ended"))

    async def _resume(self, subscriber: str, request_ids: list[str]) -> None:
        """Each open request from the token its consumer is at: resumed from the journal,
        else submitted again (its seed comes from its id: the same tokens)."""
        from ray.exceptions import RayActorError

        positions = {rid: self._num_delivered.get(rid, 0) for rid in request_ids}
        resumed = await self.handle.resume.remote(subscriber, positions)
        num_again = 0
        for request_id, is_resumed in resumed.items():
            submitted = self._submitted.get(request_id)
            if is_resumed or submitted is None:
                continue
            prompt_token_ids, params, priority, tenant = submitted
            try:
                await self.handle.submit.remote(prompt_token_ids, params, request_id, priority,
                                                tenant, subscriber, positions[request_id])
                num_again += 1
            except RayActorError:
                raise  # died again: the pump resumes again
            except Exception as err:  # refused (the queues are full): this one ends
                queue = self._queues.pop(request_id, None)
                self._forget(request_id)
                if queue is not None:
                    queue.put_nowait(Delta.failed(
                        request_id, "the controller restarted and could not run this "
                        f"request again: {_unwrap(err)}"))
        self.num_reconnects += 1
        self.num_submitted_again += num_again
        logger.warning("resumed %d request streams on the controller (%d submitted again)",
                       len(positions), num_again)

    def _dispatch(self, batch: Iterable[Delta]) -> None:
        for delta in batch:
            # Popped once finished: a consumer that never reads holds nothing here.
            request_id = delta.request_id
            if delta.is_finished:
                queue = self._queues.pop(request_id, None)
                self._forget(request_id)
                self._aborted.discard(request_id)  # not in `_forget`: its consumer leaves first
            else:
                queue = self._queues.get(request_id)
                if queue is not None:
                    self._num_delivered[request_id] = (self._num_delivered.get(request_id, 0)
                                                       + len(delta.token_ids))
            if queue is not None:
                queue.put_nowait(delta)
            elif not delta.is_finished and request_id not in self._aborted:
                # Its consumer is gone without aborting it (a response body that never
                # started): abort, or it would hold its KV blocks until max_tokens.
                self.abort(request_id)


async def run_request(client: ControllerClient, prompt_token_ids: list[int],
                      params: SamplingParams, request_id: str, priority: int = 0,
                      tenant: str = "default") -> tuple[Ack, Delta]:
    """One request to its end (tests, benchmarks): its ack and all its deltas as one."""
    ack, deltas = await client.submit(prompt_token_ids, params, request_id, priority, tenant)
    return ack, Delta.merge([delta async for delta in deltas])
