"""A fake worker for scheduler tests: samples a seeded token whenever a request's known
tokens are all computed, as the real worker does, and reports `chunk_complete` events
with a scripted cost and bandwidth. Torch-free."""

from __future__ import annotations

import random
from collections.abc import Callable

from controller.messages import ChunkComplete, StepPlan, StepResult
from controller.scheduler import Scheduler


class FakeRunner:
    def __init__(self, scheduler: Scheduler, vocab_size: int = 100, seed: int = 0,
                 chunk_cost: Callable[[str, int, int], float] | None = None,
                 bandwidth: Callable[[], float | None] | None = None):
        self.scheduler = scheduler
        self.vocab_size = vocab_size
        self.rng = random.Random(seed)
        self.held: dict[str, list[int]] = {}  # request id -> block ids, from the diffs
        self.request_to_num_chunks: dict[str, int] = {}
        # (request_id, start, num_tokens) -> seconds the chunk "took"
        self.chunk_cost = chunk_cost or (lambda rid, start, n: 1e-4 * n)
        self.bandwidth = bandwidth or (lambda: None)

    def execute(self, plan: StepPlan) -> StepResult:
        for request_id in plan.finished_request_ids:
            self.held.pop(request_id, None)
        for block_ids in self.held.values():  # defragmentation renames blocks
            block_ids[:] = [plan.block_moves.get(b, b) for b in block_ids]
        for new in plan.new_requests:
            self.held[new.request_id] = list(new.block_ids)
        for cached in plan.cached_requests:
            self.held[cached.request_id].extend(cached.new_block_ids)
        result = StepResult(step_id=plan.step_id, num_tokens=plan.total_num_scheduled_tokens,
                            bandwidth_utilization=self.bandwidth())
        for request_id, num_new in plan.num_scheduled_tokens.items():
            request = self.scheduler.requests[request_id]
            # The worker's block table mirrors the scheduler's after applying the diffs.
            assert self.held[request_id] == self.scheduler.kv.block_ids(request_id)
            start = request.num_computed_tokens
            done = start + num_new == request.num_tokens
            result.sampled_token_ids[request_id] = (
                [self.rng.randrange(self.vocab_size)] if done else [])
            if start < request.num_prompt_tokens:
                index = self.request_to_num_chunks.get(request_id, 0)
                self.request_to_num_chunks[request_id] = index + 1
                elapsed = self.chunk_cost(request_id, start, num_new)
                result.chunk_events.append(
                    ChunkComplete(request_id, index, start, num_new, elapsed, 0))
                result.elapsed_s = max(result.elapsed_s, elapsed)
        return result

    def step(self) -> list:
        plan = self.scheduler.schedule()
        return self.scheduler.update_from_output(plan, self.execute(plan))
