"""The fused layer kernels against the torch path, under the Triton interpreter (on CPU).

Not collected by the suite itself: tests/workers/test_fused_kernels.py runs this file in a
fresh Python with TRITON_INTERPRET=1. fp32: equal to the torch path within float rounding of
a different summation order; fp16: within a unit or two of fp16's last place.
"""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 from the start (test_fused_kernels.py sets it)",
                allow_module_level=True)
pytest.importorskip("triton", reason="triton is not installed (the dev extra has it)")

from tests.workers.attention_cases import fix_interpreter_scalars, make_case
from workers.attention import triton_kernels as attention_kernels
from workers.attention.triton_backend import LaunchConfig, TritonBackend
from workers.kernels import fused
from workers.models.llama import RMSNorm, apply_rotary

fix_interpreter_scalars()
CPU = torch.device("cpu")
# (dtype, atol, rtol): fp32 tight; fp16 a couple of its ulps (2^-10 relative).
TOLERANCES = [(torch.float32, 1e-6, 1e-6), (torch.float16, 2e-3, 2e-3)]
IDS = ["fp32", "fp16"]


@pytest.mark.parametrize(("dtype", "atol", "rtol"), TOLERANCES, ids=IDS)
@pytest.mark.parametrize("hidden", [64, 96])  # a power of two; one needing a masked tail
def test_add_rmsnorm_matches_torch(dtype, atol, rtol, hidden):
    gen = torch.Generator().manual_seed(hidden)
    residual = torch.randn(5, hidden, generator=gen).to(dtype)
    delta = torch.randn(5, hidden, generator=gen).to(dtype)
    norm = RMSNorm(hidden, 1e-5)
    norm.weight.data = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    with torch.no_grad():
        want_residual = residual.clone().add_(delta)
        want = norm(want_residual)
        want_first = norm(residual)
    got_residual = residual.clone()
    got = fused.add_rmsnorm(delta, got_residual, norm.weight.data, 1e-5)
    assert torch.equal(got_residual, want_residual)  # one rounding of the sum, as torch's add_
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
    untouched = residual.clone()
    first = fused.add_rmsnorm(None, untouched, norm.weight.data, 1e-5)
    assert torch.equal(untouched, residual)
    torch.testing.assert_close(first, want_first, atol=atol, rtol=rtol)


@pytest.mark.parametrize(("dtype", "atol", "rtol"), TOLERANCES, ids=IDS)
@pytest.mark.parametrize("inter", [48, 1500])  # one block, masked; two blocks of 1024
def test_silu_mul_matches_torch(dtype, atol, rtol, inter):
    gate_up = (3 * torch.randn(4, 2 * inter, generator=torch.Generator().manual_seed(1))
               ).to(dtype)
    want = torch.nn.functional.silu(gate_up[:, :inter]).mul_(gate_up[:, inter:])
    torch.testing.assert_close(fused.silu_mul(gate_up), want, atol=atol, rtol=rtol)


@pytest.mark.parametrize(("dtype", "atol", "rtol"), TOLERANCES, ids=IDS)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(4, 2, 16), (3, 3, 24)],
                         ids=["gqa", "mha-odd"])
def test_rope_write_kv_matches_rotary_then_write(dtype, atol, rtol, num_heads, num_kv_heads,
                                                 head_dim):
    case = make_case([(3, 1), (0, 5), (20, 4)], num_heads=num_heads, num_kv_heads=num_kv_heads,
                     head_dim=head_dim, block_size=16, dtype=dtype)
    meta = case.meta
    qkv = case.q.as_strided((meta.num_tokens, (num_heads + 2 * num_kv_heads) * head_dim),
                            (case.q.stride(0), 1))
    slots = meta.slot_mapping.clone()
    slots[1] = -1  # a padding row: nothing written
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    freqs = torch.arange(64).float()[:, None] * inv_freq[None, :]
    cos, sin = freqs.cos().to(dtype), freqs.sin().to(dtype)
    cos_sin = torch.cat((cos.float(), sin.float()), dim=-1)
    # The torch path: rotary over q and k in the model dtype, then the indexed write.
    c, s = cos[meta.positions], sin[meta.positions]
    want_q, want_k = apply_rotary(case.q, c, s), apply_rotary(case.k, c, s)
    want_kc, want_vc = case.k_cache.clone(), case.v_cache.clone()
    keep = slots >= 0
    want_kc.view(-1, num_kv_heads, head_dim).index_copy_(0, slots[keep], want_k[keep])
    want_vc.view(-1, num_kv_heads, head_dim).index_copy_(0, slots[keep], case.v[keep])
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    q = attention_kernels.rope_write_kv(qkv, cos_sin, meta.positions, slots, k_cache, v_cache,
                                        num_heads)
    torch.testing.assert_close(q, want_q, atol=atol, rtol=rtol)
    torch.testing.assert_close(k_cache, want_kc, atol=atol, rtol=rtol)
    assert torch.equal(v_cache, want_vc)


def _triton_backend(num_heads, num_kv_heads, head_dim):
    cfg = LaunchConfig(block_m=16, tile_n=16)
    return TritonBackend(num_heads, num_kv_heads, head_dim, torch.float32, CPU, num_sms=4,
                         decode_config=cfg, prefill_config=cfg, split_config=cfg)


def test_fused_model_equals_the_torch_path():
    """builtin:tiny through `FusedLlama` on the Triton backend vs `LlamaForCausalLM` on the
    torch backend, over a mixed step (decodes over cached context, chunks) and then a
    decode-only one: same hidden states (fp32), same caches."""
    from tests.workers.helpers import Driver, random_ids
    from workers.kernels.fused_llama import FusedLlama
    from workers.worker import Worker

    prompts = {rid: random_ids(n, i, 512) for i, (rid, n) in enumerate(
        [("a", 20), ("b", 12), ("c", 35)])}
    schedule = [{"a": 20, "b": 12, "c": 16}, {"a": 1, "b": 1, "c": 19}, {"a": 1, "b": 1, "c": 1}]
    runs = []
    for is_fused in (False, True):
        worker = Worker("builtin:tiny", num_kv_blocks=32, block_size=16, keep_logits=True)
        if is_fused:
            cfg = worker.model_config
            worker.backend = _triton_backend(cfg.num_attention_heads, cfg.num_key_value_heads,
                                             cfg.head_dim)
            worker.forward = FusedLlama(worker.model)
        driver = Driver(worker)
        for rid, ids in prompts.items():
            driver.add(rid, ids)
        logits = []
        for step in schedule:
            driver.step(step)
            logits += [worker.span_logits[rid] for rid in step]
        runs.append((logits, driver.tokens, worker.kv_caches))
    (want, want_tokens, want_kv), (got, got_tokens, got_kv) = runs
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-5)
    assert got_tokens == want_tokens
    for (k1, v1), (k2, v2) in zip(got_kv, want_kv, strict=True):
        torch.testing.assert_close(k1, k2, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v1, v2, atol=1e-5, rtol=1e-5)


def test_the_benchmarks_kernel_check_passes_on_the_triton_path():
    """The GPU benchmark's kernel check (benchmarks/gpu_smoke.py), its Triton branch, at a
    small shape: what the device's smoke phase runs reports every kernel within tolerance."""
    from benchmarks.gpu_smoke import kernel_check

    report = kernel_check(4, 2, 16, 64, 96, 16, CPU, triton=True,
                          shape=[(40, 1), (3, 1), (0, 1), (20, 9), (0, 13)],
                          dtypes=(torch.float32, torch.float16))
    assert report["all_ok"], report
    assert len(report["fused"]) == 2 and "triton_split_vs_torch_max_err" in report["attention"][0]
