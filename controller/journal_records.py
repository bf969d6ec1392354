"""The journal's settings (`journal:`), one journaled request as a restarted controller reads
it back, and the journal's counters."""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field

from controller.messages import SamplingParams, TokenLogprob
from controller.request import Request
from controller.settings import FORBID_EXTRA, check_settings, setting


@dataclass(frozen=True)
class JournalConfig:
    """The request journal in Redis (`journal:`); on when `cluster.redis_url` is set."""

    __pydantic_config__ = FORBID_EXTRA

    key_prefix: str = setting("", description=(
        "Prefix of every journal key, to keep deployments sharing one Redis apart."))
    finished_ttl_s: int = setting(3600, ge=1, description=(
        "Seconds a finished request's keys stay in Redis before they expire."))
    max_buffered_ops: int = setting(200_000, ge=1, description=(
        "Journal writes buffered for the writer thread; beyond it the buffer is dropped and "
        "the full state of every unfinished request is re-written instead (no loss)."))
    reconnect_backoff_s: float = setting(0.1, gt=0, description=(
        "First wait before retrying an unreachable Redis; doubles up to the maximum."))
    reconnect_backoff_max_s: float = setting(2.0, gt=0, description=(
        "Longest wait between tries to reach Redis."))
    socket_timeout_s: float = setting(2.0, gt=0, description=(
        "Redis socket connect and read timeout: how long a dead Redis can hold the writer."))
    write_interval_s: float = setting(0.05, ge=0, description=(
        "Least seconds between two writes of token progress: the steps in between go out "
        "in one round trip (each round trip costs the controller process CPU, a noticeable "
        "share of a GPU step when paid every step). Admissions and flushes are written at "
        "once. "
        "Tokens not yet written when the controller dies are recomputed on resume (same "
        "seed, same tokens), so this trades CPU for a little recompute, never correctness; "
        "Redis's own default fsync loses up to 1 s anyway."))
    warn_interval_s: float = setting(10.0, ge=0, description=(
        "At most one 'journal paused' warning per this many seconds."))
    resume_timeout_s: float = setting(120.0, gt=0, description=(
        "After a controller restart, a journaled request that no consumer resumed within "
        "this many seconds is aborted (its consumer is gone too)."))

    def __post_init__(self) -> None:
        check_settings(self)


@dataclass
class JournalRecord:
    """One request as the journal holds it; enough to recompute it under its own id."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    tenant: str = "default"
    priority: int = 0
    arrival_time: float = 0.0  # wall clock (s since the epoch) at admission
    output_token_ids: list[int] = field(default_factory=list)
    # chunk index -> (start, num_tokens) of the prefill chunks completed so far
    chunks: dict[int, tuple[int, int]] = field(default_factory=dict)
    finish_reason: str | None = None
    error: str | None = None
    # One per output token when the params ask for log-probabilities (else None): a
    # consumer resumed after a restart gets the journaled tokens with theirs.
    output_logprobs: list[TokenLogprob] | None = None

    @classmethod
    def of(cls, request: Request) -> JournalRecord:
        """At admission: no output yet."""
        wants = request.sampling_params.logprobs is not None
        return cls(request.request_id, list(request.prompt_token_ids), request.sampling_params,
                   request.tenant, request.priority, time.time(),
                   output_logprobs=[] if wants else None)

    def static_json(self) -> str:
        """What never changes after admission."""
        params = dataclasses.asdict(self.params)
        return json.dumps({"prompt_token_ids": self.prompt_token_ids, "params": params,
                           "tenant": self.tenant, "priority": self.priority,
                           "arrival_time": self.arrival_time})

    @classmethod
    def from_redis(cls, request_id: str, fields: dict[str, str], tokens: list[str],
                   chunks: dict[int, tuple[int, int]], logprobs: list[str]) -> JournalRecord:
        static = json.loads(fields["record"])
        params = static["params"]
        for name in ("stop_token_ids", "stop"):
            params[name] = tuple(params[name])
        output_ids = [int(t) for t in tokens]
        output_logprobs = None
        if params["logprobs"] is not None:
            # The two lists are written in one pipeline, not atomically: tokens past the
            # shorter one are recomputed on resume, with their log-probabilities.
            output_logprobs = [decode_logprob(entry) for entry in logprobs]
            num_both = min(len(output_ids), len(output_logprobs))
            output_ids, output_logprobs = output_ids[:num_both], output_logprobs[:num_both]
        return cls(request_id, static["prompt_token_ids"], SamplingParams(**params),
                   static["tenant"], static["priority"], static["arrival_time"],
                   output_ids, chunks, fields.get("finish_reason"), fields.get("error"),
                   output_logprobs)


def encode_logprob(entry: TokenLogprob) -> str:
    """JSON floats round-trip exactly: a resumed consumer gets the values it would have."""
    return json.dumps([entry.token_id, entry.logprob, entry.top_ids, entry.top_logprobs])


def decode_logprob(text: str) -> TokenLogprob:
    token_id, logprob, top_ids, top_logprobs = json.loads(text)
    return TokenLogprob(token_id, logprob, tuple(top_ids), tuple(top_logprobs))


@dataclass(frozen=True)
class JournalStats:
    is_paused: bool
    num_pauses: int  # times Redis became unreachable
    num_write_errors: int
    num_catch_ups: int  # full re-writes after a pause or an overflow
    num_overflows: int
    num_round_trips: int
    num_ops_written: int
    num_buffered_ops: int
    num_unfinished: int


# A buffered write: the writer turns each into pipeline commands.
