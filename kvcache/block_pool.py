"""Fixed-size KV blocks: free list, reference counts, prefix hashes. Torch-free.

Every block is in exactly one of three sets (the integrity invariant):
- used:   ref_count > 0 (held by at least one running request);
- cached: ref_count == 0 but its content hash is registered, so a later request with
          the same prefix can take it back; evicted least-recently-freed first;
- free:   ref_count == 0 and no hash.
`num_free + num_used + num_cached == num_blocks` after every public call.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

# Parent hash of a request's first block. Any fixed value works; it only has to differ
# from every real block hash.
ROOT_HASH = b"tokenflow-root"


def hash_block(parent_hash: bytes, token_ids: Sequence[int]) -> bytes:
    """Chained content hash: a block's identity is its tokens *and* everything before it."""
    digest = hashlib.blake2b(parent_hash, digest_size=16)
    digest.update(b"".join(t.to_bytes(4, "little", signed=False) for t in token_ids))
    return digest.digest()


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None


@dataclass(frozen=True)
class PoolStats:
    num_blocks: int
    num_free: int
    num_used: int
    num_cached: int

    @property
    def usage(self) -> float:
        return self.num_used / self.num_blocks if self.num_blocks else 0.0


class BlockPool:
    """Owns block ids 0..num_blocks-1 of one worker's KV tensors."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free_ids: deque[int] = deque(range(num_blocks))
        # hash -> block id, ref_count == 0, oldest first (LRU eviction order).
        self._cached_free: OrderedDict[bytes, int] = OrderedDict()
        # hash -> block id for every hashed block, used or cached-free.
        self._hash_to_block_id: dict[bytes, int] = {}
        self.num_used = 0

    # -- queries ---------------------------------------------------------------
    @property
    def num_available(self) -> int:
        """Blocks an allocation can take now: plain free plus evictable cached ones."""
        return len(self._free_ids) + len(self._cached_free)

    @property
    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def stats(self) -> PoolStats:
        return PoolStats(self.num_blocks, len(self._free_ids), self.num_used,
                         len(self._cached_free))

    def lookup(self, block_hash: bytes) -> int | None:
        return self._hash_to_block_id.get(block_hash)

    # -- allocation --------------------------------------------------------------
    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_available

    def allocate(self, num_blocks: int) -> list[int] | None:
        """Take `num_blocks` blocks (ref_count 1), or None when there are not enough."""
        if not self.can_allocate(num_blocks):
            return None
        block_ids = []
        for _ in range(num_blocks):
            if self._free_ids:
                block_id = self._free_ids.popleft()
            else:  # evict the least recently freed cached block
                block_hash, block_id = self._cached_free.popitem(last=False)
                del self._hash_to_block_id[block_hash]
                self.blocks[block_id].block_hash = None
            self.blocks[block_id].ref_count = 1
            block_ids.append(block_id)
        self.num_used += num_blocks
        return block_ids

    def touch(self, block_ids: Sequence[int]) -> None:
        """Take a reference on already-filled blocks (prefix-cache hit)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                assert block.block_hash is not None, "only cached blocks can be revived"
                del self._cached_free[block.block_hash]
                self.num_used += 1
            block.ref_count += 1

    def free(self, block_ids: Sequence[int]) -> int:
        """Drop one reference on each block; returns how many became unused.

        Freed in reverse so that a request's tail blocks (least likely shared) are
        evicted before its head blocks.
        """
        num_released = 0
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"double free of block {block_id}"
            block.ref_count -= 1
            if block.ref_count > 0:
                continue
            num_released += 1
            self.num_used -= 1
            if block.block_hash is not None:
                self._cached_free[block.block_hash] = block_id
            else:
                self._free_ids.append(block_id)
        return num_released

    def cache_block(self, block_id: int, block_hash: bytes) -> None:
        """Register a full, used block's content hash so later requests can share it."""
        if not self.enable_prefix_caching:
            return
        block = self.blocks[block_id]
        assert block.ref_count > 0
        if block.block_hash is not None or block_hash in self._hash_to_block_id:
            return  # already cached, or an identical block exists: keep the first one
        block.block_hash = block_hash
        self._hash_to_block_id[block_hash] = block_id

    def relocate(self, src: int, dst: int) -> None:
        """Move a used block's identity (refs, hash) to a unused slot; defragmentation.
        A cached-free `dst` loses its cached content, a free one leaves the free list."""
        source, target = self.blocks[src], self.blocks[dst]
        assert source.ref_count > 0 and target.ref_count == 0
        if target.block_hash is not None:  # evict the cached content living in dst
            del self._cached_free[target.block_hash]
            del self._hash_to_block_id[target.block_hash]
            target.block_hash = None
        else:
            self._free_ids.remove(dst)
        target.ref_count, source.ref_count = source.ref_count, 0
        target.block_hash, source.block_hash = source.block_hash, None
        if target.block_hash is not None:
            self._hash_to_block_id[target.block_hash] = dst
        self._free_ids.append(src)

    def reset_prefix_cache(self) -> int:
        """Forget every content hash: the KV behind them is gone (the worker restarted).

        Cached-free blocks go back to the free list; a used block keeps its references but
        not its hash, so no later request can share it. Returns how many hashes were dropped.
        """
        num_dropped = len(self._hash_to_block_id)
        for block_id in self._cached_free.values():
            self.blocks[block_id].block_hash = None
            self._free_ids.append(block_id)
        self._cached_free.clear()
        for block_id in self._hash_to_block_id.values():
            self.blocks[block_id].block_hash = None
        self._hash_to_block_id.clear()
        return num_dropped

    # -- invariants --------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise AssertionError when the three sets do not partition the pool."""
        free_ids = set(self._free_ids)
        cached_ids = set(self._cached_free.values())
        used_ids = {b.block_id for b in self.blocks if b.ref_count > 0}
        assert len(free_ids) == len(self._free_ids), "duplicate id on the free list"
        assert not (free_ids & cached_ids) and not (free_ids & used_ids)
        assert not (cached_ids & used_ids)
        assert len(used_ids) == self.num_used, (len(used_ids), self.num_used)
        total = len(free_ids) + len(cached_ids) + len(used_ids)
        assert total == self.num_blocks, f"{total} blocks accounted for, {self.num_blocks} exist"
        for block_hash, block_id in self._hash_to_block_id.items():
            assert self.blocks[block_id].block_hash == block_hash
        for block_id in free_ids:
            assert self.blocks[block_id].block_hash is None
