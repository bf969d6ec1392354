"""The one validated home of configuration: pydantic settings, env prefix `TOKENFLOW_`.

Every threshold from the seed documents is a documented field here, never a literal in
code. Components take the slices they need (`scheduler_config()`, ...).
"""

from __future__ import annotations

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from controller.scheduler import SchedulerConfig


class TokenflowConfig(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TOKENFLOW_", extra="ignore")

    # -- model and worker ------------------------------------------------------------
    model: str = Field("builtin:tiny", description=(
        "Hugging Face checkpoint folder (config.json, *.safetensors, tokenizer.json) of the "
        "Llama family, or a built-in preset: builtin:tiny (default) or builtin:bench."))
    served_model_name: str | None = Field(None, description=(
        "Name clients pass as `model`; defaults to the `model` value."))
    dtype: str = Field("float32", description="Weights and activations dtype: float32, "
                       "bfloat16 or float16 (CPU runs want float32).")
    device: str = Field("auto", description="auto (CUDA when present, else CPU), cpu or cuda.")
    seed: int = Field(0, description="Seed of the workers' sampler for unseeded requests.")
    num_workers: int = Field(1, ge=1, description=(
        "CPU worker actors to start when no GPU is present (one per GPU otherwise)."))
    worker_num_cpus: float = Field(0.5, gt=0, description=(
        "Ray CPUs reserved per CPU worker actor (fractional on small machines)."))

    # -- KV cache ---------------------------------------------------------------------
    block_size: int = Field(16, ge=1, description="Tokens per KV block.")
    num_kv_blocks: int = Field(2048, ge=1, description="KV blocks per worker.")
    enable_prefix_caching: bool = Field(True, description=(
        "Share full KV blocks between requests with the same prefix (chained hashes)."))

    # -- scheduler ----------------------------------------------------------------------
    max_num_batched_tokens: int = Field(2048, ge=1, description=(
        "Token budget of one step (decode tokens + prefill chunk tokens). Seed 004: 2048 "
        "is vLLM's online default on ordinary GPUs; the calibrator replaces it."))
    max_num_seqs: int = Field(256, ge=1, description="Running requests per worker at most.")
    max_chunk_tokens: int | None = Field(None, ge=1, description=(
        "Cap on one prefill chunk; None means the whole budget."))
    max_concurrent_chunks: int = Field(4, ge=1, description=(
        "Prefill chunks per step in NORMAL mode (seed 000: 4 in parallel)."))
    max_model_len: int = Field(8192, ge=1, description="Prompt + output tokens at most.")
    default_max_tokens: int = Field(256, ge=1, description=(
        "max_tokens when a request does not set it."))

    # -- protections (seed 000 §6) ---------------------------------------------------
    max_prefill_tokens: int = Field(8192, ge=1, description=(
        "Longest prompt the budget is planned for."))
    circuit_breaker_factor: float = Field(1.2, gt=1.0, description=(
        "Budget circuit breaker: a prompt over max_prefill_tokens x this factor gets 422 "
        "before any actor call (seed 000: 1.2x)."))
    max_queue_len: int = Field(1024, ge=1, description=(
        "Waiting requests in the controller before new ones get 429."))

    # -- cluster ------------------------------------------------------------------------
    host: str = Field("127.0.0.1", description="HTTP bind address of the Serve ingress.")
    port: int = Field(8000, ge=1, le=65535, description="HTTP port of the Serve ingress.")
    namespace: str = Field("tokenflow", description="Ray namespace of the named actors.")
    redis_url: str | None = Field(None, description=(
        "Redis for request persistence; None keeps it in memory (the embedded default)."))

    @model_validator(mode="after")
    def _check(self) -> TokenflowConfig:
        chunk = self.max_chunk_tokens
        if chunk is not None and chunk > self.max_num_batched_tokens:
            raise ValueError("max_chunk_tokens must not exceed max_num_batched_tokens")
        if self.num_kv_blocks < 2:
            raise ValueError("the KV pool needs at least two blocks")
        return self

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    @property
    def prefill_cap_tokens(self) -> int:
        """Prompts longer than this are refused with 422 (the circuit breaker)."""
        return int(self.max_prefill_tokens * self.circuit_breaker_factor)

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            max_chunk_tokens=self.max_chunk_tokens,
            max_concurrent_chunks=self.max_concurrent_chunks,
        )
