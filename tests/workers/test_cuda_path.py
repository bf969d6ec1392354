"""The CUDA path on a real GPU: compiled Triton kernels, CUDA graphs, device sampling.

Skipped where no CUDA device is present (CI, CPU machines); on a GPU machine this file is the
device check: `python -m pytest -q tests/workers/test_cuda_path.py` (about a minute, most of it
Triton compiling the kernels once).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from controller.messages import SamplingParams
from tests.workers.attention_cases import make_case, torch_reference
from tests.workers.helpers import Driver, build_hf_checkpoint, random_ids
from workers.attention.triton_backend import TritonBackend
from workers.cuda_graphs import graph_buckets
from workers.worker import RunOptions, Worker

CUDA = torch.device("cuda")
# Long decodes (split-K where few), chunks over cached context crossing many blocks.
SHAPE = [(1500, 1), (900, 1), (300, 1), (15, 1), (0, 1), (700, 200), (0, 333), (64, 64)]


def to_cuda(case):
    for name in ("q", "k", "v", "k_cache", "v_cache"):
        setattr(case, name, getattr(case, name).to(CUDA))
    case.meta = type(case.meta)(**{
        f: (getattr(case.meta, f).to(CUDA) if isinstance(getattr(case.meta, f), torch.Tensor)
            else getattr(case.meta, f)) for f in case.meta.__dataclass_fields__})
    return case


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return build_hf_checkpoint("llama", tmp_path_factory.mktemp("hf") / "llama",
                               num_hidden_layers=3)


@pytest.mark.parametrize("cuda_graphs", [True, False])
def test_fp32_greedy_equals_transformers_on_cuda(checkpoint, cuda_graphs):
    import transformers as tf

    hf = tf.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).to(CUDA).eval()
    hf.generation_config.eos_token_id = None
    worker = Worker(str(checkpoint), num_kv_blocks=256, block_size=16, device="cuda",
                    run=RunOptions(cuda_graphs=cuda_graphs, max_graph_batch=8))
    assert worker.backend.name == "triton" and (worker.graphs is not None) == cuda_graphs
    driver = Driver(worker)
    prompts = {f"r{i}": random_ids(n, seed=300 + i) for i, n in enumerate((3, 40, 130, 77))}
    want = {}
    for rid, prompt in prompts.items():
        ids = torch.tensor([prompt], device=CUDA)
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=24, pad_token_id=0)
        want[rid] = out[0, len(prompt):].tolist()
        driver.add(rid, prompt)
    driver.step({"r0": 3, "r1": 40, "r2": 64, "r3": 50})  # mixed, chunked
    driver.step({"r0": 1, "r1": 1, "r2": 66, "r3": 27})
    for _ in range(23):  # decode-only: replayed from the bucket-4 graph
        driver.step({rid: 1 for rid in prompts})
    for rid, prompt in prompts.items():
        assert driver.tokens[rid][len(prompt) : len(prompt) + 24] == want[rid], rid
    if cuda_graphs:  # every bucket captured at start, none later
        assert worker.graphs is not None and sorted(worker.graphs.graphs) == graph_buckets(8)


def test_start_up_compiles_and_captures_and_a_step_never_syncs(checkpoint):
    """Start-up does the slow things (kernels compiled, every graph bucket captured) before
    the first step; `launch` of mixed and decode-only steps, with greedy, seeded and unseeded
    random rows, top-k and top-p, runs with CUDA's sync debug mode set to raise."""
    worker = Worker(str(checkpoint), num_kv_blocks=256, block_size=16, device="cuda",
                    run=RunOptions(max_graph_batch=8))
    assert worker.uses_fused_layers and worker.startup_s > 0
    assert worker.graphs is not None and sorted(worker.graphs.graphs) == graph_buckets(8)
    captured = dict(worker.graphs.graphs)
    launch = worker.launch

    def strict_launch(plan):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return launch(plan)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    worker.launch = strict_launch  # `execute` calls launch, then wait (whose sync is allowed)
    driver = Driver(worker)
    params = [SamplingParams(temperature=0.0, max_tokens=99),
              SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=99),
              SamplingParams(temperature=1.1, top_k=5, max_tokens=99)]
    for i, n in enumerate((7, 40, 21)):
        driver.add(f"r{i}", random_ids(n, seed=i), params[i])
    driver.step({"r0": 7, "r1": 30, "r2": 21})  # mixed
    driver.step({"r0": 1, "r1": 10, "r2": 1})
    for _ in range(5):
        driver.step({"r0": 1, "r1": 1, "r2": 1})  # decode-only: a graph replay
    assert worker.graphs.graphs == captured  # nothing captured inside a step
    # r0 and r2 sample in all 7 steps; r1 finishes its prompt in the second
    assert [len(driver.tokens[f"r{i}"]) - n for i, n in enumerate((7, 40, 21))] == [7, 6, 7]


# bf16: 0.25 (the H200's first run: 4 of 10,240 logits off by 0.1-0.17, the rest within 0.1)
@pytest.mark.parametrize(("dtype", "tol"), [("float32", 1e-4), ("bfloat16", 0.25)])
def test_fused_layers_match_the_torch_layers_on_cuda(checkpoint, dtype, tol):
    """The CUDA path (fused layers, Triton attention, graphs) against the torch layers on
    SDPA (`attention_backend="torch"`), same device and weights: a mixed step, then
    decode-only ones; logits within the dtype's rounding (bf16: rounding compounds over
    layers), the same K/V written."""
    runs = []
    for backend in ("triton", "torch"):
        worker = Worker(str(checkpoint), num_kv_blocks=64, block_size=16, device="cuda",
                        dtype=dtype, keep_logits=True,
                        run=RunOptions(attention_backend=backend, max_graph_batch=4))
        assert worker.uses_fused_layers == (backend == "triton")
        driver = Driver(worker)
        for i, n in enumerate((3, 40, 77)):
            driver.add(f"r{i}", random_ids(n, seed=400 + i))
        logits = []
        for step in ({"r0": 3, "r1": 40, "r2": 50}, {"r0": 1, "r1": 1, "r2": 27},
                     {"r0": 1, "r1": 1, "r2": 1}, {"r0": 1, "r1": 1, "r2": 1}):
            driver.step(step)
            logits += [worker.span_logits[rid].float() for rid in step]
        runs.append((logits, worker.kv_caches))
    (fused, fused_kv), (plain, plain_kv) = runs
    for a, b in zip(fused, plain, strict=True):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)
    for (k1, v1), (k2, v2) in zip(fused_kv, plain_kv, strict=True):
        torch.testing.assert_close(k1.float(), k2.float(), atol=tol, rtol=tol)
        torch.testing.assert_close(v1.float(), v2.float(), atol=tol, rtol=tol)


def test_step_pipeline_on_cuda_gives_the_serial_tokens(checkpoint):
    """The step loop planned ahead (controller/step_loop.py) where `launch` returns before
    the device has run the step: the same tokens as serial stepping, greedy and seeded
    sampling, with decode-only steps replayed from graphs and mixed steps eager. Core and
    worker driven directly, as the GPU benchmark does (the GPU image has no pydantic for
    LocalEngine)."""
    import random

    from controller.core import ControllerCore
    from controller.messages import SamplingParams
    from controller.options import CacheConfig, ControllerOptions
    from controller.scheduler import SchedulerConfig
    from controller.step_loop import StepLoop

    def generate(is_async: bool) -> dict[str, list[int]]:
        worker = Worker(str(checkpoint), num_kv_blocks=256, block_size=16, device="cuda",
                        run=RunOptions(max_graph_batch=8))
        core = ControllerCore.for_workers(ControllerOptions(
            cache=CacheConfig(block_size=16, num_kv_blocks=256),
            scheduler=SchedulerConfig(max_num_batched_tokens=96, max_num_seqs=8)), [worker])
        rng = random.Random(3)
        params = [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
                  SamplingParams(max_tokens=20, temperature=0.9, seed=4, ignore_eos=True)]
        got: dict[str, list[int]] = {}
        for i, n in enumerate((5, 40, 130, 77, 9)):
            rid = core.add_request([rng.randrange(3, 250) for _ in range(n)],
                                   params[i % 2]).request_id
            got[rid] = []
        loop = StepLoop(core, 0, worker.launch, worker.wait, is_ahead=is_async)
        while loop.has_work():
            outputs = loop.step().outputs
            for out in outputs:
                got[out.request_id] += out.new_token_ids
        core.check_integrity()
        assert worker.graphs is not None and worker.graphs.graphs  # decode steps replayed
        return got

    serial = generate(False)
    assert all(len(tokens) == 20 for tokens in serial.values())
    assert generate(True) == serial


# Last: the most compiles (every shape and dtype); the device check's benchmark has already
# compared the kernels to torch at the model's shape when this runs.
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "block_size"),
                         [(8, 2, 64, 16), (4, 4, 128, 32), (32, 8, 64, 16)])
@pytest.mark.parametrize("num_sms", [None, 10_000])  # the GPU's own heuristics; forced splits
def test_compiled_kernels_match_torch(dtype, tol, num_heads, num_kv_heads, head_dim,
                                      block_size, num_sms):
    case = to_cuda(make_case(SHAPE, num_heads=num_heads, num_kv_heads=num_kv_heads,
                             head_dim=head_dim, block_size=block_size, dtype=dtype))
    want, want_k, want_v = torch_reference(case)
    backend = TritonBackend(num_heads, num_kv_heads, head_dim, dtype, CUDA, num_sms=num_sms)
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    got = backend.prepare(case.meta).forward(case.q, case.k, case.v, (k_cache, v_cache),
                                             case.scale)
    # bf16: both sides round q.k and p to bf16, in different orders
    torch.testing.assert_close(got.float(), want.float(), atol=tol,
                               rtol=0 if dtype == torch.float32 else tol)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
