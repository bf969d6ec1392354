"""Log-probabilities the engine returns equal transformers' `log_softmax` of the same
checkpoint (fp32, within 1e-4): sampled tokens, their top-k, and echoed prompt tokens,
with prompts long enough to be chunked and prompts that hit the prefix cache."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from cluster.engine import LocalEngine
from controller.logprobs import TokenLogprob
from controller.messages import SamplingParams
from workers.presets import resolve_model

TOL = 1e-4
NUM_TOP = 5


@pytest.fixture(scope="module")
def model_path() -> Path:
    return resolve_model("builtin:tiny")


@pytest.fixture(scope="module")
def hf_model(model_path):
    import transformers as tf

    return tf.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


def hf_logprobs(model, token_ids: list[int]) -> torch.Tensor:
    """[len, vocab]: row i is the distribution of token i + 1 given tokens 0..i."""
    with torch.inference_mode():
        logits = model(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def check_entry(entry: TokenLogprob, row: torch.Tensor, num_top: int) -> None:
    assert abs(entry.logprob - row[entry.token_id].item()) < TOL
    top = row.topk(num_top)
    assert len(entry.top_ids) == num_top
    assert torch.allclose(torch.tensor(entry.top_logprobs), top.values, atol=TOL)
    # Ids may swap only between near-ties: each listed id has the listed log-probability.
    for token, lp in zip(entry.top_ids, entry.top_logprobs, strict=True):
        assert abs(row[token].item() - lp) < TOL


def run(engine: LocalEngine, prompt: list[int], params: SamplingParams):
    rid = engine.add_request(prompt, params)
    tokens, logprobs, prompt_logprobs = [], [], []
    for out in engine.stream(rid):
        tokens += out.new_token_ids
        logprobs += out.logprobs or []
        prompt_logprobs += out.prompt_logprobs or []
    return tokens, logprobs, prompt_logprobs


def engine_for(model_path: Path, budget: int, async_scheduling: bool = False) -> LocalEngine:
    return LocalEngine(worker={"model": str(model_path)},
                       cache={"block_size": 8, "num_kv_blocks": 256},
                       scheduler={"max_num_batched_tokens": budget,
                                  "async_scheduling": async_scheduling})


@pytest.mark.parametrize(("temperature", "async_scheduling"),
                         [(0.0, False), (0.8, False), (0.8, True)])
def test_sampled_and_top_logprobs_match_transformers(model_path, hf_model, temperature,
                                                     async_scheduling):
    engine = engine_for(model_path, budget=256, async_scheduling=async_scheduling)
    rng = random.Random(3)
    prompt = [rng.randrange(3, 200) for _ in range(20)]
    params = SamplingParams(max_tokens=12, temperature=temperature, seed=11, ignore_eos=True,
                            logprobs=NUM_TOP)
    tokens, logprobs, prompt_logprobs = run(engine, prompt, params)
    assert len(logprobs) == len(tokens) == 12 and prompt_logprobs == []
    # Raw model log-probabilities (before temperature), of the tokens actually sampled.
    rows = hf_logprobs(hf_model, prompt + tokens)[len(prompt) - 1 :]
    for i, entry in enumerate(logprobs):
        assert entry.token_id == tokens[i]
        check_entry(entry, rows[i], NUM_TOP)
    engine.check_integrity()


@pytest.mark.parametrize(("budget", "async_scheduling"), [(16, False), (256, False), (16, True)])
def test_echo_prompt_logprobs_chunked_and_prefix_cached(model_path, hf_model, budget,
                                                        async_scheduling):
    """budget 16 cuts the 45-token prompt into chunks; the second run of the same prompt
    would be a prefix-cache hit and must still score every prompt token."""
    engine = engine_for(model_path, budget=budget, async_scheduling=async_scheduling)
    rng = random.Random(5)
    prompt = [rng.randrange(3, 200) for _ in range(45)]
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=2,
                            prompt_logprobs=2)
    first = run(engine, prompt, params)
    # A plain request of the same prompt caches its blocks too, then echo again.
    run(engine, prompt, SamplingParams(max_tokens=1, temperature=0.0))
    assert engine.scheduler.kv.get_computed_blocks(prompt), "the prompt is cached"
    second = run(engine, prompt, params)
    for tokens, logprobs, prompt_logprobs in (first, second):
        assert len(prompt_logprobs) == len(prompt) - 1
        rows = hf_logprobs(hf_model, prompt + tokens)
        for pos, entry in enumerate(prompt_logprobs, start=1):
            assert entry.token_id == prompt[pos]
            check_entry(entry, rows[pos - 1], 2)
        for i, entry in enumerate(logprobs):
            check_entry(entry, rows[len(prompt) - 1 + i], 2)
    assert first[0] == second[0]
    engine.check_integrity()


def test_echo_survives_preemption(model_path, hf_model):
    """A pool too small for all: preempted requests recompute their prompt and deliver
    each prompt position once."""
    engine = LocalEngine(worker={"model": str(model_path)},
                         cache={"block_size": 8, "num_kv_blocks": 24},
                         scheduler={"max_num_batched_tokens": 64})
    rng = random.Random(9)
    prompts = [[rng.randrange(3, 200) for _ in range(40)] for _ in range(4)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=1,
                            prompt_logprobs=1)
    ids = [engine.add_request(p, params) for p in prompts]
    got: dict[str, list[list]] = {rid: [[], [], []] for rid in ids}
    while engine.has_unfinished():
        for out in engine.step():
            tokens, lps, plps = got[out.request_id]
            tokens += out.new_token_ids
            lps += out.logprobs or []
            plps += out.prompt_logprobs or []
    assert engine.scheduler.stats.num_preemptions > 0
    for rid, prompt in zip(ids, prompts, strict=True):
        tokens, lps, plps = got[rid]
        assert len(plps) == len(prompt) - 1 and len(lps) == len(tokens) == 24
        rows = hf_logprobs(hf_model, prompt + tokens)
        for pos, entry in enumerate(plps, start=1):
            check_entry(entry, rows[pos - 1], 1)
        for i, entry in enumerate(lps):
            check_entry(entry, rows[len(prompt) - 1 + i], 1)
