"""What the controller keeps per worker: its pool's shape, its `WorkerState` (scheduler,
flow control, protections, queued events, step observations) and the degraded path's
settings. Plain data; the core's modules act on it."""

from __future__ import annotations

from dataclasses import dataclass, field

from controller.budget import StepCost
from controller.events import DoubleBufferedEventQueue
from controller.flow import FlowControl
from controller.histogram import (
    SCORE_BUCKETS,
    STEP_DURATION_BUCKETS_S,
    TOKEN_BUCKETS,
    Histogram,
)
from controller.messages import CacheEvict, ChunkComplete, RequestOutput
from controller.protections import Protections
from controller.refit import OnlineRefit
from controller.scheduler import Scheduler
from controller.settings import FORBID_EXTRA, check_settings, setting


@dataclass(frozen=True)
class PoolSpec:
    """What the controller must know about a worker's KV pool."""

    num_blocks: int
    block_size: int
    enable_prefix_caching: bool = True
    max_decode_steps: int = 1  # longest decode burst a plan may ask of it (scheduler.decode_steps)
    max_chunk_steps: int = 1  # longest chunk burst (scheduler.chunk_steps)


Event = ChunkComplete | CacheEvict


@dataclass(frozen=True)
class DegradedConfig:
    """The degraded path: keep serving with the smallest chunk, one prefill at a time
    (`degraded:` in the configuration)."""

    __pydantic_config__ = FORBID_EXTRA

    chunk_tokens: int | None = setting(None, ge=1, description=(
        "Chunk size on the degraded path; None means one KV block."))
    num_chunks: int = setting(1, ge=1, description="Prefill chunks per step when degraded.")
    after_paused_s: float = setting(30.0, ge=0, description=(
        "PREFILL_PAUSED this long with work waiting switches to the degraded path, which "
        "keeps serving."))

    def __post_init__(self) -> None:
        check_settings(self)



@dataclass
class EventStats:
    """What flow control has been told, per worker (for stats and metrics)."""

    num_chunk_complete: int = 0
    num_cache_evict: int = 0
    last_evict_kv_usage: float = 0.0


@dataclass
class StepHistograms:
    """Per-step observations of one worker, bounded (fixed buckets)."""

    budget_tokens: Histogram = field(default_factory=lambda: Histogram(TOKEN_BUCKETS))
    decode_tokens: Histogram = field(default_factory=lambda: Histogram(TOKEN_BUCKETS))
    prefill_tokens: Histogram = field(default_factory=lambda: Histogram(TOKEN_BUCKETS))
    duration_s: Histogram = field(default_factory=lambda: Histogram(STEP_DURATION_BUCKETS_S))
    budget_score: Histogram = field(default_factory=lambda: Histogram(SCORE_BUCKETS))


@dataclass
class WorkerState:
    """Everything the controller keeps per worker."""

    scheduler: Scheduler
    flow: FlowControl
    protections: Protections
    degraded: bool = False  # the last plan was made on the degraded path
    # False from a failure until the restarted worker reports ready: routing skips it.
    is_up: bool = True
    # Draining: takes no new request, finishes (or, past its drain timeout, hands on) the
    # ones it has. Removed: drained and released; its index stays so none other shifts.
    is_draining: bool = False
    is_removed: bool = False
    num_failures: int = 0
    # `chunk_complete` / `cache_evict` events, double-buffered: those produced while a
    # step runs are handled before the next plan.
    events: DoubleBufferedEventQueue[Event] = field(default_factory=DoubleBufferedEventQueue)
    event_stats: EventStats = field(default_factory=EventStats)
    step_histograms: StepHistograms = field(default_factory=StepHistograms)
    # step id -> clock() at its begin_step; a step planned ahead starts when the one
    # before it ends (`last_step_ended`), which is what its duration counts from.
    step_started: dict[int, float] = field(default_factory=dict)
    last_step_ended: float = float("-inf")
    # Outputs of requests a protection aborted outside `finish_step`; returned by the next.
    outbox: list[RequestOutput] = field(default_factory=list)
    # The calibrated step cost model (None: uncalibrated) and its online refit.
    step_cost: StepCost | None = None
    refit: OnlineRefit | None = None
    # (request id, chunk index) -> (charged, budgeted) seconds: a chunk's share of its step.
    chunk_charges: dict[tuple[str, int], tuple[float, float]] = field(default_factory=dict)

    @property
    def is_routable(self) -> bool:
        """Takes new requests (and a failed worker's)."""
        return self.is_up and not self.is_draining and not self.is_removed
