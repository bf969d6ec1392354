"""Every message that crosses the controller/worker boundary, as plain dataclasses.

Torch-free and Ray-free: these objects are passed by reference inside `LocalEngine`;
between the controller actor and a worker actor a step's plan and result travel as bytes
(`encode_message`, `decode_plan`, `decode_result`).

Protocol (vLLM V1 style, diffs not states):
- A request the worker has not seen travels whole once, as `NewRequestData`.
- A request the worker already holds travels as `CachedRequestData`: only the
  blocks appended since the last step.
- `finished_request_ids` tells the worker to drop its per-request state; a preempted
  request is in that list too and comes back later as `NewRequestData`.

Toward the edge (controller -> ingress or batch runner): `Ack` answers an admitted request,
then `Delta`s carry its new tokens, the last one with a `FinishReason`.
"""

from __future__ import annotations

import enum
import pickle
from collections.abc import Iterator
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One position's log-probabilities (controller/logprobs.py): the token there, its
    log-probability, and the most likely tokens with theirs. Here because it crosses the
    door: the worker builds it, the controller and the edge read it."""

    token_id: int
    logprob: float
    top_ids: tuple[int, ...] = ()  # most likely first
    top_logprobs: tuple[float, ...] = ()


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token. Validated at the edge (ingress, batch reader)."""

    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) disables top-k
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings: applied where text is decoded
    # Log-probabilities (controller/logprobs.py): None off, k >= 0 the sampled token's
    # plus the k most likely; `prompt_logprobs` the same for every prompt token (echo).
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # Choice i > 0 of an n > 1 request: the id of choice 0, whose prompt blocks it shares
    # (controller/choices.py). A scheduling hint: the worker ignores it.
    prompt_shared_with: str | None = None
    # Structured output (workers/structured/spec.py): "" is unconstrained; else the kind and its
    # text, which the worker's grammar mask enforces on every sampled token.
    grammar_kind: str = ""
    grammar_spec: str = ""

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class NewRequestData:
    """A request the worker has not seen yet (or sees again after preemption)."""

    request_id: str
    token_ids: list[int]  # prompt + already generated tokens (after a preemption)
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int  # > 0 on a prefix-cache hit
    num_output_tokens: int = 0  # generated tokens already inside token_ids


@dataclass
class CachedRequestData:
    """Diff for a request the worker holds: blocks appended this step. Sent only when
    there is one: a scheduled request without it keeps its block table, and its
    `num_computed_tokens` is where the worker's previous step left it."""

    request_id: str
    new_block_ids: list[int]
    num_computed_tokens: int  # as the controller sees it before this step


@dataclass
class StepPlan:
    """What one worker computes in one step. Invariant:
    sum(num_scheduled_tokens.values()) == total_num_scheduled_tokens <= token budget."""

    step_id: int
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    finished_request_ids: set[str] = field(default_factory=set)
    # KV defragmentation: copy block src's rows to dst and rename src -> dst in every block
    # table, after dropping finished requests and before anything else (kvcache/defrag.py).
    block_moves: dict[int, int] = field(default_factory=dict)
    # A decode burst (> 1): decode-only, every request 1 token, run this many times in a
    # row, each time on the token the one before sampled; the controller allocated the
    # blocks for all of them and drops what follows a stop (controller/scheduler.py).
    num_steps: int = 1

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0

    @property
    def carries_nothing(self) -> bool:
        """No token, no finished id, no block move: the only plan that may be dropped
        unsent. The moves are applied to the controller's tables when planned: a dropped
        step that carried them left the worker's blocks where the prefix hashes no longer
        point (a later hit read another request's KV)."""
        return self.is_empty and not self.finished_request_ids and not self.block_moves


@dataclass
class ChunkComplete:
    """A prefill chunk finished: a span of a request's prompt (or, after a preemption, of its
    recomputed tokens) computed in one step. The chunk that reaches the end of the known
    tokens samples the request's next token and is reported too; a decode step is not."""

    request_id: str
    chunk_index: int
    start: int  # global position of the chunk's first token
    num_tokens: int
    elapsed_s: float
    bytes_moved: int


@dataclass
class CacheEvict:
    """Blocks of a request were released (finish, abort or preemption)."""

    request_id: str
    num_blocks_freed: int
    kv_usage: float  # pool usage after the release, 0..1


@dataclass
class StepResult:
    """What a worker reports back for one `StepPlan`."""

    step_id: int
    # request_id -> tokens sampled this step (empty list for a chunk that did not sample)
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    chunk_events: list[ChunkComplete] = field(default_factory=list)
    elapsed_s: float = 0.0  # worker compute time for the step
    bytes_moved: int = 0  # estimate: weights + KV read/written + activations
    num_tokens: int = 0
    # The worker's telemetry sample for this step (workers/telemetry.py), 0..1 of peak
    # memory bandwidth; None when the worker has no telemetry source.
    bandwidth_utilization: float | None = None
    # Requests whose params ask for them: the sampled token's log-probabilities, and the
    # prompt positions this step's span scored as (position of the first, entries).
    sampled_logprobs: dict[str, TokenLogprob] = field(default_factory=dict)
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprob]]] = field(default_factory=dict)


class FinishReason(enum.StrEnum):
    """Why a request ended, spelled as the OpenAI API spells `finish_reason`."""

    STOP = "stop"  # EOS, a stop token id, or a stop string at the edge
    LENGTH = "length"  # max_tokens or the model's context length
    ABORT = "abort"  # aborted: by its consumer, a protection or a failed worker


@dataclass
class RequestOutput:
    """Delta for one request after one step: the edge turns these into streams."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None  # None while running
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int = 0
    error: str | None = None  # set when the request was aborted by a protection
    logprobs: list[TokenLogprob] | None = None  # one per new token, when the params ask
    prompt_logprobs: list[TokenLogprob] | None = None  # prompt positions 1.., in order

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class Ack:
    """The controller admitted a request (it sits in `worker`'s queue)."""

    request_id: str
    worker: int
    num_prompt_tokens: int


@dataclass
class Delta:
    """New tokens of one request since its last delta; counters as of the latest step."""

    request_id: str
    worker: int  # -1 when the sender no longer knows it
    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None  # None while the request runs
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None  # set when a protection or a failed worker aborted it
    logprobs: list[TokenLogprob] | None = None  # one per token in token_ids, when asked
    prompt_logprobs: list[TokenLogprob] | None = None  # prompt positions 1.., when asked

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    @classmethod
    def from_output(cls, out: RequestOutput, worker: int) -> Delta:
        return cls(out.request_id, worker, list(out.new_token_ids), out.finish_reason,
                   out.num_prompt_tokens, out.num_output_tokens, out.num_cached_tokens,
                   out.error, out.logprobs, out.prompt_logprobs)

    @classmethod
    def merge(cls, deltas: list[Delta]) -> Delta:
        """Several deltas of one request, oldest first, as one: tokens joined, the last
        one's state wins, the first error is kept (a consumer that fell behind loses no
        token and no error)."""
        last = deltas[-1]
        return cls(last.request_id, last.worker, [t for d in deltas for t in d.token_ids],
                   last.finish_reason, last.num_prompt_tokens, last.num_output_tokens,
                   last.num_cached_tokens, next((d.error for d in deltas if d.error), None),
                   _joined([d.logprobs for d in deltas]),
                   _joined([d.prompt_logprobs for d in deltas]))

    @classmethod
    def failed(cls, request_id: str, error: str) -> Delta:
        """The end of a request whose delta stream broke on the way to its consumer."""
        return cls(request_id, -1, finish_reason=FinishReason.ABORT, error=error)


def _joined(parts: list[list[TokenLogprob] | None]) -> list[TokenLogprob] | None:
    if all(part is None for part in parts):
        return None
    return [entry for part in parts if part for entry in part]


@dataclass
class DeltaBatch:
    """A subscriber's deltas of one wake-up, column by column: what `subscribe` yields.

    One object of plain lists for Ray to pickle instead of one `Delta` each: cloudpickle
    calls back into Python per object, on the controller's step loop. Iterating gives the
    `Delta`s back."""

    request_ids: list[str] = field(default_factory=list)
    workers: list[int] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)
    finish_reasons: list[str | None] = field(default_factory=list)  # FinishReason values
    num_prompt_tokens: list[int] = field(default_factory=list)
    num_output_tokens: list[int] = field(default_factory=list)
    num_cached_tokens: list[int] = field(default_factory=list)
    errors: list[str | None] = field(default_factory=list)
    logprobs: list[list[TokenLogprob] | None] = field(default_factory=list)
    prompt_logprobs: list[list[TokenLogprob] | None] = field(default_factory=list)

    def append(self, delta: Delta) -> None:
        self._add(delta.request_id, delta.worker, delta.token_ids, delta.finish_reason,
                  (delta.num_prompt_tokens, delta.num_output_tokens, delta.num_cached_tokens),
                  delta.error)
        self.logprobs.append(delta.logprobs)
        self.prompt_logprobs.append(delta.prompt_logprobs)

    def append_output(self, out: RequestOutput, worker: int) -> None:
        """`append(Delta.from_output(out, worker))` without the `Delta` (the step loop's
        common case: one output per request per wake-up). The token list is shared, not
        copied: an output's list is its own (`Scheduler._output` builds a new one)."""
        self._add(out.request_id, worker, out.new_token_ids, out.finish_reason,
                  (out.num_prompt_tokens, out.num_output_tokens, out.num_cached_tokens),
                  out.error)
        self.logprobs.append(out.logprobs)
        self.prompt_logprobs.append(out.prompt_logprobs)

    def _add(self, request_id: str, worker: int, token_ids: list[int],
             reason: FinishReason | None, counts: tuple[int, int, int],
             error: str | None) -> None:
        """counts: (prompt, output, cached) tokens."""
        self.request_ids.append(request_id)
        self.workers.append(worker)
        self.token_ids.append(token_ids)
        self.finish_reasons.append(None if reason is None else reason.value)
        self.num_prompt_tokens.append(counts[0])
        self.num_output_tokens.append(counts[1])
        self.num_cached_tokens.append(counts[2])
        self.errors.append(error)

    @classmethod
    def of(cls, deltas: list[Delta]) -> DeltaBatch:
        batch = cls()
        for delta in deltas:
            batch.append(delta)
        return batch

    def finished_ids(self) -> list[str]:
        return [rid for rid, reason in zip(self.request_ids, self.finish_reasons, strict=True)
                if reason is not None]

    def __len__(self) -> int:
        return len(self.request_ids)

    def __iter__(self) -> Iterator[Delta]:
        for rid, worker, ids, reason, num_prompt, num_output, num_cached, error, lps, plps in zip(
                self.request_ids, self.workers, self.token_ids, self.finish_reasons,
                self.num_prompt_tokens, self.num_output_tokens, self.num_cached_tokens,
                self.errors, self.logprobs, self.prompt_logprobs, strict=True):
            yield Delta(rid, worker, ids, None if reason is None else FinishReason(reason),
                        num_prompt, num_output, num_cached, error, lps, plps)


def encode_message(message: StepPlan | StepResult) -> bytes:
    """A step's plan or result as it crosses Ray: the C pickler's bytes. Given the object,
    Ray pickles it with cloudpickle, whose per-object hook makes a step's call dearer to
    submit, and as much again to decode and to answer, all on the step's critical path
    (benchmarks/results/cluster.json has the figures)."""
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def decode_plan(data: StepPlan | bytes) -> StepPlan:
    plan = pickle.loads(data) if isinstance(data, bytes) else data
    if not isinstance(plan, StepPlan):
        raise TypeError(f"expected a StepPlan, got {type(plan).__name__}")
    return plan


def decode_result(data: StepResult | bytes) -> StepResult:
    result = pickle.loads(data) if isinstance(data, bytes) else data
    if not isinstance(result, StepResult):
        raise TypeError(f"expected a StepResult, got {type(result).__name__}")
    return result
