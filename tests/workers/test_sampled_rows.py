"""The last layer on the sampled rows only (workers/sampled_rows.py), on a real checkpoint:
the rows it keeps equal the full last layer's rows, the greedy tokens equal the worker's
without it, K/V written for every row (later decodes read them), and it stays off where a
request scores its prompt or every row samples."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from cluster.config import TokenflowConfig
from cluster.engine import LocalEngine
from tests.workers.helpers import GREEDY, Driver, build_hf_checkpoint, random_ids
from workers.kernels.cpu_ops import cpu_ops
from workers.worker import RunOptions, Worker

pytestmark = pytest.mark.skipif(cpu_ops() is None, reason="the CPU kernels did not build here")

# Chunked prefills of three prompts beside decodes: a step where nothing samples (two
# chunks mid-prompt), mixed steps where a chunk ends its prompt beside decodes, decode-only.
PROMPTS = {"r0": 5, "r1": 40, "r2": 77}
SCHEDULE = ({"r0": 5, "r1": 16, "r2": 16}, {"r0": 1, "r1": 16, "r2": 16},
            {"r1": 4, "r2": 16}, {"r0": 1, "r1": 4, "r2": 29},
            *[{"r0": 1, "r1": 1, "r2": 1}] * 10)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return build_hf_checkpoint("llama", tmp_path_factory.mktemp("hf") / "llama",
                               num_hidden_layers=3)


def _run(worker: Worker) -> dict[str, list[int]]:
    driver = Driver(worker)
    for i, (rid, n) in enumerate(PROMPTS.items()):
        driver.add(rid, random_ids(n, seed=700 + i))
    for step in SCHEDULE:
        driver.step(step)
    return driver.tokens


def test_the_kept_rows_equal_the_full_last_layer_and_the_tokens_are_the_same(checkpoint):
    """Each step that skips rows is also run whole (same K/V written twice, the same values):
    the sampled rows' final hidden states agree within fp32 rounding (the GEMMs see fewer
    rows); the greedy tokens equal a worker's that runs every row."""
    worker = Worker(str(checkpoint), num_kv_blocks=64, block_size=16)
    assert worker.is_sampled_last_layer  # the default on a CPU fp32 worker
    model, forward = worker.model, worker.model.forward
    seen: list[int | None] = []  # per forward: rows kept, None when the layer ran whole

    def checked(input_ids, positions, attn, kv_caches, sampled=None):
        if sampled is None:
            seen.append(None)
            return forward(input_ids, positions, attn, kv_caches)
        full = forward(input_ids, positions, attn, kv_caches)
        got = forward(input_ids, positions, attn, kv_caches, sampled)
        seen.append(got.shape[0])
        assert got.shape == (sampled.rows.numel(), full.shape[1])
        torch.testing.assert_close(got, full[sampled.rows], rtol=1e-5, atol=1e-5)
        return got

    model.forward = checked
    tokens = _run(worker)
    # Step 1 samples r0 only (its whole prompt), step 2 r0's decode, step 3 nothing (both
    # chunks mid-prompt), step 4 r0 and r1's and r2's last chunks; then decode-only steps.
    assert seen[:4] == [1, 1, 0, 3] and seen[4:] == [None] * 10

    plain = Worker(str(checkpoint), num_kv_blocks=64, block_size=16,
                   run=RunOptions(sampled_last_layer=False))
    assert not plain.is_sampled_last_layer
    assert _run(plain) == tokens


def test_off_where_a_request_scores_its_prompt_or_logits_are_kept(checkpoint):
    worker = Worker(str(checkpoint), num_kv_blocks=64, block_size=16)
    calls: list[object] = []
    rows = worker._sampled_rows
    worker._sampled_rows = lambda *a: calls.append(rows(*a)) or calls[-1]
    driver = Driver(worker)
    echo = dataclasses.replace(GREEDY, prompt_logprobs=1)
    driver.add("echo", random_ids(30, seed=1), echo)
    driver.add("plain", random_ids(30, seed=2))
    result = driver.step({"echo": 16, "plain": 16})
    assert calls == [None]  # a prompt-scoring request in the step: every row's output
    driver.step({"plain": 14})  # without it the step skips rows
    assert calls[-1] is not None and calls[-1].rows.tolist() == [13]
    assert result.prompt_logprobs  # the echo request got its prompt's scores
    kept = Worker(str(checkpoint), num_kv_blocks=64, block_size=16, keep_logits=True)
    kept_calls: list[object] = []
    kept_rows = kept._sampled_rows
    kept._sampled_rows = lambda *a: kept_calls.append(kept_rows(*a)) or kept_calls[-1]
    kept_driver = Driver(kept)
    kept_driver.add("plain", random_ids(30, seed=2))
    kept_driver.step({"plain": 16})  # rows to skip, but every row's logits are kept
    assert kept_calls == [None]


def test_an_engine_with_it_gives_the_same_greedy_tokens_under_small_chunks(checkpoint):
    """LocalEngine with a 48-token budget (prompts cut into chunks beside decodes): every
    output equals the one without it, and no block is left held."""
    prompts = [random_ids(n, seed=900 + n) for n in (3, 50, 130, 70, 9)]
    outputs = []
    for on in (True, False):
        config = TokenflowConfig(
            worker={"model": str(checkpoint), "cpu_sampled_last_layer": on},
            cache={"num_kv_blocks": 64, "block_size": 16},
            scheduler={"max_num_batched_tokens": 48}, calibration={"auto": False})
        engine = LocalEngine(config)
        assert engine.worker.is_sampled_last_layer == on
        params = dataclasses.replace(GREEDY, max_tokens=12)
        outputs.append([c.output_token_ids for c in engine.generate(prompts, params)])
        engine.check_integrity()
    assert outputs[0] == outputs[1]
    assert all(len(o) == 12 for o in outputs[0])
