"""Protection layers that watch `chunk_complete` events (seed 000 §6). Torch-free.

- per-chunk timeout `base x (1 + chunk_index x growth)`: a chunk over it aborts its
  request (the caller frees the blocks: the KV rollback) with a clear error;
- budget deviation: a chunk whose time per token is > `deviation_threshold` off the cost
  model is logged and counted (the calibrator re-fits on repeated deviations);
- `budget_score = actual / budgeted prefill time` per request, scores over
  `slow_score_threshold` go to the slow-request log;
- degraded mode: after `degrade_after_timeouts` timeouts within `degrade_window_s`, the
  worker keeps serving with the smallest chunk and one prefill at a time, until a
  window passes without timeouts.
The cost model is a callable `predict(num_tokens, context_len) -> seconds`; until a
calibrated table is loaded it is a per-token cost from config.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from controller.messages import ChunkComplete

logger = logging.getLogger("tokenflow.protections")
slow_logger = logging.getLogger("tokenflow.slow_requests")

CostModel = Callable[[int, int], float]


@dataclass(frozen=True)
class ProtectionConfig:
    chunk_timeout_base_s: float = 30.0
    chunk_timeout_growth: float = 0.1
    deviation_threshold: float = 0.15
    slow_score_threshold: float = 1.5
    degrade_after_timeouts: int = 3
    degrade_window_s: float = 60.0
    max_slow_log: int = 256
    deviation_log_every: int = 100


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
    def __init__(self, config: ProtectionConfig, cost_model: CostModel):
        self.config = config
        self.cost_model = cost_model
        self.stats = ProtectionStats(slow_log=deque(maxlen=config.max_slow_log))
        self._prefills: dict[str, _Prefill] = {}
        self._timeouts: deque[float] = deque()

    def chunk_timeout_s(self, chunk_index: int) -> float:
        cfg = self.config
        return cfg.chunk_timeout_base_s * (1.0 + chunk_index * cfg.chunk_timeout_growth)

    def on_chunk_complete(self, event: ChunkComplete, now: float) -> str | None:
        """Account one chunk; returns an error message when the request must be aborted."""
        budgeted = self.cost_model(event.num_tokens, event.start)
        prefill = self._prefills.setdefault(event.request_id, _Prefill())
        prefill.actual_s += event.elapsed_s
        prefill.budgeted_s += budgeted
        if budgeted > 0:
            off = abs(event.elapsed_s - budgeted) / budgeted
            if off > self.config.deviation_threshold:
                self.stats.num_deviations += 1
                # A stale budget table deviates on every chunk: warn on the first and then
                # every `deviation_log_every`-th, the counter has the rest.
                log = logger.warning if self.stats.num_deviations % \
                    self.config.deviation_log_every == 1 else logger.debug
                log("chunk %s#%d took %.4fs, budget model says %.4fs (%.0f%% off)",
                             event.request_id, event.chunk_index, event.elapsed_s, budgeted,
                             100 * off)
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


def per_token_cost_model(seconds_per_token: float,
                         seconds_per_token_context: float = 0.0) -> CostModel:
    """The uncalibrated model: t = tokens x (a + b x context)."""
    def predict(num_tokens: int, context_len: int) -> float:
        return num_tokens * (seconds_per_token + seconds_per_token_context * context_len)

    return predict
