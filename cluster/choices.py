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
from cluster.answers import advance, collect, failed_message
from cluster.controller_client import ControllerClient
from cluster.frontend import Frontend, Prepared, TextStream, openai_finish_reason
from cluster.protocol.logprobs import LogprobsFormatter
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
    choice's delta under its `index`, in the order the deltas arrive, each advanced as
    one request's are (cluster/answers.py)."""
    req = prepared.request
    head = p.Head(request_id, frontend.config.worker.model_name, int(time.time()))
    chat = prepared.is_chat
    include_usage = req.include_usage
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
    texts = [frontend.text_stream(prepared) for _ in choices]
    formatters = [LogprobsFormatter(frontend.token_text) for _ in choices]
    num_sent = [0] * len(choices)
    echoes = [frontend.echo_text(prepared)] * len(choices)
    unfinished = set(range(len(choices)))
    try:
        if chat:
            for index in range(len(choices)):
                chunk = p.chat_completion_chunk(head, first=True,
                                                include_usage=include_usage)
                chunk["choices"][0]["index"] = index
                yield p.sse(chunk)
        while unfinished:
            index, delta = await queue.get()
            rid, text = choices[index][0], texts[index]
            if delta.error:
                logger.warning("request %s failed: %s", rid, delta.error)
                yield p.sse(p.error_body(p.ProtocolError(
                    503, failed_message(delta.error, request_id), code="request_failed")))
                break
            piece, reason = await advance(frontend, text, delta, lambda r=rid: abort(r))
            if reason is not None:
                reason = openai_finish_reason(text, reason)
                unfinished.discard(index)
            logprobs = frontend.logprobs_body(
                prepared, formatters[index], text.logprobs[num_sent[index]:],
                text.prompt_logprobs if echoes[index] else None, len(echoes[index]))
            num_sent[index] = len(text.logprobs)
            if echoes[index]:
                piece, echoes[index] = echoes[index] + piece, ""
            ids = delta.token_ids if req.return_token_ids else None
            if not (piece or ids or reason is not None or logprobs):
                continue
            if chat:
                chunk = p.chat_completion_chunk(head, piece or None,
                                                reason, token_ids=ids,
                                                include_usage=include_usage)
            else:
                chunk = p.completion_chunk(head, piece, reason,
                                           token_ids=ids, include_usage=include_usage)
            chunk["choices"][0]["index"] = index
            chunk["choices"][0]["logprobs"] = logprobs
            yield p.sse(chunk)
        if include_usage and not unfinished:
            yield p.sse(p.usage_chunk(head, len(prepared.prompt_token_ids),
                                      sum(len(t.token_ids) for t in texts), chat=chat))
        if not unfinished:
            yield p.SSE_DONE
    finally:
        for task in tasks:
            task.cancel()
        for index in unfinished:  # the client went away (or a choice failed)
            abort(choices[index][0])
