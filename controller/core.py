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

from controller.messages import SamplingParams, StepPlan, StepResult
from controller.request import Request, RequestOutput
from controller.scheduler import Scheduler, SchedulerConfig
from kvcache.block_pool import BlockPool
from kvcache.manager import KVCacheManager


@dataclass(frozen=True)
class PoolSpec:
    """What the controller must know about a worker's KV pool."""

    num_blocks: int
    block_size: int
    enable_prefix_caching: bool = True


class QueueFullError(RuntimeError):
    """Every worker's waiting queue is at `max_queue_len`: the edge answers 429."""


class ControllerCore:
    def __init__(self, pools: list[PoolSpec], scheduler_config: SchedulerConfig,
                 eos_token_ids: tuple[int, ...] = (), max_model_len: int | None = None,
                 max_queue_len: int = 1 << 30, clock: Callable[[], float] | None = None):
        if not pools:
            raise ValueError("at least one worker is needed")
        self.clock = clock or (lambda: 0.0)
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.max_queue_len = max_queue_len
        self.schedulers = [
            Scheduler(scheduler_config,
                      KVCacheManager(BlockPool(p.num_blocks, p.block_size,
                                               p.enable_prefix_caching)),
                      clock=self.clock)
            for p in pools]
        self.request_to_worker: dict[str, int] = {}
        self._ids = itertools.count()

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

        def score(w: int) -> tuple[int, float]:
            sched = self.schedulers[w]
            hits = len(sched.kv.get_computed_blocks(request.prompt_token_ids, count=False)) \
                if sched.kv.pool.enable_prefix_caching else 0
            queued = sum(r.num_tokens_to_compute for r in sched.requests.values())
            load = sched.kv.pool.usage + queued / sched.capacity_tokens
            return (-hits, load)

        return min(candidates, key=score)

    def abort(self, request_id: str) -> RequestOutput | None:
        worker = self.request_to_worker.pop(request_id, None)
        if worker is None:
            return None
        return self.schedulers[worker].abort_request(request_id)

    # -- stepping ---------------------------------------------------------------------
    def schedule(self, worker: int) -> StepPlan:
        return self.schedulers[worker].schedule()

    def apply(self, worker: int, plan: StepPlan, result: StepResult) -> list[RequestOutput]:
        outputs = self.schedulers[worker].update_from_output(plan, result)
        for out in outputs:
            if out.finished:
                self.request_to_worker.pop(out.request_id, None)
        return outputs

    def has_work(self, worker: int) -> bool:
        return self.schedulers[worker].has_work()

    def has_unfinished(self) -> bool:
        return any(s.has_unfinished() for s in self.schedulers)

    def check_integrity(self) -> None:
        for sched in self.schedulers:
            sched.kv.pool.check_integrity()
