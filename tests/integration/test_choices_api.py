"""`n` and `best_of` through the real `openai` client and the two-worker cluster: seeded
choices repeat, the prompt is computed once for all choices (the workers' prefill token
count), usage counts the prompt once, streamed choices equal non-streamed ones, and
`best_of` keeps the choice with the highest cumulative log-probability."""

from __future__ import annotations

import random
from typing import Any

import openai
import pytest
from openai import OpenAI

from tests.integration.conftest import Cluster

MODEL = "builtin:tiny"
EXTRA = {"return_token_ids": True, "ignore_eos": True}


@pytest.fixture(scope="module")
def client(cluster: Cluster) -> OpenAI:
    return OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0, timeout=60)


def metric(cluster: Cluster, line_start: str) -> float:
    import httpx

    text = httpx.get(f"{cluster.url}/metrics", timeout=30).text
    return float(next(line for line in text.splitlines()
                      if line.startswith(line_start)).split()[-1])


def num_prefill_tokens(cluster: Cluster) -> int:
    import ray

    snap = ray.get(cluster.controller.metrics_snapshot.remote(), timeout=30)
    return sum(w.num_prefill_tokens for w in snap.workers)


def fresh_prompt(seed: int, n: int = 41) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 250) for _ in range(n)]


def test_n_seeded_choices_repeat_and_share_the_prompt(client: OpenAI,
                                                      cluster: Cluster) -> None:
    prompt = fresh_prompt(101)  # 41 tokens: 5 full blocks of 8 and one partial
    block = cluster.config.cache.block_size
    kwargs: dict[str, Any] = dict(model=MODEL, prompt=prompt, n=4, seed=7, temperature=1.0,
                                  max_tokens=8, extra_body=EXTRA)
    before = num_prefill_tokens(cluster)
    extra_before = metric(cluster, 'tokenflow_request_features_total{feature="extra_choice"}')
    prompt_before = metric(cluster, "tokenflow_prompt_tokens_total")
    first = client.completions.create(**kwargs)
    assert metric(cluster, 'tokenflow_request_features_total{feature="extra_choice"}') \
        == extra_before + 3
    assert metric(cluster, "tokenflow_prompt_tokens_total") == prompt_before + len(prompt)
    # Choice 0 computes the prompt; choices 1-3 take its full blocks from the cache and
    # compute only the tokens of its last, partial block.
    assert num_prefill_tokens(cluster) - before == len(prompt) + 3 * (len(prompt) % block)
    assert [c.index for c in first.choices] == [0, 1, 2, 3]
    ids = [c.token_ids for c in first.choices]  # type: ignore[attr-defined]
    assert len({tuple(i) for i in ids}) == 4
    assert first.usage.prompt_tokens == len(prompt)
    assert first.usage.completion_tokens == 4 * 8
    second = client.completions.create(**kwargs)
    assert [c.token_ids for c in second.choices] == ids  # type: ignore[attr-defined]
    # Streamed: the same four choices, each under its index; usage counted once.
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True},
                                            **kwargs))
    streamed: dict[int, list[int]] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            streamed.setdefault(choice.index, []).extend(choice.token_ids or [])  # type: ignore[attr-defined]
    assert [streamed[i] for i in range(4)] == ids
    assert chunks[-1].usage.completion_tokens == 32 and chunks[-1].usage.prompt_tokens == 41
    assert cluster.stats()["num_unfinished"] == 0


def test_chat_n_with_logprobs(client: OpenAI) -> None:
    kwargs: dict[str, Any] = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                  n=3, seed=3, max_tokens=5, logprobs=True, top_logprobs=2,
                                  extra_body=EXTRA)
    resp = client.chat.completions.create(**kwargs)
    assert len(resp.choices) == 3 and resp.usage.completion_tokens == 15
    for choice in resp.choices:
        assert len(choice.logprobs.content) == 5
    texts = [c.message.content for c in resp.choices]
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    streamed = {i: "" for i in range(3)}
    for chunk in chunks:
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert [streamed[i] for i in range(3)] == texts


def test_best_of_keeps_the_most_likely(client: OpenAI) -> None:
    prompt = fresh_prompt(202, 12)
    common: dict[str, Any] = dict(model=MODEL, prompt=prompt, seed=11, temperature=1.0,
                                  max_tokens=6, logprobs=0, extra_body=EXTRA)
    every = client.completions.create(n=4, **common)
    sums = [sum(c.logprobs.token_logprobs) for c in every.choices]
    best = client.completions.create(n=1, best_of=4, **common)
    assert len(best.choices) == 1
    assert best.choices[0].token_ids == every.choices[sums.index(max(sums))].token_ids  # type: ignore[attr-defined]
    assert best.usage.completion_tokens == 4 * 6  # every generated sequence, once


def test_choice_limits_are_400(client: OpenAI, cluster: Cluster) -> None:
    too_many = cluster.config.edge.max_choices + 1
    with pytest.raises(openai.BadRequestError, match="'n'"):
        client.completions.create(model=MODEL, prompt="hi", n=too_many)
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client.completions.create(model=MODEL, prompt="hi", n=3, best_of=2)
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client.completions.create(model=MODEL, prompt="hi", best_of=2, stream=True)
