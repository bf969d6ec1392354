"""Log-probabilities as they travel from the worker to the edge (torch-free).

The worker scores with the raw model's distribution: `log_softmax` of the logits before
temperature, top-k or top-p (as vLLM returns by default), so a request's log-probabilities
do not depend on how it samples. `TokenLogprob` is one position: the token there, its
log-probability, and the `num_top` most likely tokens with theirs.

Prompt log-probabilities (completions' `echo`) are computed in the prefill chunks the
scheduler runs anyway; a request that asks for them is not served from the prefix cache
until it has them all (`Request.needs_prompt_recompute`): they are recomputed, not stored.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from controller.messages import TokenLogprob

__all__ = ["PromptLogprobs", "TokenLogprob"]


@dataclass(slots=True)
class PromptLogprobs:
    """A request's prompt log-probabilities gathered chunk by chunk until its first output
    carries them. Position p's entry scores prompt token p given tokens 0..p-1; position 0
    has none, so a prompt of n tokens has n - 1 entries."""

    num_received: int = 0  # entries received, positions 1..num_received
    pending: list[TokenLogprob] = field(default_factory=list)  # not delivered yet

    def add(self, start: int, entries: list[TokenLogprob]) -> None:
        """Entries for positions start, start + 1, ...; positions already received (a
        chunk recomputed after a preemption) are dropped."""
        skip = self.num_received + 1 - start
        if skip < 0:
            raise ValueError(f"prompt log-probabilities from position {start}, expected "
                             f"{self.num_received + 1}")
        fresh = entries[skip:]
        self.pending.extend(fresh)
        self.num_received += len(fresh)

    def take(self) -> list[TokenLogprob]:
        taken, self.pending = self.pending, []
        return taken

