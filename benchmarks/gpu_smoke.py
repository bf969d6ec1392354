"""The GPU benchmark's kernel check: the device's kernels against the torch path, in seconds.

On CUDA: the Triton attention backend against the torch one (SDPA) on a random mixed step
(decodes over long and short contexts, chunks over cached context), at the benchmark
model's head shape, fp32 and bf16; and each fused layer kernel (residual-add + RMSNorm,
rotary + KV write, SiLU·mul) against the torch ops it replaces. Elsewhere only the torch
backend against a float64 reference runs (the Triton kernels are tested on CPU under the
interpreter by the test suite). Returns max errors and whether each is within tolerance;
never raises for a mismatch (the report says it), only for a crash.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from workers.attention import HostStaging, SeqSpan, StepMetadata
from workers.attention.torch_backend import TorchBackend
from workers.models.llama import RMSNorm, apply_rotary

# (num_computed, num_query_tokens) per sequence: decodes first (long, split-K territory, and
# short), then chunks over cached context and a fresh prompt.
SHAPE = [(1500, 1), (300, 1), (15, 1), (0, 1), (700, 200), (64, 64), (0, 133)]
# (atol, rtol): |got - want| <= atol + rtol |want| (bf16: a few units of its last place).
TOLERANCE = {torch.float32: (1e-4, 1e-4), torch.float16: (5e-3, 5e-3),
             torch.bfloat16: (2e-2, 2e-2)}
DTYPES = (torch.float32, torch.bfloat16)


def random_step(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
          dtype: torch.dtype, device: torch.device, seed: int = 0,
          shape: list[tuple[int, int]] = SHAPE) -> dict[str, Any]:
    """A random paged step: `shape` is (num_computed, num_query_tokens) per sequence in the
    worker's order; blocks a random permutation of the pool; the metadata built as the
    worker builds it. Returns spans, meta, qkv [T, (H + 2 Hkv) hd] and the caches (random
    K/V in every slot, i.e. every computed token)."""
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    blocks_per_seq = [-(-(done + n) // block_size) for done, n in shape]
    num_blocks = sum(blocks_per_seq) + 1
    order = rng.permutation(num_blocks)
    spans, start, used = [], 0, 0
    for (done, n), nb in zip(shape, blocks_per_seq, strict=True):
        spans.append(SeqSpan(start, n, done + n, order[used : used + nb].astype(np.int64)))
        start, used = start + n, used + nb
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype).to(device)
    v_cache = torch.randn(shape, generator=gen).to(dtype).to(device)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(start, width, generator=gen).to(dtype).to(device)
    meta = StepMetadata.build(spans, np.zeros(start, np.int64), block_size,
                              HostStaging(device))
    return {"spans": spans, "meta": meta, "qkv": qkv, "k_cache": k_cache, "v_cache": v_cache}


def _split(qkv: Tensor, num_heads: int, num_kv_heads: int, head_dim: int
           ) -> tuple[Tensor, Tensor, Tensor]:
    q = qkv[:, : num_heads * head_dim].view(-1, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(
        -1, num_kv_heads, head_dim)
    v = qkv[:, (num_heads + num_kv_heads) * head_dim :].view(-1, num_kv_heads, head_dim)
    return q, k, v


def _float64_attention(case: dict[str, Any], q: Tensor, k: Tensor, v: Tensor,
                       scale: float) -> Tensor:
    """Per sequence, causal, in float64 on the CPU (the caches as the step writes them)."""
    k_cache, v_cache = case["k_cache"].double().cpu(), case["v_cache"].double().cpu()
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    flat_k, flat_v = k_cache.view(-1, num_kv_heads, head_dim), v_cache.view(-1, num_kv_heads,
                                                                            head_dim)
    slots = case["meta"].slot_mapping.cpu()
    flat_k[slots], flat_v[slots] = k.double().cpu(), v.double().cpu()
    group = q.shape[1] // num_kv_heads
    out = torch.zeros(q.shape, dtype=torch.float64)
    for span in case["spans"]:
        ctx, n = span.context_len, span.num_query_tokens
        key_slots = torch.tensor([int(span.block_ids[j // block_size]) * block_size
                                  + j % block_size for j in range(ctx)])
        keys = flat_k[key_slots].repeat_interleave(group, 1).transpose(0, 1)  # [H, ctx, hd]
        values = flat_v[key_slots].repeat_interleave(group, 1).transpose(0, 1)
        rows = q[span.query_start : span.query_start + n].double().cpu().transpose(0, 1)
        scores = rows @ keys.transpose(1, 2) * scale  # [H, n, ctx]
        visible = torch.arange(ctx)[None, :] <= (ctx - n + torch.arange(n))[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        out[span.query_start : span.query_start + n] = (scores.softmax(-1) @ values).transpose(
            0, 1)
    return out


def _err(got: Tensor, want: Tensor, dtype: torch.dtype, failures: list[str], name: str
         ) -> float:
    """-> max |got - want|; `name` appended to `failures` if outside TOLERANCE[dtype]."""
    atol, rtol = TOLERANCE[dtype]
    got, want = got.double().cpu(), want.double().cpu()
    diff = (got - want).abs()
    if bool((diff > atol + rtol * want.abs()).any()) or not bool(torch.isfinite(got).all()):
        failures.append(name)
    return float(diff.max())


def check_attention(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                    dtype: torch.dtype, device: torch.device, triton: bool,
                    shape: list[tuple[int, int]] = SHAPE) -> dict[str, Any]:
    """The Triton attention backend against the torch one (`triton`), else the torch one
    against a float64 reference."""
    case = random_step(num_heads, num_kv_heads, head_dim, block_size, dtype, device, shape=shape)
    q, k, v = _split(case["qkv"], num_heads, num_kv_heads, head_dim)
    scale = head_dim**-0.5

    def run(backend: Any) -> Tensor:
        caches = (case["k_cache"].clone(), case["v_cache"].clone())
        return backend.prepare(case["meta"]).forward(q, k, v, caches, scale)

    torch_out = run(TorchBackend(dtype, num_kv_heads, head_dim))
    result: dict[str, Any] = {"dtype": str(dtype).removeprefix("torch."),
                              "tolerance": TOLERANCE[dtype]}
    failures: list[str] = []
    if triton:
        from workers.attention.triton_backend import TritonBackend

        # One SM: decodes on the unified kernel; many: split-K decodes.
        for name, num_sms in (("triton_unified", 1), ("triton_split", 10_000)):
            backend = TritonBackend(num_heads, num_kv_heads, head_dim, dtype, device,
                                    num_sms=num_sms)
            result[f"{name}_vs_torch_max_err"] = _err(run(backend), torch_out, dtype,
                                                      failures, name)
    else:
        result["torch_vs_float64_max_err"] = _err(
            torch_out, _float64_attention(case, q, k, v, scale), dtype, failures, "torch")
    result["failures"], result["ok"] = failures, not failures
    return result


def check_fused(hidden: int, inter: int, num_heads: int, num_kv_heads: int, head_dim: int,
                dtype: torch.dtype, device: torch.device,
                shape: list[tuple[int, int]] = SHAPE) -> dict[str, Any]:
    """Each fused layer kernel against the torch ops it replaces."""
    from workers.attention.triton_kernels import rope_write_kv
    from workers.kernels import fused

    gen = torch.Generator().manual_seed(1)
    failures: list[str] = []

    def randn(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen).to(dtype).to(device)

    result: dict[str, Any] = {"dtype": str(dtype).removeprefix("torch."),
                              "tolerance": TOLERANCE[dtype]}
    residual, delta = randn(37, hidden), randn(37, hidden)
    norm = RMSNorm(hidden, 1e-5).to(device=device, dtype=dtype)
    with torch.inference_mode():
        want_residual = residual.clone().add_(delta)
        want = norm(want_residual)
        got_residual = residual.clone()
        got = fused.add_rmsnorm(delta, got_residual, norm.weight, 1e-5)
        result["add_rmsnorm_max_err"] = max(
            _err(got, want, dtype, failures, "add_rmsnorm"),
            _err(got_residual, want_residual, dtype, failures, "add_rmsnorm residual"))
        gate_up = randn(37, 2 * inter)
        want = F.silu(gate_up[:, :inter]).mul_(gate_up[:, inter:])
        result["silu_mul_max_err"] = _err(fused.silu_mul(gate_up), want, dtype, failures,
                                          "silu_mul")
        case = random_step(num_heads, num_kv_heads, head_dim, 16, dtype, device, seed=2,
                           shape=shape)
        meta = case["meta"]
        inv_freq = 1.0 / 10000.0 ** (torch.arange(0, head_dim, 2, device=device).float()
                                     / head_dim)
        freqs = torch.arange(4096, device=device).float()[:, None] * inv_freq[None, :]
        cos, sin = freqs.cos().to(dtype), freqs.sin().to(dtype)
        q, k, _ = _split(case["qkv"], num_heads, num_kv_heads, head_dim)
        c, s = cos[meta.positions], sin[meta.positions]
        want_q, want_k = apply_rotary(q, c, s), apply_rotary(k, c, s)
        k_cache = case["k_cache"].clone()
        got_q = rope_write_kv(case["qkv"], torch.cat((cos.float(), sin.float()), -1),
                              meta.positions, meta.slot_mapping, k_cache,
                              case["v_cache"].clone(), num_heads)
        got_k = k_cache.view(-1, num_kv_heads, head_dim)[meta.slot_mapping]
        result["rope_write_kv_max_err"] = max(
            _err(got_q, want_q, dtype, failures, "rope_write_kv q"),
            _err(got_k, want_k, dtype, failures, "rope_write_kv k"))
    result["failures"], result["ok"] = failures, not failures
    return result


def kernel_check(num_heads: int, num_kv_heads: int, head_dim: int, hidden: int, inter: int,
                 block_size: int, device: torch.device, triton: bool | None = None,
                 shape: list[tuple[int, int]] = SHAPE,
                 dtypes: tuple[torch.dtype, ...] = DTYPES) -> dict[str, Any]:
    """`triton`: check the Triton kernels (default: on CUDA; the tests run them on CPU under
    the interpreter, in fp32 and fp16: it has no bf16)."""
    triton = device.type == "cuda" if triton is None else triton
    report: dict[str, Any] = {"attention": [
        check_attention(num_heads, num_kv_heads, head_dim, block_size, dtype, device, triton,
                        shape) for dtype in dtypes]}
    checks = list(report["attention"])
    if triton:
        report["fused"] = [check_fused(hidden, inter, num_heads, num_kv_heads, head_dim, dtype,
                                       device, shape) for dtype in dtypes]
        checks += report["fused"]
    else:
        report["fused"] = "Triton only (tests/workers/fused_interpreted.py covers it on CPU)"
    report["all_ok"] = all(c["ok"] for c in checks)
    return report
