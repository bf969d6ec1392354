"""oneDNN-packed linear weights on the CPU fp32 path (workers/models/packed.py): which
layers get a packed copy, that a call switches at `min_rows`, that the C++ decode GEMM
(workers/kernels/csrc/cpu_gemm.cpp) takes calls up to `decode_max_rows` and agrees with the
plain GEMM on every tile shape, that a packed model gives the plain model's greedy tokens,
and that the settings turn them off."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from cluster.engine import LocalEngine
from controller.messages import SamplingParams
from workers.kernels.cpu_ops import cpu_ops
from workers.models.packed import PackedLinear, maybe_pack
from workers.sections import PackPolicy

POLICY = PackPolicy(min_rows=4, min_elements=1 << 10, any_rows_elements=1 << 16,
                    decode_max_rows=0)


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


needs_kernels = pytest.mark.skipif(cpu_ops() is None, reason="the CPU kernels did not build")


@needs_kernels
@pytest.mark.parametrize("num_rows", [1, 3, 5, 13, 14, 19, 32, 33, 64, 65])
def test_the_decode_gemm_takes_calls_up_to_its_rows(num_rows: int,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Every tile shape (14 rows, 4, 1 with AVX-512; 6, 4, 1 below) and the bias; oneDNN's
    packed kernel past `decode_max_rows`."""
    monkeypatch.setattr("workers.models.packed.decode_gemm_preferred", lambda ops: True)
    policy = dataclasses.replace(POLICY, decode_max_rows=64)
    linear = _linear(160, 96)  # K not a multiple of the register width, N of the block
    packed = maybe_pack(linear, policy)
    assert isinstance(packed, PackedLinear) and packed.decode_packed is not None
    calls: list[int] = []
    real = cpu_ops().decode_linear

    class Counting:
        def decode_linear(self, *args: object) -> torch.Tensor:
            calls.append(1)
            return real(*args)

    monkeypatch.setattr("workers.models.packed.cpu_ops", Counting)
    x = torch.randn(num_rows, 160)
    torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-5)
    assert len(calls) == (1 if num_rows <= 64 else 0)


@needs_kernels
def test_no_decode_gemm_where_the_outputs_are_not_whole_blocks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("workers.models.packed.decode_gemm_preferred", lambda ops: True)
    policy = dataclasses.replace(POLICY, decode_max_rows=64)
    block = cpu_ops().decode_gemm_block()
    odd = maybe_pack(_linear(64, 3 * block + 8), policy)
    assert isinstance(odd, PackedLinear) and odd.decode_packed is None
    assert maybe_pack(_linear(64, 3 * block), policy).decode_packed is not None
    assert maybe_pack(_linear(64, 3 * block), POLICY).decode_packed is None  # turned off
    monkeypatch.setattr("workers.models.packed.decode_gemm_preferred", lambda ops: False)
    assert maybe_pack(_linear(64, 3 * block), policy).decode_packed is None  # not here


@needs_kernels
@pytest.mark.parametrize("num_rows", [1, 7, 8, 9, 40])
def test_a_weight_too_small_for_onednn_keeps_only_the_decode_gemm(
        num_rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under `min_elements` no oneDNN copy is made (its call never runs), but the decode
    GEMM's is, so a model of small layers still gets the decode stack; past its rows the
    plain GEMM."""
    monkeypatch.setattr("workers.models.packed.decode_gemm_preferred", lambda ops: True)
    policy = dataclasses.replace(POLICY, min_elements=1 << 20, decode_max_rows=8)
    block = cpu_ops().decode_gemm_block()
    linear = _linear(48, 2 * block)
    small = maybe_pack(linear, policy)
    assert isinstance(small, PackedLinear)
    assert small.packed is None and small.decode_packed is not None
    onednn: list[int] = []
    monkeypatch.setattr("workers.models.packed._packed_op",
                        lambda *args: onednn.append(1))  # type: ignore[func-returns-value]
    x = torch.randn(num_rows, 48)
    torch.testing.assert_close(small(x), linear(x), rtol=1e-5, atol=1e-5)
    assert not onednn
    odd = _linear(48, 2 * block + 4)  # no decode copy either: stays an nn.Linear
    assert maybe_pack(odd, policy) is odd


@needs_kernels
def test_a_failed_onednn_copy_keeps_the_decode_gemm(monkeypatch: pytest.MonkeyPatch) -> None:
    """A weight large enough for oneDNN whose copy fails (a torch build without the op)
    still gets the decode GEMM's copy: the two are decided apart."""
    monkeypatch.setattr("workers.models.packed.decode_gemm_preferred", lambda ops: True)
    monkeypatch.setattr("workers.models.packed.pack_weight", lambda weight: None)
    policy = dataclasses.replace(POLICY, decode_max_rows=8)
    block = cpu_ops().decode_gemm_block()
    linear = _linear(64, 2 * block)
    large = maybe_pack(linear, policy)
    assert isinstance(large, PackedLinear)
    assert large.packed is None and large.decode_packed is not None
    x = torch.randn(5, 64)
    torch.testing.assert_close(large(x), linear(x), rtol=1e-5, atol=1e-5)
    assert maybe_pack(linear, POLICY) is linear  # neither copy: the plain layer


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
