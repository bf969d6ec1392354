"""Batch file format (OpenAI Batch API): input-line envelopes and output lines."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from cluster.protocol.errors import ProtocolError, _short_repr, error_body
from cluster.protocol.responses import new_batch_request_id

BATCH_URLS: frozenset[str] = frozenset({"/v1/completions", "/v1/chat/completions"})


class BatchLineError(ProtocolError):
    """A malformed batch input line; `custom_id` is set when it could be read, so the output
    line can still be matched to its input."""

    def __init__(self, message: str, param: str | None = None, custom_id: str | None = None):
        super().__init__(400, message, param=param)
        self.custom_id = custom_id


@dataclass(frozen=True)
class BatchItem:
    custom_id: str
    method: str
    url: str
    body: dict[str, Any]


def parse_batch_line(line: str) -> BatchItem:
    """Parse one input line `{"custom_id", "method", "url", "body"}`.

    Only the envelope is checked here; the body is validated with `validate_request` against
    `request_class_for_url(item.url)` so its errors become per-request 400 responses.
    Callers skip blank lines before calling (a blank line is an error here)."""
    try:
        data = json.loads(line)
    except json.JSONDecodeError as exc:
        raise BatchLineError(f"line is not valid JSON: {exc.msg} (col {exc.colno})") from None
    if not isinstance(data, dict):
        raise BatchLineError("line must be a JSON object")
    custom_id = data.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise BatchLineError("'custom_id' is required and must be a non-empty string", "custom_id")
    method = data.get("method")
    if method != "POST":
        raise BatchLineError(
            f"'method' must be \"POST\", got {_short_repr(method)}", "method", custom_id
        )
    url = data.get("url")
    if url not in BATCH_URLS:
        raise BatchLineError(
            f"'url' must be one of {sorted(BATCH_URLS)}, got {_short_repr(url)}", "url", custom_id
        )
    body = data.get("body")
    if not isinstance(body, dict):
        raise BatchLineError("'body' is required and must be a JSON object", "body", custom_id)
    return BatchItem(custom_id=custom_id, method=method, url=url, body=body)


def batch_output_line(
    custom_id: str | None,
    response: dict[str, Any] | None,
    error: dict[str, Any] | None,
    status_code: int | None,
    request_id: str | None = None,
) -> dict[str, Any]:
    """One output line: `{"id", "custom_id", "response": {"status_code", "request_id", "body"}
    | null, "error": {...} | null}`.

    The response block is present whenever there is a status code (an error response has one
    too: its body is the error envelope, as OpenAI writes it); it is null only for lines that
    never became a request. `request_id` defaults to the response body's `id`."""
    response_block: dict[str, Any] | None = None
    if status_code is not None or response is not None:
        if request_id is None:
            body_id = response.get("id") if response is not None else None
            request_id = body_id if isinstance(body_id, str) else f"req_{uuid.uuid4().hex}"
        response_block = {
            "status_code": status_code if status_code is not None else 200,
            "request_id": request_id,
            "body": response,
        }
    return {
        "id": new_batch_request_id(),
        "custom_id": custom_id,
        "response": response_block,
        "error": error,
    }


def batch_error_line(custom_id: str | None, err: ProtocolError) -> dict[str, Any]:
    """Output line for a request that failed with `err`: the error envelope is the response
    body (with its status), and `error` repeats code and message for readers that check only
    the top-level field."""
    return batch_output_line(
        custom_id,
        error_body(err),
        {"code": err.code if err.code is not None else err.type, "message": err.message},
        err.status_code,
    )
