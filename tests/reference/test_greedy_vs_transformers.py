"""LocalEngine greedy outputs equal transformers' `generate`, token by token."""

from __future__ import annotations

import random
from typing import Any

import pytest

from cluster.engine import LocalEngine
from controller.messages import SamplingParams
from tests.reference.conftest import ARCHS, hf_greedy

PROMPT_LENS = (5, 17, 64, 100, 129, 250, 333, 600)
NEW_TOKENS = 32
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def make_prompts(seed: int, vocab_size: int = 256) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def references(checkpoints):
    prompts = make_prompts(7)
    return prompts, {arch: hf_greedy(checkpoints[arch], prompts, NEW_TOKENS) for arch in ARCHS}


def engine_for(path, **overrides: dict[str, Any]) -> LocalEngine:
    settings: dict[str, dict[str, Any]] = {
        "worker": {"model": str(path)},
        "cache": {"block_size": 16, "num_kv_blocks": 512, "enable_prefix_caching": False},
        "scheduler": {"max_num_batched_tokens": 4096}}
    for section, fields in overrides.items():
        settings[section] = {**settings.get(section, {}), **fields}
    return LocalEngine(**settings)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("budget", (16, 64, 4096))
def test_greedy_matches_transformers(checkpoints, references, arch, budget):
    prompts, expected = references
    engine = engine_for(checkpoints[arch], scheduler={"max_num_batched_tokens": budget})
    results = engine.generate(prompts, GREEDY)
    for prompt, want, got in zip(prompts, expected[arch], results, strict=True):
        assert got.output_token_ids == want, f"prompt of {len(prompt)} tokens diverged"
        assert got.finish_reason == "length"
    engine.check_integrity()


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_under_preemption(checkpoints, references, arch):
    prompts, expected = references
    # 48 blocks of 16 tokens hold the largest request (632 tokens = 40 blocks), never all.
    engine = engine_for(checkpoints[arch], cache={"num_kv_blocks": 48},
                        scheduler={"max_num_batched_tokens": 256})
    results = engine.generate(prompts, GREEDY)
    assert engine.scheduler.stats.num_preemptions > 0
    assert [r.output_token_ids for r in results] == expected[arch]
    engine.check_integrity()


def test_greedy_matches_with_prefix_caching(checkpoints):
    path = checkpoints["llama"]
    rng = random.Random(11)
    shared = [rng.randrange(3, 256) for _ in range(200)]
    prompts = [shared + [rng.randrange(3, 256) for _ in range(n)] for n in (5, 40, 90, 3)]
    expected = hf_greedy(path, prompts, NEW_TOKENS)
    engine = engine_for(path, cache={"enable_prefix_caching": True},
                        scheduler={"max_num_batched_tokens": 128})
    first = engine.generate(prompts[:1], GREEDY)  # fills the cache with the prefix
    rest = engine.generate(prompts[1:], GREEDY)
    assert [r.output_token_ids for r in first + rest] == expected
    assert all(r.num_cached_tokens >= 192 for r in rest)  # 12 full blocks of the prefix
    assert engine.scheduler.kv.num_prefix_hits > 0
    engine.check_integrity()
