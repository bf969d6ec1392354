"""One request's deltas turned into its answer: the whole text (`collect`, for a
non-streaming answer and the remote batch runner) or Server-Sent Events (`sse_events`)."""

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable

from cluster import protocol as p
from cluster.frontend import Frontend, Prepared, TextStream, openai_finish_reason
from cluster.protocol.logprobs import LogprobsFormatter
from controller.messages import Delta, FinishReason

logger = logging.getLogger(__name__)
# Aborts a request: (request id, finish reason); STOP when the edge matched a stop string.
Abort = Callable[..., None]


def failed_message(error: str, request_id: str) -> str:
    return f"the request failed ({error[:200]}): retry shortly (request id {request_id})"


async def collect(frontend: Frontend, prepared: Prepared, request_id: str,
                  deltas: AsyncIterator[Delta], abort: Abort
                  ) -> tuple[TextStream, FinishReason | None, str | None]:
    """Run one request to its end: (text, finish reason, error). Used for non-streaming
    answers and by the remote batch runner."""
    text = frontend.text_stream(prepared)
    reason: FinishReason | None = None
    try:
        async for delta in deltas:
            if delta.error:
                reason = FinishReason.ABORT
                return text, reason, delta.error
            _, reason = await advance(frontend, text, delta,
                                    lambda: abort(request_id, FinishReason.STOP))
            if reason is not None:
                break
    finally:
        if reason is None:  # cancelled (the client went away) or the stream broke
            abort(request_id)
    return text, reason, None


async def advance(frontend: Frontend, text: TextStream, delta: Delta,
                  abort: Callable[[], object]) -> tuple[str, FinishReason | None]:
    """`text.advance` for one delta; a long delta (a stream that fell behind) is
    detokenized on the frontend's pool. `abort` always runs here, on the event loop."""
    token_ids = text.take_scores(delta)
    if (frontend.executor is None
            or text.num_to_decode(token_ids, delta.finish_reason)
            < frontend.config.edge.detokenize_in_thread_tokens):
        return text.advance(token_ids, delta.finish_reason, abort)
    stopped: list[bool] = []
    piece, reason = await asyncio.get_running_loop().run_in_executor(
        frontend.executor, text.advance, token_ids, delta.finish_reason,
        lambda: stopped.append(True))
    if stopped:
        abort()
    return piece, reason


async def sse_events(frontend: Frontend, prepared: Prepared, request_id: str,
                     deltas: AsyncIterator[Delta],
                     abort: Abort) -> AsyncIterator[bytes]:
    """Server-sent events of one request, ending in `data: [DONE]`. Chunks carry text
    deltas (and the delta's token ids with `return_token_ids`); the last one carries the
    finish reason; with `stream_options.include_usage` a usage chunk comes before [DONE]."""
    req = prepared.request
    head = p.Head(request_id, frontend.config.worker.model_name, int(time.time()))
    chat = prepared.is_chat
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return_ids = bool(req.return_token_ids)
    prompt_ids: list[int] | None = prepared.prompt_token_ids if return_ids else None
    text = frontend.text_stream(prepared)
    reason: FinishReason | None = None
    echo = frontend.echo_text(prepared)  # completions' echo: the first chunk leads with it
    formatter = LogprobsFormatter(frontend.token_text)
    num_sent = 0  # text.logprobs already in a chunk
    tools = prepared.tool_plan if chat and prepared.tool_plan is not None \
        and prepared.tool_plan.is_active else None
    try:
        if chat:  # OpenAI's first chat chunk announces the role
            yield p.sse(p.chat_completion_chunk(head, first=True,
                                                prompt_token_ids=prompt_ids,
                                                include_usage=include_usage))
            prompt_ids = None
        async for delta in deltas:
            if delta.error:
                reason = FinishReason.ABORT
                logger.warning("request %s failed: %s", request_id, delta.error)
                yield p.sse(p.error_body(p.ProtocolError(
                    503, failed_message(delta.error, request_id), code="request_failed")))
                break
            piece, reason = await advance(frontend, text, delta,
                                    lambda: abort(request_id, FinishReason.STOP))
            if reason is not None:
                reason = openai_finish_reason(text, reason)
            if tools is not None:  # held back: sent whole at the end, as content or calls
                piece = ""
                if reason is not None:
                    piece, calls, reason = frontend.tool_stream_end(tools, text.text, reason)
                    if calls:
                        chunk = p.chat_completion_chunk(head, piece,
                                                        include_usage=include_usage)
                        chunk["choices"][0]["delta"]["tool_calls"] = calls
                        yield p.sse(chunk)
                        piece = None
            ids = delta.token_ids if return_ids else None
            logprobs = frontend.logprobs_body(
                prepared, formatter, text.logprobs[num_sent:],
                text.prompt_logprobs if echo and num_sent == 0 else None, len(echo))
            num_sent = len(text.logprobs)
            if echo:
                piece, echo = echo + piece, ""
            if piece or ids or reason is not None or logprobs:
                if chat:
                    chunk = p.chat_completion_chunk(head, piece or None,
                                                    reason, token_ids=ids,
                                                    include_usage=include_usage)
                else:
                    chunk = p.completion_chunk(head, piece, reason,
                                               token_ids=ids, prompt_token_ids=prompt_ids,
                                               include_usage=include_usage)
                    prompt_ids = None
                chunk["choices"][0]["logprobs"] = logprobs
                yield p.sse(chunk)
            if reason is not None:
                break
        if include_usage:
            yield p.sse(p.usage_chunk(head,
                                      len(prepared.prompt_token_ids), len(text.token_ids),
                                      chat=chat))
        yield p.SSE_DONE
    finally:
        if reason is None:  # the client went away mid-stream (or the stream broke)
            abort(request_id)
