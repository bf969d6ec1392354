"""The calibration section (`calibration:` in the configuration): what `tokenflow
calibrate` and the automatic calibration at start measure, how a measurement becomes the
budget (planning limits), and the budget file. One definition: the grid a calibration
measures, the fit that turns it into a table and the short run (`quick`, the `--quick`
grid and the automatic one) are all this section, taken whole. The ITL SLO the budget is
planned for is the `slo:` section's (`controller/slo.py`).

The controller reads it (the budget of its schedulers), the workers measure with it.
Pydantic-free, like every component section.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from controller.settings import FORBID_EXTRA, check_settings, setting

# The short calibration (`tokenflow calibrate --quick` and the automatic one at start, one
# definition for both): fewer samples, chunks up to 512 tokens, two depths, two decode
# batches, a point's third run only where its first two disagree. The probes, decode
# contexts and memory fraction stay the configured ones (the decode fit needs two contexts;
# a smaller bandwidth buffer would measure a cache).
QUICK_RUN: dict[str, Any] = {"warmup": 1, "iters": 3, "max_tokens": 512,
                             "contexts": (0, 256), "decode_batches": (1, 8),
                             "agree_within": 0.05}


@dataclass(frozen=True)
class CalibrationConfig:
    """Token budget calibration (`tokenflow calibrate`) and the budget file it writes."""

    __pydantic_config__ = FORBID_EXTRA

    budget_file: Path | None = setting(None, description=(  # noqa: RUF009 a field spec
        "Budget table written by `tokenflow calibrate`. When set, "
        "scheduler.max_num_batched_tokens comes from its recommendation for slo.itl_ms "
        "unless that is set explicitly, and its cost model sizes each chunk under the SLO. "
        "A table measured for another model is refused (see allow_other_model)."))
    explicit_budget: bool | None = setting(None, description=(
        "Whether scheduler.max_num_batched_tokens was set (keyword, serve.yaml args, "
        "environment) rather than defaulted: then it is the step budget, and neither the "
        "automatic calibration nor a budget file's recommendation replaces it. None: found "
        "when the configuration is built (a dump carries the answer, so a rebuilt one "
        "agrees)."))
    allow_other_model: bool = setting(False, description=(
        "Use a budget_file measured for another model than worker.model (its budget and "
        "cost model are that model's: for experiments only). False: refused at start."))
    auto: bool = setting(True, description=(
        "Without budget_file: before serving, worker 0 (the in-process worker of a local "
        "engine) loads the budget table of its model, device, dtype, threads, block size "
        "and tile from cache_dir, or measures it on its own device with the `calibrate "
        "--quick` grid (under 30 s for builtin:tiny on CPU) and caches it. False "
        "(`--no-calibrate`): the fixed scheduler budget and the per-token cost model."))
    cache_dir: Path | None = setting(None, description=(  # noqa: RUF009 a field spec
        "Folder of the cached budget tables, on the worker's machine; None: "
        "$TOKENFLOW_CACHE_DIR/budgets (~/.cache/tokenflow/budgets) of the worker's process."))
    max_contention_cores: float = setting(0.3, ge=0, description=(
        "Other processes' CPU use on the worker's cores, in cores beyond those its threads "
        "leave free, above which a calibration measurement counts as disturbed: the "
        "measurement waits for the cores to be quiet and is taken again "
        "(workers/contention.py). A first start's table measured while Serve and the "
        "ingress started on a 2-core machine came out 2-3x slow and was cached."))
    quiet_wait_s: float = setting(20.0, ge=0, description=(
        "Seconds a calibration waits in all for quiet cores (max_contention_cores) before "
        "it measures anyway."))
    max_measure_attempts: int = setting(3, ge=1, description=(
        "Calibration measurements at most while they are disturbed; the least disturbed "
        "is used, and cached only when it was quiet."))
    weight_bits: int | None = setting(None, ge=1, le=32, description=(
        "Bits per weight in the bandwidth constraint (INT4/INT8 scale the weight term by "
        "bits/16); None: the dtype's bits."))
    tile_tokens: int = setting(16, ge=1, description=(
        "Query tile of the attention kernel: chunk sizes are multiples of it and of "
        "cache.block_size, and every cost pads token counts up to it."))
    bandwidth_headroom: float = setting(0.15, ge=0, lt=1, description=(
        "Share of the measured memory bandwidth a step leaves free (>= 15 %)."))
    chunk_efficiency: float = setting(0.98, gt=0, le=1, description=(
        "Chunk size: the smallest grid size reaching this share of the best predicted "
        "prefill throughput within the budget (smaller chunks pay the per-step cost often); "
        "with the derived SLO it also sets the step time. 0.95, not 0.9: in the peer scene "
        "(docs/peer.md) the long prompt's first token came after 4.4 s against 5.4, the "
        "users' P99 gap 0.17 s against 0.11 (vLLM's: 0.8 s). 0.98, not 0.95 (an AMX Xeon, "
        "tokenflow alone, 4 rounds each): 3.0 s against 3.44, P99 gap 0.167 s against "
        "0.155 (vLLM's: 1.0-1.1 s), users 302 against 285 tok/s: the linear fit of the "
        "short calibration (chunks up to 512) reaches 0.95 of its best rate at ~280 tokens "
        "while the GEMMs' rate keeps rising past 512 rows and each served step carries "
        "costs the calibration does not see."))
    plan_context_tokens: int | None = setting(None, ge=0, description=(
        "Context depth the budget is planned at; None: the deepest calibrated depth in the "
        "file's own recommendation, depth 0 for the running scheduler (its cost model "
        "shrinks deeper chunks step by step)."))
    plan_decodes: int | None = setting(None, ge=0, description=(
        "Decodes a step may carry besides its chunk when the budget is planned (every mix "
        "up to this stays under the SLO); None: the largest calibrated decode batch."))
    plan_decode_context_tokens: int | None = setting(None, ge=0, description=(
        "Context the planned decodes are priced at (where running requests decode, not the "
        "chunk's depth); None: the deepest calibrated decode context."))
    warmup: int = setting(5, ge=0, description=(
        "Calibration runs discarded per point (5: the first runs pay for compilation and "
        "caches); a prefill point's admission, never timed, is the first of them."))
    iters: int = setting(20, ge=1, description=(
        "Calibration runs averaged per point after the warm-up (20)."))
    agree_within: float = setting(0.0, ge=0, description=(
        "A point (and a hardware probe) stops after two kept runs that agree within this "
        "fraction (slower / faster - 1) instead of running all iters, and a point whose "
        "last warm-up run agrees with its first kept run keeps both (a cold run would not "
        "agree); a disagreeing pair, a stolen-time burst in one, runs on, and the median "
        "of three drops it. 0: every point runs iters times (the full calibration, whose "
        "spread `--check` reads). The short calibration uses 0.05: on a 2-core Zen 1 it "
        "then measured in 4.4-5.7 s instead of 7.3, a first start's largest part."))
    max_tokens: int = setting(8192, ge=1, description=(
        "Largest prefill chunk calibrated; the grid doubles from the chunk unit up to it."))
    contexts: tuple[int, ...] = setting((0, 1024, 4096), description=(
        "Context depths the prefill chunks are calibrated at (JSON list in the env)."))
    decode_batches: tuple[int, ...] = setting((1, 8, 32), description=(
        "Decode batch sizes calibrated (JSON list in the env)."))
    decode_contexts: tuple[int, ...] = setting((128, 1024), description=(
        "Cached tokens per request in the decode calibration: at least two depths, so the "
        "per-token and per-pair decode costs can be told apart (JSON list in the env)."))
    matmul_size: int = setting(2048, ge=1, description=(
        "Edge of the square GEMM whose FLOP/s is the compute constraint's peak (large enough "
        "to saturate the device: 2048 suits a CPU, a large GPU wants 8192)."))
    bandwidth_bytes: int = setting(256 * 2**20, ge=1, description=(
        "Buffer copied by the memory-bandwidth probe; must be far above the last-level cache."))
    memory_fraction: float = setting(0.9, gt=0, le=1, description=(
        "Share of the device's total memory that weights plus KV blocks may take."))
    check_tolerance: float = setting(0.10, gt=0, description=(
        "`tokenflow calibrate --check` fails when a quantity drifted more than this plus "
        "its allowance for noise (symmetric: max(new/old, old/new) - 1) from the table."))
    check_noise_factor: float = setting(2.0, ge=0, description=(
        "The noise allowance of `--check`: this many times the larger of the two runs' "
        "measured spread of a quantity (the relative interquartile range of its samples, "
        "median over points), added to check_tolerance."))
    max_duration_s: float = setting(150.0, gt=0, description=(
        "`tokenflow calibrate` (not --quick, not --check) sizes its grid to finish the "
        "sweep in about this long on this device: after a pilot it lowers iters to "
        "min_iters and warmup to 1, then drops the largest chunk sizes (keeping "
        "min_chunk_sizes) and the deepest contexts (keeping one) until the estimate fits. "
        "The estimate is printed before the sweep."))
    min_iters: int = setting(10, ge=1, description=(
        "Fewest runs kept per point when the grid is sized to max_duration_s."))
    min_chunk_sizes: int = setting(3, ge=2, description=(
        "Fewest prefill chunk sizes kept when the grid is sized to max_duration_s (the fit "
        "needs several)."))

    def __post_init__(self) -> None:
        check_settings(self)

    def quick(self) -> CalibrationConfig:
        """This section with the short run's grid (`QUICK_RUN`)."""
        return replace(self, **QUICK_RUN)
