"""The controller core: per-worker state, routing, request bookkeeping, the step verbs.

Torch-free and Ray-free. One step of one worker is `plan = begin_step(w)`, the worker
executes `plan`, `outputs = finish_step(w, plan, result)`; `StepLoop`
(controller/step_loop.py) is the one loop that sequences them, serially or planned ahead,
for `LocalEngine`, the Ray controller's worker loop, the benchmarks and the tests. Event
handling (flow control, protections) lives here only: events never leave the core.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from controller.budget import StepCost
from controller.events import DoubleBufferedEventQueue
from controller.flow import FlowConfig, FlowControl
from controller.histogram import (
    SCORE_BUCKETS,
    STEP_DURATION_BUCKETS_S,
    TOKEN_BUCKETS,
    Histogram,
    HistogramSnapshot,
)
from controller.messages import (
    CacheEvict,
    ChunkComplete,
    RequestOutput,
    SamplingParams,
    StepPlan,
    StepResult,
)
from controller.protections import (
    ProtectionConfig,
    Protections,
)
from controller.refit import OnlineRefit
from controller.request import Request, RequestStatus
from controller.scheduler import Scheduler, SchedulerConfig, StepLimits, StepShape
from controller.settings import FORBID_EXTRA, check_settings, setting
from kvcache.block_pool import BlockPool
from kvcache.manager import KVCacheManager


@dataclass(frozen=True)
class PoolSpec:
    """What the controller must know about a worker's KV pool."""

    num_blocks: int
    block_size: int
    enable_prefix_caching: bool = True


Event = ChunkComplete | CacheEvict


@dataclass(frozen=True)
class DegradedConfig:
    """The degraded path: keep serving with the smallest chunk, one prefill at a time
    (`degraded:` in the configuration)."""

    __pydantic_config__ = FORBID_EXTRA

    chunk_tokens: int | None = setting(None, ge=1, description=(
        "Chunk size on the degraded path; None means one KV block."))
    num_chunks: int = setting(1, ge=1, description="Prefill chunks per step when degraded.")
    after_paused_s: float = setting(30.0, ge=0, description=(
        "PREFILL_PAUSED this long with work waiting switches to the degraded path, which "
        "keeps serving."))

    def __post_init__(self) -> None:
        check_settings(self)


def request_seed(request_id: str) -> int:
    """A stable 63-bit sampling seed for a request that brought none."""
    digest = hashlib.blake2b(request_id.encode(), digest_size=8, person=b"tf-seed").digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class QueueFullError(RuntimeError):
    """Every worker's waiting queue is at `max_queue_len`: the edge answers 429."""


class NoWorkerUpError(RuntimeError):
    """No worker is up (all are restarting or waiting for resources): the edge answers
    503 with Retry-After."""


@dataclass
class EventStats:
    """What flow control has been told, per worker (for stats and metrics)."""

    num_chunk_complete: int = 0
    num_cache_evict: int = 0
    last_evict_kv_usage: float = 0.0


@dataclass
class StepHistograms:
    """Per-step observations of one worker, bounded (fixed buckets)."""

    budget_tokens: Histogram = field(default_factory=lambda: Histogram(TOKEN_BUCKETS))
    decode_tokens: Histogram = field(default_factory=lambda: Histogram(TOKEN_BUCKETS))
    prefill_tokens: Histogram = field(default_factory=lambda: Histogram(TOKEN_BUCKETS))
    duration_s: Histogram = field(default_factory=lambda: Histogram(STEP_DURATION_BUCKETS_S))
    budget_score: Histogram = field(default_factory=lambda: Histogram(SCORE_BUCKETS))


@dataclass
class WorkerState:
    """Everything the controller keeps per worker."""

    scheduler: Scheduler
    flow: FlowControl
    protections: Protections
    degraded: bool = False  # the last plan was made on the degraded path
    # False from a failure until the restarted worker reports ready: routing skips it.
    is_up: bool = True
    num_failures: int = 0
    # `chunk_complete` / `cache_evict` events, double-buffered: those produced while a
    # step runs are handled before the next plan.
    events: DoubleBufferedEventQueue[Event] = field(default_factory=DoubleBufferedEventQueue)
    event_stats: EventStats = field(default_factory=EventStats)
    step_histograms: StepHistograms = field(default_factory=StepHistograms)
    # step id -> clock() at its begin_step; a step planned ahead starts when the one
    # before it ends (`last_step_ended`), which is what its duration counts from.
    step_started: dict[int, float] = field(default_factory=dict)
    last_step_ended: float = float("-inf")
    # Outputs of requests a protection aborted outside `finish_step`; returned by the next.
    outbox: list[RequestOutput] = field(default_factory=list)
    # The calibrated step cost model (None: uncalibrated) and its online refit.
    step_cost: StepCost | None = None
    refit: OnlineRefit | None = None
    # (request id, chunk index) -> (charged, budgeted) seconds: a chunk's share of its step.
    chunk_charges: dict[tuple[str, int], tuple[float, float]] = field(default_factory=dict)


@dataclass(frozen=True)
class WorkerStats:
    """One typed snapshot of every counter the core keeps for a worker: what `stats()`
    and the metrics exporter read, and nothing else needs to reach into the parts."""

    num_blocks: int
    num_free_blocks: int
    num_used_blocks: int
    num_cached_blocks: int
    kv_usage: float
    num_running: int
    num_waiting: int
    num_steps: int
    num_preemptions: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_finished: int
    num_defrag_moves: int
    num_prefix_query_tokens: int
    num_prefix_hit_tokens: int
    tenant_to_prefill_tokens: dict[str, int]
    tenant_to_decode_tokens: dict[str, int]
    tenant_to_num_waiting: dict[str, int]
    flow_mode: str
    flow_mode_to_count: dict[str, int]
    num_flow_transitions: int
    bandwidth_avg: float
    num_chunk_timeouts: int
    num_budget_deviations: int
    num_slow_requests: int
    num_refits: int
    slo_headroom: float  # the ITL SLO is divided by it when chunks are planned
    last_budget_score: float
    is_degraded: bool
    num_chunk_complete: int
    num_cache_evict: int
    last_evict_kv_usage: float
    is_up: bool
    flow_kv_usage: float  # the usage flow control last saw (cache pressure hysteresis)
    flow_transition_to_count: dict[tuple[str, str], int]
    num_prefill_pending: int  # requests still needing prefill chunks (the chunk queue)
    step_budget_tokens: HistogramSnapshot
    step_decode_tokens: HistogramSnapshot
    step_prefill_tokens: HistogramSnapshot
    step_duration_s: HistogramSnapshot
    budget_score: HistogramSnapshot


class ControllerCore:
    def __init__(self, pools: list[PoolSpec], scheduler_config: SchedulerConfig,
                 eos_token_ids: tuple[int, ...] = (), max_model_len: int | None = None,
                 max_queue_len: int = 1 << 30, clock: Callable[[], float] | None = None,
                 flow_config: FlowConfig | None = None,
                 protection_config: ProtectionConfig | None = None,
                 degraded_config: DegradedConfig | None = None,
                 scheduler_cls: type[Scheduler] = Scheduler, vocab_size: int | None = None,
                 step_cost: StepCost | None = None, itl_slo_s: float | None = None):
        if not pools:
            raise ValueError("at least one worker is needed")
        self.clock = clock or (lambda: 0.0)
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size  # None: token ids are not checked here
        self.max_model_len = max_model_len
        self.max_queue_len = max_queue_len
        self.degraded_config = degraded_config or DegradedConfig()
        protection_config = protection_config or ProtectionConfig()
        # The protections and the step deadline price chunks by the calibrated model,
        # else by a fixed cost per token; the scheduler sizes chunks only by a calibrated one.
        chunk_cost = step_cost or StepCost.per_token(protection_config.seconds_per_token)
        arrivals = itertools.count()  # one arrival order across workers
        self.workers = [
            WorkerState(
                scheduler_cls(scheduler_config,
                              KVCacheManager(BlockPool(p.num_blocks, p.block_size,
                                                       p.enable_prefix_caching)),
                              clock=self.clock, arrivals=arrivals, step_cost=step_cost,
                              itl_slo_s=itl_slo_s),
                FlowControl(flow_config, scheduler_config.max_concurrent_chunks),
                Protections(protection_config, chunk_cost), step_cost=step_cost,
                refit=OnlineRefit(protection_config) if step_cost is not None else None)
            for p in pools]
        self.request_to_worker: dict[str, int] = {}
        self._ids = itertools.count()
        self._next_tie = 0

    @property
    def num_workers(self) -> int:
        return len(self.workers)

    def scheduler(self, worker: int) -> Scheduler:
        return self.workers[worker].scheduler

    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    # -- intake ---------------------------------------------------------------------
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                    request_id: str | None = None, priority: int = 0,
                    tenant: str = "default") -> Request:
        """Route and queue a request. ValueError for a request that can never run,
        QueueFullError when every queue is full."""
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        vocab = self.vocab_size
        if vocab is not None and any(not 0 <= t < vocab for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        request_id = request_id or self.new_request_id()
        if params.seed is None:
            # A seed of its own makes every sampled token a function of (seed, position,
            # logits): a request recomputed on another worker after a failure, or resumed
            # from the journal, draws exactly the tokens it drew before.
            params = dataclasses.replace(params, seed=request_seed(request_id))
        request = Request(request_id, list(prompt_token_ids), params,
                          eos_token_ids=self.eos_token_ids, priority=priority,
                          arrival_time=self.clock(), tenant=tenant,
                          max_model_len=self.max_model_len)
        self.restore_request(request)
        return request

    def restore_request(self, request: Request) -> int:
        """Route and queue a built request; also one an earlier controller admitted (read
        back from the journal) under its own id: it recomputes its prompt and the tokens it
        already generated, then continues where it stopped. Returns its worker."""
        if request.request_id in self.request_to_worker:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        worker = self.route(request)
        self.workers[worker].scheduler.add_request(request)
        self.request_to_worker[request.request_id] = worker
        return worker

    def route(self, request: Request) -> int:
        """Prefix affinity first (the worker holding most of the prompt's blocks), then
        least loaded: KV usage plus queued tokens relative to the pool."""
        up = [w for w, state in enumerate(self.workers) if state.is_up]
        if not up:
            raise NoWorkerUpError("no worker is up")
        candidates = [w for w in up if self.workers[w].scheduler.num_waiting < self.max_queue_len]
        if not candidates:
            raise QueueFullError("all request queues are full")
        if len(candidates) == 1:  # nothing to weigh (scoring walks every queued request)
            return candidates[0]

        def score(w: int) -> tuple[int, float, int]:
            sched = self.workers[w].scheduler
            hits = len(sched.kv.get_computed_blocks(request.prompt_token_ids, count=False)) \
                if sched.kv.pool.enable_prefix_caching else 0
            queued = sum(r.num_tokens_to_compute for r in sched.requests.values())
            load = sched.kv.pool.usage + queued / sched.capacity_tokens
            # Ties (an idle cluster) rotate, so one-at-a-time requests spread too.
            rotation = (w - self._next_tie) % self.num_workers
            return (-hits, load, rotation)

        worker = min(candidates, key=score)
        self._next_tie = (worker + 1) % self.num_workers
        return worker

    def abort(self, request_id: str) -> RequestOutput | None:
        """Finish a request as aborted; its blocks are released now (their `cache_evict`
        reaches flow control before the worker's next plan)."""
        worker = self.request_to_worker.pop(request_id, None)
        if worker is None:
            return None
        state = self.workers[worker]
        state.protections.forget(request_id)  # its prefill timing would linger
        out = state.scheduler.abort_request(request_id)
        self._queue_evicts(state)
        return out

    # -- stepping ---------------------------------------------------------------------
    def begin_step(self, worker: int, is_ahead: bool = False) -> StepPlan:
        """Plan one step within the limits flow control and the protections set now.
        Every event queued so far is handled first. `is_ahead`: the previous step of this
        worker is still running (its result not applied yet); see `can_plan_ahead`."""
        state = self.workers[worker]
        state.outbox.extend(self._handle_events(state))
        limits = self._limits(state)
        if is_ahead:
            limits = dataclasses.replace(limits, may_preempt=False)
        plan = state.scheduler.schedule(limits)
        self._queue_evicts(state)  # preemptions inside schedule() released blocks
        state.step_started[plan.step_id] = self.clock()
        if plan.total_num_scheduled_tokens:
            self._observe_plan(state, plan)
        return plan

    def can_plan_ahead(self, worker: int) -> bool:
        """Whether a step may be planned while this worker's previous one runs: requests
        are running (their next tokens can be planned before the last ones are known) and
        nothing is queued to be handled first (events of the running step, a protection's
        aborts)."""
        state = self.workers[worker]
        return (state.is_up and bool(state.scheduler.running) and not state.outbox
                and not state.degraded)

    def discard_step(self, worker: int, plan: StepPlan) -> None:
        """Forget a planned-ahead step that carries nothing (it is never sent)."""
        assert plan.is_empty and not plan.finished_request_ids
        state = self.workers[worker]
        state.scheduler.pop_shape(plan.step_id)
        state.step_started.pop(plan.step_id, None)

    @staticmethod
    def _observe_plan(state: WorkerState, plan: StepPlan) -> None:
        sched, hists = state.scheduler, state.step_histograms
        shape = sched.last_shape
        num_prefill = sum(n for rid, n in plan.num_scheduled_tokens.items()
                          if rid in shape.chunks) if shape.step_id == plan.step_id else \
            sum(n for n in plan.num_scheduled_tokens.values() if n > 1)  # a baseline's plan
        hists.budget_tokens.observe(sched.config.max_num_batched_tokens)
        hists.prefill_tokens.observe(num_prefill)
        hists.decode_tokens.observe(plan.total_num_scheduled_tokens - num_prefill)

    def finish_step(self, worker: int, plan: StepPlan,
                    result: StepResult) -> list[RequestOutput]:
        """Apply the worker's result and handle the step's events; returns the step's
        outputs, including requests a protection aborted."""
        state = self.workers[worker]
        sched, flow, protections = state.scheduler, state.flow, state.protections
        outputs = state.outbox + sched.update_from_output(plan, result)
        state.outbox = []
        now = self.clock()
        started = state.step_started.pop(plan.step_id, None)
        if started is not None:
            state.step_histograms.duration_s.observe(now - max(started, state.last_step_ended))
        state.last_step_ended = now
        flow.on_kv_usage(sched.kv.pool.usage, now)
        if result.bandwidth_utilization is not None:
            flow.on_bandwidth(result.bandwidth_utilization, now)
        for out in outputs:
            if out.num_output_tokens == 1 and out.new_token_ids:
                score = protections.on_prefill_done(out.request_id)
                if score is not None:
                    state.step_histograms.budget_score.observe(score)
            if out.finished:
                self.request_to_worker.pop(out.request_id, None)
                protections.forget(out.request_id)
        self._price_chunks(state, plan, result, sched.pop_shape(plan.step_id))
        state.events.extend(result.chunk_events)
        self._queue_evicts(state)
        outputs += self._handle_events(state)
        return outputs

    def _price_chunks(self, state: WorkerState, plan: StepPlan, result: StepResult,
                      shape: StepShape | None) -> None:
        """Charge each chunk its share of the step (by the cost model), and let the online
        refit see the step."""
        events = result.chunk_events
        if not events:
            return
        step_s = result.elapsed_s or max(e.elapsed_s for e in events)
        cost = state.step_cost
        if cost is not None and shape is not None and shape.chunks:
            predicted = cost.step_s(list(shape.chunks.values()), shape.num_decodes,
                                    shape.decode_context)
            # Decodes keep their part; the chunks split the fixed cost and add their own.
            for e in events:
                budgeted = cost.prefill.a / len(events) + cost.marginal_s(e.num_tokens, e.start)
                charged = step_s * budgeted / predicted if predicted > 0 else step_s
                state.chunk_charges[(e.request_id, e.chunk_index)] = (charged, budgeted)
            assert state.refit is not None
            refitted = state.refit.observe(shape, step_s, cost)
            if refitted is not None:
                state.step_cost = state.scheduler.step_cost = refitted
                state.protections.step_cost = refitted
            state.scheduler.slo_headroom = state.refit.headroom
            return
        alone = [state.protections.step_cost.chunk_s(e.num_tokens, e.start) for e in events]
        total = sum(alone)
        for e, budgeted in zip(events, alone, strict=True):
            charged = step_s * budgeted / total if total > 0 else e.elapsed_s
            state.chunk_charges[(e.request_id, e.chunk_index)] = (charged, budgeted)

    def take_outbox(self, worker: int) -> list[RequestOutput]:
        """Outputs no step has carried yet (requests a protection aborted)."""
        state = self.workers[worker]
        outputs, state.outbox = state.outbox, []
        return outputs

    def _limits(self, state: WorkerState) -> StepLimits:
        flow, now = state.flow, self.clock()
        paused_too_long = (flow.paused_since is not None
                           and now - flow.paused_since >= self.degraded_config.after_paused_s)
        state.degraded = state.protections.is_degraded(now) or paused_too_long
        if state.degraded:  # everything else tripped: still serve, smallest chunk, one at a time
            sched = state.scheduler
            return StepLimits(self.degraded_config.num_chunks,
                              self.degraded_config.chunk_tokens or sched.block_size)
        # PREFILL_PAUSED recovers from telemetry alone: no forced progress there.
        return StepLimits(flow.max_concurrent_chunks, progress_guard=not flow.paused)

    def _queue_evicts(self, state: WorkerState) -> None:
        evicts = state.scheduler.stats.cache_evicts
        state.events.extend(evicts)
        evicts.clear()

    def _handle_events(self, state: WorkerState) -> list[RequestOutput]:
        """Feed queued events to flow control and the protections; returns the outputs
        of requests a protection aborted (their blocks are already released)."""
        aborted: list[RequestOutput] = []
        now = self.clock()
        batch = state.events.drain()
        while batch:
            for event in batch:
                if isinstance(event, CacheEvict):
                    state.event_stats.num_cache_evict += 1
                    state.event_stats.last_evict_kv_usage = event.kv_usage
                    state.flow.on_cache_evict(event, now)
                    continue
                state.event_stats.num_chunk_complete += 1
                state.flow.on_chunk_complete(event, now)
                charged, budgeted = state.chunk_charges.pop(
                    (event.request_id, event.chunk_index), (None, None))
                error = state.protections.on_chunk_complete(event, now, charged, budgeted)
                if error is not None:
                    out = self.abort(event.request_id)  # queues its evicts
                    if out is not None:
                        out.error = error
                        aborted.append(out)
            # Aborts release blocks: their evicts reach flow control now (no lost wake-up).
            batch = state.events.drain()
        return aborted

    def worker_stats(self, worker: int) -> WorkerStats:
        state = self.workers[worker]
        sched, flow, prot, events = (state.scheduler, state.flow, state.protections,
                                     state.event_stats)
        pool = sched.kv.pool.stats()
        tenant_to_num_waiting: dict[str, int] = {}
        for request in sched.waiting.values():
            tenant_to_num_waiting[request.tenant] = tenant_to_num_waiting.get(
                request.tenant, 0) + 1
        hists = state.step_histograms
        return WorkerStats(
            num_blocks=pool.num_blocks, num_free_blocks=pool.num_free,
            num_used_blocks=pool.num_used, num_cached_blocks=pool.num_cached,
            kv_usage=pool.usage, num_running=len(sched.running), num_waiting=sched.num_waiting,
            num_steps=sched.stats.num_steps, num_preemptions=sched.stats.num_preemptions,
            num_prefill_tokens=sched.stats.num_prefill_tokens,
            num_decode_tokens=sched.stats.num_decode_tokens,
            num_finished=sched.stats.num_finished, num_defrag_moves=sched.stats.num_defrag_moves,
            num_prefix_query_tokens=sched.kv.num_prefix_queries,
            num_prefix_hit_tokens=sched.kv.num_prefix_hits,
            tenant_to_prefill_tokens=dict(sched.tenant_stats.tenant_to_prefill_tokens),
            tenant_to_decode_tokens=dict(sched.tenant_stats.tenant_to_decode_tokens),
            tenant_to_num_waiting=tenant_to_num_waiting,
            flow_mode=flow.mode.name, flow_mode_to_count=dict(flow.stats.mode_to_count),
            num_flow_transitions=flow.stats.transitions, bandwidth_avg=flow.bandwidth_avg,
            num_chunk_timeouts=prot.stats.num_timeouts,
            num_budget_deviations=prot.stats.num_deviations,
            num_slow_requests=prot.stats.num_slow_requests,
            num_refits=state.refit.num_refits if state.refit is not None else 0,
            slo_headroom=state.refit.headroom if state.refit is not None else 1.0,
            last_budget_score=prot.stats.last_budget_score, is_degraded=state.degraded,
            num_chunk_complete=events.num_chunk_complete,
            num_cache_evict=events.num_cache_evict,
            last_evict_kv_usage=events.last_evict_kv_usage, is_up=state.is_up,
            flow_kv_usage=flow.kv_usage,
            flow_transition_to_count=dict(flow.stats.transition_to_count),
            num_prefill_pending=sum(not r.is_decoding for r in sched.requests.values()),
            step_budget_tokens=hists.budget_tokens.snapshot(),
            step_decode_tokens=hists.decode_tokens.snapshot(),
            step_prefill_tokens=hists.prefill_tokens.snapshot(),
            step_duration_s=hists.duration_s.snapshot(),
            budget_score=hists.budget_score.snapshot())

    # -- worker failure -------------------------------------------------------------------
    def worker_failed(self, worker: int, max_failures_per_request: int = 2
                      ) -> tuple[list[int], list[RequestOutput]]:
        """The worker died or hung. It leaves routing; every unfinished request on it is
        detached and re-queued, on a worker that is up when there is one (else here, to
        run once it is back), to recompute its prompt and the tokens it already produced:
        its stream continues with no gap and no duplicate. Its pool forgets every prefix
        hash (the KV behind them is gone). A request that has now been on
        `max_failures_per_request` failing workers is aborted instead (it may be what
        kills them). Returns (workers that received requests, aborted outputs)."""
        state = self.workers[worker]
        state.is_up = False
        state.num_failures += 1
        state.outbox = []
        state.step_started.clear()  # its steps in flight are lost with it
        sched = state.scheduler
        detached = []
        for request_id in list(sched.requests):
            num_blocks = len(sched.kv.block_ids(request_id))
            request = sched.detach_request(request_id)
            assert request is not None
            state.protections.forget(request_id)
            if num_blocks:
                state.events.append(CacheEvict(request_id, num_blocks, sched.kv.pool.usage))
            detached.append(request)
        sched.forget_worker_state()
        sched.kv.pool.reset_prefix_cache()
        targets: set[int] = set()
        aborted: list[RequestOutput] = []
        for request in detached:
            request.num_worker_failures += 1
            if request.num_worker_failures >= max_failures_per_request:
                self.request_to_worker.pop(request.request_id, None)
                request.status = RequestStatus.FINISHED_ABORTED
                aborted.append(RequestOutput(
                    request.request_id, [], request.status.finish_reason, request.num_prompt_tokens,
                    request.num_output_tokens, request.num_cached_tokens,
                    error=f"request was on {request.num_worker_failures} failed workers"))
                continue
            target = self._reroute(request, exclude=worker)
            self.workers[target].scheduler.adopt_request(request)
            self.request_to_worker[request.request_id] = target
            targets.add(target)
        return sorted(targets), aborted

    def fail_worker_requests(self, worker: int, error: str) -> list[RequestOutput]:
        """The controller failed before a plan reached the worker: what the worker holds is
        unknown. Every request here fails with `error`, the scheduler forgets the worker's
        state and the pool its prefix hashes (a lost block move leaves them naming KV that
        was never copied). Returns the failed requests' outputs."""
        state = self.workers[worker]
        failed = self.take_outbox(worker)  # ended by a protection, not handed out yet
        for request_id in list(state.scheduler.requests):
            out = self.abort(request_id)
            if out is not None:
                out.error = error
                failed.append(out)
        state.scheduler.forget_worker_state()
        self.reset_prefix_cache(worker)
        return failed

    def worker_ready(self, worker: int) -> None:
        """The (restarted) worker answered: back in routing."""
        self.workers[worker].is_up = True

    def _reroute(self, request: Request, exclude: int) -> int:
        need = request.num_tokens + request.sampling_params.max_tokens - request.num_output_tokens
        fits = [w for w, state in enumerate(self.workers)
                if w != exclude and state.is_up and need <= state.scheduler.capacity_tokens]
        if not fits:
            return exclude  # waits for the worker to come back
        return min(fits, key=lambda w: (self.workers[w].scheduler.kv.pool.usage,
                                        self.workers[w].scheduler.num_waiting))

    def reset_prefix_cache(self, worker: int) -> int:
        """The worker lost its KV (restart): no prefix hash of its pool may be served again.
        Returns how many hashes were dropped."""
        return self.workers[worker].scheduler.kv.pool.reset_prefix_cache()

    def has_work(self, worker: int) -> bool:
        state = self.workers[worker]
        return state.scheduler.has_work() or bool(state.outbox)

    def has_unfinished(self) -> bool:
        return any(state.scheduler.has_unfinished() for state in self.workers)

    def check_integrity(self) -> None:
        for state in self.workers:
            state.scheduler.kv.pool.check_integrity()
