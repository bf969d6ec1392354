"""The controller core: one Scheduler per worker, routing, request bookkeeping.

Torch-free and Ray-free. `LocalEngine` drives it with an in-process worker; the Ray
controller actor drives it with one async step loop per worker actor. Both call the
same three verbs per worker and step: `schedule(w)`, (the worker executes the plan),
`apply(w, plan, result)`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

from controller.flow import FlowConfig, FlowControl
from controller.messages import CacheEvict, ChunkComplete, SamplingParams, StepPlan, StepResult
from controller.protections import (
    CostModel,
    ProtectionConfig,
    Protections,
    per_token_cost_model,
)
from controller.request import Request, RequestOutput
from controller.scheduler import Scheduler, SchedulerConfig
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


class QueueFullError(RuntimeError):
    """Every worker's waiting queue is at `max_queue_len`: the edge answers 429."""


class ControllerCore:
    def __init__(self, pools: list[PoolSpec], scheduler_config: SchedulerConfig,
                 eos_token_ids: tuple[int, ...] = (), max_model_len: int | None = None,
                 max_queue_len: int = 1 << 30, clock: Callable[[], float] | None = None,
                 flow_config: FlowConfig | None = None,
                 protection_config: ProtectionConfig | None = None,
                 cost_model: CostModel | None = None,
                 degraded_config: DegradedConfig | None = None,
                 scheduler_cls: type[Scheduler] = Scheduler, vocab_size: int | None = None):
        if not pools:
            raise ValueError("at least one worker is needed")
        self.clock = clock or (lambda: 0.0)
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size  # None: token ids are not checked here
        self.max_model_len = max_model_len
        self.max_queue_len = max_queue_len
        self.schedulers = [
            scheduler_cls(scheduler_config,
                      KVCacheManager(BlockPool(p.num_blocks, p.block_size,
                                               p.enable_prefix_caching)),
                      clock=self.clock)
            for p in pools]
        self.request_to_worker: dict[str, int] = {}
        self._ids = itertools.count()
        self._next_tie = 0
        self.flows = [FlowControl(flow_config, scheduler_config.max_concurrent_chunks)
                      for _ in pools]
        protection_config = protection_config or ProtectionConfig()
        cost_model = cost_model or per_token_cost_model(protection_config.seconds_per_token)
        self.protections = [Protections(protection_config, cost_model) for _ in pools]
        self.degraded_config = degraded_config or DegradedConfig()
        self.degraded = [False] * len(pools)

    @property
    def num_workers(self) -> int:
        return len(self.schedulers)

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
        request = Request(request_id or self.new_request_id(), list(prompt_token_ids), params,
                          eos_token_ids=self.eos_token_ids, priority=priority,
                          arrival_time=self.clock(), tenant=tenant,
                          max_model_len=self.max_model_len)
        if request.request_id in self.request_to_worker:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        worker = self.route(request)
        self.schedulers[worker].add_request(request)
        self.request_to_worker[request.request_id] = worker
        return request

    def route(self, request: Request) -> int:
        """Prefix affinity first (the worker holding most of the prompt's blocks), then
        least loaded: KV usage plus queued tokens relative to the pool."""
        candidates = [w for w, s in enumerate(self.schedulers)
                      if s.num_waiting < self.max_queue_len]
        if not candidates:
            raise QueueFullError("all request queues are full")

        def score(w: int) -> tuple[int, float, int]:
            sched = self.schedulers[w]
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
        worker = self.request_to_worker.pop(request_id, None)
        if worker is None:
            return None
        self.protections[worker].forget(request_id)  # its prefill timing would linger
        return self.schedulers[worker].abort_request(request_id)

    # -- stepping ---------------------------------------------------------------------
    def schedule(self, worker: int) -> StepPlan:
        """Plan a step within the limits flow control and the protections set now."""
        sched, flow = self.schedulers[worker], self.flows[worker]
        now = self.clock()
        paused_too_long = (flow.paused_since is not None
                           and now - flow.paused_since >= self.degraded_config.after_paused_s)
        degraded = self.protections[worker].is_degraded(now) or paused_too_long
        self.degraded[worker] = degraded
        if degraded:  # everything else tripped: still serve, smallest chunk, one at a time
            sched.chunk_limit = self.degraded_config.num_chunks
            sched.chunk_cap_override = self.degraded_config.chunk_tokens or sched.block_size
        else:
            sched.chunk_limit = flow.max_concurrent_chunks
            sched.chunk_cap_override = None
        sched.progress_guard = not flow.paused
        return sched.schedule()

    def apply(self, worker: int, plan: StepPlan, result: StepResult) -> list[RequestOutput]:
        """Apply a worker's result; the step's events come from `take_events`."""
        sched = self.schedulers[worker]
        outputs = sched.update_from_output(plan, result)
        now = self.clock()
        flow = self.flows[worker]
        flow.on_kv_usage(sched.kv.pool.usage, now)
        if result.bandwidth_utilization is not None:
            flow.on_bandwidth(result.bandwidth_utilization, now)
        for out in outputs:
            if out.num_output_tokens == 1 and out.new_token_ids:
                self.protections[worker].on_prefill_done(out.request_id)
            if out.finished:
                self.request_to_worker.pop(out.request_id, None)
                self.protections[worker].forget(out.request_id)
        return outputs

    def take_events(self, worker: int, result: StepResult | None = None) -> list[Event]:
        """The step's `chunk_complete` events and every `cache_evict` since the last call,
        for the worker's double-buffered event queue."""
        evicts = self.schedulers[worker].stats.cache_evicts
        events: list[Event] = list(result.chunk_events) if result is not None else []
        events.extend(evicts)
        evicts.clear()
        return events

    def handle_events(self, worker: int, events: list[Event]) -> list[RequestOutput]:
        """Feed drained events to flow control and the protections; returns the outputs
        of requests a protection aborted (their blocks are already released)."""
        now = self.clock()
        flow, protections = self.flows[worker], self.protections[worker]
        aborted: list[RequestOutput] = []
        for event in events:
            if isinstance(event, CacheEvict):
                flow.on_cache_evict(event, now)
                continue
            flow.on_chunk_complete(event, now)
            error = protections.on_chunk_complete(event, now)
            if error is not None:
                out = self.abort(event.request_id)
                if out is not None:
                    out.error = error
                    aborted.append(out)
        # Aborts release blocks: their evicts go to flow control at once (no lost wake-up).
        for event in self.take_events(worker):
            if isinstance(event, CacheEvict):
                flow.on_cache_evict(event, now)
        return aborted

    def reset_prefix_cache(self, worker: int) -> int:
        """The worker lost its KV (restart): no prefix hash of its pool may be served again.
        Returns how many hashes were dropped."""
        return self.schedulers[worker].kv.pool.reset_prefix_cache()

    def has_work(self, worker: int) -> bool:
        return self.schedulers[worker].has_work()

    def has_unfinished(self) -> bool:
        return any(s.has_unfinished() for s in self.schedulers)

    def check_integrity(self) -> None:
        for sched in self.schedulers:
            sched.kv.pool.check_integrity()
