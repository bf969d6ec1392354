"""The one validated home of configuration: pydantic settings, env prefix `TOKENFLOW_`.

Every threshold from the seed documents is a documented field here, never a literal in
code. Components take the slices they need (`scheduler_config()`, ...).
"""

from __future__ import annotations

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from controller.core import DegradedConfig
from controller.flow import FlowConfig
from controller.options import ControllerOptions
from controller.protections import ProtectionConfig, per_token_cost_model
from controller.scheduler import SchedulerConfig


class TokenflowConfig(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TOKENFLOW_", extra="ignore")

    # -- model and worker ------------------------------------------------------------
    model: str = Field("builtin:tiny", description=(
        "Hugging Face checkpoint folder (config.json, *.safetensors, tokenizer.json) of the "
        "Llama family, or a built-in preset: builtin:tiny (default) or builtin:bench."))
    served_model_name: str | None = Field(None, description=(
        "Name clients pass as `model`; defaults to the `model` value."))
    dtype: str = Field("float32", description="Weights and activations dtype: float32, "
                       "bfloat16 or float16 (CPU runs want float32).")
    device: str = Field("auto", description="auto (CUDA when present, else CPU), cpu or cuda.")
    seed: int = Field(0, description="Seed of the workers' sampler for unseeded requests.")
    num_workers: int = Field(1, ge=1, description=(
        "CPU worker actors to start when no GPU is present (one per GPU otherwise)."))
    worker_num_cpus: float = Field(0.5, gt=0, description=(
        "Ray CPUs reserved per CPU worker actor (fractional on small machines)."))

    # -- KV cache ---------------------------------------------------------------------
    block_size: int = Field(16, ge=1, description="Tokens per KV block.")
    num_kv_blocks: int = Field(2048, ge=1, description="KV blocks per worker.")
    enable_prefix_caching: bool = Field(True, description=(
        "Share full KV blocks between requests with the same prefix (chained hashes)."))

    # -- scheduler ----------------------------------------------------------------------
    max_num_batched_tokens: int = Field(2048, ge=1, description=(
        "Token budget of one step (decode tokens + prefill chunk tokens). Seed 004: 2048 "
        "is vLLM's online default on ordinary GPUs; the calibrator replaces it."))
    max_num_seqs: int = Field(256, ge=1, description="Running requests per worker at most.")
    max_chunk_tokens: int | None = Field(None, ge=1, description=(
        "Cap on one prefill chunk; None means the whole budget."))
    max_concurrent_chunks: int = Field(4, ge=1, description=(
        "Prefill chunks per step in NORMAL mode (seed 000: 4 in parallel)."))
    max_model_len: int = Field(8192, ge=1, description="Prompt + output tokens at most.")
    default_max_tokens: int = Field(256, ge=1, description=(
        "max_tokens when a request does not set it."))

    # -- protections (seed 000 §6) ---------------------------------------------------
    max_prefill_tokens: int = Field(8192, ge=1, description=(
        "Longest prompt the budget is planned for."))
    circuit_breaker_factor: float = Field(1.2, gt=1.0, description=(
        "Budget circuit breaker: a prompt over max_prefill_tokens x this factor gets 422 "
        "before any actor call (seed 000: 1.2x)."))
    max_queue_len: int = Field(1024, ge=1, description=(
        "Waiting requests in the controller before new ones get 429."))

    # -- flow control (seed 000 §4; DESIGN.md "Flow control") ----------------------------
    cache_pressure_enter: float = Field(0.85, gt=0, le=1, description=(
        "KV usage above which new prefill chunks stop (CACHE_PRESSURE_WAIT)."))
    cache_pressure_exit: float = Field(0.79, gt=0, le=1, description=(
        "A cache_evict that brings KV usage below this resumes chunk scheduling."))
    bandwidth_window_s: float = Field(5.0, gt=0, description=(
        "Window of the bandwidth utilisation moving average."))
    throttle_enter: float = Field(0.90, gt=0, le=1, description=(
        "Average bandwidth above which, held for throttle_hold_s, chunks drop to "
        "throttle_chunks (BANDWIDTH_THROTTLE)."))
    throttle_hard: float = Field(0.95, gt=0, le=1, description=(
        "Average bandwidth above which, held for throttle_hold_s, chunks drop to "
        "throttle_hard_chunks."))
    throttle_exit: float = Field(0.85, gt=0, le=1, description=(
        "The throttle ends when the average stays below this for throttle_hold_s."))
    throttle_hold_s: float = Field(3.0, ge=0, description="Hold time of throttle entry/exit.")
    throttle_chunks: int = Field(2, ge=1, description="Prefill chunks per step when throttled.")
    throttle_hard_chunks: int = Field(1, ge=1, description=(
        "Prefill chunks per step above throttle_hard."))
    pause_enter: float = Field(0.98, gt=0, le=1, description=(
        "Average bandwidth above which, held for pause_hold_s, new prefill stops "
        "(PREFILL_PAUSED, the emergency)."))
    pause_hold_s: float = Field(10.0, ge=0, description="Hold time before PREFILL_PAUSED.")
    pause_exit: float = Field(0.90, gt=0, le=1, description=(
        "PREFILL_PAUSED ends when the average falls below this."))
    peak_bandwidth_gbs: float | None = Field(None, gt=0, description=(
        "Peak memory bandwidth (GB/s) for the CPU bandwidth estimate; None measures it "
        "at worker start."))

    # -- protections (seed 000 §6) ----------------------------------------------------------
    chunk_timeout_base_s: float = Field(30.0, gt=0, description=(
        "Per-chunk timeout base: chunk n may take base x (1 + n x chunk_timeout_growth)."))
    chunk_timeout_growth: float = Field(0.1, ge=0, description=(
        "Per-chunk timeout growth per chunk index (later chunks attend to more context)."))
    budget_deviation_threshold: float = Field(0.15, gt=0, description=(
        "A chunk whose time is this far off the cost model is logged as a deviation."))
    slow_budget_score: float = Field(1.5, gt=0, description=(
        "budget_score (actual / budgeted prefill time) above which a request is written "
        "to the slow-request log."))
    seconds_per_token: float = Field(1e-4, gt=0, description=(
        "Uncalibrated cost model: prefill seconds per token (a budget file replaces it)."))
    degrade_after_timeouts: int = Field(3, ge=1, description=(
        "Chunk timeouts within degrade_window_s that switch a worker to the degraded path."))
    degrade_window_s: float = Field(60.0, gt=0, description="Window of the timeout count.")
    degrade_after_paused_s: float = Field(30.0, ge=0, description=(
        "PREFILL_PAUSED this long switches to the degraded path, which keeps serving."))
    degraded_chunk_tokens: int | None = Field(None, ge=1, description=(
        "Chunk size on the degraded path; None means one KV block."))
    tenant_weights: dict[str, float] = Field(default_factory=dict, description=(
        "Weights of tenants (X-Tenant-Id) in each step's prefill budget; absent = 1.0."))

    # -- cluster ------------------------------------------------------------------------
    host: str = Field("127.0.0.1", description="HTTP bind address of the Serve ingress.")
    port: int = Field(8000, ge=1, le=65535, description="HTTP port of the Serve ingress.")
    namespace: str = Field("tokenflow", description="Ray namespace of the named actors.")
    redis_url: str | None = Field(None, description=(
        "Redis for request persistence; None keeps it in memory (the embedded default)."))
    controller_num_cpus: float = Field(0.25, ge=0, description=(
        "Ray CPUs reserved for the controller actor (it mostly waits on workers)."))
    controller_max_restarts: int = Field(3, ge=-1, description=(
        "Times Ray restarts a dead controller actor (-1: without limit)."))
    controller_max_concurrency: int = Field(10_000, ge=16, description=(
        "Concurrent calls the async controller accepts: one per open request stream."))
    detached_controller: bool = Field(False, description=(
        "Give the controller a detached lifetime, so it outlives the process that created "
        "it (`serve deploy` on a long-lived cluster); tests and `make serve` keep it owned."))
    worker_max_restarts: int = Field(1, ge=-1, description=(
        "Times Ray restarts a dead worker actor; its in-flight requests fail either way."))
    ingress_num_cpus: float = Field(0.25, ge=0, description=(
        "Ray CPUs reserved per Serve ingress replica (tokenization, SSE)."))
    ingress_num_replicas: int = Field(1, ge=1, description="Serve ingress replicas.")
    retry_after_s: int = Field(1, ge=0, description=(
        "Retry-After header (seconds) of a 429 answer when the request queues are full."))
    batch_max_in_flight: int = Field(256, ge=1, description=(
        "Requests a batch job on the cluster keeps outstanding at once (`ray job submit`)."))

    @model_validator(mode="after")
    def _check(self) -> TokenflowConfig:
        chunk = self.max_chunk_tokens
        if chunk is not None and chunk > self.max_num_batched_tokens:
            raise ValueError("max_chunk_tokens must not exceed max_num_batched_tokens")
        if not self.cache_pressure_exit < self.cache_pressure_enter:
            raise ValueError("cache_pressure_exit must be below cache_pressure_enter")
        if not self.throttle_exit < self.throttle_enter <= self.throttle_hard:
            raise ValueError("need throttle_exit < throttle_enter <= throttle_hard")
        if not self.pause_exit < self.pause_enter:
            raise ValueError("pause_exit must be below pause_enter")
        if self.num_kv_blocks < 2:
            raise ValueError("the KV pool needs at least two blocks")
        return self

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    @property
    def prefill_cap_tokens(self) -> int:
        """Prompts longer than this are refused with 422 (the circuit breaker)."""
        return int(self.max_prefill_tokens * self.circuit_breaker_factor)

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            max_chunk_tokens=self.max_chunk_tokens,
            max_concurrent_chunks=self.max_concurrent_chunks,
            tenant_weights=dict(self.tenant_weights),
        )

    def core_options(self) -> dict:
        """Flow control, protections and degraded path for `ControllerCore`."""
        flow = FlowConfig(
            cache_enter=self.cache_pressure_enter, cache_exit=self.cache_pressure_exit,
            bw_window_s=self.bandwidth_window_s, throttle_enter=self.throttle_enter,
            throttle_hard=self.throttle_hard, throttle_exit=self.throttle_exit,
            throttle_hold_s=self.throttle_hold_s, pause_enter=self.pause_enter,
            pause_hold_s=self.pause_hold_s, pause_exit=self.pause_exit,
            normal_chunks=self.max_concurrent_chunks, throttle_chunks=self.throttle_chunks,
            throttle_hard_chunks=self.throttle_hard_chunks)
        protections = ProtectionConfig(
            chunk_timeout_base_s=self.chunk_timeout_base_s,
            chunk_timeout_growth=self.chunk_timeout_growth,
            deviation_threshold=self.budget_deviation_threshold,
            slow_score_threshold=self.slow_budget_score,
            degrade_after_timeouts=self.degrade_after_timeouts,
            degrade_window_s=self.degrade_window_s)
        degraded = DegradedConfig(chunk_tokens=self.degraded_chunk_tokens or self.block_size,
                                  after_paused_s=self.degrade_after_paused_s)
        return dict(flow_config=flow, protection_config=protections, degraded_config=degraded,
                    cost_model=per_token_cost_model(self.seconds_per_token))

    def controller_options(self) -> ControllerOptions:
        """The controller actor's slice (it does not import this module)."""
        return ControllerOptions(
            model=self.model, dtype=self.dtype, device=self.device, seed=self.seed,
            num_workers=self.num_workers, worker_num_cpus=self.worker_num_cpus,
            worker_max_restarts=self.worker_max_restarts, block_size=self.block_size,
            num_kv_blocks=self.num_kv_blocks, enable_prefix_caching=self.enable_prefix_caching,
            scheduler=self.scheduler_config(), core=self.core_options(),
            max_model_len=self.max_model_len, max_queue_len=self.max_queue_len,
            namespace=self.namespace,
            num_cpus=self.controller_num_cpus, max_restarts=self.controller_max_restarts,
            max_concurrency=self.controller_max_concurrency, detached=self.detached_controller)
