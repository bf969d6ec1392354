"""Per-worker flow-control modes (docs/architecture.md, "Flow control"). Torch-free.

Two independent conditions, each with its own hysteresis:
- cache pressure: entered when KV usage > `cache_enter`; left only by a `cache_evict`
  that brings usage below `cache_exit` (79 % < 85 %: a usage hovering around 85 % does
  not flap);
- bandwidth: a moving average of utilisation samples over `bw_window_s`; throttle level
  2 after it stays > `throttle_enter` for `throttle_hold_s`, level 1 after > `throttle_hard`
  for as long (levels only tighten until the throttle is left as a whole), left after the
  average stays < `throttle_exit` for the hold time; PREFILL_PAUSED after > `pause_enter`
  for `pause_hold_s`, left when the average falls < `pause_exit`.
The reported mode is the most restrictive one that holds. Time comes from the samples
themselves (injectable), never from a wall clock read here.
"""

from __future__ import annotations

import enum
import logging
from collections import deque
from dataclasses import dataclass, field

from controller.messages import CacheEvict, ChunkComplete
from controller.settings import FORBID_EXTRA, check_settings, setting

logger = logging.getLogger("tokenflow.flow")


class Mode(enum.IntEnum):  # ordered by restrictiveness
    NORMAL = 0
    BANDWIDTH_THROTTLE = 1
    CACHE_PRESSURE_WAIT = 2
    PREFILL_PAUSED = 3


@dataclass(frozen=True)
class FlowConfig:
    """Flow-control thresholds (`flow:` in the configuration)."""

    __pydantic_config__ = FORBID_EXTRA

    cache_enter: float = setting(0.85, gt=0, le=1, description=(
        "KV usage above which new prefill chunks stop (CACHE_PRESSURE_WAIT)."))
    cache_exit: float = setting(0.79, gt=0, le=1, description=(
        "A cache_evict that brings KV usage below this resumes chunk scheduling."))
    bw_window_s: float = setting(5.0, gt=0, description=(
        "Window of the bandwidth utilisation moving average."))
    throttle_enter: float = setting(0.90, gt=0, le=1, description=(
        "Average bandwidth above which, held for throttle_hold_s, chunks drop to "
        "throttle_chunks (BANDWIDTH_THROTTLE)."))
    throttle_hard: float = setting(0.95, gt=0, le=1, description=(
        "Average bandwidth above which, held for throttle_hold_s, chunks drop to "
        "throttle_hard_chunks."))
    throttle_exit: float = setting(0.85, gt=0, le=1, description=(
        "The throttle ends when the average stays below this for throttle_hold_s."))
    throttle_hold_s: float = setting(3.0, ge=0, description="Hold time of throttle entry/exit.")
    pause_enter: float = setting(0.98, gt=0, le=1, description=(
        "Average bandwidth above which, held for pause_hold_s, new prefill stops "
        "(PREFILL_PAUSED, the emergency)."))
    pause_hold_s: float = setting(10.0, ge=0, description="Hold time before PREFILL_PAUSED.")
    pause_exit: float = setting(0.90, gt=0, le=1, description=(
        "PREFILL_PAUSED ends when the average falls below this."))
    throttle_chunks: int = setting(2, ge=1, description=(
        "Prefill chunks per step when throttled."))
    throttle_hard_chunks: int = setting(1, ge=1, description=(
        "Prefill chunks per step above throttle_hard."))

    def __post_init__(self) -> None:
        check_settings(self)
        if not self.cache_exit < self.cache_enter:
            raise ValueError("flow.cache_exit must be below flow.cache_enter")
        if not self.throttle_exit < self.throttle_enter <= self.throttle_hard:
            raise ValueError("need flow.throttle_exit < flow.throttle_enter <= "
                             "flow.throttle_hard")
        if not self.pause_exit < self.pause_enter:
            raise ValueError("flow.pause_exit must be below flow.pause_enter")


@dataclass
class Transition:
    time_s: float
    old: Mode
    new: Mode
    reason: str


class _Held:
    """Tracks since when a predicate has held continuously."""

    def __init__(self) -> None:
        self.since: float | None = None

    def update(self, holds: bool, now: float) -> float:
        """Seconds the predicate has held (0 when it does not hold now)."""
        if not holds:
            self.since = None
            return 0.0
        if self.since is None:
            self.since = now
        return now - self.since


@dataclass
class FlowStats:
    transitions: int = 0
    mode_to_count: dict[str, int] = field(default_factory=dict)
    # (old mode, new mode) -> count: `log` is bounded, these counters are not lost.
    transition_to_count: dict[tuple[str, str], int] = field(default_factory=dict)


class FlowControl:
    def __init__(self, config: FlowConfig | None = None, normal_chunks: int = 4):
        self.config = config or FlowConfig()
        self.normal_chunks = normal_chunks  # the scheduler's max_concurrent_chunks
        self.cache_pressure = False
        self.throttle_level = 0  # 0 none, 2 -> 2 chunks, 1 -> 1 chunk (seed's naming)
        self.paused = False
        self.paused_since: float | None = None
        self.kv_usage = 0.0
        self._samples: deque[tuple[float, float]] = deque()
        self._above_enter, self._above_hard = _Held(), _Held()
        self._below_exit, self._above_pause = _Held(), _Held()
        self.log: deque[Transition] = deque(maxlen=1024)  # recent transitions
        self.stats = FlowStats()
        self._mode = Mode.NORMAL

    # -- signals -----------------------------------------------------------------------
    def on_kv_usage(self, usage: float, now: float) -> None:
        """Usage after a step's allocations (it can only rise here)."""
        self.kv_usage = usage
        if not self.cache_pressure and usage > self.config.cache_enter:
            self.cache_pressure = True
        self._settle(now, f"kv usage {usage:.2f}")

    def on_cache_evict(self, event: CacheEvict, now: float) -> None:
        self.kv_usage = event.kv_usage
        if self.cache_pressure and event.kv_usage < self.config.cache_exit:
            self.cache_pressure = False
        self._settle(now, f"cache_evict {event.request_id} usage {event.kv_usage:.2f}")

    def on_chunk_complete(self, event: ChunkComplete, now: float) -> None:
        """Chunks carry no mode signal of their own; they re-evaluate the held timers."""
        self._update_bandwidth(now)
        self._settle(now, f"chunk_complete {event.request_id}#{event.chunk_index}")

    def on_bandwidth(self, utilization: float, now: float) -> None:
        self._samples.append((now, utilization))
        self._update_bandwidth(now)
        self._settle(now, f"bandwidth avg {self.bandwidth_avg:.2f}")

    # -- derived -----------------------------------------------------------------------
    @property
    def bandwidth_avg(self) -> float:
        if not self._samples:
            return 0.0
        return sum(u for _, u in self._samples) / len(self._samples)

    @property
    def mode(self) -> Mode:
        return self._mode

    @property
    def allow_new_prefill(self) -> bool:
        return not (self.cache_pressure or self.paused)

    @property
    def max_concurrent_chunks(self) -> int:
        cfg = self.config
        if not self.allow_new_prefill:
            return 0
        return {0: self.normal_chunks, 2: cfg.throttle_chunks,
                1: cfg.throttle_hard_chunks}[self.throttle_level]

    def _update_bandwidth(self, now: float) -> None:
        cfg = self.config
        while self._samples and self._samples[0][0] < now - cfg.bw_window_s:
            self._samples.popleft()
        avg = self.bandwidth_avg
        held_enter = self._above_enter.update(avg > cfg.throttle_enter, now)
        held_hard = self._above_hard.update(avg > cfg.throttle_hard, now)
        held_exit = self._below_exit.update(avg < cfg.throttle_exit, now)
        if held_hard >= cfg.throttle_hold_s:
            self.throttle_level = 1
        elif held_enter >= cfg.throttle_hold_s and self.throttle_level == 0:
            self.throttle_level = 2
        elif self.throttle_level and held_exit >= cfg.throttle_hold_s:
            self.throttle_level = 0
        held_pause = self._above_pause.update(avg > cfg.pause_enter, now)
        if held_pause >= cfg.pause_hold_s and not self.paused:
            self.paused, self.paused_since = True, now
        elif self.paused and avg < cfg.pause_exit:  # 98 % in, 90 % out: no flapping
            self.paused, self.paused_since = False, None

    def _settle(self, now: float, reason: str) -> None:
        if self.paused:
            mode = Mode.PREFILL_PAUSED
        elif self.cache_pressure:
            mode = Mode.CACHE_PRESSURE_WAIT
        elif self.throttle_level:
            mode = Mode.BANDWIDTH_THROTTLE
        else:
            mode = Mode.NORMAL
        if mode != self._mode:
            logger.info("flow mode %s -> %s (%s)", self._mode.name, mode.name, reason)
            self.log.append(Transition(now, self._mode, mode, reason))
            self.stats.transitions += 1
            self.stats.mode_to_count[mode.name] = self.stats.mode_to_count.get(mode.name, 0) + 1
            key = (self._mode.name, mode.name)
            self.stats.transition_to_count[key] = self.stats.transition_to_count.get(key, 0) + 1
            self._mode = mode
