"""KV defragmentation: compact used blocks towards the low block ids. Torch-free.

A paged pool never fails an allocation because free blocks are scattered, but scattered
used blocks cost on the device side: a request's KV spread over the whole tensor reads
worse than a compact one, and the pool cannot be shrunk. Fragmentation here is the
fraction of used blocks that lie outside the compact region `[0, num_used)`; past
`threshold` (default 30 %) the controller plans moves `src -> dst` of used blocks from
the top into free slots at the bottom. The worker copies the KV rows and remaps its
block tables with the same map; the controller remaps its own tables here.
"""

from __future__ import annotations

from kvcache.block_pool import BlockPool
from kvcache.manager import KVCacheManager


def fragmentation(pool: BlockPool) -> float:
    if pool.num_used == 0:
        return 0.0
    outside = sum(1 for b in pool.blocks[pool.num_used:] if b.ref_count > 0)
    return outside / pool.num_used


def plan_compaction(kv: KVCacheManager, max_moves: int) -> dict[int, int]:
    """Move up to `max_moves` used blocks from the top into free slots at the bottom
    and remap every request's table. Cached-free slots at the bottom are evicted (their
    content is only a cache). Returns the moves `src -> dst` for the worker."""
    pool = kv.pool
    boundary = pool.num_used
    sources = [b.block_id for b in reversed(pool.blocks[boundary:]) if b.ref_count > 0]
    targets = [b.block_id for b in pool.blocks[:boundary] if b.ref_count == 0]
    moves = dict(zip(sources[:max_moves], targets[:max_moves], strict=False))
    for src, dst in moves.items():
        pool.relocate(src, dst)
    if moves:
        for block_ids in kv.req_to_block_ids.values():
            block_ids[:] = [moves.get(b, b) for b in block_ids]
    return moves
