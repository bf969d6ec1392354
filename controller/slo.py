"""The service-level objectives (`slo:` in the configuration), in one place: the
inter-token latency steps are planned for, the time to first token the dashboard draws,
and the headroom the plan keeps under the ITL SLO for the steps' noise.

The controller reads them (the budget's SLO, the headroom of `controller/refit.py`), the
edge's `/metrics` exports them. Pydantic-free, like every component section.
"""

from __future__ import annotations

from dataclasses import dataclass

from controller.settings import FORBID_EXTRA, check_settings, setting


@dataclass(frozen=True)
class SloConfig:
    """Latency objectives and the planning headroom under them (`slo:`)."""

    __pydantic_config__ = FORBID_EXTRA

    itl_ms: float | None = setting(None, gt=0, description=(
        "Inter-token-latency SLO (ms) the budget is planned for: no step predicted longer. "
        "None: derived from the measured step costs: the step in which a chunk riding with "
        "the planned decodes prefills at calibration.chunk_efficiency of the best prefill "
        "rate, and at least twice the planned pure-decode step (controller/budget.py "
        "derived_slo_ms), so prefill keeps near full speed while no decode gap exceeds a "
        "few decode steps; deep in a long prompt a step may run past the derived one, up "
        "to max_depth_stretch times it. Was calibration.itl_slo_ms."))
    ttft_s: float = setting(2.0, gt=0, description=(
        "Time-to-first-token SLO, exported as tokenflow_ttft_slo_seconds: the dashboard's "
        "threshold line (the ITL line is itl_ms, or the derived one). Was "
        "metrics.ttft_slo_s."))
    headroom_quantile: float = setting(1.0, gt=0, le=1, description=(
        "Chunk-carrying steps are planned to the ITL SLO / h, h being this quantile of "
        "measured / predicted step time over the last headroom_window such steps "
        "(clamped to [1, max_headroom]): the P99 inter-token latency is set by the slow "
        "steps, so the plan keeps the room that the model's error and the machine's noise "
        "take. The default is the window's slowest step. Was "
        "protections.slo_headroom_quantile."))
    headroom_window: int = setting(64, ge=1, description=(
        "Chunk-carrying steps whose measured / predicted time sets the headroom. A new step "
        "exceeds the slowest of the last n with probability 1 / (n + 1): with 64, about one "
        "step in 65 runs past the plan's room, what a P99 target allows (with 16, one in 17 "
        "did, and the slowest steps of a long prefill went over the SLO). Was "
        "protections.slo_headroom_window."))
    max_headroom: float = setting(1.3, ge=1, description=(
        "Most headroom the plan keeps (a model that is off by more gets refitted instead). "
        "Was protections.max_slo_headroom."))

    max_depth_stretch: float = setting(2.0, ge=1, description=(
        "With the derived ITL SLO (itl_ms None): how far past it a step may run so that a "
        "chunk deep into a long prompt still prefills at calibration.chunk_efficiency of "
        "the best rate at its depth. There each token costs more (attention over the "
        "context) while the step's fixed costs (weights, the decodes riding along) stay, "
        "so the SLO alone shrinks chunks into overhead: a 6,000-token prompt beside 8 "
        "decodes took 80-token chunks at 5,000 tokens, 40 % of each step fixed cost. At "
        "depth 0 the stretch changes nothing (the derived SLO is that efficient step). 1: "
        "no stretch. A configured itl_ms is never stretched."))

    max_refit_slo_scale: float = setting(2.0, ge=1, description=(
        "With the derived ITL SLO (itl_ms None): an online refit whose model predicts "
        "longer steps than the calibrated one (the median over the refit window's steps) "
        "raises the SLO by as much, up to this factor. The derived SLO is the step in "
        "which a chunk prefills efficiently; where served steps run slower than "
        "calibrated (other processes on the worker's cores) that chunk takes longer, and "
        "a fixed SLO shrank the chunks instead. A refit that predicts shorter steps "
        "leaves the SLO (larger chunks fit it: on a 2-core Zen 3 that gave the peer "
        "scene's long prompt 6.2 s against 7.0 s with the SLO lowered as well, "
        "docs/peer.md). 1: the SLO stays. A configured itl_ms never moves."))

    def __post_init__(self) -> None:
        check_settings(self)
