"""`Backoff`: the wait between retries of something that keeps failing. Ray- and torch-free.

Only the arithmetic: each caller keeps its own way of waiting (`asyncio.sleep` in the step
loop and the delta pump, `Condition.wait_for` in the journal's writer thread).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Backoff:
    """Waits of `first_s`, then twice the previous one, capped at `max_s`; `reset()` after
    a success starts again at `first_s`."""

    first_s: float
    max_s: float
    _next_s: float = field(init=False, repr=False)

    def __post_init__(self) -> None:
        # A zero wait would turn a retry loop into a busy loop.
        if self.first_s <= 0 or self.max_s <= 0:
            raise ValueError(f"backoff waits must be positive, got {self.first_s} "
                             f"and {self.max_s}")
        self._next_s = self.first_s

    def next_s(self) -> float:
        """The wait before the next try; the one after it doubles (up to `max_s`)."""
        wait_s = self._next_s
        self._next_s = min(2 * wait_s, self.max_s)
        return wait_s

    def reset(self) -> None:
        self._next_s = self.first_s
