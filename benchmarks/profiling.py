"""Where a workload's time goes, summarised small enough to live in a results JSON.

`torch.profiler` records every aten op; we keep the top ops by self time (time inside the op
itself, children excluded, so the shares add up) and the share of wall time that no op accounts
for, which is Python, module dispatch and metadata building: the per-step overhead that a
decode step on a small model is most sensitive to. The profiler itself adds a few microseconds
per op, so profiled wall times run above unprofiled ones and that share is an upper bound.

`profile_alternating` profiles several workloads one run at a time, in turn, so that a burst
of background load lands on all of them rather than on whichever was profiled at that moment.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from torch.profiler import ProfilerActivity, profile


def _profile_once(fn: Callable[[], object]) -> tuple[float, dict[str, tuple[float, int]]]:
    """Wall seconds and {aten op: (self microseconds, calls)} of one call."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        fn()
        wall_s = time.perf_counter() - start
    # Only operators ("aten::mm", "mkldnn::_linear_pointwise", ...): the profiler's own
    # annotations would otherwise double-count time.
    return wall_s, {e.key: (e.self_cpu_time_total, e.count) for e in prof.key_averages()
                    if "::" in e.key}


def _summarise(wall_s: float, ops: dict[str, list[float]], runs: int, top: int) -> dict[str, Any]:
    ranked = sorted(ops.items(), key=lambda item: item[1][0], reverse=True)
    total_self_us = sum(us for us, _ in ops.values()) / runs
    wall_us = wall_s / runs * 1e6
    return {
        "wall_ms": wall_us / 1e3,  # profiled, so a little above the unprofiled timings
        "ops_ms": total_self_us / 1e3,
        "outside_ops_share": max(0.0, 1.0 - total_self_us / wall_us),
        "num_op_calls": int(sum(calls for _, calls in ops.values()) // runs),
        "top_ops": [
            {"op": name, "calls": int(calls // runs), "self_ms": us / runs / 1e3,
             "share": us / runs / wall_us}
            for name, (us, calls) in ranked[:top]
        ],
    }


def profile_alternating(
    workloads: dict[str, Callable[[], object]], runs: int = 2, top: int = 10
) -> dict[str, dict[str, Any]]:
    """Per workload: per-run wall and op times over `runs` profiled calls, taken in turn
    (after one unprofiled warm-up call each)."""
    for fn in workloads.values():
        fn()
    walls: dict[str, float] = defaultdict(float)
    ops: dict[str, dict[str, list[float]]] = {name: {} for name in workloads}
    for _ in range(runs):
        for name, fn in workloads.items():
            wall_s, once = _profile_once(fn)
            walls[name] += wall_s
            for op, (us, calls) in once.items():
                acc = ops[name].setdefault(op, [0.0, 0.0])
                acc[0] += us
                acc[1] += calls
    return {name: _summarise(walls[name], ops[name], runs, top) for name in workloads}


def profile_workload(fn: Callable[[], object], runs: int = 3, top: int = 8) -> dict[str, Any]:
    """The summary of one workload alone."""
    return profile_alternating({"fn": fn}, runs, top)["fn"]


def describe(profile_summary: dict[str, Any], top: int = 4) -> str:
    """One line: the biggest ops and the overhead share, for a JSON `why` field."""
    parts = [f"{op['op']} {op['share']:.0%} ({op['calls']} calls)"
             for op in profile_summary["top_ops"][:top]]
    return (f"{profile_summary['num_op_calls']} op calls per run; top self time: "
            + ", ".join(parts)
            + f"; outside ops (Python, dispatch): {profile_summary['outside_ops_share']:.0%}")
