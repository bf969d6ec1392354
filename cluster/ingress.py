"""The OpenAI-compatible HTTP edge: a Ray Serve FastAPI deployment in front of the controller.

Everything textual happens here, never in the controller: validation, tokenization (chat
template for chat), the 422 circuit breaker (`Frontend.prepare`, before any actor call),
incremental detokenization and stop strings (`TextStream`). The controller sees token ids
and streams them back as `Delta`s (cluster/controller_client.py: one `submit` per request,
one shared `subscribe` stream per replica); `submit` answers with an `Ack` or raises, so a
full queue (429) or an unrunnable request (400) is known before any response header is sent.

The edge defends itself before anything reaches the controller: an API key when keys are
configured (cluster/auth.py: the key names the tenant and bounds `priority`), a body-size
limit decided from Content-Length before the body is read (413), and all parsing, chat
templating, tokenizing and long detokenizations on a thread pool, so that one huge or
hostile request never stalls the event loop the other streams run on. Error bodies say what
went wrong in the client's terms; internal details go to the log under the request id that
the body (and the X-Request-Id header) carries.

A request whose consumer goes away (client disconnect: Serve cancels the handler, the SSE
generator is closed) is aborted at the controller from a `finally`, which frees its blocks.
`OpenAIServer` is plain Python over a `ControllerClient` (cluster/controller_client.py), so
tests can drive it with a fake.
"""

# No `from __future__ import annotations` here: Serve rebuilds the route methods outside
# this module, and FastAPI could then not resolve a string annotation `Request`.
import asyncio
import contextvars
import dataclasses
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster import protocol as p
from cluster.answers import collect, failed_message, sse_events
from cluster.auth import Authenticator
from cluster.choices import Choice, choices_body, collect_choices, sse_choices, submit_choices
from cluster.config import TokenflowConfig, api_keys_from_env
from cluster.controller_client import ControllerClient, RayControllerClient
from cluster.edge_metrics import render_edge
from cluster.frontend import (
    CHAT,
    COMPLETIONS,
    Frontend,
    Prepared,
)
from cluster.metrics import CONTENT_TYPE, render
from cluster.openapi import HEALTH, MODELS, openapi_spec
from controller.messages import Delta
from controller.request_metrics import CIRCUIT_BREAKER
from controller.routing import NoWorkerUpError, QueueFullError
from workers.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
T = TypeVar("T")
METRICS = "/metrics"


def error_response(err: p.ProtocolError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(p.error_body(err), status_code=err.status_code, headers=headers)


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The body, or 413 once it is known to pass `max_bytes`: from Content-Length before
    reading anything, else (chunked) as soon as the bytes read pass it."""
    length = request.headers.get("content-length")
    if length is not None:
        if not length.isdigit():
            raise p.ProtocolError(400, "the Content-Length header must be a number")
        if int(length) > max_bytes:
            raise p.ProtocolError(413, f"the request body has {int(length)} bytes, over the "
                                  f"limit of {max_bytes} bytes", code="body_too_large")
    chunks: list[bytes] = []
    num_bytes = 0
    async for chunk in request.stream():
        num_bytes += len(chunk)
        if num_bytes > max_bytes:
            raise p.ProtocolError(413, f"the request body is over the limit of {max_bytes} "
                                  f"bytes", code="body_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def num_text_threads(config: TokenflowConfig) -> int:
    """Threads of the text pool: the CPUs this process may use (tokenizers release the
    GIL), at least two so that one long tokenization leaves a thread for the others."""
    if config.edge.num_text_threads is not None:
        return config.edge.num_text_threads
    cpus = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
            else os.cpu_count() or 1)
    return max(2, cpus)


class OpenAIServer:
    def __init__(self, config: TokenflowConfig, client: ControllerClient) -> None:
        self.config = config
        self.client = client
        self.auth = Authenticator(config.edge, config.edge.api_keys)
        self.executor = ThreadPoolExecutor(num_text_threads(config),
                                           thread_name_prefix="tokenflow-text")
        self._frontend: Frontend | None = None
        # The one start in flight (model_info, then the tokenizer): every early request
        # awaits it with its own timeout; replaced only once it failed.
        self._start: asyncio.Task[Frontend] | None = None

    async def in_pool(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the text pool: the event loop keeps serving the other requests."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    async def frontend(self) -> Frontend:
        """Tokenizer and model limits, asked of the controller once (its workers know them).
        Each caller waits at most `cluster.ready_wait_s` for the shared start, however many
        wait with it: while the workers start (or wait for resources) a request gets 503
        with Retry-After, never a hang."""
        if self._frontend is not None:
            return self._frontend
        start = self._start
        if start is None or (start.done() and (start.cancelled()
                                               or start.exception() is not None)):
            # A fresh context: the cancellation of the request that happens to start it
            # (its client went away) must not reach the call every other request awaits.
            start = self._start = asyncio.get_running_loop().create_task(
                self._start_frontend(), context=contextvars.Context())
            # Retrieved here: a failure that every waiter timed out on is not an
            # "exception never retrieved" at garbage collection.
            start.add_done_callback(lambda task: task.cancelled() or task.exception())
        # Shielded: a caller's timeout abandons its own wait, never the shared start.
        return await asyncio.wait_for(asyncio.shield(start), self.config.cluster.ready_wait_s)

    async def _start_frontend(self) -> Frontend:
        # Unbounded on purpose: Ray fails a call pending on a controller that died, and
        # one that waits for its workers answers once they are up.
        info = await self.client.model_info()
        frontend = await self.in_pool(self._build_frontend, info)
        self._frontend = frontend
        return frontend

    def _build_frontend(self, info: dict[str, Any]) -> Frontend:
        """On the text pool: reading and parsing the tokenizer's files (and resolving a
        preset) must not stall the streams on the event loop."""
        path = Path(info["model_path"])
        if not path.is_dir():  # another node's preset folder: build ours
            from workers.presets import resolve_model

            path = resolve_model(self.config.worker.model)
        worker = dataclasses.replace(self.config.worker, max_model_len=info["max_model_len"])
        config = self.config.model_copy(update={"worker": worker})
        return Frontend(Tokenizer(path), config, info["vocab_size"], self.executor)

    async def handle(self, url: str, request: Request) -> Response:
        request_id = p.new_chat_completion_id() if url == CHAT else p.new_completion_id()
        try:
            caller = self.auth.authenticate(request.headers)
            raw = await read_body(request, self.config.edge.max_body_bytes)
        except p.ProtocolError as err:
            return self.error(err, request_id)
        try:
            frontend = await self.frontend()
        except Exception as err:  # the controller is down or restarting
            return self.unavailable(err, request_id)
        try:
            prepared = await self.in_pool(frontend.prepare, url, raw)
            caller.check_priority(prepared.priority)
        except p.ProtocolError as err:
            if err.code == "prompt_too_long":  # the circuit breaker: counted centrally
                self.client.record_rejection(CIRCUIT_BREAKER)
            return self.error(err, request_id)
        choices: list[Choice] = []
        try:
            if prepared.request.num_choices > 1:
                choices = await submit_choices(self.client, prepared, request_id, caller.tenant)
            else:
                _, deltas = await self.client.submit(prepared.prompt_token_ids, prepared.params,
                                                     request_id, prepared.priority, caller.tenant)
        except QueueFullError as err:
            return self.error(p.ProtocolError(429, str(err), code="queue_full"), request_id)
        except NoWorkerUpError as err:  # every worker is restarting: come back shortly
            return self.error(p.ProtocolError(503, str(err), code="no_worker_up"), request_id)
        except ValueError as err:  # the controller's refusal, in the client's terms
            return self.error(p.ProtocolError(400, str(err)), request_id)
        except Exception as err:
            return self.unavailable(err, request_id)
        if choices:
            return await self._respond_choices(frontend, prepared, request_id, choices)
        headers = {"X-Request-Id": request_id}
        if prepared.request.stream:
            events = sse_events(frontend, prepared, request_id, deltas, self.client.abort)
            return StreamingResponse(events, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", **headers})
        return await self._complete(frontend, prepared, request_id, deltas)

    async def _respond_choices(self, frontend: Frontend, prepared: Prepared, request_id: str,
                               choices: list[Choice]) -> Response:
        """`n` (or best_of) choices, each its own engine request (cluster/choices.py)."""
        headers = {"X-Request-Id": request_id}
        if prepared.request.stream:
            events = sse_choices(frontend, prepared, request_id, choices, self.client.abort)
            return StreamingResponse(events, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", **headers})
        results, error = await collect_choices(frontend, prepared, choices, self.client.abort)
        if error is not None:
            logger.warning("request %s failed: %s", request_id, error)
            return self.error(p.ProtocolError(503, failed_message(error, request_id),
                                              code="request_failed"), request_id)
        return JSONResponse(choices_body(frontend, prepared, request_id, results),
                            headers=headers)

    async def _complete(self, frontend: Frontend, prepared: Prepared, request_id: str,
                        deltas: AsyncIterator[Delta]) -> Response:
        text, reason, error = await collect(frontend, prepared, request_id, deltas,
                                            self.client.abort)
        if error is not None:
            logger.warning("request %s failed: %s", request_id, error)
            return self.error(p.ProtocolError(503, failed_message(error, request_id),
                                              code="request_failed"), request_id)
        return JSONResponse(frontend.response(prepared, request_id, text, reason),
                            headers={"X-Request-Id": request_id})

    async def models(self, request: Request) -> Response:
        try:
            self.auth.authenticate(request.headers)
        except p.ProtocolError as err:
            return self.error(err)
        try:
            frontend = await self.frontend()
        except Exception as err:
            return self.unavailable(err)
        return JSONResponse(p.models_response(frontend.served_names, int(time.time())))

    async def health(self) -> Response:
        """200 only when the controller answers and at least one worker is up; the body has
        each worker's state, or what the service is waiting for. Open without a key."""
        try:
            status = await asyncio.wait_for(self.client.ping(), self.config.cluster.ready_wait_s)
        except Exception as err:
            return self.unavailable(err)
        headers = None if status["ok"] else {
            "Retry-After": str(self.config.cluster.retry_after_s)}
        return JSONResponse(status, status_code=200 if status["ok"] else 503, headers=headers)

    async def metrics(self, request: Request) -> Response:
        """Prometheus text from the controller's one snapshot: identical on every replica.
        Open unless `edge.metrics_require_api_key` (and keys are configured)."""
        if self.config.edge.metrics_require_api_key and not self.auth.is_open:
            try:
                self.auth.authenticate(request.headers)
            except p.ProtocolError as err:
                return self.error(err)
        try:
            snap = await asyncio.wait_for(self.client.metrics_snapshot(),
                                          self.config.cluster.ready_wait_s)
        except Exception as err:
            return self.unavailable(err)
        body = render(snap, self.config.metrics, self.config.slo)
        body += render_edge(self._frontend).encode()
        return Response(body, media_type=CONTENT_TYPE)

    def error(self, err: p.ProtocolError, request_id: str | None = None) -> JSONResponse:
        """The error body; every 429 and 503 carries Retry-After, a 401 WWW-Authenticate."""
        headers: dict[str, str] = {}
        if err.status_code in (429, 503):
            headers["Retry-After"] = str(self.config.cluster.retry_after_s)
        if err.status_code == 401:
            headers["WWW-Authenticate"] = "Bearer"
        if request_id is not None:
            headers["X-Request-Id"] = request_id
        return error_response(err, headers)

    def unavailable(self, err: Exception, request_id: str | None = None) -> JSONResponse:
        """503 in the client's terms; what failed (actor ids, addresses) goes to the log
        under the request id the body carries."""
        request_id = request_id or f"req-{os.urandom(8).hex()}"
        if isinstance(err, TimeoutError):
            message = (f"the service is not ready (no answer within "
                       f"{self.config.cluster.ready_wait_s:g}s): see /health")
        else:
            logger.warning("request %s: the controller is unavailable: %r", request_id, err)
            message = "the service is restarting or unavailable: retry shortly"
        return self.error(p.ProtocolError(503, f"{message} (request id {request_id})",
                                          code="unavailable"), request_id)


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    # Unknown paths and methods answer in OpenAI's error body too; a 405 keeps its Allow.
    err = p.ProtocolError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")
    return error_response(err, dict(exc.headers or {}))


async def _unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    # The last guard: a bug answers 500 in OpenAI's shape, the details only in the log.
    request_id = f"req-{os.urandom(8).hex()}"
    logger.error("request %s (%s %s) failed", request_id, request.method, request.url.path,
                 exc_info=exc)
    return error_response(p.ProtocolError(500, f"internal error (request id {request_id})"),
                          {"X-Request-Id": request_id})


def configure_app(app: FastAPI) -> FastAPI:
    """What every app serving `OpenAIServer` shares: error bodies and the OpenAPI document
    (cluster/openapi.py; the routes read their own bodies, FastAPI cannot infer it)."""
    app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _unexpected_error)
    app.openapi = openapi_spec  # type: ignore[method-assign]
    return app


def add_routes(app: FastAPI, server: OpenAIServer) -> FastAPI:
    """The routes of `TokenflowIngress` on a plain FastAPI app (tests, no Serve)."""

    async def completions(request: Request) -> Response:
        return await server.handle(COMPLETIONS, request)

    async def chat_completions(request: Request) -> Response:
        return await server.handle(CHAT, request)

    async def models(request: Request) -> Response:
        return await server.models(request)

    async def health() -> Response:
        return await server.health()

    async def metrics(request: Request) -> Response:
        return await server.metrics(request)

    app.post(COMPLETIONS)(completions)
    app.post(CHAT)(chat_completions)
    app.get(MODELS)(models)
    app.get(HEALTH)(health)
    app.get(METRICS)(metrics)
    return configure_app(app)


app = configure_app(FastAPI(title="tokenflow", docs_url=None, redoc_url=None))


@serve.deployment(name="tokenflow-ingress")
@serve.ingress(app)
class TokenflowIngress:
    def __init__(self, config: dict[str, Any] | None = None) -> None:
        from controller.actor import get_or_create_controller

        self.config = TokenflowConfig(**(config or {}))
        # Keys of this replica's environment (a Kubernetes secret) join the configured ones.
        edge = self.config.edge
        edge = edge.model_copy(update={"api_keys": edge.api_keys + api_keys_from_env()})
        self.config = self.config.model_copy(update={"edge": edge})
        handle = get_or_create_controller(self.config.controller_options())
        self.server = OpenAIServer(self.config, RayControllerClient(handle, self.config.edge))
        self.replica_id = serve.get_replica_context().replica_id.unique_id

    @app.post(COMPLETIONS)
    async def completions(self, request: Request) -> Response:
        return await self.server.handle(COMPLETIONS, request)

    @app.post(CHAT)
    async def chat_completions(self, request: Request) -> Response:
        return await self.server.handle(CHAT, request)

    @app.get(MODELS)
    async def models(self, request: Request) -> Response:
        return await self.server.models(request)

    @app.get(HEALTH)
    async def health(self) -> Response:
        return await self.server.health()

    @app.get(METRICS)
    async def metrics(self, request: Request) -> Response:
        response = await self.server.metrics(request)
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
