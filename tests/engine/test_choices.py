"""n choices of one prompt in the engine: each its own seeded stream, the same choices
twice, the prompt's full blocks allocated once and shared (asserted on the pool)."""

from __future__ import annotations

from cluster.engine import LocalEngine
from controller.choices import choice_params, choice_request_id
from controller.messages import SamplingParams

BLOCK = 8
PROMPT = list(range(10, 51))  # 41 tokens: 5 full blocks and a partial one


def engine() -> LocalEngine:
    return LocalEngine(worker={"model": "builtin:tiny"},
                       cache={"block_size": BLOCK, "num_kv_blocks": 128},
                       scheduler={"max_num_batched_tokens": 256})


def run_choices(eng: LocalEngine, request_id: str, n: int, params: SamplingParams):
    ids = [choice_request_id(request_id, i) for i in range(n)]
    for i, rid in enumerate(ids):
        eng.add_request(PROMPT, choice_params(params, request_id, i), request_id=rid)
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    shared_checked = False
    while eng.has_unfinished():
        for out in eng.step():
            tokens[out.request_id] += out.new_token_ids
        kv = eng.scheduler.kv
        if not shared_checked and all(kv.block_ids(rid) for rid in ids):
            tables = [kv.block_ids(rid) for rid in ids]
            num_full = len(PROMPT) // BLOCK
            # Every choice's table starts with the same full prompt blocks, each
            # referenced n times; the rest of each table is its own.
            assert all(t[:num_full] == tables[0][:num_full] for t in tables)
            for block in tables[0][:num_full]:
                assert eng.scheduler.kv.pool.blocks[block].ref_count == n
            own = [set(t[num_full:]) for t in tables]
            assert sum(len(s) for s in own) == len(set().union(*own))
            shared_checked = True
    assert shared_checked
    return [tokens[rid] for rid in ids], ids


def test_four_seeded_choices_share_the_prompt_and_repeat() -> None:
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=42, ignore_eos=True)
    eng = engine()
    first, _ = run_choices(eng, "a", 4, params)
    assert len({tuple(t) for t in first}) == 4, "each choice samples its own stream"
    # Again on a fresh engine (no cache from the first run): the same four choices.
    second, _ = run_choices(engine(), "b", 4, params)
    assert second == first
    # Prompt computed once: 5 full blocks from choice 0, each other choice recomputes
    # only the last partial block's tokens.
    stats = eng.scheduler.stats
    assert stats.num_prefill_tokens == len(PROMPT) + 3 * (len(PROMPT) % BLOCK)
    eng.check_integrity()
