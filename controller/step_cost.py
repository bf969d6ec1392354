"""The step cost model the scheduler plans with and the protections price chunks by.

    t(tokens, context) = a + b * tokens + c * pairs,  pairs = tokens * (context + (tokens+1)/2)

for a prefill chunk, and its own (a, b, c) over (batch, batch * (context + 1)) for decodes;
fitted on calibration runs (controller/budget.py). Torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class LinearFit:
    """One kind of step's time: t = a + b * tokens + c * pairs."""

    a: float  # seconds per step (launches, weight reads, Python)
    b: float  # seconds per token
    c: float  # seconds per (query, key) pair

    def __call__(self, tokens: float, pairs: float) -> float:
        return self.a + self.b * tokens + self.c * pairs


@dataclass(frozen=True)
class StepCost:
    """The cost model: predicted seconds of a whole step, its prefill chunks (tokens,
    context) and its decodes, with two fits. A step with a chunk pays the prefill model's
    fixed cost once, each chunk its tokens and pairs, each decode the decode model's
    marginal cost (decode rows are padded to the step's longest decode context). What the
    scheduler sizes chunks with (a budget table's), the protections charge chunks by and
    the step deadline is drawn from (a table's, else `per_token`)."""

    prefill: LinearFit
    decode: LinearFit
    tile: int = 1

    @classmethod
    def per_token(cls, seconds_per_token: float) -> StepCost:
        """The uncalibrated model: every token costs the same, nothing else costs."""
        fit = LinearFit(0.0, seconds_per_token, 0.0)
        return cls(fit, fit)

    def chunk_s(self, tokens: int, context: int) -> float:
        """A step that prefills one chunk alone."""
        return self.step_s([(tokens, context)], 0, 0)

    def marginal_s(self, tokens: int, context: int) -> float:
        """What one chunk adds to a step that already runs."""
        t = pad(tokens, self.tile)
        return self.prefill.b * t + self.prefill.c * chunk_pairs(t, context)

    def decode_marginal_s(self, num_decodes: int, decode_context: int) -> float:
        dec = self.decode
        return dec.b * num_decodes + dec.c * num_decodes * (decode_context + 1.0)

    def step_s(self, chunks: Sequence[tuple[int, int]], num_decodes: int,
               decode_context: int) -> float:
        if not chunks:
            return self.decode(num_decodes, num_decodes * (decode_context + 1.0))
        return (self.prefill.a + sum(self.marginal_s(t, c) for t, c in chunks)
                + self.decode_marginal_s(num_decodes, decode_context))

    def scaled(self, factor: float) -> StepCost:
        """Every coefficient times `factor` (a device that got uniformly slower)."""
        return replace(self, prefill=LinearFit(*(factor * v for v in (
            self.prefill.a, self.prefill.b, self.prefill.c))), decode=LinearFit(*(
                factor * v for v in (self.decode.a, self.decode.b, self.decode.c))))


def pad(tokens: int, tile: int) -> int:
    return -(-tokens // tile) * tile


def chunk_pairs(tokens: int, context: int) -> float:
    """(query, key) pairs of a chunk: its query i sees `context + i + 1` keys."""
    return tokens * (context + (tokens + 1) / 2)
