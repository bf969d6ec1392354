"""A scheduler's results side (a part of `Scheduler`): a worker's `StepResult` applied to
the requests it advanced, their outputs, finished requests released; and the shapes of
planned steps, kept until their results are priced."""

from __future__ import annotations

from collections.abc import Callable

from controller.logprobs import PromptLogprobs
from controller.messages import RequestOutput, StepPlan, StepResult
from controller.request import Request, RequestStatus
from controller.scheduler_config import SchedulerStats, StepShape
from controller.step_cost import StepCost
from kvcache.manager import KVCacheManager


class SchedulerResults:
    _shapes: dict[int, StepShape]
    running: list[Request]
    waiting: dict[str, Request]
    requests: dict[str, Request]
    stats: SchedulerStats
    kv: KVCacheManager
    _release: Callable[[Request], None]
    step_cost: StepCost | None

    def step_context_len(self, step_id: int) -> int:
        """The longest context a planned step reads (its deadline's size): from the step's
        shape, without a pass over the running requests; a baseline's step has none."""
        shape = self._shapes.get(step_id)
        if shape is None:
            return max((r.num_tokens for r in self.running), default=0)
        steps = shape.num_steps  # a burst's last step reads the deepest
        return max([shape.decode_context + steps,
                    *(depth + num * steps for num, depth in shape.chunks.values())])

    def predicted_step_s(self, step_id: int) -> float | None:
        """The cost model's time of a planned step, a burst's steps together (None without
        a model or a shape)."""
        shape = self._shapes.get(step_id)
        if self.step_cost is None or shape is None:
            return None
        return sum(self.step_cost.step_s(*step) for step in shape.steps())

    def pop_shape(self, step_id: int) -> StepShape | None:
        """The shape of a step whose result is in (None for a baseline policy's step)."""
        for older in [sid for sid in self._shapes if sid < step_id]:
            del self._shapes[older]  # steps whose results were dropped (worker failure)
        return self._shapes.pop(step_id, None)

    def update_from_output(self, plan: StepPlan, result: StepResult) -> list[RequestOutput]:
        outputs = []
        shape = self._shapes.get(plan.step_id)
        for request_id, num_new in plan.num_scheduled_tokens.items():
            request = self.requests.get(request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted or preempted while the step ran
            is_prefill = request_id in shape.chunks if shape is not None else num_new > 1
            if is_prefill:
                self.stats.num_prefill_tokens += num_new * plan.num_steps
            else:
                self.stats.num_decode_tokens += num_new * plan.num_steps
            sampled = result.sampled_token_ids.get(request_id, [])
            # A sample only exists where the plan counted one pending.
            assert len(sampled) <= request.num_pending_outputs
            request.num_pending_outputs -= len(sampled)
            if len(sampled) > 1:  # a decode burst: what follows a stop is dropped
                sampled = self._until_stop(request, sampled)
            else:
                request.output_token_ids.extend(sampled)
            prompt_lps = result.prompt_logprobs.get(request_id)
            if prompt_lps is not None:
                if request.prompt_logprobs is None:
                    request.prompt_logprobs = PromptLogprobs()
                request.prompt_logprobs.add(*prompt_lps)
            # Computed (or planned: steps run in order, the next one writes it before
            # anyone reads it) and known: full blocks up to there can be hashed.
            num_ready = min(request.num_computed_tokens, request.num_tokens)
            if self.kv.has_new_full_block(request_id, num_ready):
                self.kv.cache_full_blocks(request_id, request.all_token_ids, num_ready)
            finish = request.check_stop() if sampled else None
            if finish is not None:
                self._finish(request, finish)
            if sampled or finish is not None:
                out = self._output(request, sampled)
                if sampled and request.sampling_params.logprobs is not None:
                    out.logprobs = [result.sampled_logprobs[request_id]]
                if request.prompt_logprobs is not None and sampled:
                    out.prompt_logprobs = request.prompt_logprobs.take()
                outputs.append(out)
        return outputs

    @staticmethod
    def _until_stop(request: Request, sampled: list[int]) -> list[int]:
        """Append a burst's tokens up to the first that ends the request; -> those kept."""
        for num_kept, token in enumerate(sampled, 1):
            request.output_token_ids.append(token)
            if request.check_stop() is not None:
                return sampled[:num_kept]
        return sampled

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.waiting.pop(request.request_id, None)
        if request in self.running:
            self.running.remove(request)
        self._release(request)
        self.requests.pop(request.request_id, None)
        self.stats.num_finished += 1

    @staticmethod
    def _output(request: Request, new_token_ids: list[int]) -> RequestOutput:
        return RequestOutput(request.request_id, list(new_token_ids), request.status.finish_reason,
                             request.num_prompt_tokens, request.num_output_tokens,
                             request.num_cached_tokens)
