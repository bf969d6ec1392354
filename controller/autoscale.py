"""When the worker pool grows or shrinks: a pure policy over load samples.

The controller sees every queue, so it decides; Ray places what it asks for (and its
autoscaler adds nodes where one is configured). Time comes in with each sample, so tests
drive the policy with a virtual clock.

Invariants: the pool never leaves [min_workers, max_workers] by a decision of this policy;
a scale-up needs its condition to hold on every sample for `window_s` (a load that
oscillates faster than the window never scales); after any decision nothing happens for
`window_s` (the new worker needs time to load, a drained one to empty); a worker is
released only after `idle_cooldown_s` without work, and never while a scale-up condition
holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from controller.settings import FORBID_EXTRA, check_settings, setting

Direction = Literal["up", "down"]
# Every (direction, reason) a decision can carry: metrics initialise one series for each.
SCALE_REASONS: tuple[tuple[Direction, str], ...] = (
    ("up", "below_min"), ("up", "queue"), ("up", "ttft"), ("down", "idle"),
    ("down", "above_max"))


@dataclass(frozen=True)
class ScalingConfig:
    """Load-driven pool size (`scaling:` in the configuration)."""

    __pydantic_config__ = FORBID_EXTRA

    enabled: bool = setting(False, description=(
        "Grow and shrink the worker pool with the load, within min_workers..max_workers. "
        "Off: the pool is what started (and what an operator adds or drains)."))
    min_workers: int = setting(1, ge=1, description="Fewest workers the policy keeps.")
    max_workers: int = setting(4, ge=1, description=(
        "Most workers the policy asks for (Ray must find their resources, or its "
        "autoscaler add nodes)."))
    waiting_per_worker: float = setting(8.0, gt=0, description=(
        "Scale up when the waiting requests per worker stay above this for window_s."))
    ttft_p90_s: float | None = setting(None, gt=0, description=(
        "Scale up when the P90 time to first token over the last window stays above this "
        "for window_s (None: the queue alone decides)."))
    window_s: float = setting(30.0, gt=0, description=(
        "How long a scale-up condition must hold on every sample, and the quiet time "
        "after any decision."))
    idle_cooldown_s: float = setting(300.0, gt=0, description=(
        "A worker with nothing running or waiting for this long is drained and released "
        "(down to min_workers)."))
    sample_interval_s: float = setting(5.0, gt=0, description=(
        "How often the controller samples its queues and TTFT for the policy."))
    drain_timeout_s: float = setting(60.0, gt=0, description=(
        "How long a drained worker (the policy's or `tokenflow workers drain`'s) may take "
        "to finish its running requests; past it they move to the other workers through "
        "the journal's recompute path, with the same tokens."))
    wait_for_nodes: bool = setting(False, description=(
        "Grow even when no node has a worker's resources free, leaving the new worker "
        "pending until Ray's autoscaler adds a node (a cluster with an autoscaler). False: "
        "grow only within the resources free now (a fixed cluster)."))

    def __post_init__(self) -> None:
        check_settings(self)
        if self.min_workers > self.max_workers:
            raise ValueError(f"ScalingConfig.min_workers ({self.min_workers}) must be <= "
                             f"max_workers ({self.max_workers})")


@dataclass(frozen=True)
class LoadSample:
    """What the controller saw at `now` over the workers that take new requests."""

    now: float
    num_workers: int  # routable or starting; draining ones are not counted
    num_waiting: int
    ttft_p90_s: float | None  # over the recent window; None without first tokens
    idle_workers: tuple[int, ...] = ()  # routable workers with nothing running or waiting


@dataclass(frozen=True)
class ScaleDecision:
    direction: Direction
    reason: str  # one of SCALE_REASONS' for its direction
    worker: int | None = None  # the worker to drain (down only)
    detail: str = ""  # for the log: the numbers behind it


@dataclass
class ScalingPolicy:
    config: ScalingConfig
    _pressure_since: float | None = None
    _last_decision_at: float | None = None
    _idle_since: dict[int, float] = field(default_factory=dict)

    def observe(self, sample: LoadSample) -> ScaleDecision | None:
        """The decision this sample calls for, if any; call it on every sample."""
        cfg = self.config
        self._track_idle(sample)
        if sample.num_workers < cfg.min_workers:
            return self._decide(sample, ScaleDecision(
                "up", "below_min", detail=f"{sample.num_workers} < min {cfg.min_workers}"))
        if sample.num_workers > cfg.max_workers and sample.idle_workers:
            return self._decide(sample, ScaleDecision(
                "down", "above_max", worker=sample.idle_workers[-1],
                detail=f"{sample.num_workers} > max {cfg.max_workers}"))
        reason, detail = self._pressure(sample)
        if reason is None:
            self._pressure_since = None
        elif self._pressure_since is None:
            self._pressure_since = sample.now
        if self._is_quiet(sample.now):
            return None
        if reason is not None:
            held_s = sample.now - self._pressure_since  # type: ignore[operator]
            if held_s >= cfg.window_s and sample.num_workers < cfg.max_workers:
                return self._decide(sample, ScaleDecision(
                    "up", reason, detail=f"{detail} for {held_s:.0f} s"))
            return None
        if sample.num_workers > cfg.min_workers:
            for worker in sorted(sample.idle_workers, reverse=True):  # newest first
                idle_s = sample.now - self._idle_since[worker]
                if idle_s >= cfg.idle_cooldown_s:
                    return self._decide(sample, ScaleDecision(
                        "down", "idle", worker=worker, detail=f"idle for {idle_s:.0f} s"))
        return None

    def _pressure(self, sample: LoadSample) -> tuple[str | None, str]:
        cfg = self.config
        per_worker = sample.num_waiting / max(sample.num_workers, 1)
        if per_worker > cfg.waiting_per_worker:
            return "queue", (f"{per_worker:.1f} waiting per worker > "
                             f"{cfg.waiting_per_worker:g}")
        ttft = sample.ttft_p90_s
        if cfg.ttft_p90_s is not None and ttft is not None and ttft > cfg.ttft_p90_s:
            return "ttft", f"TTFT P90 {ttft:.2f} s > {cfg.ttft_p90_s:g} s"
        return None, ""

    def _track_idle(self, sample: LoadSample) -> None:
        idle = set(sample.idle_workers)
        self._idle_since = {w: self._idle_since.get(w, sample.now) for w in idle}

    def _is_quiet(self, now: float) -> bool:
        last = self._last_decision_at
        return last is not None and now - last < self.config.window_s

    def _decide(self, sample: LoadSample, decision: ScaleDecision) -> ScaleDecision | None:
        if self._is_quiet(sample.now):
            return None
        self._last_decision_at = sample.now
        self._pressure_since = None
        if decision.worker is not None:
            self._idle_since.pop(decision.worker, None)
        return decision
