"""64 concurrent streams with the right usage and every block back afterwards; a client that
disconnects mid-stream gets its request aborted and its blocks freed."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import httpx
from openai import AsyncOpenAI

from tests.integration.conftest import Cluster

MODEL = "builtin:tiny"


def wait_for(condition: Callable[[], bool], deadline_s: float, what: str) -> None:
    """Poll a condition on the controller's state until a bounded deadline."""
    end = time.monotonic() + deadline_s
    while not condition():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.05)


def assert_all_blocks_free(cluster: Cluster) -> None:
    report = cluster.check_integrity()
    assert all(w["checked"] for w in report["workers"]), report
    stats = cluster.stats()
    assert stats["num_unfinished"] == 0 and stats["num_streams"] == 0
    for worker in stats["workers"]:
        assert worker["num_used_blocks"] == 0
        assert worker["num_free_blocks"] + worker["num_cached_blocks"] == worker["num_blocks"]


def test_64_concurrent_streams_complete_with_usage(cluster: Cluster) -> None:
    num, max_tokens = 64, 10
    prompts = [[3 + (7 * i + j) % 500 for j in range(4 + i % 13)] for i in range(num)]

    async def one(client: AsyncOpenAI, prompt: list[int]) -> tuple[int, int, int, str | None]:
        stream = await client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=max_tokens, stream=True,
            stream_options={"include_usage": True},
            extra_body={"return_token_ids": True, "ignore_eos": True})
        ids: list[int] = []
        reason = usage = None
        async for chunk in stream:
            if chunk.choices:
                ids += chunk.choices[0].token_ids or []
                reason = chunk.choices[0].finish_reason or reason
            if chunk.usage is not None:
                usage = chunk.usage
        assert usage is not None
        return usage.prompt_tokens, usage.completion_tokens, len(ids), reason

    async def run() -> list[tuple[int, int, int, str | None]]:
        client = AsyncOpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0,
                             timeout=120, http_client=httpx.AsyncClient(
                                 limits=httpx.Limits(max_connections=num)))
        async with client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    results = asyncio.run(run())
    for prompt, (prompt_tokens, completion_tokens, num_ids, reason) in zip(
            prompts, results, strict=True):
        assert prompt_tokens == len(prompt)
        assert completion_tokens == max_tokens == num_ids
        assert reason == "length"
    assert all(w["num_routed"] > 0 for w in cluster.stats()["workers"])
    assert_all_blocks_free(cluster)


def test_disconnect_mid_stream_aborts_and_frees_blocks(cluster: Cluster) -> None:
    aborted_before = cluster.stats()["num_aborted"]
    body = {"model": MODEL, "prompt": "a long story", "max_tokens": 1000, "stream": True,
            "ignore_eos": True}
    with httpx.Client(timeout=60) as http, \
            http.stream("POST", f"{cluster.url}/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        events = 0
        for line in resp.iter_lines():
            events += line.startswith("data: ")
            if events == 3:
                break  # leaving the block closes the connection mid-stream
    # The abort lands within a few steps; 1000 tokens would take many seconds, and the
    # abort counter below tells an abort from a natural finish either way.
    wait_for(lambda: cluster.stats()["num_unfinished"] == 0, 5, "the abort")
    assert cluster.stats()["num_aborted"] == aborted_before + 1
    assert_all_blocks_free(cluster)
