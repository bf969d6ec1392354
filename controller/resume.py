"""Resume after a controller restart: the journal's unfinished requests re-queued under
their own ids to recompute their prompt and generated tokens, their outputs held until a
consumer claims them (`ControllerActor.resume`), and the tokens a consumer already has not
sent twice (recomputation is deterministic)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from controller.core import ControllerCore
from controller.journal import Journal, JournalRecord
from controller.messages import RequestOutput, StepResult, TokenLogprob
from controller.options import ControllerOptions
from controller.request import Request, RequestStatus
from controller.routing import NoWorkerUpError

if TYPE_CHECKING:
    from controller.worker_loop import WorkerSlot

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _Unclaimed:
    """A request resumed from the journal that no consumer has claimed yet: its tokens
    (journaled and new) wait here for `resume`."""

    num_prompt_tokens: int
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None  # one per token when the params ask
    last: RequestOutput | None = None
    prompt_logprobs: list[TokenLogprob] | None = None  # echo's, recomputed meanwhile


class Resume:
    """The journal and the requests read back from it."""

    def __init__(self, options: ControllerOptions) -> None:
        self.options = options
        self.journal: Journal | None = None
        self.num_resumed = 0  # requests re-queued from the journal at start
        self.num_resumed_streams = 0  # of those, claimed by a consumer's `resume`
        self.unclaimed: dict[str, _Unclaimed] = {}
        # request id -> tokens its consumer already has beyond what the journal held (the
        # recomputation produces them again; they are not sent twice)
        self.num_to_skip: dict[str, int] = {}
        # Resumed echo requests whose consumer had a token, so their prompt's
        # log-probabilities (recomputed with the prompt) are not sent twice.
        self.has_prompt_logprobs: set[str] = set()
        # Why the journal could not be read at start (Redis unreachable), else None (in
        # `stats()`; the edge submits its open requests again).
        self.journal_error: str | None = None

    async def open_journal(self) -> list[JournalRecord]:
        """Start the journal (when Redis is configured) and read back what an earlier
        controller left unfinished."""
        url = self.options.cluster.redis_url
        if not url:
            return []
        if self.journal is not None:  # a failed start is retried: one writer thread only
            self.journal.close()
        self.journal = Journal(url, self.options.journal)
        try:
            return await asyncio.to_thread(self.journal.load_unfinished)
        except Exception as err:  # Redis down: serve on, the earlier requests are lost
            self.journal_error = f"{type(err).__name__}: {err}"
            logger.error("could not read the journal, no request resumed: %s",
                         self.journal_error)
            return []

    def restore(self, core: ControllerCore, records: list[JournalRecord],
                slots: list[WorkerSlot], abort: Callable[[str], bool]) -> None:
        """Re-queue journaled requests to recompute under their own ids; their tokens wait
        in `unclaimed` until a consumer resumes them (or `resume_timeout_s` passes)."""
        restored = []
        for record in records:
            request = Request(record.request_id, record.prompt_token_ids, record.params,
                              eos_token_ids=core.eos_token_ids, priority=record.priority,
                              arrival_time=core.clock(), tenant=record.tenant,
                              max_model_len=core.max_model_len,
                              output_token_ids=list(record.output_token_ids))
            logprobs = record.output_logprobs
            unclaimed = _Unclaimed(request.num_prompt_tokens, list(record.output_token_ids),
                                   None if logprobs is None else list(logprobs))
            self.unclaimed[record.request_id] = unclaimed
            status = request.check_stop() if request.output_token_ids else None
            error = None
            if status is None:
                try:
                    worker = core.restore_request(request)
                except (ValueError, NoWorkerUpError) as err:  # the configuration changed
                    status, error = RequestStatus.FINISHED_ABORTED, f"cannot resume: {err}"
            if status is not None:  # its last token ended it (the finish was not journaled)
                unclaimed.last = RequestOutput(
                    request.request_id, [], status.finish_reason, request.num_prompt_tokens,
                    request.num_output_tokens, error=error)
                if self.journal is not None:
                    self.journal.restore([record])
                    self.journal.record_output(unclaimed.last)
                continue
            slots[worker].num_routed += 1
            restored.append(record)
        if self.journal is not None:
            self.journal.restore(restored)
            self.journal.end_step()
        self.num_resumed = len(records)
        if records:
            asyncio.get_running_loop().call_later(
                self.options.journal.resume_timeout_s, self.abort_unclaimed, abort)

    def abort_unclaimed(self, abort: Callable[[str], bool]) -> None:
        """Nobody resumed these after a restart: their consumers are gone too."""
        unclaimed, self.unclaimed = self.unclaimed, {}
        if unclaimed:
            logger.warning("aborting %d journaled requests nobody resumed", len(unclaimed))
        for request_id in unclaimed:
            abort(request_id)

    def on_step(self, result: StepResult) -> None:
        if self.journal is not None:
            self.journal.record_chunks(result.chunk_events)
            self.journal.end_step()

    def intercept(self, out: RequestOutput) -> RequestOutput | None:
        """`out` as its consumer gets it: None while a resumed request is unclaimed (its
        tokens wait here), without the recomputed tokens its consumer already has."""
        request_id = out.request_id
        unclaimed = self.unclaimed.get(request_id)
        if unclaimed is not None:  # resumed from the journal, its consumer not back yet
            unclaimed.token_ids.extend(out.new_token_ids)
            if unclaimed.logprobs is not None and out.logprobs is not None:
                unclaimed.logprobs.extend(out.logprobs)
            if out.prompt_logprobs:
                unclaimed.prompt_logprobs = (unclaimed.prompt_logprobs or []) \
                    + out.prompt_logprobs
            unclaimed.last = out
            return None
        if out.prompt_logprobs and request_id in self.has_prompt_logprobs:
            out = dataclasses.replace(out, prompt_logprobs=None)  # recomputed, not news
        if out.finished:
            self.has_prompt_logprobs.discard(request_id)
        num_to_skip = self.num_to_skip.pop(request_id, 0)
        if num_to_skip:  # recomputed tokens the consumer had before the restart
            num_skipped = min(num_to_skip, len(out.new_token_ids))
            out = dataclasses.replace(
                out, new_token_ids=out.new_token_ids[num_skipped:],
                logprobs=out.logprobs[num_skipped:] if out.logprobs is not None else None)
            if num_to_skip > num_skipped and not out.finished:
                self.num_to_skip[request_id] = num_to_skip - num_skipped
        return out
