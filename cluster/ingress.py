"""The OpenAI-compatible HTTP edge: a Ray Serve FastAPI deployment in front of the controller.

Everything textual happens here, never in the controller: validation, tokenization (chat
template for chat), the 422 circuit breaker (`Frontend.prepare`, before any actor call),
incremental detokenization and stop strings (`TextStream`). The controller sees token ids
and streams them back as `Delta`s (cluster/controller_client.py: one `submit` per request,
one shared `subscribe` stream per replica); `submit` answers with an `Ack` or raises, so a
full queue (429) or an unrunnable request (400) is known before any response header is sent.

A request whose consumer goes away (client disconnect: Serve cancels the handler, the SSE
generator is closed) is aborted at the controller from a `finally`, which frees its blocks.
`OpenAIServer` is plain Python over a `ControllerClient` (cluster/controller_client.py), so
tests can drive it with a fake.
"""

# No `from __future__ import annotations` here: Serve rebuilds the route methods outside
# this module, and FastAPI could then not resolve a string annotation `Request`.
import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster import protocol as p
from cluster.config import TokenflowConfig
from cluster.controller_client import ControllerClient, RayControllerClient
from cluster.frontend import (
    CHAT,
    COMPLETIONS,
    Frontend,
    Prepared,
    TextStream,
    openai_finish_reason,
)
from cluster.metrics import CONTENT_TYPE, render
from controller.core import NoWorkerUpError, QueueFullError
from controller.messages import Delta, FinishReason
from controller.request_metrics import CIRCUIT_BREAKER
from workers.tokenizer import Tokenizer


def error_response(err: p.ProtocolError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(p.error_body(err), status_code=err.status_code, headers=headers)


class OpenAIServer:
    def __init__(self, config: TokenflowConfig, client: ControllerClient) -> None:
        self.config = config
        self.client = client
        self._frontend: Frontend | None = None
        self._lock = asyncio.Lock()

    async def frontend(self) -> Frontend:
        """Tokenizer and model limits, asked of the controller once (its workers know them)."""
        if self._frontend is None:
            async with self._lock:
                if self._frontend is None:
                    # Bounded: while the workers start (or wait for resources) a request
                    # gets 503 with Retry-After, never a hang.
                    info = await asyncio.wait_for(self.client.model_info(),
                                                  self.config.cluster.ready_wait_s)
                    path = Path(info["model_path"])
                    if not path.is_dir():  # another node's preset folder: build ours
                        from workers.presets import resolve_model

                        path = resolve_model(self.config.worker.model)
                    worker = dataclasses.replace(self.config.worker,
                                                 max_model_len=info["max_model_len"])
                    config = self.config.model_copy(update={"worker": worker})
                    self._frontend = Frontend(Tokenizer(path), config, info["vocab_size"])
        return self._frontend

    async def handle(self, url: str, request: Request) -> Response:
        try:
            frontend = await self.frontend()
        except Exception as err:  # the controller is down or restarting
            return self.unavailable(err)
        try:
            prepared = frontend.prepare(url, await request.body())
        except p.ProtocolError as err:
            if err.code == "prompt_too_long":  # the circuit breaker: counted centrally
                self.client.record_rejection(CIRCUIT_BREAKER)
            return error_response(err)
        request_id = p.new_chat_completion_id() if prepared.is_chat else p.new_completion_id()
        try:
            _, deltas = await self.client.submit(prepared.prompt_token_ids, prepared.params,
                                                 request_id, prepared.priority,
                                                 request.headers.get("x-tenant-id", "default"))
        except QueueFullError as err:
            return error_response(p.ProtocolError(429, str(err), code="queue_full"),
                                  {"Retry-After": str(self.config.cluster.retry_after_s)})
        except NoWorkerUpError as err:  # every worker is restarting: come back shortly
            return error_response(p.ProtocolError(503, str(err), code="no_worker_up"),
                                  {"Retry-After": str(self.config.cluster.retry_after_s)})
        except ValueError as err:
            return error_response(p.ProtocolError(400, str(err)))
        except Exception as err:
            return self.unavailable(err)
        if prepared.request.stream:
            events = sse_events(frontend, prepared, request_id, deltas, self.client.abort)
            return StreamingResponse(events, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await self._complete(frontend, prepared, request_id, deltas)

    async def _complete(self, frontend: Frontend, prepared: Prepared, request_id: str,
                        deltas: AsyncIterator[Delta]) -> Response:
        text, reason, error = await collect(frontend, prepared, request_id, deltas,
                                            self.client.abort)
        if error is not None:
            return error_response(p.ProtocolError(503, error),
                                  {"Retry-After": str(self.config.cluster.retry_after_s)})
        return JSONResponse(frontend.response(prepared, request_id, text, reason))

    async def models(self) -> Response:
        frontend = await self.frontend()
        return JSONResponse(p.models_response(frontend.served_names, int(time.time())))

    async def health(self) -> Response:
        """200 only when the controller answers and at least one worker is up; the body has
        each worker's state, or what the service is waiting for."""
        try:
            status = await asyncio.wait_for(self.client.ping(), self.config.cluster.ready_wait_s)
        except Exception as err:
            return self.unavailable(err)
        headers = None if status["ok"] else {
            "Retry-After": str(self.config.cluster.retry_after_s)}
        return JSONResponse(status, status_code=200 if status["ok"] else 503, headers=headers)

    async def metrics(self) -> Response:
        """Prometheus text from the controller's one snapshot: identical on every replica."""
        try:
            snap = await asyncio.wait_for(self.client.metrics_snapshot(),
                                          self.config.cluster.ready_wait_s)
        except Exception as err:
            return self.unavailable(err)
        body = render(snap, self.config.metrics, self.config.calibration.itl_slo_ms / 1e3)
        return Response(body, media_type=CONTENT_TYPE)

    def unavailable(self, err: Exception) -> JSONResponse:
        if isinstance(err, TimeoutError):
            message = (f"the service is not ready (no answer within "
                       f"{self.config.cluster.ready_wait_s:g}s): see /health")
        else:
            message = f"the controller is unavailable: {type(err).__name__}: {err}"
        return error_response(p.ProtocolError(503, message[:500], code="unavailable"),
                              {"Retry-After": str(self.config.cluster.retry_after_s)})


async def collect(frontend: Frontend, prepared: Prepared, request_id: str,
                  deltas: AsyncIterator[Delta], abort: Callable[[str], None]
                  ) -> tuple[TextStream, FinishReason | None, str | None]:
    """Run one request to its end: (text, finish reason, error). Used for non-streaming
    answers and by the remote batch runner."""
    text = frontend.text_stream(prepared)
    reason: FinishReason | None = None
    try:
        async for delta in deltas:
            if delta.error:
                reason = FinishReason.ABORT
                return text, reason, delta.error
            _, reason = text.advance(delta.token_ids, delta.finish_reason,
                                     lambda: abort(request_id))
            if reason is not None:
                break
    finally:
        if reason is None:  # cancelled (the client went away) or the stream broke
            abort(request_id)
    return text, reason, None


async def sse_events(frontend: Frontend, prepared: Prepared, request_id: str,
                     deltas: AsyncIterator[Delta],
                     abort: Callable[[str], None]) -> AsyncIterator[bytes]:
    """Server-sent events of one request, ending in `data: [DONE]`. Chunks carry text
    deltas (and the delta's token ids with `return_token_ids`); the last one carries the
    finish reason; with `stream_options.include_usage` a usage chunk comes before [DONE]."""
    req = prepared.request
    model, created, chat = frontend.config.worker.model_name, int(time.time()), prepared.is_chat
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return_ids = bool(req.return_token_ids)
    prompt_ids: list[int] | None = prepared.prompt_token_ids if return_ids else None
    text = frontend.text_stream(prepared)
    reason: FinishReason | None = None
    try:
        if chat:  # OpenAI's first chat chunk announces the role
            yield p.sse(p.chat_completion_chunk(request_id, model, created, first=True,
                                                prompt_token_ids=prompt_ids,
                                                include_usage=include_usage))
            prompt_ids = None
        async for delta in deltas:
            if delta.error:
                reason = FinishReason.ABORT
                yield p.sse(p.error_body(p.ProtocolError(503, delta.error)))
                break
            piece, reason = text.advance(delta.token_ids, delta.finish_reason,
                                         lambda: abort(request_id))
            if reason is not None:
                reason = openai_finish_reason(text, reason)
            ids = delta.token_ids if return_ids else None
            if piece or ids or reason is not None:
                if chat:
                    chunk = p.chat_completion_chunk(request_id, model, created, piece or None,
                                                    reason, token_ids=ids,
                                                    include_usage=include_usage)
                else:
                    chunk = p.completion_chunk(request_id, model, created, piece, reason,
                                               token_ids=ids, prompt_token_ids=prompt_ids,
                                               include_usage=include_usage)
                    prompt_ids = None
                yield p.sse(chunk)
            if reason is not None:
                break
        if include_usage:
            yield p.sse(p.usage_chunk(request_id, model, created,
                                      len(prepared.prompt_token_ids), len(text.token_ids),
                                      chat=chat))
        yield p.SSE_DONE
    finally:
        if reason is None:  # the client went away mid-stream (or the stream broke)
            abort(request_id)


app = FastAPI(title="tokenflow", docs_url=None, redoc_url=None)


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    # Unknown paths and methods answer in OpenAI's error body too.
    err = p.ProtocolError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")
    return error_response(err)


@serve.deployment(name="tokenflow-ingress")
@serve.ingress(app)
class TokenflowIngress:
    def __init__(self, config: dict[str, Any] | None = None) -> None:
        from controller.actor import get_or_create_controller

        self.config = TokenflowConfig(**(config or {}))
        handle = get_or_create_controller(self.config.controller_options())
        self.server = OpenAIServer(self.config, RayControllerClient(handle))
        self.replica_id = serve.get_replica_context().replica_id.unique_id

    @app.post(COMPLETIONS)
    async def completions(self, request: Request) -> Response:
        return await self.server.handle(COMPLETIONS, request)

    @app.post(CHAT)
    async def chat_completions(self, request: Request) -> Response:
        return await self.server.handle(CHAT, request)

    @app.get("/v1/models")
    async def models(self) -> Response:
        return await self.server.models()

    @app.get("/health")
    async def health(self) -> Response:
        return await self.server.health()

    @app.get("/metrics")
    async def metrics(self) -> Response:
        response = await self.server.metrics()
        # Which replica answered: any replica's scrape must read the same.
        response.headers["X-Tokenflow-Replica"] = self.replica_id
        return response


def build_app(args: dict[str, Any] | None = None) -> serve.Application:
    """Application builder for the `args:` of deploy/serve.yaml (or `serve run
    cluster.ingress:build_app`): `TokenflowConfig`'s sections, each a mapping of its fields.
    An unknown section or field fails here, before anything starts, naming it."""
    config = TokenflowConfig(**(args or {}))
    return TokenflowIngress.options(
        num_replicas=config.cluster.ingress_num_replicas,
        max_ongoing_requests=config.cluster.ingress_max_ongoing_requests,
        ray_actor_options={"num_cpus": config.cluster.ingress_num_cpus},
    ).bind(config.model_dump())
