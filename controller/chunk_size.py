"""How large a chunk one step takes, by the step cost model: the largest under a time limit
and the smallest that prefills efficiently at its depth (the scheduler's time cap).
Torch-free."""

from __future__ import annotations

from dataclasses import dataclass

from controller.budget import StepCost


@dataclass(frozen=True)
class StepSpan:
    """A step being planned: what it already carries (`chunks`, the decodes) and the depth
    (`context`) of the chunk to size, on a grid of `unit` tokens."""

    cost: StepCost
    chunks: list[tuple[int, int]]  # (tokens, context) of the chunks already in the step
    num_decodes: int
    decode_context: int
    context: int
    unit: int

    def seconds(self, tokens: int) -> float:
        """The step's predicted time with a chunk of `tokens` at `context`."""
        return self.cost.step_s([*self.chunks, (tokens, self.context)], self.num_decodes,
                                self.decode_context)

    def largest_under(self, most: int, limit_s: float) -> int:
        """The largest grid chunk (<= most) whose step is predicted under `limit_s`; 0 when
        none is."""
        lo, hi = 0, most // self.unit + 1  # invariant: lo units fit (0 trivially), hi do not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.seconds(mid * self.unit) <= limit_s else (lo, mid)
        return lo * self.unit

    def best_rate(self, sizes_max: int) -> float:
        """The best prefill-only rate (tokens/s) of a grid chunk (<= sizes_max) at this
        depth: past it, attention within the chunk costs more than the fixed cost saved."""
        return max(t / self.cost.chunk_s(t, self.context) for t in self._sizes(sizes_max))

    def smallest_efficient(self, most: int, sizes_max: int, goal_rate: float) -> int:
        """The smallest grid chunk (<= most) whose tokens per second of this step reach
        `goal_rate`; `most` when none does."""
        for tokens in self._sizes(min(most, sizes_max)):
            if tokens / self.seconds(tokens) >= goal_rate:
                return tokens
        return most

    def _sizes(self, sizes_max: int) -> range:
        return range(self.unit, max(sizes_max // self.unit, 1) * self.unit + 1, self.unit)


class DepthStretch:
    """Deep in a prompt each token costs more (attention over the context) while the step's
    fixed costs stay, so the SLO's chunk may be mostly fixed cost: the chunk then grows to
    the smallest one reaching `chunk_efficiency` of the best rate at its depth (the derived
    SLO's rule, applied at the chunk's depth), within a stretched time limit."""

    def __init__(self, chunk_efficiency: float) -> None:
        self.chunk_efficiency = chunk_efficiency
        self._best: dict[tuple[int, int], float] = {}  # (id(cost), depth / unit) -> tok/s

    def efficient(self, step: StepSpan, most: int, limit_s: float, sizes_max: int) -> int:
        """The smallest efficient grid chunk (<= most) at the step's depth, or the largest
        under `limit_s` when that one is smaller."""
        key = (id(step.cost), step.context // step.unit)
        if key not in self._best:
            if len(self._best) > 4096:  # bounded: the depths of a few prompts
                self._best.clear()
            self._best[key] = step.best_rate(sizes_max)
        goal = self.chunk_efficiency * self._best[key]
        return min(step.smallest_efficient(most, sizes_max, goal),
                   step.largest_under(most, limit_s))
