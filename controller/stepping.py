"""The step verbs with their events: `begin_step` plans within the limits flow control and
the protections set, `finish_step` applies a worker's result, prices its chunks and feeds
the `chunk_complete` / `cache_evict` events to flow control and the protections. A part of
`ControllerCore`; `StepLoop` (controller/step_loop.py) sequences the verbs."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from controller.budget import StepCost
from controller.messages import CacheEvict, ChunkComplete, RequestOutput, StepPlan, StepResult
from controller.scheduler import StepLimits, StepShape
from controller.worker_state import DegradedConfig, WorkerState


class Stepping:
    """The core's step verbs (a part of `ControllerCore`)."""

    workers: list[WorkerState]
    clock: Callable[[], float]
    degraded_config: DegradedConfig
    request_to_worker: dict[str, int]

    def abort(self, request_id: str) -> RequestOutput | None:  # ControllerCore's
        raise NotImplementedError

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
        assert plan.carries_nothing
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
        hists.prefill_tokens.observe(num_prefill * plan.num_steps)
        # A burst computes its chunk and its decodes num_steps times.
        hists.decode_tokens.observe((plan.total_num_scheduled_tokens - num_prefill)
                                    * plan.num_steps)

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
        cost = state.step_cost
        if cost is not None and shape is not None and shape.chunks:
            if shape.num_steps > 1:  # a chunk burst: one chunk a step, each its step's time
                # A decode recomputing an admitted token (after a preemption) reports an
                # event too: it keeps the protections' default price.
                (chunk_id,) = shape.chunks
                own = [e for e in events if e.request_id == chunk_id]
                for event, step in zip(own, shape.steps(), strict=False):
                    step_shape = StepShape(shape.step_id, {chunk_id: step[0][0]}, step[1],
                                           step[2])
                    self._price_step(state, cost, step_shape, [event], event.elapsed_s)
            else:
                self._price_step(state, cost, shape, events,
                                 result.elapsed_s or max(e.elapsed_s for e in events))
            return
        step_s = result.elapsed_s or max(e.elapsed_s for e in events)
        alone = [state.protections.step_cost.chunk_s(e.num_tokens, e.start) for e in events]
        total = sum(alone)
        for e, budgeted in zip(events, alone, strict=True):
            charged = step_s * budgeted / total if total > 0 else e.elapsed_s
            state.chunk_charges[(e.request_id, e.chunk_index)] = (charged, budgeted)

    @staticmethod
    def _price_step(state: WorkerState, cost: StepCost, shape: StepShape,
                    events: list[ChunkComplete], step_s: float) -> None:
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
            state.scheduler.itl_slo_s = state.refit.itl_slo_s
        state.scheduler.slo_headroom = state.refit.headroom

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
