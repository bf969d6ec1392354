"""Tiny random Llama-family checkpoints written with transformers' `save_pretrained`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

ARCHS = ("llama", "mistral", "qwen2")


def build_checkpoint(arch: str, path: Path, vocab_size: int = 256) -> Path:
    import transformers as tf

    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=2048, initializer_range=0.2, rms_norm_eps=1e-6,
                  bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    if arch == "llama":
        config = tf.LlamaConfig(**common)
        model_cls = tf.LlamaForCausalLM
    elif arch == "mistral":
        config = tf.MistralConfig(sliding_window=None, **common)
        model_cls = tf.MistralForCausalLM
    elif arch == "qwen2":
        common["tie_word_embeddings"] = True
        config = tf.Qwen2Config(use_sliding_window=False, **common)
        model_cls = tf.Qwen2ForCausalLM
    else:
        raise ValueError(arch)
    torch.manual_seed(1234 + ARCHS.index(arch))
    model = model_cls(config).eval()
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {arch: build_checkpoint(arch, root / arch) for arch in ARCHS}


def hf_greedy(path: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Reference: transformers' own greedy `generate`, one prompt at a time (no padding)."""
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # we compare with ignore_eos=True
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_new_tokens, pad_token_id=0)
            outputs.append(out[0, len(prompt):].tolist())
    return outputs
