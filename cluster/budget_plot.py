"""PNG of a budget table: fitted cost curves over the measured points.

Left: prefill step time against chunk tokens, one colour per context depth (points: means
with one standard deviation; lines: the fitted model), the ITL SLO and the recommended
budget. Right: decode step time against batch size. matplotlib is a dev extra: without
it `plot_table` returns None and the caller says so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from controller.budget import BudgetTable

CURVE_POINTS = 64  # samples per fitted curve (smooth on a log axis)


def plot_table(table: BudgetTable, path: Path, itl_slo_ms: float | None = None,
               held_out: list[dict[str, Any]] | None = None) -> Path | None:
    """Write the plot; `held_out` prefill points (same keys as the table's) are drawn as
    hollow markers so a reader sees the model on sizes it was not fitted on."""
    try:
        import matplotlib
        import matplotlib.ticker

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    data = table.data
    fig, (ax_pre, ax_dec) = plt.subplots(1, 2, figsize=(12, 5))
    contexts = sorted({p["context"] for p in data["prefill"]})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    low = min(p["tokens"] for p in data["prefill"])
    high = max(p["tokens"] for p in data["prefill"])
    for i, context in enumerate(contexts):
        color = colors[i % len(colors)]
        pts = [p for p in data["prefill"] if p["context"] == context]
        ax_pre.errorbar([p["tokens"] for p in pts], [p["mean_s"] for p in pts],
                        yerr=[p["std_s"] for p in pts], fmt="o", color=color,
                        label=f"measured, context {context}")
        curve = [round(low * (high / low) ** (k / (CURVE_POINTS - 1)))
                 for k in range(CURVE_POINTS)]
        ax_pre.plot(curve, [table.predict(t, context) for t in curve], "-", color=color,
                    label=f"fit, context {context}")
        extra = [p for p in held_out or [] if p["context"] == context]
        if extra:
            ax_pre.plot([p["tokens"] for p in extra], [p["mean_s"] for p in extra], "s",
                        mfc="none", color=color, label=f"held out, context {context}")
    rec = data["recommendation"]
    slo_ms = itl_slo_ms or rec["itl_slo_ms"]
    ax_pre.axhline(slo_ms / 1e3, color="grey", ls="--", label=f"ITL SLO {slo_ms:g} ms")
    ax_pre.axvline(rec["max_num_batched_tokens"], color="grey", ls=":",
                   label=f"budget {rec['max_num_batched_tokens']} ({rec['itl_slo_ms']:g} ms)")
    ax_pre.set_xscale("log", base=2)  # the tile grid doubles: one tick per measured size
    ax_pre.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax_pre.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax_pre.set(yscale="log", xlabel="chunk tokens", ylabel="step time (s)",
               title="prefill chunks: t = a + b*tokens + c*pairs (steps: tile padding)")
    ax_pre.legend(fontsize="x-small")

    batches = list(range(1, max(d["batch"] for d in data["decode"]) + 1))
    for i, context in enumerate(sorted({d["context"] for d in data["decode"]})):
        color = colors[i % len(colors)]
        dec = [d for d in data["decode"] if d["context"] == context]
        ax_dec.errorbar([d["batch"] for d in dec], [d["mean_s"] for d in dec],
                        yerr=[d["std_s"] for d in dec], fmt="o", color=color,
                        label=f"measured, context {context}")
        ax_dec.plot(batches, [table.predict_step(0, 0, b, context) for b in batches], "-",
                    color=color, label=f"fit, context {context}")
    ax_dec.set(xlabel="decode batch", ylabel="step time (s)", title="decode steps")
    ax_dec.legend(fontsize="x-small")
    fit = data["fit"]["prefill"]
    fig.suptitle(f"{data['spec']['model']} on {data['device_name']}: median fit error "
                 f"{fit['median_rel_error'] * 100:.1f} %, worst {fit['max_rel_error'] * 100:.1f} %"
                 f" (token counts padded to the {table.tile}-token tile)",
                 fontsize="small")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
