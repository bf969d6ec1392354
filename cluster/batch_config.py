"""The batch jobs' settings (`batch:` in the configuration), apart from the runners so that
`cluster.config` nests them without importing the runners (which import it)."""

from __future__ import annotations

from dataclasses import dataclass

from controller.settings import FORBID_EXTRA, check_settings, check_thread_count, setting


@dataclass(frozen=True)
class BatchConfig:
    """Offline batch jobs (`python -m cluster.batch`): local, on the cluster, with Ray Data."""

    __pydantic_config__ = FORBID_EXTRA

    max_in_flight: int = setting(256, ge=1, description=(
        "Requests a batch job keeps outstanding at once (in the local engine, or on the "
        "cluster's controller: its queue stays bounded for online traffic, and a long input "
        "is never held in memory)."))
    max_num_batched_tokens: int = setting(8192, ge=1, description=(
        "Step budget of an offline batch job (local, or on a controller the job starts) "
        "unless scheduler.max_num_batched_tokens or a budget file is set: no one waits on "
        "a token, so a step as large as vLLM's offline default amortizes weight reads "
        "instead of meeting an ITL SLO."))
    max_concurrent_chunks: int = setting(256, ge=1, description=(
        "Prefill chunks per step of an offline batch job (local, or on a controller the "
        "job starts) unless scheduler.max_concurrent_chunks is set: every short prompt is "
        "a chunk, and the interactive limit would admit a batch of short prompts a few "
        "per step while the step budget sits unused."))
    worker_num_threads: int | None = setting(-2, description=(
        "torch threads of the CPU worker that a job's own controller starts, unless "
        "worker.num_threads is set, counted as worker.num_threads counts: the default -2 "
        "is every core of its node but one (an offline job is that node's work; the one "
        "left is the job's driver's and controller's: on 2 cores the job ran as fast or "
        "faster with its worker on one thread than on two, 1,742 vs 1,570 tok/s in one "
        "run); None keeps worker.num_threads' default (the CPUs Ray reserves for the "
        "worker)."))
    start_timeout_s: float = setting(600.0, gt=0, description=(
        "How long a batch job on the cluster waits for the controller's workers to come up "
        "(a job that starts its own controller loads the model first). Was "
        "batch.ready_wait_s, renamed: cluster.ready_wait_s is another wait (a request's for "
        "the controller's answer)."))
    rows_per_shard: int = setting(10_000, ge=1, description=(
        "Output lines per shard file of `--ray-data` (a shard is closed and listed in the "
        "manifest when full)."))

    def __post_init__(self) -> None:
        check_settings(self)
        check_thread_count("batch.worker_num_threads", self.worker_num_threads)
