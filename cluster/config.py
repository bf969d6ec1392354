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

import contextlib
import dataclasses
import json
import os
import typing
from collections.abc import Iterable
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    SecretStr,
    ValidationError,
    model_validator,
)
from pydantic_settings import BaseSettings, SettingsConfigDict

from cluster.batch_config import BatchConfig, check_overrides
from cluster.metrics import MetricsConfig
from cluster.renames import check_moved, moved_env
from controller.autoscale import ScalingConfig
from controller.budget import AutoBudget, BudgetTable
from controller.calibration import CalibrationConfig
from controller.flow import FlowConfig
from controller.journal_records import JournalConfig
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
from controller.slo import SloConfig
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


def _decode_json(section: str, values: Any) -> Any:
    """A section's lists and maps given as JSON text (`TOKENFLOW_CALIBRATION__CONTEXTS='[0,
    512]'`), decoded: pydantic-settings decodes them in models' fields, not dataclasses'."""
    field = TokenflowConfig.model_fields.get(section)
    fields = _section_fields(field.annotation) if field is not None else None
    if not isinstance(values, dict) or not fields:
        return values
    decoded = dict(values)
    for name, value in values.items():
        kinds = {typing.get_origin(a) for a in (fields.get(name), *typing.get_args(
            fields.get(name)))}
        if isinstance(value, str) and kinds & {tuple, list, dict}:
            with contextlib.suppress(ValueError):
                decoded[name] = json.loads(value)
    return decoded


def check_env(environ: dict[str, str] | None = None) -> None:
    """Raise ValueError naming every `TOKENFLOW_*` variable that sets no field
    (pydantic-settings would ignore it silently)."""
    environ = dict(os.environ) if environ is None else environ
    unknown = [name for name in environ if name.upper().startswith(ENV_PREFIX)
               and name.upper() not in OTHER_ENV_VARS
               and not _is_known(name[len(ENV_PREFIX):].lower())]
    moved = {n: moved_env(n.upper(), ENV_PREFIX, ENV_NESTED_DELIMITER) for n in unknown}
    renamed = sorted(m for m in moved.values() if m)
    problems = [f"renamed configuration variable(s): {'; '.join(renamed)}"] if renamed else []
    if unknown := [n for n in unknown if not moved[n]]:
        problems.append(f"unknown configuration variable(s) {', '.join(sorted(unknown))}: "
                        f"set sections' fields as {ENV_PREFIX}<SECTION>"
                        f"{ENV_NESTED_DELIMITER}<FIELD>")
    if problems:
        raise ValueError("; ".join(problems))


def given_settings(data: dict[str, Any], environ: dict[str, str]) -> frozenset[str]:
    """`section.field` of every setting given rather than defaulted: keyword arguments (of
    a section object, the fields off their defaults) and `TOKENFLOW_*` variables."""
    given: set[str] = set()
    for section, values in data.items():
        if isinstance(values, dict):
            given.update(f"{section}.{name}" for name in values)
        elif dataclasses.is_dataclass(values) and not isinstance(values, type):
            default = type(values)()
            given.update(f"{section}.{f.name}" for f in dataclasses.fields(values)
                         if getattr(values, f.name) != getattr(default, f.name))
    for name, value in environ.items():
        key = name.upper()
        if not key.startswith(ENV_PREFIX) or key in OTHER_ENV_VARS:
            continue
        section, _, rest = key[len(ENV_PREFIX):].lower().partition(ENV_NESTED_DELIMITER)
        if rest:
            given.add(f"{section}.{rest.partition(ENV_NESTED_DELIMITER)[0]}")
            continue
        with contextlib.suppress(ValueError):  # a whole section as JSON
            values = json.loads(value)
            given.update(f"{section}.{k}" for k in values if isinstance(values, dict))
    return frozenset(given)


class TokenflowConfig(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid",
                                      env_nested_delimiter=ENV_NESTED_DELIMITER)
    # The settings given rather than defaulted (`is_given`): a batch profile's override
    # yields to them.
    _given: frozenset[str] = PrivateAttr(default_factory=frozenset)

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
    slo: SloConfig = Field(default_factory=SloConfig, description=(
        "Latency objectives: the ITL SLO steps are planned for, the TTFT SLO line, and the "
        "planning headroom under the ITL SLO."))
    scaling: ScalingConfig = Field(default_factory=ScalingConfig, description=(
        "The elastic worker pool: load-driven growth and shrinking within "
        "min_workers..max_workers (off by default), drain timeout."))

    def __init__(self, **data: Any) -> None:
        check_env()
        given = given_settings(data, dict(os.environ))
        super().__init__(**data)
        self._given = given

    @model_validator(mode="after")
    def _check_batch_profile(self) -> TokenflowConfig:
        sections = {name: getattr(self, name) for name in type(self).model_fields
                    if name != "batch"}
        checked = check_overrides(self.batch.overrides, sections)
        if checked != self.batch.overrides:  # as the sections validate them ("8" -> 8)
            self.batch = dataclasses.replace(self.batch, overrides=checked)
        return self

    def __eq__(self, other: object) -> bool:
        # The settings, not how they were given: a configuration rebuilt from its dump is it.
        return isinstance(other, TokenflowConfig) and self.__dict__ == other.__dict__

    def is_given(self, dotted: str) -> bool:
        """Whether `section.field` was given (keyword, serve.yaml args, environment)."""
        return dotted in self._given

    def with_batch_profile(self, sections: Iterable[str],
                           also_given: Iterable[str] = ()) -> TokenflowConfig:
        """This configuration as a batch job runs it: `batch.overrides` of `sections` on
        each setting that was not given (nor is in `also_given`)."""
        kept = self._given | set(also_given)
        update = {}
        for section in sections:
            fields = {name: value for name, value in self.batch.overrides.get(section, {})
                      .items() if f"{section}.{name}" not in kept}
            if fields:
                update[section] = dataclasses.replace(getattr(self, section), **fields)
        return self.model_copy(update=update)

    @model_validator(mode="before")
    @classmethod
    def _find_explicit_budget(cls, data: Any) -> Any:
        # Runs on the arguments merged with the environment (pydantic-settings' sources).
        check_moved(data)  # an old name fails naming its new home
        if not isinstance(data, dict):
            return data
        data = {k: _decode_json(k, v) for k, v in data.items()}
        cal = data.get("calibration")
        if isinstance(cal, CalibrationConfig):
            cal = dataclasses.asdict(cal)
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

    def auto_budget(self) -> AutoBudget | None:
        """The short calibration worker 0 loads or runs at start (calibration.auto without
        a budget file), or None."""
        cal = self.calibration
        if cal.budget_file is not None or not cal.auto or self.budget_is_explicit:
            return None
        return AutoBudget(cal.quick(), self.slo.itl_ms)

    def scheduler_config(self, table: BudgetTable | None = None) -> SchedulerConfig:
        """A copy of `scheduler` (the comparison policies mutate theirs) with the budget
        table's recommendation applied (the table wins); chunks are then sized per step
        by its cost model, not by one fixed size."""
        if table is None or self.budget_is_explicit:
            return dataclasses.replace(self.scheduler)
        return budgeted_scheduler(self.scheduler, table, self.calibration, self.slo, self.cache)

    def controller_options(self) -> ControllerOptions:
        """What the controller actor takes (it does not import this module). Measures
        nothing: with calibration.auto, the controller has worker 0 load or measure the
        table on the worker's own device before it builds its schedulers."""
        options = ControllerOptions(
            worker=self.worker, cache=self.cache, scheduler=self.scheduler_config(),
            flow=self.flow, protections=self.protections, degraded=self.degraded,
            cluster=self.cluster, recovery=self.recovery, journal=self.journal, slo=self.slo,
            scaling=self.scaling, auto_budget=self.auto_budget())
        table = self.budget_table()
        if table is None:
            return options
        # The table's cost model either way; its budget only when none was set explicitly.
        return dataclasses.replace(options.with_budget_table(table, self.calibration),
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
