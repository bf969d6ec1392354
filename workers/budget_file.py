"""The budget file (`tokenflow calibrate --out budget.json`): its pydantic model and loader.

The controller's `BudgetTable` trusts its data; a file enters only through
`load_budget_table`, which refuses a table that is not of this schema version or whose
fields have the wrong type or range, naming the offending field. Strict: a JSON string is
not a number, 1 is not true. Keys beyond the listed ones are ignored (the writer may add
fields; `schema_version` changes when a listed one changes).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from controller.budget import SCHEMA_VERSION, BudgetTable

NonNegInt = Annotated[int, Field(ge=0)]
PosInt = Annotated[int, Field(ge=1)]
NonNeg = Annotated[float, Field(ge=0)]
Pos = Annotated[float, Field(gt=0)]
Fraction = Annotated[float, Field(ge=0, le=1)]


class _Part(BaseModel):
    model_config = ConfigDict(strict=True, frozen=True)


class Spec(_Part):
    """What was measured (workers/calibrate.py `CalibrationSpec`)."""

    model: str
    dtype: str
    device: str
    block_size: PosInt
    tile_tokens: PosInt
    warmup: NonNegInt
    iters: PosInt
    threads: PosInt | None
    prefill_tokens: list[PosInt]
    contexts: list[NonNegInt]
    decode_batches: list[PosInt]
    decode_contexts: list[NonNegInt]
    matmul_size: PosInt
    bandwidth_bytes: PosInt
    memory_fraction: Fraction
    agree_within: NonNeg = 0.0  # tables measured before it ran every point iters times


class ModelStats(_Part):
    num_params: PosInt
    weight_bytes: PosInt
    weight_bits: PosInt
    measured_weight_bits: PosInt
    flops_per_token: Pos
    flops_per_pair: Pos
    flops_per_sample: NonNeg
    max_model_len: PosInt


class Hardware(_Part):
    peak_flops: Pos  # FLOP/s
    memory_bandwidth: Pos  # bytes/s


class AllocProbe(_Part):
    blocks: NonNegInt
    ok: bool


class KVStats(_Part):
    bytes_per_block: PosInt
    memory_budget_bytes: NonNegInt
    blocks_fit: NonNegInt
    alloc_probe: list[AllocProbe]
    blocks_allocated: NonNegInt
    max_blocks_int64: PosInt
    max_tokens_int32_offset: PosInt
    capacity_tokens: NonNegInt


class Timing(_Part):
    mean_s: Pos
    median_s: Pos
    std_s: NonNeg
    bytes_moved: NonNegInt


class PrefillPoint(Timing):
    tokens: PosInt
    context: NonNegInt


class DecodePoint(Timing):
    batch: PosInt
    context: NonNegInt


class Fit(_Part):
    """t = a + b * tokens + c * pairs, with the fit's relative errors."""

    a: NonNeg
    b: NonNeg
    c: NonNeg
    median_rel_error: NonNeg
    max_rel_error: NonNeg


class BytesFit(_Part):
    weights: NonNeg
    per_token: NonNeg
    per_context_token: NonNeg


class Fits(_Part):
    prefill: Fit
    decode: Fit
    bytes: BytesFit


class Limits(_Part):
    bandwidth_headroom: Fraction
    chunk_efficiency: Fraction
    plan_context_tokens: NonNegInt
    plan_decodes: NonNegInt
    plan_decode_context_tokens: NonNegInt | None = None  # absent in older tables


class BindingRow(_Part):
    tokens_min: PosInt
    tokens_max: PosInt
    binding: Literal["compute", "bandwidth", "kv_capacity"]
    compute_s: NonNeg
    bandwidth_s: NonNeg
    predicted_s: NonNeg


class Recommendation(_Part):
    itl_slo_ms: Pos
    max_num_batched_tokens: PosInt
    chunk_size: PosInt
    limited_by: str
    # configured: itl_slo_ms was set; derived: from the fits (BudgetTable.derived_slo_ms)
    slo_source: Literal["configured", "derived"] = "configured"


class Noise(_Part):
    """Relative spread (interquartile range / median) of each quantity `--check` compares:
    the median over points for step times, over runs for the probes."""

    prefill_time: NonNeg
    decode_time: NonNeg
    peak_flops: NonNeg
    memory_bandwidth: NonNeg


class BudgetFile(_Part):
    schema_version: Literal[SCHEMA_VERSION]  # type: ignore[valid-type]
    created_unix: NonNeg
    device_name: str
    spec: Spec
    model_stats: ModelStats
    hardware: Hardware
    kv: KVStats
    prefill: list[PrefillPoint]
    decode: list[DecodePoint]
    fit: Fits
    limits: Limits
    table: list[BindingRow]
    recommendation: Recommendation
    # The measured model's config.json hash (absent in older tables): the same model under
    # another path is still the same model.
    model_config_sha256: str | None = None
    noise: Noise | None = None  # absent in older tables: no allowance beyond the tolerance


def validate_budget(data: Any, source: str = "budget table") -> None:
    """Raise ValueError naming each bad field (`spec.block_size: ...`) of `data`."""
    try:
        BudgetFile.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '<root>'}: {err['msg']}"
            f" (got {err['input']!r:.60})" for err in exc.errors())
        raise ValueError(f"{source} is not a budget table of schema version "
                         f"{SCHEMA_VERSION}: {problems}") from None


def _config_sha256(model: str) -> str | None:
    config = Path(model) / "config.json"
    return hashlib.sha256(config.read_bytes()).hexdigest() if config.is_file() else None


def is_same_model(measured: str, measured_sha256: str | None, model: str) -> bool:
    """Whether a table measured for `measured` (config.json hash `measured_sha256`) is
    `model`'s: the same name or folder, or a folder here with the same config.json."""
    if measured == model:
        return True
    if Path(measured).is_dir() and Path(model).is_dir() \
            and Path(measured).resolve() == Path(model).resolve():
        return True
    return measured_sha256 is not None and _config_sha256(model) == measured_sha256


def check_model(table: BudgetTable, model: str, source: str = "budget table") -> None:
    """Raise ValueError when `table` was measured for another model than `model`: its
    budget and cost model would be another model's, silently."""
    measured = table.data["spec"]["model"]
    if is_same_model(measured, table.data.get("model_config_sha256"), model):
        return
    raise ValueError(
        f"{source} was measured for model {measured!r}, but this runs {model!r}: its step "
        f"budget and cost model are the other model's. Measure this one (tokenflow "
        f"calibrate --model {model} --out FILE), or set calibration.allow_other_model=true "
        f"(TOKENFLOW_CALIBRATION__ALLOW_OTHER_MODEL=true) to use it anyway")


def load_budget_table(path: str | Path) -> BudgetTable:
    """Read and validate a budget file."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    validate_budget(data, str(path))
    return BudgetTable(data)
