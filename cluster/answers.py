"""One request's deltas turned into its answer: the whole text (`collect`, for a
non-streaming answer and the remote batch runner) or Server-Sent Events (`sse_events`)."""

import logging
import time
from collections.abc import AsyncIterator, Callable

from cluster import protocol as p
from cluster.chunks import ChoiceChunks, advance
from cluster.frontend import Frontend, Prepared, TextStream
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


async def sse_events(frontend: Frontend, prepared: Prepared, request_id: str,
                     deltas: AsyncIterator[Delta],
                     abort: Abort) -> AsyncIterator[bytes]:
    """Server-sent events of one request, ending in `data: [DONE]`: its chunks
    (cluster/chunks.py), the last one with the finish reason; with
    `stream_options.include_usage` a usage chunk comes before [DONE]."""
    head = p.Head(request_id, frontend.config.worker.model_name, int(time.time()))
    choice = ChoiceChunks(frontend, prepared, head)
    reason: FinishReason | str | None = None
    try:
        if choice.is_chat:  # OpenAI's first chat chunk announces the role
            yield p.sse(choice.opening())
        async for delta in deltas:
            if delta.error:
                reason = FinishReason.ABORT
                logger.warning("request %s failed: %s", request_id, delta.error)
                yield p.sse(p.error_body(p.ProtocolError(
                    503, failed_message(delta.error, request_id), code="request_failed")))
                break
            chunks, reason = await choice.on_delta(
                delta, lambda: abort(request_id, FinishReason.STOP))
            for chunk in chunks:
                yield p.sse(chunk)
            if reason is not None:
                break
        if choice.include_usage:
            yield p.sse(p.usage_chunk(head, len(prepared.prompt_token_ids),
                                      len(choice.text.token_ids), chat=choice.is_chat))
        yield p.SSE_DONE
    finally:
        if reason is None:  # the client went away mid-stream (or the stream broke)
            abort(request_id)
