"""Built-in model presets: seeded random Llama weights plus a byte-level tokenizer.

`resolve_model("builtin:tiny")` creates, on first use, a real Hugging Face folder (config.json,
model.safetensors, tokenizer.json, tokenizer_config.json) under
`$TOKENFLOW_CACHE_DIR/<name>-v<version>` (default root `~/.cache/tokenflow`); it is then loaded
through the normal loader like any checkpoint. The version is part of the folder name so a change
of preset definition never reuses a stale folder. The folder is written into a temporary sibling
and renamed into place, so concurrent creators never see a half-written folder: the first rename
wins and the others discard their copy.

Weights: embeddings ~ N(0, 1); every linear layer ~ N(0, 1/fan_in) so each block's output varies
with its input at the scale of the residual stream; lm_head ~ N(0, LOGIT_STD^2/hidden) so
logits have std LOGIT_STD and greedy argmaxes are far from ties. Drawn from one seeded CPU
generator in sorted parameter order: deterministic across machines.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from workers.loader import build_on_meta
from workers.model_config import ModelConfig
from workers.models.registry import model_class
from workers.tokenizer import DEFAULT_CHAT_TEMPLATE

PRESET_VERSION = 1
PREFIX = "builtin:"
LOGIT_STD = 4.0
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")  # ids 0, 1, 2; the 256 bytes follow at 3..258
NUM_SPECIAL_TOKENS = len(SPECIAL_TOKENS)


@dataclass(frozen=True)
class PresetSpec:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int = 8192
    seed: int = 0


PRESETS: dict[str, PresetSpec] = {
    "tiny": PresetSpec(64, 2, 4, 2, 192, 512),
    # about 57M parameters (16M each for the untied embedding and lm_head)
    "bench": PresetSpec(512, 8, 8, 2, 1536, 32000, seed=1),
    # about 7M parameters: a step's time is mostly the model's, not Python's (batch benchmark)
    "small": PresetSpec(256, 4, 4, 2, 768, 8000, seed=2),
}


def cache_root() -> Path:
    env = os.environ.get("TOKENFLOW_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "tokenflow"


def resolve_model(name_or_path: str | Path) -> Path:
    """`builtin:<name>` -> its (created on demand) folder; anything else must be a folder."""
    name = str(name_or_path)
    if name.startswith(PREFIX):
        preset = name.removeprefix(PREFIX)
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; known: {[PREFIX + p for p in PRESETS]}")
        return ensure_preset(preset)
    path = Path(name).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"model {name!r} is neither a builtin preset nor a folder")
    return path


def ensure_preset(preset: str, root: Path | None = None) -> Path:
    root = root or cache_root()
    final = root / f"{preset}-v{PRESET_VERSION}"
    if final.is_dir():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{preset}-", dir=root))
    try:
        write_preset(PRESETS[preset], tmp)
        os.rename(tmp, final)
    except OSError:
        if not final.is_dir():
            raise
        # Another process won the race; its folder is complete by construction.
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def preset_config_dict(spec: PresetSpec) -> dict[str, object]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.hidden_size // spec.num_attention_heads,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": spec.max_position_embeddings,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }


def random_state_dict(config: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    with build_on_meta():
        shapes = {k: v.shape for k, v in
                  model_class(config.model_type)(config).state_dict().items()}
    generator = torch.Generator(device="cpu").manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    for name in sorted(shapes):
        shape = shapes[name]
        if name.endswith("norm.weight"):
            state[name] = torch.ones(shape)
            continue
        if name == "model.embed_tokens.weight":
            std = 1.0
        elif name == "lm_head.weight":
            std = LOGIT_STD / config.hidden_size**0.5
        else:  # [out, in] linear weight
            std = 1.0 / shape[-1] ** 0.5
        state[name] = torch.randn(shape, generator=generator) * std
    return state


def bytes_to_unicode() -> dict[int, str]:
    """The GPT-2 byte-level alphabet: printable bytes map to themselves, the rest are shifted
    to code points >= 256 so that every byte is a visible, whitespace-free character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    mapping = {b: chr(b) for b in printable}
    shift = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + shift)
            shift += 1
    return mapping


def build_tokenizer(vocab_size: int) -> Tokenizer:
    """Byte-level BPE without merges: specials, the 256 bytes, then `<id>` fillers so every id
    up to vocab_size decodes to something."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for byte, char in bytes_to_unicode().items():
        vocab[char] = NUM_SPECIAL_TOKENS + byte
    for token_id in range(len(vocab), vocab_size):
        vocab[f"<{token_id}>"] = token_id
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL_TOKENS])
    return tokenizer


def write_preset(spec: PresetSpec, folder: Path) -> None:
    raw_config = preset_config_dict(spec)
    config = ModelConfig.from_dict(raw_config)
    (folder / "config.json").write_text(json.dumps(raw_config, indent=2), encoding="utf-8")
    save_file(random_state_dict(config, spec.seed), str(folder / "model.safetensors"))
    build_tokenizer(spec.vocab_size).save(str(folder / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "model_max_length": spec.max_position_embeddings,
        "chat_template": DEFAULT_CHAT_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config, indent=2), encoding="utf-8"
    )
