"""The HTTP edge over a fake controller client: status codes, SSE shape, aborts.

No Ray: `OpenAIServer` is mounted on a plain FastAPI app the way the Serve deployment
mounts it. The builtin tiny tokenizer maps byte b to token id 3 + b.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from cluster.config import TokenflowConfig
from cluster.frontend import CHAT, COMPLETIONS
from cluster.ingress import OpenAIServer, add_routes, sse_events
from controller.messages import Ack, Delta, FinishReason, SamplingParams
from controller.request_metrics import MetricsSnapshot, RequestMetrics
from controller.routing import QueueFullError
from workers.presets import resolve_model


def ids(text: str) -> list[int]:
    return [3 + b for b in text.encode()]


class FakeClient:
    def __init__(self, tokens: list[int], refuse: Exception | None = None,
                 error: str | None = None) -> None:
        self.tokens, self.refuse, self.error = tokens, refuse, error
        self.aborted: list[str] = []
        self.started: list[str] = []
        self.rejections: list[str] = []
        self.tenants: list[str] = []

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
        self.tenants.append(tenant)
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

    async def metrics_snapshot(self) -> MetricsSnapshot:
        return MetricsSnapshot([], RequestMetrics().snapshot())

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> None:
        self.aborted.append(request_id)

    def record_rejection(self, kind: str) -> None:
        self.rejections.append(kind)


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
    assert fake.rejections == ["circuit_breaker"]  # counted at the controller, once


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


class SlowStartClient(FakeClient):
    """A controller that answers model_info only once `ready` is set; counts the asks."""

    def __init__(self) -> None:
        super().__init__(ids("ok"))
        self.ready = asyncio.Event()
        self.num_model_info_calls = 0

    async def model_info(self) -> dict[str, Any]:
        self.num_model_info_calls += 1
        await self.ready.wait()
        return await super().model_info()


def test_concurrent_requests_share_one_start_and_each_waits_one_ready_wait(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests during a slow start each get their 503 after one ready_wait_s (not one per
    request ahead of them: a single start is shared); once the controller answers they are
    served, the tokenizer built on the text pool."""
    import cluster.ingress
    from workers.tokenizer import Tokenizer

    build_threads: list[str] = []

    def tokenizer(path: Any) -> Tokenizer:
        build_threads.append(threading.current_thread().name)
        return Tokenizer(path)

    monkeypatch.setattr(cluster.ingress, "Tokenizer", tokenizer)
    ready_wait_s, num_requests = 0.5, 6

    async def main() -> tuple[list[int], float, list[int], int]:
        fake = SlowStartClient()
        server = OpenAIServer(TokenflowConfig(cluster={"ready_wait_s": ready_wait_s}), fake)
        transport = httpx.ASGITransport(add_routes(FastAPI(), server))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            began = time.perf_counter()
            waiting = await asyncio.gather(*(client.post(COMPLETIONS, json=BODY)
                                             for _ in range(num_requests)))
            elapsed = time.perf_counter() - began
            assert all("retry-after" in r.headers for r in waiting)
            fake.ready.set()
            served = await asyncio.gather(*(client.post(COMPLETIONS, json=BODY)
                                            for _ in range(num_requests)))
        return ([r.status_code for r in waiting], elapsed, [r.status_code for r in served],
                fake.num_model_info_calls)

    waiting, elapsed, served, num_calls = asyncio.run(main())
    assert waiting == [503] * num_requests
    assert served == [200] * num_requests
    assert num_calls == 1  # one start, awaited by all, never restarted since it never failed
    # Serialized waits would take num_requests * ready_wait_s (3 s).
    assert elapsed < num_requests * ready_wait_s / 2, f"the 503s took {elapsed:.2f}s"
    assert len(build_threads) == 1 and build_threads[0].startswith("tokenflow-text")


def test_a_failed_start_is_retried_by_the_next_request() -> None:
    class FailsOnce(FakeClient):
        num_model_info_calls = 0

        async def model_info(self) -> dict[str, Any]:
            self.num_model_info_calls += 1
            if self.num_model_info_calls == 1:
                raise ConnectionError("the controller is restarting")
            return await super().model_info()

    fake = FailsOnce(ids("ok"))
    client = make_client(fake)
    assert client.post(COMPLETIONS, json=BODY).status_code == 503
    assert client.post(COMPLETIONS, json=BODY).status_code == 200
    assert client.post(COMPLETIONS, json=BODY).status_code == 200
    assert fake.num_model_info_calls == 2


def test_health_is_200_only_with_a_worker_up() -> None:
    class Up(FakeClient):
        async def ping(self) -> dict[str, Any]:
            return {"ok": True, "status": "ok", "num_workers_up": 1,
                    "workers": [{"worker": 0, "up": True}]}

    health = make_client(Up([])).get("/health")
    assert health.status_code == 200 and health.json()["workers"][0]["up"]


# --- The front door: limits, keys, tenants, priorities, errors ---------------------------

KEYS = [{"key": "sk-team-a", "tenant": "team-a"},
        {"key": "sk-urgent", "tenant": "ops", "min_priority": -5, "max_priority": 10}]


def test_body_over_the_limit_is_413_from_its_content_length() -> None:
    fake = FakeClient(ids("x"))
    client = make_client(fake, edge={"max_body_bytes": 4096})
    resp = client.post(COMPLETIONS, json={**BODY, "prompt": "y" * 5000})
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "body_too_large"
    assert fake.started == []


def test_chunked_body_over_the_limit_is_413_without_a_content_length() -> None:
    async def main() -> httpx.Response:
        server = OpenAIServer(TokenflowConfig(edge={"max_body_bytes": 4096}),
                              FakeClient(ids("x")))
        chunks_sent = []

        async def body() -> AsyncIterator[bytes]:
            for _ in range(100):  # 100 KB, never all read
                chunks_sent.append(1)
                yield b" " * 1024

        transport = httpx.ASGITransport(add_routes(FastAPI(), server))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.post(COMPLETIONS, content=body())

    resp = asyncio.run(main())
    assert resp.status_code == 413 and "4096" in resp.json()["error"]["message"]


def test_a_huge_prompt_never_stalls_the_event_loop() -> None:
    """A 3 MB prompt under the body limit is parsed and refused on the text pool; a ticker
    on the event loop keeps its pace meanwhile."""
    async def main() -> tuple[int, float]:
        server = OpenAIServer(TokenflowConfig(edge={"max_body_bytes": 8 * 2**20},
                                              protections={"max_prefill_tokens": 64}),
                              FakeClient(ids("x")))
        transport = httpx.ASGITransport(add_routes(FastAPI(), server))
        big = {**BODY, "prompt": list(range(3, 300)) * 2000}  # 600k ids, ~2.6 MB of JSON
        gaps: list[float] = []

        async def ticker(done: asyncio.Event) -> None:
            last = time.perf_counter()
            while not done.is_set():
                await asyncio.sleep(0.01)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            await server.frontend()
            done = asyncio.Event()
            tick = asyncio.create_task(ticker(done))
            resp = await client.post(COMPLETIONS, json=big)
            done.set()
            await tick
        return resp.status_code, max(gaps)

    status, max_gap = asyncio.run(main())
    assert status == 422
    assert max_gap < 0.5, f"the event loop stalled for {max_gap:.2f}s"


def test_a_long_text_prompt_is_refused_before_tokenizing() -> None:
    # builtin:tiny: one token per byte, so 200,000 characters are at least 100,000 tokens.
    resp = make_client(FakeClient(ids("x"))).post(COMPLETIONS,
                                                  json={**BODY, "prompt": "z" * 200_000})
    assert resp.status_code == 422 and "at least" in resp.json()["error"]["message"]


@pytest.mark.parametrize(("url", "body", "param"), [
    (COMPLETIONS, '{"model": "builtin:tiny", "prompt": "a\\ud800b"}', "prompt"),
    (CHAT, '{"messages": [{"role": "user", "content": "\\udfff"}]}', "messages[0].content"),
    (CHAT, '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud83d"}]}]}',
     "messages[0].content[0].text"),
    (COMPLETIONS, '{"prompt": "hi", "stop": ["\\udc00"]}', "stop[0]"),
])
def test_lone_surrogates_are_400_naming_the_field(url: str, body: str, param: str) -> None:
    fake = FakeClient(ids("x"))
    resp = make_client(fake).post(url, content=body,
                                  headers={"content-type": "application/json"})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param and "surrogate" in resp.json()["error"][
        "message"]
    assert fake.started == []


@pytest.mark.parametrize("url", [COMPLETIONS, CHAT])
def test_deep_json_is_400(url: str) -> None:
    resp = make_client(FakeClient(ids("x"))).post(url, content="[" * 10_000 + "]" * 10_000)
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "too_deep"
    resp = make_client(FakeClient(ids("x"))).post(
        url, content='{"prompt": ' + '{"a": ' * 10_000 + "1" + "}" * 10_001)
    assert resp.status_code == 400 and "10001 levels" in resp.json()["error"]["message"]


@pytest.mark.parametrize(("field", "value"), [
    ("functions", [{"name": "f"}]),
    ("response_format", {"type": "xml"}), ("top_logprobs", 21), ("n", 9),
    ("tool_choice", "required"), ("logit_bias", {"1": 5})])
def test_options_that_change_the_answer_are_400_naming_them(field: str, value: Any) -> None:
    resp = make_client(FakeClient(ids("x"))).post(CHAT, json={
        "messages": [{"role": "user", "content": "hi"}], field: value})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == field


def test_keys_authenticate_and_name_the_tenant() -> None:
    fake = FakeClient(ids("ok"))
    client = make_client(fake, edge={"api_keys": KEYS})
    missing = client.post(COMPLETIONS, json=BODY)
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "missing_api_key"
    bad = client.post(COMPLETIONS, json=BODY, headers={"Authorization": "Bearer sk-nope"})
    assert bad.status_code == 401 and bad.json()["error"]["code"] == "invalid_api_key"
    assert bad.headers["www-authenticate"] == "Bearer" and "sk-nope" not in bad.text
    assert fake.started == []
    good = client.post(COMPLETIONS, json=BODY, headers={"Authorization": "Bearer sk-team-a",
                                                        "X-Tenant-Id": "ops"})
    assert good.status_code == 200 and good.json()["choices"][0]["text"] == "ok"
    assert fake.tenants == ["team-a"]  # the key's tenant, not the header's
    assert client.get("/health").status_code == 200  # open without a key
    assert client.get("/v1/models").status_code == 401


@pytest.mark.parametrize("require", [False, True])
def test_metrics_needs_a_key_only_when_configured(require: bool) -> None:
    client = make_client(FakeClient([]), edge={"api_keys": KEYS,
                                               "metrics_require_api_key": require})
    keyed = client.get("/metrics", headers={"Authorization": "Bearer sk-team-a"})
    assert keyed.status_code == 200 and b"tokenflow_" in keyed.content
    for headers in ({}, {"Authorization": "Bearer sk-nope"}):
        resp = client.get("/metrics", headers=headers)
        if require:  # the same 401 as the /v1 routes
            v1 = client.get("/v1/models", headers=headers)
            assert resp.status_code == 401 and resp.json() == v1.json()
            assert resp.headers["www-authenticate"] == "Bearer"
        else:
            assert resp.status_code == 200 and resp.content == keyed.content


def test_metrics_stays_open_without_keys_even_when_required() -> None:
    client = make_client(FakeClient([]), edge={"metrics_require_api_key": True})
    assert client.get("/metrics").status_code == 200


def test_without_keys_the_header_names_the_tenant() -> None:
    fake = FakeClient(ids("ok"))
    client = make_client(fake)
    assert client.post(COMPLETIONS, json=BODY, headers={"X-Tenant-Id": "t1"}).status_code == 200
    assert client.post(COMPLETIONS, json=BODY).status_code == 200
    assert fake.tenants == ["t1", "default"]
    bad = client.post(COMPLETIONS, json=BODY, headers={"X-Tenant-Id": "a b/../c"})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_tenant"


def test_priority_is_bounded_by_the_callers_range() -> None:
    fake = FakeClient(ids("ok"))
    client = make_client(fake, edge={"api_keys": KEYS})
    team_a = {"Authorization": "Bearer sk-team-a"}
    urgent = {"Authorization": "Bearer sk-urgent"}
    for priority, headers, status in [(10**30, team_a, 400), (-1, team_a, 400),
                                      (100, team_a, 200), (-5, urgent, 200),
                                      (-6, urgent, 400), (11, urgent, 400)]:
        resp = client.post(COMPLETIONS, json={**BODY, "priority": priority}, headers=headers)
        assert resp.status_code == status, (priority, resp.text)
        if status == 400:
            assert resp.json()["error"]["param"] == "priority"
    assert fake.tenants == ["team-a", "ops"]


def test_unavailable_bodies_carry_a_request_id_not_internals() -> None:
    internal = "ActorDiedError: actor 5f3e pid=4242 ip=10.1.2.3 namespace=tokenflow"

    class DeadClient(FakeClient):
        async def model_info(self) -> dict[str, Any]:
            raise ConnectionError(internal)

    client = make_client(DeadClient([]), cluster={"retry_after_s": 2})
    for resp in (client.post(COMPLETIONS, json=BODY), client.get("/v1/models")):
        assert resp.status_code == 503 and resp.headers["retry-after"] == "2"
        message = resp.json()["error"]["message"]
        assert "10.1.2.3" not in message and "pid" not in message
        assert resp.headers["x-request-id"] in message


def test_worker_failure_503_has_retry_after() -> None:
    resp = make_client(FakeClient([], error="worker 0 failed")).post(COMPLETIONS, json=BODY)
    assert resp.status_code == 503 and resp.headers["retry-after"] == "1"


def test_wrong_method_is_405_with_allow() -> None:
    resp = make_client(FakeClient([])).get(COMPLETIONS)
    assert resp.status_code == 405 and resp.headers["allow"] == "POST"
    assert "error" in resp.json()


def test_openapi_describes_the_bodies_the_serve_app_serves() -> None:
    from cluster.ingress import app

    spec = make_client(FakeClient([])).get("/openapi.json").json()
    assert spec == app.openapi()
    for path, model in [(COMPLETIONS, "CompletionRequest"), (CHAT, "ChatCompletionRequest")]:
        post = spec["paths"][path]["post"]
        schema = post["requestBody"]["content"]["application/json"]["schema"]
        assert schema == {"$ref": f"#/components/schemas/{model}"}
        assert {"200", "400", "401", "413", "422", "429", "503"} <= set(post["responses"])
    assert "messages" in spec["components"]["schemas"]["ChatCompletionRequest"]["properties"]
