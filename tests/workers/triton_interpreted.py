"""The Triton kernels against the torch path, under the Triton interpreter (on CPU).

Not collected by the suite itself: tests/workers/test_attention_backends.py runs this file in a
fresh Python with TRITON_INTERPRET=1 (the variable must be set before triton is imported).
Tiny shapes (head_dim 16, few heads and tokens): the interpreter runs each program in numpy.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 from the start (test_attention_backends.py sets it)",
                allow_module_level=True)
pytest.importorskip("triton", reason="triton is not installed (the dev extra has it)")

from tests.workers.attention_cases import (
    MIXED,
    fix_interpreter_scalars,
    make_case,
    reference_attention,
    torch_reference,
)
from workers.attention import triton_kernels as kernels
from workers.attention.triton_backend import LaunchConfig, TritonBackend

fix_interpreter_scalars()
ATOL = 1e-5
CPU = torch.device("cpu")


def triton_backend(num_heads, num_kv_heads, *, num_sms=1, tile=16, prefill_m=32):
    return TritonBackend(
        num_heads, num_kv_heads, 16, torch.float32, CPU, num_sms=num_sms,
        decode_config=LaunchConfig(block_m=16, tile_n=tile),
        prefill_config=LaunchConfig(block_m=prefill_m, tile_n=tile),
        split_config=LaunchConfig(block_m=16, tile_n=tile),
    )


def test_write_kv_matches_indexed_copy():
    case = make_case([(3, 1), (0, 5), (20, 4)], num_heads=4, num_kv_heads=2, head_dim=16,
                     block_size=16, pad_to=None)
    slots = case.meta.slot_mapping.clone()
    slots[1] = -1  # a padding row: nothing written
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    kernels.write_kv(case.k, case.v, k_cache, v_cache, slots)
    want_k, want_v = case.k_cache.clone(), case.v_cache.clone()
    keep = slots >= 0
    want_k.view(-1, 2, 16).index_copy_(0, slots[keep], case.k[keep])
    want_v.view(-1, 2, 16).index_copy_(0, slots[keep], case.v[keep])
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


@pytest.mark.parametrize(
    ("block_size", "num_heads", "num_kv_heads", "tile"),
    [(16, 4, 2, 32), (32, 2, 2, 16)],  # GQA, tiles of two blocks; MHA, two tiles per block
    ids=["bs16-gqa", "bs32-mha"],
)
def test_unified_kernel_matches_torch(block_size, num_heads, num_kv_heads, tile):
    case = make_case(MIXED, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=16,
                     block_size=block_size, seed=block_size)
    want, want_k, want_v = torch_reference(case)
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    # block_m 16 for decodes and prefill: chunks span several programs (and with GQA,
    # programs hold 8 tokens x 2 heads).
    step = triton_backend(num_heads, num_kv_heads, tile=tile, prefill_m=16).prepare(
        case.meta)
    assert step.num_splits == 1
    got = step.forward(case.q, case.k, case.v, (k_cache, v_cache), case.scale)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


def test_unified_kernel_alone_over_a_mixed_batch():
    """One launch over every sequence, decodes and chunks mixed in any order (a 1-token span
    after a chunk too), as the kernel allows."""
    shape = [(17, 9), (46, 1), (0, 11), (32, 1), (30, 14), (0, 1)]
    case = make_case(shape, num_heads=4, num_kv_heads=1, head_dim=16, block_size=16, seed=3,
                     strided=False)
    want, _, _ = reference_attention(case)
    meta = case.meta
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    kernels.write_kv(case.k, case.v, k_cache, v_cache, meta.slot_mapping)
    out = torch.full_like(case.q, float("nan"))
    kernels.unified_attention(case.q, k_cache, v_cache, out, meta.query_start_loc, meta.seq_lens,
                              meta.block_table, case.scale, seq_begin=0, num_seqs=meta.num_seqs,
                              num_tokens=meta.num_tokens, block_m=32, tile_n=16)
    torch.testing.assert_close(out.double(), want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("num_splits", [3, 4])
def test_split_decode_kernel_matches_torch(num_splits):
    case = make_case([(70, 1), (33, 1), (15, 1), (0, 1)], num_heads=4, num_kv_heads=2,
                     head_dim=16, block_size=16, seed=num_splits)
    want, _, _ = torch_reference(case)
    meta = case.meta
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    kernels.write_kv(case.k, case.v, k_cache, v_cache, meta.slot_mapping)
    out = torch.full_like(case.q, float("nan"))
    kernels.split_decode_attention(case.q, k_cache, v_cache, out, meta.query_start_loc,
                                   meta.seq_lens, meta.block_table, case.scale,
                                   num_seqs=meta.num_seqs, num_splits=num_splits, tile_n=16)
    torch.testing.assert_close(out, want, atol=ATOL, rtol=0)


def test_padded_decode_step_skips_padding():
    """A decode-only step padded to a graph bucket, prepared as a capture prepares it (no
    context known, so the split kernel runs): real rows equal the unpadded torch step, padding
    rows are zeros and write nothing."""
    shape = [(40, 1), (17, 1), (3, 1)]
    padded = make_case(shape, num_heads=4, num_kv_heads=2, head_dim=16, block_size=16, seed=5,
                       pad_to=8)
    meta = replace(padded.meta, max_seq_len=None)
    unpadded = make_case(shape, num_heads=4, num_kv_heads=2, head_dim=16, block_size=16, seed=5)
    want, want_k, want_v = torch_reference(unpadded)
    step = triton_backend(4, 2, num_sms=32).prepare(meta)
    assert step.num_splits == 4  # 8 x 2 programs for 32 SMs: 4 splits make two waves
    k_cache, v_cache = padded.k_cache.clone(), padded.v_cache.clone()
    got = step.forward(padded.q, padded.k, padded.v, (k_cache, v_cache), padded.scale)
    torch.testing.assert_close(got[:3], want, atol=ATOL, rtol=0)
    assert torch.equal(got[3:], torch.zeros_like(got[3:]))
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


def test_decode_graph_runner_equals_eager(monkeypatch):
    """The tiny model through the Worker with the Triton backend and the fused layers (the
    CUDA path): mixed steps (chunked prefills over cached blocks, decodes) run eagerly,
    decode-only steps through `DecodeGraphs` (padding to a bucket, static buffers, every
    bucket captured before the first step and none inside one; on CPU a "replay" calls the
    captured forward with the arguments fixed at capture, as a graph would). Same logits and
    tokens as the eager torch path. Bucket 4 is replayed with fewer sequences after a full
    one, so stale static entries would show."""
    from tests.workers.helpers import Driver, random_ids
    from workers.cuda_graphs import DecodeGraphs
    from workers.kernels.fused_llama import FusedLlama
    from workers.worker import Worker

    captured: list[int] = []

    def record(self, forward):
        captured.append(len(self.graphs))
        return forward

    monkeypatch.setattr(DecodeGraphs, "_record", record)
    prompts = {rid: random_ids(n, i, 512) for i, (rid, n) in enumerate(
        [("a", 20), ("b", 12), ("c", 35), ("d", 5)])}
    schedule = [{"a": 20, "b": 12, "c": 16, "d": 5}, {"a": 1, "b": 1, "c": 19, "d": 1},
                {"a": 1, "b": 1, "c": 1, "d": 1}, {"a": 1, "b": 1, "c": 1}, {"d": 1},
                {"a": 1, "b": 1}, {"a": 1, "b": 1, "c": 1, "d": 1}]
    runs = []
    for backend in ("torch", "triton"):
        worker = Worker("builtin:tiny", num_kv_blocks=32, block_size=16, keep_logits=True)
        cfg = worker.model_config
        if backend == "triton":
            # 8 "SMs": bucket 4 runs the unified kernel, buckets 2 and 1 the split one.
            worker.backend = triton_backend(cfg.num_attention_heads, cfg.num_key_value_heads,
                                            num_sms=8)
            worker.forward = FusedLlama(worker.model)
            worker.graphs = DecodeGraphs(worker.forward, worker.kv_caches, worker.backend,
                                         max_batch=4, max_blocks_per_seq=8, block_size=16,
                                         hidden_size=cfg.hidden_size, dtype=torch.float32,
                                         device=CPU)
            kv_before = [(k.clone(), v.clone()) for k, v in worker.kv_caches]
            assert worker._warm_up() > 0  # what a CUDA worker runs at start
            assert sorted(worker.graphs.graphs) == [1, 2, 4] and len(captured) == 3
            for (k, v), (k0, v0) in zip(worker.kv_caches, kv_before, strict=True):
                assert torch.equal(k, k0) and torch.equal(v, v0)  # the warm-up wrote no K/V
        driver = Driver(worker)
        for rid, ids in prompts.items():
            driver.add(rid, ids)
        logits = []
        for step in schedule:
            driver.step(step)
            logits += [worker.span_logits[rid] for rid in step]
        runs.append((logits, driver.tokens, worker))
    (want, want_tokens, _), (got, got_tokens, worker) = runs
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
    assert got_tokens == want_tokens
    assert len(captured) == 3  # at start only, once per bucket
