"""A decode burst's steps 2.. in one tight loop (CPU fp32 worker: the C++ decode stack and the
greedy screen), instead of a whole `Worker._launch` each.

Why: inside a decode burst (controller/decode_burst.py) each further step changes nothing
but the ids fed back and one more position per request, yet `_launch` rebuilds everything
from the plan: the flat batch's order, a `SeqSpan` per request, the step's metadata, the
attention step, the sampling rows, and `_finish_step`'s per-request bookkeeping, all in
Python while torch's threads wait. Here the burst's whole metadata is built once (every
step's positions, context lengths and slots in one numpy pass), and a step is four calls:
the embedding, the rotary tables, the stack, the screen. Its tokens reach the requests'
states once, after the last step.

Exactness: the same kernels on the same inputs as `_launch`'s path for such a step (the
ids the step before sampled at the next position, each context one key longer, the new
key's slot from the request's blocks; the block table only wider, read up to each context),
so the tokens are the single steps' tokens. Taken only where `_launch` would run exactly
that path (`loopable`); anything else runs step by step as before.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import numpy as np
import torch

from controller.messages import StepResult
from workers.greedy_head import GreedyHead
from workers.model_config import ModelConfig
from workers.step_state import PendingStep, RequestState


class Worker(Protocol):
    """What the loop reads of `workers.worker.Worker` (which imports this module)."""

    model: Any
    forward: Any
    backend: Any
    graphs: Any
    kv_provenance: Any
    device: torch.device
    dtype: torch.dtype
    keep_logits: bool
    greedy_head: GreedyHead | None
    block_size: int
    vocab_size: int
    _config: ModelConfig
    _requests: dict[str, RequestState]

    def _is_screened(self, sampling_ids: list[str]) -> bool: ...

    def _fixed_bytes(self, num_sampled: int) -> int: ...

    def _token_bytes(self, num_kv_tokens: int, num_query_tokens: int) -> int: ...


def loopable(worker: Worker, pending: PendingStep) -> list[str] | None:
    """The requests of the burst's first step in batch-row order where the loop runs its
    further steps exactly as `_launch` would (every row a sampled greedy decode on the C++
    stack and the screen, nothing scored, no KV checks), else None."""
    model, spans = worker.model, pending.spans
    stack = getattr(model, "decode_stack", None)
    if (stack is None or worker.forward is not model or worker.device.type != "cpu"
            or worker.dtype != torch.float32 or worker.keep_logits
            or worker.kv_provenance is not None or worker.graphs is not None
            or getattr(worker.backend, "decode_kernel", None) is None
            or not spans or len(spans) > stack.max_rows
            or len(pending.sampling_ids) != len(spans)
            or pending.sampled_scores is not None or pending.prompt_scores
            or not worker._is_screened(pending.sampling_ids)):
        return None
    for request_id, span in spans.items():
        state = worker._requests[request_id]
        if span.num_query_tokens != 1 or span.context_len - 1 < state.num_admitted_tokens:
            return None
    return sorted(spans, key=lambda rid: spans[rid].query_start)


@torch.inference_mode()
def run_decode_loop(worker: Worker, pending: PendingStep, result: StepResult,
                    num_more: int) -> bool:
    """Steps 2..num_more + 1 of the burst whose first step is `pending` (its tokens already
    in `result` and the requests' states), into `result`. False where the loop does not
    apply or a request lacks the blocks or the model length for them (the step-by-step
    path then runs, and fails as it would)."""
    order = loopable(worker, pending)
    if order is None:
        return False
    start_s = time.perf_counter()
    block_size = worker.block_size
    states = [worker._requests[rid] for rid in order]
    ctx = np.fromiter((pending.spans[rid].context_len for rid in order), np.int64, len(order))
    last = ctx + num_more  # each request's context after the burst's last step
    num_blocks = -(-last // block_size)
    if int(last.max()) > worker._config.max_model_len or any(
            n > len(state.block_ids) for n, state in zip(num_blocks.tolist(), states,
                                                         strict=True)):
        return False
    num_rows, width = len(order), int(num_blocks.max())
    table = np.zeros((num_rows, width), dtype=np.int64)  # [T, W]
    for row, (state, n) in enumerate(zip(states, num_blocks.tolist(), strict=True)):
        table[row, :n] = state.block_ids[:n]
    steps = np.arange(1, num_more + 1, dtype=np.int64)[:, None]  # [num_more, 1]
    positions = ctx[None, :] - 1 + steps  # [num_more, T]: each step's new token
    seq_lens = positions + 1
    rows = np.arange(num_rows)[None, :]
    slots = table[rows, positions // block_size] * block_size + positions % block_size
    table_t, positions_t = torch.from_numpy(table), torch.from_numpy(positions)
    seq_lens_t, slots_t = torch.from_numpy(seq_lens), torch.from_numpy(slots)

    model, stack, head = worker.model, worker.model.decode_stack, worker.greedy_head
    assert head is not None  # `loopable` checked `_is_screened`
    ids = torch.tensor([result.sampled_token_ids[rid][-1] for rid in order],
                       dtype=torch.long)  # [T]
    sampled = []
    for step in range(num_more):
        x = model.model.embed_tokens(ids)  # [T, hidden], the stack's own residual stream
        cos, sin = model.rotary_emb(positions_t[step], torch.float32)  # [T, hd/2] each
        hidden = stack.forward(x, cos, sin, (table_t, seq_lens_t[step], slots_t[step]))
        ids = head.ids(hidden)  # [T]
        sampled.append(ids)
    tokens = torch.stack(sampled, dim=1).tolist()  # [T, num_more]

    for request_id, state, row_tokens in zip(order, states, tokens, strict=True):
        state.token_ids.extend(row_tokens)
        state.num_computed += num_more
        state.num_output_tokens += num_more
        result.sampled_token_ids[request_id].extend(row_tokens)
    # `_finish_step`'s bytes, summed over the steps: each step's weights and logits, each
    # request's KV read and written and its one token's activations.
    kv_tokens = int(seq_lens.sum()) + num_rows * num_more  # read + written, all steps
    result.bytes_moved += (worker._fixed_bytes(num_rows) * num_more
                           + worker._token_bytes(kv_tokens, num_rows * num_more))
    result.num_tokens += num_rows * num_more
    result.elapsed_s += time.perf_counter() - start_s
    return True
