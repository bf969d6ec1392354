"""The decode GEMM's prefetch (`worker.cpu_gemm_prefetch`, workers/gemm_prefetch.py): with it
on and off a worker's decode steps give bit-equal logits (prefetches move no value); `on` /
`off` set the process's setting as told, `auto` keeps the faster of the two timings and the
timing leaves the setting as it found it; a worker without decode GEMM copies chooses
nothing; a misspelled setting fails validation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from cluster.config import TokenflowConfig
from tests.workers.helpers import Driver, build_hf_checkpoint, random_ids

# The decode stack's tests' skip (no C++ decode GEMM here), kernels, packing policy (every
# linear with its decode copy up to 8 rows: decode steps run the stack) and prompts.
from tests.workers.test_decode_stack import (  # noqa: F401  (pytestmark: pytest reads it)
    OPS,
    POLICY,
    PROMPTS,
    pytestmark,
)
from workers import gemm_prefetch
from workers.sections import PackPolicy
from workers.worker import RunOptions, Worker


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return build_hf_checkpoint("llama", tmp_path_factory.mktemp("hf") / "llama",
                               num_hidden_layers=3, attention_bias=True, mlp_bias=True)


@pytest.fixture(autouse=True)
def restore_setting():
    was_on = OPS.decode_gemm_prefetch()
    yield
    OPS.set_decode_gemm_prefetch(was_on)


def _worker(checkpoint: Path, setting: str, packing: PackPolicy | None = POLICY) -> Worker:
    return Worker(str(checkpoint), num_kv_blocks=64, block_size=16, keep_logits=True,
                  run=RunOptions(packing=packing, gemm_prefetch=setting))


def _decode(worker: Worker) -> tuple[dict[str, list[int]], list[torch.Tensor]]:
    """Prefill three prompts, then 10 decode-only steps; the tokens and every step's logits."""
    driver = Driver(worker)
    for i, (rid, n) in enumerate(PROMPTS.items()):
        driver.add(rid, random_ids(n, seed=830 + i))
        driver.prefill(rid, chunk_len=64)
    logits = []
    for _ in range(10):
        driver.step(dict.fromkeys(PROMPTS, 1))
        logits += [worker.span_logits[rid] for rid in PROMPTS]
    return driver.tokens, logits


def test_prefetch_on_and_off_give_bit_equal_decode_steps(checkpoint):
    on = _worker(checkpoint, "on")
    assert on.gemm_prefetch == {"prefetch": True, "timings_ms": {}}
    assert OPS.decode_gemm_prefetch()
    assert on.model.decode_stack is not None
    on_tokens, on_logits = _decode(on)

    off = _worker(checkpoint, "off")
    assert off.gemm_prefetch == {"prefetch": False, "timings_ms": {}}
    assert not OPS.decode_gemm_prefetch()
    stack, calls = off.model.decode_stack, []
    assert stack is not None
    forward = stack.forward
    stack.forward = lambda x, *a: calls.append(x.shape[0]) or forward(x, *a)  # type: ignore
    off_tokens, off_logits = _decode(off)  # the setting is process-wide: off from here
    assert calls == [3] * 10  # every decode step ran the stack's GEMMs
    assert on_tokens == off_tokens
    assert len(on_logits) == len(off_logits) == 30
    assert all(torch.equal(a, b) for a, b in zip(on_logits, off_logits, strict=True))


def test_auto_keeps_the_faster_setting(checkpoint, monkeypatch):
    worker = _worker(checkpoint, "on")
    weights = gemm_prefetch.decode_weights(worker.model)
    assert len(weights) == 3 * 5  # q/k/v, o, gate, up, down of each layer, in step order
    assert weights[0] is worker.model.model.layers[0].self_attn.qkv_proj.decode_packed
    # A byte cap keeps the step's first weights (at least one): a large model's start does
    # not time its whole step 12 times.
    sizes = [w.numel() * w.element_size() for w in weights]
    capped = gemm_prefetch.decode_weights(worker.model, max_bytes=sizes[0] + sizes[1])
    assert [w is v for w, v in zip(capped, weights[:2], strict=True)] == [True, True]
    assert len(gemm_prefetch.decode_weights(worker.model, max_bytes=1)) == 1
    timed: list[int] = []
    for faster, timings in (("off", {"on": 2.0, "off": 1.0}), ("on", {"on": 1.0, "off": 2.0}),
                            ("on", {"on": 1.0, "off": 1.0})):  # a tie keeps the prefetches
        def fake_time(ops, weights, timings=timings):
            timed.append(len(weights))
            return timings

        monkeypatch.setattr(gemm_prefetch, "time_prefetch", fake_time)
        chosen = gemm_prefetch.choose_prefetch(worker.model, "auto")
        assert chosen == {"prefetch": faster == "on", "timings_ms": timings}
        assert OPS.decode_gemm_prefetch() == (faster == "on")
    assert timed == [15, 15, 15]


def test_timing_measures_both_and_leaves_the_setting(checkpoint):
    worker = _worker(checkpoint, "off")
    weights = gemm_prefetch.decode_weights(worker.model)
    timings = gemm_prefetch.time_prefetch(OPS, weights, rows=4, reps=2)
    assert set(timings) == {"on", "off"} and all(ms > 0 for ms in timings.values())
    assert not OPS.decode_gemm_prefetch()  # as it found it
    auto = _worker(checkpoint, "auto")
    assert auto.gemm_prefetch is not None
    assert set(auto.gemm_prefetch["timings_ms"]) == {"on", "off"}
    assert OPS.decode_gemm_prefetch() == auto.gemm_prefetch["prefetch"]


def test_no_decode_copies_no_choice(checkpoint):
    OPS.set_decode_gemm_prefetch(True)
    plain = _worker(checkpoint, "off", packing=None)
    assert plain.gemm_prefetch is None
    assert OPS.decode_gemm_prefetch()  # untouched: nothing here runs the decode GEMM


def test_a_misspelled_setting_fails_validation():
    with pytest.raises(ValidationError, match="cpu_gemm_prefetch"):
        TokenflowConfig(worker={"cpu_gemm_prefetch": "sometimes"})
    assert TokenflowConfig(worker={"cpu_gemm_prefetch": "off"}).worker.cpu_gemm_prefetch == "off"
    # On by default: served on a Zen 4 the prefetches' absence slowed the long prompt.
    assert TokenflowConfig().worker.cpu_gemm_prefetch == "on"
