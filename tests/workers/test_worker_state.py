"""Worker bookkeeping: plan diffs, events, estimates, errors."""

from __future__ import annotations

import pytest
import torch

from controller.messages import CachedRequestData, NewRequestData, StepPlan
from tests.workers.helpers import GREEDY, Driver, random_ids
from workers.worker import Worker


@pytest.fixture
def worker(tiny_path) -> Worker:
    return Worker("builtin:tiny", num_kv_blocks=64, block_size=16)


def test_diffs_maintain_state(worker):
    driver = Driver(worker)
    driver.add("a", random_ids(20, 1, 512), block_ids=[5, 9])
    driver.add("b", random_ids(10, 2, 512), block_ids=[3])
    driver.step({"a": 16, "b": 10})
    assert worker.num_active_requests == 2
    assert worker.held_block_ids() == {3, 5, 9}
    plan = StepPlan(
        step_id=9,
        cached_requests=[CachedRequestData("b", [4], 10)],
        num_scheduled_tokens={"a": 4, "b": 1},
        total_num_scheduled_tokens=5,
    )
    result = worker.execute(plan)
    assert worker.held_block_ids() == {3, 4, 5, 9}
    assert {k: len(v) for k, v in result.sampled_token_ids.items()} == {"a": 1, "b": 1}
    result = worker.execute(StepPlan(step_id=10, finished_request_ids={"a", "b", "unknown"}))
    assert result.sampled_token_ids == {} and result.num_tokens == 0
    assert worker.num_active_requests == 0 and worker.held_block_ids() == set()


def test_new_request_replaces_old_state(worker):
    driver = Driver(worker)
    driver.add("a", random_ids(20, 1, 512), block_ids=[0, 1])
    driver.step({"a": 20})
    driver.add("a", random_ids(5, 2, 512), block_ids=[7])
    driver.step({"a": 5})
    assert worker.held_block_ids() == {7}


def test_chunk_events_and_bytes(worker):
    driver = Driver(worker)
    driver.add("p", random_ids(33, 1, 512))
    first = driver.step({"p": 32})
    last = driver.step({"p": 1})  # the prompt's last token alone is still a prefill chunk
    decode = driver.step({"p": 1})
    assert first.sampled_token_ids["p"] == [] and len(last.sampled_token_ids["p"]) == 1
    assert [(e.chunk_index, e.start, e.num_tokens) for e in first.chunk_events] == [(0, 0, 32)]
    assert [(e.chunk_index, e.start, e.num_tokens) for e in last.chunk_events] == [(1, 32, 1)]
    assert decode.chunk_events == [] and decode.num_tokens == 1
    cfg = worker.model_config
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.kv_size * 4
    assert worker.kv_bytes_per_block == 16 * kv_per_token
    # Weights dominate a decode step; bytes grow with the tokens moved.
    assert worker.weight_bytes // 2 < decode.bytes_moved < first.bytes_moved
    assert first.chunk_events[0].bytes_moved <= first.bytes_moved
    assert worker.weight_bytes == worker.num_params * 4
    assert all(r.elapsed_s > 0 for r in (first, last, decode))


def test_errors(worker):
    driver = Driver(worker)
    driver.add("a", random_ids(10, 1, 512), block_ids=[0])
    with pytest.raises(ValueError, match="only 10 known"):
        driver.step({"a": 11})
    with pytest.raises(KeyError, match="no request"):
        worker.execute(StepPlan(step_id=1, num_scheduled_tokens={"x": 1},
                                total_num_scheduled_tokens=1))
    bad = NewRequestData("b", [1, 2], GREEDY, [64], 0)
    with pytest.raises(ValueError, match="outside the pool"):
        worker.execute(StepPlan(step_id=2, new_requests=[bad]))
    short = NewRequestData("c", list(range(3, 40)), GREEDY, [1], 0)
    with pytest.raises(ValueError, match="needs 3 blocks"):
        worker.execute(StepPlan(step_id=3, new_requests=[short], num_scheduled_tokens={"c": 37},
                                total_num_scheduled_tokens=37))


def test_dtype_option(tiny_path):
    worker = Worker(str(tiny_path), num_kv_blocks=8, block_size=16, dtype="bfloat16",
                    keep_logits=True)
    assert worker.kv_caches[0][0].dtype == torch.bfloat16
    driver = Driver(worker)
    driver.add("a", random_ids(30, 1, 512))
    driver.step({"a": 30})
    assert worker.last_logits["a"].dtype == torch.float32


def test_tokenizer_and_auto_device(tiny_path):
    worker = Worker("builtin:tiny", num_kv_blocks=4, block_size=16, device="auto")
    assert worker.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert worker.tokenizer.decode(worker.tokenizer.encode("héllo")) == "héllo"
    assert worker.tokenizer is worker.tokenizer  # loaded once
