"""How the edge talks to the controller actor: `ControllerClient` and its two Ray forms.

- `RayControllerClient`: one `generate` streaming call per request (the batch runner).
- `MultiplexedControllerClient`: what the HTTP ingress uses. One long-lived `subscribe`
  stream per process carries the deltas of all its requests, a list per controller step,
  and each request is one plain `submit` call. A Ray streaming item costs an object plus a
  report RPC on both ends; per request and token that ate as much CPU as the model on a
  small node (benchmarks/cluster_bench.py).
Both unwrap Ray's task errors, so callers catch `QueueFullError` / `ValueError` as such,
and both yield the admission acknowledgement as the first item.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any, Protocol

from controller.messages import SamplingParams

logger = logging.getLogger(__name__)


class ControllerClient(Protocol):
    async def model_info(self) -> dict[str, Any]: ...

    async def ping(self) -> dict[str, Any]: ...

    def stream(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str,
               priority: int, tenant: str) -> AsyncIterator[dict[str, Any]]: ...

    def abort(self, request_id: str) -> None: ...


def _unwrap(err: Exception) -> Exception:
    cause = getattr(err, "cause", None)
    return cause if isinstance(cause, Exception) else err


class RayControllerClient:
    def __init__(self, handle: Any) -> None:
        self.handle = handle

    async def model_info(self) -> dict[str, Any]:
        return await self.handle.model_info.remote()

    async def ping(self) -> dict[str, Any]:
        return await self.handle.ping.remote()

    async def stream(self, prompt_token_ids: list[int], params: SamplingParams,
                     request_id: str, priority: int, tenant: str
                     ) -> AsyncIterator[dict[str, Any]]:
        from ray.exceptions import RayTaskError

        refs = self.handle.generate.options(num_returns="streaming").remote(
            prompt_token_ids, params, request_id, priority, tenant)
        try:
            async for ref in refs:
                yield await ref
        except RayTaskError as err:
            raise _unwrap(err) from None

    def abort(self, request_id: str) -> None:
        # Fire and forget: this runs in `finally` blocks of cancelled tasks, which must not
        # await. Submitted from a fresh context: in the cancelled request's own context Ray
        # would count the call as a child of the cancelled task and cancel it too.
        contextvars.Context().run(self.handle.abort.remote, request_id)


class MultiplexedControllerClient(RayControllerClient):
    def __init__(self, handle: Any) -> None:
        super().__init__(handle)
        self._queues: dict[str, asyncio.Queue[dict[str, Any]]] = {}
        self._subscriber = ""
        self._pump_task: asyncio.Task[None] | None = None

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
                    queue = self._queues.get(delta["request_id"])
                    if queue is not None:  # else its client is gone: drop
                        queue.put_nowait(delta)
        except Exception:
            logger.exception("the controller's delta stream broke")
        finally:
            # Every open request fails; the next request subscribes again.
            for request_id, queue in self._queues.items():
                queue.put_nowait({"request_id": request_id, "token_ids": [],
                                  "finish_reason": "abort",
                                  "error": "the controller's delta stream ended"})

    async def stream(self, prompt_token_ids: list[int], params: SamplingParams,
                     request_id: str, priority: int, tenant: str
                     ) -> AsyncIterator[dict[str, Any]]:
        from ray.exceptions import RayTaskError

        subscriber = self._subscribe()
        # Registered before `submit`: the first deltas may overtake its reply.
        queue = self._queues[request_id] = asyncio.Queue()
        try:
            try:
                yield await self.handle.submit.remote(prompt_token_ids, params, request_id,
                                                      priority, tenant, subscriber)
            except RayTaskError as err:
                raise _unwrap(err) from None
            while True:
                delta = await queue.get()
                yield delta
                if delta["finish_reason"] is not None:
                    return
        finally:
            self._queues.pop(request_id, None)
