"""The policies benchmark's workloads: the long-prompt scene and a Poisson/lognormal mix.

Everything is drawn from fixed seeds, so every policy (and every trial of the capacity
search) sees exactly the same requests. The capacity workload draws its inter-arrival gaps
once, at rate 1, and a trial at rate r divides them by r: trials at different rates then
differ only in the rate (common random numbers), which keeps pass/fail monotone in the rate
far more often than fresh draws per trial would, and the bisection needs that.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from benchmarks.virtual_time import Arrival, Hook, Trace


def random_prompt(rng: random.Random, length: int, vocab_size: int) -> list[int]:
    # Ids 0..2 are the presets' special tokens; prompts are plain "text" ids.
    return [rng.randrange(3, vocab_size) for _ in range(length)]


@dataclass(frozen=True)
class SceneSpec:
    """The long-prompt scene: users streaming; a long prompt lands once they all decode."""

    num_users: int
    user_prompt: int
    user_output: int
    long_prompt: int
    long_output: int
    decode_steps_before: int  # every user has decoded this many tokens when it lands
    seed: int = 4
    short_prompt: int = 32  # a short prompt lands `short_after_steps` steps after the long
    short_after_steps: int = 2


def scene_users(spec: SceneSpec, vocab_size: int, start_s: float) -> list[Arrival]:
    rng = random.Random(spec.seed)
    return [Arrival(start_s, f"user-{i}", random_prompt(rng, spec.user_prompt, vocab_size),
                    spec.user_output) for i in range(spec.num_users)]


def long_prompt_hook(spec: SceneSpec, vocab_size: int) -> Hook:
    """Adds the long request at the end of the step after which every user has sampled
    `decode_steps_before` tokens beyond its first (so all of them are mid-stream), and a
    short one `short_after_steps` steps later (while the long prompt is prefilled)."""
    prompt = random_prompt(random.Random(spec.seed + 1), spec.long_prompt, vocab_size)
    short = random_prompt(random.Random(spec.seed + 2), spec.short_prompt, vocab_size)
    long_at: int | None = None
    short_added = False

    def hook(trace: Trace, now: float) -> list[Arrival]:
        nonlocal long_at, short_added
        if long_at is not None:
            if short_added or len(trace.steps) - long_at < spec.short_after_steps:
                return []
            short_added = True
            return [Arrival(now, "short-0", short, spec.long_output)]
        users = [trace.requests[rid] for rid in trace.ids("user-")]
        if len(users) < spec.num_users or any(
                len(u.token_times) < spec.decode_steps_before + 1 for u in users):
            return []
        long_at = len(trace.steps)
        return [Arrival(now, "long-0", prompt, spec.long_output)]

    return hook


@dataclass(frozen=True)
class MixSpec:
    """Lognormal prompt and output lengths (median, sigma of the log), clipped to bounds."""

    num_requests: int
    prompt_median: int
    prompt_sigma: float
    prompt_bounds: tuple[int, int]
    output_median: int
    output_sigma: float
    output_bounds: tuple[int, int]
    seed: int = 11


@dataclass(frozen=True)
class MixRequest:
    gap_at_rate_1: float  # seconds after the previous arrival at 1 request/s
    prompt: list[int]
    max_tokens: int


def _lognormal(rng: random.Random, median: int, sigma: float, bounds: tuple[int, int]) -> int:
    value = round(rng.lognormvariate(math.log(median), sigma))
    return min(max(value, bounds[0]), bounds[1])


def mix_requests(spec: MixSpec, vocab_size: int) -> list[MixRequest]:
    rng = random.Random(spec.seed)
    out = []
    for _ in range(spec.num_requests):
        gap = rng.expovariate(1.0)
        prompt_len = _lognormal(rng, spec.prompt_median, spec.prompt_sigma, spec.prompt_bounds)
        output_len = _lognormal(rng, spec.output_median, spec.output_sigma, spec.output_bounds)
        out.append(MixRequest(gap, random_prompt(rng, prompt_len, vocab_size), output_len))
    return out


def poisson_arrivals(requests: list[MixRequest], rate: float, start_s: float,
                     tag: str) -> list[Arrival]:
    """The mix at `rate` requests/s; the first request arrives at `start_s`."""
    arrivals, now = [], start_s
    for i, req in enumerate(requests):
        if i:
            now += req.gap_at_rate_1 / rate
        arrivals.append(Arrival(now, f"{tag}-{i}", req.prompt, req.max_tokens))
    return arrivals
