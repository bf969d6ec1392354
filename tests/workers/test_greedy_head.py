"""The screen of a CPU fp32 lm_head for greedy rows (workers/greedy_head.py): its ids equal
the fp32 argmax on peaked, flat, tied and NaN rows with each of its GEMMs; a worker that
uses it decodes token by token as transformers' `generate`, and a step where a request
needs logits (log-probs, a random sample) takes the fp32 path.

The screen is built where the lm_head is large and the CPU has bf16 units (bf16) or AVX2
(int16); the tests build it anyway where they can (the size patched; oneDNN packs bf16
where it has AVX-512 and emulates it without bf16 units: slower, the same values), so the
bound and the fallbacks are checked on every machine where the C++ kernels build (the row
pass is theirs: workers/kernels/csrc/cpu_screen.cpp), with oneDNN's bf16 GEMM where it
packs, the C++ bf16 one where the build has AVX512-BF16 and the int16 one with AVX2."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import workers.greedy_head as greedy_head
from controller.messages import SamplingParams
from tests.workers.helpers import Driver, build_hf_checkpoint, random_ids
from workers.greedy_head import SCREEN_TOP_K, GreedyHead, i16_limits, pack_i16, quantize_rows
from workers.kernels.cpu_ops import cpu_ops
from workers.models.packed import pack_weight
from workers.worker import RunOptions, Worker

VOCAB = 4096

pytestmark = pytest.mark.skipif(cpu_ops() is None, reason="the CPU kernels did not build here")


def _has_own_gemm() -> bool:
    ops = cpu_ops()
    return ops is not None and bool(ops.screen_gemm_available())


def _has_i16() -> bool:
    ops = cpu_ops()
    return ops is not None and bool(ops.screen_i16_available())


@pytest.fixture(params=["onednn", "own", "i16"])
def gemm(request) -> str:
    """The screen's GEMM: oneDNN's bf16 one, the C++ bf16 one (where built with
    AVX512-BF16), or the C++ int16 one (where built with AVX2)."""
    if request.param == "own" and not _has_own_gemm():
        pytest.skip("the C++ screen GEMM needs an AVX512-BF16 build")
    if request.param == "i16" and not _has_i16():
        pytest.skip("the int16 screen needs an AVX2 build")
    return str(request.param)


def _head(weight: torch.Tensor, gemm: str = "onednn") -> GreedyHead:
    ops = cpu_ops()
    if gemm == "own":
        return GreedyHead(weight, ops.pack_screen_weight(weight.bfloat16()), ops, gemm="own")
    if gemm == "i16":
        q, scale = quantize_rows(weight, i16_limits(weight.shape[1])[0])
        return GreedyHead(weight, pack_i16(q), ops, gemm="i16", w_scale=scale)
    packed = pack_weight(weight.bfloat16(), batch_hint=32)
    if packed is None:
        pytest.skip("this torch build cannot pack a bf16 weight for oneDNN")
    return GreedyHead(weight, packed, ops)


def _argmax(hidden: torch.Tensor, weight: torch.Tensor) -> list[int]:
    return F.linear(hidden, weight).max(dim=1).indices.tolist()


def test_the_ids_are_the_fp32_argmax_on_peaked_rows(gemm):
    torch.manual_seed(0)
    weight = torch.randn(VOCAB + (37 if gemm == "onednn" else 32), 256) * 0.05  # odd vocabs
    hidden = torch.randn(64, 256) * 4.0
    head = _head(weight, gemm)
    assert head.ids(hidden).tolist() == _argmax(hidden, weight)
    assert head.num_rows == 64
    assert head.num_widened_rows < 64  # most rows decided by their top k


def test_the_ids_are_the_fp32_argmax_with_either_gemm(gemm):
    torch.manual_seed(3)
    weight = torch.randn(VOCAB, 256) * 0.05
    hidden = torch.randn(40, 256) * 4.0  # tiles of 12 rows and a short one: 10, 10, 10, 10
    head = _head(weight, gemm)
    assert head.ids(hidden).tolist() == _argmax(hidden, weight)
    assert head.ids(hidden[:5]).tolist() == _argmax(hidden[:5], weight)


@pytest.mark.skipif(not _has_own_gemm(), reason="the C++ screen GEMM needs AVX512-BF16")
@pytest.mark.parametrize("rows", [1, 7, 12, 13, 32, 65])
def test_the_screen_gemm_is_the_bf16_product_rounded_once(rows):
    """The C++ screen GEMM against the exact product of the same bf16 inputs (float64),
    rounded to bf16: within one bf16 rounding of it, plus fp32 sums' error."""
    torch.manual_seed(rows)
    weight = (torch.randn(96, 130) * 0.05).bfloat16()  # K not a multiple of 32
    x = torch.randn(rows, 130).bfloat16()
    ops = cpu_ops()
    got = ops.screen_gemm(x, ops.pack_screen_weight(weight)).double()
    want = F.linear(x.double(), weight.double())
    slack = 2.0**-8 * want.abs() + 130 * 2.0**-23 * F.linear(x.double().abs(),
                                                            weight.double().abs())
    assert got.shape == (rows, 96)
    assert bool(((got - want).abs() <= slack).all())


@pytest.mark.skipif(not _has_i16(), reason="the int16 screen needs an AVX2 build")
@pytest.mark.parametrize(("rows", "width"), [(1, 130), (7, 64), (13, 130), (32, 512), (3, 4096)])
def test_the_int16_screen_is_the_quantized_product_rounded_once(rows, width):
    """The int16 screen against the exact product (float64) of its own quantized inputs,
    rounded to bf16: within one bf16 rounding plus the scaling's three fp32 roundings; the
    input it reports is its own quantization. At the int16 limits (every value at its row's
    largest) the int32 sums do not overflow."""
    torch.manual_seed(rows)
    qmax_w, qmax_x = i16_limits(width)
    assert width * qmax_w * qmax_x < 2**31
    weight = torch.randn(48, width) * 0.05
    x = torch.randn(rows, width)
    x[0] = x[0].abs().max()  # the worst row: every product at the limits, one sign
    weight[5] = weight[5].abs().max()
    q, scale = quantize_rows(weight, qmax_w)
    ops = cpu_ops()
    got, dequantized = ops.screen_i16(x, pack_i16(q), scale, qmax_x)
    t = x.abs().amax(dim=1, keepdim=True) / qmax_x
    p = torch.round(x / t).clamp(-qmax_x, qmax_x)
    assert torch.equal(dequantized, p * t)
    want = F.linear(p.double(), q.double()) * t.double() * scale.double()
    assert bool((want[0, 5] > 0).item())  # the limits' row and weight: no wrap-around
    slack = (2.0**-8 + 4 * 2.0**-24) * want.abs()
    assert got.shape == (rows, 48)
    assert bool(((got.double() - want).abs() <= slack).all())


@pytest.mark.skipif(not _has_i16(), reason="the int16 screen needs an AVX2 build")
@pytest.mark.parametrize("rows", [1, 5, 8, 13, 32])
def test_the_int16_screen_gives_the_bits_of_its_definition(rows):
    """Bit for bit: each output is bf16(fp32(exact int32 sum) * (s_j * t_r in fp32)), rounded
    to nearest even, whichever tiles the build has (AVX2's 4-row tiles of two 256-bit halves
    or AVX-512's 8-row tiles of one register): a CPU's screen does not depend on them."""
    torch.manual_seed(40 + rows)
    width = 512
    qmax_w, qmax_x = i16_limits(width)
    weight = torch.randn(64, width) * 0.05
    x = torch.randn(rows, width) * 3.0
    q, scale = quantize_rows(weight, qmax_w)
    ops = cpu_ops()
    got, _ = ops.screen_i16(x, pack_i16(q), scale, qmax_x)
    t = x.abs().amax(dim=1) / qmax_x
    p = torch.round(x / t[:, None]).clamp(-qmax_x, qmax_x)
    sums = (p.long()[:, None, :] * q.long()[None, :, :]).sum(dim=2)  # exact
    want = (sums.to(torch.int32).float() * (scale[None, :] * t[:, None])).bfloat16()
    assert torch.equal(got, want)


def test_the_own_gemm_only_without_amx(monkeypatch):
    ops = cpu_ops()
    weight = torch.randn(VOCAB, 64)
    monkeypatch.setattr(greedy_head, "has_amx", lambda: True)
    assert not greedy_head.uses_own_gemm(ops, weight)  # oneDNN's AMX tiles there
    monkeypatch.setattr(greedy_head, "has_amx", lambda: False)
    assert greedy_head.uses_own_gemm(ops, weight) == _has_own_gemm()
    assert not greedy_head.uses_own_gemm(ops, torch.randn(VOCAB + 1, 64))  # not its blocks


def test_flat_rows_widen_and_stay_exact(gemm):
    """Logits closer together than the bound: the top k cannot decide, every id within 2e
    of the largest is recomputed in fp32."""
    torch.manual_seed(1)
    base = torch.randn(256)
    weight = base + 1e-4 * torch.randn(VOCAB, 256)  # every id's logit within ~1e-3
    hidden = torch.randn(8, 256)
    head = _head(weight, gemm)
    assert head.ids(hidden).tolist() == _argmax(hidden, weight)
    assert head.num_widened_rows == 8


def test_a_tie_goes_to_the_lowest_id_and_a_nan_row_to_the_fp32_row(gemm):
    torch.manual_seed(2)
    weight = torch.randn(VOCAB, 128) * 0.05
    hidden = torch.randn(3, 128) * 4.0
    best = int(F.linear(hidden[0], weight).argmax())
    # The same row at another id: both are the largest logit.
    twin = (best + 640) % VOCAB
    weight[twin] = weight[best]
    low = min(best, twin)
    hidden[2, 7] = float("nan")
    head = _head(weight, gemm)
    got = head.ids(hidden).tolist()
    assert got == _argmax(hidden, weight)
    assert got[0] == low
    assert head.num_widened_rows >= 1  # the NaN row


def test_no_screen_where_it_cannot_gain(monkeypatch):
    monkeypatch.setattr(greedy_head, "has_bf16_units", lambda: True)
    assert GreedyHead.build(torch.randn(VOCAB, 64)) is None  # a small lm_head
    monkeypatch.setattr(greedy_head, "SCREEN_MIN_ELEMENTS", 0)
    weight = torch.randn(VOCAB, 64)
    # Its bf16 GEMM: the C++ one, or oneDNN's packed one, which needs AVX-512 or AVX-NE-CONVERT
    # (an AVX2 CPU: no bf16 copy); or, without AMX, the int16 one where AVX2.
    ops = cpu_ops()
    has_gemm = ((ops is not None and greedy_head.uses_own_gemm(ops, weight))
                or pack_weight(weight.bfloat16(), batch_hint=32) is not None
                or (_has_i16() and not greedy_head.has_amx()))
    assert (GreedyHead.build(weight) is not None) == has_gemm
    assert GreedyHead.build(torch.randn(SCREEN_TOP_K, 64)) is None  # a vocab of k ids
    monkeypatch.setattr(greedy_head, "cpu_ops", lambda: None)
    assert GreedyHead.build(torch.randn(VOCAB, 64)) is None  # no C++ kernels
    assert GreedyHead.build(torch.randn(VOCAB, 64).bfloat16()) is None  # not fp32
    monkeypatch.setattr(greedy_head, "cpu_ops", cpu_ops)
    monkeypatch.setattr(greedy_head, "has_bf16_units", lambda: False)
    head = GreedyHead.build(torch.randn(VOCAB, 64))  # no bf16 units: int16 where AVX2
    assert (head.gemm if head is not None else None) == ("i16" if _has_i16() else None)
    assert GreedyHead.build(torch.randn(VOCAB + 8, 64)) is None  # not its blocks


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return build_hf_checkpoint("llama", tmp_path_factory.mktemp("hf") / "llama",
                               vocab_size=VOCAB)


def _worker(checkpoint: Path, screen: bool, monkeypatch) -> Worker:
    """A worker with the screen this CPU builds (bf16 units: bf16; else AVX2: int16)."""
    monkeypatch.setattr(greedy_head, "SCREEN_MIN_ELEMENTS", 0)  # the tiny model's lm_head
    worker = Worker(str(checkpoint), num_kv_blocks=64, block_size=16,
                    run=RunOptions(greedy_screen=screen))
    if screen and worker.greedy_head is None:
        pytest.skip("no screen here: no bf16 units that oneDNN packs for, no AVX2 build")
    return worker


def test_greedy_decode_with_the_screen_matches_generate(checkpoint, monkeypatch):
    import transformers as tf

    hf = tf.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    worker = _worker(checkpoint, True, monkeypatch)
    driver = Driver(worker)
    for i, n in enumerate((3, 40, 130)):
        prompt = random_ids(n, seed=900 + i, vocab_size=VOCAB)
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=24, pad_token_id=0)
        driver.add(f"r{i}", prompt)
        driver.prefill(f"r{i}", chunk_len=64)
        got = driver.tokens[f"r{i}"][n:] + driver.decode(f"r{i}", 23)
        assert got == out[0, n:].tolist(), f"prompt of {n} tokens diverged"
    assert worker.greedy_head is not None and worker.greedy_head.num_rows >= 3 * 24


def test_a_step_that_needs_logits_takes_the_fp32_path(checkpoint, monkeypatch):
    """Beside greedy rows, a request asking for log-probs and a random one: those steps run
    the fp32 logits (their log-probs come back), the greedy tokens are the same as with
    no screen; the steps where all rows are greedy again take the screen."""
    scored = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True, logprobs=2)
    sampled = SamplingParams(max_tokens=64, temperature=0.8, seed=5, ignore_eos=True)
    tokens = {}
    for screen in (True, False):
        worker = _worker(checkpoint, screen, monkeypatch)
        driver = Driver(worker)
        driver.add("greedy", random_ids(20, seed=1, vocab_size=VOCAB))
        driver.add("scored", random_ids(9, seed=2, vocab_size=VOCAB), params=scored)
        driver.add("random", random_ids(12, seed=3, vocab_size=VOCAB), params=sampled)
        result = driver.step({"greedy": 20, "scored": 9, "random": 12})
        assert "scored" in result.sampled_logprobs
        for _ in range(4):
            result = driver.step({"greedy": 1, "scored": 1, "random": 1})
            assert "scored" in result.sampled_logprobs
        if screen:
            assert worker.greedy_head is not None and worker.greedy_head.num_rows == 0
        for _ in range(4):
            driver.step({"greedy": 1})
        if screen:
            assert worker.greedy_head is not None and worker.greedy_head.num_rows == 4
        tokens[screen] = dict(driver.tokens)
    assert tokens[True] == tokens[False]


class _Timed:
    """A screen whose GEMM takes the next of its `costs_s` on a fake clock."""

    def __init__(self, gemm: str, costs_s: list[float], clock: list[float]) -> None:
        self.gemm, self.weight, self.timings_ms = gemm, torch.zeros(VOCAB, 64), {}
        self._costs, self._clock, self.num_calls = list(costs_s), clock, 0

    def screen(self, hidden: torch.Tensor) -> None:
        assert hidden.shape == (greedy_head.SCREEN_TIMING_ROWS, 64)
        self._clock[0] += self._costs[self.num_calls]
        self.num_calls += 1


def test_fastest_keeps_the_lower_median_of_interleaved_timings(monkeypatch):
    """Each screen runs once untimed, then SCREEN_TIMING_REPS times: the lower median
    wins, whatever one slow call (a stolen slice of time) or a slow first call says."""
    clock = [0.0]
    monkeypatch.setattr(greedy_head.time, "perf_counter", lambda: clock[0])
    reps = greedy_head.SCREEN_TIMING_REPS
    own = _Timed("own", [9.0] + [0.006] * reps, clock)  # slow first call, untimed
    i16 = _Timed("i16", [0.001] + [0.004] * (reps - 1) + [0.5], clock)  # one stolen slice
    best = greedy_head.fastest([own, i16])  # type: ignore[list-item]
    assert best is i16 and own.num_calls == i16.num_calls == reps + 1
    assert best.timings_ms == pytest.approx({"own": 6.0, "i16": 4.0})
    assert greedy_head.fastest([own]) is own and greedy_head.fastest([]) is None


@pytest.mark.skipif(not (_has_own_gemm() and _has_i16()),
                    reason="both screens are built only with AVX512-BF16 and AVX2")
def test_a_cpu_with_both_screens_runs_the_faster_and_stays_exact(monkeypatch):
    monkeypatch.setattr(greedy_head, "SCREEN_MIN_ELEMENTS", 0)
    monkeypatch.setattr(greedy_head, "has_amx", lambda: False)
    monkeypatch.setattr(greedy_head, "has_bf16_units", lambda: True)
    torch.manual_seed(5)
    weight = torch.randn(VOCAB, 256) * 0.05
    head = GreedyHead.build(weight)
    assert head is not None and set(head.timings_ms) == {"own", "i16"}
    assert head.timings_ms[head.gemm] == min(head.timings_ms.values())
    hidden = torch.randn(32, 256) * 4.0
    assert head.ids(hidden).tolist() == _argmax(hidden, weight)
    monkeypatch.setattr(greedy_head, "has_amx", lambda: True)  # AMX: bf16 tiles, untimed
    amx_head = GreedyHead.build(weight)
    assert amx_head is not None and amx_head.gemm != "i16" and not amx_head.timings_ms
