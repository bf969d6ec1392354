"""A worker's results side (a part of `Worker`): a step's `StepResult` with its sampled
tokens, one `ChunkComplete` per prefill chunk, the bytes the step moved (the model's
config prices them) and the telemetry sample taken on it."""

from __future__ import annotations

import time

import torch

from controller.messages import ChunkComplete, StepPlan, StepResult
from workers.attention import SeqSpan
from workers.model_config import ModelConfig
from workers.step_state import RequestState
from workers.telemetry import TelemetrySource


class StepResults:
    telemetry: TelemetrySource | None
    _requests: dict[str, RequestState]
    _kv_bytes_per_token: int
    _act_bytes_per_token: int
    _matmul_weight_bytes: int
    _config: ModelConfig
    dtype: torch.dtype
    vocab_size: int

    def _sample_telemetry(self, result: StepResult) -> StepResult:
        if self.telemetry is not None:
            sample = self.telemetry.sample(result.bytes_moved, result.elapsed_s, time.monotonic())
            result.bandwidth_utilization = sample.bandwidth_utilization
        return result

    def _finish_step(
        self, plan: StepPlan, spans: dict[str, SeqSpan], sampled: dict[str, int], elapsed_s: float
    ) -> StepResult:
        num_tokens = sum(span.num_query_tokens for span in spans.values())
        result = StepResult(step_id=plan.step_id, elapsed_s=elapsed_s, num_tokens=num_tokens)
        total_bytes = self._matmul_weight_bytes + len(sampled) * self.vocab_size * 4
        for request_id, span in spans.items():
            state = self._requests[request_id]
            begin = span.context_len - span.num_query_tokens
            span_bytes = self._span_bytes(span)
            total_bytes += span_bytes
            if span.num_query_tokens > 1 or begin < state.num_admitted_tokens:
                weight_share = self._matmul_weight_bytes * span.num_query_tokens // num_tokens
                result.chunk_events.append(
                    ChunkComplete(
                        request_id=request_id,
                        chunk_index=state.num_chunks,
                        start=begin,
                        num_tokens=span.num_query_tokens,
                        elapsed_s=elapsed_s,
                        bytes_moved=span_bytes + weight_share,
                    )
                )
                state.num_chunks += 1
            state.num_computed = span.context_len
            token = sampled.get(request_id)
            result.sampled_token_ids[request_id] = [] if token is None else [token]
            if token is not None:
                state.token_ids.append(token)
                state.num_output_tokens += 1
        result.bytes_moved = total_bytes
        return result

    def _span_bytes(self, span: SeqSpan) -> int:
        """KV read + KV written + activations of one span (weights excluded)."""
        kv = (span.context_len + span.num_query_tokens) * self._kv_bytes_per_token
        embed_row = self._config.hidden_size * self.dtype.itemsize
        return kv + span.num_query_tokens * (self._act_bytes_per_token + embed_row)
