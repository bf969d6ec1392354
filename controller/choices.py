"""Several choices of one request (`n`, `best_of`): one engine request per choice.

Each choice is its own sampling stream: choice 0 keeps the request's seed, choice i > 0
samples with `choice_seed(seed, i)`, so a seeded request gives the same choices every time.
The choices share the prompt's KV blocks instead of recomputing them: choice i > 0 names
choice 0 in `SamplingParams.prompt_shared_with`, is routed to its worker, and is admitted
only once choice 0 has sampled (its prompt's full blocks are then in the prefix cache), so
its admission takes them from the cache: the prompt is computed, and its full blocks
allocated, once. Only the prompt's last, partial block is recomputed per choice (a choice
writes its own tokens into it). Without prefix caching each choice computes its prompt.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import TYPE_CHECKING

from controller.messages import SamplingParams

if TYPE_CHECKING:
    from controller.request import Request


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice `index` (0 keeps the request's own), 63-bit and stable."""
    if index == 0:
        return seed
    digest = hashlib.blake2b(f"choice:{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def choice_request_id(request_id: str, index: int) -> str:
    return request_id if index == 0 else f"{request_id}-{index}"


def waits_for_shared_prompt(request: Request, requests: dict[str, Request]) -> bool:
    """The choice whose prompt this one shares is queued or still computing its prompt."""
    owner_id = request.sampling_params.prompt_shared_with
    owner = requests.get(owner_id) if owner_id is not None else None
    return owner is not None and not owner.is_finished and owner.num_output_tokens == 0


def choice_params(params: SamplingParams, request_id: str, index: int) -> SamplingParams:
    """Choice `index`'s parameters: its own seed (when the request has one) and, past
    choice 0, the prompt shared with choice 0."""
    if index == 0:
        return params
    seed = None if params.seed is None else choice_seed(params.seed, index)
    return dataclasses.replace(params, seed=seed, prompt_shared_with=request_id)
