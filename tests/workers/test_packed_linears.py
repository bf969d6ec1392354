"""oneDNN-packed linear weights on the CPU fp32 path (workers/models/packed.py): which
layers get a packed copy, that a call switches at `min_rows`, that a packed model gives the
plain model's greedy tokens, and that the setting turns it off."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cluster.engine import LocalEngine
from controller.messages import SamplingParams
from workers.models.packed import PackedLinear, maybe_pack
from workers.sections import PackPolicy

POLICY = PackPolicy(min_rows=4, min_elements=1 << 10, any_rows_elements=1 << 16)


def _linear(k: int, n: int) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(k, n, bias=True).requires_grad_(False)


def test_small_weights_stay_plain_and_large_ones_pack_for_any_rows() -> None:
    small = _linear(16, 16)  # 256 elements < min_elements
    assert maybe_pack(small, POLICY) is small
    middle = maybe_pack(_linear(64, 64), POLICY)  # 4096: packed from min_rows
    assert isinstance(middle, PackedLinear) and middle.min_rows == 4
    large = maybe_pack(_linear(256, 512), POLICY)  # 131072 >= any_rows_elements
    assert isinstance(large, PackedLinear) and large.min_rows == 1


@pytest.mark.parametrize("num_rows", [1, 3, 4, 37])
def test_packed_and_plain_calls_agree(num_rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    linear = _linear(64, 96)
    packed = maybe_pack(linear, POLICY)
    assert isinstance(packed, PackedLinear)
    calls: list[int] = []
    real = torch.ops.mkldnn._linear_pointwise

    def counting(*args: object) -> torch.Tensor:
        calls.append(1)
        return real(*args)

    monkeypatch.setattr("workers.models.packed._packed_op", counting)
    x = torch.randn(num_rows, 64)
    torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-5)
    assert len(calls) == (1 if num_rows >= POLICY.min_rows else 0)


def _num_packed(engine: LocalEngine) -> int:
    return sum(isinstance(m, PackedLinear) for m in engine.worker.model.modules())


def test_packed_model_gives_the_plain_models_greedy_tokens() -> None:
    packed = LocalEngine(worker={"model": "builtin:small"})
    plain = LocalEngine(worker={"model": "builtin:small", "cpu_packed_weights": False})
    assert _num_packed(packed) > 0 and _num_packed(plain) == 0
    prompts = [[300 + 7 * i + j for j in range(40 + 9 * i)] for i in range(12)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outputs = [[c.output_token_ids for c in engine.generate(prompts, params)]
               for engine in (packed, plain)]
    assert outputs[0] == outputs[1]
