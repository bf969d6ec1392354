"""The model registry: `model_type` (config.json) -> the class that runs it.

Adding an architecture is one module under workers/models/ and one line here. The class
is built from a `ModelConfig` on the `meta` device and loaded strictly
(workers/loader.py); it has the methods `LlamaForCausalLM` has (`tie_weights`,
`fuse_projections`, `reset_rotary`, `pack_linears`, `forward`). The bytes a step moves
come from the model's config (`ModelConfig.kv_bytes_per_token`,
`ModelConfig.activation_bytes_per_token`). Classes are named by import path so that
reading a config imports no torch.
"""

from __future__ import annotations

import importlib
from typing import Any

MODEL_TYPE_TO_CLASS: dict[str, str] = {
    "llama": "workers.models.llama:LlamaForCausalLM",
    "mistral": "workers.models.llama:LlamaForCausalLM",  # Llama's layers, a sliding window
    "qwen2": "workers.models.llama:LlamaForCausalLM",  # Llama's layers, q/k/v biases
}


def model_class(model_type: str) -> type[Any]:
    """The class registered for `model_type`; ValueError naming the supported ones."""
    path = MODEL_TYPE_TO_CLASS.get(model_type)
    if path is None:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: "
                         f"{tuple(MODEL_TYPE_TO_CLASS)}")
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)
