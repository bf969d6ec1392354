"""The 3 ms stand-in worker keeps its request state from plan diffs as the real worker does:
driven by a real ControllerCore (no Ray), every request runs to its token count, chunks
report completion, and finished requests release their blocks on the stand-in too."""

from __future__ import annotations

import pytest

from benchmarks.standin_worker import STEP_S, StandInWorkerActor
from controller.core import ControllerCore, ModelFacts, PoolSpec
from controller.messages import SamplingParams, StepResult, decode_result, encode_message
from controller.options import CacheConfig, ControllerOptions, WorkerConfig
from controller.scheduler import SchedulerConfig


@pytest.mark.parametrize("is_wire", [False, True], ids=["objects", "bytes"])
def test_standin_runs_requests_to_completion_from_plan_diffs(is_wire: bool) -> None:
    """`is_wire`: plans sent as bytes, as actor calls send them; answered in bytes."""
    worker = StandInWorkerActor(WorkerConfig(), CacheConfig(block_size=16, num_kv_blocks=64))
    info = worker.info()
    # No prefix caching: the prompts share a prefix, and a hit skips reporting its chunk.
    core = ControllerCore([PoolSpec(info.num_kv_blocks, info.block_size, False)],
                          ControllerOptions(scheduler=SchedulerConfig(
                              max_num_batched_tokens=48, max_chunk_tokens=32)),
                          ModelFacts(info.eos_token_ids, vocab_size=info.vocab_size))
    lengths = {core.add_request(list(range(3, 3 + n)), SamplingParams(
        max_tokens=5, temperature=0.0, ignore_eos=True)).request_id: n for n in (70, 9, 40)}
    tokens: dict[str, list[int]] = {rid: [] for rid in lengths}
    chunks: dict[str, int] = dict.fromkeys(lengths, 0)
    while core.has_unfinished():
        plan = core.begin_step(0)
        answer = worker.execute(encode_message(plan) if is_wire else plan, info.incarnation)
        assert isinstance(answer, bytes if is_wire else StepResult)
        result = decode_result(answer)
        assert result.elapsed_s >= STEP_S
        for event in result.chunk_events:
            chunks[event.request_id] += event.num_tokens
        for out in core.finish_step(0, plan, result):
            tokens[out.request_id].extend(out.new_token_ids)
    assert {rid: len(t) for rid, t in tokens.items()} == dict.fromkeys(lengths, 5)
    assert all(3 <= t < info.vocab_size for ts in tokens.values() for t in ts)
    assert chunks == lengths  # every prompt token was reported in a chunk, once
    worker.execute(core.begin_step(0), info.incarnation)  # delivers the finished ids
    assert worker.held_block_ids() == set() and worker.num_active_requests() == 0
