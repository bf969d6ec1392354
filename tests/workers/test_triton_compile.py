"""The Triton kernels compile for Hopper (sm_90a) at the backend's launch sizes, on CPU.

Triton compiles without a GPU when given the target; its bundled ptxas then reports registers
and spills. This catches what the interpreter cannot (types of loop-carried values, layouts,
tensor-core shapes) and register spills, the first thing that makes a kernel slow. Arguments
are typed the way the JIT launcher specialises them at run time: pointers and the strides it
sees divisible by 16 carry that hint (it enables 16-byte vector loads), the `do_not_specialize`
ones do not.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not installed (the dev extra has it)")

PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
if not PTXAS.exists():
    pytest.skip("triton's bundled ptxas is missing", allow_module_level=True)

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from workers.attention import triton_kernels as K  # noqa: E402
from workers.attention.triton_backend import default_configs  # noqa: E402

TYPES = {torch.bfloat16: "bf16", torch.float32: "fp32"}
INDEX_PTRS = ("query_start_ptr", "seq_lens_ptr", "block_table_ptr", "slot_ptr", "pos_ptr")
FP32_PTRS = ("cos_sin_ptr",)


def compile_kernel(fn, dtype: torch.dtype, constexprs: dict, num_warps: int,
                   num_stages: int) -> dict:
    """Compile `fn` for sm_90a -> {"registers", "spill_bytes", "shared"}."""
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        if name.endswith("_ptr"):
            kind = ("*i64" if name in INDEX_PTRS
                    else "*fp32" if name.startswith("part_") or name in FP32_PTRS
                    else f"*{TYPES[dtype]}")
        else:
            kind = "fp32" if name.startswith("scale") or name == "eps" else "i32"
        signature[name] = kind
        if kind != "fp32" and name not in fn.do_not_specialize and i not in fn.do_not_specialize:
            attrs[(i,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})
    proc = subprocess.run([str(PTXAS), "-arch=sm_90a", "-v", "-", "-o", "/dev/null"],
                          input=compiled.asm["ptx"], capture_output=True, text=True, check=True)
    registers = int(re.search(r"Used (\d+) registers", proc.stderr).group(1))
    spills = sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", proc.stderr))
    return {"registers": registers, "spill_bytes": spills, "shared": compiled.metadata.shared}


@pytest.mark.parametrize(("dtype", "head_dim"), [
    (torch.bfloat16, 64), (torch.bfloat16, 128), (torch.float32, 128)
], ids=["bf16-64", "bf16-128", "fp32-128"])
def test_kernels_compile_for_hopper_without_spills(dtype, head_dim):
    group = 4  # Llama-1B/8B-like GQA
    decode, prefill, split = default_configs(group, head_dim, dtype)
    dims = dict(GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_P=max(K.next_pow2(head_dim), 16),
                BLOCK_SIZE=16)
    precision = "ieee" if dtype == torch.float32 else "tf32"
    results = {}
    for name, cfg in (("decode", decode), ("prefill", prefill)):
        results[name] = compile_kernel(
            K._unified_attention_kernel, dtype,
            {**dims, "BLOCK_M": cfg.block_m, "BLOCK_Q": cfg.block_m // group,
             "TILE_N": cfg.tile_n, "PRECISION": precision}, cfg.num_warps, cfg.num_stages)
    results["split"] = compile_kernel(
        K._split_decode_kernel, dtype,
        {**dims, "BLOCK_H": split.block_m, "TILE_N": split.tile_n,
         "MAX_SPLITS": K.MAX_SPLITS, "PRECISION": precision}, split.num_warps, split.num_stages)
    results["merge"] = compile_kernel(
        K._split_merge_kernel, dtype,
        {"HEAD_DIM": head_dim, "HEAD_DIM_P": dims["HEAD_DIM_P"], "MAX_SPLITS": K.MAX_SPLITS},
        1, 1)
    results["write_kv"] = compile_kernel(
        K._write_kv_kernel, dtype,
        {"NUM_KV_HEADS": 8, "HEAD_DIM": head_dim, "BLOCK": K.next_pow2(8 * head_dim)}, 4, 1)
    spilled = {name: r for name, r in results.items() if r["spill_bytes"]}
    assert not spilled, f"register spills at the default launch sizes: {spilled}"
    assert all(r["shared"] <= 227 * 1024 for r in results.values()), results  # sm_90's limit


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize(("hidden", "num_heads", "num_kv_heads", "head_dim", "inter"), [
    (2048, 32, 8, 64, 8192), (4096, 32, 8, 128, 14336)], ids=["llama-1b", "llama-8b"])
def test_fused_layer_kernels_compile_for_hopper_without_spills(dtype, hidden, num_heads,
                                                               num_kv_heads, head_dim, inter):
    """The fused layer's kernels (workers/kernels/fused.py, rope_write_kv) at the sizes their
    wrappers launch them with for Llama-1B and -8B shapes."""
    from workers.kernels import fused as F

    block = F.next_pow2(hidden)
    half = head_dim // 2
    results = {
        "add_rmsnorm": compile_kernel(
            F._add_rmsnorm_kernel, dtype, {"N": hidden, "BLOCK": block, "HAS_DELTA": True},
            8 if block >= 4096 else 4, 1),
        "silu_mul": compile_kernel(
            F._silu_mul_kernel, dtype, {"INTER": inter, "BLOCK": F.SILU_BLOCK}, 4, 1),
        "rope_write_kv": compile_kernel(
            K._rope_write_kv_kernel, dtype,
            {"NUM_HEADS": num_heads, "NUM_KV_HEADS": num_kv_heads, "HEAD_DIM": head_dim,
             "HALF": half, "HALF_P": K.next_pow2(half), "HEADS_P": K.next_pow2(num_heads),
             "KV_HEADS_P": K.next_pow2(num_kv_heads)}, 4, 1),
    }
    spilled = {name: r for name, r in results.items() if r["spill_bytes"]}
    assert not spilled, f"register spills at the wrappers' launch sizes: {spilled}"
