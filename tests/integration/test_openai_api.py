"""The real `openai` client against the two-worker cluster: completions and chat, streamed and
not; greedy ids equal to LocalEngine's; requests spread over both workers."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from openai import AsyncOpenAI, OpenAI

from controller.messages import SamplingParams
from tests.integration.conftest import Cluster

MODEL = "builtin:tiny"
PROMPTS: list[list[int]] = [[5, 6, 7, 8], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50],
                            [300, 12, 99], list(range(100, 130))]
GREEDY = {"temperature": 0.0, "max_tokens": 12}
EXTRA = {"return_token_ids": True, "ignore_eos": True}


@pytest.fixture(scope="module")
def client(cluster: Cluster) -> OpenAI:
    return OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0, timeout=60)


def local_greedy(engine: Any, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=GREEDY["max_tokens"], temperature=0.0, ignore_eos=True)
    return [c.output_token_ids for c in engine.generate(prompts, params)]


def test_completion_greedy_ids_match_local_engine(client: OpenAI, local_engine: Any) -> None:
    got = []
    for prompt in PROMPTS:
        resp = client.completions.create(model=MODEL, prompt=prompt, extra_body=EXTRA, **GREEDY)
        choice = resp.choices[0]
        assert choice.finish_reason == "length"
        assert choice.prompt_token_ids == prompt
        assert resp.usage is not None
        assert resp.usage.prompt_tokens == len(prompt)
        assert resp.usage.completion_tokens == GREEDY["max_tokens"]
        got.append(choice.token_ids)
    assert got == local_greedy(local_engine, PROMPTS)


def test_streamed_completion_equals_non_streamed(client: OpenAI) -> None:
    prompt = "The quick brown fox"
    whole = client.completions.create(model=MODEL, prompt=prompt, extra_body=EXTRA, **GREEDY)
    chunks = list(client.completions.create(
        model=MODEL, prompt=prompt, stream=True, stream_options={"include_usage": True},
        extra_body=EXTRA, **GREEDY))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    ids = [t for c in chunks if c.choices for t in (c.choices[0].token_ids or [])]
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert text == whole.choices[0].text
    assert ids == whole.choices[0].token_ids
    assert reasons[-1] == "length" and all(r is None for r in reasons[:-1])
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(ids)


def test_chat_stream_and_not_match_local_engine(client: OpenAI, local_engine: Any) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi!"}]
    resp = client.chat.completions.create(model=MODEL, messages=messages, extra_body=EXTRA,
                                          **GREEDY)
    prompt_ids = resp.model_extra["prompt_token_ids"]
    token_ids = resp.choices[0].token_ids
    assert token_ids == local_greedy(local_engine, [prompt_ids])[0]
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content

    stream = client.chat.completions.create(model=MODEL, messages=messages, stream=True,
                                            extra_body=EXTRA, **GREEDY)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    ids = [t for c in chunks for t in (getattr(c.choices[0], "token_ids", None) or [])]
    assert content == resp.choices[0].message.content
    assert ids == token_ids
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_string_cuts_the_text(client: OpenAI) -> None:
    whole = client.completions.create(model=MODEL, prompt="abc", extra_body=EXTRA, **GREEDY)
    text = whole.choices[0].text
    stop = text[3:5]
    assert stop, "the greedy continuation is long enough to hold a stop string"
    resp = client.completions.create(model=MODEL, prompt="abc", stop=[stop], extra_body=EXTRA,
                                     **GREEDY)
    assert resp.choices[0].finish_reason == "stop"
    assert resp.choices[0].text == text[:text.index(stop)]


def test_models_and_health(client: OpenAI, cluster: Cluster) -> None:
    import httpx

    assert [m.id for m in client.models.list().data] == [MODEL]
    health = httpx.get(f"{cluster.url}/health", timeout=30)
    assert health.status_code == 200 and health.json()["status"] == "ok"


def test_requests_spread_over_both_workers(cluster: Cluster) -> None:
    before = [w["num_routed"] for w in cluster.stats()["workers"]]

    async def burst() -> None:
        aclient = AsyncOpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0)
        async with aclient:
            await asyncio.gather(*(aclient.completions.create(
                model=MODEL, prompt=[10 + i, 20, 30], max_tokens=4) for i in range(8)))

    asyncio.run(burst())
    after = [w["num_routed"] for w in cluster.stats()["workers"]]
    routed = [a - b for a, b in zip(after, before, strict=True)]
    assert sum(routed) == 8
    assert min(routed) >= 2, f"routing left a worker idle: {routed}"
