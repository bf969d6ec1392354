"""One `Request` per user request: the only per-request state the scheduler keeps.

No prefill or decode phase is stored: a request has `num_computed_tokens` and
`num_tokens`, and whether it is prefilling or decoding is derived from them (as in vLLM
V1). The status says only where the request is: queued, running, preempted or finished.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from controller.logprobs import PromptLogprobs
from controller.messages import FinishReason, RequestOutput, SamplingParams

__all__ = ["Request", "RequestOutput", "RequestStatus"]  # RequestOutput: its old home


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"  # admitted: holds blocks, advances every step it is scheduled
    PREEMPTED = "preempted"  # back in the waiting queue, blocks released
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    # Plain attributes set once per member: read for every request every step, where an
    # enum property with a membership test and a FinishReason lookup would cost more.
    is_finished: bool
    finish_reason: FinishReason | None

    def __init__(self, value: str) -> None:
        self.is_finished = value in ("stop", "length", "abort")
        self.finish_reason = FinishReason(value) if self.is_finished else None


# eq=False: a request is an identity. The generated __eq__ builds and compares a tuple of
# every field, and `request in running` / `running.remove` would run it against each
# running request, every step.
@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    priority: int = 0  # lower value is served first (vLLM's convention)
    arrival_time: float = 0.0
    tenant: str = "default"
    max_model_len: int | None = None  # hard cap on prompt + output tokens
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # planned ones included: advanced when a step is planned
    # Tokens that steps planned (and maybe still running) will sample, ids not known yet.
    # Always 0 between steps when they run one at a time; up to 1 per step planned ahead.
    num_pending_outputs: int = 0
    num_cached_tokens: int = 0  # prefix-cache hit at first admission
    num_preemptions: int = 0
    num_worker_failures: int = 0  # workers that died or hung while it was on them
    status: RequestStatus = RequestStatus.WAITING
    arrival_seq: int = 0  # tie-breaker set by the scheduler: strict arrival order
    first_scheduled_time: float | None = None
    prompt_logprobs: PromptLogprobs | None = None  # gathered when the params ask (echo)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens_to_compute(self) -> int:
        """Known and pending tokens that no step has computed or planned yet."""
        return self.num_tokens + self.num_pending_outputs - self.num_computed_tokens

    @property
    def num_outputs_planned(self) -> int:
        return self.num_output_tokens + self.num_pending_outputs

    @property
    def is_decoding(self) -> bool:
        """Exactly one token is not computed yet: the last sampled (or pending) one.
        (num_outputs_planned > 0 and num_tokens_to_compute == 1, inlined: it is asked of
        every running request every step.)"""
        num_planned = len(self.output_token_ids) + self.num_pending_outputs
        return num_planned > 0 and \
            len(self.prompt_token_ids) + num_planned - self.num_computed_tokens == 1

    @property
    def is_done_when_pending_land(self) -> bool:
        """Steps in flight will sample its last token (by length): plan nothing more."""
        if self.num_pending_outputs == 0:
            return False
        if self.num_outputs_planned >= self.sampling_params.max_tokens:
            return True
        return self.max_model_len is not None and \
            self.num_tokens + self.num_pending_outputs >= self.max_model_len

    @property
    def is_prefilling(self) -> bool:
        """Running and not decoding: a prompt (or, after a preemption, prompt + output)
        is being computed in chunks."""
        return self.status == RequestStatus.RUNNING and not self.is_decoding

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def sort_key(self) -> tuple[int, int]:
        return (self.priority, self.arrival_seq)

    @property
    def needs_prompt_recompute(self) -> bool:
        """The request wants prompt log-probabilities it has not all received: its prompt is
        computed from the start, whatever the prefix cache holds (controller/logprobs.py)."""
        if self.sampling_params.prompt_logprobs is None:
            return False
        got = self.prompt_logprobs.num_received if self.prompt_logprobs else 0
        return got < self.num_prompt_tokens - 1

    def check_stop(self) -> RequestStatus | None:
        """The finish status implied by the last sampled token, if any."""
        params = self.sampling_params
        last = self.output_token_ids[-1]
        if not params.ignore_eos and last in self.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if last in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if self.max_model_len is not None and self.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
