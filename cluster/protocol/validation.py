"""Request validation entry points and the checks that need the model.

Validation happens in two stages because some limits are only known after tokenization:
1. `parse_request` / `validate_request`: shape, types and ranges of every field (model-free);
2. `check_limits`: prompt length, `max_tokens` against the context window, token ids against
   the vocabulary (needs the tokenized prompt and the model's limits).
`to_sampling_params` then maps a request that passed both to the engine's SamplingParams.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Sequence
from typing import Any, TypeVar

import numpy as np
from pydantic import ValidationError

from cluster.protocol.errors import ProtocolError, _from_validation_error
from cluster.protocol.requests import ChatCompletionRequest, CompletionRequest, _RequestBase
from controller.messages import SamplingParams

RequestT = TypeVar("RequestT", bound=_RequestBase)


# A JSON string (escapes included): removed before brackets are counted.
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def json_depth(raw: bytes) -> int:
    """How deep objects and arrays nest in `raw`, read without parsing it (C-speed regex
    and numpy, so a hostile body costs little and never recurses)."""
    brackets = _JSON_STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    if not brackets:
        return 0
    opens = np.frombuffer(brackets, dtype=np.uint8)
    steps = np.where((opens == ord("[")) | (opens == ord("{")), 1, -1)
    return int(np.cumsum(steps).max())


def find_invalid_text(data: Any) -> tuple[str, str] | None:
    """(param, character) of the first string (or key) holding a lone surrogate, which JSON's
    \\uXXXX escapes can carry but UTF-8 cannot; iterative, so depth costs no recursion."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        param, value = stack.pop()
        if isinstance(value, str):
            bad = _lone_surrogate(value)
            if bad is not None:
                return param or "body", bad
        elif isinstance(value, dict):
            for key, item in reversed(value.items()):
                name = f"{param}.{key}" if param else str(key)
                bad = _lone_surrogate(key)
                if bad is not None:
                    return name, bad
                stack.append((name, item))
        elif isinstance(value, list):
            stack.extend((f"{param}[{i}]", item) for i, item in reversed(list(
                enumerate(value))))
    return None


def _lone_surrogate(text: str) -> str | None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        return f"\\u{ord(text[err.start]):04x}"
    return None


def validate_request(data: Any, cls: type[RequestT]) -> RequestT:
    """Validate an already-decoded body (e.g. a batch line's `body`)."""
    if not isinstance(data, dict):
        raise ProtocolError(400, "request body must be a JSON object")
    invalid = find_invalid_text(data)
    if invalid is not None:
        param, char = invalid
        raise ProtocolError(400, f"'{param}' contains a lone surrogate ({char}): text must "
                            f"be valid Unicode", param=param, code="invalid_text")
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        raise _from_validation_error(exc) from None


def parse_request(raw: bytes | str, cls: type[RequestT], max_depth: int = 32) -> RequestT:
    """Decode and validate an HTTP body; every failure is a ProtocolError(400). Nesting
    deeper than `max_depth` is refused before parsing (deep JSON recurses in the parser)."""
    depth = json_depth(raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw)
    if depth > max_depth:
        raise ProtocolError(400, f"request body nests {depth} levels deep, over the limit of "
                            f"{max_depth}", code="too_deep")
    try:
        data = json.loads(raw)
    except RecursionError:  # unreachable past the depth check; kept as the last guard
        raise ProtocolError(400, "request body nests too deep", code="too_deep") from None
    except UnicodeDecodeError:
        raise ProtocolError(400, "request body is not valid UTF-8") from None
    except json.JSONDecodeError as exc:
        raise ProtocolError(
            400, f"request body is not valid JSON: {exc.msg} (line {exc.lineno}, col {exc.colno})"
        ) from None
    except ValueError as exc:  # a number past Python's int-conversion digit limit
        raise ProtocolError(400, f"request body is not valid JSON: {exc}") from None
    return validate_request(data, cls)


def request_class_for_url(url: str) -> type[CompletionRequest] | type[ChatCompletionRequest]:
    if url == "/v1/completions":
        return CompletionRequest
    if url == "/v1/chat/completions":
        return ChatCompletionRequest
    raise ProtocolError(404, f"unknown endpoint {url!r}", param="url")


# --------------------------------------------------------------------------------------------
# Checks that need the model (after tokenization)


def check_model(requested: str | None, served: Sequence[str]) -> str:
    """Resolve the request's `model` to a served name; a missing one means the first served."""
    if requested is None:
        if not served:
            raise ProtocolError(503, "no model is loaded", code="model_not_loaded")
        return served[0]
    if requested not in served:
        raise ProtocolError(
            404,
            f"The model '{requested}' does not exist",
            type="NotFoundError",
            param="model",
            code="model_not_found",
        )
    return requested


def check_token_ids(token_ids: Iterable[int], vocab_size: int, param: str) -> None:
    for t in token_ids:
        if not 0 <= t < vocab_size:
            raise ProtocolError(
                400,
                f"'{param}' contains token id {t} outside the vocabulary [0, {vocab_size})",
                param=param,
            )


def check_max_tokens(req: _RequestBase, prompt_len: int, max_model_len: int) -> int:
    """Check the prompt and requested output fit the context window.

    Returns the room left for output (`max_model_len - prompt_len`), the natural
    `default_max_tokens` for `to_sampling_params` when the client gave no limit."""
    room = max_model_len - prompt_len
    if room < 1:
        raise ProtocolError(
            400,
            f"'{req.prompt_param}' is too long: {prompt_len} tokens, but this model's maximum "
            f"context length is {max_model_len} tokens and at least 1 must be left for output",
            param=req.prompt_param,
        )
    requested = req.requested_max_tokens
    if requested is not None and requested > room:
        param = req.max_tokens_param
        raise ProtocolError(
            400,
            f"'{param}' is too large: {requested}. This model's maximum context length is "
            f"{max_model_len} tokens and the prompt has {prompt_len}, so '{param}' must be "
            f"<= {room}",
            param=param,
        )
    return room


def check_limits(
    req: _RequestBase, prompt_token_ids: Sequence[int], max_model_len: int, vocab_size: int
) -> int:
    """All model-dependent checks in one call; returns the room left for output tokens."""
    if not prompt_token_ids:
        # A text prompt can tokenize to nothing (no BOS token and only ignorable characters).
        raise ProtocolError(
            400, f"'{req.prompt_param}' is empty after tokenization", param=req.prompt_param
        )
    check_token_ids(prompt_token_ids, vocab_size, req.prompt_param)
    check_token_ids(req.stop_token_ids, vocab_size, "stop_token_ids")
    return check_max_tokens(req, len(prompt_token_ids), max_model_len)


# --------------------------------------------------------------------------------------------
# Engine parameters


def _finite_or(value: float | None, default: float, param: str) -> float:
    # Models built with model_construct skip validation; NaN must still never reach a sampler,
    # where it would turn every probability into NaN.
    if value is None:
        return default
    if not math.isfinite(value):
        raise ProtocolError(400, f"'{param}' must be a finite number, got {value}", param=param)
    return float(value)


def to_sampling_params(req: _RequestBase, default_max_tokens: int) -> SamplingParams:
    """Map a validated request to the engine's SamplingParams (OpenAI's defaults for unset)."""
    max_tokens = req.requested_max_tokens
    if max_tokens is None:
        max_tokens = default_max_tokens
    if req.is_prompt_only:
        max_tokens = 1  # the one sampled token is dropped at the edge
    if max_tokens < 1:
        param = req.max_tokens_param
        raise ProtocolError(400, f"'{param}' must be at least 1, got {max_tokens}", param=param)
    top_k = req.top_k if req.top_k is not None else 0
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=_finite_or(req.temperature, 1.0, "temperature"),
        top_p=_finite_or(req.top_p, 1.0, "top_p"),
        # -1 and 0 both mean "no top-k" to clients; the engine wants a single spelling.
        top_k=max(top_k, 0),
        seed=req.seed,
        ignore_eos=bool(req.ignore_eos),
        stop_token_ids=tuple(req.stop_token_ids),
        stop=tuple(req.stop),
        logprobs=req.num_logprobs,
        prompt_logprobs=req.num_prompt_logprobs,
        grammar_kind=req.grammar.kind if req.grammar else "",
        grammar_spec=req.grammar.text if req.grammar else "",
    )
