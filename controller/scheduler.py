"""One token budget per step, no prefill or decode phase: only `num_computed_tokens`.

Each step, for one worker, in this order and never past `max_num_batched_tokens` nor
`max_num_seqs`:
1. running requests that decode (one uncomputed token, the last sampled one): 1 token each;
2. running requests still prefilling: the next chunk;
3. waiting requests, by (priority, arrival): admitted with their first chunk.
`StepLimits` (from flow control and the protections) narrows a step further.

Nobody queues behind a long prompt: a prompt longer than
`long_prefill_token_threshold` is long; at most `max_long_partial_prefills` long prompts
are chunked at once (a long waiting prompt over that cap is passed over, not blocking the
queue), and while short prompts wait, long chunks leave them `short_prefill_share` of the
step's prefill budget, so a prompt that fits in one chunk is admitted in the next step;
with one chunk a step (throttled or degraded), short prompts and long chunks take turns.
With a step cost model and an ITL SLO, each chunk is the largest (block/tile grid) whose
step, decodes included, is predicted under the SLO at the request's depth (a share of it
while a short prompt waits): deeper chunks get smaller (with the derived SLO, never below
the smallest efficient at their depth but beside a short prompt: `slo.max_depth_stretch`).
A running request that cannot get a block preempts by recompute the lowest-priority,
latest-arrived running request (possibly itself), which returns to the waiting queue
ahead of every later arrival of its priority. Waiting requests never preempt.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator

from controller.budget import StepCost
from controller.choices import waits_for_shared_prompt
from controller.chunk_size import DepthStretch, StepSpan
from controller.decode_burst import burst_len, chunk_burst
from controller.messages import CachedRequestData, CacheEvict, NewRequestData, StepPlan
from controller.request import Request, RequestOutput, RequestStatus
from controller.scheduler_config import SchedulerConfig, SchedulerStats, StepLimits, StepShape
from controller.scheduler_results import SchedulerResults
from controller.tenants import TenantStats, seq_cap, split_budget
from kvcache.defrag import fragmentation, plan_compaction
from kvcache.manager import KVCacheManager

_SCHEDULABLE = (RequestStatus.RUNNING, RequestStatus.WAITING, RequestStatus.PREEMPTED)


class Scheduler(SchedulerResults):
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager,
                 clock: Callable[[], float] | None = None,
                 arrivals: Iterator[int] | None = None,
                 step_cost: StepCost | None = None, itl_slo_s: float | None = None,
                 depth_stretch: float = 1.0, chunk_efficiency: float = 1.0):
        self.config = config
        self.max_decode_steps = self.max_chunk_steps = 1  # controller/decode_burst.py (core)
        # Both set: chunks are sized by predicted step time (the core swaps in a refit).
        self.step_cost = step_cost
        self.itl_slo_s = itl_slo_s
        self.depth_stretch = depth_stretch  # controller/chunk_size.py
        self._depth_stretch = DepthStretch(chunk_efficiency)
        # >= 1: chunks are planned to itl_slo_s / slo_headroom (set from measured steps)
        self.slo_headroom = 1.0
        self.chunk_unit = math.lcm(kv.block_size, getattr(step_cost, "tile", 1))
        self.kv, self.block_size = kv, kv.block_size
        self.clock = clock or (lambda: 0.0)
        self.requests: dict[str, Request] = {}
        self.waiting: dict[str, Request] = {}  # ordered by sort_key when scheduling
        self.running: list[Request] = []  # admission order
        # Arrival order, one counter for all workers: a moved request keeps its place.
        self._arrivals = arrivals or itertools.count()
        self._step_ids = itertools.count()
        # id -> (blocks sent, num_computed_tokens after the last step that carried it)
        self._worker_known: dict[str, tuple[int, int]] = {}
        self._finished_ids: set[str] = set()  # to tell the worker next plan
        self.stats = SchedulerStats()
        self.tenant_stats = TenantStats()
        self.last_shape = StepShape(-1)  # of the latest plan
        self._shapes: dict[int, StepShape] = {}  # step id -> shape, until its result is in
        self._may_preempt = True  # this step's StepLimits.may_preempt
        self._long_chunk_last = False  # the latest chunk scheduled was a long prompt's

    # -- requests ----------------------------------------------------------------
    @property
    def capacity_tokens(self) -> int:
        return self.kv.pool.num_blocks * self.block_size

    def add_request(self, request: Request) -> None:
        """Queue a request. Raises ValueError when it could never fit in this pool."""
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        need = request.num_prompt_tokens + request.sampling_params.max_tokens
        if need > self.capacity_tokens:
            raise ValueError(f"prompt + max_tokens = {need} tokens exceeds the KV capacity "
                             f"of {self.capacity_tokens} tokens")
        request.arrival_seq = next(self._arrivals)
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting[request.request_id] = request

    def abort_request(self, request_id: str,
                      status: RequestStatus = RequestStatus.FINISHED_ABORTED
                      ) -> RequestOutput | None:
        """End a request where it stands. `status`: how it counts; a stop string matched
        at the edge ends it as FINISHED_STOPPED, not as an abort."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        self._finish(request, status)
        return self._output(request, [])

    def detach_request(self, request_id: str) -> Request | None:
        """Take a request away unfinished (its worker died): blocks released, progress
        reset to recompute, nothing sent to the worker. The caller re-queues it."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        self.waiting.pop(request_id, None)
        if request in self.running:
            self.running.remove(request)
            self.kv.free(request_id)
        self._worker_known.pop(request_id, None)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = request.num_pending_outputs = 0
        return request

    def adopt_request(self, request: Request) -> None:
        """Queue a detached request here, keeping its arrival order: it recomputes its
        prompt and every token it already generated, then continues where it stopped."""
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = request.num_pending_outputs = 0
        self.requests[request.request_id] = request
        self.waiting[request.request_id] = request

    def forget_worker_state(self) -> None:
        """The worker restarted and knows no request: nothing was sent to it, nothing
        needs to be dropped."""
        self._worker_known.clear()
        self._finished_ids.clear()
        self._shapes.clear()  # the steps in flight there are lost

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def has_work(self) -> bool:
        """Something to schedule, or finished ids the worker has not been told yet."""
        return bool(self.requests) or bool(self._finished_ids)

    # -- planning ------------------------------------------------------------------
    def schedule(self, limits: StepLimits | None = None) -> StepPlan:
        limits = limits or StepLimits()
        budget = self.config.max_num_batched_tokens
        plan = StepPlan(step_id=next(self._step_ids))
        plan.block_moves = self._maybe_defrag(plan.step_id)
        scheduled: dict[str, int] = {}
        num_preemptions_before = self.stats.num_preemptions
        shape = self.last_shape = self._shapes[plan.step_id] = StepShape(plan.step_id)
        self._may_preempt = limits.may_preempt

        # 1: decodes, 1 token each, before any prefill; a burst when nothing else can run.
        steps = burst_len(self, limits)
        for request in [r for r in self.running if r.is_decoding]:
            if budget == 0:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted as a victim earlier in this loop
            if request.is_done_when_pending_land:
                continue  # a step in flight samples its last token
            if self._allocate_or_preempt(request, steps, scheduled):
                scheduled[request.request_id] = 1
                budget -= 1
                self.tenant_stats.add(request.tenant, steps, is_prefill=False)
        shape.num_decodes = len(scheduled)  # preemption may have dropped earlier ones
        shape.decode_context = max((self.requests[rid].num_computed_tokens
                                    for rid in scheduled), default=0)

        # 2 + 3: partial prefills, then admissions; admissions only if nothing was
        # preempted this step (a preemption means the pool is full: admitting would thrash).
        max_chunks = self.config.max_concurrent_chunks
        if limits.max_chunks is not None:
            max_chunks = min(max_chunks, limits.max_chunks)
        allow_admission = True
        if max_chunks == 0 and limits.progress_guard and not scheduled and self.running:
            # Flow control stopped prefill, but nothing decodes: no step would ever free
            # a block (deadlock). The running prefills continue one chunk a step, so they
            # reach decode and finish; nobody new is admitted.
            max_chunks, allow_admission = 1, False
        if budget > 0 and max_chunks > 0:
            self._schedule_prefills(budget, max_chunks, scheduled, limits.chunk_cap,
                                    allow_admission, num_preemptions_before)
        plan.num_steps = shape.num_steps = max(steps, chunk_burst(self, limits, scheduled))

        self._fill_plan(plan, scheduled)
        self.stats.num_steps += 1
        self.stats.num_scheduled_tokens += plan.total_num_scheduled_tokens
        return plan

    def _maybe_defrag(self, step_id: int) -> dict[int, int]:
        cfg = self.config
        if (cfg.defrag_threshold is None or step_id % cfg.defrag_every_steps
                or fragmentation(self.kv.pool) <= cfg.defrag_threshold):
            return {}
        moves = plan_compaction(self.kv, cfg.defrag_max_moves)
        self.stats.num_defrag_moves += len(moves)
        return moves

    @property
    def long_threshold(self) -> int:
        threshold = self.config.long_prefill_token_threshold
        return self.config.max_num_batched_tokens if threshold is None else threshold

    def is_long(self, request: Request) -> bool:
        """By its whole length, so a long prompt's tail stays long (and counted)."""
        return request.num_tokens > self.long_threshold

    def _schedule_prefills(self, budget: int, max_chunks: int, scheduled: dict[str, int],
                           chunk_cap: int | None, allow_admission: bool,
                           num_preemptions_before: int) -> None:
        """Prefill chunks within `budget`: running partial prefills first (they hold
        blocks), then waiting requests by (priority, arrival); split by tenant share when
        several tenants compete, unused shares lent in a second pass. Nobody is admitted
        once this step preempted (the pool is full: admitting would thrash). Long prompts
        leave the short ones waiting a reserved share and are chunked a few at a time."""
        def may_admit() -> bool:
            return allow_admission and self.stats.num_preemptions == num_preemptions_before

        partial = [r for r in self.running if r.is_prefilling]
        waiting = sorted(self.waiting.values(), key=lambda r: r.sort_key) if may_admit() else []
        candidates = partial + waiting
        if max_chunks == 1 and self._long_chunk_last:
            # One chunk a step (flow control or the degraded path): after a long chunk, the
            # next goes to a short prompt if one waits (stable sort: order kept within each
            # class), so shorts and long chunks alternate: a short prompt's first chunk
            # comes within two steps, and a stream of them never starves the long one.
            candidates.sort(key=self.is_long)
        weights = self.config.tenant_weights
        shares = split_budget(budget, (r.tenant for r in candidates), weights)
        waiting_tenants = {r.tenant for r in waiting}
        # With one chunk a step (throttled) there is no room to share: order decides. The
        # reserve holds the first short prompt whole even past the share, but long chunks
        # keep one grid unit a step (a stream of short prompts never starves them).
        shorts = [r.num_tokens_to_compute for r in partial if not self.is_long(r)]
        if len(self.running) < self.config.max_num_seqs:
            shorts += [r.num_tokens_to_compute for r in waiting if not self.is_long(r)]
        if max_chunks == 1:
            shorts = []
        reserve = min(sum(shorts), max(math.ceil(self.config.short_prefill_share * budget),
                                       shorts[0] if shorts else 0),
                      max(budget - self.chunk_unit, 0))
        long_budget = budget - reserve
        num_long = sum(1 for r in partial if self.is_long(r))
        held_back = False  # a long chunk left the reserve's time to the short prompts
        num_chunks, blocked = 0, set()  # classes (is_long) whose head could not be admitted
        for lending in (False, True):
            for request in candidates:
                if budget == 0 or num_chunks >= max_chunks:
                    return
                if request.request_id in scheduled or request.status not in _SCHEDULABLE:
                    continue
                limit = budget if lending or shares is None else min(
                    budget, shares[request.tenant].left)
                is_long = self.is_long(request)
                if is_long:
                    limit = min(limit, long_budget)
                if limit <= 0:
                    continue
                # A long chunk leaves the reserve's time too; a short prompt inside the
                # reserve is never cut by time (the long chunk left it room).
                reserved = reserve if is_long else 0
                floor = request.num_tokens_to_compute if not is_long and held_back and \
                    request.num_tokens_to_compute <= reserve else 0
                if request.status == RequestStatus.RUNNING:
                    num_new = self._chunk_len(request, limit, chunk_cap, reserved, floor)
                    if num_new == 0 or not self._allocate_or_preempt(request, num_new,
                                                                     scheduled):
                        continue
                else:
                    if is_long and num_long >= self.config.max_long_partial_prefills:
                        continue  # passed over: the short prompts behind it still go
                    if (is_long in blocked or not may_admit()
                            or not self._may_admit(request, waiting_tenants)
                            or waits_for_shared_prompt(request, self.requests)):
                        continue
                    num_new = self._admit(request, limit, chunk_cap, reserved, floor)
                    if num_new == 0:
                        # FCFS within a class: a later, smaller request must not overtake
                        # the head forever, so its class stops for this step. A long head
                        # does not hold up short prompts (they are bounded by the reserve).
                        blocked.add(is_long)
                        continue
                    num_long += is_long
                scheduled[request.request_id] = num_new
                self._long_chunk_last = is_long
                self.last_shape.chunks[request.request_id] = (num_new,
                                                              request.num_computed_tokens)
                budget -= num_new
                if is_long:
                    long_budget -= num_new
                    held_back = held_back or reserved > 0
                elif floor:
                    reserve = max(reserve - num_new, 0)
                num_chunks += 1
                if shares is not None:
                    shares[request.tenant].used += num_new
                self.tenant_stats.add(request.tenant, num_new, is_prefill=True)
            if shares is None:
                return

    def _may_admit(self, request: Request, waiting_tenants: set[str]) -> bool:
        if len(self.running) >= self.config.max_num_seqs:
            return False
        others = waiting_tenants - {request.tenant}
        if not others:
            return True
        num_own = sum(1 for r in self.running if r.tenant == request.tenant)
        return num_own < seq_cap(self.config.max_num_seqs, request.tenant, waiting_tenants,
                                 self.config.tenant_weights)

    def _admit(self, request: Request, limit: int, chunk_cap: int | None = None,
               reserved: int = 0, floor: int = 0) -> int:
        """Move a waiting request to running with its first chunk; 0 when it cannot."""
        computed = ([] if request.needs_prompt_recompute
                    else self.kv.get_computed_blocks(request.all_token_ids))
        num_computed = len(computed) * self.block_size
        request.num_computed_tokens = num_computed
        num_new = self._chunk_len(request, limit, chunk_cap, reserved, floor)
        if num_new == 0 or self.kv.allocate_slots(
                request.request_id, num_computed + num_new, computed) is None:
            request.num_computed_tokens = 0
            return 0
        del self.waiting[request.request_id]
        if request.num_preemptions == 0:  # hits after a preemption are our own blocks
            request.num_cached_tokens = num_computed
        if request.first_scheduled_time is None:
            request.first_scheduled_time = self.clock()
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        return num_new

    def _chunk_len(self, request: Request, budget: int, chunk_cap: int | None = None,
                   reserved: int = 0, floor: int = 0) -> int:
        """Next chunk: min(remaining, budget, chunk cap, time cap), its end on the block grid.

        The time cap (`_time_cap`) keeps the predicted step under the SLO; `floor` tokens
        are granted past it. Only the request's last chunk may end off the grid, except
        when the grid would give 0 tokens: progress beats alignment (a budget smaller than
        a block must not starve prefill), and the next chunk realigns.
        """
        cap = chunk_cap or self.config.max_chunk_tokens or budget
        remaining = request.num_tokens_to_compute
        num_new = min(remaining, budget, cap)
        timed = self._time_cap(request.num_computed_tokens, num_new, reserved)
        if timed is not None:
            num_new = min(num_new, max(timed, floor))
        if 0 < num_new < remaining:
            end = request.num_computed_tokens + num_new
            aligned = end - end % self.block_size - request.num_computed_tokens
            num_new = aligned if aligned > 0 else num_new
        return num_new

    def _time_cap(self, context: int, most: int, reserved: int) -> int | None:
        """The largest chunk (<= `most`, a multiple of the block/tile unit unless it is
        `most`) at `context` whose step, with what the step carries and `reserved` tokens
        kept for short prompts, is predicted under the ITL SLO / the measured headroom
        (x `short_step_share` when a short prompt waits: its first token ends this step);
        None without a cost model. Nothing fits: one unit for the step's first chunk
        (progress beats the SLO), else 0. Deep, with a stretch and no short prompt
        waiting: at least the smallest chunk efficient there, within the stretched SLO
        (controller/chunk_size.py)."""
        cost, slo = self.step_cost, self.itl_slo_s
        if cost is None or slo is None or most <= 0:
            return None
        shape = self.last_shape
        step = StepSpan(cost, [*shape.chunks.values(), *([(reserved, 0)] if reserved else [])],
                        shape.num_decodes, shape.decode_context, context, self.chunk_unit)
        slo *= (self.config.short_step_share if reserved else 1.0) / self.slo_headroom
        if step.seconds(most) <= slo:
            return most
        tokens = step.largest_under(most, slo)
        if self.depth_stretch > 1 and context > 0 and not reserved:
            tokens = max(tokens, self._depth_stretch.efficient(
                step, most, slo * self.depth_stretch, self.config.max_num_batched_tokens))
        if tokens == 0 and not shape.chunks:
            return self.chunk_unit
        return tokens

    def _allocate_or_preempt(self, request: Request, num_new: int,
                             scheduled: dict[str, int]) -> bool:
        total = request.num_computed_tokens + num_new
        while self.kv.allocate_slots(request.request_id, total) is None:
            if not self._may_preempt:
                return False
            victim = max(self.running, key=lambda r: r.sort_key)
            self._preempt(victim, scheduled)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request, scheduled: dict[str, int]) -> None:
        """Recompute preemption: drop the blocks, go back to the waiting queue."""
        self.running.remove(request)
        scheduled.pop(request.request_id, None)
        self._release(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = request.num_pending_outputs = 0
        request.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting[request.request_id] = request

    def _release(self, request: Request) -> None:
        num_freed = self.kv.free(request.request_id)
        if self._worker_known.pop(request.request_id, None) is not None:
            self._finished_ids.add(request.request_id)
        if num_freed:
            self.stats.cache_evicts.append(
                CacheEvict(request.request_id, num_freed, self.kv.pool.usage))

    def _fill_plan(self, plan: StepPlan, scheduled: dict[str, int]) -> None:
        plan.finished_request_ids = self._finished_ids
        self._finished_ids = set()
        for request_id, num_new in scheduled.items():
            request = self.requests[request_id]
            block_ids = self.kv.block_ids(request_id)
            known = self._worker_known.get(request_id)
            if known is None:
                plan.new_requests.append(NewRequestData(
                    request_id, request.all_token_ids, request.sampling_params,
                    list(block_ids), request.num_computed_tokens, request.num_output_tokens))
            elif known != (len(block_ids), request.num_computed_tokens):
                # Only what the worker cannot know: new blocks, or a count it did not reach
                # itself. A decode inside its last block sends nothing but its span.
                plan.cached_requests.append(CachedRequestData(
                    request_id, block_ids[known[0]:], request.num_computed_tokens))
            # Planned is as good as computed for the next plan (steps run in order on the
            # worker); a step that computes every token so far samples one more, a burst
            # (its 1-token spans run num_steps times) num_steps more.
            request.num_computed_tokens += num_new * plan.num_steps
            self._worker_known[request_id] = (len(block_ids), request.num_computed_tokens)
            plan.num_scheduled_tokens[request_id] = num_new
            if request.num_tokens_to_compute <= 0:
                request.num_pending_outputs += plan.num_steps
        plan.total_num_scheduled_tokens = sum(scheduled.values())
        assert plan.total_num_scheduled_tokens <= self._max_plan_tokens(plan)

    def _max_plan_tokens(self, plan: StepPlan) -> int:
        """The plan-size invariant; a baseline policy may knowingly exceed the budget."""
        return self.config.max_num_batched_tokens
