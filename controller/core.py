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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from controller.budget import StepCost
from controller.flow import FlowControl
from controller.messages import (
    CacheEvict,
    FinishReason,
    RequestOutput,
    SamplingParams,
)
from controller.options import ControllerOptions
from controller.policies import make_scheduler_class
from controller.protections import (
    Protections,
)
from controller.refit import OnlineRefit
from controller.request import Request, RequestStatus
from controller.routing import NoWorkerUpError, QueueFullError, Routing
from controller.scheduler import Scheduler
from controller.stepping import Stepping
from controller.worker_state import DegradedConfig, PoolSpec, WorkerState
from controller.worker_stats import WorkerStats, worker_stats
from kvcache.block_pool import BlockPool
from kvcache.manager import KVCacheManager

# Also importable from here, where they lived before the core was split.
__all__ = ["ControllerCore", "DegradedConfig", "NoWorkerUpError", "PoolSpec", "QueueFullError",
           "WorkerStats", "request_seed"]


def request_seed(request_id: str) -> int:
    """A stable 63-bit sampling seed for a request that brought none."""
    digest = hashlib.blake2b(request_id.encode(), digest_size=8, person=b"tf-seed").digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


@dataclass(frozen=True)
class ModelFacts:
    """What the workers report about the model that requests are checked against."""

    eos_token_ids: tuple[int, ...] = ()
    max_model_len: int | None = None  # None: no cap on prompt + output tokens here
    vocab_size: int | None = None  # None: token ids are not checked here


class WorkerFacts(Protocol):
    """What a worker reports at start (`WorkerInfo`, a `Worker`)."""

    num_kv_blocks: int
    block_size: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    max_model_len: int


class ControllerCore(Routing, Stepping):
    def __init__(self, pools: list[PoolSpec], options: ControllerOptions | None = None,
                 model: ModelFacts | None = None, clock: Callable[[], float] | None = None):
        """One worker per pool, each with its scheduler, flow control and protections as
        `options`' sections say (the scheduler's policy, a budget table's cost model)."""
        if not pools:
            raise ValueError("at least one worker is needed")
        options = options or ControllerOptions()
        model = model or ModelFacts()
        self.clock = clock or (lambda: 0.0)
        self.eos_token_ids = model.eos_token_ids
        self.vocab_size = model.vocab_size
        self.max_model_len = model.max_model_len
        self.max_queue_len = options.protections.max_queue_len
        self.degraded_config = options.degraded
        self.options = options  # what a worker added later is built with
        self._scheduler_cls = make_scheduler_class(options.scheduler.scheduling_policy)
        self._arrivals = itertools.count()  # one arrival order across workers
        self.workers = [self._new_worker_state(p) for p in pools]
        self.request_to_worker: dict[str, int] = {}
        self._ids = itertools.count()
        self._next_tie = 0

    def _new_worker_state(self, pool: PoolSpec) -> WorkerState:
        """A worker's scheduler, flow control and protections as the options' sections say
        (the scheduler's policy, a budget table's cost model)."""
        options = self.options
        scheduler_config, protection_config = options.scheduler, options.protections
        step_cost = options.step_cost
        # The protections and the step deadline price chunks by the calibrated model,
        # else by a fixed cost per token; the scheduler sizes chunks only by a calibrated one.
        chunk_cost = step_cost or StepCost.per_token(protection_config.seconds_per_token)
        scheduler = self._scheduler_cls(
            scheduler_config, KVCacheManager(BlockPool(pool.num_blocks, pool.block_size,
                                                       pool.enable_prefix_caching)),
            clock=self.clock, arrivals=self._arrivals, step_cost=step_cost,
            itl_slo_s=options.itl_slo_s, depth_stretch=options.depth_stretch,
            chunk_efficiency=options.chunk_efficiency)
        scheduler.max_decode_steps = pool.max_decode_steps
        scheduler.max_chunk_steps = pool.max_chunk_steps
        return WorkerState(
            scheduler,
            FlowControl(options.flow, scheduler_config.max_concurrent_chunks),
            Protections(protection_config, chunk_cost), step_cost=step_cost,
            refit=None if step_cost is None else OnlineRefit(
                protection_config, options.slo, step_cost, options.itl_slo_s,
                options.refit_slo_scale))

    def add_worker(self, pool: PoolSpec) -> int:
        """A worker joined (its model loaded): it takes new requests from now on. Returns
        its index, the next one (indices never shift: a removed worker keeps its own)."""
        self.workers.append(self._new_worker_state(pool))
        return len(self.workers) - 1

    @staticmethod
    def pool_of(options: ControllerOptions, worker: WorkerFacts) -> PoolSpec:
        """A worker's pool as it reports it (`WorkerInfo`, an in-process `Worker`): its
        blocks, its decode bursts by its device (a worker without one: none), its chunk
        bursts as configured."""
        return PoolSpec(worker.num_kv_blocks, worker.block_size,
                        options.cache.enable_prefix_caching,
                        options.scheduler.max_decode_steps(str(getattr(worker, "device", ""))),
                        options.scheduler.chunk_steps)

    @classmethod
    def for_workers(cls, options: ControllerOptions, workers: Sequence[WorkerFacts],
                    clock: Callable[[], float] | None = None) -> ControllerCore:
        """The one way a core is built outside tests (the controller actor, `LocalEngine`,
        the benchmarks): a pool per worker as it reports it, the model's limits from the
        first (every worker runs the same model), the configured max_model_len capped by
        the model's."""
        first = workers[0]
        pools = [cls.pool_of(options, w) for w in workers]
        max_model_len = min([options.worker.max_model_len, *(w.max_model_len for w in workers)])
        return cls(pools, options, ModelFacts(tuple(first.eos_token_ids), max_model_len,
                                              first.vocab_size), clock)

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

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT
              ) -> RequestOutput | None:
        """Finish a request as aborted (or, `reason` STOP, as stopped by a stop string the
        edge matched); its blocks are released now (their `cache_evict` reaches flow
        control before the worker's next plan)."""
        worker = self.request_to_worker.pop(request_id, None)
        if worker is None:
            return None
        state = self.workers[worker]
        state.protections.forget(request_id)  # its prefill timing would linger
        status = RequestStatus.FINISHED_STOPPED if reason == FinishReason.STOP \
            else RequestStatus.FINISHED_ABORTED
        out = state.scheduler.abort_request(request_id, status)
        self._queue_evicts(state)
        return out

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
        targets: set[int] = set()
        aborted: list[RequestOutput] = []
        for request in self._detach_all(worker):
            request.num_worker_failures += 1
            if request.num_worker_failures >= max_failures_per_request:
                aborted.append(self._end_detached(
                    request, f"request was on {request.num_worker_failures} failed workers"))
                continue
            target = self._reroute(request, exclude=worker)
            self.workers[target].scheduler.adopt_request(request)
            self.request_to_worker[request.request_id] = target
            targets.add(target)
        return sorted(targets), aborted

    def evacuate(self, worker: int) -> tuple[list[int], list[RequestOutput]]:
        """A draining worker's time is up: its unfinished requests move, as a failed
        worker's do (recomputed elsewhere, same tokens), but the move counts as no failure.
        One that fits no other worker is ended with an error. Returns (workers that
        received requests, ended outputs)."""
        targets: set[int] = set()
        ended: list[RequestOutput] = []
        for request in self._detach_all(worker):
            target = self._reroute(request, exclude=worker)
            if target == worker:
                ended.append(self._end_detached(
                    request, "its worker was drained and no other worker can hold it"))
                continue
            self.workers[target].scheduler.adopt_request(request)
            self.request_to_worker[request.request_id] = target
            targets.add(target)
        return sorted(targets), ended

    def _detach_all(self, worker: int) -> list[Request]:
        """Every unfinished request of `worker`, taken away to be recomputed elsewhere; the
        worker's steps in flight and its prefix hashes are forgotten (its KV is lost)."""
        state = self.workers[worker]
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
        return detached

    def _end_detached(self, request: Request, error: str) -> RequestOutput:
        self.request_to_worker.pop(request.request_id, None)
        request.status = RequestStatus.FINISHED_ABORTED
        return RequestOutput(
            request.request_id, [], request.status.finish_reason, request.num_prompt_tokens,
            request.num_output_tokens, request.num_cached_tokens, error=error)

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

    def reset_prefix_cache(self, worker: int) -> int:
        """The worker lost its KV (restart): no prefix hash of its pool may be served again.
        Returns how many hashes were dropped."""
        return self.workers[worker].scheduler.kv.pool.reset_prefix_cache()

    def worker_stats(self, worker: int) -> WorkerStats:
        return worker_stats(self.workers[worker])

    def has_work(self, worker: int) -> bool:
        state = self.workers[worker]
        return state.scheduler.has_work() or bool(state.outbox)

    def has_unfinished(self) -> bool:
        return any(state.scheduler.has_unfinished() for state in self.workers)

    def check_integrity(self) -> None:
        for state in self.workers:
            state.scheduler.kv.pool.check_integrity()
