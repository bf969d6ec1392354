"""One choice's streamed chunks: what a delta turns into on the wire, built in one place for
a single answer (cluster/answers.py) and for each of `n` choices (cluster/choices.py).

A delta is detokenized (`advance`), its text goes out as `content` (chat) or `text`
(completions) with its log-probabilities, its token ids when asked, and a completion's echo
in front of its first piece; a chat answer with tools streams its calls as OpenAI
`tool_calls` deltas while they are generated (cluster/protocol/tool_stream.py), in a chunk
of their own before the one with the finish reason."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from cluster import protocol as p
from cluster.frontend import Frontend, Prepared, TextStream, openai_finish_reason
from cluster.protocol.logprobs import LogprobsFormatter
from cluster.protocol.tool_stream import ToolCallStream
from cluster.protocol.tools import parse_tool_calls
from controller.messages import Delta, FinishReason

if TYPE_CHECKING:
    from cluster.protocol.tools import ToolPlan


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


class ChoiceChunks:
    def __init__(self, frontend: Frontend, prepared: Prepared, head: p.Head,
                 index: int = 0) -> None:
        self.frontend, self.prepared, self.head, self.index = frontend, prepared, head, index
        request = prepared.request
        self.is_chat = prepared.is_chat
        self.include_usage = request.include_usage
        self.return_ids = bool(request.return_token_ids)
        # vLLM's convention: the prompt's ids on the first chunk (of the first choice).
        self._prompt_ids = prepared.prompt_token_ids if self.return_ids and index == 0 else None
        self.text = frontend.text_stream(prepared)
        self._formatter = LogprobsFormatter(frontend.token_text)
        self._num_logprobs_sent = 0
        self._echo = frontend.echo_text(prepared)  # a completion's echo leads its first chunk
        plan = prepared.tool_plan if self.is_chat else None
        self.plan: ToolPlan | None = plan if plan is not None and plan.is_active else None
        self._tools = ToolCallStream(self.plan) if self.plan is not None else None

    def opening(self) -> dict[str, Any]:
        """A chat stream's first chunk, announcing the role."""
        chunk = p.chat_completion_chunk(self.head, first=True, prompt_token_ids=self._prompt_ids,
                                        include_usage=self.include_usage)
        self._prompt_ids = None
        chunk["choices"][0]["index"] = self.index
        return chunk

    async def on_delta(self, delta: Delta, abort: Callable[[], object]
                       ) -> tuple[list[dict[str, Any]], FinishReason | str | None]:
        """The chunks one delta makes (maybe none) and the choice's finish reason, once it
        has one. `abort` ends the engine request (a stop string matched)."""
        piece, engine_reason = await advance(self.frontend, self.text, delta, abort)
        reason: FinishReason | str | None = None
        if engine_reason is not None:
            reason = openai_finish_reason(self.text, engine_reason)
        chunks: list[dict[str, Any]] = []
        if self._tools is not None:
            piece, calls = self._tools.feed(self.text.text, reason is not None)
            if calls:
                chunks.append(self._chunk(piece or None, None, None, None))
                chunks[-1]["choices"][0]["delta"]["tool_calls"] = calls
                piece = ""
            if reason is not None:
                reason = self._tools_finish(reason)
        logprobs = self.frontend.logprobs_body(
            self.prepared, self._formatter, self.text.logprobs[self._num_logprobs_sent :],
            self.text.prompt_logprobs if self._echo and self._num_logprobs_sent == 0 else None,
            len(self._echo))
        self._num_logprobs_sent = len(self.text.logprobs)
        if self._echo:
            piece, self._echo = self._echo + piece, ""
        ids = delta.token_ids if self.return_ids else None
        if piece or ids or reason is not None or logprobs:
            chunks.append(self._chunk(piece, reason, ids, logprobs))
        return chunks, reason

    def _chunk(self, piece: str | None, reason: FinishReason | str | None,
               ids: list[int] | None, logprobs: dict | None) -> dict[str, Any]:
        if self.is_chat:
            chunk = p.chat_completion_chunk(self.head, piece or None, reason, token_ids=ids,
                                            include_usage=self.include_usage)
        else:
            chunk = p.completion_chunk(self.head, piece or "", reason, token_ids=ids,
                                       prompt_token_ids=self._prompt_ids,
                                       include_usage=self.include_usage)
            self._prompt_ids = None
        chunk["choices"][0]["index"] = self.index
        chunk["choices"][0]["logprobs"] = logprobs
        return chunk

    def _tools_finish(self, reason: FinishReason | str) -> FinishReason | str:
        """Calls were streamed: a stop is `tool_calls` (not for a named function, as
        OpenAI); text that looked like calls and did not parse is counted."""
        assert self.plan is not None and self._tools is not None
        _, calls, failed = parse_tool_calls(self.text.text, self.plan)
        self.frontend.num_tool_parse_failures += failed or (self._tools.is_calls and not calls)
        if self._tools.is_calls and reason == FinishReason.STOP and not self.plan.is_named:
            return "tool_calls"
        return reason
