"""`WorkerStats`: one typed snapshot of every counter the core keeps for a worker."""

from __future__ import annotations

from dataclasses import dataclass

from controller.histogram import HistogramSnapshot
from controller.worker_state import WorkerState


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


def worker_stats(state: WorkerState) -> WorkerStats:
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
