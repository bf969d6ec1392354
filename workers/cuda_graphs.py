"""CUDA graphs for decode-only steps (nano-vllm's scheme), every bucket captured at start.

A decode-only step of `n` sequences is padded to the smallest bucket `B >= n` (1, 2, 4, 8,
then every 16 up to `max_batch`; `StepMetadata.build(pad_to=B)` pads on the host: one token per
extra sequence, `seq_len` 0, slot -1, so the kernels skip them). Its inputs are copied into
static device buffers and the bucket's graph is replayed: one launch instead of hundreds.
Mixed and prefill steps, and batches above `max_batch`, run eagerly.

Capture (`capture_all`, called by the worker before it reports ready, never inside a step):
largest bucket first, each from the static buffers holding padding only (slot -1, `seq_len`
0: nothing read or written), one eager run (compiles the Triton kernels, warms cuBLAS), then
the capture. All buckets share one memory pool: graphs replay one at a time on one stream
and keep nothing alive between replays but the static buffers, so sharing is safe.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

from workers.attention import AttentionBackend, KVCache, StepMetadata

log = logging.getLogger(__name__)


def graph_buckets(max_batch: int) -> list[int]:
    """Batch sizes that get a graph: 1, 2, 4, 8, 16, 32, ... every 16 up to `max_batch`
    (itself included)."""
    if max_batch < 1:
        return []
    sizes = [b for b in (1, 2, 4, 8) if b <= max_batch]
    sizes += list(range(16, max_batch + 1, 16))
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


def pick_bucket(buckets: list[int], batch: int) -> int | None:
    """The smallest bucket holding `batch` sequences; None if none does (run eagerly)."""
    for size in buckets:
        if size >= batch:
            return size
    return None


Forward = Callable[[Tensor, Tensor, object, list[KVCache]], Tensor]


class DecodeGraphs:
    def __init__(
        self, model: Forward, kv_caches: list[KVCache], backend: AttentionBackend,
        max_batch: int, max_blocks_per_seq: int, block_size: int, hidden_size: int,
        dtype: torch.dtype, device: torch.device,
    ) -> None:
        self.model, self.kv_caches, self.backend = model, kv_caches, backend
        self.buckets = graph_buckets(max_batch)
        self.max_blocks_per_seq = max_blocks_per_seq
        self.block_size = block_size
        n = self.buckets[-1]
        zeros = dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(n, **zeros)
        self.positions = torch.zeros(n, **zeros)
        self.slot_mapping = torch.full((n,), -1, **zeros)
        self.seq_lens = torch.zeros(n, **zeros)
        self.query_start_loc = torch.arange(n + 1, **zeros)  # decodes: one token each
        self.block_table = torch.zeros((n, max_blocks_per_seq), **zeros)
        self.hidden = torch.zeros((n, hidden_size), dtype=dtype, device=device)
        self.graphs: dict[int, Callable[[], None]] = {}  # bucket -> replay
        self.num_replays = 0
        self.pool = None

    def bucket_for(self, num_seqs: int, max_blocks: int) -> int | None:
        """The bucket a decode-only step runs in, or None (eager)."""
        if max_blocks > self.max_blocks_per_seq:
            return None
        return pick_bucket(self.buckets, num_seqs)

    def _static_meta(self, size: int) -> StepMetadata:
        empty = np.zeros(0, dtype=np.int64)
        return StepMetadata(
            input_ids=self.input_ids[:size], positions=self.positions[:size],
            slot_mapping=self.slot_mapping[:size], query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size], block_table=self.block_table[:size],
            logits_indices=self.input_ids[:0], block_size=self.block_size,
            num_tokens=size, num_seqs=size, num_decodes=size, max_query_len=1,
            max_seq_len=None,  # replayed for any context: kernels must not depend on it
            query_start_np=np.arange(size + 1), seq_lens_np=empty,
            num_real_tokens=size, num_real_seqs=size,
        )

    def run(self, meta: StepMetadata) -> Tensor:
        """meta: a decode-only step padded to a bucket -> hidden states [bucket, hidden]."""
        size = meta.num_seqs
        assert meta.is_decode_only and size in self.buckets
        width = meta.block_table.shape[1]
        self.input_ids[:size].copy_(meta.input_ids)
        self.positions[:size].copy_(meta.positions)
        self.slot_mapping[:size].copy_(meta.slot_mapping)
        self.seq_lens[:size].copy_(meta.seq_lens)
        self.block_table[:size, :width].copy_(meta.block_table)
        replay = self.graphs.get(size)
        if replay is None:  # a capture takes a second: never inside a step
            raise RuntimeError(f"no CUDA graph for bucket {size}: capture_all() at start")
        replay()
        self.num_replays += 1
        return self.hidden[:size]

    def capture_all(self) -> float:
        """Capture every bucket (largest first, so that the shared pool is sized once);
        progress in the log. -> seconds taken."""
        start = time.perf_counter()
        for i, size in enumerate(reversed(self.buckets)):
            if size not in self.graphs:
                self.graphs[size] = self._capture(size)
            log.info("CUDA graph %d/%d captured (batch %d), %.1f s", i + 1, len(self.buckets),
                     size, time.perf_counter() - start)
        return time.perf_counter() - start

    def _capture(self, size: int) -> Callable[[], None]:
        # Padding only: no K/V written (slot -1), none read (seq_len 0).
        self.input_ids[:size] = 0
        self.positions[:size] = 0
        self.slot_mapping[:size] = -1
        self.seq_lens[:size] = 0
        self.block_table[:size] = 0
        static = self._static_meta(size)
        step = self.backend.prepare(static)

        def forward() -> None:
            self.hidden[:size] = self.model(static.input_ids, static.positions, step,
                                            self.kv_caches)

        forward()  # warm-up: compiles the kernels, warms cuBLAS
        self._synchronize()
        return self._record(forward)

    def _record(self, forward: Callable[[], None]) -> Callable[[], None]:
        """Capture `forward` into a CUDA graph -> its replay (tests on CPU substitute an eager
        call here)."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            forward()
        if self.pool is None:
            self.pool = graph.pool()
        self._synchronize()
        return graph.replay

    def _synchronize(self) -> None:
        if self.hidden.device.type == "cuda":
            torch.cuda.synchronize(self.hidden.device)
