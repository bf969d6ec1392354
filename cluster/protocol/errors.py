"""Protocol errors: `ProtocolError`, OpenAI's error envelope, and pydantic errors made readable.

Every failure in the protocol layer is a `ProtocolError` carrying the HTTP status and OpenAI's
error fields, so callers only need `error_body(err)` and `err.status_code` to answer.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError
from pydantic_core import PydanticCustomError

# Long inputs are cut in error messages so one huge bad field cannot bloat the response.
_MAX_INPUT_REPR = 60
_MAX_REPORTED_ERRORS = 3

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
