"""Stop strings: cut streamed or complete text before the first stop string, OpenAI-style."""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    """Applies stop strings to streamed text deltas.

    `feed(delta)` returns the text that is safe to emit and whether a stop string was hit.
    Text that could be the start of a stop string is held back until the next delta proves
    otherwise, so no client ever sees part of a stop string. On a hit the output ends right
    before the stop string (OpenAI excludes it). When several stop strings occur, the one that
    completes first in generation order wins, as it would if tokens arrived one by one. At the
    end of a generation that did not stop on a string, call `flush()` for the held text.
    """

    def __init__(self, stop: Sequence[str]) -> None:
        # An empty stop string would match at once; validation rejects it, so drop it here.
        self._stops: tuple[str, ...] = tuple(s for s in stop if s)
        self._held = ""
        self._stopped = False
        self.matched: str | None = None

    @property
    def stopped(self) -> bool:
        return self._stopped

    @property
    def held(self) -> str:
        """Text received but not yet released (a possible stop-string prefix)."""
        return self._held

    def feed(self, delta: str) -> tuple[str, bool]:
        if self._stopped:
            return "", True
        text = self._held + delta
        if not self._stops:
            return text, False
        hit: tuple[int, int, str] | None = None  # (end, start, stop string)
        for s in self._stops:
            start = text.find(s)
            if start >= 0:
                candidate = (start + len(s), start, s)
                if hit is None or candidate < hit:
                    hit = candidate
        if hit is not None:
            _, start, s = hit
            self._stopped = True
            self.matched = s
            self._held = ""
            return text[:start], True
        keep = self._longest_partial_suffix(text)
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep], False

    def flush(self) -> str:
        """Release held text once generation has ended without a stop string."""
        out, self._held = ("" if self._stopped else self._held), ""
        return out

    def _longest_partial_suffix(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        best = 0
        for s in self._stops:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best


def apply_stop_strings(text: str, stop: Sequence[str]) -> tuple[str, bool]:
    """One-shot form for a complete text: (text cut before the first stop string, stopped)."""
    matcher = StopStringMatcher(stop)
    out, stopped = matcher.feed(text)
    return out + matcher.flush(), stopped
