"""Presets, loader and config parsing."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

from tests.workers.helpers import Driver, build_hf_checkpoint, hf_logits, random_ids
from workers.loader import load_model
from workers.model_config import ModelConfig
from workers.presets import PRESETS, ensure_preset, random_state_dict, resolve_model
from workers.worker import Worker


def test_tiny_preset_is_a_hf_folder_matching_transformers(tiny_path):
    names = {p.name for p in tiny_path.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    worker = Worker("builtin:tiny", num_kv_blocks=64, block_size=16, keep_logits=True)
    assert worker.model_path == tiny_path
    cfg = worker.model_config
    assert (cfg.model_type, cfg.hidden_size, cfg.num_hidden_layers) == ("llama", 64, 2)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size) == (4, 2, 512)
    assert worker.eos_token_ids == (2,)
    ids = random_ids(200, seed=9, vocab_size=512)
    driver = Driver(worker)
    driver.add("r", ids)
    driver.prefill("r", chunk_len=64)
    want = hf_logits(tiny_path, ids)
    torch.testing.assert_close(worker.last_logits["r"], want[-1], atol=1e-4, rtol=0)
    # Not near-ties: greedy is robust to float noise on the random weights.
    top2 = want.topk(2, dim=-1).values
    assert float((top2[:, 0] - top2[:, 1]).median()) > 0.5


def test_preset_weights_are_deterministic():
    config = ModelConfig.from_dict(
        {"model_type": "llama", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 192,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    )
    first, second = random_state_dict(config, seed=0), random_state_dict(config, seed=0)
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert not torch.equal(first["lm_head.weight"], random_state_dict(config, 1)["lm_head.weight"])


def test_concurrent_creation_is_atomic(tmp_path):
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(ensure_preset("tiny", tmp_path)))
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(results)) == 1 and len(results) == 3
    assert os.listdir(tmp_path) == [results[0].name]  # no temporary folder left behind
    load_model(results[0])


def test_resolve_model_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown preset"):
        resolve_model("builtin:nope")
    with pytest.raises(FileNotFoundError):
        resolve_model(tmp_path / "missing")
    assert set(PRESETS) >= {"tiny", "bench"}


def test_loader_errors_and_sharded_checkpoints(tmp_path):
    path = build_hf_checkpoint("llama", tmp_path / "ckpt", tie_word_embeddings=True)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        load_model(tmp_path / "empty")
    (tmp_path / "empty" / "config.json").write_bytes((path / "config.json").read_bytes())
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(tmp_path / "empty")

    import transformers as tf

    hf = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    hf.save_pretrained(tmp_path / "sharded", safe_serialization=True, max_shard_size="40KB")
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    model, cfg = load_model(tmp_path / "sharded")
    assert cfg.tie_word_embeddings
    assert model.lm_head.weight is model.model.embed_tokens.weight
    bf16, _ = load_model(path, dtype="bfloat16")
    assert bf16.lm_head.weight.dtype == torch.bfloat16


BASE = {"vocab_size": 100, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "max_position_embeddings": 32768}


def test_config_parsing():
    llama = ModelConfig.from_dict({**BASE, "model_type": "llama", "eos_token_id": [2, 7],
                                   "rope_theta": 5e5, "attention_bias": True})
    assert (llama.head_dim, llama.num_key_value_heads, llama.eos_token_ids) == (16, 4, (2, 7))
    assert (llama.rope.rope_type, llama.rope.rope_theta) == ("default", 5e5)
    assert llama.attention_bias and llama.o_proj_bias
    qwen = ModelConfig.from_dict({**BASE, "model_type": "qwen2", "sliding_window": 4096})
    assert qwen.attention_bias and not qwen.o_proj_bias
    assert qwen.max_model_len == 32768  # qwen2's window only applies with use_sliding_window
    mistral = ModelConfig.from_dict({**BASE, "model_type": "mistral", "sliding_window": 4096})
    assert mistral.max_model_len == 4096  # capped: exact, no sliding-window approximation
    old = ModelConfig.from_dict({**BASE, "model_type": "llama", "rope_theta": 5e5, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}})
    new = ModelConfig.from_dict({**BASE, "model_type": "llama", "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}})
    assert old.rope == new.rope and new.rope.factor == 8.0


@pytest.mark.parametrize("bad", [
    {"model_type": "gpt2"},
    {"model_type": "llama", "rope_scaling": {"type": "yarn", "factor": 4.0}},
    {"model_type": "llama", "rope_parameters": {"rope_type": "linear", "factor": 2.0}},
    {"model_type": "llama", "rope_parameters": {"rope_type": "llama3"}},
])
def test_config_rejects_unsupported(bad):
    with pytest.raises(ValueError):
        ModelConfig.from_dict({**BASE, **bad})
