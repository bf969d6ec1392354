"""Routing: which worker a request goes to, on admission and after a worker failed."""

from __future__ import annotations

from controller.request import Request
from controller.worker_state import WorkerState


class QueueFullError(RuntimeError):
    """Every worker's waiting queue is at `max_queue_len`: the edge answers 429."""


class NoWorkerUpError(RuntimeError):
    """No worker is up (all are restarting or waiting for resources): the edge answers
    503 with Retry-After."""


class Routing:
    """The core's routing (a part of `ControllerCore`)."""

    workers: list[WorkerState]
    max_queue_len: int
    request_to_worker: dict[str, int]
    _next_tie: int

    @property
    def num_workers(self) -> int:
        return len(self.workers)

    def route(self, request: Request) -> int:
        """Prefix affinity first (the worker holding most of the prompt's blocks), then
        least loaded: KV usage plus queued tokens relative to the pool."""
        up = [w for w, state in enumerate(self.workers) if state.is_routable]
        if not up:
            raise NoWorkerUpError("no worker is up")
        candidates = [w for w in up if self.workers[w].scheduler.num_waiting < self.max_queue_len]
        if not candidates:
            raise QueueFullError("all request queues are full")
        if len(candidates) == 1:  # nothing to weigh (scoring walks every queued request)
            return candidates[0]
        shared = self.request_to_worker.get(request.sampling_params.prompt_shared_with or "")
        if shared in candidates:  # a choice goes where its prompt's blocks are
            return shared

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

    def _reroute(self, request: Request, exclude: int) -> int:
        need = request.num_tokens + request.sampling_params.max_tokens - request.num_output_tokens
        fits = [w for w, state in enumerate(self.workers)
                if w != exclude and state.is_routable and need <= state.scheduler.capacity_tokens]
        if not fits:
            return exclude  # waits for the worker to come back
        return min(fits, key=lambda w: (self.workers[w].scheduler.kv.pool.usage,
                                        self.workers[w].scheduler.num_waiting))
