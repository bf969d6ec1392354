"""The model registry (workers/models/registry.py): an architecture is one module and one
registry line; the loader builds the class the registry names, and the bytes a step moves
come from the model's config."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from workers.loader import load_model
from workers.model_config import ModelConfig
from workers.models.llama import LlamaForCausalLM
from workers.models.registry import MODEL_TYPE_TO_CLASS, model_class
from workers.presets import resolve_model
from workers.worker import Worker


class RenamedLlama(LlamaForCausalLM):
    """A "new architecture" for the test: Llama's layers under a model_type of its own."""


def _renamed_checkpoint(tmp_path: Path) -> Path:
    folder = tmp_path / "renamed"
    shutil.copytree(resolve_model("builtin:tiny"), folder)
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "renamed-llama"
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_an_architecture_is_one_registry_line(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    folder = _renamed_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="unsupported model_type 'renamed-llama'"):
        load_model(folder)
    monkeypatch.setitem(MODEL_TYPE_TO_CLASS, "renamed-llama",
                        f"{__name__}:{RenamedLlama.__name__}")
    model, config = load_model(folder)
    assert type(model) is RenamedLlama and config.model_type == "renamed-llama"
    assert model_class("llama") is LlamaForCausalLM


def test_the_bytes_moved_estimate_comes_from_the_models_config() -> None:
    worker = Worker("builtin:tiny", num_kv_blocks=8, block_size=4)
    config: ModelConfig = worker.model_config
    elem = worker.dtype.itemsize
    assert worker._kv_bytes_per_token == config.kv_bytes_per_token(elem) > 0
    assert worker._act_bytes_per_token == config.activation_bytes_per_token(elem) > 0
    assert worker.kv_bytes_per_block == 4 * config.kv_bytes_per_token(elem)
