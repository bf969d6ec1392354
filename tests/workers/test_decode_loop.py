"""A decode burst's further steps in one loop (workers/decode_loop.py) against the same burst
run step by step through `_launch` and against single steps: the same tokens, request
states, step results (tokens, bytes) and KV cache bit for bit; taken only where every row is
a greedy decode on the C++ stack and the screen; a request without the blocks for the whole
burst still fails as before."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import workers.greedy_head as greedy_head
import workers.step_results as step_results
from controller.messages import CachedRequestData, SamplingParams, StepPlan, StepResult
from tests.workers.helpers import GREEDY, Driver, build_hf_checkpoint, random_ids
from workers.kernels.cpu_ops import cpu_ops
from workers.sections import PackPolicy
from workers.worker import RunOptions, Worker

OPS = cpu_ops()
pytestmark = pytest.mark.skipif(
    OPS is None or not OPS.decode_gemm_preferred(),
    reason="the CPU kernels or their decode GEMM are not built for this CPU")

VOCAB = 4096  # a screened lm_head (with SCREEN_MIN_ELEMENTS lowered for it)
POLICY = PackPolicy(min_rows=1, min_elements=1, any_rows_elements=1, decode_max_rows=8)
PROMPT_LENS = {"r0": 5, "r1": 40, "r2": 77}  # r1 crosses a block edge inside a burst
NUM_STEPS, NUM_BURSTS = 4, 5
SEEDED = SamplingParams(max_tokens=64, temperature=0.8, seed=5, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return build_hf_checkpoint("llama", tmp_path_factory.mktemp("hf") / "llama",
                               num_hidden_layers=3, vocab_size=VOCAB)


@pytest.fixture
def make_worker(checkpoint, monkeypatch):
    monkeypatch.setattr(greedy_head, "SCREEN_MIN_ELEMENTS", 0)  # the small model's lm_head

    def make(is_looped: bool = True) -> Worker:
        worker = Worker(str(checkpoint), num_kv_blocks=64, block_size=16,
                        run=RunOptions(packing=POLICY))
        if worker.greedy_head is None or worker.model.decode_stack is None:
            pytest.skip("no screen or no decode stack on this CPU")
        if not is_looped:  # every further step of a burst through `_launch`
            monkeypatch.setattr(step_results, "run_decode_loop", lambda *_: False)
        return worker

    return make


class BurstDriver(Driver):
    """`Driver` whose decode plans run `num_steps` steps each (a controller's burst)."""

    def burst(self, schedule: dict[str, int], num_steps: int) -> StepResult:
        self.step_id += 1
        cached = [CachedRequestData(rid, [], self.num_computed[rid]) for rid in schedule]
        plan = StepPlan(step_id=self.step_id, cached_requests=cached,
                        num_scheduled_tokens=dict(schedule),
                        total_num_scheduled_tokens=sum(schedule.values()), num_steps=num_steps)
        result = self.worker.execute(plan)
        for rid, n in schedule.items():
            self.num_computed[rid] += n * num_steps
            self.tokens[rid] += result.sampled_token_ids[rid]
        return result


def _count(worker: Worker) -> dict[str, int]:
    """Calls of `_launch` and of the stack's forward from now on."""
    counts = {"launch": 0, "stack": 0}
    launch, stack = worker._launch, worker.model.decode_stack
    forward = stack.forward

    def counted_launch(plan: StepPlan):  # type: ignore[no-untyped-def]
        counts["launch"] += 1
        return launch(plan)

    def counted_forward(*args):  # type: ignore[no-untyped-def]
        counts["stack"] += 1
        return forward(*args)

    worker._launch = counted_launch  # type: ignore[method-assign]
    stack.forward = counted_forward  # type: ignore[method-assign]
    return counts


def _run(worker: Worker, num_steps: int, params: dict[str, SamplingParams] | None = None
         ) -> tuple[BurstDriver, list[StepResult]]:
    driver = BurstDriver(worker)
    for i, (rid, n) in enumerate(PROMPT_LENS.items()):
        driver.add(rid, random_ids(n, seed=600 + i, vocab_size=VOCAB),
                   params=(params or {}).get(rid, GREEDY))
    driver.step(dict(PROMPT_LENS))  # the prompts in one step
    results = []
    for _ in range(NUM_BURSTS * NUM_STEPS // num_steps):
        results.append(driver.burst(dict.fromkeys(PROMPT_LENS, 1), num_steps))
    return driver, results


def _states(worker: Worker) -> dict[str, tuple[list[int], int, int]]:
    return {rid: (s.token_ids, s.num_computed, s.num_output_tokens)
            for rid, s in worker._requests.items()}


def test_the_loop_gives_the_steps_of_launch_bit_for_bit(make_worker):
    looped = make_worker()
    counts = _count(looped)
    driver, results = _run(looped, NUM_STEPS)
    assert counts == {"launch": 1 + NUM_BURSTS, "stack": NUM_BURSTS * NUM_STEPS}

    stepped = make_worker(is_looped=False)
    stepped_counts = _count(stepped)
    stepped_driver, stepped_results = _run(stepped, NUM_STEPS)
    assert stepped_counts["launch"] == 1 + NUM_BURSTS * NUM_STEPS
    assert driver.tokens == stepped_driver.tokens
    assert _states(looped) == _states(stepped)
    for got, want in zip(results, stepped_results, strict=True):
        assert got.sampled_token_ids == want.sampled_token_ids
        assert all(len(ids) == NUM_STEPS for ids in got.sampled_token_ids.values())
        assert (got.num_tokens, got.bytes_moved, got.chunk_events) == \
            (want.num_tokens, want.bytes_moved, want.chunk_events)
    for got, want in zip(looped.kv_caches, stepped.kv_caches, strict=True):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])

    single_driver, _ = _run(make_worker(), 1)
    assert driver.tokens == single_driver.tokens


def test_a_burst_with_a_seeded_random_row_runs_step_by_step(make_worker):
    """A random row is sampled, not screened: every step of its bursts goes through
    `_launch`, with the tokens of single steps."""
    params = {"r1": SEEDED}
    worker = make_worker()
    counts = _count(worker)
    driver, _ = _run(worker, NUM_STEPS, params)
    assert counts["launch"] == 1 + NUM_BURSTS * NUM_STEPS
    single_driver, _ = _run(make_worker(), 1, params)
    assert driver.tokens == single_driver.tokens


def test_a_burst_past_the_requests_blocks_still_fails(make_worker):
    """One block for a 14-token prompt: a 4-step burst would need a second block. The loop
    does not run it; `_launch` refuses the step that passes the block as before."""
    worker = make_worker()
    driver = BurstDriver(worker)
    driver.add("r", random_ids(14, seed=7, vocab_size=VOCAB), block_ids=[3])
    driver.step({"r": 14})
    with pytest.raises(ValueError, match="needs 2 blocks"):
        driver.burst({"r": 1}, NUM_STEPS)
