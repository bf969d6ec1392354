"""Per-row token sampling: greedy, temperature, top-k, top-p, per-request seeds.

Determinism: a seeded request draws its k-th output token from a generator seeded with
`derive_seed(seed, k)`. The draw therefore depends only on (seed, k, logits), not on batch
composition or on earlier draws, so a request recomputed after preemption samples the same
tokens. Unseeded rows share one worker-level generator.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from torch import Tensor

from controller.messages import SamplingParams


@dataclass(frozen=True)
class SamplingRow:
    params: SamplingParams
    num_output_tokens: int  # tokens already generated; the index of the token drawn now


def derive_seed(seed: int, num_output_tokens: int) -> int:
    """Stable across processes and machines (unlike `hash()` of str), 63-bit."""
    digest = hashlib.blake2b(f"{seed}:{num_output_tokens}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def apply_top_k(logits: Tensor, top_k: Tensor) -> Tensor:
    """logits [S, V], top_k [S] int (<= 0 disables) -> logits with the rest set to -inf.

    Ties at the k-th value are all kept (the filter is by value, not by rank).
    """
    vocab_size = logits.shape[-1]
    k = torch.where(top_k <= 0, vocab_size, top_k.clamp(max=vocab_size))
    sorted_desc = logits.sort(dim=-1, descending=True).values
    kth_value = sorted_desc.gather(-1, (k - 1)[:, None])  # [S, 1]
    return logits.masked_fill(logits < kth_value, float("-inf"))


def apply_top_p(logits: Tensor, top_p: Tensor) -> Tensor:
    """logits [S, V], top_p [S] in (0, 1] -> keep the smallest set of top tokens whose
    probability mass reaches top_p (always at least the most likely token)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # mass of strictly better tokens
    remove_sorted = mass_before >= top_p[:, None]
    remove_sorted[:, 0] = False
    remove = torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted)
    return logits.masked_fill(remove, float("-inf"))


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator(device="cpu").manual_seed(seed)

    def __call__(self, logits: Tensor, rows: list[SamplingRow]) -> list[int]:
        """logits [S, V] fp32 (any device) -> one token id per row."""
        assert logits.shape[0] == len(rows)
        # Sampling is a few vectors per step: do it on CPU, where generators are portable.
        logits = logits.detach().float().cpu()
        tokens = logits.argmax(dim=-1).tolist()
        random_rows = [i for i, row in enumerate(rows) if not row.params.is_greedy]
        if not random_rows:
            return tokens
        params = [rows[i].params for i in random_rows]
        sub = logits[random_rows] / torch.tensor([p.temperature for p in params])[:, None]
        if any(p.top_k > 0 for p in params):
            sub = apply_top_k(sub, torch.tensor([p.top_k for p in params]))
        if any(p.top_p < 1.0 for p in params):
            sub = apply_top_p(sub, torch.tensor([p.top_p for p in params]))
        probs = sub.softmax(dim=-1)
        for j, i in enumerate(random_rows):
            seed = rows[i].params.seed
            generator = self.generator
            if seed is not None:
                generator = torch.Generator(device="cpu")
                generator.manual_seed(derive_seed(seed, rows[i].num_output_tokens))
            tokens[i] = int(torch.multinomial(probs[j], 1, generator=generator).item())
        return tokens
