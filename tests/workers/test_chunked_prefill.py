"""Chunked prefill, prefix-cache resumes and mixed steps give the logits of one-shot runs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from controller.messages import SamplingParams
from tests.workers.helpers import Driver, random_ids
from workers.worker import Worker

ATOL = 1e-4


def make_worker(path: Path, num_kv_blocks: int = 512) -> Worker:
    return Worker(str(path), num_kv_blocks=num_kv_blocks, block_size=16, keep_logits=True)


@pytest.fixture(scope="module")
def long_prompt() -> list[int]:
    return random_ids(2048, seed=1, vocab_size=512)


@pytest.fixture(scope="module")
def one_shot(tiny_path: Path, long_prompt: list[int]) -> torch.Tensor:
    """Logits of every position of the 2,048-token prompt prefilled in one step."""
    driver = Driver(make_worker(tiny_path))
    driver.add("r", long_prompt)
    driver.prefill("r", chunk_len=len(long_prompt))
    return driver.worker.span_logits["r"]


@pytest.mark.parametrize("chunk_len", [128, 100])  # block-aligned, and not
def test_chunked_prefill_matches_one_shot(tiny_path, long_prompt, one_shot, chunk_len):
    worker = make_worker(tiny_path)
    driver = Driver(worker)
    driver.add("r", long_prompt)
    begin, events = 0, []
    while begin < len(long_prompt):
        n = min(chunk_len, len(long_prompt) - begin)
        result = driver.step({"r": n})
        events += result.chunk_events
        torch.testing.assert_close(
            worker.span_logits["r"], one_shot[begin : begin + n], atol=ATOL, rtol=0
        )
        begin += n
    torch.testing.assert_close(worker.last_logits["r"], one_shot[-1], atol=ATOL, rtol=0)
    num_chunks = -(-len(long_prompt) // chunk_len)
    assert [e.chunk_index for e in events] == list(range(num_chunks))
    assert [e.start for e in events] == list(range(0, len(long_prompt), chunk_len))
    assert sum(e.num_tokens for e in events) == len(long_prompt)
    assert all(e.bytes_moved > 0 and e.elapsed_s > 0 for e in events)
    # Only the last chunk reaches the end of the prompt and samples.
    assert result.sampled_token_ids["r"] == [int(one_shot[-1].argmax())]


def test_prefix_cache_resume(tiny_path, long_prompt, one_shot):
    """A second request reusing the first one's full blocks computes only its tail."""
    worker = make_worker(tiny_path)
    driver = Driver(worker)
    prefix = long_prompt[:512]
    driver.add("first", prefix)
    driver.prefill("first", chunk_len=512)
    shared = list(range(512 // 16))  # the driver gave "first" blocks 0..35; share 32 full ones
    tail_blocks = list(range(100, 100 + 64))
    driver.add("second", long_prompt[:700], block_ids=shared + tail_blocks, num_computed=512)
    result = driver.step({"second": 188})
    torch.testing.assert_close(worker.span_logits["second"], one_shot[512:700], atol=ATOL, rtol=0)
    (event,) = result.chunk_events
    assert (event.chunk_index, event.start, event.num_tokens) == (0, 512, 188)


def test_mixed_step_matches_separate_runs(tiny_path):
    """Two prefill chunks and three decodes in one plan == each request on its own."""
    prompts = {
        "a": random_ids(300, seed=11, vocab_size=512),
        "b": random_ids(200, seed=12, vocab_size=512),
        "c": random_ids(50, seed=13, vocab_size=512),
        "d": random_ids(130, seed=14, vocab_size=512),
        "e": random_ids(7, seed=15, vocab_size=512),
    }
    steps = [
        {"c": 50}, {"d": 130}, {"e": 7}, {"a": 128},
        {"a": 128, "b": 64, "c": 1, "d": 1, "e": 1},  # the mixed steps
        {"a": 44, "b": 64, "c": 1, "d": 1, "e": 1},
        {"a": 1, "b": 72, "c": 1, "d": 1, "e": 1},
    ]

    def run(request_ids: list[str]) -> dict[str, list[torch.Tensor]]:
        driver = Driver(make_worker(tiny_path))
        for rid in request_ids:
            driver.add(rid, prompts[rid])
        logits: dict[str, list[torch.Tensor]] = {rid: [] for rid in request_ids}
        for schedule in steps:
            mine = {rid: n for rid, n in schedule.items() if rid in request_ids}
            if mine:
                driver.step(mine)
                for rid in mine:
                    logits[rid].append(driver.worker.span_logits[rid])
        return logits

    together = run(list(prompts))
    for rid in prompts:
        (alone,) = run([rid]).values()
        assert len(alone) == len(together[rid])
        for got, want in zip(together[rid], alone, strict=True):
            torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_seeded_sampling_survives_preemption(tiny_path):
    """Preempt-by-recompute: the request comes back whole and samples the same tokens."""
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=42)
    prompt = random_ids(40, seed=3, vocab_size=512)

    uninterrupted = Driver(make_worker(tiny_path))
    uninterrupted.add("r", prompt, params)
    uninterrupted.prefill("r", chunk_len=16)
    want = uninterrupted.tokens["r"][40:] + uninterrupted.decode("r", 11)

    driver = Driver(make_worker(tiny_path))
    driver.add("r", prompt, params)
    driver.prefill("r", chunk_len=40)
    got = driver.tokens["r"][40:] + driver.decode("r", 4)
    # Preempted: dropped, then re-sent with its generated tokens and fresh blocks.
    tokens = driver.tokens["r"]
    driver.step({}, finished={"r"})
    assert driver.worker.num_active_requests == 0
    driver.add("r", tokens, params, num_output_tokens=len(tokens) - 40)
    result = driver.step({"r": len(tokens)})
    assert [e.start for e in result.chunk_events] == [0]
    got += result.sampled_token_ids["r"] + driver.decode("r", 6)
    assert got == want
