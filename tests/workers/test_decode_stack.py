"""A decode-only step's layers in one C++ call (workers/decode_stack.py) against the Python
layer loop on the same weights: bit-equal logits and the same greedy tokens over decode
steps between chunked prefills, and through LocalEngine; against transformers directly
(its logits within the parity tests' tolerance, its greedy tokens); taken only where it
applies; a bad slot fails the call before any KV row is written."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from tests.workers.helpers import Driver, build_hf_checkpoint, random_ids
from tests.workers.test_hf_parity import ATOL
from workers.decode_stack import DecodeStack
from workers.kernels.cpu_ops import cpu_ops
from workers.sections import PackPolicy
from workers.worker import RunOptions, Worker

OPS = cpu_ops()
pytestmark = pytest.mark.skipif(
    OPS is None or not OPS.decode_gemm_preferred(),
    reason="the CPU kernels or their decode GEMM are not built for this CPU")

# Every linear of the small checkpoint packed, with its C++ decode copy up to 8 rows.
POLICY = PackPolicy(min_rows=1, min_elements=1, any_rows_elements=1, decode_max_rows=8)
# Chunked prefills beside decodes (mixed steps: the loop), then decode-only steps (the stack).
PROMPTS = {"r0": 5, "r1": 40, "r2": 77}
SCHEDULE = ({"r0": 5, "r1": 16, "r2": 16}, {"r0": 1, "r1": 24, "r2": 61},
            *[{"r0": 1, "r1": 1, "r2": 1}] * 12)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return build_hf_checkpoint("llama", tmp_path_factory.mktemp("hf") / "llama",
                               num_hidden_layers=3, attention_bias=True, mlp_bias=True)


def _worker(checkpoint: Path, **run: object) -> Worker:
    run = {"packing": POLICY, **run}
    return Worker(str(checkpoint), num_kv_blocks=64, block_size=16, keep_logits=True,
                  run=RunOptions(**run))  # type: ignore[arg-type]


def _count_calls(stack: DecodeStack) -> list[int]:
    """The rows of each `stack.forward` call from now on (the list grows as it runs)."""
    calls: list[int] = []
    forward = stack.forward
    stack.forward = lambda x, *a: calls.append(x.shape[0]) or forward(x, *a)  # type: ignore
    return calls


def _run(worker: Worker) -> tuple[dict[str, list[int]], list[torch.Tensor]]:
    driver = Driver(worker)
    for i, (rid, n) in enumerate(PROMPTS.items()):
        driver.add(rid, random_ids(n, seed=800 + i))
    logits = []
    for step in SCHEDULE:
        driver.step(step)
        logits += [worker.span_logits[rid] for rid in step]
    return driver.tokens, logits


def test_the_stack_is_bit_equal_to_the_layer_loop(checkpoint):
    """With biases on every linear: every step's logits equal (bit for bit) those of a
    worker that runs the Python loop, and the stack ran exactly the decode-only steps."""
    worker = _worker(checkpoint)
    stack = worker.model.decode_stack
    assert isinstance(stack, DecodeStack) and stack.max_rows == 8
    calls = _count_calls(stack)
    tokens, logits = _run(worker)
    assert calls == [3] * 12  # the 12 decode-only steps, not the two with chunks

    loop = _worker(checkpoint, decode_stack=False)
    assert loop.model.decode_stack is None
    loop_tokens, loop_logits = _run(loop)
    assert tokens == loop_tokens
    assert len(logits) == len(loop_logits)
    for got, want in zip(logits, loop_logits, strict=True):
        assert torch.equal(got, want)


def test_layers_too_small_for_onednn_still_get_the_stack(checkpoint):
    """No weight large enough for oneDNN's copy (builtin:small's o_proj is not): every
    linear keeps its decode GEMM copy, so the stack runs the decode-only steps, bit-equal
    to the loop over the same copies and with the tokens of plain GEMMs."""
    small = dataclasses.replace(POLICY, min_elements=1 << 30, any_rows_elements=1 << 30)
    worker = _worker(checkpoint, packing=small)
    layer = worker.model.model.layers[0]
    assert layer.self_attn.o_proj.packed is None and layer.mlp.down_proj.packed is None
    stack = worker.model.decode_stack
    assert isinstance(stack, DecodeStack)
    calls = _count_calls(stack)
    tokens, logits = _run(worker)
    assert calls == [3] * 12
    loop_tokens, loop_logits = _run(_worker(checkpoint, packing=small, decode_stack=False))
    assert tokens == loop_tokens
    assert all(torch.equal(a, b) for a, b in zip(logits, loop_logits, strict=True))
    plain_tokens, _ = _run(_worker(checkpoint, packing=None))
    assert tokens == plain_tokens


def test_the_stack_matches_transformers_generate(checkpoint):
    """Three requests decoding together through the stack (every decode step one call):
    each step's logits within test_hf_parity's tolerance of transformers' scores, and the
    greedy tokens of `generate`, token for token."""
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # full runs
    worker = _worker(checkpoint)
    stack = worker.model.decode_stack
    assert stack is not None
    calls = _count_calls(stack)
    driver = Driver(worker)
    prompts = {f"r{i}": random_ids(n, seed=970 + i) for i, n in enumerate((3, 40, 130))}
    logits: dict[str, list[torch.Tensor]] = {rid: [] for rid in prompts}
    for rid, prompt in prompts.items():
        driver.add(rid, prompt)
        driver.prefill(rid, chunk_len=64)
        logits[rid].append(worker.span_logits[rid][-1])
    num_decodes = 15
    for _ in range(num_decodes):
        driver.step(dict.fromkeys(prompts, 1))
        for rid in prompts:
            logits[rid].append(worker.span_logits[rid][-1])
    assert calls == [3] * num_decodes
    for rid, prompt in prompts.items():
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=num_decodes + 1, pad_token_id=0,
                                 output_scores=True, return_dict_in_generate=True)
        assert driver.tokens[rid][len(prompt):] == out.sequences[0, len(prompt):].tolist()
        for got, want in zip(logits[rid], out.scores, strict=True):
            torch.testing.assert_close(got, want[0].float(), atol=ATOL, rtol=0)


def test_not_taken_past_its_rows_or_where_a_layer_lacks_its_decode_gemm(checkpoint):
    worker = _worker(checkpoint)
    stack = worker.model.decode_stack
    assert stack is not None
    x = torch.zeros(9, worker.model_config.hidden_size)

    class DecodeOnly:  # an attention step whose rows are all decodes
        def decode_only_inputs(self):
            return "inputs"

    assert stack.inputs(x, DecodeOnly()) is None  # 9 rows > decode_max_rows
    assert stack.inputs(x[:8], DecodeOnly()) == "inputs"
    assert stack.inputs(x[:8].bfloat16(), DecodeOnly()) is None
    assert stack.inputs(x[:8], object()) is None  # an attention step without the C++ kernel
    # No decode GEMM copies (decode_max_rows 0): no stack; bf16 weights: none either.
    no_copies = PackPolicy(min_rows=1, min_elements=1, any_rows_elements=1, decode_max_rows=0)
    plain = Worker(str(checkpoint), num_kv_blocks=64, block_size=16,
                   run=RunOptions(packing=no_copies))
    assert plain.model.decode_stack is None
    bf16 = Worker(str(checkpoint), num_kv_blocks=64, block_size=16, dtype="bfloat16",
                  run=RunOptions(packing=POLICY))
    assert bf16.model.decode_stack is None


def test_a_slot_outside_the_cache_fails_before_any_kv_row_is_written(checkpoint):
    worker = _worker(checkpoint)
    stack = worker.model.decode_stack
    assert stack is not None
    cfg = worker.model_config
    before = [c.clone() for pair in worker.kv_caches for c in pair]
    rows, half = 2, cfg.head_dim // 2
    x = torch.randn(rows, cfg.hidden_size)
    cos, sin = torch.ones(rows, half), torch.zeros(rows, half)
    table = torch.tensor([[0], [1]], dtype=torch.long)
    lens = torch.tensor([1, 1], dtype=torch.long)
    bad = torch.tensor([3, 64 * 16], dtype=torch.long)  # the second row past the last slot
    with pytest.raises(RuntimeError, match="out of the cache"):
        stack.forward(x, cos, sin, (table, lens, bad))
    after = [c for pair in worker.kv_caches for c in pair]
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))


def test_an_engine_with_it_gives_the_loops_tokens_and_holds_no_block(checkpoint):
    """LocalEngine (its own scheduler, decode bursts and chunked prompts) with the stack and
    without: the same greedy outputs, and the pool whole afterwards."""
    from cluster.config import TokenflowConfig
    from cluster.engine import LocalEngine
    from tests.workers.helpers import GREEDY

    prompts = [random_ids(n, seed=950 + n) for n in (3, 50, 130, 70, 9)]
    outputs = []
    for on in (True, False):
        config = TokenflowConfig(
            worker={"model": str(checkpoint), "cpu_decode_stack": on,
                    "cpu_packed_min_elements": 1, "cpu_packed_any_rows_elements": 1,
                    "cpu_decode_gemm_max_rows": 8},
            cache={"num_kv_blocks": 64, "block_size": 16},
            scheduler={"max_num_batched_tokens": 48}, calibration={"auto": False})
        engine = LocalEngine(config)
        assert (engine.worker.model.decode_stack is not None) == on
        params = dataclasses.replace(GREEDY, max_tokens=12)
        outputs.append([c.output_token_ids for c in engine.generate(prompts, params)])
        engine.check_integrity()
    assert outputs[0] == outputs[1]
    assert all(len(o) == 12 for o in outputs[0])
