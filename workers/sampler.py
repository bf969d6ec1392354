"""Per-row token sampling: greedy, temperature, top-k, top-p, per-request seeds.

Determinism: a seeded request draws its k-th output token from a generator seeded with
`derive_seed(seed, k)`. The draw therefore depends only on (seed, k, logits), not on batch
composition or on earlier draws, so a request recomputed after preemption samples the same
tokens. Unseeded rows share one worker-level generator.

On CUDA the worker samples where the logits are (`Sampler.on_device`): greedy rows take the
argmax; random rows race exponential noise against the filtered probabilities (the argmax of
`probs / E`, E ~ Exp(1), is a draw from `probs`), the noise a counter-based hash of (seed, k,
token id), so a seeded draw again depends only on (seed, k, logits), on any device. Its draws
are not the CPU path's (a different random stream); the only device-to-host copy is the
sampled ids. No host sync inside a step: the random rows' parameters (`DeviceSampling`, built
on the host, seeds derived there) travel in the step's one pinned metadata upload, and
`sample_on_device` reads them from there.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
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


_GOLDEN = -0x61C8864680B583EB  # 0x9E3779B97F4A7C15 as a signed int64
_MIX1 = -0x40A7B892E31B1A47  # 0xBF58476D1CE4E5B9
_MIX2 = -0x6B2FB644ECCEEE15  # 0x94D049BB133111EB


def _shr(x: Tensor, bits: int) -> Tensor:
    """Logical right shift of int64 (torch's `>>` is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def hash_uniform(seeds: Tensor, num_columns: int) -> Tensor:
    """seeds [R] int64 -> [R, num_columns] float32 uniform in (0, 1): SplitMix64 of
    (seed, column), computed on `seeds`' device with wrapping int64 arithmetic."""
    cols = torch.arange(num_columns, dtype=torch.int64, device=seeds.device)
    x = seeds[:, None] + (cols[None, :] + 1) * _GOLDEN
    x = (x ^ _shr(x, 30)) * _MIX1
    x = (x ^ _shr(x, 27)) * _MIX2
    x = x ^ _shr(x, 31)
    return (_shr(x, 41).float() + 0.5) * (1.0 / (1 << 23))  # 23 bits: exact, never 0 or 1


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator(device="cpu").manual_seed(seed)

    def __call__(self, logits: Tensor, rows: list[SamplingRow]) -> list[int]:
        """logits [S, V] fp32 (any device) -> one token id per row."""
        assert logits.shape[0] == len(rows)
        # Sampling is a few vectors per step: do it on CPU, where generators are portable.
        logits = logits.detach().float().cpu()
        # max's indices are argmax's (the first maximum; NaN wins as in argmax), and on a CPU
        # it ran ~3x faster: argmax took 1.3 ms of a 24 ms 32-row decode step here.
        tokens = logits.max(dim=-1).indices.tolist()
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

    def on_device(self, logits: Tensor, rows: list[SamplingRow]) -> list[int]:
        """logits [S, V] fp32 -> one token id per row, sampled on the logits' device."""
        return self.ids_on_device(logits, rows).tolist()  # the step's one device-to-host copy

    def ids_on_device(self, logits: Tensor, rows: list[SamplingRow]) -> Tensor:
        """logits [S, V] fp32 -> [S] int64 token ids on the logits' device, not synchronised
        (the caller copies them to the host when it needs them). The parameters are copied
        here; the worker sends them with the step's metadata instead (`sample_on_device`)."""
        assert logits.shape[0] == len(rows)
        plan = self.device_sampling(rows)
        uploaded = () if plan is None else tuple(
            torch.from_numpy(a).to(logits.device) for a in plan.arrays)
        return self.sample_on_device(logits, plan, uploaded)

    def device_sampling(self, rows: list[SamplingRow]) -> DeviceSampling | None:
        """The host side of a step's random rows (None when all are greedy): their indices,
        temperatures, top-k, top-p and seeds (a seeded row's from (seed, k); an unseeded
        row's drawn from the worker's generator) as int64 arrays."""
        random_rows = [i for i, row in enumerate(rows) if not row.params.is_greedy]
        if not random_rows:
            return None
        params = [rows[i].params for i in random_rows]
        seeds = [
            derive_seed(p.seed, rows[i].num_output_tokens) if p.seed is not None
            else int(torch.randint(1 << 62, (1,), generator=self.generator))
            for i, p in zip(random_rows, params, strict=True)
        ]
        arrays = (
            np.asarray(random_rows, np.int64),
            np.asarray([p.temperature for p in params], np.float64).view(np.int64),
            np.asarray([p.top_k for p in params], np.int64),
            np.asarray([p.top_p for p in params], np.float64).view(np.int64),
            np.asarray(seeds, np.int64),
        )
        return DeviceSampling(arrays, any(p.top_k > 0 for p in params),
                              any(p.top_p < 1.0 for p in params))

    def sample_on_device(self, logits: Tensor, plan: DeviceSampling | None,
                         uploaded: tuple[Tensor, ...]) -> Tensor:
        """logits [S, V] fp32 -> [S] int64 ids on the device; `uploaded`: `plan.arrays` on
        the device, in order. Nothing here reads the device from the host."""
        tokens = logits.argmax(dim=-1)
        if plan is None:
            return tokens
        index, temp_bits, top_k, top_p_bits, seeds = uploaded
        sub = logits.index_select(0, index).float() / temp_bits.view(torch.float64).float()[
            :, None]
        if plan.has_top_k:
            sub = apply_top_k(sub, top_k)
        if plan.has_top_p:
            sub = apply_top_p(sub, top_p_bits.view(torch.float64).float())
        probs = sub.softmax(dim=-1)
        noise = -torch.log(hash_uniform(seeds, sub.shape[1]))
        return tokens.scatter_(0, index, (probs / noise).argmax(dim=-1))


@dataclass(frozen=True)
class DeviceSampling:
    """`arrays`: (row indices, temperatures as float64 bits, top-k, top-p as float64 bits,
    seeds), int64 each, one entry per random row; which filters any row uses."""

    arrays: tuple[np.ndarray, ...]
    has_top_k: bool
    has_top_p: bool
