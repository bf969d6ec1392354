"""The fused layers of the CUDA path, on CPU: their kernels under the Triton interpreter
(fused_interpreted.py, in its own process) and the kernels per decode step, counted by
dispatch over the CUDA path's code on meta tensors (workers/kernels/dispatch_count.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from workers.kernels.dispatch_count import count_decode_kernels
from workers.model_config import ModelConfig
from workers.presets import PresetSpec, preset_config_dict

# The GPU benchmark's Llama-1B shape (benchmarks/gpu_bench.py: LLAMA_1B).
LLAMA_1B = PresetSpec(2048, 16, 32, 8, 8192, 32000, max_position_embeddings=32768, seed=3)
MAX_KERNELS_PER_LAYER = 12  # the GPU issue's target for a decode step


def test_fused_kernels_under_the_interpreter():
    pytest.importorskip("triton", reason="triton is not installed (the dev extra has it)")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           str(Path(__file__).with_name("fused_interpreted.py"))]
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, tail
    assert " passed" in tail and " skipped" not in tail, tail


@pytest.mark.parametrize("batch", [64, 4])  # unified decode kernel; split-K (two launches)
def test_decode_step_kernels_per_layer(batch):
    cfg = ModelConfig.from_dict(preset_config_dict(LLAMA_1B))
    fused = count_decode_kernels(cfg, batch, 1024)
    assert fused["per_layer"] <= MAX_KERNELS_PER_LAYER, fused["per_layer_ops"]
    ops = fused["per_layer_ops"]
    assert ops["aten::mm"] == 4  # qkv, o, merged gate/up, down
    assert ops["triton::add_rmsnorm"] == 2 and ops["triton::rope_write_kv"] == 1
    assert ops["triton::silu_mul"] == 1
    attention = 1 if batch == 64 else 2  # 64 x 8 programs fill 132 SMs; 4 x 8 split
    assert fused["per_layer"] == 8 + attention
    assert fused["per_step"] == cfg.num_hidden_layers * fused["per_layer"] + \
        fused["outside_layers"]
    # The counter sees the torch layers' many small ops: what the fusion removed.
    unfused = count_decode_kernels(cfg, batch, 1024, fused=False)
    assert unfused["per_layer"] >= 3 * fused["per_layer"], unfused["per_layer_ops"]


def test_mixed_step_dispatches_under_a_third_of_the_ops():
    """A mixed step runs eagerly: every counted kernel is an op the host dispatches. 32
    decodes and a 2,048-token chunk at depth 8,192 (the GPU benchmark's mixed step)."""
    cfg = ModelConfig.from_dict(preset_config_dict(LLAMA_1B))
    fused = count_decode_kernels(cfg, 32, 256, chunk=(8192, 2048))
    unfused = count_decode_kernels(cfg, 32, 256, fused=False, chunk=(8192, 2048))
    # Decodes and the chunk: two attention launches (decode and prefill programs).
    assert fused["per_layer_ops"]["triton::unified_attention"] == 2
    assert fused["per_layer"] == 10 and 3 * fused["per_step"] <= unfused["per_step"]
