"""The one validated home of configuration: pydantic settings, env prefix `TOKENFLOW_`.

Every threshold from the seed documents is a documented field here, never a literal in
code. Components take the slices they need (`scheduler_config()`, ...).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from controller.core import DegradedConfig
from controller.flow import FlowConfig
from controller.options import ControllerOptions
from controller.policies import make_scheduler_class
from controller.protections import CostModel, ProtectionConfig, per_token_cost_model
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
    scheduling_policy: Literal["tokenflow", "prefill-first", "prefill-priority-chunked"] = Field(
        "tokenflow", description=(
            "tokenflow: decode-first unified budget with flow control. The others exist to "
            "be measured against: prefill-first (vLLM V0: whole prompts in prefill-only "
            "steps) and prefill-priority-chunked (nano-vllm: only a step's first prefill "
            "is cut; prefill and decode never share a step)."))
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
    telemetry: bool = Field(True, description=(
        "Sample memory-bandwidth utilisation every step (NVML on NVIDIA GPUs, an estimate "
        "on CPU) for the bandwidth modes; off, those modes never trigger."))
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
    defrag_threshold: float | None = Field(0.30, gt=0, lt=1, description=(
        "KV defragmentation: compact used blocks when more than this share lies outside "
        "the compact region (seed 000: 30 %); None disables it."))
    defrag_max_moves: int = Field(64, ge=1, description="KV blocks moved per step at most.")
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
    ingress_max_ongoing_requests: int = Field(4096, ge=1, description=(
        "Requests one ingress replica holds at once (Serve's default of 5 would queue "
        "every further stream at the proxy, defeating continuous batching)."))
    retry_after_s: int = Field(1, ge=0, description=(
        "Retry-After header (seconds) of a 429 answer when the request queues are full."))
    batch_max_in_flight: int = Field(256, ge=1, description=(
        "Requests a batch job on the cluster keeps outstanding at once (`ray job submit`)."))

    # -- token budget calibration (seed 000 §3, DESIGN.md "Token budget") -------------
    budget_file: Path | None = Field(None, description=(
        "Budget table written by `tokenflow calibrate`. When set, max_num_batched_tokens and "
        "max_chunk_tokens come from its recommendation for itl_slo_ms (the table wins)."))
    itl_slo_ms: float = Field(100.0, gt=0, description=(
        "Inter-token-latency SLO (ms) the budget is planned for: no step predicted longer."))
    weight_bits: int | None = Field(None, ge=1, le=32, description=(
        "Bits per weight in the bandwidth constraint (INT4/INT8 scale the weight term by "
        "bits/16); None: the dtype's bits."))
    kernel_tile_tokens: int = Field(16, ge=1, description=(
        "Query tile of the attention kernel: chunk sizes are multiples of it and of "
        "block_size, and every cost pads token counts up to it."))
    bandwidth_headroom: float = Field(0.15, ge=0, lt=1, description=(
        "Share of the measured memory bandwidth a step leaves free (seed 000: >= 15 %)."))
    budget_chunk_efficiency: float = Field(0.9, gt=0, le=1, description=(
        "Chunk size: the smallest grid size reaching this share of the best predicted "
        "prefill throughput within the budget (smaller chunks pay the per-step cost often)."))
    budget_plan_context_tokens: int | None = Field(None, ge=0, description=(
        "Context depth the budget is planned at; None: the deepest calibrated depth."))
    budget_plan_decodes: int | None = Field(None, ge=0, description=(
        "Decodes a step may carry besides its chunk when the budget is planned (every mix "
        "up to this stays under the SLO); None: the largest calibrated decode batch."))
    calib_warmup: int = Field(5, ge=0, description=(
        "Calibration runs discarded per point (seed 000 pitfall 9: 5)."))
    calib_iters: int = Field(20, ge=1, description=(
        "Calibration runs averaged per point after the warm-up (seed 000: 20)."))
    calib_max_tokens: int = Field(8192, ge=1, description=(
        "Largest prefill chunk calibrated; the grid doubles from the chunk unit up to it."))
    calib_contexts: tuple[int, ...] = Field((0, 1024, 4096), description=(
        "Context depths the prefill chunks are calibrated at (JSON list in the env)."))
    calib_decode_batches: tuple[int, ...] = Field((1, 8, 32), description=(
        "Decode batch sizes calibrated (JSON list in the env)."))
    calib_decode_contexts: tuple[int, ...] = Field((128, 1024), description=(
        "Cached tokens per request in the decode calibration: at least two depths, so the "
        "per-token and per-pair decode costs can be told apart (JSON list in the env)."))
    calib_matmul_size: int = Field(2048, ge=1, description=(
        "Edge of the square GEMM whose FLOP/s is the compute constraint's peak (large enough "
        "to saturate the device: 2048 suits a CPU, a large GPU wants 8192)."))
    calib_bandwidth_bytes: int = Field(256 * 2**20, ge=1, description=(
        "Buffer copied by the memory-bandwidth probe; must be far above the last-level cache."))
    calib_memory_fraction: float = Field(0.9, gt=0, le=1, description=(
        "Share of the device's total memory that weights plus KV blocks may take."))
    calib_check_tolerance: float = Field(0.10, gt=0, description=(
        "`tokenflow calibrate --check` fails when a quantity drifted more than this "
        "(symmetric: max(new/old, old/new) - 1) from the table."))

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
        budget, chunk = self.max_num_batched_tokens, self.max_chunk_tokens
        if self.budget_file is not None:
            from controller.budget import BudgetTable  # numpy only where a table is used

            budget, chunk = BudgetTable.load(self.budget_file).recommend(
                self.itl_slo_ms, block_size=self.block_size,
                kv_capacity_tokens=self.num_kv_blocks * self.block_size,
                context=self.budget_plan_context_tokens, decodes=self.budget_plan_decodes)
        return SchedulerConfig(
            max_num_batched_tokens=budget,
            max_num_seqs=self.max_num_seqs,
            max_chunk_tokens=chunk,
            max_concurrent_chunks=self.max_concurrent_chunks,
            tenant_weights=dict(self.tenant_weights),
            defrag_threshold=self.defrag_threshold, defrag_max_moves=self.defrag_max_moves,
        )

    def cost_model(self) -> CostModel:
        """predict(tokens, context) -> s: the budget table's fitted model when budget_file is
        set (deviation warnings and budget_score then compare against measurements)."""
        if self.budget_file is None:
            return per_token_cost_model(self.seconds_per_token)
        from controller.budget import BudgetTable

        return BudgetTable.load(self.budget_file).predict

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
                    cost_model=self.cost_model(),
                    scheduler_cls=make_scheduler_class(self.scheduling_policy))

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
            max_concurrency=self.controller_max_concurrency, detached=self.detached_controller,
            telemetry=self.telemetry, peak_bandwidth_bytes_s=self.peak_bandwidth_bytes_s)

    @property
    def peak_bandwidth_bytes_s(self) -> float | None:
        return None if self.peak_bandwidth_gbs is None else self.peak_bandwidth_gbs * 1e9
