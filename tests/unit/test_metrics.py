"""`/metrics` rendering from a real `ControllerCore` (scripted worker, virtual time):
every series the dashboard needs is there, histograms are bounded and consistent, tenants
fold, and Prometheus' own linter (`promtool check metrics`) finds nothing."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster.metrics import MetricsConfig, fold_tenants, render
from controller.flow import Mode
from controller.histogram import Histogram
from controller.messages import SamplingParams
from controller.request_metrics import (
    CIRCUIT_BREAKER,
    QUEUE_FULL,
    MetricsSnapshot,
    RequestMetrics,
)
from controller.slo import SloConfig
from tests.unit.test_flow_core import Harness


def _drive_through_cache_pressure() -> tuple[Harness, RequestMetrics]:
    h = Harness(num_blocks=100, budget=64)
    metrics = RequestMetrics()
    for i in range(4):  # 84 % of the pool once decoding starts: CACHE_PRESSURE_WAIT
        params = SamplingParams(max_tokens=12 + 8 * i, temperature=0.0, ignore_eos=True)
        request = h.core.add_request(list(range(1, 85)), params, request_id=f"d{i}",
                                     tenant=f"t{i}")
        metrics.on_admit(request)
    while h.core.has_unfinished():
        n = len(h.outputs)
        h.step()
        for out in h.outputs[n:]:
            metrics.on_output(out, h.now)
        assert h.now < 500
    metrics.on_reject(QUEUE_FULL)
    metrics.on_reject(CIRCUIT_BREAKER)
    return h, metrics


def _samples(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text.decode())
            for s in family.samples}


def test_render_reports_what_the_core_counted() -> None:
    h, metrics = _drive_through_cache_pressure()
    stats = h.core.worker_stats(0)
    assert stats.flow_transition_to_count[("NORMAL", "CACHE_PRESSURE_WAIT")] == 1
    text = render(MetricsSnapshot([stats], metrics.snapshot()), MetricsConfig(),
                  SloConfig(itl_ms=100.0, ttft_s=1.5))
    s = _samples(text)
    # The dashboard's lines are the slo section's, in seconds.
    assert s[("tokenflow_itl_slo_seconds", ())] == 0.1
    assert s[("tokenflow_ttft_slo_seconds", ())] == 1.5
    assert s[("tokenflow_time_to_first_token_seconds_count", ())] == 4
    assert s[("tokenflow_request_success_total", (("finished_reason", "length"),))] == 4
    assert s[("tokenflow_generation_tokens_total", ())] == 12 + 20 + 28 + 36
    assert s[("tokenflow_prompt_tokens_total", ())] == 4 * 84
    # Every token after the first is one inter-token interval.
    assert s[("tokenflow_inter_token_latency_seconds_count", ())] == 12 + 20 + 28 + 36 - 4
    transition = (("from", "NORMAL"), ("to", "CACHE_PRESSURE_WAIT"), ("worker", "0"))
    assert s[("tokenflow_flow_transitions_total", transition)] == 1
    modes = {m.name: s[("tokenflow_flow_mode", (("mode", m.name), ("worker", "0")))]
             for m in Mode}
    assert sum(modes.values()) == 1 and modes[stats.flow_mode] == 1
    assert s[("tokenflow_queue_full_rejections_total", ())] == 1
    assert s[("tokenflow_circuit_breaker_rejections_total", ())] == 1
    assert s[("tokenflow_computed_tokens_total", (("kind", "prefill"), ("worker", "0")))] \
        == stats.num_prefill_tokens
    scheduled = sum(s[("tokenflow_step_scheduled_tokens_sum", (("kind", kind), ("worker", "0")))]
                    for kind in ("prefill", "decode"))
    assert scheduled == stats.num_prefill_tokens + stats.num_decode_tokens
    assert s[("tokenflow_budget_score_count", (("worker", "0"),))] == 4
    assert s[("tokenflow_tenant_prefill_tokens_total", (("tenant", "t3"),))] == 84
    assert s[("tokenflow_worker_up", (("worker", "0"),))] == 1
    assert metrics.num_tracked == 0  # finished requests leave no per-request state


@pytest.mark.skipif(shutil.which("promtool") is None,
                    reason="promtool missing: apt-get install prometheus (.ci/run does)")
def test_promtool_finds_no_problem() -> None:
    h, metrics = _drive_through_cache_pressure()
    text = render(MetricsSnapshot([h.core.worker_stats(0)], metrics.snapshot()),
                  MetricsConfig(), SloConfig(itl_ms=100.0))
    out = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True,
                         timeout=60)
    assert out.returncode == 0 and not out.stdout and not out.stderr, out


def test_tenants_beyond_the_cap_fold_into_other() -> None:
    ranking = {"a": 50, "b": 40, "c": 30, "d": 1}
    assert fold_tenants(ranking, ranking, 3) == {"a": 50, "b": 40, "other": 31}
    assert fold_tenants(ranking, ranking, 4) == ranking
    # Pure: equal input, equal labels (two replicas fold alike).
    assert fold_tenants({"d": 2, "a": 1}, ranking, 2) == {"a": 1, "other": 2}


def test_histogram_buckets_are_le_and_bounded() -> None:
    hist = Histogram((0.005, 0.01, 60.0))
    for value in (0.005, 0.0051, 0.5, 61.0):
        hist.observe(value)
    hist.observe(0.001, 3)
    snap = hist.snapshot()
    assert snap.cumulative() == [(0.005, 4), (0.01, 5), (60.0, 6), (float("inf"), 7)]
    assert snap.count == 7 and len(snap.counts) == 4
    with pytest.raises(ValueError):
        Histogram((1.0, 0.5))


def test_every_flow_transition_and_worker_node_has_a_series_from_the_first_scrape() -> None:
    """A panel over `flow_transitions_total` reads 0, not "No data", before any mode change;
    each worker names its Ray node once."""
    h = Harness(num_blocks=100, budget=64)
    stats = h.core.worker_stats(0)
    assert stats.flow_transition_to_count == {}
    snap = MetricsSnapshot([stats], RequestMetrics().snapshot(), worker_nodes=["node-a"])
    s = _samples(render(snap, MetricsConfig(), SloConfig(itl_ms=100.0)))
    changes = [(key, value) for key, value in s.items()
               if key[0] == "tokenflow_flow_transitions_total"]
    assert len(changes) == len(Mode) * (len(Mode) - 1)
    assert all(value == 0 for _, value in changes)
    assert s[("tokenflow_worker_node", (("node", "node-a"), ("worker", "0")))] == 1


def test_pool_states_and_scale_events_have_every_series_from_the_first_scrape() -> None:
    """Before any worker has started (an empty snapshot), `tokenflow_workers` has each
    state and `tokenflow_scale_events_total` each known (direction, reason), at 0; a
    removed worker is left out under its own index, no other index shifts."""
    from controller.pool import SCALE_EVENT_LABELS, WORKER_STATES

    s = _samples(render(MetricsSnapshot([], RequestMetrics().snapshot()), MetricsConfig(),
                        SloConfig()))
    assert {k[1][0][1]: v for k, v in s.items() if k[0] == "tokenflow_workers"} == \
        dict.fromkeys(WORKER_STATES, 0)
    events = {tuple(v for _, v in k[1]): n for k, n in s.items()
              if k[0] == "tokenflow_scale_events_total"}
    assert events == dict.fromkeys(SCALE_EVENT_LABELS, 0)
    h = Harness(num_blocks=100, budget=64)
    stats = h.core.worker_stats(0)
    snap = MetricsSnapshot([stats, stats], RequestMetrics().snapshot(), None,
                           ["node-a", "node-b"], [0, 2], {"serving": 2},
                           {("up", "queue"): 3})
    s = _samples(render(snap, MetricsConfig(), SloConfig()))
    assert {k[1][0][1] for k in s if k[0] == "tokenflow_worker_up"} == {"0", "2"}
    assert s[("tokenflow_worker_node", (("node", "node-b"), ("worker", "2")))] == 1
    assert s[("tokenflow_workers", (("state", "serving"),))] == 2
    assert s[("tokenflow_scale_events_total", (("direction", "up"), ("reason", "queue")))] == 3
