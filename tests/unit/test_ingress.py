"""The HTTP edge over a fake controller client: status codes, SSE shape, aborts.

No Ray: `OpenAIServer` is mounted on a plain FastAPI app the way the Serve deployment
mounts it. The builtin tiny tokenizer maps byte b to token id 3 + b.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from cluster.config import TokenflowConfig
from cluster.frontend import CHAT, COMPLETIONS
from cluster.ingress import OpenAIServer, add_routes, sse_events
from controller.core import QueueFullError
from controller.messages import Ack, Delta, FinishReason, SamplingParams
from workers.presets import resolve_model


def ids(text: str) -> list[int]:
    return [3 + b for b in text.encode()]


class FakeClient:
    def __init__(self, tokens: list[int], refuse: Exception | None = None,
                 error: str | None = None) -> None:
        self.tokens, self.refuse, self.error = tokens, refuse, error
        self.aborted: list[str] = []
        self.started: list[str] = []

    async def model_info(self) -> dict[str, Any]:
        return {"vocab_size": 512, "max_model_len": 1024,
                "model_path": str(resolve_model("builtin:tiny"))}

    async def ping(self) -> dict[str, Any]:
        return {"ok": True, "dead_loops": []}

    async def submit(self, prompt_token_ids: list[int], params: SamplingParams,
                     request_id: str, priority: int, tenant: str
                     ) -> tuple[Ack, AsyncIterator[Delta]]:
        if self.refuse is not None:
            raise self.refuse
        self.started.append(request_id)
        return Ack(request_id, 0, len(prompt_token_ids)), self._deltas(
            request_id, len(prompt_token_ids), params)

    async def _deltas(self, request_id: str, num_prompt_tokens: int,
                      params: SamplingParams) -> AsyncIterator[Delta]:
        if self.error is not None:
            yield Delta(request_id, 0, [], FinishReason.ABORT, num_prompt_tokens,
                        error=self.error)
            return
        tokens = self.tokens[:params.max_tokens]
        for i, token in enumerate(tokens):
            last = i == len(tokens) - 1
            yield Delta(request_id, 0, [token], FinishReason.LENGTH if last else None,
                        num_prompt_tokens, i + 1)

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def make_client(fake: FakeClient, **config: Any) -> TestClient:
    server = OpenAIServer(TokenflowConfig(protections={"max_prefill_tokens": 64}, **config),
                          fake)
    return TestClient(add_routes(FastAPI(), server))


BODY = {"model": "builtin:tiny", "prompt": "hi", "max_tokens": 5}


def sse_data(text: str) -> list[str]:
    return [line[len("data: "):] for line in text.split("\n\n") if line.startswith("data: ")]


def test_full_queue_is_429_with_retry_after() -> None:
    client = make_client(FakeClient([], refuse=QueueFullError("all queues full")),
                         cluster={"retry_after_s": 7})
    resp = client.post(COMPLETIONS, json=BODY)
    assert resp.status_code == 429
    assert resp.headers["retry-after"] == "7"
    assert resp.json()["error"]["type"] == "rate_limit_error"


def test_controller_refusal_is_400_and_failure_is_503() -> None:
    resp = make_client(FakeClient([], refuse=ValueError("too big"))).post(COMPLETIONS,
                                                                           json=BODY)
    assert resp.status_code == 400 and resp.json()["error"]["message"] == "too big"
    resp = make_client(FakeClient([], error="worker 0 failed")).post(COMPLETIONS, json=BODY)
    assert resp.status_code == 503 and "worker 0 failed" in resp.json()["error"]["message"]


def test_over_cap_prompt_is_422_without_a_controller_call() -> None:
    fake = FakeClient(ids("x"))
    resp = make_client(fake).post(COMPLETIONS, json={**BODY, "prompt": "y" * 200})
    assert resp.status_code == 422 and resp.json()["error"]["code"] == "prompt_too_long"
    assert fake.started == []


def test_stream_with_usage_ends_in_done() -> None:
    fake = FakeClient(ids("hello"))
    resp = make_client(fake).post(COMPLETIONS, json={
        **BODY, "stream": True, "stream_options": {"include_usage": True},
        "return_token_ids": True})
    assert resp.headers["content-type"].startswith("text/event-stream")
    data = sse_data(resp.text)
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == "hello"
    assert [t for c in chunks if c["choices"] for t in c["choices"][0]["token_ids"]] == \
        ids("hello")
    assert chunks[-1]["usage"] == {"prompt_tokens": 2, "completion_tokens": 5,
                                   "total_tokens": 7}
    assert fake.aborted == []


def test_chat_stream_opens_with_the_role() -> None:
    resp = make_client(FakeClient(ids("ok!"))).post(CHAT, json={
        "model": "builtin:tiny", "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3, "stream": True})
    chunks = [json.loads(d) for d in sse_data(resp.text)[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "ok!"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_aborts_the_request(stream: bool) -> None:
    fake = FakeClient(ids("hello world"))
    resp = make_client(fake).post(COMPLETIONS, json={**BODY, "max_tokens": 11,
                                                     "stop": ["lo w"], "stream": stream})
    if stream:
        chunks = [json.loads(d) for d in sse_data(resp.text)[:-1]]
        text = "".join(c["choices"][0]["text"] for c in chunks)
        reason = chunks[-1]["choices"][0]["finish_reason"]
    else:
        text, reason = resp.json()["choices"][0]["text"], resp.json()["choices"][0][
            "finish_reason"]
    assert (text, reason) == ("hel", "stop")
    assert len(fake.aborted) == 1


def test_consumer_leaving_mid_stream_aborts() -> None:
    async def main() -> list[str]:
        fake = FakeClient(ids("a long answer"))
        server = OpenAIServer(TokenflowConfig(), fake)
        frontend = await server.frontend()
        prepared = frontend.prepare(COMPLETIONS, {**BODY, "max_tokens": 13, "stream": True})
        _, deltas = await fake.submit(prepared.prompt_token_ids, prepared.params, "cmpl-x", 0,
                                      "t")
        events = sse_events(frontend, prepared, "cmpl-x", deltas, fake.abort)
        await anext(events)
        await events.aclose()  # what Starlette does when the client disconnects
        return fake.aborted

    assert asyncio.run(main()) == ["cmpl-x"]


def test_controller_down_is_503_with_an_error_body() -> None:
    class DeadClient(FakeClient):
        async def ping(self) -> dict[str, Any]:
            raise ConnectionError("actor died")

    fake = DeadClient([], refuse=ConnectionError("actor died"))
    client = make_client(fake)
    resp = client.post(COMPLETIONS, json=BODY)
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "unavailable"
    assert "retry-after" in resp.headers


class StartingClient(FakeClient):
    """A controller whose workers wait for resources: model_info never answers."""

    def __init__(self) -> None:
        super().__init__([])
        self.never = asyncio.Event()

    async def model_info(self) -> dict[str, Any]:
        await self.never.wait()
        raise AssertionError("unreachable")

    async def ping(self) -> dict[str, Any]:
        return {"ok": False, "status": "starting", "num_workers_up": 0, "workers": [],
                "reason": "1 worker actor(s) not ready; each needs {'CPU': 64.0}"}


def test_requests_and_health_get_503_with_retry_after_while_workers_wait() -> None:
    client = make_client(StartingClient(), cluster={"ready_wait_s": 0.05, "retry_after_s": 3})
    resp = client.post(COMPLETIONS, json=BODY)  # answers instead of hanging
    assert resp.status_code == 503 and resp.headers["retry-after"] == "3"
    assert "not ready" in resp.json()["error"]["message"]
    health = client.get("/health")
    assert health.status_code == 503 and health.headers["retry-after"] == "3"
    assert "CPU" in health.json()["reason"]  # names the missing resource


def test_health_is_200_only_with_a_worker_up() -> None:
    class Up(FakeClient):
        async def ping(self) -> dict[str, Any]:
            return {"ok": True, "status": "ok", "num_workers_up": 1,
                    "workers": [{"worker": 0, "up": True}]}

    health = make_client(Up([])).get("/health")
    assert health.status_code == 200 and health.json()["workers"][0]["up"]
