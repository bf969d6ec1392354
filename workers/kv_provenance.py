"""A check of the paged KV cache's contents, for debugging and the integration tests
(`worker.check_kv_provenance`).

The worker cannot tell a block written for other tokens from the right one: attention
reads whatever the block table points at, and a wrong block only shows as a changed
answer, sometimes. This keeps, per KV slot, a key of the tokens the slot was computed
from (a chained hash of every token up to and including its position) and which request
wrote it; before a step runs, every slot a span attends over must hold its own request's
key. A prefix hit on a block that was never written, or was overwritten since, a block
freed while still read, a defragmentation move the worker never made: each raises
`KVProvenanceError` naming the request, the position, the block and its writer.

Costs a pass over every scheduled request's context per step (Python): a check, not a
serving mode.
"""

from __future__ import annotations

from collections.abc import Sequence

from workers.step_state import RequestState

_Slot = tuple[int, str]  # (key of the tokens it was computed from, the writer's request id)


class KVProvenanceError(RuntimeError):
    """A step would attend over KV computed for other tokens."""


class KVProvenance:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._blocks: dict[int, list[_Slot | None]] = {}  # block id -> its slots
        self.num_checked = 0  # slots verified so far

    def move(self, moves: dict[int, int]) -> None:
        """Defragmentation: block src's slots go to dst, all moves at once (as the copy)."""
        moved = {dst: self._blocks.get(src) for src, dst in moves.items()}
        for dst, slots in moved.items():
            if slots is None:
                self._blocks.pop(dst, None)
            else:
                self._blocks[dst] = list(slots)

    def check_step(self, moves: dict[int, int],
                   scheduled: Sequence[tuple[str, RequestState, int, int]]) -> None:
        """A step's block moves (made before its forward), then each scheduled span
        (request id, its state, first position, tokens) checked and written in turn."""
        if moves:
            self.move(moves)
        for request_id, state, begin, num_tokens in scheduled:
            self.check_and_write(request_id, state.token_ids, state.block_ids.tolist(), begin,
                                 begin + num_tokens)

    def check_and_write(self, request_id: str, token_ids: Sequence[int],
                        block_ids: Sequence[int], begin: int, end: int) -> None:
        """A span computing positions begin..end-1 of `token_ids`: positions before `begin`
        must hold this request's KV; then the span's own positions are written."""
        size = self.block_size
        key, keys = 0, []
        for token in token_ids[:end]:
            key = hash((key, token))
            keys.append(key)
        for p in range(begin):
            slots = self._blocks.get(block_ids[p // size])
            held = slots[p % size] if slots is not None else None
            if held is None or held[0] != keys[p]:
                writer = "nothing" if held is None else f"KV of request {held[1]!r}"
                raise KVProvenanceError(
                    f"{request_id}: position {p} reads block {block_ids[p // size]}, which "
                    f"holds {writer}, not this request's")
        self.num_checked += begin
        for p in range(begin, end):
            slots = self._blocks.setdefault(block_ids[p // size], [None] * size)
            slots[p % size] = (keys[p], request_id)
