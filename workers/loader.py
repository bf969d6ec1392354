"""Load a Hugging Face checkpoint folder (config.json + *.safetensors) into the class the
model registry names for its `model_type` (workers/models/registry.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import Tensor

from workers.model_config import ModelConfig
from workers.models.registry import model_class

# Keys some checkpoints carry that our model derives instead of storing.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

_DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


_INIT_FUNCTIONS = ("normal_", "uniform_", "kaiming_uniform_", "trunc_normal_", "zeros_", "ones_")


@contextlib.contextmanager
def build_on_meta() -> Iterator[None]:
    """Build modules on `meta` without running their parameter init.

    The load replaces every tensor, so init is wasted there, and torch's first `normal_` on
    `meta` imports its decompositions: ~1.5 s of every worker's start-up on CPU. Not
    thread-safe (it swaps `torch.nn.init` functions): call it where a model is built, once.
    """
    saved = {name: getattr(torch.nn.init, name) for name in _INIT_FUNCTIONS}
    for name in _INIT_FUNCTIONS:
        setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        with torch.device("meta"):
            yield
    finally:
        for name, function in saved.items():
            setattr(torch.nn.init, name, function)


def parse_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    name = dtype.removeprefix("torch.")
    if name not in _DTYPE_NAMES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(_DTYPE_NAMES)}")
    return _DTYPE_NAMES[name]


def load_state_dict_files(folder: Path) -> dict[str, Tensor]:
    """Merge every `*.safetensors` file in `folder` (sharded or single)."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors file in {folder}; only safetensors checkpoints are supported "
            "(convert .bin weights with `save_pretrained(..., safe_serialization=True)`)"
        )
    state: dict[str, Tensor] = {}
    for file in files:
        state.update(load_file(str(file), device="cpu"))
    return state


def load_model(
    folder: str | Path,
    dtype: torch.dtype | str = torch.float32,
    device: str | torch.device = "cpu",
) -> tuple[Any, ModelConfig]:
    """Build the model from `folder/config.json` and load its weights strictly."""
    folder = Path(folder)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} not found: not a Hugging Face model folder")
    config = ModelConfig.from_file(config_path)
    torch_dtype, torch_device = parse_dtype(dtype), torch.device(device)

    state = {
        name: tensor.to(device=torch_device, dtype=torch_dtype)
        for name, tensor in load_state_dict_files(folder).items()
        if not name.endswith(_IGNORED_SUFFIXES)
    }
    if config.tie_word_embeddings:
        # Tied checkpoints usually omit lm_head; if both are present the embedding wins.
        state["lm_head.weight"] = state["model.embed_tokens.weight"]

    # Build on `meta` so no memory is spent on an init that the load overwrites.
    with build_on_meta():
        model = model_class(config.model_type)(config)
    expected = set(model.state_dict())
    missing, unexpected = expected - state.keys(), state.keys() - expected
    if missing or unexpected:
        raise ValueError(
            f"checkpoint in {folder} does not match a {config.model_type} model: "
            f"missing {sorted(missing)[:8]}, unexpected {sorted(unexpected)[:8]}"
        )
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()  # `assign` replaced the shared Parameter by two objects
    model.fuse_projections()  # q/k/v become one matmul
    model.reset_rotary(torch_device)
    model.eval().requires_grad_(False)
    return model, config
