"""`worker.check_kv_provenance` (workers/kv_provenance.py): a real worker of the tiny preset
refuses a step that would attend over KV computed for other tokens (a prefix hit on a
block another request wrote, a block move it never made) and runs the right ones."""

from __future__ import annotations

import pytest

from cluster.config import TokenflowConfig
from controller.messages import NewRequestData, SamplingParams, StepPlan
from workers.kv_provenance import KVProvenanceError
from workers.worker import Worker, build_worker

PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture()
def worker() -> Worker:
    config = TokenflowConfig(worker={"check_kv_provenance": True, "telemetry": False},
                             cache={"block_size": 4, "num_kv_blocks": 16})
    return build_worker(config.worker, config.cache)


def new(rid: str, tokens: list[int], blocks: list[int], num_computed: int = 0
        ) -> NewRequestData:
    return NewRequestData(rid, tokens, PARAMS, blocks, num_computed)


def step(worker: Worker, step_id: int, **fields) -> None:
    sched = fields.pop("scheduled")
    worker.execute(StepPlan(step_id, num_scheduled_tokens=sched,
                            total_num_scheduled_tokens=sum(sched.values()), **fields))


def test_a_prefix_hit_on_its_own_tokens_runs_and_on_others_fails(worker: Worker) -> None:
    prompt = [5, 6, 7, 8, 9, 10, 11]
    step(worker, 0, new_requests=[new("a", prompt, [3, 4])], scheduled={"a": 7})
    # The same first block: a hit that reads what "a" wrote there.
    step(worker, 1, new_requests=[new("b", [*prompt[:4], 40, 41], [3, 5], 4)],
         scheduled={"b": 2})
    assert worker.kv_provenance is not None and worker.kv_provenance.num_checked == 4
    # Another prompt pointed at "a"'s block: refused before the forward.
    with pytest.raises(KVProvenanceError, match=r"c: position 0 reads block 3.*'a'"):
        step(worker, 2, new_requests=[new("c", [1, 2, 3, 4, 5], [3, 6], 4)],
             scheduled={"c": 1})


def test_a_hit_on_a_moved_block_reads_it_only_once_the_move_is_made(worker: Worker) -> None:
    prompt = [5, 6, 7, 8, 9]
    step(worker, 0, new_requests=[new("a", prompt, [9, 10])], scheduled={"a": 5})
    # The controller moved "a"'s blocks down (9 -> 0, 10 -> 1) in a step the worker never
    # got: a hit on block 0 would read whatever is there.
    with pytest.raises(KVProvenanceError, match="b: position 0 reads block 0, which holds "
                                                "nothing"):
        step(worker, 1, new_requests=[new("b", [*prompt[:4], 7], [0, 2], 4)],
             scheduled={"b": 1})
    # With the move made, "a" decodes on from its moved blocks and a hit reads block 0.
    step(worker, 2, block_moves={9: 0, 10: 1}, finished_request_ids={"b"},
         scheduled={"a": 1})
    step(worker, 3, new_requests=[new("c", [*prompt[:4], 8], [0, 3], 4)], scheduled={"c": 1})
    assert worker.kv_provenance is not None and worker.kv_provenance.num_checked == 5 + 4
