"""The closed loop: refit the step cost model online when measured steps keep deviating.

Every step that carried prefill chunks is priced by the current model; the last
`refit_window` of them (shape and measured time: bounded memory) are kept. When at least
`refit_deviating_share` of that window is more than `deviation_threshold` off the model,
a new model is fitted on the window: least squares over the step's fixed cost, tokens,
(query, key) pairs, decodes and decode pairs when the window's chunk sizes spread enough
to tell them apart and that fit, made on one half of the sizes, predicts the other half
better than scaling does; else the current model scaled by the median measured /
predicted ratio (a device that got uniformly slower or faster). The window
then starts afresh, so one drift gives one refit; a refit that would not predict the
window better is dropped (noise, not drift). With a derived ITL SLO, a refit whose model
predicts longer steps than the calibrated one raises the SLO as much (`itl_slo_s`, at most
`slo.max_refit_slo_scale` times), so that chunks keep the size that prefills efficiently.

The same steps give the planning headroom: a high quantile of measured / predicted time
over the last `slo.headroom_window` of them (`slo.headroom_quantile`), which the scheduler
divides the ITL SLO by, so that noisy steps, not only average ones, land under it.
Torch-free.
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from dataclasses import dataclass

from controller.budget import LinearFit, StepCost, chunk_pairs, fit_nonneg, pad
from controller.protections import ProtectionConfig
from controller.scheduler import StepShape
from controller.slo import SloConfig

logger = logging.getLogger("tokenflow.refit")

# Fewer steps than this say nothing about the noise: no headroom yet.
MIN_HEADROOM_SAMPLES = 4


@dataclass(frozen=True)
class StepSample:
    chunks: tuple[tuple[int, int], ...]  # (tokens, context)
    num_decodes: int
    decode_context: int
    elapsed_s: float


class OnlineRefit:
    def __init__(self, config: ProtectionConfig, slo: SloConfig,
                 calibrated: StepCost | None = None, itl_slo_s: float | None = None,
                 max_slo_scale: float = 1.0) -> None:
        self.config, self.slo = config, slo
        # The ITL SLO planned for: with max_slo_scale > 1 (a derived SLO) a refit that
        # predicts longer steps than the calibrated model moves it up as much (at most x).
        self.calibrated, self.calibrated_slo_s = calibrated, itl_slo_s
        self.itl_slo_s, self.max_slo_scale = itl_slo_s, max_slo_scale
        self.window: deque[tuple[StepSample, bool]] = deque(maxlen=config.refit_window)
        # measured / predicted of the last steps with chunks, against the current model
        self.ratios: deque[float] = deque(maxlen=slo.headroom_window)
        self.num_refits = 0

    @property
    def headroom(self) -> float:
        """What the ITL SLO is divided by when chunks are planned (>= 1)."""
        slo = self.slo
        if len(self.ratios) < MIN_HEADROOM_SAMPLES:
            return 1.0
        ordered = sorted(self.ratios)
        quantile = ordered[min(len(ordered) - 1, int(slo.headroom_quantile * len(ordered)))]
        return min(max(quantile, 1.0), slo.max_headroom)

    def observe(self, shape: StepShape, elapsed_s: float,
                cost: StepCost) -> StepCost | None:
        """Account one step with chunks; returns a refitted model when the window says so."""
        if not shape.chunks or elapsed_s <= 0:
            return None
        sample = StepSample(tuple(shape.chunks.values()), shape.num_decodes,
                            shape.decode_context, elapsed_s)
        predicted = _predict(cost, sample)
        deviated = predicted <= 0 or abs(elapsed_s / predicted - 1.0) > \
            self.config.deviation_threshold
        if predicted > 0:
            self.ratios.append(elapsed_s / predicted)
        self.window.append((sample, deviated))
        cfg = self.config
        if len(self.window) < cfg.refit_window or \
                sum(d for _, d in self.window) < cfg.refit_deviating_share * cfg.refit_window:
            return None
        samples = [s for s, _ in self.window]
        refit, how = _refit(samples, cost, cfg)
        self.window.clear()
        before = statistics.median(_errors(samples, cost))
        after = statistics.median(_errors(samples, refit))
        if after >= before:  # noise, not drift: keep the model
            return None
        self.num_refits += 1
        self.ratios.clear()  # measured against the old model
        self._move_slo(samples, refit)
        logger.warning("cost model refitted (%s) on %d steps: median error %.0f%% -> %.0f%%",
                       how, len(samples), 100 * before, 100 * after)
        return refit

    def _move_slo(self, samples: list[StepSample], refit: StepCost) -> None:
        base, slo_s, most = self.calibrated, self.calibrated_slo_s, self.max_slo_scale
        if base is None or slo_s is None or most <= 1.0:
            return
        scale = statistics.median(_predict(refit, s) / _predict(base, s) for s in samples)
        # Never below the calibrated SLO: on a device faster than calibrated the SLO's
        # time (what users see) holds and larger chunks fit, more efficient still.
        self.itl_slo_s = slo_s * min(max(scale, 1.0), most)


def _predict(cost: StepCost, sample: StepSample) -> float:
    return cost.step_s(sample.chunks, sample.num_decodes, sample.decode_context)


def _errors(samples: list[StepSample], cost: StepCost) -> list[float]:
    return [abs(_predict(cost, s) / s.elapsed_s - 1.0) for s in samples]


def _refit(samples: list[StepSample], cost: StepCost,
           config: ProtectionConfig) -> tuple[StepCost, str]:
    """Least squares when the window's chunk sizes and decodes spread and the fit, made on
    either half of the sizes, predicts the other half clearly better than scaling does
    (`refit_least_squares_gain`), and the whole window better too; else the scaled model.
    Held out by size, not at random: the scheduler uses the model to price chunks of
    other sizes than it saw, so a fit must extrapolate, not only interpolate."""
    scaled = _scaled(samples, cost)
    tokens = sorted({t for s in samples for t, _ in s.chunks})
    depths = {c for s in samples for _, c in s.chunks}
    spread = config.refit_min_token_spread
    num_decodes = {s.num_decodes for s in samples}
    decode_depths = [s.decode_context + 1 for s in samples if s.num_decodes]
    decodes_vary = len(num_decodes) > 1 or (
        bool(decode_depths) and max(decode_depths) >= spread * min(decode_depths))
    if len(tokens) < 3 or len(depths) < 2 or not decodes_vary or tokens[-1] < spread * tokens[0]:
        return scaled, "scaled"  # too little spread to tell the coefficients apart
    by_size = sorted(samples, key=lambda s: sum(t for t, _ in s.chunks))
    half = len(by_size) // 2
    small, large = by_size[:half], by_size[half:]
    held_fit = [*_errors(large, _least_squares(small, cost)),
                *_errors(small, _least_squares(large, cost))]
    held_scaled = [*_errors(large, _scaled(small, cost)), *_errors(small, _scaled(large, cost))]
    if statistics.median(held_fit) > config.refit_least_squares_gain * \
            statistics.median(held_scaled):
        return scaled, "scaled"
    fitted = _least_squares(samples, cost)
    if statistics.median(_errors(samples, fitted)) < statistics.median(_errors(samples, scaled)):
        return fitted, "least squares"
    return scaled, "scaled"


def _scaled(samples: list[StepSample], cost: StepCost) -> StepCost:
    return cost.scaled(statistics.median(s.elapsed_s / _predict(cost, s) for s in samples))


def _least_squares(samples: list[StepSample], cost: StepCost) -> StepCost:
    """Fixed cost, tokens, (query, key) pairs, decodes and decode pairs, >= 0."""
    rows = []
    for s in samples:
        padded = [(pad(t, cost.tile), c) for t, c in s.chunks]
        rows.append([1.0, sum(t for t, _ in padded), sum(chunk_pairs(t, c) for t, c in padded),
                     s.num_decodes, s.num_decodes * (s.decode_context + 1.0)])
    a, b, c, d, e = fit_nonneg(rows, [s.elapsed_s for s in samples])
    return StepCost(LinearFit(a, b, c), LinearFit(cost.decode.a * a / max(
        cost.prefill.a, 1e-12), d, e), cost.tile)
