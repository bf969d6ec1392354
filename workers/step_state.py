"""What a worker keeps per request between steps (`RequestState`), a step it launched and
has not waited for (`PendingStep`), and its thread count."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from controller.messages import (
    SamplingParams,
    StepPlan,
)
from workers.attention import SeqSpan
from workers.logprobs import ScoredRows


@dataclass
class RequestState:
    token_ids: list[int]  # prompt + generated, including tokens sampled by this worker
    num_computed: int  # tokens whose K/V are in the cache
    num_admitted_tokens: int  # len(token_ids) at admission: spans starting before are prefill
    num_output_tokens: int
    sampling_params: SamplingParams
    num_chunks: int = 0  # ChunkComplete events emitted so far (next chunk_index)
    # The block table row, kept as a growable int64 array: a step copies its first blocks
    # into the step's table with one slice assignment, whatever the context length.
    _blocks: np.ndarray = field(default_factory=lambda: np.zeros(8, dtype=np.int64))
    _num_blocks: int = 0
    # Positions past it are outputs (prompt log-probabilities): set from the admission.
    num_prompt_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        self.num_prompt_tokens = self.num_admitted_tokens - self.num_output_tokens

    @property
    def block_ids(self) -> np.ndarray:
        return self._blocks[: self._num_blocks]

    def add_blocks(self, block_ids: list[int]) -> None:
        end = self._num_blocks + len(block_ids)
        if end > len(self._blocks):
            grown = np.zeros(max(end, 2 * len(self._blocks)), dtype=np.int64)
            grown[: self._num_blocks] = self.block_ids
            self._blocks = grown
        self._blocks[self._num_blocks : end] = block_ids
        self._num_blocks = end


@dataclass
class PendingStep:
    """A launched step (`Worker.launch`) until its result is taken (`Worker.wait`)."""

    plan: StepPlan
    start_s: float  # perf_counter at launch
    end_s: float | None = None  # CPU: when the step had run (inside `launch`)
    start_event: torch.cuda.Event | None = None  # CUDA: recorded before the step's work
    spans: dict[str, SeqSpan] = field(default_factory=dict)  # plan order
    sampling_ids: list[str] = field(default_factory=list)  # requests that sample, in order
    tokens: list[int] = field(default_factory=list)  # sampled ids, once on the host
    host_ids: Tensor | None = None  # CUDA: pinned buffer the ids are copied into
    done: torch.cuda.Event | None = None  # CUDA: recorded after that copy
    # Log-probabilities queued on the device (workers/logprobs.py): the sampling rows that
    # asked, and per echo request (id, first position, its prompt tokens, their scores).
    sampled_scores: tuple[list[str], ScoredRows] | None = None
    prompt_scores: list[tuple[str, int, list[int], ScoredRows]] = field(default_factory=list)


def resolve_num_threads(num_threads: int) -> int:
    """N > 0 threads as given; -1 every core this process may run on (Ray pins an actor
    to its reserved CPUs otherwise), -2 all but one, ...; at least one."""
    if num_threads == 0:  # as `worker.num_threads` is checked in the configuration
        raise ValueError("num_threads must not be 0 (-1 means every core)")
    if num_threads > 0:
        return num_threads
    return max(1, len(os.sched_getaffinity(0)) + 1 + num_threads)
