"""The CPU worker's C++ elementwise layers (workers/kernels/csrc/cpu_layers.cpp) against
torch's operators, and the worker with them against the worker without: same greedy tokens,
logits within fp32 rounding; and glibc told to keep freed memory (workers/cpu_setup.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.workers.helpers import Driver, build_hf_checkpoint, random_ids
from workers.cpu_setup import keep_freed_memory
from workers.kernels.cpu_ops import cpu_ops
from workers.models.llama import RMSNorm, apply_rotary
from workers.worker import RunOptions, Worker

OPS = cpu_ops()
pytestmark = pytest.mark.skipif(OPS is None, reason="the CPU kernels did not build here")


@pytest.mark.parametrize("num_tokens", [1, 7, 300])
def test_rotary_in_place_is_bit_equal_to_the_torch_path(num_tokens):
    heads, kv_heads, hd = 8, 2, 64
    torch.manual_seed(num_tokens)
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * hd) * 3
    freqs = (torch.arange(num_tokens) + 11).float()[:, None] / (
        10000 ** (torch.arange(0, hd, 2).float() / hd))[None, :]
    cos, sin = freqs.cos(), freqs.sin()
    qk = (heads + kv_heads) * hd
    want = apply_rotary(qkv[:, :qk].view(num_tokens, heads + kv_heads, hd), cos, sin)
    got = qkv.clone()
    OPS.rotary_(got, cos, sin, heads + kv_heads, hd)
    assert torch.equal(got[:, :qk].view_as(want), want)
    assert torch.equal(got[:, qk:], qkv[:, qk:])  # v untouched


@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm_adds_in_place_and_normalises_within_rounding(with_delta):
    torch.manual_seed(1)
    norm = RMSNorm(512, 1e-5)
    norm.weight.data = torch.randn(512)
    x, delta = torch.randn(37, 512) * 5, torch.randn(37, 512)
    want_x = x + delta if with_delta else x.clone()
    got_x = x.clone()
    got = OPS.add_rms_norm(got_x, delta if with_delta else None, norm.weight, 1e-5)
    assert torch.equal(got_x, want_x)  # the residual, updated as torch's add_ does
    torch.testing.assert_close(got, norm(want_x), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("width", [1536, 1531, 7])  # whole registers, and a tail
def test_silu_mul_in_place_within_rounding(width):
    torch.manual_seed(2)
    gate, up = torch.randn(5, width) * 6, torch.randn(5, width)
    gate[0, :3] = torch.tensor([-200.0, 200.0, 0.0])  # past exp's clamp both ways
    want = F.silu(gate) * up
    got = gate.clone()
    assert OPS.silu_mul_(got, up).data_ptr() == got.data_ptr()
    torch.testing.assert_close(got, want, rtol=4e-6, atol=1e-6)


def _rel_err(got: torch.Tensor, want: torch.Tensor, floor: float) -> float:
    return float(((got.float() - want).abs() / want.abs().clamp_min(floor)).max())


BF16_ULP = 2.0**-8  # one rounding to bf16 (8 bits of mantissa): relative error <= 2^-9


def test_bf16_layers_compute_in_fp32_and_round_once():
    """bf16: each pass computes in fp32 from the bf16 inputs and rounds once where it stores,
    so it sits within one bf16 rounding of the fp32 result (torch's bf16 operators round
    after each operator, further off)."""
    torch.manual_seed(3)
    x, delta = (torch.randn(37, 512) * 5).bfloat16(), torch.randn(37, 512).bfloat16()
    weight = torch.randn(512).bfloat16()
    got_x = x.clone()
    out = OPS.add_rms_norm(got_x, delta, weight, 1e-5)
    assert out.dtype == torch.bfloat16
    want_x = (x.float() + delta.float()).bfloat16()  # the residual, stored rounded
    assert torch.equal(got_x, want_x)
    xf = want_x.float()
    want = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5) * weight.float()
    assert _rel_err(out, want, 1e-3) <= BF16_ULP
    assert torch.equal(OPS.add_rms_norm(x.clone(), None, weight, 1e-5),
                       OPS.add_rms_norm(x.clone(), torch.zeros_like(x), weight, 1e-5))

    gate, up = (torch.randn(5, 1531) * 6).bfloat16(), torch.randn(5, 1531).bfloat16()
    gate[0, :2] = torch.tensor([-200.0, 200.0])
    want = F.silu(gate.float()) * up.float()
    got = gate.clone()
    assert OPS.silu_mul_(got, up).data_ptr() == got.data_ptr()
    assert _rel_err(got, want, 1e-3) <= BF16_ULP

    heads, kv_heads, hd, num_tokens = 8, 2, 64, 37
    qkv = (torch.randn(num_tokens, (heads + 2 * kv_heads) * hd) * 3).bfloat16()
    freqs = (torch.arange(num_tokens) + 11).float()[:, None] / (
        10000 ** (torch.arange(0, hd, 2).float() / hd))[None, :]
    qk = (heads + kv_heads) * hd
    want = apply_rotary(qkv[:, :qk].float().view(num_tokens, heads + kv_heads, hd),
                        freqs.cos(), freqs.sin())
    got = qkv.clone()
    OPS.rotary_(got, freqs.cos(), freqs.sin(), heads + kv_heads, hd)
    assert torch.equal(got[:, :qk].view_as(want), want.bfloat16())  # fp32, rounded once
    assert torch.equal(got[:, qk:], qkv[:, qk:])  # v untouched


def test_the_layers_refuse_mixed_or_other_dtypes():
    x = torch.randn(3, 64)
    with pytest.raises(RuntimeError, match="one dtype"):
        OPS.silu_mul_(x.bfloat16(), x)
    with pytest.raises(RuntimeError, match="fp32 or bf16"):
        OPS.add_rms_norm(x.half(), None, torch.ones(64).half(), 1e-5)
    with pytest.raises(RuntimeError, match="bf16"):
        OPS.add_rms_norm(x.bfloat16(), None, torch.ones(64), 1e-5)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return build_hf_checkpoint("llama", tmp_path_factory.mktemp("hf") / "llama",
                               num_hidden_layers=3)


def test_a_worker_with_the_fused_layers_gives_the_operators_tokens(checkpoint):
    """Chunked prefills and decodes, fused against torch's operators on the same weights:
    the same greedy ids, logits within fp32 rounding; the worker picks the fused layers by
    default on CPU fp32, and not when asked not to."""
    runs = []
    for fused in (True, False):
        worker = Worker(str(checkpoint), num_kv_blocks=64, block_size=16, keep_logits=True,
                        run=RunOptions(fused_layers=fused))
        assert (worker.model.cpu_layers is not None) == fused
        driver = Driver(worker)
        for i, n in enumerate((5, 40, 77)):
            driver.add(f"r{i}", random_ids(n, seed=500 + i))
        logits = []
        for step in ({"r0": 5, "r1": 40, "r2": 32}, {"r0": 1, "r1": 1, "r2": 45},
                     *[{"r0": 1, "r1": 1, "r2": 1}] * 12):
            driver.step(step)
            logits += [worker.span_logits[rid] for rid in step]
        runs.append((logits, driver.tokens))
    (fused_logits, fused_tokens), (plain_logits, plain_tokens) = runs
    assert fused_tokens == plain_tokens
    for a, b in zip(fused_logits, plain_logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_glibc_keeps_freed_memory_when_asked():
    """mallopt answers 1 for each setting on glibc (this machine's C library)."""
    assert keep_freed_memory()


def test_the_kernels_exp_is_within_two_ulp_of_torch_over_its_range():
    """The exp every CPU kernel uses (cpu_vec.h: the attention softmaxes, SiLU), scalar form:
    relative error under 2.5e-7 over [-87, 88]; clamped outside (no inf, no nan)."""
    x = torch.linspace(-87.0, 88.0, 200_001)
    got, want = OPS.exp_clamped(x), torch.exp(x.double())
    assert ((got.double() - want).abs() / want).max().item() < 2.5e-7
    edges = OPS.exp_clamped(torch.tensor([-1e4, -200.0, 200.0, 1e4]))
    assert torch.isfinite(edges).all() and (edges[:2] < 1e-37).all()
