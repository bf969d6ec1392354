"""A stand-in worker actor whose step takes a fixed time: the Ray path's overhead, alone.

`StandInWorkerActor` answers the controller like `workers.actor.WorkerActor` (same
constructor, `info`, `execute`, `held_block_ids`, the same `StepGate` ordering two calls
at once) but runs no model: it keeps per-request state from the plan's diffs exactly as
the real worker does, waits `STEP_S`, and returns a
plausible `StepResult` (a token for every span that reaches the end of its known tokens,
a `ChunkComplete` for every prefill span). Against it, a step's wall time minus `STEP_S` is
what the controller and Ray add around a GPU step of that length.
"""

from __future__ import annotations

import os
import random
import time
import uuid
from dataclasses import dataclass
from typing import Any

from controller.messages import (
    ChunkComplete,
    StepPlan,
    StepResult,
    decode_plan,
    encode_message,
)
from workers.actor import WorkerInfo, WorkerRestartedError
from workers.step_gate import WORKER_MAX_CONCURRENCY, StepGate

STEP_S = 0.003  # a decode step of a 1B model on an H200, as the GPU path targets


@dataclass
class _State:
    num_tokens: int  # known: prompt + sampled
    num_admitted: int
    num_computed: int
    block_ids: list[int]
    num_chunks: int = 0


class StandInWorkerActor:
    MAX_CONCURRENCY = WORKER_MAX_CONCURRENCY  # as `WorkerActor`: the same two-call overlap

    def __init__(self, section: Any, cache: Any) -> None:
        """The `worker:` and `cache:` sections, as `WorkerActor` takes them; of the worker's
        settings only the model and the seed matter: nothing runs on a device here."""
        from workers.model_config import ModelConfig
        from workers.presets import resolve_model

        self.model_path = resolve_model(section.model)
        self.config = ModelConfig.from_file(self.model_path / "config.json")
        self.num_kv_blocks, self.block_size = cache.num_kv_blocks, cache.block_size
        self.rng = random.Random(section.seed)
        self.states: dict[str, _State] = {}
        self.gate = StepGate()
        self.incarnation = uuid.uuid4().hex

    def info(self) -> WorkerInfo:
        return WorkerInfo(self.num_kv_blocks, self.block_size, self.config.vocab_size,
                          tuple(self.config.eos_token_ids), self.config.max_model_len,
                          str(self.model_path), "stand-in", os.getpid(), 1, self.incarnation)

    def execute(self, plan: StepPlan | bytes, incarnation: str | None = None,
                sender: str | None = None, seq: int | None = None) -> StepResult | bytes:
        step = decode_plan(plan)
        with self.gate.turn(sender, seq):
            if incarnation is not None and incarnation != self.incarnation:
                raise WorkerRestartedError(f"plan for incarnation {incarnation}")
            result = self._execute(step)
        return encode_message(result) if isinstance(plan, bytes) else result

    def _execute(self, plan: StepPlan) -> StepResult:
        start = time.perf_counter()
        for request_id in plan.finished_request_ids:
            self.states.pop(request_id, None)
        if plan.block_moves:  # as the real worker: no pass over every request otherwise
            for state in self.states.values():
                state.block_ids = [plan.block_moves.get(b, b) for b in state.block_ids]
        for new in plan.new_requests:
            self.states[new.request_id] = _State(len(new.token_ids), len(new.token_ids),
                                                 new.num_computed_tokens, list(new.block_ids))
        for cached in plan.cached_requests:
            state = self.states[cached.request_id]
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed = cached.num_computed_tokens
        result = StepResult(step_id=plan.step_id)
        for request_id, num in plan.num_scheduled_tokens.items():
            state = self.states[request_id]
            begin, end = state.num_computed, state.num_computed + num
            if end > state.num_tokens:
                raise ValueError(f"{request_id}: scheduled up to {end} of {state.num_tokens}")
            if num > 1 or begin < state.num_admitted:
                result.chunk_events.append(ChunkComplete(request_id, state.num_chunks, begin,
                                                         num, STEP_S, 0))
                state.num_chunks += 1
            state.num_computed = end
            sampled = end == state.num_tokens
            # Ids past the specials (0..2), so no stand-in token is an EOS by accident.
            result.sampled_token_ids[request_id] = (
                [self.rng.randrange(3, self.config.vocab_size)] if sampled else [])
            state.num_tokens += sampled
            result.num_tokens += num
        # The GPU's share of the step: a fixed wait stands in for the kernels.
        time.sleep(max(0.0, STEP_S - (time.perf_counter() - start)))
        result.elapsed_s = time.perf_counter() - start
        return result

    def held_block_ids(self) -> set[int]:
        with self.gate.turn():
            return {b for state in self.states.values() for b in state.block_ids}

    def num_active_requests(self) -> int:
        with self.gate.turn():
            return len(self.states)

    def reset(self) -> int:
        with self.gate.turn():
            num_requests = len(self.states)
            self.states.clear()
            self.gate.retire()
            return num_requests
