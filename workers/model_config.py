"""`ModelConfig`: the subset of a Hugging Face `config.json` that the Llama family needs.

Supported `model_type`s: llama, mistral, qwen2. They share one architecture (pre-norm decoder,
RMSNorm, rotary embeddings, GQA attention, SiLU-gated MLP) and differ only in:
- projection biases: qwen2 always has q/k/v biases and no o bias; llama has biases on q/k/v/o
  iff `attention_bias`; mistral has none;
- mistral's sliding window (see `max_model_len`).

RoPE is read from either layout Hugging Face has used:
- old: top-level `rope_theta` plus an optional `rope_scaling` dict (`rope_type` or `type`);
- new (transformers >= 5): a `rope_parameters` dict holding `rope_theta`, `rope_type` and the
  scaling fields (llama3: `factor`, `low_freq_factor`, `high_freq_factor`,
  `original_max_position_embeddings`).
Only `default` and `llama3` are implemented; anything else raises `ValueError`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workers.models.registry import MODEL_TYPE_TO_CLASS

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = tuple(MODEL_TYPE_TO_CLASS)  # one line each in workers/models/registry.py
SUPPORTED_ROPE_TYPES = ("default", "llama3")
DEFAULT_ROPE_THETA = 10000.0


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters; the llama3 fields are only meaningful for `llama3`."""

    rope_type: str = "default"
    rope_theta: float = DEFAULT_ROPE_THETA
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool  # biases on q/k/v
    o_proj_bias: bool
    mlp_bias: bool
    max_position_embeddings: int
    rope: RopeConfig
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"
    sliding_window: int | None = None

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def max_model_len(self) -> int:
        """Longest sequence this engine serves with the model.

        Sliding-window attention is not implemented. Within the window it is identical to full
        attention, so instead of approximating we cap the usable context at the window: the
        result is exact, and longer requests must be rejected by the caller.
        """
        if self.sliding_window is not None and self.sliding_window < self.max_position_embeddings:
            return self.sliding_window
        return self.max_position_embeddings

    def kv_bytes_per_token(self, elem: int) -> int:
        """K and V of one token in every layer, `elem` bytes per value."""
        return 2 * self.num_hidden_layers * self.kv_size * elem

    def activation_bytes_per_token(self, elem: int) -> int:
        """One write and one read, per layer, of each intermediate vector of a token (norm
        in/out, q/k/v, attention out, gate/up/act): the step's activation traffic."""
        per_layer = 4 * self.hidden_size + 2 * self.q_size + 2 * self.kv_size
        per_layer += 3 * self.intermediate_size
        return 2 * self.num_hidden_layers * per_layer * elem

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        model_type = raw.get("model_type")
        if model_type not in MODEL_TYPE_TO_CLASS:
            raise ValueError(
                f"unsupported model_type {model_type!r}; supported: {tuple(MODEL_TYPE_TO_CLASS)}"
            )
        hidden_size = int(raw["hidden_size"])
        num_heads = int(raw["num_attention_heads"])
        head_dim = raw.get("head_dim") or hidden_size // num_heads
        if model_type == "qwen2":
            qkv_bias, o_bias = True, False
        else:
            qkv_bias = o_bias = bool(raw.get("attention_bias", False))
        max_pos = int(raw.get("max_position_embeddings", 2048))
        sliding_window = _parse_sliding_window(model_type, raw)
        if sliding_window is not None and sliding_window < max_pos:
            logger.warning(
                "%s: sliding_window=%d < max_position_embeddings=%d; sliding-window attention "
                "is not implemented, context is capped at %d tokens",
                model_type, sliding_window, max_pos, sliding_window,
            )
        return cls(
            model_type=model_type,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=num_heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=qkv_bias,
            o_proj_bias=o_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            max_position_embeddings=max_pos,
            rope=parse_rope(raw, max_pos),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_as_id_tuple(raw.get("eos_token_id")),
            # transformers >= 5 writes `dtype`, older versions `torch_dtype`.
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            sliding_window=sliding_window,
        )


def parse_rope(raw: dict[str, Any], max_position_embeddings: int) -> RopeConfig:
    """Merge both RoPE layouts; `rope_parameters` wins where both are present."""
    params: dict[str, Any] = {}
    if isinstance(raw.get("rope_scaling"), dict):
        params.update(raw["rope_scaling"])
    if raw.get("rope_theta") is not None:
        params.setdefault("rope_theta", raw["rope_theta"])
    if isinstance(raw.get("rope_parameters"), dict):
        params.update(raw["rope_parameters"])
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope_type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}"
        )
    theta = float(params.get("rope_theta") or DEFAULT_ROPE_THETA)
    if rope_type == "default":
        return RopeConfig(rope_type="default", rope_theta=theta)
    missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor") if k not in params]
    if missing:
        raise ValueError(f"llama3 rope scaling is missing {missing}")
    return RopeConfig(
        rope_type="llama3",
        rope_theta=theta,
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        # Same fallback as transformers: the model's own context length.
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings") or max_position_embeddings
        ),
    )


def _parse_sliding_window(model_type: str, raw: dict[str, Any]) -> int | None:
    window = raw.get("sliding_window")
    # qwen2 configs carry a `sliding_window` value that only applies with `use_sliding_window`.
    if model_type == "qwen2" and not raw.get("use_sliding_window", False):
        return None
    if model_type == "llama":
        return None
    return int(window) if window else None


def _as_id_tuple(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)
