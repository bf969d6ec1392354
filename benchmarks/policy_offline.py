"""Offline throughput on a fixed set of requests: `transformers` static batching vs ours.

What a user reaches for without a server: `model.generate` on padded static batches. Prompts
of a batch are left-padded to the batch's longest (decoder-only models continue from the
right edge), and the batch runs until its longest output is done: every shorter request pays
for the padding and the tail. Only the tokens each request asked for count as useful, so
tokens/s here is useful output tokens per wall second, the same count ours produces.
EOS is disabled on both sides (`ignore_eos`), so both generate exactly the same amounts.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.policy_metrics import offline_composition
from benchmarks.policy_workloads import MixRequest
from benchmarks.virtual_time import Arrival, VirtualClock, drive, warm_up
from cluster.engine import LocalEngine

PAD_ID = 0  # the presets' <pad>


def _batches(requests: list[MixRequest], size: int) -> list[list[MixRequest]]:
    return [requests[i:i + size] for i in range(0, len(requests), size)]


def _generate(model: Any, batch: list[MixRequest]) -> int:
    """One padded static batch; returns the tokens generated (padding waste included)."""
    width = max(len(r.prompt) for r in batch)
    ids = torch.full((len(batch), width), PAD_ID, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for row, req in enumerate(batch):
        ids[row, width - len(req.prompt):] = torch.tensor(req.prompt)
        mask[row, width - len(req.prompt):] = 1
    max_new = max(r.max_tokens for r in batch)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new,
                             pad_token_id=PAD_ID)
    return int((out.shape[1] - width) * len(batch))


def transformers_static(model_path: Path, requests: list[MixRequest],
                        batch_size: int) -> dict[str, Any]:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # ignore_eos, as ours runs
    _generate(model, [MixRequest(0.0, r.prompt[:16], 2) for r in requests[:2]])  # warm-up
    start = time.perf_counter()
    generated = sum(_generate(model, batch) for batch in _batches(requests, batch_size))
    wall = time.perf_counter() - start
    useful = sum(r.max_tokens for r in requests)
    prompt = sum(len(r.prompt) for r in requests)
    return {"batch_size": batch_size, "num_batches": len(_batches(requests, batch_size)),
            "wall_s": wall, "output_tokens": useful,
            "generated_tokens_incl_padding_tail": generated,
            "output_tokens_per_s": useful / wall, "total_tokens_per_s": (useful + prompt) / wall}


def tokenflow_offline(engine: LocalEngine, clock: VirtualClock,
                      requests: list[MixRequest]) -> dict[str, Any]:
    """All requests at once, as `cluster.batch --local` submits them; driven step by step
    (nothing arrives later, so virtual time is the steps' wall time) to keep the step
    composition for the report."""
    warm_up(engine, clock, [r.prompt[:16] for r in requests[:2]], 2, "offline-warm")
    arrivals = [Arrival(clock.now, f"offline-{i}", r.prompt, r.max_tokens)
                for i, r in enumerate(requests)]
    start = time.perf_counter()
    trace = drive(engine, clock, arrivals)
    wall = time.perf_counter() - start
    out = sum(len(r.token_times) for r in trace.requests.values())
    assert out == sum(r.max_tokens for r in requests), "ignore_eos: every request runs to max"
    prompt = sum(len(r.prompt) for r in requests)
    config = engine.scheduler.config
    return {"max_num_batched_tokens": config.max_num_batched_tokens,
            "max_chunk_tokens": config.max_chunk_tokens, "wall_s": wall, "output_tokens": out,
            "output_tokens_per_s": out / wall, "total_tokens_per_s": (out + prompt) / wall,
            "steps": offline_composition(trace)}
