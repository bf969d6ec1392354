"""`/metrics`: the controller's `MetricsSnapshot` in the Prometheus text format.

The controller is the single source of truth: it counts and measures (request latencies
where deltas leave it, step histograms in the core), an ingress replica only renders one
snapshot, so every replica answers a scrape with the same series. Names carry vLLM's
suffixes where the meaning is the same (`time_to_first_token_seconds`, ...), so existing
queries carry over by changing the prefix. The prefix is `tokenflow_`, not vLLM's
`name:` form: Prometheus reserves ':' for recording rules and `promtool check metrics`
flags it. Label cardinality is bounded: workers, modes, finish reasons and kinds are
small fixed sets; tenants beyond `metrics.max_tenant_labels` fold into `other`; no
request id is ever a label.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

from controller.flow import Mode
from controller.histogram import HistogramSnapshot
from controller.pool import SCALE_EVENT_LABELS, WORKER_STATES
from controller.request_metrics import CIRCUIT_BREAKER, QUEUE_FULL, MetricsSnapshot
from controller.settings import FORBID_EXTRA, check_settings, setting
from controller.slo import SloConfig
from controller.worker_stats import WorkerStats

PREFIX = "tokenflow_"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
OTHER_TENANT = "other"


@dataclass(frozen=True)
class MetricsConfig:
    """The `/metrics` exporter (`metrics:`); the dashboard's SLO lines are the `slo:` section's."""

    __pydantic_config__ = FORBID_EXTRA

    max_tenant_labels: int = setting(16, ge=1, description=(
        "Tenants with their own `tenant` label (the most prefill tokens first); the rest "
        "fold into `other`, so the series count stays bounded."))

    def __post_init__(self) -> None:
        check_settings(self)


def fold_tenants(tenant_to_value: dict[str, int], ranking: dict[str, int],
                 max_labels: int) -> dict[str, int]:
    """At most `max_labels` tenants keep their name (the top of `ranking`, ties by name);
    the others are summed under `other`. Every replica folds alike (pure function)."""
    order = sorted(ranking, key=lambda t: (-ranking[t], t))
    if len(order) <= max_labels:
        return dict(sorted(tenant_to_value.items()))
    kept = set(order[:max_labels - 1])  # one label is left for `other`
    out: dict[str, int] = {}
    for tenant, value in sorted(tenant_to_value.items()):
        label = tenant if tenant in kept else OTHER_TENANT
        out[label] = out.get(label, 0) + value
    return out


def _buckets(hist: HistogramSnapshot) -> list[tuple[str, float]]:
    return [(floatToGoString(bound), n) for bound, n in hist.cumulative()]


class _Families:
    """Builds the metric families of one scrape."""

    def __init__(self) -> None:
        self.families: list[Metric] = []

    def gauge(self, name: str, doc: str, labels: Iterable[str] = ()) -> GaugeMetricFamily:
        family = GaugeMetricFamily(PREFIX + name, doc, labels=list(labels))
        self.families.append(family)
        return family

    def counter(self, name: str, doc: str, labels: Iterable[str] = ()) -> CounterMetricFamily:
        family = CounterMetricFamily(PREFIX + name, doc, labels=list(labels))
        self.families.append(family)
        return family

    def histogram(self, name: str, doc: str, labels: Iterable[str] = ()
                  ) -> HistogramMetricFamily:
        family = HistogramMetricFamily(PREFIX + name, doc, labels=list(labels))
        self.families.append(family)
        return family


def metric_families(snap: MetricsSnapshot, config: MetricsConfig,
                    slo: SloConfig) -> list[Metric]:
    f = _Families()
    req = snap.requests
    for name, doc, hist in (
            ("time_to_first_token_seconds", "Arrival at the controller to the first token "
             "leaving it.", req.ttft_s),
            ("inter_token_latency_seconds", "Time between two tokens of a request leaving "
             "the controller.", req.itl_s),
            ("e2e_request_latency_seconds", "Arrival to the last delta (any finish).",
             req.e2e_s),
            ("request_queue_time_seconds", "Arrival to the first step that scheduled the "
             "request.", req.queue_time_s)):
        f.histogram(name, doc).add_metric([], _buckets(hist), hist.total)
    success = f.counter("request_success", "Finished requests by finish reason: stop (EOS, "
                        "a stop token or string), length, abort (the client went away, a "
                        "protection), error (the request failed).", ["finished_reason"])
    for reason in sorted({"stop", "length", "abort", "error",
                          *req.finished_reason_to_count}):
        success.add_metric([reason], req.finished_reason_to_count.get(reason, 0))
    f.counter("prompt_tokens", "Prompt tokens of requests that produced a first token (once "
              "for the n choices of one request)."
              ).add_metric([], req.num_prompt_tokens)
    f.counter("generation_tokens", "Generated tokens delivered.").add_metric(
        [], req.num_generation_tokens)
    features = f.counter("request_features", "Admitted requests by what they asked for: "
                         "logprobs, prompt_logprobs (echo), extra_choice (each choice past "
                         "the first of n or best_of).", ["feature"])
    for feature, count in sorted(req.feature_to_count.items()):
        features.add_metric([feature], count)
    f.counter("circuit_breaker_rejections", "Requests refused with 422: prompt over the "
              "prefill cap.").add_metric([], req.rejection_to_count.get(CIRCUIT_BREAKER, 0))
    f.counter("queue_full_rejections", "Requests refused with 429: every waiting queue "
              "full.").add_metric([], req.rejection_to_count.get(QUEUE_FULL, 0))
    f.gauge("ttft_slo_seconds", "The configured TTFT SLO (slo.ttft_s).").add_metric(
        [], slo.ttft_s)
    # The configured ITL SLO, else the controller's (derived from its budget table).
    itl_slo_s = slo.itl_ms / 1e3 if slo.itl_ms is not None else snap.itl_slo_s
    f.gauge("itl_slo_seconds", "The ITL SLO steps are planned for (slo.itl_ms, or the one "
            "derived from the budget table, as online refits moved it)."
            ).add_metric([], itl_slo_s or 0.0)
    ids = snap.worker_ids or list(range(len(snap.workers)))
    _worker_families(f, snap.workers, ids)
    node = f.gauge("worker_node", "1 for the Ray node each worker runs on (one series per "
                   "worker: the label set stays bounded).", ["worker", "node"])
    for index, node_id in zip(ids, snap.worker_nodes, strict=False):
        node.add_metric([str(index), node_id or "unknown"], 1.0)
    _pool_families(f, snap)
    _tenant_families(f, snap.workers, config.max_tenant_labels)
    return f.families


_MODE_CHANGES = [(a.name, b.name) for a in Mode for b in Mode if a != b]


def _pool_families(f: _Families, snap: MetricsSnapshot) -> None:
    states = f.gauge("workers", "Workers by state: loading (started, model not loaded yet "
                     "or waiting for resources), serving, draining (no new requests).",
                     ["state"])
    for state in WORKER_STATES:  # every state from the first scrape, 0 included
        states.add_metric([state], snap.pool_states.get(state, 0))
    events = f.counter("scale_events", "Workers added (up) and drained (down), by reason: "
                       "the scaling policy's (queue, ttft, below_min, idle, above_max) or "
                       "an operator's.", ["direction", "reason"])
    for direction, reason in SCALE_EVENT_LABELS:
        events.add_metric([direction, reason], snap.scale_events.get((direction, reason), 0))


def _worker_families(f: _Families, workers: list[WorkerStats], ids: list[int]) -> None:
    w = ["worker"]
    up = f.gauge("worker_up", "1 while the worker is in routing, 0 from a failure until it "
                 "is back.", w)
    running = f.gauge("num_requests_running", "Requests holding KV blocks.", w)
    waiting = f.gauge("num_requests_waiting", "Requests queued (new or preempted).", w)
    usage = f.gauge("kv_cache_usage_perc", "Share of KV blocks in use (1 = full).", w)
    preempt = f.counter("num_preemptions", "Requests preempted to free KV blocks.", w)
    queries = f.counter("prefix_cache_queries", "Prompt tokens looked up in the prefix "
                        "cache.", w)
    hits = f.counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", w)
    computed = f.counter("computed_tokens", "Tokens computed by kind.", ["worker", "kind"])
    mode = f.gauge("flow_mode", "1 for the worker's current flow-control mode.",
                   ["worker", "mode"])
    transitions = f.counter("flow_transitions", "Flow-control mode changes.",
                            ["worker", "from", "to"])
    chunk_queue = f.gauge("chunk_queue_length", "Requests still needing prefill chunks.", w)
    pressure = f.gauge("cache_pressure_ratio", "KV usage as flow control last saw it (cache "
                       "pressure enters above flow.cache_enter, leaves below "
                       "flow.cache_exit).", w)
    bandwidth = f.gauge("bandwidth_utilization_5s_avg", "Moving average of memory-bandwidth "
                        "utilisation over flow.bw_window_s.", w)
    slow = f.counter("slow_requests", "Requests whose budget_score exceeded "
                     "protections.slow_score_threshold.", w)
    deviation = f.counter("budget_deviation", "Prefill chunks whose time deviated from the "
                          "cost model beyond protections.deviation_threshold.", w)
    timeouts = f.counter("chunk_timeouts", "Prefill chunks over their timeout (the request "
                         "is aborted).", w)
    degraded = f.gauge("degraded_mode", "1 while the worker serves on the degraded path.", w)
    defrag = f.counter("kv_defrag_moves", "KV blocks moved by defragmentation.", w)
    budget = f.histogram("step_budget_tokens", "Token budget of each non-empty step.", w)
    scheduled = f.histogram("step_scheduled_tokens", "Tokens scheduled per non-empty step by "
                            "kind (a burst's: all of its steps').", ["worker", "kind"])
    duration = f.histogram("step_duration_seconds", "Plan to applied result, per step (a "
                           "burst is one).", w)
    score = f.histogram("budget_score", "Actual / budgeted prefill time per request.", w)
    for s_index, s in zip(ids, workers, strict=True):
        k = str(s_index)
        up.add_metric([k], float(s.is_up))
        running.add_metric([k], s.num_running)
        waiting.add_metric([k], s.num_waiting)
        usage.add_metric([k], s.kv_usage)
        preempt.add_metric([k], s.num_preemptions)
        queries.add_metric([k], s.num_prefix_query_tokens)
        hits.add_metric([k], s.num_prefix_hit_tokens)
        computed.add_metric([k, "prefill"], s.num_prefill_tokens)
        computed.add_metric([k, "decode"], s.num_decode_tokens)
        for m in Mode:
            mode.add_metric([k, m.name], float(s.flow_mode == m.name))
        # Every possible change from the first scrape, so that panels over it have a
        # series (0) before the first mode change.
        for old, new in _MODE_CHANGES:
            transitions.add_metric([k, old, new],
                                   s.flow_transition_to_count.get((old, new), 0))
        chunk_queue.add_metric([k], s.num_prefill_pending)
        pressure.add_metric([k], s.flow_kv_usage)
        bandwidth.add_metric([k], s.bandwidth_avg)
        slow.add_metric([k], s.num_slow_requests)
        deviation.add_metric([k], s.num_budget_deviations)
        timeouts.add_metric([k], s.num_chunk_timeouts)
        degraded.add_metric([k], float(s.is_degraded))
        defrag.add_metric([k], s.num_defrag_moves)
        budget.add_metric([k], _buckets(s.step_budget_tokens), s.step_budget_tokens.total)
        scheduled.add_metric([k, "prefill"], _buckets(s.step_prefill_tokens),
                             s.step_prefill_tokens.total)
        scheduled.add_metric([k, "decode"], _buckets(s.step_decode_tokens),
                             s.step_decode_tokens.total)
        duration.add_metric([k], _buckets(s.step_duration_s), s.step_duration_s.total)
        score.add_metric([k], _buckets(s.budget_score), s.budget_score.total)


def _tenant_families(f: _Families, workers: list[WorkerStats], max_labels: int) -> None:
    prefill: dict[str, int] = {}
    waiting: dict[str, int] = {}
    for s in workers:
        for tenant, n in s.tenant_to_prefill_tokens.items():
            prefill[tenant] = prefill.get(tenant, 0) + n
        for tenant, n in s.tenant_to_num_waiting.items():
            waiting[tenant] = waiting.get(tenant, 0) + n
    ranking = {t: prefill.get(t, 0) for t in {*prefill, *waiting}}
    tokens = f.counter("tenant_prefill_tokens", "Prefill tokens scheduled per tenant.",
                       ["tenant"])
    for tenant, n in fold_tenants(prefill, ranking, max_labels).items():
        tokens.add_metric([tenant], n)
    queued = f.gauge("tenant_requests_waiting", "Requests queued per tenant.", ["tenant"])
    # Every labelled tenant reports, 0 included, so a drained queue reads 0, not absent.
    folded = fold_tenants(dict.fromkeys(ranking, 0) | waiting, ranking, max_labels)
    for tenant, n in folded.items():
        queued.add_metric([tenant], n)


class _SnapshotCollector:
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


def render(snap: MetricsSnapshot, config: MetricsConfig, slo: SloConfig) -> bytes:
    """The exposition text of one snapshot (a fresh registry: nothing is kept between
    scrapes, so replicas cannot drift apart)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_SnapshotCollector(metric_families(snap, config, slo)))
    return generate_latest(registry)
