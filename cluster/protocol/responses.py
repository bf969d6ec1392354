"""Response bodies: ids, non-streamed completion and chat bodies, /v1/models.

`_choice`, `_envelope` and `_usage` are the pieces every body and stream chunk is built from
(`cluster.protocol.streaming` uses them too), so OpenAI's field order and names live once.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Head:
    """What every body and chunk of one answer carries: its id, the model, its creation."""

    request_id: str
    model: str
    created: int


def new_completion_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


def new_chat_completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def new_batch_request_id() -> str:
    return f"batch_req_{uuid.uuid4().hex}"


def _usage(prompt_len: int, completion_len: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_len,
        "completion_tokens": completion_len,
        "total_tokens": prompt_len + completion_len,
    }


def _choice(
    key: str,
    value: Any,
    finish_reason: str | None,
    token_ids: Sequence[int] | None,
    prompt_token_ids: Sequence[int] | None = None,
) -> dict[str, Any]:
    """The single choice (index 0) of a body or chunk; `key` is "text", "message" or "delta"."""
    choice: dict[str, Any] = {
        "index": 0,
        key: value,
        "logprobs": None,
        "finish_reason": finish_reason,
    }
    if token_ids is not None:
        choice["token_ids"] = list(token_ids)
    if prompt_token_ids is not None:
        choice["prompt_token_ids"] = list(prompt_token_ids)
    return choice


def _envelope(
    request_id: str, object_: str, created: int, model: str, choices: list[dict[str, Any]]
) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": object_,
        "created": created,
        "model": model,
        "choices": choices,
    }


def completion_response(
    head: Head,
    text: str,
    finish_reason: str | None,
    prompt_len: int,
    completion_len: int,
    token_ids: Sequence[int] | None = None,
    prompt_token_ids: Sequence[int] | None = None,
) -> dict[str, Any]:
    """Non-streamed /v1/completions body. With `return_token_ids`, vLLM puts both `token_ids`
    and `prompt_token_ids` on the choice for completions; we do the same."""
    choice = _choice("text", text, finish_reason, token_ids, prompt_token_ids)
    body = _envelope(head.request_id, "text_completion", head.created, head.model, [choice])
    body["usage"] = _usage(prompt_len, completion_len)
    return body


def chat_completion_response(
    head: Head,
    text: str,
    finish_reason: str | None,
    prompt_len: int,
    completion_len: int,
    token_ids: Sequence[int] | None = None,
    prompt_token_ids: Sequence[int] | None = None,
) -> dict[str, Any]:
    """Non-streamed /v1/chat/completions body. As in vLLM, `token_ids` sits on the choice and
    `prompt_token_ids` on the response."""
    message = {"role": "assistant", "content": text}
    choice = _choice("message", message, finish_reason, token_ids)
    body = _envelope(head.request_id, "chat.completion", head.created, head.model, [choice])
    body["usage"] = _usage(prompt_len, completion_len)
    if prompt_token_ids is not None:
        body["prompt_token_ids"] = list(prompt_token_ids)
    return body


def models_response(
    model_names: Sequence[str], created: int, owned_by: str = "tokenflow"
) -> dict[str, Any]:
    """/v1/models body."""
    return {
        "object": "list",
        "data": [
            {"id": name, "object": "model", "created": created, "owned_by": owned_by}
            for name in model_names
        ],
    }
