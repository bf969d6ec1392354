"""`LocalEngine`: the controller core and one worker in one process.

Used by tests, benchmarks and `python -m cluster.batch --local`. The same
`ControllerCore` runs inside the Ray controller actor; only the transport differs.
"""

from __future__ import annotations

import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from controller.budget import BudgetTable
from controller.core import ControllerCore
from controller.gc_freeze import freeze_long_lived
from controller.messages import FinishReason, RequestOutput, SamplingParams, StepPlan, StepResult
from controller.step_loop import StepLoop

if TYPE_CHECKING:  # pydantic stays out of importers that bring their own engine (gpu_bench)
    from cluster.config import TokenflowConfig
    from workers.worker import PendingStep


@dataclass
class Completion:
    """A finished request, as `generate` returns it."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    num_cached_tokens: int = 0


class LocalEngine:
    def __init__(self, config: TokenflowConfig | None = None,
                 clock: Callable[[], float] | None = None, **overrides: object):
        from cluster.config import TokenflowConfig
        from workers.worker import build_worker  # torch stays out of torch-free importers

        self.config = config or TokenflowConfig(**overrides)  # type: ignore[arg-type]
        cfg = self.config
        wcfg = cfg.worker
        self.worker = build_worker(wcfg, cfg.cache)
        options = cfg.controller_options()  # with a budget file's table applied
        auto = options.auto_budget
        if auto is not None:  # measured on this engine's own worker, as the actor's worker 0
            from workers.auto_budget import worker_budget_table

            result = worker_budget_table(self.worker, wcfg.model, wcfg.dtype, auto,
                                         progress=True)
            self.worker.reset()
            options = options.with_budget_table(BudgetTable(result.data), auto.calibration)
        self.options = options
        self.core = ControllerCore.for_workers(options, [self.worker], clock or time.monotonic)
        # scheduler.async_scheduling: the next step is planned and launched while the
        # worker runs the current one (controller/step_loop.py); else one step at a time.
        self.loop = StepLoop(self.core, 0, self.worker.launch, self._wait,
                             is_ahead=options.scheduler.is_async(is_actor=False))
        self._pending: dict[str, deque[RequestOutput]] = defaultdict(deque)
        self.step_log: list[tuple[StepPlan, StepResult]] = []  # kept only when asked
        self.keep_step_log = False
        freeze_long_lived("LocalEngine")  # no full collection of the model mid-step

    @property
    def scheduler(self):  # the single worker's scheduler
        return self.core.scheduler(0)

    # -- requests ---------------------------------------------------------------------
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                    request_id: str | None = None, priority: int = 0,
                    tenant: str = "default") -> str:
        request = self.core.add_request(prompt_token_ids, params, request_id, priority, tenant)
        return request.request_id

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> None:
        out = self.core.abort(request_id, reason)
        if out is not None:
            self._pending[request_id].append(out)

    # -- stepping ---------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduler step on the worker; returns the deltas it produced. With async
        scheduling: the deltas of the step that was running, the next one launched."""
        return self.loop.step().outputs

    def _wait(self, pending: PendingStep) -> StepResult:
        result = self.worker.wait(pending)
        if self.keep_step_log:
            self.step_log.append((pending.plan, result))
        return result

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    def has_work(self) -> bool:
        """Something to step: a request to advance, or a step still running."""
        return self.loop.has_work()

    def drain(self) -> list[RequestOutput]:
        """Finish the step still running (async scheduling), launching nothing after it."""
        return self.loop.drain()

    def stream(self, request_id: str) -> Iterator[RequestOutput]:
        """Deltas of one request; steps the engine as needed (others' deltas are kept)."""
        while True:
            queue = self._pending[request_id]
            while queue:
                out = queue.popleft()
                yield out
                if out.finished:
                    del self._pending[request_id]
                    return
            if not self.has_work():
                raise RuntimeError(f"request {request_id} is not running")
            for out in self.step():
                self._pending[out.request_id].append(out)

    def generate(self, prompts: list[list[int]],
                 params: SamplingParams | list[SamplingParams]) -> list[Completion]:
        """Run prompts to completion; results in prompt order."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params_list, strict=True)]
        done = {rid: Completion(rid, list(p)) for rid, p in zip(ids, prompts, strict=True)}
        while any(c.finish_reason is None for c in done.values()):
            if not self.has_work():
                raise RuntimeError("engine idle with unfinished requests")
            for out in self.step():
                completion = done.get(out.request_id)
                if completion is None:
                    self._pending[out.request_id].append(out)
                    continue
                completion.output_token_ids.extend(out.new_token_ids)
                completion.finish_reason = out.finish_reason
                completion.num_cached_tokens = out.num_cached_tokens
        return [done[rid] for rid in ids]

    def check_integrity(self) -> None:
        """Pool partition holds and, once idle, the worker holds no block."""
        self.core.check_integrity()
        if not self.core.has_unfinished():
            for out in self.drain():  # a step planned past a request's stop
                self._pending[out.request_id].append(out)
            self.step()  # deliver pending finished ids so the worker drops its tables
            assert not self.worker.held_block_ids(), "worker still holds blocks"
