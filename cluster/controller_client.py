"""How the edge talks to the controller actor: `ControllerClient` and its Ray form.

`RayControllerClient` speaks the controller's one streaming protocol: one long-lived
`subscribe` stream per process carries the `Delta`s of all its requests, a list per
controller step, and each request is one plain `submit` call answered by an `Ack`. A Ray
streaming item costs an object plus a report RPC on both ends; per request and token that
ate as much CPU as the model on a small node (benchmarks/cluster_bench.py).
The HTTP ingress, the remote batch runner, the benchmarks and the integration tests all use
it. It unwraps Ray's task errors, so callers catch `QueueFullError` / `ValueError` as such.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any, Protocol

from controller.messages import Ack, Delta, SamplingParams
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

    def abort(self, request_id: str) -> None: ...

    async def metrics_snapshot(self) -> MetricsSnapshot: ...

    def record_rejection(self, kind: str) -> None: ...


def _unwrap(err: Exception) -> Exception:
    cause = getattr(err, "cause", None)
    return cause if isinstance(cause, Exception) else err


class RayControllerClient:
    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self._queues: dict[str, asyncio.Queue[Delta]] = {}  # unfinished request -> deltas
        self._subscriber = ""
        self._pump_task: asyncio.Task[None] | None = None

    async def model_info(self) -> dict[str, Any]:
        return await self.handle.model_info.remote()

    async def ping(self) -> dict[str, Any]:
        return await self.handle.ping.remote()

    async def metrics_snapshot(self) -> MetricsSnapshot:
        return await self.handle.metrics_snapshot.remote()

    def record_rejection(self, kind: str) -> None:
        # Fire and forget: counting must never delay or fail the refusal itself.
        contextvars.Context().run(self.handle.record_rejection.remote, kind)

    def abort(self, request_id: str) -> None:
        # Fire and forget: this runs in `finally` blocks of cancelled tasks, which must not
        # await. Submitted from a fresh context: in the cancelled request's own context Ray
        # would count the call as a child of the cancelled task and cancel it too.
        contextvars.Context().run(self.handle.abort.remote, request_id)

    async def submit(self, prompt_token_ids: list[int], params: SamplingParams,
                     request_id: str, priority: int, tenant: str
                     ) -> tuple[Ack, AsyncIterator[Delta]]:
        from ray.exceptions import RayTaskError

        subscriber = self._subscribe()
        # Registered before `submit`: the first deltas may overtake its reply.
        queue = self._queues[request_id] = asyncio.Queue()
        try:
            ack = await self.handle.submit.remote(prompt_token_ids, params, request_id,
                                                  priority, tenant, subscriber)
        except BaseException as err:
            self._queues.pop(request_id, None)
            if isinstance(err, RayTaskError):
                raise _unwrap(err) from None
            raise
        return ack, self._deltas(request_id, queue)

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

    def _subscribe(self) -> str:
        if self._pump_task is None or self._pump_task.done():
            self._subscriber = f"sub-{uuid.uuid4().hex}"
            # A fresh context: no request's cancellation may reach the shared stream.
            self._pump_task = asyncio.get_running_loop().create_task(
                self._pump(self._subscriber), context=contextvars.Context())
        return self._subscriber

    async def _pump(self, subscriber: str) -> None:
        try:
            refs = self.handle.subscribe.options(num_returns="streaming").remote(subscriber)
            async for ref in refs:
                for delta in await ref:
                    # Popped once finished: a consumer that never reads holds nothing here.
                    queue = (self._queues.pop(delta.request_id, None) if delta.is_finished
                             else self._queues.get(delta.request_id))
                    if queue is not None:  # else its consumer is gone: drop
                        queue.put_nowait(delta)
        except Exception:
            logger.exception("the controller's delta stream broke")
        finally:
            # Every open request fails; the next request subscribes again.
            queues, self._queues = self._queues, {}
            for request_id, queue in queues.items():
                queue.put_nowait(Delta.failed(request_id, "the controller's delta stream ended"))


async def run_request(client: ControllerClient, prompt_token_ids: list[int],
                      params: SamplingParams, request_id: str, priority: int = 0,
                      tenant: str = "default") -> tuple[Ack, Delta]:
    """One request to its end (tests, benchmarks): its ack and all its deltas as one."""
    ack, deltas = await client.submit(prompt_token_ids, params, request_id, priority, tenant)
    return ack, Delta.merge([delta async for delta in deltas])
