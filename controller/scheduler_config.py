"""The scheduler's settings (`scheduler:`) and the values it plans with: a step's limits, its
shape (for pricing) and the scheduler's counters."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from controller.messages import CacheEvict
from controller.settings import FORBID_EXTRA, check_settings, setting

DEFAULT_CPU_DECODE_STEPS = 4  # scheduler.decode_steps unset, on a CPU worker


@dataclass
class SchedulerConfig:
    """The scheduler's settings (`scheduler:` in the configuration). Mutable: the
    comparison policies widen the budget for one step."""

    __pydantic_config__ = FORBID_EXTRA

    max_num_batched_tokens: int = setting(2048, ge=1, description=(
        "Token budget of one step (decode tokens + prefill chunk tokens). 2048 is vLLM's "
        "online default on ordinary GPUs; a budget file (calibration.budget_file) "
        "replaces it."))
    max_num_seqs: int = setting(256, ge=1, description="Running requests per worker at most.")
    max_chunk_tokens: int | None = setting(None, ge=1, description=(
        "Cap on one prefill chunk; None means the whole budget."))
    long_prefill_token_threshold: int | None = setting(None, ge=1, description=(
        "A prompt (with its generated tokens) longer than this is long: capped by "
        "max_long_partial_prefills, and leaving short_prefill_share of each step's "
        "prefill budget to short prompts. None: max_num_batched_tokens (a prompt that "
        "fits in one step is short)."))
    max_long_partial_prefills: int = setting(1, ge=1, description=(
        "Long prompts being chunked at once; a further long prompt waits without "
        "blocking short ones behind it (vLLM's max_long_partial_prefills)."))
    short_prefill_share: float = setting(0.25, gt=0, lt=1, description=(
        "Share of a step's prefill budget (and of its predicted time under the ITL SLO) "
        "that long chunks leave free while short prompts wait."))
    short_step_share: float = setting(0.5, gt=0, le=1, description=(
        "With a step cost model: a step that carries a waiting short prompt's chunk is "
        "planned to this share of the ITL SLO (the long chunk beside it shrinks), so the "
        "short prompt's first token comes within the running step's rest and half a "
        "step: at 1 (the whole SLO) it came 1.8-2.3 of the long prompt's steps after it "
        "was sent in the served peer scene on a 2-core Zen 3 (docs/peer.md); the long "
        "prompt loses half a step's chunk per short prompt. 1: no shorter step."))
    max_concurrent_chunks: int = setting(4, ge=1, description=(
        "Prefill chunks per step in NORMAL flow mode (flow control lowers it: "
        "flow.throttle_chunks, flow.throttle_hard_chunks, 0 under cache pressure)."))
    async_scheduling: bool | None = setting(None, description=(
        "Plan a worker's next step while its current one runs: in the Ray step loop the "
        "controller's planning and the actor round trip hide behind the device; in process "
        "(LocalEngine, controller/step_loop.py) the next step is launched as soon as the "
        "current one is done and the controller plans and applies while it runs. Tokens "
        "sampled by the running step are "
        "pending in the next plan (the worker feeds them), a request that finishes is "
        "dropped a step later, and nobody is preempted while a step runs ahead. The same "
        "tokens either way (vLLM's --async-scheduling). None (default): on where the "
        "worker is a Ray actor (`make serve`, batch jobs), off in process. Measured on 2 "
        "cores in the peer scene (docs/peer.md): served, the long prompt's first token 18 % "
        "sooner and the users' tokens/s 14 % higher; in process 3 % slower, as there is no "
        "round trip to hide and the planning takes the model's cores."))
    decode_steps: int | None = setting(None, ge=1, description=(
        "Decode burst: when a step would carry only decodes and nobody waits who could be "
        "admitted, the worker runs up to this many decode steps in a row on one plan, each "
        "on the tokens the one before sampled, and the controller applies them as one "
        "result (vLLM's multi-step scheduling). It saves the controller's planning and "
        "applying, the actor call and the other processes' share of the cores per token: "
        "on a 2-core CPU those stall the step's threads (docs/peer.md). Not for a request "
        "that asks for log-probabilities, a grammar or stop strings, and never past a "
        "request's max_tokens; tokens after an EOS or stop token id are computed and "
        "dropped. A request that arrives meanwhile waits for the burst to end; tokens "
        "reach a stream a burst at a time. None: 4 on a CPU worker (8 was not faster "
        "served, nor 16 in a batch job), 1 (off) on an accelerator, where asynchronous "
        "scheduling already hides the host's work."))
    chunk_steps: int = setting(1, ge=1, description=(
        "Chunk burst: while one prompt is chunked beside decoding requests and nobody "
        "waits who could be admitted, the worker runs up to this many of those steps in a "
        "row on one plan: the prompt's next chunk of the same size and one more token of "
        "every decoding request each time. Each step keeps the ITL SLO's time; the users' "
        "tokens reach their streams a burst at a time (their gap is the burst). It saves "
        "what a decode burst saves on the steps where a long prompt waits. Never the "
        "prompt's last chunk (it samples), nor for what decode bursts exclude. 1 (off) by "
        "default: on a 2-core Zen 4, 2 gave the peer scene's long prompt its first token "
        "2 % sooner and the users' P99 gap 60 % longer (docs/peer.md)."))
    plan_ahead_at: float = setting(0.7, ge=0, lt=1, description=(
        "With async scheduling in the Ray step loop: the next step is planned once the "
        "running one is this share done, by its predicted time (the cost model's, scaled "
        "by how long this worker's steps have really taken), not at once. A request that "
        "arrives before then rides in the very next step: with a 250 ms chunk step "
        "planned at once, a short prompt arriving mid-step waited for the step after "
        "next (2.3 steps to its first token in the peer scene). If the step ends first, "
        "the next is planned serially. 0: plan at once (vLLM's async scheduling); without "
        "a cost model, always at once."))
    plan_ahead_lead_ms: float | None = setting(10.0, gt=0, description=(
        "...but no earlier than this long before the running step's predicted end: the "
        "next plan needs only the controller's planning and the actor call (1-2 ms), "
        "while a share of a long step leaves a request that arrives in its last part out "
        "of the very next step (at 0.7, the last 70 ms of a 230 ms chunk step). The plan "
        "is made at max(plan_ahead_at x predicted, predicted - lead); a step that ends "
        "sooner than predicted costs one serial planning. 10 ms: what the share gives a "
        "30 ms decode step (served on 2 cores, 96 % of them planned ahead). None: the "
        "share alone."))
    scheduling_policy: Literal["tokenflow", "prefill-first", "prefill-priority-chunked"] = (
        setting("tokenflow", description=(
            "tokenflow: decode-first unified budget with flow control. The others exist to "
            "be measured against: prefill-first (vLLM V0: whole prompts in prefill-only "
            "steps) and prefill-priority-chunked (nano-vllm: only a step's first prefill "
            "is cut; prefill and decode never share a step).")))
    tenant_weights: dict[str, float] = field(default_factory=dict, metadata={"description": (
        "Weights of tenants (X-Tenant-Id) in each step's prefill budget; absent = 1.0.")})
    defrag_threshold: float | None = setting(0.30, gt=0, lt=1, description=(
        "KV defragmentation: compact used blocks when more than this share lies outside "
        "the compact region (30 %); None disables it."))
    defrag_max_moves: int = setting(64, ge=1, description=(
        "KV blocks moved per step at most (bounds the copy's cost)."))
    defrag_every_steps: int = setting(16, ge=1, description=(
        "Steps between fragmentation checks (fragmentation is O(blocks): look only now "
        "and then)."))

    def __post_init__(self) -> None:
        check_settings(self)
        chunk = self.max_chunk_tokens
        if chunk is not None and chunk > self.max_num_batched_tokens:
            raise ValueError("scheduler.max_chunk_tokens must not exceed "
                             "scheduler.max_num_batched_tokens")

    def plan_ahead_s(self, expected_s: float) -> float:
        """When to plan the next step, in seconds after the running one started, given the
        running step's expected time (async scheduling in the Ray step loop)."""
        at = self.plan_ahead_at * expected_s
        if self.plan_ahead_lead_ms is None or not self.plan_ahead_at:
            return at
        return max(at, expected_s - self.plan_ahead_lead_ms / 1e3)

    def max_decode_steps(self, device: str) -> int:
        """The decode burst a worker on `device` ("cpu", "cuda:0", ...) may run."""
        if self.decode_steps is not None:
            return self.decode_steps
        return DEFAULT_CPU_DECODE_STEPS if device.startswith("cpu") else 1

    def is_async(self, is_actor: bool) -> bool:
        """Whether a worker's steps are planned ahead: `async_scheduling`, or where unset,
        whether the worker is a Ray actor (a round trip to hide)."""
        return is_actor if self.async_scheduling is None else self.async_scheduling


@dataclass
class StepShape:
    """What a plan carries, for pricing the step once its time is known."""

    step_id: int
    chunks: dict[str, tuple[int, int]] = field(default_factory=dict)  # id -> (tokens, ctx)
    num_decodes: int = 0
    decode_context: int = 0  # the longest
    num_steps: int = 1  # a burst's steps (StepPlan.num_steps)

    def steps(self) -> list[tuple[list[tuple[int, int]], int, int]]:
        """Each step of the plan as (chunks, num_decodes, decode_context): a burst's chunks
        go one chunk deeper each step, its decodes one token."""
        return [([(num, depth + i * num) for num, depth in self.chunks.values()],
                 self.num_decodes, self.decode_context + i) for i in range(self.num_steps)]


@dataclass(frozen=True)
class StepLimits:
    """What flow control and the protections allow in one step, passed to `schedule`."""

    max_chunks: int | None = None  # prefill chunks this step (0: decodes only); None: config
    chunk_cap: int | None = None  # a smaller chunk cap (degraded path); None: config
    # With prefill stopped and nothing decoding, let one running prefill continue (under
    # cache pressure only finishing requests free blocks). False in PREFILL_PAUSED, which
    # recovers from telemetry alone.
    progress_guard: bool = True
    # False while an earlier step still runs (planned ahead): a victim's blocks could be
    # written by that step after they were given to someone else, so nobody is preempted;
    # a request that finds no block waits a step.
    may_preempt: bool = True


@dataclass
class SchedulerStats:
    """Filled by the core, exported by the metrics module at the edge."""

    num_steps: int = 0
    num_preemptions: int = 0
    num_scheduled_tokens: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_finished: int = 0
    num_defrag_moves: int = 0
    cache_evicts: list[CacheEvict] = field(default_factory=list)
