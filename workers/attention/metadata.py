"""Per-step inputs of the model and its attention, built once on the host, sent in one copy.

Flat batch: the step's scheduled spans laid end to end, `T` tokens from `S` requests. The
worker puts the 1-token spans (decodes) first, longest context first, then the multi-token
spans (prefill chunks); `num_decodes` counts that leading run. Everything the kernels need is
packed into one int64 host buffer, pinned on CUDA, and copied to the device with one
non-blocking copy; the device tensors below are views into that one copy:

    input_ids       [T]       token ids
    positions       [T]       global positions (`context_len - num_query_tokens + i`)
    slot_mapping    [T]       where each new token's K/V is written; -1 = padding, no write
    query_start_loc [S + 1]   first row of each span in the flat batch, then T
    seq_lens        [S]       keys visible after the step (= context_len), 0 for padding
    block_table     [S, W]    each span's first W = max ceil(seq_len / block_size) blocks,
                              zero past a span's own blocks
    logits_indices  [R]       rows whose logits are computed (the sampled spans' last rows)
    extra           any       int64 arrays a caller adds to the same copy (the sampler's
                              per-row parameters, floats as their float64 bits)

No `[n, context]` mask is built here: causality follows from positions and `seq_lens`.
A decode-only step can be padded to a CUDA-graph bucket (`pad_to`): the extra sequences have
one token, `seq_len` 0 and slot -1, so the kernels neither read nor write anything for them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor


@dataclass(frozen=True)
class SeqSpan:
    """One request's slice of the flat batch, as the worker schedules it."""

    query_start: int  # index of its first token in the flat batch
    num_query_tokens: int
    context_len: int  # num_computed + num_query_tokens, i.e. keys visible after this step
    block_ids: Sequence[int] | np.ndarray  # the request's blocks, at least ceil(ctx / bs)


class HostStaging:
    """The host buffer a step's integers are packed into.

    On CUDA it is pinned and reused, so the copy to the device is asynchronous; an event
    recorded after each copy is waited on before the buffer is written again (normally long
    done: the step's sampled ids were copied back since). On CPU every step gets a fresh
    array and the "device" tensors are views of it (no copy at all)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pinned = device.type == "cuda"
        self._buf: Tensor | None = None
        self._event: torch.cuda.Event | None = None

    def take(self, size: int) -> np.ndarray:
        if not self.pinned:
            return np.empty(size, dtype=np.int64)
        if self._event is not None:
            self._event.synchronize()
        if self._buf is None or self._buf.numel() < size:
            capacity = max(size, 2 * (0 if self._buf is None else self._buf.numel()), 4096)
            self._buf = torch.empty(capacity, dtype=torch.int64, pin_memory=True)
        return self._buf.numpy()[:size]

    def upload(self, host: np.ndarray) -> Tensor:
        if not self.pinned:
            return torch.from_numpy(host)
        assert self._buf is not None
        device_copy = self._buf[: host.size].to(self.device, non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record()
        return device_copy


@dataclass(frozen=True)
class StepMetadata:
    input_ids: Tensor
    positions: Tensor
    slot_mapping: Tensor
    query_start_loc: Tensor
    seq_lens: Tensor
    block_table: Tensor
    logits_indices: Tensor
    block_size: int
    num_tokens: int  # T, padding included
    num_seqs: int  # S, padding included
    num_decodes: int  # leading spans of one query token (padding included)
    max_query_len: int
    # Longest context of the step; None where it must not be relied on (a CUDA-graph capture,
    # whose kernels are replayed for any context).
    max_seq_len: int | None
    # Host copies of the per-span numbers (no device read-back ever needed).
    query_start_np: np.ndarray  # [S + 1]
    seq_lens_np: np.ndarray  # [S]
    num_real_tokens: int  # T before padding
    num_real_seqs: int  # S before padding
    extra: tuple[Tensor, ...] = ()  # device views of `build`'s `extra` arrays, in order

    @property
    def is_decode_only(self) -> bool:
        return self.num_decodes == self.num_seqs

    @classmethod
    def build(
        cls,
        spans: Sequence[SeqSpan],
        input_ids: Sequence[int] | np.ndarray,
        block_size: int,
        staging: HostStaging,
        logits_indices: Sequence[int] = (),
        pad_to: int | None = None,
        extra: Sequence[np.ndarray] = (),
    ) -> StepMetadata:
        """`spans` in flat-batch order (each starts where the previous ends). `extra`: int64
        arrays uploaded in the same copy (one copy and no sync for everything a step sends)."""
        num_seqs = len(spans)
        if num_seqs == 0:
            raise ValueError("a step needs at least one span")
        q_lens = np.fromiter((s.num_query_tokens for s in spans), np.int64, num_seqs)
        ctx = np.fromiter((s.context_len for s in spans), np.int64, num_seqs)
        num_blocks = -(-ctx // block_size)
        for span, needed in zip(spans, num_blocks.tolist(), strict=True):
            if needed > len(span.block_ids):
                raise ValueError(
                    f"context of {span.context_len} tokens needs {needed} blocks, request "
                    f"holds {len(span.block_ids)}"
                )
        num_tokens = int(q_lens.sum())
        if len(input_ids) != num_tokens:
            raise ValueError(f"{len(input_ids)} input ids for {num_tokens} scheduled tokens")
        not_decode = np.flatnonzero(q_lens != 1)
        num_decodes = int(not_decode[0]) if not_decode.size else num_seqs
        padded = num_seqs if pad_to is None else pad_to
        if pad_to is not None and (num_decodes != num_seqs or pad_to < num_seqs):
            raise ValueError(f"only a decode-only step of <= {pad_to} spans can be padded")
        padded_tokens = num_tokens + (padded - num_seqs)
        width = max(int(num_blocks.max()), 1)

        sizes = (padded_tokens, padded_tokens, padded_tokens, padded + 1, padded,
                 padded * width, len(logits_indices), *(len(a) for a in extra))
        # Each array starts on a 16-byte boundary (an even number of int64s): Triton
        # specialises a kernel on its pointers' alignment, so offsets that moved with the
        # step's counts compiled a new variant mid-serving (seen on an H200: ~0.7 s a step).
        slots_of = [n + (n & 1) for n in sizes]
        host = staging.take(sum(slots_of))
        ids, pos, slots, qsl, lens, table, logit_rows, *extra_host = (
            seg[:n] for seg, n in zip(np.split(host, np.cumsum(slots_of)[:-1]), sizes,
                                      strict=True))
        for dst, src in zip(extra_host, extra, strict=True):
            dst[:] = src
        table2d = table.reshape(padded, width)

        ids[:num_tokens] = input_ids
        ids[num_tokens:] = 0
        qsl[0] = 0
        np.cumsum(q_lens, out=qsl[1 : num_seqs + 1])
        qsl[num_seqs + 1 :] = np.arange(num_tokens + 1, padded_tokens + 1)
        lens[:num_seqs] = ctx
        lens[num_seqs:] = 0
        table[:] = 0
        for row, (span, n) in enumerate(zip(spans, num_blocks.tolist(), strict=True)):
            table2d[row, :n] = span.block_ids[:n]
        seq_of_token = np.repeat(np.arange(num_seqs), q_lens)  # [T]
        token_pos = np.arange(num_tokens) - qsl[seq_of_token] + (ctx - q_lens)[seq_of_token]
        pos[:num_tokens] = token_pos
        pos[num_tokens:] = 0
        slots[:num_tokens] = table2d[seq_of_token, token_pos // block_size] * block_size
        slots[:num_tokens] += token_pos % block_size
        slots[num_tokens:] = -1
        logit_rows[:] = logits_indices

        device_buf = staging.upload(host)
        views = [seg[:n] for seg, n in zip(torch.split(device_buf, slots_of), sizes,
                                           strict=True)]
        return cls(
            input_ids=views[0], positions=views[1], slot_mapping=views[2],
            query_start_loc=views[3], seq_lens=views[4],
            block_table=views[5].view(padded, width), logits_indices=views[6],
            block_size=block_size, num_tokens=padded_tokens, num_seqs=padded,
            num_decodes=num_decodes + (padded - num_seqs),
            max_query_len=int(q_lens.max()), max_seq_len=int(ctx.max()),
            query_start_np=qsl.copy(), seq_lens_np=lens.copy(),
            num_real_tokens=num_tokens, num_real_seqs=num_seqs, extra=tuple(views[7:]),
        )
