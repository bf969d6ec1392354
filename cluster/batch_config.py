"""The batch jobs' settings (`batch:` in the configuration), apart from the runners so that
`cluster.config` nests them without importing the runners (which import it).

`batch` holds only what is a batch job's own (requests in flight, the start-up wait, shard
size) and a profile, `overrides`: settings of the other sections that a batch job runs with
instead of the serving ones, each unless that setting was given (keyword, serve.yaml
`args`, environment, a CLI flag). The profile names the sections' own fields, so it is
validated like them (`check_overrides`, at start): a misspelled key fails naming it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import TypeAdapter, ValidationError

from controller.settings import FORBID_EXTRA, check_settings, setting

# The offline profile: no one waits on a token, so a step as large as vLLM's offline
# default amortizes weight reads instead of meeting an ITL SLO; every short prompt is a
# chunk, and the interactive chunk limit would admit a batch of them a few per step while
# the budget sits unused; the worker of a controller the job starts takes every core of its
# node (its idle threads sleep, so the job's driver and controller still get their share:
# on 2 cores, in 4 alternating pairs of rounds, the job ran 1.05-1.4x faster on both).
DEFAULT_OVERRIDES: dict[str, dict[str, Any]] = {
    "scheduler": {"max_num_batched_tokens": 8192, "max_concurrent_chunks": 256},
    "worker": {"num_threads": -1},
}
# Sections whose overrides apply to the workers of a controller the job starts (a `--local`
# job's in-process worker keeps its `worker:` settings); the others apply to every engine
# a job starts.
OWN_CONTROLLER_SECTIONS = frozenset({"worker"})


@dataclass(frozen=True)
class BatchConfig:
    """Offline batch jobs (`python -m cluster.batch`): local, on the cluster, with Ray Data."""

    __pydantic_config__ = FORBID_EXTRA

    max_in_flight: int = setting(256, ge=1, description=(
        "Requests a batch job keeps outstanding at once (in the local engine, or on the "
        "cluster's controller: its queue stays bounded for online traffic, and a long input "
        "is never held in memory)."))
    start_timeout_s: float = setting(600.0, gt=0, description=(
        "How long a batch job on the cluster waits for the controller's workers to come up "
        "(a job that starts its own controller loads the model first). Was "
        "batch.ready_wait_s, renamed: cluster.ready_wait_s is another wait (a request's for "
        "the controller's answer)."))
    engine_in_task: bool = setting(True, description=(
        "A job on a cluster with no tokenflow controller, for one worker "
        "(worker.num_workers 1), runs its engine in one Ray task on the driver's node that "
        "holds one worker's resources (cluster/task_batch.py): no controller, no per-step "
        "calls between processes. False, or another case: the job starts a controller "
        "(owned by the job) and streams its requests through it."))
    task_max_retries: int = setting(3, ge=0, description=(
        "Times Ray runs the engine's task again when its process dies "
        "(batch.engine_in_task); each run resumes after the answered lines."))
    rows_per_shard: int = setting(10_000, ge=1, description=(
        "Output lines per shard file of `--ray-data` (a shard is closed and listed in the "
        "manifest when full)."))
    overrides: dict[str, dict[str, Any]] = setting(  # noqa: RUF009 a field spec
        default_factory=lambda: {s: dict(f) for s, f in DEFAULT_OVERRIDES.items()},
        description=(
            "The batch profile: {section: {field: value}} a batch job runs with instead of "
            "the section's own value, unless that field was given (keyword, serve.yaml args, "
            "environment, CLI flag; a budget file counts as giving the step budget). Merged "
            "over the default profile, {scheduler: {max_num_batched_tokens: 8192, "
            "max_concurrent_chunks: 256}, worker: {num_threads: -1}}: the offline step "
            "(with the profile's budget the automatic calibration is off: it plans for an "
            "ITL SLO no one waits on) and, for the worker of a controller the job starts, "
            "every core of its node. Keys are the sections' own fields, checked at "
            "start (TOKENFLOW_BATCH__OVERRIDES__SCHEDULER__MAX_NUM_BATCHED_TOKENS=4096). "
            "Was batch.max_num_batched_tokens, batch.max_concurrent_chunks and "
            "batch.worker_num_threads."))

    def __post_init__(self) -> None:
        check_settings(self)
        merged = {s: dict(f) for s, f in DEFAULT_OVERRIDES.items()}
        for section, fields in self.overrides.items():
            merged[section] = {**merged.get(section, {}), **fields}
        object.__setattr__(self, "overrides", merged)


@functools.cache
def _adapter(section_type: type) -> TypeAdapter[Any]:
    return TypeAdapter(section_type)  # built once per section class: it costs milliseconds


def check_overrides(overrides: Mapping[str, Mapping[str, Any]],
                    sections: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The profile with its values as the sections validate them (`sections`: name -> the
    configured section object). ValueError naming `batch.overrides.SECTION[.FIELD]` when a
    section or field does not exist or a value is out of its bounds."""
    checked: dict[str, dict[str, Any]] = {}
    for name, fields in overrides.items():
        where = f"batch.overrides.{name}"
        section = sections.get(name)
        if section is None or not dataclasses.is_dataclass(section):
            raise ValueError(f"{where}: no such section (one of {', '.join(sorted(sections))})")
        known = {f.name for f in dataclasses.fields(section)}
        for field in fields:
            if field not in known:
                raise ValueError(f"{where}.{field}: {name} has no such setting")
        try:
            profiled = _adapter(type(section)).validate_python(
                {**dataclasses.asdict(section), **fields})
        except ValidationError as err:
            reasons = "; ".join(".".join([where, *map(str, e["loc"])]) + f": {e['msg']}"
                                for e in err.errors(include_url=False))
            raise ValueError(reasons) from None
        checked[name] = {field: getattr(profiled, field) for field in fields}
    return checked
