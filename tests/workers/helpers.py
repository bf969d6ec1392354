"""Test helpers: tiny random transformers checkpoints and a minimal controller stand-in."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

from controller.messages import (
    CachedRequestData,
    NewRequestData,
    SamplingParams,
    StepPlan,
    StepResult,
)
from workers.worker import Worker

GREEDY = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
COMMON: dict[str, Any] = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
    initializer_range=0.2, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
)


def build_hf_checkpoint(arch: str, path: Path, seed: int = 0, **overrides: Any) -> Path:
    """Random transformers model saved as safetensors. Biases and norm weights are perturbed
    (transformers initialises them to 0 and 1, which would hide bugs in their handling)."""
    import transformers as tf

    settings = {**COMMON, **overrides}
    if arch == "llama":
        config, model_cls = tf.LlamaConfig(**settings), tf.LlamaForCausalLM
    elif arch == "mistral":
        settings.setdefault("sliding_window", None)
        config, model_cls = tf.MistralConfig(**settings), tf.MistralForCausalLM
    elif arch == "qwen2":
        settings.setdefault("use_sliding_window", False)
        config, model_cls = tf.Qwen2Config(**settings), tf.Qwen2ForCausalLM
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.2)
            elif "norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
    model.save_pretrained(path, safe_serialization=True)
    return path


def hf_logits(path: Path, ids: list[int]) -> torch.Tensor:
    """transformers' logits for every position of one unpadded sequence: [n, vocab] fp32."""
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()


def random_ids(n: int, seed: int, vocab_size: int = 256) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab_size) for _ in range(n)]


class Driver:
    """Controller stand-in: gives each request a disjoint block range up front and sends the
    plan diffs the real scheduler would (NewRequestData once, CachedRequestData after)."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.step_id = 0
        self.next_block = 0
        self.pending: dict[str, NewRequestData] = {}
        self.num_computed: dict[str, int] = {}
        self.tokens: dict[str, list[int]] = {}

    def add(
        self,
        request_id: str,
        token_ids: list[int],
        params: SamplingParams = GREEDY,
        max_len: int | None = None,
        block_ids: list[int] | None = None,
        num_computed: int = 0,
        num_output_tokens: int = 0,
    ) -> None:
        if block_ids is None:
            num_blocks = -(-(max_len or len(token_ids) + 64) // self.worker.block_size)
            block_ids = list(range(self.next_block, self.next_block + num_blocks))
            self.next_block += num_blocks
        self.pending[request_id] = NewRequestData(
            request_id, list(token_ids), params, block_ids, num_computed, num_output_tokens
        )
        self.num_computed[request_id] = num_computed
        self.tokens[request_id] = list(token_ids)

    def step(self, schedule: dict[str, int], finished: set[str] | None = None) -> StepResult:
        self.step_id += 1
        cached = [
            CachedRequestData(rid, [], self.num_computed[rid])
            for rid in schedule if rid not in self.pending
        ]
        plan = StepPlan(
            step_id=self.step_id,
            new_requests=list(self.pending.values()),
            cached_requests=cached,
            num_scheduled_tokens=dict(schedule),
            total_num_scheduled_tokens=sum(schedule.values()),
            finished_request_ids=set(finished or ()),
        )
        self.pending.clear()
        result = self.worker.execute(plan)
        for rid, n in schedule.items():
            self.num_computed[rid] += n
            self.tokens[rid] += result.sampled_token_ids[rid]
        return result

    def prefill(self, request_id: str, chunk_len: int) -> StepResult:
        """Run the request's known tokens in chunks of `chunk_len`; returns the last result."""
        result = None
        num_known = len(self.tokens[request_id])  # the last chunk appends a sampled token
        while self.num_computed[request_id] < num_known:
            remaining = num_known - self.num_computed[request_id]
            result = self.step({request_id: min(chunk_len, remaining)})
        assert result is not None
        return result

    def decode(self, request_id: str, num_steps: int) -> list[int]:
        before = len(self.tokens[request_id])
        for _ in range(num_steps):
            self.step({request_id: 1})
        return self.tokens[request_id][before:]
