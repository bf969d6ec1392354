"""`worker.num_threads` reaches torch in LocalEngine (and, through the same `Worker`
argument, in worker actors): None keeps the process's default, -1 takes every core."""

from __future__ import annotations

import os

import pytest
import torch

from cluster.engine import LocalEngine
from workers.worker import RunOptions, Worker


@pytest.fixture
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_num_threads_reaches_torch(restore_threads):
    torch.set_num_threads(1)
    LocalEngine(worker={"model": "builtin:tiny", "telemetry": False})
    assert torch.get_num_threads() == 1  # None: left as it was
    LocalEngine(worker={"model": "builtin:tiny", "telemetry": False, "num_threads": -1})
    assert torch.get_num_threads() == len(os.sched_getaffinity(0))
    if len(os.sched_getaffinity(0)) > 1:
        LocalEngine(worker={"model": "builtin:tiny", "telemetry": False, "num_threads": 1})
        assert torch.get_num_threads() == 1
    with pytest.raises(ValueError, match="num_threads"):
        Worker("builtin:tiny", num_kv_blocks=8, block_size=4, run=RunOptions(num_threads=0))
