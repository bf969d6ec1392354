"""Our worker against transformers on tiny random checkpoints of each supported layout."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.workers.helpers import Driver, build_hf_checkpoint, random_ids
from workers.worker import Worker

LLAMA3_ROPE = {
    "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
}
# name -> (architecture, config overrides); each exercises a different loading path.
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {"attention_bias": True, "mlp_bias": True}),
    "mistral": ("mistral", {"head_dim": 32}),  # head_dim != hidden / heads
    "qwen2": ("qwen2", {"tie_word_embeddings": True}),
    "llama3_rope": ("llama", {"rope_parameters": LLAMA3_ROPE, "num_hidden_layers": 3}),
}
ARCHS = ("llama", "mistral", "qwen2")
PROMPT_LENS = (5, 77, 600)
ATOL = 1e-4


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {
        name: build_hf_checkpoint(arch, root / name, seed=i, **overrides)
        for i, (name, (arch, overrides)) in enumerate(VARIANTS.items())
    }


@pytest.fixture(scope="module")
def hf_models(checkpoints: dict[str, Path]) -> dict[str, Any]:
    import transformers as tf

    models = {}
    for name, path in checkpoints.items():
        model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        model.generation_config.eos_token_id = None  # compare full 32-token runs
        models[name] = model
    return models


def make_worker(path: Path, **kwargs: Any) -> Worker:
    return Worker(str(path), num_kv_blocks=256, block_size=16, keep_logits=True, **kwargs)


def old_layout_copy(src: Path, dst: Path) -> Path:
    """The same checkpoint with RoPE written the pre-transformers-5 way."""
    shutil.copytree(src, dst)
    raw = json.loads((dst / "config.json").read_text())
    rope = dict(raw.pop("rope_parameters"))
    raw["rope_theta"] = rope.pop("rope_theta")
    rope["type"] = rope.pop("rope_type")  # the oldest spelling of the key
    raw["rope_scaling"] = rope
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


@pytest.mark.parametrize("name", list(VARIANTS))
def test_prefill_logits_match_transformers(checkpoints, hf_models, name):
    worker = make_worker(checkpoints[name])
    driver = Driver(worker)
    for i, n in enumerate(PROMPT_LENS):
        ids = random_ids(n, seed=100 + i)
        driver.add(f"r{i}", ids)
        driver.prefill(f"r{i}", chunk_len=n)
        with torch.inference_mode():
            want = hf_models[name](torch.tensor([ids])).logits[0].float()
        got = worker.span_logits[f"r{i}"]
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_old_rope_layout_loads_the_same(checkpoints, hf_models, tmp_path):
    path = old_layout_copy(checkpoints["llama3_rope"], tmp_path / "old")
    worker = make_worker(path)
    assert worker.model_config.rope.rope_type == "llama3"
    ids = random_ids(300, seed=5)
    driver = Driver(worker)
    driver.add("r", ids)
    driver.prefill("r", chunk_len=300)
    with torch.inference_mode():
        want = hf_models["llama3_rope"](torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(worker.span_logits["r"], want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", [*ARCHS, "llama3_rope"])
def test_greedy_decode_matches_generate(checkpoints, hf_models, name):
    worker = make_worker(checkpoints[name])
    driver = Driver(worker)
    for i, n in enumerate((3, 40, 130)):
        prompt = random_ids(n, seed=200 + i)
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = hf_models[name].generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False,
                max_new_tokens=32, pad_token_id=0,
            )
        want = out[0, n:].tolist()
        driver.add(f"r{i}", prompt)
        driver.prefill(f"r{i}", chunk_len=64)  # chunked on purpose: still exact
        got = driver.tokens[f"r{i}"][n:] + driver.decode(f"r{i}", 31)
        assert got == want, f"{name}: prompt of {n} tokens diverged"
