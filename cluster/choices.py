"""Several choices of one request at the edge (`n`, completions' `best_of`).

Each choice is an engine request of its own (controller/choices.py: its own seed, the
prompt's blocks shared with choice 0); here they are submitted, their streams merged into
one OpenAI body or one SSE stream whose chunks carry each choice's `index`, and, for
`best_of`, the `n` with the highest cumulative log-probability kept. Usage counts the
prompt once and every generated sequence's tokens once (`best_of` ones included: they
were computed).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable

from cluster import protocol as p
from cluster.answers import collect, failed_message
from cluster.chunks import ChoiceChunks
from cluster.controller_client import ControllerClient
from cluster.frontend import Frontend, Prepared, TextStream
from cluster.protocol.responses import _usage
from controller.choices import choice_params, choice_request_id
from controller.messages import Delta, FinishReason

logger = logging.getLogger(__name__)
Choice = tuple[str, AsyncIterator[Delta]]  # (engine request id, its deltas)


async def submit_choices(client: ControllerClient, prepared: Prepared, request_id: str,
                         tenant: str) -> list[Choice]:
    """Submit every choice, choice 0 first (the others are routed to its worker). A
    refusal aborts the choices already admitted and is raised as `submit` raises it."""
    choices: list[Choice] = []
    try:
        for index in range(prepared.request.num_choices):
            rid = choice_request_id(request_id, index)
            _, deltas = await client.submit(prepared.prompt_token_ids,
                                            choice_params(prepared.params, request_id, index),
                                            rid, prepared.priority, tenant)
            choices.append((rid, deltas))
    except BaseException:
        for rid, _ in choices:
            client.abort(rid)
        raise
    return choices


def cumulative_logprob(text: TextStream) -> float:
    return sum(entry.logprob for entry in text.logprobs)


async def collect_choices(frontend: Frontend, prepared: Prepared, choices: list[Choice],
                          abort: Callable[[str], None]
                          ) -> tuple[list[tuple[TextStream, FinishReason | None]], str | None]:
    """Run every choice to its end with `collect` (the one-request runner):
    ([(text, finish reason)] in choice order, the first error)."""
    results = await asyncio.gather(*(collect(frontend, prepared, rid, deltas, abort)
                                     for rid, deltas in choices))
    error = next((err for _, _, err in results if err is not None), None)
    return [(text, reason) for text, reason, _ in results], error


def choices_body(frontend: Frontend, prepared: Prepared, request_id: str,
                 results: list[tuple[TextStream, FinishReason | None]]) -> dict:
    """One body with `n` choices: the best `n` by cumulative log-probability when more
    were generated (best_of), else all in order."""
    num_generated = sum(len(text.token_ids) for text, _ in results)
    n = prepared.request.n or 1
    if len(results) > n:
        results = sorted(results, key=lambda r: cumulative_logprob(r[0]), reverse=True)[:n]
    bodies = [frontend.response(prepared, request_id, text, reason) for text, reason in results]
    body = bodies[0]
    body["choices"] = [one["choices"][0] for one in bodies]
    for index, choice in enumerate(body["choices"]):
        choice["index"] = index
    body["usage"] = _usage(len(prepared.prompt_token_ids), num_generated)
    return body


async def sse_choices(frontend: Frontend, prepared: Prepared, request_id: str,
                      choices: list[Choice], abort: Callable[[str], None]
                      ) -> AsyncIterator[bytes]:
    """The SSE stream of `n` choices (not best_of: refused with stream): each chunk is one
    choice's delta under its `index`, in the order the deltas arrive, each built as one
    request's are (cluster/chunks.py)."""
    head = p.Head(request_id, frontend.config.worker.model_name, int(time.time()))
    queue: asyncio.Queue[tuple[int, Delta]] = asyncio.Queue()

    async def pump(index: int, deltas: AsyncIterator[Delta]) -> None:
        try:
            async for delta in deltas:
                await queue.put((index, delta))
                if delta.is_finished:
                    return
        except Exception as err:  # the stream broke: the merged stream ends with an error
            await queue.put((index, Delta.failed(choices[index][0], repr(err))))

    tasks = [asyncio.create_task(pump(i, deltas)) for i, (_, deltas) in enumerate(choices)]
    streams = [ChoiceChunks(frontend, prepared, head, index) for index in range(len(choices))]
    unfinished = set(range(len(choices)))
    try:
        if prepared.is_chat:
            for stream in streams:
                yield p.sse(stream.opening())
        while unfinished:
            index, delta = await queue.get()
            rid = choices[index][0]
            if delta.error:
                logger.warning("request %s failed: %s", rid, delta.error)
                yield p.sse(p.error_body(p.ProtocolError(
                    503, failed_message(delta.error, request_id), code="request_failed")))
                break
            chunks, reason = await streams[index].on_delta(delta, lambda r=rid: abort(r))
            if reason is not None:
                unfinished.discard(index)
            for chunk in chunks:
                yield p.sse(chunk)
        if prepared.request.include_usage and not unfinished:
            yield p.sse(p.usage_chunk(head, len(prepared.prompt_token_ids),
                                      sum(len(s.text.token_ids) for s in streams),
                                      chat=prepared.is_chat))
        if not unfinished:
            yield p.SSE_DONE
    finally:
        for task in tasks:
            task.cancel()
        for index in unfinished:  # the client went away (or a choice failed)
            abort(choices[index][0])
