"""Protection layers that watch `chunk_complete` events (docs/architecture.md). Torch-free.

- per-chunk timeout `base x (1 + chunk_index x growth)`: a chunk over it aborts its
  request (the caller frees the blocks: the KV rollback) with a clear error;
- budget deviation: a chunk whose time per token is > `deviation_threshold` off the cost
  model is logged and counted (the calibrator re-fits on repeated deviations);
- `budget_score = actual / budgeted prefill time` per request, scores over
  `slow_score_threshold` go to the slow-request log; a chunk that shares its step with
  others (or with decodes) is charged its share of the step by the cost model, not the
  whole step's time (the core computes the share);
- degraded mode: after `degrade_after_timeouts` timeouts within `degrade_window_s`, the
  worker keeps serving with the smallest chunk and one prefill at a time, until a
  window passes without timeouts.
The cost model is the one `StepCost` (controller/budget.py): a chunk alone costs
`chunk_s(num_tokens, context_len)` seconds; until a calibrated table is loaded it is
`StepCost.per_token(seconds_per_token)`.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from controller.budget import StepCost
from controller.messages import ChunkComplete
from controller.settings import FORBID_EXTRA, check_settings, setting

logger = logging.getLogger("tokenflow.protections")
slow_logger = logging.getLogger("tokenflow.slow_requests")



@dataclass(frozen=True)
class ProtectionConfig:
    """The protection layers (`protections:` in the configuration): the edge's circuit
    breaker and queue bound, and the per-chunk watches of `Protections`."""

    __pydantic_config__ = FORBID_EXTRA

    max_prefill_tokens: int = setting(8192, ge=1, description=(
        "Longest prompt the budget is planned for."))
    circuit_breaker_factor: float = setting(1.2, gt=1.0, description=(
        "Budget circuit breaker: a prompt over max_prefill_tokens x this factor gets 422 "
        "before any actor call (1.2x)."))
    max_queue_len: int = setting(1024, ge=1, description=(
        "Waiting requests in the controller before new ones get 429."))
    chunk_timeout_base_s: float = setting(30.0, gt=0, description=(
        "Per-chunk timeout base: chunk n may take base x (1 + n x chunk_timeout_growth)."))
    chunk_timeout_growth: float = setting(0.1, ge=0, description=(
        "Per-chunk timeout growth per chunk index (later chunks attend to more context)."))
    deviation_threshold: float = setting(0.15, gt=0, description=(
        "A chunk whose time is this far off the cost model is logged as a deviation."))
    slow_score_threshold: float = setting(1.5, gt=0, description=(
        "budget_score (actual / budgeted prefill time) above which a request is written "
        "to the slow-request log."))
    seconds_per_token: float = setting(1e-4, gt=0, description=(
        "Uncalibrated cost model: prefill seconds per token (a budget file replaces it)."))
    degrade_after_timeouts: int = setting(3, ge=1, description=(
        "Chunk timeouts within degrade_window_s that switch a worker to the degraded path."))
    degrade_window_s: float = setting(60.0, gt=0, description="Window of the timeout count.")
    max_slow_log: int = setting(256, ge=1, description=(
        "Entries kept in the slow-request log (the oldest go first)."))
    deviation_log_every: int = setting(100, ge=1, description=(
        "Budget deviations are logged once per this many, from the this-many-th on (all "
        "are counted; a cold first chunk alone is not worth a warning)."))
    refit_window: int = setting(16, ge=2, description=(
        "Online refit: the last this many steps that carried prefill chunks are kept (their "
        "shape and time: bounded memory); when refit_deviating_share of them are off the "
        "cost model by more than deviation_threshold, the model is refitted on them."))
    refit_deviating_share: float = setting(0.75, gt=0, le=1, description=(
        "Share of the refit window's steps that must deviate to trigger a refit."))
    refit_min_token_spread: float = setting(2.0, ge=1, description=(
        "A refit fits the model's coefficients by least squares only when the window's "
        "chunks span at least this ratio of sizes (largest / smallest), and keeps that fit "
        "only when, fitted on the window's smaller chunks, it predicts the larger ones "
        "(and the other way round) better than the scaled model does; otherwise the model "
        "is scaled. The steps of one long prompt have chunks of nearly one size going "
        "deeper: fitted on them, least squares traded the fixed cost against the per-token "
        "one (a 5 ms, b 0.234 ms a token became a 34 ms, b 0.168 ms), and the chunks it "
        "then planned depended on which fit a server happened to get. The decodes must "
        "vary too (their count or depth): with the same decodes in every step their cost "
        "and the fixed cost are one number to least squares."))
    refit_least_squares_gain: float = setting(0.8, gt=0, le=1, description=(
        "Least squares is kept only when its held-out median error is at most this share "
        "of the scaled model's: with noisy steps a fit of five coefficients beats scaling "
        "by a little on noise alone, and it is the one that extrapolates worse."))

    def __post_init__(self) -> None:
        check_settings(self)

    @property
    def prefill_cap_tokens(self) -> int:
        """Prompts longer than this are refused with 422 (the circuit breaker)."""
        return int(self.max_prefill_tokens * self.circuit_breaker_factor)


@dataclass
class SlowRequest:
    request_id: str
    budget_score: float
    actual_s: float
    budgeted_s: float


@dataclass
class ProtectionStats:
    num_timeouts: int = 0
    num_deviations: int = 0
    num_slow_requests: int = 0
    last_budget_score: float = 0.0
    slow_log: deque[SlowRequest] = field(default_factory=lambda: deque(maxlen=256))


@dataclass
class _Prefill:
    actual_s: float = 0.0
    budgeted_s: float = 0.0


class Protections:
    def __init__(self, config: ProtectionConfig, step_cost: StepCost):
        self.config = config
        self.step_cost = step_cost
        self.stats = ProtectionStats(slow_log=deque(maxlen=config.max_slow_log))
        self._prefills: dict[str, _Prefill] = {}
        self._timeouts: deque[float] = deque()

    def chunk_timeout_s(self, chunk_index: int) -> float:
        cfg = self.config
        return cfg.chunk_timeout_base_s * (1.0 + chunk_index * cfg.chunk_timeout_growth)

    def on_chunk_complete(self, event: ChunkComplete, now: float,
                          charged_s: float | None = None,
                          budgeted_s: float | None = None) -> str | None:
        """Account one chunk; returns an error message when the request must be aborted.
        `charged_s` / `budgeted_s`: the chunk's share of its step's measured / predicted
        time (default: the event's time / the cost model's chunk alone). The timeout
        watches the whole step: a hung step is hung for every chunk in it."""
        budgeted = self.step_cost.chunk_s(event.num_tokens, event.start) if budgeted_s is None \
            else budgeted_s
        charged = event.elapsed_s if charged_s is None else charged_s
        prefill = self._prefills.setdefault(event.request_id, _Prefill())
        prefill.actual_s += charged
        prefill.budgeted_s += budgeted
        if budgeted > 0:
            off = abs(charged - budgeted) / budgeted
            if off > self.config.deviation_threshold:
                self.stats.num_deviations += 1
                # A stale budget table deviates on every chunk: warn on every
                # `deviation_log_every`-th, the counter has the rest. Not on the first: a
                # worker's first chunks are cold (allocation, first kernels), not a sign.
                log = logger.warning if self.stats.num_deviations % \
                    self.config.deviation_log_every == 0 else logger.debug
                log("chunk %s#%d took %.4fs, budget model says %.4fs (%.0f%% off)",
                    event.request_id, event.chunk_index, charged, budgeted, 100 * off)
        limit = self.chunk_timeout_s(event.chunk_index)
        if event.elapsed_s <= limit:
            return None
        self.stats.num_timeouts += 1
        self._timeouts.append(now)
        self._prefills.pop(event.request_id, None)
        return (f"prefill chunk {event.chunk_index} of request {event.request_id} took "
                f"{event.elapsed_s:.2f}s, over its timeout of {limit:.2f}s; the request was "
                "aborted and its KV blocks released")

    def on_prefill_done(self, request_id: str) -> float | None:
        """The request's prompt is computed: its budget score, logged when slow."""
        prefill = self._prefills.pop(request_id, None)
        if prefill is None or prefill.budgeted_s <= 0:
            return None
        score = prefill.actual_s / prefill.budgeted_s
        self.stats.last_budget_score = score
        if score > self.config.slow_score_threshold:
            self.stats.num_slow_requests += 1
            self.stats.slow_log.append(
                SlowRequest(request_id, score, prefill.actual_s, prefill.budgeted_s))
            slow_logger.warning("slow request %s: budget_score %.2f (%.3fs actual, %.3fs "
                                "budgeted)", request_id, score, prefill.actual_s,
                                prefill.budgeted_s)
        return score

    def forget(self, request_id: str) -> None:
        self._prefills.pop(request_id, None)

    def is_degraded(self, now: float) -> bool:
        while self._timeouts and self._timeouts[0] < now - self.config.degrade_window_s:
            self._timeouts.popleft()
        return len(self._timeouts) >= self.config.degrade_after_timeouts
