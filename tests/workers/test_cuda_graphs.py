"""CUDA-graph bucketing and the worker's choice of execution path (what runs on CPU)."""

from __future__ import annotations

import torch

from workers.cuda_graphs import DecodeGraphs, graph_buckets, pick_bucket
from workers.worker import RunOptions, Worker


def test_buckets_like_nano_vllm():
    assert graph_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert graph_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert graph_buckets(3) == [1, 2, 3]
    assert graph_buckets(0) == []


def test_pick_bucket_is_the_smallest_that_fits():
    buckets = graph_buckets(64)
    assert [pick_bucket(buckets, n) for n in (1, 3, 8, 9, 17, 64)] == [1, 4, 8, 16, 32, 64]
    assert pick_bucket(buckets, 65) is None  # larger batches run eagerly


def test_bucket_for_checks_the_block_table_width(tiny_path):
    worker = Worker("builtin:tiny", num_kv_blocks=16, block_size=16)
    cfg = worker.model_config
    graphs = DecodeGraphs(worker.model, worker.kv_caches, worker.backend, max_batch=8,
                          max_blocks_per_seq=4, block_size=16, hidden_size=cfg.hidden_size,
                          dtype=torch.float32, device=torch.device("cpu"))
    assert graphs.bucket_for(5, 4) == 8
    assert graphs.bucket_for(5, 5) is None  # a context past the static table: eager
    assert graphs.bucket_for(9, 1) is None
    assert graphs.query_start_loc.tolist() == list(range(9))
    assert graphs.slot_mapping.tolist() == [-1] * 8  # nothing written before any capture


def test_cpu_worker_runs_eagerly_on_the_cpu_backend(tiny_path):
    worker = Worker("builtin:tiny", num_kv_blocks=4, block_size=16, device="auto")
    if torch.cuda.is_available():
        assert worker.backend.name == "triton" and worker.graphs is not None
    else:
        # The torch layers with the C++ decode kernel (gcc and ninja are on every CI machine).
        assert worker.backend.name == "cpu" and worker.graphs is None
    eager = Worker("builtin:tiny", num_kv_blocks=4, block_size=16,
                   run=RunOptions(cuda_graphs=False))
    assert eager.graphs is None
