"""OpenAI-compatible wire protocol: request models, validation, response builders, SSE, batch lines.

Pure on purpose (no Ray, torch or FastAPI app): the Serve ingress and the batch CLI both import
it, so a request is validated the same way whether it arrives over HTTP or in a batch file, and
the whole module is unit-testable in milliseconds.

Validation happens in two stages because some limits are only known after tokenization:
1. `parse_request` / `validate_request`: shape, types and ranges of every field (model-free);
2. `check_limits`: prompt length, `max_tokens` against the context window, token ids against
   the vocabulary (needs the tokenized prompt and the model's limits).
Every failure is a `ProtocolError` carrying the HTTP status and OpenAI's error fields, so callers
only need `error_body(err)` and `err.status_code` to answer.
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from controller.messages import SamplingParams

__all__ = [
    "BATCH_URLS",
    "SSE_DONE",
    "BatchItem",
    "BatchLineError",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "ProtocolError",
    "StopStringMatcher",
    "StreamOptions",
    "apply_stop_strings",
    "batch_error_line",
    "batch_output_line",
    "chat_completion_chunk",
    "chat_completion_response",
    "check_limits",
    "check_max_tokens",
    "check_model",
    "check_token_ids",
    "completion_chunk",
    "completion_response",
    "error_body",
    "models_response",
    "new_batch_request_id",
    "new_chat_completion_id",
    "new_completion_id",
    "parse_batch_line",
    "parse_request",
    "request_class_for_url",
    "sse",
    "to_sampling_params",
    "usage_chunk",
    "validate_request",
]

# OpenAI caps `stop` at 4 sequences; matching cost grows with their number on every delta.
MAX_STOP_SEQUENCES = 4
TEMPERATURE_MAX = 2.0
# Seeds travel to torch generators, which take 64-bit values.
_SEED_MIN = -(2**63)
_SEED_MAX = 2**64 - 1
# Long inputs are cut in error messages so one huge bad field cannot bloat the response.
_MAX_INPUT_REPR = 60
_MAX_REPORTED_ERRORS = 3

# Strict types: OpenAI rejects "16" for an integer and `true` for a number; pydantic's lax mode
# would silently coerce them (and `True` is an `int` in Python). Floats still accept JSON ints.
StrictInt = Annotated[int, Strict()]
StrictBool = Annotated[bool, Strict()]
StrictFloat = Annotated[float, Strict()]
StrictStr = Annotated[str, Strict()]


# --------------------------------------------------------------------------------------------
# Errors


_DEFAULT_ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    404: "NotFoundError",
    422: "invalid_request_error",
    429: "rate_limit_error",
}


class ProtocolError(Exception):
    """A request the server answers with an OpenAI error body and `status_code`."""

    def __init__(
        self,
        status_code: int,
        message: str,
        type: str | None = None,  # named like OpenAI's field, shadowing the builtin
        param: str | None = None,
        code: str | int | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type or _DEFAULT_ERROR_TYPES.get(
            status_code, "server_error" if status_code >= 500 else "invalid_request_error"
        )
        self.param = param
        self.code = code

    def __repr__(self) -> str:
        return f"ProtocolError({self.status_code}, {self.message!r}, param={self.param!r})"


def error_body(err: ProtocolError) -> dict[str, Any]:
    """OpenAI's error envelope: `{"error": {"message", "type", "param", "code"}}`."""
    return {
        "error": {
            "message": err.message,
            "type": err.type,
            "param": err.param,
            "code": err.code,
        }
    }


def _invalid(reason: str, field: str | None = None) -> PydanticCustomError:
    """A validation error whose text is final. `field` names the offending field for checks
    that run at model level, where pydantic's location stops at the model itself."""
    ctx: dict[str, Any] = {"reason": reason}
    if field is not None:
        ctx["field"] = field
    # The message goes through the context so braces in `reason` are never read as a template.
    return PydanticCustomError("invalid_param", "{reason}", ctx)


def _loc_to_param(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else part
    return out


def _short_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _MAX_INPUT_REPR else text[: _MAX_INPUT_REPR - 3] + "..."


def _from_validation_error(exc: ValidationError) -> ProtocolError:
    """Turn pydantic's error list into one readable sentence per problem, param first."""
    errors = exc.errors(include_url=False)
    messages: list[str] = []
    first_param: str | None = None
    for err in errors[:_MAX_REPORTED_ERRORS]:
        ctx = err.get("ctx") or {}
        loc = err["loc"] + ((ctx["field"],) if "field" in ctx else ())
        param = _loc_to_param(loc)
        if first_param is None and param:
            first_param = param
        if err["type"] == "invalid_param":
            messages.append(f"'{param}' {err['msg']}" if param else err["msg"])
        elif err["type"] == "missing":
            messages.append(f"'{param}' is required")
        elif err["type"] in ("model_type", "model_attributes_type", "dict_type"):
            # pydantic's text names our Python class, which means nothing to an API client.
            messages.append(f"'{param}' must be a JSON object (got {_short_repr(err['input'])})")
        else:
            messages.append(f"'{param}': {err['msg']} (got {_short_repr(err['input'])})")
    if len(errors) > _MAX_REPORTED_ERRORS:
        messages.append(f"and {len(errors) - _MAX_REPORTED_ERRORS} more errors")
    return ProtocolError(400, "; ".join(messages), param=first_param)


# --------------------------------------------------------------------------------------------
# Request models


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: StrictBool | None = False


class ChatMessage(BaseModel):
    """One chat turn. `content` is normalized to a plain string: text parts are joined with
    newlines (as vLLM does), so chat templates always see a string."""

    model_config = ConfigDict(extra="ignore")

    ROLES: ClassVar[frozenset[str]] = frozenset(
        {"system", "developer", "user", "assistant", "tool"}
    )

    role: StrictStr
    content: str = ""
    name: StrictStr | None = None

    @field_validator("role")
    @classmethod
    def _check_role(cls, role: str) -> str:
        if role not in cls.ROLES:
            raise _invalid(f"must be one of {sorted(cls.ROLES)}, got {_short_repr(role)}")
        return role

    @field_validator("content", mode="before")
    @classmethod
    def _normalize_content(cls, content: Any) -> str:
        # None is what clients send for an assistant turn that only had tool calls.
        if content is None:
            return ""
        if isinstance(content, str):
            return content
        if not isinstance(content, list):
            raise _invalid("must be a string or a list of text content parts")
        texts: list[str] = []
        for i, part in enumerate(content):
            if not isinstance(part, dict):
                raise _invalid(f"part {i} must be an object like {{'type': 'text', 'text': ...}}")
            if part.get("type") != "text":
                raise _invalid(
                    f"part {i} has type {_short_repr(part.get('type'))}: "
                    "only 'text' content parts are supported"
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise _invalid(f"part {i} needs a string 'text' field")
            texts.append(text)
        return "\n".join(texts)

    @model_validator(mode="before")
    @classmethod
    def _require_content(cls, data: Any) -> Any:
        # Only an assistant turn may omit content (tool calls); elsewhere it is a client bug.
        if (
            isinstance(data, dict)
            and isinstance(data.get("role"), str)
            and data["role"] != "assistant"
            and data.get("content") is None
        ):
            raise _invalid("is required", field="content")
        return data


class _RequestBase(BaseModel):
    """Fields and checks shared by /v1/completions and /v1/chat/completions.

    Unknown fields are ignored, not errors, so that clients sending newer OpenAI parameters
    (or other servers' extensions) keep working."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    max_tokens: StrictInt | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    top_k: StrictInt | None = None
    seed: StrictInt | None = None
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[StrictInt] = Field(default_factory=list)
    ignore_eos: StrictBool | None = False
    n: StrictInt | None = 1
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    return_token_ids: StrictBool | None = False
    priority: StrictInt = 0
    user: StrictStr | None = None

    @field_validator("max_tokens")
    @classmethod
    def _check_max_tokens(cls, value: int | None) -> int | None:
        if value is not None and value < 1:
            raise _invalid(f"must be at least 1, got {value}")
        return value

    @field_validator("temperature")
    @classmethod
    def _check_temperature(cls, value: float | None) -> float | None:
        if value is not None and not (math.isfinite(value) and 0.0 <= value <= TEMPERATURE_MAX):
            raise _invalid(f"must be a number between 0 and {TEMPERATURE_MAX:g}, got {value}")
        return value

    @field_validator("top_p")
    @classmethod
    def _check_top_p(cls, value: float | None) -> float | None:
        if value is not None and not (math.isfinite(value) and 0.0 < value <= 1.0):
            raise _invalid(f"must be in (0, 1], got {value}")
        return value

    @field_validator("top_k")
    @classmethod
    def _check_top_k(cls, value: int | None) -> int | None:
        if value is not None and value < -1:
            raise _invalid(f"must be -1 (disabled) or >= 0, got {value}")
        return value

    @field_validator("seed")
    @classmethod
    def _check_seed(cls, value: int | None) -> int | None:
        if value is not None and not _SEED_MIN <= value <= _SEED_MAX:
            raise _invalid("must fit in 64 bits")
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _normalize_stop(cls, value: Any) -> list[str]:
        if value is None:
            return []
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
            raise _invalid("must be a string or a list of strings")
        if len(value) > MAX_STOP_SEQUENCES:
            raise _invalid(f"accepts at most {MAX_STOP_SEQUENCES} sequences, got {len(value)}")
        # An empty stop string would match before the first character and end every request.
        if any(s == "" for s in value):
            raise _invalid("must not contain empty strings")
        return value

    @field_validator("stop_token_ids", mode="before")
    @classmethod
    def _none_is_empty(cls, value: Any) -> Any:
        return [] if value is None else value

    @field_validator("stop_token_ids")
    @classmethod
    def _check_stop_token_ids(cls, value: list[int]) -> list[int]:
        if any(t < 0 for t in value):
            raise _invalid("token ids must be >= 0")
        return value

    @field_validator("n")
    @classmethod
    def _check_n(cls, value: int | None) -> int | None:
        if value not in (None, 1):
            raise _invalid(f"must be 1: only one choice per request is supported, got {value}")
        return value

    @field_validator("priority", mode="before")
    @classmethod
    def _default_priority(cls, value: Any) -> Any:
        return 0 if value is None else value

    @model_validator(mode="after")
    def _check_stream_options(self) -> _RequestBase:
        if self.stream_options is not None and not self.stream:
            raise _invalid("is only allowed when 'stream' is true", field="stream_options")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def max_tokens_param(self) -> str:
        """The field the client used for the output limit, for error messages."""
        return "max_tokens"

    @property
    def include_usage(self) -> bool:
        """Whether a streamed response ends with a usage chunk."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def prompt_param(self) -> str:
        return "prompt"


class CompletionRequest(_RequestBase):
    """/v1/completions. After validation `prompt` is either a non-empty string or a non-empty
    list of token ids: one-element batches (`["text"]`, `[[1, 2]]`) are unwrapped."""

    prompt: str | list[StrictInt]
    echo: StrictBool | None = False
    logprobs: StrictInt | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _normalize_prompt(cls, value: Any) -> str | list[int]:
        if isinstance(value, str):
            if not value:
                raise _invalid("must not be empty")
            return value
        if not isinstance(value, list):
            raise _invalid("must be a string or a list of token ids")
        if not value:
            raise _invalid("must not be empty")
        if all(isinstance(v, (str, list)) for v in value):
            # OpenAI's batched form: several prompts in one request. Each would need its own
            # choice index and stream, which this server does not do.
            if len(value) > 1:
                raise _invalid("must be a single prompt: only one prompt per request is supported")
            return cls._normalize_prompt(value[0])
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            raise _invalid("must be a string or a list of token ids (integers)")
        if any(v < 0 for v in value):
            raise _invalid("token ids must be >= 0")
        return value

    @field_validator("echo")
    @classmethod
    def _check_echo(cls, value: bool | None) -> bool | None:
        if value:
            raise _invalid("is not supported")
        return value

    @field_validator("logprobs")
    @classmethod
    def _check_logprobs(cls, value: int | None) -> int | None:
        if value:
            raise _invalid("is not supported")
        return value

    @property
    def prompt_token_ids(self) -> list[int] | None:
        """The prompt when the client sent token ids, else None (text needs tokenizing)."""
        return self.prompt if isinstance(self.prompt, list) else None

    @property
    def prompt_text(self) -> str | None:
        return self.prompt if isinstance(self.prompt, str) else None


class ChatCompletionRequest(_RequestBase):
    """/v1/chat/completions. `max_completion_tokens` (OpenAI's newer name) wins over
    `max_tokens` when both are given."""

    messages: list[ChatMessage]
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = False
    top_logprobs: StrictInt | None = None

    @field_validator("messages", mode="before")
    @classmethod
    def _check_messages_not_empty(cls, value: Any) -> Any:
        if isinstance(value, list) and not value:
            raise _invalid("must contain at least one message")
        return value

    @field_validator("max_completion_tokens")
    @classmethod
    def _check_max_completion_tokens(cls, value: int | None) -> int | None:
        if value is not None and value < 1:
            raise _invalid(f"must be at least 1, got {value}")
        return value

    @field_validator("logprobs")
    @classmethod
    def _check_logprobs(cls, value: bool | None) -> bool | None:
        if value:
            raise _invalid("is not supported")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _check_top_logprobs(cls, value: int | None) -> int | None:
        if value:
            raise _invalid("is not supported")
        return value

    @property
    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    @property
    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    @property
    def prompt_param(self) -> str:
        return "messages"

    def conversation(self) -> list[dict[str, str]]:
        """Messages as `[{"role", "content"}]`, the shape chat templates take."""
        return [{"role": m.role, "content": m.content} for m in self.messages]


RequestT = TypeVar("RequestT", bound=_RequestBase)


def validate_request(data: Any, cls: type[RequestT]) -> RequestT:
    """Validate an already-decoded body (e.g. a batch line's `body`)."""
    if not isinstance(data, dict):
        raise ProtocolError(400, "request body must be a JSON object")
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        raise _from_validation_error(exc) from None


def parse_request(raw: bytes | str, cls: type[RequestT]) -> RequestT:
    """Decode and validate an HTTP body; every failure is a ProtocolError(400)."""
    try:
        data = json.loads(raw)
    except UnicodeDecodeError:
        raise ProtocolError(400, "request body is not valid UTF-8") from None
    except json.JSONDecodeError as exc:
        raise ProtocolError(
            400, f"request body is not valid JSON: {exc.msg} (line {exc.lineno}, col {exc.colno})"
        ) from None
    return validate_request(data, cls)


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
    )


def request_class_for_url(url: str) -> type[CompletionRequest] | type[ChatCompletionRequest]:
    if url == "/v1/completions":
        return CompletionRequest
    if url == "/v1/chat/completions":
        return ChatCompletionRequest
    raise ProtocolError(404, f"unknown endpoint {url!r}", param="url")


# --------------------------------------------------------------------------------------------
# Responses


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


def completion_response(
    request_id: str,
    model: str,
    created: int,
    text: str,
    finish_reason: str | None,
    prompt_len: int,
    completion_len: int,
    token_ids: Sequence[int] | None = None,
    prompt_token_ids: Sequence[int] | None = None,
) -> dict[str, Any]:
    """Non-streamed /v1/completions body. With `return_token_ids`, vLLM puts both `token_ids`
    and `prompt_token_ids` on the choice for completions; we do the same."""
    choice: dict[str, Any] = {
        "index": 0,
        "text": text,
        "logprobs": None,
        "finish_reason": finish_reason,
    }
    if token_ids is not None:
        choice["token_ids"] = list(token_ids)
    if prompt_token_ids is not None:
        choice["prompt_token_ids"] = list(prompt_token_ids)
    return {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": _usage(prompt_len, completion_len),
    }


def chat_completion_response(
    request_id: str,
    model: str,
    created: int,
    text: str,
    finish_reason: str | None,
    prompt_len: int,
    completion_len: int,
    token_ids: Sequence[int] | None = None,
    prompt_token_ids: Sequence[int] | None = None,
) -> dict[str, Any]:
    """Non-streamed /v1/chat/completions body. As in vLLM, `token_ids` sits on the choice and
    `prompt_token_ids` on the response."""
    choice: dict[str, Any] = {
        "index": 0,
        "message": {"role": "assistant", "content": text},
        "logprobs": None,
        "finish_reason": finish_reason,
    }
    if token_ids is not None:
        choice["token_ids"] = list(token_ids)
    body: dict[str, Any] = {
        "id": request_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": _usage(prompt_len, completion_len),
    }
    if prompt_token_ids is not None:
        body["prompt_token_ids"] = list(prompt_token_ids)
    return body


def completion_chunk(
    request_id: str,
    model: str,
    created: int,
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
    choice: dict[str, Any] = {
        "index": 0,
        "text": text,
        "logprobs": None,
        "finish_reason": finish_reason,
    }
    if token_ids is not None:
        choice["token_ids"] = list(token_ids)
    if prompt_token_ids is not None:
        choice["prompt_token_ids"] = list(prompt_token_ids)
    chunk: dict[str, Any] = {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
    }
    if include_usage:
        chunk["usage"] = None
    return chunk


def chat_completion_chunk(
    request_id: str,
    model: str,
    created: int,
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
    choice: dict[str, Any] = {
        "index": 0,
        "delta": delta,
        "logprobs": None,
        "finish_reason": finish_reason,
    }
    if token_ids is not None:
        choice["token_ids"] = list(token_ids)
    chunk: dict[str, Any] = {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [choice],
    }
    if prompt_token_ids is not None:
        chunk["prompt_token_ids"] = list(prompt_token_ids)
    if include_usage:
        chunk["usage"] = None
    return chunk


def usage_chunk(
    request_id: str,
    model: str,
    created: int,
    prompt_len: int,
    completion_len: int,
    *,
    chat: bool,
) -> dict[str, Any]:
    """The last event of a stream with `stream_options.include_usage`: no choices, usage set."""
    return {
        "id": request_id,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [],
        "usage": _usage(prompt_len, completion_len),
    }


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


SSE_DONE = b"data: [DONE]\n\n"


def sse(data: dict[str, Any] | str) -> bytes:
    """One server-sent event. A dict is compact JSON (which never contains a raw newline);
    a string is split into one `data:` line per line, since a bare newline would end the
    field early."""
    if isinstance(data, dict):
        payload = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
        return f"data: {payload}\n\n".encode()
    lines = "".join(f"data: {line}\n" for line in data.split("\n"))
    return f"{lines}\n".encode()


# --------------------------------------------------------------------------------------------
# Stop strings


class StopStringMatcher:
    """Applies stop strings to streamed text deltas.

    `feed(delta)` returns the text that is safe to emit and whether a stop string was hit.
    Text that could be the start of a stop string is held back until the next delta proves
    otherwise, so no client ever sees part of a stop string. On a hit the output ends right
    before the stop string (OpenAI excludes it). When several stop strings occur, the one that
    completes first in generation order wins, as it would if tokens arrived one by one. At the
    end of a generation that did not stop on a string, call `flush()` for the held text.
    """

    def __init__(self, stop: Sequence[str]) -> None:
        # An empty stop string would match at once; validation rejects it, so drop it here.
        self._stops: tuple[str, ...] = tuple(s for s in stop if s)
        self._held = ""
        self._stopped = False
        self.matched: str | None = None

    @property
    def stopped(self) -> bool:
        return self._stopped

    @property
    def held(self) -> str:
        """Text received but not yet released (a possible stop-string prefix)."""
        return self._held

    def feed(self, delta: str) -> tuple[str, bool]:
        if self._stopped:
            return "", True
        text = self._held + delta
        if not self._stops:
            return text, False
        hit: tuple[int, int, str] | None = None  # (end, start, stop string)
        for s in self._stops:
            start = text.find(s)
            if start >= 0:
                candidate = (start + len(s), start, s)
                if hit is None or candidate < hit:
                    hit = candidate
        if hit is not None:
            _, start, s = hit
            self._stopped = True
            self.matched = s
            self._held = ""
            return text[:start], True
        keep = self._longest_partial_suffix(text)
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep], False

    def flush(self) -> str:
        """Release held text once generation has ended without a stop string."""
        out, self._held = ("" if self._stopped else self._held), ""
        return out

    def _longest_partial_suffix(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        best = 0
        for s in self._stops:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best


def apply_stop_strings(text: str, stop: Sequence[str]) -> tuple[str, bool]:
    """One-shot form for a complete text: (text cut before the first stop string, stopped)."""
    matcher = StopStringMatcher(stop)
    out, stopped = matcher.feed(text)
    return out + matcher.flush(), stopped


# --------------------------------------------------------------------------------------------
# Batch file format (OpenAI Batch API)

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
