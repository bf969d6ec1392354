"""Baseline scheduling policies users run today, on the same engine (benchmarks only).

- `prefill-first` (vLLM V0's default): waiting prompts are prefilled whole, in steps
  that carry no decode; decoding pauses while any prompt waits.
- `prefill-priority-chunked` (nano-vllm's rule): prefill steps come first and only the
  first prefill of a step may be cut to fit the budget; prefill and decode never share
  a step.
- `tokenflow`: the unified, decode-first `Scheduler` itself.
Both baselines reuse the scheduler's bookkeeping (allocation, preemption, plan diffs);
only the choice of who advances how far differs.
"""

from __future__ import annotations

from controller.messages import StepPlan
from controller.request import Request, RequestStatus
from controller.scheduler import Scheduler, StepLimits

POLICIES = ("tokenflow", "prefill-first", "prefill-priority-chunked")


class _PrefillFirstBase(Scheduler):
    """Prefill-only steps while prompts wait; otherwise decode-only steps."""

    allow_cut = False  # may the first prefill of a step be cut to the budget?

    def schedule(self, limits: StepLimits | None = None) -> StepPlan:
        # Flow-control limits are the unified scheduler's; a baseline ignores them.
        plan = StepPlan(step_id=next(self._step_ids))
        scheduled: dict[str, int] = {}
        budget = self.config.max_num_batched_tokens
        # A cut prompt left over from the previous step continues first.
        partial = [r for r in self.running if r.is_prefilling]
        for request in partial:
            num_new = min(request.num_tokens_to_compute, budget)
            if num_new > 0 and self._allocate_or_preempt(request, num_new, scheduled):
                scheduled[request.request_id] = num_new
                budget -= num_new
        if not scheduled:
            for request in sorted(self.waiting.values(), key=lambda r: r.sort_key):
                if len(self.running) >= self.config.max_num_seqs:
                    break
                need = request.num_tokens_to_compute
                cut = self.allow_cut and not scheduled
                if need > budget and not (cut or not scheduled):
                    break
                num_new = min(need, budget) if cut else need
                if num_new == 0 or not self._admit_whole(request, num_new):
                    break
                scheduled[request.request_id] = num_new
                budget -= num_new
                if budget <= 0:
                    break
        if not scheduled:  # no prefill this step: decode everyone
            for request in [r for r in self.running if r.is_decoding]:
                if budget == 0:
                    break
                if request.status == RequestStatus.RUNNING \
                        and self._allocate_or_preempt(request, 1, scheduled):
                    scheduled[request.request_id] = 1
                    budget -= 1
        self._fill_plan(plan, scheduled)
        self.stats.num_steps += 1
        self.stats.num_scheduled_tokens += plan.total_num_scheduled_tokens
        return plan

    def _admit_whole(self, request: Request, num_new: int) -> bool:
        if self.kv.allocate_slots(request.request_id, num_new) is None:
            return False
        del self.waiting[request.request_id]
        request.num_computed_tokens = 0
        if request.first_scheduled_time is None:
            request.first_scheduled_time = self.clock()
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        return True


class PrefillFirstScheduler(_PrefillFirstBase):
    """vLLM V0: a whole prompt per prefill step even past the budget (the budget only
    limits how many prompts share the step), decodes paused meanwhile."""

    allow_cut = False

    def _max_plan_tokens(self, plan: StepPlan) -> int:
        # A whole prompt may exceed the budget here: that is the policy being measured.
        return max(self.config.max_num_batched_tokens, plan.total_num_scheduled_tokens)


class PrefillPriorityChunkedScheduler(_PrefillFirstBase):
    """nano-vllm: prefill first, the first prefill of a step may be cut to the budget."""

    allow_cut = True


def make_scheduler_class(policy: str) -> type[Scheduler]:
    classes: dict[str, type[Scheduler]] = {
        "tokenflow": Scheduler,
        "prefill-first": PrefillFirstScheduler,
        "prefill-priority-chunked": PrefillPriorityChunkedScheduler,
    }
    if policy not in classes:
        raise ValueError(f"unknown scheduling policy {policy!r}; one of {sorted(classes)}")
    return classes[policy]
