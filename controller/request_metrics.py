"""Request latencies and counts, measured once: where the controller emits deltas.

Every ingress replica reads the same numbers from the controller, so two replicas never
split or double-count a series. Times come from the controller's clock (the actor's event
loop), the same clock as `Request.arrival_time` and `first_scheduled_time`. Torch-free,
Ray-free and free of prometheus-client; the edge renders `RequestMetricsSnapshot`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from controller.histogram import LATENCY_BUCKETS_S, Histogram, HistogramSnapshot
from controller.messages import RequestOutput
from controller.request import Request
from controller.worker_stats import WorkerStats

# Why the edge or the controller refused a request before it ran.
CIRCUIT_BREAKER = "circuit_breaker"  # 422: prompt over the prefill cap (counted at the edge)
QUEUE_FULL = "queue_full"  # 429: every waiting queue is full
REJECTION_KINDS = (CIRCUIT_BREAKER, QUEUE_FULL)
# What admitted requests asked for beyond plain sampling: log-probabilities of their
# tokens, of their prompt (echo), and choices past the first of an n > 1 request.
FEATURES = ("logprobs", "prompt_logprobs", "extra_choice")


@dataclass
class _Timing:
    request: Request
    first_token_s: float | None = None
    last_token_s: float | None = None


@dataclass(frozen=True)
class RequestMetricsSnapshot:
    ttft_s: HistogramSnapshot
    itl_s: HistogramSnapshot
    e2e_s: HistogramSnapshot
    queue_time_s: HistogramSnapshot
    finished_reason_to_count: dict[str, int]
    num_prompt_tokens: int
    num_generation_tokens: int
    rejection_to_count: dict[str, int]
    feature_to_count: dict[str, int] = field(default_factory=dict)


class RequestMetrics:
    def __init__(self) -> None:
        self.ttft_s = Histogram(LATENCY_BUCKETS_S)
        self.itl_s = Histogram(LATENCY_BUCKETS_S)
        self.e2e_s = Histogram(LATENCY_BUCKETS_S)
        self.queue_time_s = Histogram(LATENCY_BUCKETS_S)
        self.finished_reason_to_count: dict[str, int] = {}
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.rejection_to_count = dict.fromkeys(REJECTION_KINDS, 0)
        self.feature_to_count = dict.fromkeys(FEATURES, 0)
        # Unfinished admitted requests only: an entry leaves with the request's last delta.
        self._timings: dict[str, _Timing] = {}

    @property
    def num_tracked(self) -> int:
        return len(self._timings)

    def on_admit(self, request: Request) -> None:
        self._timings[request.request_id] = _Timing(request)
        params = request.sampling_params
        for feature, used in (("logprobs", params.logprobs is not None),
                              ("prompt_logprobs", params.prompt_logprobs is not None),
                              ("extra_choice", params.prompt_shared_with is not None)):
            self.feature_to_count[feature] += used

    def on_reject(self, kind: str) -> None:
        if kind not in self.rejection_to_count:
            raise ValueError(f"unknown rejection kind {kind!r}")
        self.rejection_to_count[kind] += 1

    def on_output(self, out: RequestOutput, now: float) -> None:
        """One delta leaves the controller toward its consumer."""
        timing = self._timings.get(out.request_id)
        if timing is None:
            return
        request = timing.request
        num_new = len(out.new_token_ids)
        if num_new:
            if timing.first_token_s is None:
                timing.first_token_s = now
                self.ttft_s.observe(now - request.arrival_time)
                if request.sampling_params.prompt_shared_with is None:  # once per prompt
                    self.num_prompt_tokens += out.num_prompt_tokens
                num_intervals = num_new - 1  # further tokens of the same delta
            else:
                num_intervals = num_new
            if num_intervals and timing.last_token_s is not None:
                # A delta carrying n tokens (a slow consumer's merge) shares its interval.
                self.itl_s.observe((now - timing.last_token_s) / num_intervals, num_intervals)
            timing.last_token_s = now
            self.num_generation_tokens += num_new
        if out.finished:
            del self._timings[out.request_id]
            # As the consumer sees it: a failed request (an error delta) is an error, not
            # the abort it is to the scheduler.
            reason = "error" if out.error else \
                out.finish_reason.value if out.finish_reason is not None else "abort"
            self.finished_reason_to_count[reason] = \
                self.finished_reason_to_count.get(reason, 0) + 1
            self.e2e_s.observe(now - request.arrival_time)
            if request.first_scheduled_time is not None:
                self.queue_time_s.observe(request.first_scheduled_time - request.arrival_time)

    def snapshot(self) -> RequestMetricsSnapshot:
        return RequestMetricsSnapshot(
            self.ttft_s.snapshot(), self.itl_s.snapshot(), self.e2e_s.snapshot(),
            self.queue_time_s.snapshot(), dict(self.finished_reason_to_count),
            self.num_prompt_tokens, self.num_generation_tokens, dict(self.rejection_to_count),
            dict(self.feature_to_count))


@dataclass(frozen=True)
class MetricsSnapshot:
    """Everything `/metrics` shows, in one controller answer: no exporter reads the parts."""

    workers: list[WorkerStats]  # empty while the workers start
    requests: RequestMetricsSnapshot
    itl_slo_s: float | None = None  # what worker 0's scheduler plans for; None: not yet
    worker_nodes: list[str] = field(default_factory=list)  # Ray node id per worker
    # Index of each worker above (a removed worker is left out; indices never shift).
    worker_ids: list[int] = field(default_factory=list)
    pool_states: dict[str, int] = field(default_factory=dict)  # state -> workers in it
    # (direction, reason) -> scale events, every known pair from the start.
    scale_events: dict[tuple[str, str], int] = field(default_factory=dict)
