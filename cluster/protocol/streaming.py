"""Streamed responses: completion and chat chunks, the usage chunk, and SSE framing."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from cluster.protocol.responses import Head, _choice, _envelope, _usage

SSE_DONE = b"data: [DONE]\n\n"


def completion_chunk(
    head: Head,
    text: str,
    finish_reason: str | None = None,
    *,
    token_ids: Sequence[int] | None = None,
    prompt_token_ids: Sequence[int] | None = None,
    include_usage: bool = False,
) -> dict[str, Any]:
    """One streamed /v1/completions event. `token_ids` are this chunk's delta tokens; pass
    `prompt_token_ids` on the first chunk only (vLLM's convention). With `include_usage`,
    OpenAI sends `"usage": null` on every chunk but the final usage chunk."""
    choice = _choice("text", text, finish_reason, token_ids, prompt_token_ids)
    chunk = _envelope(head.request_id, "text_completion", head.created, head.model, [choice])
    if include_usage:
        chunk["usage"] = None
    return chunk


def chat_completion_chunk(
    head: Head,
    content: str | None = None,
    finish_reason: str | None = None,
    *,
    first: bool = False,
    token_ids: Sequence[int] | None = None,
    prompt_token_ids: Sequence[int] | None = None,
    include_usage: bool = False,
) -> dict[str, Any]:
    """One streamed /v1/chat/completions event.

    `first=True` gives the opening chunk, whose delta announces the role (`{"role":
    "assistant", "content": ""}`) as OpenAI's does; clients key the message off it. A chunk
    with `content=None` has an empty delta, which is what the closing `finish_reason` chunk
    carries."""
    delta: dict[str, Any]
    if first:
        delta = {"role": "assistant", "content": content or ""}
    elif content is not None:
        delta = {"content": content}
    else:
        delta = {}
    choice = _choice("delta", delta, finish_reason, token_ids)
    chunk = _envelope(head.request_id, "chat.completion.chunk", head.created, head.model, [choice])
    if prompt_token_ids is not None:
        chunk["prompt_token_ids"] = list(prompt_token_ids)
    if include_usage:
        chunk["usage"] = None
    return chunk


def usage_chunk(
    head: Head,
    prompt_len: int,
    completion_len: int,
    *,
    chat: bool,
) -> dict[str, Any]:
    """The last event of a stream with `stream_options.include_usage`: no choices, usage set."""
    object_ = "chat.completion.chunk" if chat else "text_completion"
    chunk = _envelope(head.request_id, object_, head.created, head.model, [])
    chunk["usage"] = _usage(prompt_len, completion_len)
    return chunk


def sse(data: dict[str, Any] | str) -> bytes:
    """One server-sent event. A dict is compact JSON (which never contains a raw newline);
    a string is split into one `data:` line per line, since a bare newline would end the
    field early."""
    if isinstance(data, dict):
        payload = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
        return f"data: {payload}\n\n".encode()
    lines = "".join(f"data: {line}\n" for line in data.split("\n"))
    return f"{lines}\n".encode()
