"""A fake worker for scheduler tests. Torch-free.

It keeps its own per-request state, built only from the plans' diffs (as the real worker
does; a scheduled request without a diff continues where its last step left it), and checks
every diff against it: a cached request it does not hold, a
`num_computed_tokens` that disagrees with what it computed, or a block table too small for
the scheduled tokens fails the test. With `check_kv` it also keeps what each KV slot holds
(which tokens the position was computed from) and fails a step that would attend over a
slot holding anything else: a prefix hit on a block never written or overwritten since, a
block freed while still read, a lost defragmentation move. It samples a seeded token
whenever a request's known tokens are all computed, and reports `chunk_complete` events
with a scripted cost and bandwidth. A burst (`StepPlan.num_steps`) runs its spans that many
times, its decodes each on the token sampled the time before, its chunk (one at most) on
the prompt's next tokens, each step with its own events, as the worker does.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from controller.messages import ChunkComplete, StepPlan, StepResult
from controller.scheduler import Scheduler


@dataclass
class _FakeRequest:
    token_ids: list[int]  # prompt + sampled, as this worker knows them
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int


class FakeRunner:
    def __init__(self, scheduler: Scheduler | None = None, vocab_size: int = 100, seed: int = 0,
                 chunk_cost: Callable[[str, int, int], float] | None = None,
                 bandwidth: Callable[[], float | None] | None = None,
                 block_size: int | None = None,
                 sample: Callable[[list[int]], int] | None = None, check_kv: bool = False):
        self.scheduler = scheduler  # only for `step()`; execute reads the plan alone
        self.vocab_size = vocab_size
        if block_size is None:
            assert scheduler is not None, "a block size or a scheduler to take it from"
            block_size = scheduler.block_size
        self.block_size = block_size
        self.rng = random.Random(seed)
        self.requests: dict[str, _FakeRequest] = {}
        self.request_to_num_chunks: dict[str, int] = {}
        # (request_id, start, num_tokens) -> seconds the chunk "took"
        self.chunk_cost = chunk_cost or (lambda rid, start, n: 1e-4 * n)
        self.bandwidth = bandwidth or (lambda: None)
        # token ids so far -> the next token; default: a seeded draw (depends on step order)
        self.sample = sample or (lambda token_ids: self.rng.randrange(self.vocab_size))
        # block id -> per slot, the tokens (as a tuple) whose last one was computed there
        self.kv: dict[int, list[tuple[int, ...] | None]] | None = {} if check_kv else None
        self.num_kv_checked = 0  # context slots verified
        self.num_bursts = 0  # plans with num_steps > 1 run
        self.num_chunk_bursts = 0  # ... of them with a chunk

    @property
    def held(self) -> dict[str, list[int]]:
        """Request id -> block ids, as the diffs built them."""
        return {rid: r.block_ids for rid, r in self.requests.items()}

    def execute(self, plan: StepPlan) -> StepResult:
        for request_id in plan.finished_request_ids:
            self.requests.pop(request_id, None)
        for req in self.requests.values():  # defragmentation renames blocks
            req.block_ids[:] = [plan.block_moves.get(b, b) for b in req.block_ids]
        if self.kv is not None and plan.block_moves:  # and copies their KV, all at once
            moved = {dst: self.kv.get(src) for src, dst in plan.block_moves.items()}
            for dst, slots in moved.items():
                if slots is None:
                    self.kv.pop(dst, None)
                else:
                    self.kv[dst] = list(slots)
        for new in plan.new_requests:
            assert new.request_id not in self.requests, f"{new.request_id} sent new twice"
            num_prompt = len(new.token_ids) - new.num_output_tokens
            self.requests[new.request_id] = _FakeRequest(
                list(new.token_ids), num_prompt, list(new.block_ids), new.num_computed_tokens)
        for cached in plan.cached_requests:
            req = self.requests.get(cached.request_id)
            assert req is not None, f"diff for {cached.request_id}, which the worker never got"
            assert cached.num_computed_tokens == req.num_computed_tokens, (
                cached.request_id, cached.num_computed_tokens, req.num_computed_tokens)
            req.block_ids.extend(cached.new_block_ids)
        scheduled_ids = set(plan.num_scheduled_tokens)
        sent_ids = {n.request_id for n in plan.new_requests} | {
            c.request_id for c in plan.cached_requests}
        assert sent_ids <= scheduled_ids, "a diff for a request this step does not run"
        for request_id in scheduled_ids - sent_ids:  # no diff: where the last step left it
            assert request_id in self.requests, f"{request_id} scheduled, never sent"
        result = StepResult(step_id=plan.step_id, num_tokens=plan.total_num_scheduled_tokens,
                            bandwidth_utilization=self.bandwidth())
        if plan.num_steps > 1:  # a burst: the same spans num_steps times, one chunk at most
            chunks = [rid for rid, n in plan.num_scheduled_tokens.items() if n > 1]
            assert len(chunks) <= 1, "a burst of several chunks"
            self.num_bursts += 1
            self.num_chunk_bursts += bool(chunks)
        for _ in range(plan.num_steps):
            step = StepResult(plan.step_id)
            self._run_spans(plan, step, is_burst=plan.num_steps > 1)
            for request_id, tokens in step.sampled_token_ids.items():
                result.sampled_token_ids.setdefault(request_id, []).extend(tokens)
            result.chunk_events += step.chunk_events
            result.elapsed_s += step.elapsed_s
        result.num_tokens *= plan.num_steps
        return result

    def _run_spans(self, plan: StepPlan, result: StepResult, is_burst: bool) -> None:
        for request_id, num_new in plan.num_scheduled_tokens.items():
            req = self.requests[request_id]
            start = req.num_computed_tokens
            end = start + num_new
            assert num_new > 0 and end <= len(req.token_ids), (request_id, start, num_new)
            # A burst's chunk never samples: the next step would schedule past its tokens.
            assert not (is_burst and num_new > 1 and end == len(req.token_ids)), request_id
            assert end <= len(req.block_ids) * self.block_size, "block table too small"
            if self.kv is not None:
                self._check_and_write_kv(request_id, req, start, end)
            req.num_computed_tokens = end
            sampled = [self.sample(req.token_ids)] if end == len(req.token_ids) else []
            req.token_ids.extend(sampled)
            result.sampled_token_ids.setdefault(request_id, []).extend(sampled)
            if start < req.num_prompt_tokens:
                index = self.request_to_num_chunks.get(request_id, 0)
                self.request_to_num_chunks[request_id] = index + 1
                elapsed = self.chunk_cost(request_id, start, num_new)
                result.chunk_events.append(
                    ChunkComplete(request_id, index, start, num_new, elapsed, 0))
                result.elapsed_s = max(result.elapsed_s, elapsed)

    def _check_and_write_kv(self, request_id: str, req: _FakeRequest, start: int,
                            end: int) -> None:
        """The span attends over positions 0..end-1: those before it must hold this
        request's own tokens (computed earlier, or shared by a prefix hit); then it writes
        its own. A step's spans are checked in plan order, as if each wrote before the next
        read, which no two spans of one step can tell apart (they share no block unless it
        is full and read-only)."""
        assert self.kv is not None
        size = self.block_size
        for p in range(start):
            slots = self.kv.get(req.block_ids[p // size])
            held = slots[p % size] if slots is not None else None
            assert held == tuple(req.token_ids[:p + 1]), (
                f"{request_id}: position {p} in block {req.block_ids[p // size]} holds KV of "
                f"{held}, not of its own tokens")
        self.num_kv_checked += start
        for p in range(start, end):
            slots = self.kv.setdefault(req.block_ids[p // size], [None] * size)
            slots[p % size] = tuple(req.token_ids[:p + 1])

    def step(self) -> list:
        assert self.scheduler is not None
        plan = self.scheduler.schedule()
        return self.scheduler.update_from_output(plan, self.execute(plan))
