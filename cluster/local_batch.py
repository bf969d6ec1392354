"""The in-process batch runner: a batch file's lines through a `LocalEngine`.

`python -m cluster.batch --local` runs it in the job's own process; a job on a cluster with
no controller, for one worker, runs it in one Ray task (cluster/task_batch.py). Each input
line is a `Job` of one or more engine requests (its choices); answers are written as their
last choice finishes.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, TextIO

from cluster import protocol as p
from cluster.batch_io import Progress, new_counts, read_items, write_answer, write_error
from cluster.choices import choices_body
from cluster.config import TokenflowConfig
from cluster.frontend import Frontend, Prepared, TextStream
from controller.choices import choice_params, choice_request_id
from controller.messages import FinishReason

if TYPE_CHECKING:
    from cluster.engine import LocalEngine


@dataclass
class Job:
    """One input line: its choices (`n`, `best_of`), each an engine request of its own."""

    custom_id: str
    prepared: Prepared
    request_id: str  # choice 0's, the response's id
    streams: list[TextStream]
    reasons: list[FinishReason | None]
    num_open: int

    def body(self, frontend: Frontend) -> dict:
        if len(self.streams) == 1:
            return frontend.response(self.prepared, self.request_id, self.streams[0],
                                     self.reasons[0])
        return choices_body(frontend, self.prepared, self.request_id,
                            list(zip(self.streams, self.reasons, strict=True)))


def _add_choices(engine: LocalEngine, frontend: Frontend, custom_id: str,
                 prepared: Prepared) -> Job:
    """Every choice of a line into the engine (choice 0 first: the others share its
    prompt's blocks); ValueError (nothing left admitted) when the engine refuses one."""
    num_choices = prepared.request.num_choices
    request_ids: list[str] = []
    try:
        for index in range(num_choices):
            params = prepared.params if index == 0 else \
                choice_params(prepared.params, request_ids[0], index)
            request_ids.append(engine.add_request(
                prepared.prompt_token_ids, params,
                None if index == 0 else choice_request_id(request_ids[0], index),
                priority=prepared.priority))
    except ValueError:
        for request_id in request_ids:
            engine.abort(request_id)
        raise
    return Job(custom_id, prepared, request_ids[0],
               [frontend.text_stream(prepared) for _ in range(num_choices)],
               [None] * num_choices, num_choices)


def run_local(lines: Iterable[str], out: TextIO, config: TokenflowConfig,
              done_ids: set[str], progress: bool = True,
              bind_threads: bool = False) -> dict[str, int]:
    """`bind_threads`: the process is the engine's alone (a Ray task's), so its CPU threads
    may be pinned to its cores as a worker actor's are (`worker.cpu_bind_threads`)."""
    from cluster.engine import LocalEngine

    started = time.perf_counter()
    engine = LocalEngine(config)
    if bind_threads and config.worker.cpu_bind_threads and engine.worker.device.type == "cpu":
        from workers.cpu_setup import bind_threads_to_cores

        bind_threads_to_cores()
    tokenizer = engine.worker.tokenizer
    frontend = Frontend(tokenizer, config, engine.worker.vocab_size)
    counts = new_counts()
    counts["startup_ms"] = round(1e3 * (time.perf_counter() - started))
    # engine request id -> (its line's job, its choice index)
    choices: dict[str, tuple[Job, int]] = {}
    bar = Progress(progress)

    def step() -> None:
        for output in engine.step():
            found = choices.get(output.request_id)
            if found is None:
                continue
            job, index = found
            stream = job.streams[index]
            _, reason = stream.advance(stream.take_scores(output), output.finish_reason,
                                       partial(engine.abort, output.request_id,
                                               FinishReason.STOP))
            if reason is None:
                continue
            del choices[output.request_id]
            job.reasons[index] = reason
            job.num_open -= 1
            if job.num_open == 0:
                write_answer(out, job.custom_id, job.body(frontend), counts, bar)
        if choices and not engine.has_unfinished():
            raise RuntimeError("engine went idle with unfinished batch requests")

    # Streamed like the cluster runner: at most batch.max_in_flight requests in the engine
    # (its queue is bounded, and a long input must not be held in memory).
    first_request_at: float | None = None
    for custom_id, prepared in read_items(lines, frontend, done_ids, out, counts):
        if first_request_at is None:
            first_request_at = time.perf_counter()
        while len(choices) >= config.batch.max_in_flight:
            step()
        try:
            job = _add_choices(engine, frontend, custom_id, prepared)
        except ValueError as err:  # the engine refused it (KV capacity)
            write_error(out, custom_id, p.ProtocolError(400, str(err)), counts)
            continue
        for index in range(len(job.streams)):
            choices[choice_request_id(job.request_id, index)] = (job, index)
        bar.add_total(1)
    while choices:
        step()
    if first_request_at is not None:
        counts["generation_ms"] = round(1e3 * (time.perf_counter() - first_request_at))
    bar.close()
    engine.check_integrity()
    return counts
