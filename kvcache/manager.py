"""Per-request block tables on top of one BlockPool. Torch-free.

`allocate_slots` returns None when the pool cannot hold the step's tokens: the caller
(the scheduler) decides whom to preempt. Nothing here raises on a full pool.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvcache.block_pool import ROOT_HASH, BlockPool, hash_block


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, pool: BlockPool):
        self.pool = pool
        self.block_size = pool.block_size
        self.req_to_block_ids: dict[str, list[int]] = {}
        # Chained hashes of the request's full blocks registered so far (prefix caching).
        self.req_to_block_hashes: dict[str, list[bytes]] = {}
        self.num_prefix_queries = 0  # tokens looked up
        self.num_prefix_hits = 0  # tokens found

    def get_computed_blocks(self, token_ids: Sequence[int], count: bool = True) -> list[int]:
        """Longest run of cached full blocks that prefix `token_ids`.

        The last token is never served from cache: its logits must be computed to sample,
        so at most `(len - 1) // block_size` blocks can hit. `count=False` for a peek
        (routing) that must not show up in the hit-rate statistics.
        """
        if not self.pool.enable_prefix_caching:
            return []
        num_full = (len(token_ids) - 1) // self.block_size
        parent, block_ids = ROOT_HASH, []
        for i in range(num_full):
            parent = hash_block(parent, token_ids[i * self.block_size:(i + 1) * self.block_size])
            block_id = self.pool.lookup(parent)
            if block_id is None:
                break
            block_ids.append(block_id)
        if count:
            self.num_prefix_queries += len(token_ids)
            self.num_prefix_hits += len(block_ids) * self.block_size
        return block_ids

    def num_blocks_needed(self, request_id: str, num_tokens: int) -> int:
        return max(0, cdiv(num_tokens, self.block_size)
                   - len(self.req_to_block_ids.get(request_id, ())))

    def allocate_slots(self, request_id: str, num_tokens: int,
                       computed_block_ids: Sequence[int] = ()) -> list[int] | None:
        """Grow the request's table to hold `num_tokens` tokens in total.

        `computed_block_ids` (prefix hits, only for a request with no table yet) are
        shared, not allocated. Returns the block ids appended to the table, or None,
        in which case nothing changed.
        """
        held = self.req_to_block_ids.get(request_id, [])
        assert not computed_block_ids or not held
        num_new = cdiv(num_tokens, self.block_size) - len(held) - len(computed_block_ids)
        if num_new <= 0 and not computed_block_ids:
            return []  # the common decode: its last block still has room

        num_revived = sum(1 for b in computed_block_ids if self.pool.blocks[b].ref_count == 0)
        if max(num_new, 0) > self.pool.num_available - num_revived:
            return None
        self.pool.touch(computed_block_ids)
        fresh = self.pool.allocate(max(num_new, 0))
        assert fresh is not None
        appended = list(computed_block_ids) + fresh
        self.req_to_block_ids.setdefault(request_id, []).extend(appended)
        if computed_block_ids:
            self._rehash(request_id, len(computed_block_ids))
        return appended

    def _rehash(self, request_id: str, num_blocks: int) -> None:
        # Hits are exactly the registered blocks: copy their hashes into the request.
        hashes = [self.pool.blocks[b].block_hash for b in
                  self.req_to_block_ids[request_id][:num_blocks]]
        assert all(h is not None for h in hashes)
        self.req_to_block_hashes[request_id] = hashes  # type: ignore[assignment]

    def has_new_full_block(self, request_id: str, num_computed_tokens: int) -> bool:
        """Whether `cache_full_blocks` would register anything: callers skip building the
        token list (prompt + output, every step of every request) when it would not."""
        if not self.pool.enable_prefix_caching:
            return False
        num_full = min(num_computed_tokens // self.block_size,
                       len(self.req_to_block_ids.get(request_id, ())))
        return num_full > len(self.req_to_block_hashes.get(request_id, ()))

    def cache_full_blocks(self, request_id: str, token_ids: Sequence[int],
                          num_computed_tokens: int) -> None:
        """Register the hashes of blocks whose tokens are all computed now."""
        if not self.pool.enable_prefix_caching:
            return
        hashes = self.req_to_block_hashes.setdefault(request_id, [])
        block_ids = self.req_to_block_ids.get(request_id, [])
        num_full = min(num_computed_tokens // self.block_size, len(block_ids))
        parent = hashes[-1] if hashes else ROOT_HASH
        for i in range(len(hashes), num_full):
            parent = hash_block(parent, token_ids[i * self.block_size:(i + 1) * self.block_size])
            hashes.append(parent)
            self.pool.cache_block(block_ids[i], parent)

    def free(self, request_id: str) -> int:
        """Release the request's blocks; returns the number of block references dropped."""
        block_ids = self.req_to_block_ids.pop(request_id, [])
        self.req_to_block_hashes.pop(request_id, None)
        self.pool.free(block_ids)
        return len(block_ids)

    def block_ids(self, request_id: str) -> list[int]:
        return self.req_to_block_ids.get(request_id, [])
