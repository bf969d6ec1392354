"""The online refit's choice between least squares and scaling (controller/refit.py): the
steps of one long prompt, chunks of nearly one size going deeper, cannot tell the fixed
cost from the per-token one; a window of spread sizes can. Torch-free, no Ray."""

from __future__ import annotations

import itertools
import random

from controller.budget import LinearFit, StepCost
from controller.protections import ProtectionConfig
from controller.refit import OnlineRefit
from controller.scheduler_config import StepShape
from controller.slo import SloConfig

# The calibrated model, and a device whose served steps carry a larger fixed cost and a
# smaller per-token one (the shape of the refit traced in docs/peer.md).
CALIBRATED = StepCost(LinearFit(5e-3, 2.34e-4, 9.4e-8), LinearFit(4e-3, 1e-3, 5e-8), tile=16)
SERVED = StepCost(LinearFit(34e-3, 1.68e-4, 9.4e-8), LinearFit(4e-3, 1e-3, 5e-8), tile=16)
# A device where every coefficient moved, each by its own factor.
SKEWED = StepCost(LinearFit(20e-3, 4e-4, 1.2e-7), LinearFit(4e-3, 2e-3, 1e-7), tile=16)
Step = tuple[int, int, int, int]  # chunk tokens, chunk context, decodes, decode context


def _refit(steps: list[Step], truth: StepCost, min_spread: float = 2.0,
           noise: list[float] | None = None, gain: float = 0.8) -> StepCost | None:
    """Feeds `steps`, timed by `truth` (times `noise`), to a refit whose window is all of
    them; the model it returns, if any."""
    config = ProtectionConfig(refit_window=len(steps), refit_min_token_spread=min_spread,
                              refit_least_squares_gain=gain)
    refit = OnlineRefit(config, SloConfig())
    factors = itertools.cycle(noise or [1.0])
    out = None
    for i, (tokens, context, num_decodes, decode_context) in enumerate(steps):
        shape = StepShape(i, {"long": (tokens, context)}, num_decodes, decode_context)
        elapsed = next(factors) * truth.step_s([(tokens, context)], num_decodes,
                                               decode_context)
        out = refit.observe(shape, elapsed, CALIBRATED) or out
    return out


def _is_scaled(model: StepCost) -> bool:
    """`model` is CALIBRATED times one factor."""
    mine = [f.a for f in (model.prefill, model.decode)] + [
        v for f in (model.prefill, model.decode) for v in (f.b, f.c)]
    base = [f.a for f in (CALIBRATED.prefill, CALIBRATED.decode)] + [
        v for f in (CALIBRATED.prefill, CALIBRATED.decode) for v in (f.b, f.c)]
    factor = mine[0] / base[0]
    return all(abs(m - factor * b) <= 1e-9 * max(abs(b), 1e-12) + 1e-15
               for m, b in zip(mine, base, strict=True))


def one_prompt() -> list[Step]:
    """16 chunk steps of one prompt beside 8 decoding users: 160 tokens shrinking to 112
    as it goes deeper, the users one token deeper each step."""
    steps, context = [], 0
    for i in range(16):
        tokens = 160 - 16 * (i // 5)
        steps.append((tokens, context, 8, 300 + i))
        context += tokens
    return steps


def spread() -> list[Step]:
    """Chunks of 32-512 tokens at several depths beside 2-16 decodes."""
    return [(t, c, d, 100 * d) for (t, c), d in zip(
        itertools.product((32, 64, 128, 256, 512), (0, 1000, 3000)),
        itertools.cycle((2, 8, 16)), strict=False)]


def test_one_prompts_chunks_refit_by_scaling_not_least_squares():
    """The window's chunk sizes span 1.4x: least squares would fit it exactly (the truth is
    linear), and trade the fixed cost against the per-token one; the guard scales the
    calibrated model instead, so the chunks planned next keep its proportions."""
    steps = one_prompt()
    model = _refit(steps, SERVED)
    assert model is not None and _is_scaled(model)
    # No spread asked, the decodes made to vary a little: least squares wins on the window.
    steps[0] = (*steps[0][:2], 7, steps[0][3])
    free = _refit(steps, SERVED, min_spread=1.0)
    assert free is not None and not _is_scaled(free)


def test_spread_chunks_refit_by_least_squares_that_extrapolates():
    """Chunks of 32-512 tokens at several depths tell the coefficients apart: least squares
    wins on held-out sizes and predicts a chunk larger than any it saw."""
    model = _refit(spread(), SKEWED)
    assert model is not None and not _is_scaled(model)
    for unseen in (([(1024, 4000)], 8, 800), ([(16, 6000)], 24, 2000)):
        assert abs(model.step_s(*unseen) / SKEWED.step_s(*unseen) - 1.0) < 0.05


def test_a_uniformly_slower_device_with_noise_is_scaled():
    """Every step 1.5x the calibrated time with +-10 % noise, spread sizes, 60 windows of
    different noise: least squares fits the noise, and held out by size it beats scaling
    in some windows by chance; asking it to beat scaling clearly
    (`refit_least_squares_gain`) leaves fewer of those."""
    def num_scaled(gain: float) -> int:
        count = 0
        for seed in range(60):
            rng = random.Random(seed)
            noise = [1.5 * rng.uniform(0.9, 1.1) for _ in spread()]
            model = _refit(spread(), CALIBRATED, noise=noise, gain=gain)
            assert model is not None
            count += _is_scaled(model)
        return count

    strict, loose = num_scaled(0.8), num_scaled(1.0)
    assert strict >= 56 and strict > loose
