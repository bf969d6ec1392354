"""Where tokenflow's step time goes (the peer benchmark's `profile` section): per-step shapes
and times from `LocalEngine`'s step log, and an operator breakdown of a few steps from
torch's profiler, grouped into what the issue asks about (GEMMs of the layers and lm_head,
attention, KV reads/writes, sampling, the rest)."""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from typing import Any

# Operator name fragments -> group; first match wins (aten::linear's children are the mms).
OP_GROUPS = (
    # A decode-only step's layers in one C++ call (workers/decode_stack.py): its GEMMs,
    # attention and elementwise passes, which the profiler cannot see one by one.
    ("decode_stack", ("tokenflow::decode_stack",)),
    ("attention", ("scaled_dot_product", "_flash_attention", "_scaled_dot",
                   "tokenflow::decode_attention", "tokenflow::chunk_attention")),
    ("kv_read_write", ("index_select", "index_copy")),
    # The CPU worker's packed linears (lm_head among them) are oneDNN calls, plain ones mms.
    ("gemm", ("mkldnn::_linear_pointwise", "aten::mm", "aten::addmm", "aten::bmm",
              "aten::matmul")),
    ("sampling", ("argmax", "topk", "softmax", "multinomial", "sort", "cumsum")),
    ("elementwise", ("aten::mul", "aten::add", "aten::silu", "aten::rsqrt", "aten::pow",
                     "aten::mean", "aten::cat", "aten::cos", "aten::sin", "aten::copy_",
                     "aten::to", "aten::neg", "aten::sub")),
)


def _group(name: str) -> str:
    for group, fragments in OP_GROUPS:
        if any(f in name for f in fragments):
            return group
    return "other_ops"


def _quantiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)
    return {"median": statistics.median(ordered), "p90": ordered[int(0.9 * (len(ordered) - 1))],
            "max": ordered[-1], "n": len(ordered)}


def step_shapes(step_log: list[Any], itl_slo_s: float | None) -> dict[str, Any]:
    """Chunks planned, decodes carried, step times and the share of the SLO each step used,
    split into prefill-only, mixed and decode-only steps."""
    kinds: dict[str, list[tuple[int, int, float]]] = defaultdict(list)
    chunk_sizes: list[int] = []
    for plan, result in step_log:
        counts = list(plan.num_scheduled_tokens.values())
        chunks = [n for n in counts if n > 1]
        num_decodes = len(counts) - len(chunks)
        chunk_sizes += chunks
        kind = "decode_only" if not chunks else ("prefill_only" if not num_decodes else "mixed")
        kinds[kind].append((sum(chunks), num_decodes, result.elapsed_s))
    out: dict[str, Any] = {"chunk_tokens": _quantiles([float(c) for c in chunk_sizes])}
    for kind, rows in kinds.items():
        prefill_tokens = sum(r[0] for r in rows)
        out[kind] = {"num_steps": len(rows), "step_s": _quantiles([r[2] for r in rows]),
                     "decodes_per_step": _quantiles([float(r[1]) for r in rows])}
        if prefill_tokens:
            out[kind]["s_per_prefill_token"] = sum(r[2] for r in rows) / prefill_tokens
        if itl_slo_s:
            out[kind]["slo_share"] = _quantiles([r[2] / itl_slo_s for r in rows])
    return out


def op_breakdown(run_steps: Any, num_steps: int) -> dict[str, Any]:
    """Self CPU time per group over `num_steps` steps of `run_steps`, and what no operator
    accounts for (Python, planning, dispatch) as the rest of the wall time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        run_steps(num_steps)
        wall = time.perf_counter() - start
    groups: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        groups[_group(event.key)] += event.self_cpu_time_total / 1e6
    ops_s = sum(groups.values())
    return {"wall_s": wall, "num_steps": num_steps,
            "share": {k: v / wall for k, v in sorted(groups.items(), key=lambda kv: -kv[1])},
            "outside_ops_share": max(wall - ops_s, 0.0) / wall}


def offline_breakdown(engine: Any, batch: list[list[int]], fresh: list[list[int]],
                      params: Any) -> dict[str, Any]:
    """The offline run once more with the step log on, then a profiled prefill-heavy and a
    decode-heavy stretch on `fresh` prompts: `batch`'s would be prefix-cache hits there,
    their prefill skipped."""
    engine.keep_step_log, engine.step_log = True, []
    engine.generate(batch, params)
    shapes = step_shapes(engine.step_log, engine.scheduler.itl_slo_s)
    engine.keep_step_log, engine.step_log = False, []
    ids = [engine.add_request(p, params) for p in fresh]

    def run_steps(n: int) -> None:
        for _ in range(n):
            engine.step()

    engine.keep_step_log = True
    prefill = op_breakdown(run_steps, 4)  # the first steps: the prompts' chunks
    prefill["prefill_tokens"] = sum(n for plan, _ in engine.step_log
                                    for n in plan.num_scheduled_tokens.values() if n > 1)
    engine.keep_step_log, engine.step_log = False, []
    run_steps(8)
    decode = op_breakdown(run_steps, 8)
    for rid in ids:
        engine.abort(rid)
    while engine.has_work():
        engine.step()
    return {"steps": shapes, "ops_prefill_steps": prefill, "ops_decode_steps": decode}
