from kvcache.block_pool import BlockPool
from kvcache.manager import KVCacheManager


def test_allocate_free_and_integrity():
    pool = BlockPool(num_blocks=4, block_size=2)
    ids = pool.allocate(3)
    assert ids is not None and len(ids) == 3
    assert pool.allocate(2) is None  # a full pool is a return value, not an exception
    assert pool.stats().num_free == 1
    pool.free(ids)
    pool.check_integrity()
    assert pool.num_available == 4


def test_prefix_cache_hit_reuses_blocks_and_recomputes_last_token():
    pool = BlockPool(num_blocks=8, block_size=4, enable_prefix_caching=True)
    kv = KVCacheManager(pool)
    prompt = list(range(12))
    assert kv.allocate_slots("a", len(prompt)) is not None
    kv.cache_full_blocks("a", prompt, len(prompt))
    kv.free("a")
    pool.check_integrity()
    assert pool.stats().num_cached == 3
    # 12 tokens = 3 full blocks, but the last token must be recomputed: 2 blocks hit.
    hits = kv.get_computed_blocks(prompt)
    assert len(hits) == 2
    appended = kv.allocate_slots("b", len(prompt), hits)
    assert appended is not None and appended[:2] == hits
    pool.check_integrity()
    assert pool.num_used == 3


def test_cached_blocks_evicted_lru_first():
    pool = BlockPool(num_blocks=3, block_size=2, enable_prefix_caching=True)
    kv = KVCacheManager(pool)
    for rid, toks in (("a", [1, 2]), ("b", [3, 4])):
        kv.allocate_slots(rid, 2)
        kv.cache_full_blocks(rid, toks, 2)
        kv.free(rid)
    assert pool.allocate(2) is not None  # takes the plain free block, then a's block
    assert kv.get_computed_blocks([1, 2, 9]) == []  # a was evicted first
    assert len(kv.get_computed_blocks([3, 4, 9])) == 1  # b survives
    pool.check_integrity()


def test_failed_allocation_changes_nothing():
    pool = BlockPool(num_blocks=2, block_size=2)
    kv = KVCacheManager(pool)
    assert kv.allocate_slots("a", 4) is not None
    assert kv.allocate_slots("b", 1) is None
    assert kv.block_ids("b") == []
    pool.check_integrity()


def test_compaction_moves_top_blocks_down_and_remaps_tables():
    from kvcache.defrag import fragmentation, plan_compaction

    pool = BlockPool(num_blocks=10, block_size=2, enable_prefix_caching=True)
    kv = KVCacheManager(pool)
    for rid in "abcde":
        kv.allocate_slots(rid, 4)  # 2 blocks each: a=[0,1] ... e=[8,9]
    kv.cache_full_blocks("e", [1, 2, 3, 4], 4)
    for rid in "abc":
        kv.free(rid)
    assert pool.num_used == 4 and fragmentation(pool) == 1.0  # d, e live in 6..9
    moves = plan_compaction(kv, max_moves=8)
    assert sorted(moves.values()) == [0, 1, 2, 3] and fragmentation(pool) == 0.0
    assert all(b < 4 for rid in "de" for b in kv.block_ids(rid))
    pool.check_integrity()
    # the prefix cache follows the move
    assert len(kv.get_computed_blocks([1, 2, 3, 4, 5])) == 2
    kv.free("d")
    kv.free("e")
    pool.check_integrity()


def test_reset_prefix_cache_forgets_every_hash_and_keeps_references() -> None:
    pool = BlockPool(6, 4, enable_prefix_caching=True)
    held = pool.allocate(2)
    freed = pool.allocate(2)
    assert held is not None and freed is not None
    for i, block_id in enumerate(held + freed):
        pool.cache_block(block_id, bytes([i]))
    pool.free(freed)  # now cached-free
    assert pool.stats().num_cached == 2
    assert pool.reset_prefix_cache() == 4
    assert all(pool.lookup(bytes([i])) is None for i in range(4))
    stats = pool.stats()
    assert (stats.num_free, stats.num_used, stats.num_cached) == (4, 2, 0)
    pool.check_integrity()
    assert pool.free(held) == 2 and pool.stats().num_free == 6  # no hash comes back
    pool.check_integrity()
