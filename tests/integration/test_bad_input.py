"""Bad input gets its documented 4xx and OpenAI's error body, and the server keeps serving."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest

from tests.integration.conftest import Cluster

MODEL = "builtin:tiny"
# ignore_eos: the default temperature samples, and EOS may come first; the length must not.
OK_BODY: dict[str, Any] = {"model": MODEL, "prompt": "ok", "max_tokens": 2, "ignore_eos": True}
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"

# (name, endpoint, raw body or JSON object, status, expected `param` or None)
CASES: list[tuple[str, str, bytes | dict[str, Any], int, str | None]] = [
    ("malformed json", COMPLETIONS, b'{"model": "builtin:tiny", "prompt": ', 400, None),
    ("body not an object", COMPLETIONS, b"[1, 2]", 400, None),
    ("unknown model", COMPLETIONS, {**OK_BODY, "model": "gpt-17"}, 404, "model"),
    ("negative max_tokens", COMPLETIONS, {**OK_BODY, "max_tokens": -3}, 400, "max_tokens"),
    ("huge max_tokens", COMPLETIONS, {**OK_BODY, "max_tokens": 10**9}, 400, "max_tokens"),
    ("temperature NaN", COMPLETIONS,
     b'{"model": "builtin:tiny", "prompt": "x", "temperature": NaN}', 400, "temperature"),
    ("negative temperature", COMPLETIONS, {**OK_BODY, "temperature": -0.5}, 400, "temperature"),
    ("empty prompt", COMPLETIONS, {**OK_BODY, "prompt": ""}, 400, "prompt"),
    ("empty token list", COMPLETIONS, {**OK_BODY, "prompt": []}, 400, "prompt"),
    ("token id outside vocab", COMPLETIONS, {**OK_BODY, "prompt": [5, 512]}, 400, "prompt"),
    ("negative token id", COMPLETIONS, {**OK_BODY, "prompt": [5, -1]}, 400, "prompt"),
    ("over-cap prompt", COMPLETIONS, {**OK_BODY, "prompt": list(range(3, 100))}, 422, "prompt"),
    ("over-cap chat", CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "y" * 90}]},
     422, "messages"),
    ("chat without messages", CHAT, {"model": MODEL, "messages": []}, 400, "messages"),
    ("unknown route", "/v1/embeddings", OK_BODY, 404, None),
    ("lone surrogate in the prompt", COMPLETIONS,
     b'{"model": "builtin:tiny", "prompt": "a\\ud800"}', 400, "prompt"),
    ("lone surrogate in chat content", CHAT,
     b'{"messages": [{"role": "user", "content": "\\udc00"}]}', 400, "messages[0].content"),
    ("10,000-deep JSON", COMPLETIONS, b"[" * 10_000 + b"]" * 10_000, 400, None),
    ("nameless tool", CHAT, {"messages": [{"role": "user", "content": "hi"}],
                             "tools": [{"type": "function", "function": {"name": ""}}]}, 400,
     "tools[0]"),
    ("bad json_schema", CHAT, {"messages": [{"role": "user", "content": "hi"}],
                               "response_format": {"type": "json_schema", "json_schema": {
                                   "name": "x", "schema": {"type": "objekt"}}}}, 400,
     "response_format"),
    ("bad guided_regex", COMPLETIONS, {**OK_BODY, "guided_regex": "[a-"}, 400, "guided_regex"),
    ("priority 1e30", COMPLETIONS, {**OK_BODY, "priority": 10**30}, 400, "priority"),
    ("queue-jumping priority", COMPLETIONS, {**OK_BODY, "priority": -1}, 400, "priority"),
    ("5 MB body", COMPLETIONS, b'{"prompt": "' + b"x" * 5 * 2**20 + b'"}', 413, None),
]


@pytest.fixture(scope="module")
def http(cluster: Cluster) -> httpx.Client:
    with httpx.Client(base_url=cluster.url, timeout=60) as client:
        yield client


@pytest.mark.parametrize(("name", "path", "body", "status", "param"), CASES,
                         ids=[c[0] for c in CASES])
def test_bad_input_gets_error_body_and_server_keeps_serving(
        http: httpx.Client, name: str, path: str, body: bytes | dict[str, Any], status: int,
        param: str | None) -> None:
    if isinstance(body, bytes):
        resp = http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        resp = http.post(path, json=body)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] == param
    ok = http.post(COMPLETIONS, json=OK_BODY)
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["completion_tokens"] == 2


def test_refused_prompts_never_reach_the_controller(cluster: Cluster,
                                                    http: httpx.Client) -> None:
    before = sum(w["num_routed"] for w in cluster.stats()["workers"])
    assert http.post(COMPLETIONS, json={**OK_BODY, "prompt": list(range(3, 100))}
                     ).status_code == 422
    assert http.post(COMPLETIONS, json={**OK_BODY, "max_tokens": 0}).status_code == 400
    assert sum(w["num_routed"] for w in cluster.stats()["workers"]) == before


def test_a_20mb_body_is_413_at_once_and_stalls_no_one(http: httpx.Client,
                                                      cluster: Cluster) -> None:
    """The 413 is decided from Content-Length, and no text work runs on the event loop:
    a small request sent beside it completes in under 1 s."""
    big = b'{"model": "builtin:tiny", "prompt": "' + b"y" * 20 * 2**20 + b'"}'

    async def main() -> tuple[httpx.Response, float, httpx.Response, float]:
        async with httpx.AsyncClient(base_url=cluster.url, timeout=60) as client:
            async def timed(**kwargs: Any) -> tuple[httpx.Response, float]:
                start = time.perf_counter()
                resp = await client.post(COMPLETIONS, **kwargs)
                return resp, time.perf_counter() - start

            (big_resp, big_s), (small_resp, small_s) = await asyncio.gather(
                timed(content=big, headers={"content-type": "application/json"}),
                timed(json=OK_BODY))
            return big_resp, big_s, small_resp, small_s

    big_resp, big_s, small_resp, small_s = asyncio.run(main())
    assert big_resp.status_code == 413 and big_resp.json()["error"]["code"] == "body_too_large"
    assert small_resp.status_code == 200, small_resp.text
    print(f"20 MB body: 413 in {big_s:.2f}s; small request beside it: {small_s:.3f}s")
    assert small_s < 1.0
    assert big_s < 10.0  # the upload over loopback, not tokenizing (34.7 s before)


def test_after_bad_input_nothing_leaks(cluster: Cluster, http: httpx.Client) -> None:
    """Runs after the cases above (file order): no stuck request, no held KV block, and
    both step loops alive."""
    for body in ({**OK_BODY, "temperature": -1}, {**OK_BODY, "prompt": [10**6]}):
        assert http.post(COMPLETIONS, json=body).status_code == 400
    assert cluster.stats()["num_unfinished"] == 0
    report = cluster.check_integrity()
    assert all(w["checked"] for w in report["workers"]), report
    assert all(w["num_used_blocks"] == 0 for w in cluster.stats()["workers"])
