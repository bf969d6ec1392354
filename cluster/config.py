"""The one validated home of configuration: pydantic settings, env prefix `TOKENFLOW_`.

`TokenflowConfig` nests one section per component, each the very object that component
takes (`scheduler` is the `SchedulerConfig` the scheduler runs with, ...), so a setting has
one name from YAML to code. The component sections are stdlib dataclasses in their own
packages (the controller, KV cache and workers import no pydantic); pydantic validates them
here from their fields' bounds and descriptions. Every threshold is a documented field,
never a literal in code.

Set a field in the environment as `TOKENFLOW_<SECTION>__<FIELD>` (for example
`TOKENFLOW_SCHEDULER__MAX_NUM_BATCHED_TOKENS=4096`; lists and maps as JSON). Unknown keys are
an error naming the key: in keyword arguments (serve.yaml `args`), in nested sections and in
`TOKENFLOW_*` variables.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from pathlib import Path
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    model_validator,
)
from pydantic_settings import BaseSettings, SettingsConfigDict

from cluster.batch_config import BatchConfig
from cluster.metrics import MetricsConfig
from controller.autoscale import ScalingConfig
from controller.budget import AutoBudget, BudgetFit, BudgetTable, CalibrationGrid
from controller.flow import FlowConfig
from controller.journal import JournalConfig
from controller.options import (
    CacheConfig,
    ClusterConfig,
    ControllerOptions,
    WorkerConfig,
    budgeted_scheduler,
)
from controller.protections import ProtectionConfig
from controller.recovery import RecoveryConfig
from controller.scheduler import SchedulerConfig
from controller.worker_state import DegradedConfig

ENV_PREFIX = "TOKENFLOW_"
# Comma-separated `KEY[:TENANT[:MIN_PRIORITY:MAX_PRIORITY]]` entries (a Kubernetes secret
# as an env var, `--api-key` of `make serve`); apart from `edge.api_keys` so that keys stay
# out of YAML files and of the Serve application's arguments.
API_KEYS_ENV = "TOKENFLOW_API_KEYS"
ENV_NESTED_DELIMITER = "__"
# `TOKENFLOW_*` variables that are not configuration fields (read where they are used).
OTHER_ENV_VARS = frozenset({
    "TOKENFLOW_CACHE_DIR",  # built-in presets' weights (workers/presets.py)
    "TOKENFLOW_BENCH_THREADS", "TOKENFLOW_BENCH_ITL_SLO_MS",  # benchmarks
    API_KEYS_ENV,  # API keys, read by the HTTP edge (`api_keys_from_env`)
})


class CalibrationConfig(BaseModel):
    """Token budget calibration (`tokenflow calibrate`) and the budget file it writes."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    budget_file: Path | None = Field(None, description=(
        "Budget table written by `tokenflow calibrate`. When set, "
        "scheduler.max_num_batched_tokens comes from its recommendation for itl_slo_ms "
        "unless that is set explicitly, and its cost model sizes each chunk under the SLO. "
        "A table measured for another model is refused (see allow_other_model)."))
    explicit_budget: bool | None = Field(None, description=(
        "Whether scheduler.max_num_batched_tokens was set (keyword, serve.yaml args, "
        "environment) rather than defaulted: then it is the step budget, and neither the "
        "automatic calibration nor a budget file's recommendation replaces it. None: found "
        "when the configuration is built (a dump carries the answer, so a rebuilt one "
        "agrees)."))
    allow_other_model: bool = Field(False, description=(
        "Use a budget_file measured for another model than worker.model (its budget and "
        "cost model are that model's: for experiments only). False: refused at start."))
    auto: bool = Field(True, description=(
        "Without budget_file: before serving, worker 0 (the in-process worker of a local "
        "engine) loads the budget table of its model, device, dtype, threads, block size "
        "and tile from cache_dir, or measures it on its own device with the `calibrate "
        "--quick` grid (under 30 s for builtin:tiny on CPU) and caches it. False "
        "(`--no-calibrate`): the fixed scheduler budget and the per-token cost model."))
    cache_dir: Path | None = Field(None, description=(
        "Folder of the cached budget tables, on the worker's machine; None: "
        "$TOKENFLOW_CACHE_DIR/budgets (~/.cache/tokenflow/budgets) of the worker's process."))
    itl_slo_ms: float | None = Field(None, gt=0, description=(
        "Inter-token-latency SLO (ms) the budget is planned for: no step predicted longer. "
        "None: derived from the measured step costs: the step in which a chunk riding with "
        "the planned decodes prefills at chunk_efficiency of the best prefill rate, and at "
        "least twice the planned pure-decode step (controller/budget.py derived_slo_ms), so "
        "prefill keeps near full speed while no decode gap exceeds a few decode steps."))
    weight_bits: int | None = Field(None, ge=1, le=32, description=(
        "Bits per weight in the bandwidth constraint (INT4/INT8 scale the weight term by "
        "bits/16); None: the dtype's bits."))
    tile_tokens: int = Field(16, ge=1, description=(
        "Query tile of the attention kernel: chunk sizes are multiples of it and of "
        "cache.block_size, and every cost pads token counts up to it."))
    bandwidth_headroom: float = Field(0.15, ge=0, lt=1, description=(
        "Share of the measured memory bandwidth a step leaves free (>= 15 %)."))
    chunk_efficiency: float = Field(0.9, gt=0, le=1, description=(
        "Chunk size: the smallest grid size reaching this share of the best predicted "
        "prefill throughput within the budget (smaller chunks pay the per-step cost often)."))
    plan_context_tokens: int | None = Field(None, ge=0, description=(
        "Context depth the budget is planned at; None: the deepest calibrated depth in the "
        "file's own recommendation, depth 0 for the running scheduler (its cost model "
        "shrinks deeper chunks step by step)."))
    plan_decodes: int | None = Field(None, ge=0, description=(
        "Decodes a step may carry besides its chunk when the budget is planned (every mix "
        "up to this stays under the SLO); None: the largest calibrated decode batch."))
    plan_decode_context_tokens: int | None = Field(None, ge=0, description=(
        "Context the planned decodes are priced at (where running requests decode, not the "
        "chunk's depth); None: the deepest calibrated decode context."))
    warmup: int = Field(5, ge=0, description=(
        "Calibration runs discarded per point (5: the first runs pay for compilation and "
        "caches)."))
    iters: int = Field(20, ge=1, description=(
        "Calibration runs averaged per point after the warm-up (20)."))
    max_tokens: int = Field(8192, ge=1, description=(
        "Largest prefill chunk calibrated; the grid doubles from the chunk unit up to it."))
    contexts: tuple[int, ...] = Field((0, 1024, 4096), description=(
        "Context depths the prefill chunks are calibrated at (JSON list in the env)."))
    decode_batches: tuple[int, ...] = Field((1, 8, 32), description=(
        "Decode batch sizes calibrated (JSON list in the env)."))
    decode_contexts: tuple[int, ...] = Field((128, 1024), description=(
        "Cached tokens per request in the decode calibration: at least two depths, so the "
        "per-token and per-pair decode costs can be told apart (JSON list in the env)."))
    matmul_size: int = Field(2048, ge=1, description=(
        "Edge of the square GEMM whose FLOP/s is the compute constraint's peak (large enough "
        "to saturate the device: 2048 suits a CPU, a large GPU wants 8192)."))
    bandwidth_bytes: int = Field(256 * 2**20, ge=1, description=(
        "Buffer copied by the memory-bandwidth probe; must be far above the last-level cache."))
    memory_fraction: float = Field(0.9, gt=0, le=1, description=(
        "Share of the device's total memory that weights plus KV blocks may take."))
    check_tolerance: float = Field(0.10, gt=0, description=(
        "`tokenflow calibrate --check` fails when a quantity drifted more than this plus "
        "its allowance for noise (symmetric: max(new/old, old/new) - 1) from the table."))
    check_noise_factor: float = Field(2.0, ge=0, description=(
        "The noise allowance of `--check`: this many times the larger of the two runs' "
        "measured spread of a quantity (the relative interquartile range of its samples, "
        "median over points), added to check_tolerance."))
    max_duration_s: float = Field(150.0, gt=0, description=(
        "`tokenflow calibrate` (not --quick, not --check) sizes its grid to finish the "
        "sweep in about this long on this device: after a pilot it lowers iters to "
        "min_iters and warmup to 1, then drops the largest chunk sizes (keeping "
        "min_chunk_sizes) and the deepest contexts (keeping one) until the estimate fits. "
        "The estimate is printed before the sweep."))
    min_iters: int = Field(10, ge=1, description=(
        "Fewest runs kept per point when the grid is sized to max_duration_s."))
    min_chunk_sizes: int = Field(3, ge=2, description=(
        "Fewest prefill chunk sizes kept when the grid is sized to max_duration_s (the fit "
        "needs several)."))


class ApiKey(BaseModel):
    """One API key and what it may do: the tenant its requests are charged to, and the
    `priority` values it may ask for (lower runs first)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    key: SecretStr = Field(description=(
        "The bearer token (`Authorization: Bearer KEY`); never logged, shown as ******."))
    tenant: str = Field("default", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$",
                        description="Tenant of every request made with this key.")
    min_priority: int | None = Field(None, description=(
        "Lowest (most urgent) priority this key may ask for; None: edge.min_priority."))
    max_priority: int | None = Field(None, description=(
        "Highest priority this key may ask for; None: edge.max_priority."))

    @model_validator(mode="after")
    def _check(self) -> ApiKey:
        key = self.key.get_secret_value()
        if not key or any(c.isspace() or c in ",:" for c in key):
            raise ValueError("an API key must be non-empty, without spaces, ',' or ':'")
        if (self.min_priority is not None and self.max_priority is not None
                and self.min_priority > self.max_priority):
            raise ValueError("min_priority must be <= max_priority")
        return self


def api_keys_from_env(environ: dict[str, str] | None = None) -> tuple[ApiKey, ...]:
    """The keys of `TOKENFLOW_API_KEYS`: `KEY`, `KEY:TENANT` or `KEY:TENANT:MIN:MAX`,
    comma-separated. ValueError (never echoing a key) on a malformed entry."""
    environ = dict(os.environ) if environ is None else environ
    keys: list[ApiKey] = []
    for i, entry in enumerate(e.strip() for e in environ.get(API_KEYS_ENV, "").split(",")):
        if not entry:
            continue
        parts = entry.split(":")
        if len(parts) not in (1, 2, 4):
            raise ValueError(f"{API_KEYS_ENV}: entry {i} must be KEY, KEY:TENANT or "
                             f"KEY:TENANT:MIN_PRIORITY:MAX_PRIORITY")
        fields: dict[str, Any] = {"key": parts[0]}
        if len(parts) > 1:
            fields["tenant"] = parts[1]
        try:
            if len(parts) == 4:
                fields["min_priority"], fields["max_priority"] = int(parts[2]), int(parts[3])
            keys.append(ApiKey(**fields))
        except ValidationError as err:  # messages only: the inputs may hold the key
            reasons = "; ".join(e["msg"] for e in err.errors(include_url=False))
            raise ValueError(f"{API_KEYS_ENV}: entry {i} is invalid: {reasons}") from None
        except ValueError:  # int() of a priority
            raise ValueError(f"{API_KEYS_ENV}: entry {i} has a priority that is not an "
                             f"integer") from None
    return tuple(keys)


class EdgeConfig(BaseModel):
    """The HTTP edge's limits and who may call it (`edge:` in the configuration)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_body_bytes: int = Field(4 * 2**20, ge=1024, description=(
        "Largest request body (bytes); larger ones get 413 from their Content-Length (or "
        "as soon as a chunked body passes it), before the body is read."))
    max_json_depth: int = Field(32, ge=4, le=400, description=(
        "Deepest nesting of objects and arrays in a request body (a chat request needs 5); "
        "deeper bodies get 400 before they are parsed."))
    api_keys: tuple[ApiKey, ...] = Field((), description=(
        "API keys (JSON list of {key, tenant, min_priority, max_priority}); the keys of "
        "TOKENFLOW_API_KEYS are added. With any key, every /v1 route needs one and a "
        "request's tenant is its key's; without keys, the X-Tenant-Id header names it. "
        "/health stays open, /metrics too unless metrics_require_api_key."))
    metrics_require_api_key: bool = Field(False, description=(
        "With API keys configured, /metrics needs one too (401 without a valid key; give "
        "the scraper `authorization: {credentials: KEY}`). False: /metrics is open, as in "
        "vLLM. Without keys it changes nothing."))
    min_priority: int = Field(0, description=(
        "Lowest `priority` a request may ask for (lower runs first): 0, the default "
        "priority, so that no client can jump the queue unless its key allows it."))
    max_priority: int = Field(100, description="Highest `priority` a request may ask for.")
    num_text_threads: int | None = Field(None, ge=1, description=(
        "Threads that parse, template, tokenize and detokenize off the event loop (a batch "
        "job on the cluster also reads its input on them); None: the CPUs this process may "
        "use."))
    detokenize_in_thread_tokens: int = Field(16, ge=1, description=(
        "A delta of at least this many tokens is detokenized on the text threads (smaller "
        "ones cost less than the hand-off)."))
    reconnect_backoff_s: float = Field(0.05, gt=0, description=(
        "First wait before the edge subscribes to a restarted controller again; doubles up "
        "to reconnect_backoff_max_s."))
    reconnect_backoff_max_s: float = Field(1.0, gt=0, description=(
        "Longest wait between the edge's tries to reach a restarted controller."))
    reconnect_timeout_s: float = Field(120.0, ge=0, description=(
        "How long the edge keeps trying to reach a restarted controller before every open "
        "request fails."))
    max_choices: int = Field(8, ge=1, le=128, description=(
        "Most sequences one request may generate (`n`, and completions' `best_of`); more "
        "get 400. Each choice is an engine request of its own sharing the prompt's blocks."))

    @model_validator(mode="after")
    def _check(self) -> EdgeConfig:
        if self.min_priority > self.max_priority:
            raise ValueError("edge.min_priority must be <= edge.max_priority")
        return self


def _section_fields(annotation: Any) -> dict[str, Any] | None:
    """Field name -> type of a nested section, None for a plain value."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return {name: f.annotation for name, f in annotation.model_fields.items()}
    if dataclasses.is_dataclass(annotation):
        return typing.get_type_hints(annotation)
    return None


def _is_known(key: str) -> bool:
    """Whether `key` (`section__field...`, lower case, no prefix) sets a field."""
    section, _, rest = key.partition(ENV_NESTED_DELIMITER)
    field = TokenflowConfig.model_fields.get(section)
    if field is None:
        return False
    if not rest:
        return True  # a value, or a whole section as JSON
    fields = _section_fields(field.annotation)
    name, _, deeper = rest.partition(ENV_NESTED_DELIMITER)
    if fields is None or name not in fields:
        return False
    # Only a map takes keys below its field (TOKENFLOW_SCHEDULER__TENANT_WEIGHTS__A=2).
    return not deeper or typing.get_origin(fields[name]) is dict


def check_env(environ: dict[str, str] | None = None) -> None:
    """Raise ValueError naming every `TOKENFLOW_*` variable that sets no field
    (pydantic-settings would ignore it silently)."""
    environ = dict(os.environ) if environ is None else environ
    unknown = [name for name in environ if name.upper().startswith(ENV_PREFIX)
               and name.upper() not in OTHER_ENV_VARS
               and not _is_known(name[len(ENV_PREFIX):].lower())]
    if unknown:
        raise ValueError(f"unknown configuration variable(s) {', '.join(sorted(unknown))}: "
                         f"set sections' fields as {ENV_PREFIX}<SECTION>"
                         f"{ENV_NESTED_DELIMITER}<FIELD>")


class TokenflowConfig(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid",
                                      env_nested_delimiter=ENV_NESTED_DELIMITER)

    worker: WorkerConfig = Field(default_factory=WorkerConfig, description=(
        "The model and the worker actors that run it."))
    cache: CacheConfig = Field(default_factory=CacheConfig, description=(
        "Each worker's paged KV cache."))
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig, description=(
        "The per-worker scheduler: step budget, chunking, policy, tenants, defragmentation."))
    flow: FlowConfig = Field(default_factory=FlowConfig, description=(
        "Flow control: cache pressure and bandwidth modes with their hysteresis."))
    protections: ProtectionConfig = Field(default_factory=ProtectionConfig, description=(
        "Circuit breaker, queue bound, chunk timeouts, budget deviation, slow requests."))
    degraded: DegradedConfig = Field(default_factory=DegradedConfig, description=(
        "The degraded path a worker takes after repeated timeouts or a long pause."))
    calibration: CalibrationConfig = Field(default_factory=CalibrationConfig, description=(
        "Token budget calibration and the budget file."))
    cluster: ClusterConfig = Field(default_factory=ClusterConfig, description=(
        "Ray and Serve: resources, restarts, namespace, the HTTP edge."))
    recovery: RecoveryConfig = Field(default_factory=RecoveryConfig, description=(
        "Dead and hung workers: step deadlines, restart backoff, poison requests."))
    metrics: MetricsConfig = Field(default_factory=MetricsConfig, description=(
        "The /metrics exporter: tenant label cap, SLO reference lines."))
    journal: JournalConfig = Field(default_factory=JournalConfig, description=(
        "The request journal in Redis (on when cluster.redis_url is set)."))
    edge: EdgeConfig = Field(default_factory=EdgeConfig, description=(
        "The HTTP edge: body and nesting limits, API keys, priority bounds, text threads."))
    batch: BatchConfig = Field(default_factory=BatchConfig, description=(
        "Offline batch jobs: requests in flight, step budget, start-up wait, shard size."))
    scaling: ScalingConfig = Field(default_factory=ScalingConfig, description=(
        "The elastic worker pool: load-driven growth and shrinking within "
        "min_workers..max_workers (off by default), drain timeout."))

    def __init__(self, **data: Any) -> None:
        check_env()
        super().__init__(**data)

    @model_validator(mode="before")
    @classmethod
    def _find_explicit_budget(cls, data: Any) -> Any:
        # Runs on the arguments merged with the environment (pydantic-settings' sources).
        if not isinstance(data, dict):
            return data
        cal = data.get("calibration")
        if isinstance(cal, CalibrationConfig):
            cal = cal.model_dump()
        cal = dict(cal or {})
        if cal.get("explicit_budget") is None:
            cal["explicit_budget"] = sets_budget(data.get("scheduler"))
        return {**data, "calibration": cal}

    @property
    def budget_is_explicit(self) -> bool:
        return bool(self.calibration.explicit_budget)

    def budget_table(self) -> BudgetTable | None:
        """The budget file's table, or None. The automatic table is not made here (this
        process may be a driver or an ingress on another device): see `auto_budget`."""
        cal = self.calibration
        if cal.budget_file is None:
            return None
        from workers.budget_file import check_model, load_budget_table

        table = load_budget_table(cal.budget_file)
        if not cal.allow_other_model:
            check_model(table, self.worker.model, str(cal.budget_file))
        return table

    def calibration_grid(self) -> CalibrationGrid:
        """What `tokenflow calibrate` measures by default (`.quick()`: `--quick`)."""
        cal = self.calibration
        return CalibrationGrid(
            warmup=cal.warmup, iters=cal.iters, max_tokens=cal.max_tokens,
            contexts=cal.contexts, decode_batches=cal.decode_batches,
            decode_contexts=cal.decode_contexts, matmul_size=cal.matmul_size,
            bandwidth_bytes=cal.bandwidth_bytes, memory_fraction=cal.memory_fraction)

    def budget_fit(self) -> BudgetFit:
        cal = self.calibration
        return BudgetFit(
            itl_slo_ms=cal.itl_slo_ms, bandwidth_headroom=cal.bandwidth_headroom,
            chunk_efficiency=cal.chunk_efficiency, plan_context_tokens=cal.plan_context_tokens,
            plan_decodes=cal.plan_decodes,
            plan_decode_context_tokens=cal.plan_decode_context_tokens,
            weight_bits=cal.weight_bits)

    def auto_budget(self) -> AutoBudget | None:
        """The short calibration worker 0 loads or runs at start (calibration.auto without
        a budget file), or None."""
        cal = self.calibration
        if cal.budget_file is not None or not cal.auto or self.budget_is_explicit:
            return None
        return AutoBudget(grid=self.calibration_grid().quick(), tile_tokens=cal.tile_tokens,
                          fit=self.budget_fit(),
                          cache_dir=None if cal.cache_dir is None else str(cal.cache_dir))

    def scheduler_config(self, table: BudgetTable | None = None) -> SchedulerConfig:
        """A copy of `scheduler` (the comparison policies mutate theirs) with the budget
        table's recommendation applied (the table wins); chunks are then sized per step
        by its cost model, not by one fixed size."""
        if table is None or self.budget_is_explicit:
            return dataclasses.replace(self.scheduler)
        return budgeted_scheduler(self.scheduler, table, self.budget_fit(), self.cache)

    def controller_options(self) -> ControllerOptions:
        """What the controller actor takes (it does not import this module). Measures
        nothing: with calibration.auto, the controller has worker 0 load or measure the
        table on the worker's own device before it builds its schedulers."""
        options = ControllerOptions(
            worker=self.worker, cache=self.cache, scheduler=self.scheduler_config(),
            flow=self.flow, protections=self.protections, degraded=self.degraded,
            cluster=self.cluster, recovery=self.recovery, journal=self.journal,
            scaling=self.scaling, auto_budget=self.auto_budget())
        table = self.budget_table()
        if table is None:
            return options
        # The table's cost model either way; its budget only when none was set explicitly.
        return dataclasses.replace(options.with_budget_table(table, self.budget_fit()),
                                   scheduler=self.scheduler_config(table))


BUDGET_FIELD = "max_num_batched_tokens"


def sets_budget(scheduler: Any) -> bool:
    """Whether a `scheduler` argument (a mapping or a SchedulerConfig) sets the budget."""
    if isinstance(scheduler, dict):
        return BUDGET_FIELD in scheduler
    if isinstance(scheduler, SchedulerConfig):
        return scheduler.max_num_batched_tokens != SchedulerConfig().max_num_batched_tokens
    return False


def nest(dotted: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """`{"worker.model": M}` -> `{"worker": {"model": M}}`, leaving out None values: the
    CLIs' flat options as `TokenflowConfig` keyword arguments."""
    sections: dict[str, dict[str, Any]] = {}
    for key, value in dotted.items():
        if value is not None:
            section, _, name = key.partition(".")
            sections.setdefault(section, {})[name] = value
    return sections
