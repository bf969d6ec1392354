"""Step metadata, the varlen torch backend, and the Triton kernels (under the interpreter).

The torch path must equal a float64 token-by-token reference (tests/workers/attention_cases.py);
the Triton kernels run on CPU under the interpreter in a subprocess (triton_interpreted.py) and
must equal the torch path in fp32 to 1e-5.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.workers.attention_cases import MIXED, make_case, reference_attention
from workers.attention import HostStaging, SeqSpan, StepMetadata, has_amx, make_backend
from workers.attention.torch_backend import TorchBackend, decode_groups, profiled
from workers.kernels.cpu_ops import cpu_ops

ATOL = 1e-5
CPU = torch.device("cpu")


# ---- metadata ---------------------------------------------------------------------------------
def test_metadata_positions_slots_and_table():
    spans = [SeqSpan(0, 1, 20, [7, 3]), SeqSpan(1, 3, 5, [9])]
    meta = StepMetadata.build(spans, [5, 6, 7, 8], 16, HostStaging(CPU), logits_indices=[0, 3])
    assert meta.input_ids.tolist() == [5, 6, 7, 8]
    assert meta.positions.tolist() == [19, 2, 3, 4]
    assert meta.slot_mapping.tolist() == [3 * 16 + 3, 9 * 16 + 2, 9 * 16 + 3, 9 * 16 + 4]
    assert meta.query_start_loc.tolist() == [0, 1, 4]
    assert meta.seq_lens.tolist() == [20, 5]
    assert meta.block_table.tolist() == [[7, 3], [9, 0]]
    assert meta.logits_indices.tolist() == [0, 3]
    assert (meta.num_decodes, meta.max_query_len, meta.max_seq_len) == (1, 3, 20)
    assert not meta.is_decode_only


def test_metadata_pads_decode_steps_to_a_bucket():
    spans = [SeqSpan(0, 1, 40, [4, 5, 6]), SeqSpan(1, 1, 2, [8])]
    meta = StepMetadata.build(spans, [11, 12], 16, HostStaging(CPU), pad_to=4)
    assert (meta.num_tokens, meta.num_seqs, meta.num_decodes) == (4, 4, 4)
    assert (meta.num_real_tokens, meta.num_real_seqs) == (2, 2)
    assert meta.input_ids.tolist() == [11, 12, 0, 0]
    assert meta.slot_mapping.tolist() == [6 * 16 + 7, 8 * 16 + 1, -1, -1]  # padding: no write
    assert meta.seq_lens.tolist() == [40, 2, 0, 0]  # padding: no key read
    assert meta.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert meta.block_table.tolist() == [[4, 5, 6], [8, 0, 0], [0, 0, 0], [0, 0, 0]]
    with pytest.raises(ValueError, match="decode-only"):
        StepMetadata.build([SeqSpan(0, 2, 2, [1])], [1, 2], 16, HostStaging(CPU), pad_to=2)


@pytest.mark.parametrize("num_tokens", [1, 2, 3, 7, 33])
def test_metadata_views_start_16_byte_aligned_whatever_the_counts(num_tokens):
    """Triton specialises a kernel on its pointers' alignment: views whose offsets followed
    the step's token and sequence counts made steps of new shapes compile a kernel variant
    mid-serving (on an H200: ~0.7 s a step). Every view starts 16 bytes from the upload's
    start times a whole number, and holds only its own values."""
    spans = [SeqSpan(0, 1, 20, [7, 3]), SeqSpan(1, num_tokens, num_tokens + 2, [9, 4, 5])]
    extra = (np.arange(3, dtype=np.int64),)
    meta = StepMetadata.build(spans, list(range(num_tokens + 1)), 16, HostStaging(CPU),
                              logits_indices=[0, num_tokens], extra=extra)
    views = [meta.input_ids, meta.positions, meta.slot_mapping, meta.query_start_loc,
             meta.seq_lens, meta.block_table, meta.logits_indices, *meta.extra]
    base = meta.input_ids.data_ptr()
    assert all((v.data_ptr() - base) % 16 == 0 for v in views)
    assert meta.input_ids.tolist() == list(range(num_tokens + 1))
    assert meta.query_start_loc.tolist() == [0, 1, num_tokens + 1]
    assert meta.logits_indices.tolist() == [0, num_tokens] and meta.extra[0].tolist() == [0, 1, 2]


def test_metadata_rejects_short_block_lists():
    with pytest.raises(ValueError, match="needs 3 blocks"):
        StepMetadata.build([SeqSpan(0, 37, 37, [1])], list(range(37)), 16, HostStaging(CPU))


def test_auto_backend_by_device():
    kwargs = dict(num_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32)
    # The C++ decode kernel where it builds (every CI machine has gcc and ninja).
    assert make_backend("auto", device=CPU, **kwargs).name == "cpu"
    assert make_backend("torch", device=CPU, **kwargs).name == "torch"
    # A dtype the kernel lacks keeps the torch path.
    assert make_backend("cpu", device=CPU, **{**kwargs, "dtype": torch.float16}).name == "torch"
    with pytest.raises(ValueError, match="CUDA"):
        make_backend("triton", device=CPU, **kwargs)
    with pytest.raises(ValueError, match="expected one of"):
        make_backend("flash", device=CPU, **kwargs)


def test_triton_that_fails_to_import_is_an_error_on_cuda(monkeypatch):
    """No silent fall back to SDPA on a GPU: "auto" on CUDA needs Triton; the torch backend
    stays available when asked for by name."""
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` raises ImportError
    kwargs = dict(num_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32)
    cuda = torch.device("cuda")
    for name in ("auto", "triton"):
        with pytest.raises(RuntimeError, match="attention_backend=torch"):
            make_backend(name, device=cuda, **kwargs)
    assert make_backend("torch", device=cuda, **kwargs).name == "torch"


# ---- torch backend ----------------------------------------------------------------------------
def test_decode_groups_bound_the_padding():
    lens = np.array([4000, 3900, 3300, 1000, 900, 300, 200, 180, 5])
    groups = decode_groups(lens, max_padding=256)
    # 3900 pads 100 keys; 3300 would pad 700 more: a new group, and so on down
    assert groups == [(0, 2), (2, 3), (3, 5), (5, 8), (8, 9)]
    for a, b in groups:
        assert sum(lens[a] - n for n in lens[a:b]) <= 256
    assert decode_groups(np.array([64, 64, 63]), 0) == [(0, 2), (2, 3)]
    assert decode_groups(np.array([64, 64, 63]), 1) == [(0, 3)]
    assert decode_groups(np.array([], dtype=np.int64), 0) == []


def test_decode_group_padding_is_counted_in_kv_bytes():
    # fp32, 2 KV heads of 16: a key is 2 * 2 * 16 * 4 = 256 bytes of K and V
    assert TorchBackend(torch.float32, 2, 16, group_waste_bytes=256 * 100).max_group_padding == 100
    assert TorchBackend(torch.bfloat16, 2, 16, group_waste_bytes=256 * 100).max_group_padding == 200


@pytest.mark.parametrize("waste_bytes", [0, 10**9])  # one group per context, one group
def test_torch_backend_matches_reference(waste_bytes):
    case = make_case([(700, 1), (300, 1), (150, 1), *MIXED], num_heads=4, num_kv_heads=2,
                     head_dim=16, block_size=16, seed=1)
    want, want_k, want_v = reference_attention(case)
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    step = TorchBackend(torch.float32, 2, 16, group_waste_bytes=waste_bytes).prepare(case.meta)
    assert len(step.decodes) == (7 if waste_bytes == 0 else 1)
    got = step.forward(case.q, case.k, case.v, (k_cache, v_cache), case.scale)
    torch.testing.assert_close(got.double(), want, atol=ATOL, rtol=0)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


def test_cpu_backend_matches_reference():
    """The C++ decode kernel (in place, no groups) and SDPA chunks against float64; long
    contexts, a 0-context decode, GQA with 4 query heads per KV head, strided q."""
    case = make_case([(1000, 1), (300, 1), (150, 1), *MIXED, (0, 1)], num_heads=8,
                     num_kv_heads=2, head_dim=16, block_size=16, seed=2)
    want, want_k, want_v = reference_attention(case)
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    backend = make_backend("cpu", device=CPU, num_heads=8, num_kv_heads=2, head_dim=16,
                           dtype=torch.float32)
    step = backend.prepare(case.meta)
    assert step.decodes == [] and step.decode_kernel is not None
    got = step.forward(case.q, case.k, case.v, (k_cache, v_cache), case.scale)
    torch.testing.assert_close(got.double(), want, atol=ATOL, rtol=0)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)



def test_kernel_calls_are_named_for_the_profiler_only_while_it_runs():
    """A C++ kernel is no aten op: the profiler sees it by its record_function name, which
    the backend enters only while a profiler runs (entering it costs ~28 us a call)."""
    case = make_case([(300, 1), (150, 1), (17, 9)], num_heads=4, num_kv_heads=2, head_dim=16,
                     block_size=16, seed=3)
    calls: list[int] = []

    def decode_kernel(out, q, k_cache, v_cache, block_table, seq_lens, scale):
        calls.append(int(torch.autograd.profiler._is_profiler_enabled))
        out.zero_()

    step = TorchBackend(torch.float32, 2, 16, decode_kernel=decode_kernel).prepare(case.meta)
    caches = (case.k_cache.clone(), case.v_cache.clone())
    assert isinstance(profiled("tokenflow::decode_attention"), contextlib.nullcontext)
    step.forward(case.q, case.k, case.v, caches, case.scale)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step.forward(case.q, case.k, case.v, caches, case.scale)
    names = [event.name for event in prof.events()]
    assert names.count("tokenflow::decode_attention") == 1
    assert calls == [0, 1]  # one call a step, the second under the profiler

@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", [
    (8, 2, 64, 16), (4, 4, 128, 32), (6, 2, 32, 8), (3, 3, 16, 16), (8, 2, 96, 16),
    (8, 2, 8, 16), (8, 1, 128, 16), (16, 2, 64, 16)])
@pytest.mark.parametrize("lengths", [[37], [0, 14, 15, 16, 17, 31, 32, 33, 700]])
def test_cpu_decode_kernel_matches_reference(num_heads, num_kv_heads, head_dim, block_size,
                                             lengths):
    """The C++ decode kernel on decode-only steps against float64: head sizes of 1, 2, 4
    and 8 registers (the register-blocked fp32 path) and sizes it leaves to the generic
    loop; blocks smaller and larger than a tile of keys; contexts around the tile's edges;
    one row (a KV head per thread) and many (a row per thread); GQA groups of 4, 3 and 1,
    and of 8 (more query heads than one pass of its p @ V loop holds: 6); a last tile of
    keys partly padding (its lanes masked) at every length not a multiple of the tile."""
    case = make_case([(n, 1) for n in lengths], num_heads=num_heads,
                     num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
                     seed=5)
    want, _, _ = reference_attention(case)
    ops = cpu_ops()
    assert ops is not None
    backend = TorchBackend(torch.float32, num_kv_heads, head_dim,
                           decode_kernel=ops.decode_attention)
    got = backend.prepare(case.meta).forward(case.q, case.k, case.v,
                                             (case.k_cache.clone(), case.v_cache.clone()),
                                             case.scale)
    torch.testing.assert_close(got.double(), want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", [
    (8, 2, 64, 16), (4, 4, 128, 32), (6, 2, 32, 8), (8, 2, 96, 16), (8, 2, 8, 16)])
def test_cpu_decode_kernel_bf16_rounds_the_exact_result_once(num_heads, num_kv_heads, head_dim,
                                                             block_size):
    """A bf16 cache and queries: the register-blocked path (head sizes of whole registers)
    and the generic loop read the bf16 values and sum in fp32, so the output is the float64
    attention of those very values rounded once to bf16 (a relative 2^-8 at most), up to
    fp32's sums."""
    case = make_case([(n, 1) for n in (0, 14, 17, 33, 700)], num_heads=num_heads,
                     num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
                     seed=6, dtype=torch.bfloat16)
    want, _, _ = reference_attention(case)
    ops = cpu_ops()
    assert ops is not None
    backend = TorchBackend(torch.bfloat16, num_kv_heads, head_dim,
                           decode_kernel=ops.decode_attention)
    got = backend.prepare(case.meta).forward(case.q, case.k, case.v,
                                             (case.k_cache.clone(), case.v_cache.clone()),
                                             case.scale)
    assert got.dtype == torch.bfloat16
    err = (got.double() - want).abs()
    assert bool((err <= want.abs() * 2.0**-8 + 1e-5).all()), float(err.max())


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", [
    (8, 2, 64, 16), (4, 4, 128, 16), (6, 2, 64, 8)])
def test_cpu_chunk_kernel_matches_reference(num_heads, num_kv_heads, head_dim, block_size):
    """The C++ chunk kernel (flash-style over the paged cache, causal by position, no mask)
    against float64: fresh prompts (context = chunk), chunks deep into earlier context over
    many key tiles, row counts off the kernel's tiles (1, 7, 33, 100), beside decodes; GQA
    groups of 4, 1 and 3; strided q. The kernel of this machine's build, whether or not the
    backend would pick it here (it does where the build has AVX-512)."""
    case = make_case([(700, 1), (9, 1), (0, 33), (1000, 100), (45, 7), (0, 1), (61, 1),
                      (5, 70)], num_heads=num_heads, num_kv_heads=num_kv_heads,
                     head_dim=head_dim, block_size=block_size, seed=4)
    want, want_k, want_v = reference_attention(case)
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    ops = cpu_ops()
    assert ops is not None
    backend = TorchBackend(torch.float32, num_kv_heads, head_dim,
                           decode_kernel=ops.decode_attention, chunk_kernel=ops.chunk_attention)
    step = backend.prepare(case.meta)
    assert all(c.mask is None and c.block_ids is not None for c in step.chunks)
    got = step.forward(case.q, case.k, case.v, (k_cache, v_cache), case.scale)
    torch.testing.assert_close(got.double(), want, atol=ATOL, rtol=0)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


def test_cpu_chunk_kernel_is_used_only_for_its_head_sizes_with_avx512():
    ops = cpu_ops()
    assert ops is not None
    is_avx512 = ops.chunk_attention_width == 16
    for head_dim, has_kernel in ((64, is_avx512), (128, is_avx512), (16, False), (96, False)):
        backend = make_backend("cpu", device=CPU, num_heads=4, num_kv_heads=2,
                               head_dim=head_dim, dtype=torch.float32)
        assert (backend.chunk_kernel is not None) == has_kernel
    # bf16: SDPA where AMX tiles run its blocks, the kernel elsewhere.
    backend = make_backend("cpu", device=CPU, num_heads=4, num_kv_heads=2, head_dim=64,
                           dtype=torch.bfloat16)
    assert (backend.chunk_kernel is not None) == (is_avx512 and not has_amx())
    assert backend.decode_kernel is not None


def test_has_amx_reads_the_cpus_flags():
    flags = Path("/proc/cpuinfo").read_text()
    assert has_amx() == (" amx_tile" in flags)


def test_cpu_backend_bf16_matches_the_torch_backend():
    """bf16 cache and queries: the kernel accumulates in fp32 as SDPA does, so both round to
    the same bf16 values but for the last bit."""
    case = make_case([(400, 1), (64, 1), (3, 1), (20, 7)], num_heads=4, num_kv_heads=2,
                     head_dim=64, block_size=16, seed=3, dtype=torch.bfloat16)
    outs = []
    for name in ("cpu", "torch"):
        backend = make_backend(name, device=CPU, num_heads=4, num_kv_heads=2, head_dim=64,
                               dtype=torch.bfloat16)
        caches = (case.k_cache.clone(), case.v_cache.clone())
        outs.append(backend.prepare(case.meta).forward(case.q, case.k, case.v, caches,
                                                       case.scale))
    torch.testing.assert_close(outs[0].float(), outs[1].float(), atol=2e-2, rtol=2e-2)


# ---- Triton kernels, under the interpreter, in their own process ------------------------------
def test_triton_kernels_under_the_interpreter():
    """tests/workers/triton_interpreted.py in a fresh Python with TRITON_INTERPRET=1: the
    variable must be set before triton is first imported (triton.language's own helpers are
    decorated then), and the rest of this suite must keep compiled kernels on a GPU."""
    pytest.importorskip("triton", reason="triton is not installed (the dev extra has it)")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           str(Path(__file__).with_name("triton_interpreted.py"))]
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, tail
    assert " passed" in tail and " skipped" not in tail, tail
