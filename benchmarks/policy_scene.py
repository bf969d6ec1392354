"""The long-prompt scene (docs/architecture.md) on one policy's engine, its numbers and its figure.

Users stream; once each has decoded `decode_steps_before` tokens a long prompt lands. The
numbers: the users' inter-token gaps that overlap the long prompt's prefill (from its arrival
to its first token), the long request's time to first token, and throughput over the whole
scene (first arrival to last token).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.policy_metrics import (
    gaps,
    itls,
    itls_overlapping,
    step_composition,
    summary_ms,
    throughput,
    ttft,
)
from benchmarks.policy_workloads import SceneSpec, long_prompt_hook, scene_users
from benchmarks.virtual_time import Driver, Trace, VirtualClock, drive_together
from cluster.engine import LocalEngine

LONG_ID = "long-0"
SHORT_ID = "short-0"


def run_scenes(engines: dict[str, LocalEngine], clocks: dict[str, VirtualClock],
               spec: SceneSpec) -> dict[str, Trace]:
    """The scene on every engine, interleaved step by step (same background load)."""
    drivers = {}
    for name, engine in engines.items():
        vocab = engine.worker.vocab_size
        drivers[name] = Driver(engine, clocks[name], scene_users(spec, vocab, clocks[name].now),
                               hook=long_prompt_hook(spec, vocab))
    drive_together(list(drivers.values()))
    return {name: driver.trace for name, driver in drivers.items()}


def scene_metrics(trace: Trace) -> dict[str, Any]:
    long = trace.requests[LONG_ID]
    t0, t1 = long.arrival_s, long.token_times[0]
    users = trace.ids("user-")
    during = itls_overlapping(trace, users, t0, t1)
    return {
        "long_arrival_s": t0 - trace.start_s,
        "long_ttft_s": ttft(long),
        # A short prompt landing two steps into the long prefill: queued behind it or not.
        "short_ttft_s": ttft(trace.requests[SHORT_ID]),
        "itl_during_long_prefill": summary_ms(during),
        "itl_whole_scene": summary_ms(itls(trace, users)),
        # Once the long request decodes, its 4k-token context rides in every decode step:
        # this is what the users see then (the same work in every policy).
        "itl_while_long_decodes": summary_ms(itls_overlapping(
            trace, users, long.token_times[0], long.token_times[-1])),
        "users_ttft_max_s": max(ttft(trace.requests[u]) for u in users),
        "throughput": throughput(trace),
        "window_steps": step_composition(trace, t0, t1, LONG_ID),
        "aborted": sum(r.aborted for r in trace.requests.values()),
    }


def _user_gaps(trace: Trace, origin: float) -> tuple[np.ndarray, np.ndarray]:
    """(token time relative to origin, gap ms) of every user's token after its first."""
    points = sorted((end - origin, (end - start) * 1e3)
                    for rid in trace.ids("user-") for start, end in gaps(trace.requests[rid]))
    arr = np.asarray(points) if points else np.zeros((0, 2))
    return arr[:, 0], arr[:, 1]


def plot_scene(traces: dict[str, Trace], itl_slo_ms: float, path: Path) -> None:
    """Left: the users' ITL over time (0 = the long prompt lands; the dotted line of each
    policy's colour is its first token). Right: the CDF of the users' gaps overlapping the
    long prefill (solid) and over the whole scene (dashed)."""
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on benchmark machines
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.6))
    for (name, trace), color in zip(traces.items(), ("C0", "C3", "C1"), strict=False):
        long = trace.requests[LONG_ID]
        origin = long.arrival_s
        times, gap_ms = _user_gaps(trace, origin)
        left.plot(times, gap_ms, ".", ms=2.5, color=color, label=name)
        left.axvline(long.token_times[0] - origin, color=color, ls=":", lw=1.2)
        during = np.sort(np.asarray(itls_overlapping(trace, trace.ids("user-"), origin,
                                                     long.token_times[0])) * 1e3)
        whole = np.sort(np.asarray(itls(trace, trace.ids("user-"))) * 1e3)
        for data, style, label in ((during, "-", f"{name}, during long prefill"),
                                   (whole, "--", f"{name}, whole scene")):
            if data.size:
                right.step(data, np.arange(1, data.size + 1) / data.size, style, color=color,
                           where="post", label=label)
    for ax in (left, right):
        ax.grid(alpha=0.3)
    left.axhline(itl_slo_ms, color="k", lw=0.8, ls="--", label=f"ITL SLO {itl_slo_ms:.0f} ms")
    left.set(yscale="log", xlabel="time since the long prompt landed (s, virtual)",
             ylabel="users' inter-token latency (ms)",
             title="ITL over time (dotted: long request's first token)")
    left.legend(fontsize=8, markerscale=3)
    right.axvline(itl_slo_ms, color="k", lw=0.8, ls="--")
    right.set(xscale="log", xlabel="users' inter-token latency (ms)", ylabel="fraction <= x",
              title="ITL CDF")
    right.legend(fontsize=7, loc="lower right")
    fig.suptitle("The long-prompt scene: users streaming, a long prompt lands")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
