"""Field types and checks shared by the request models.

A check that means the same thing on both endpoints (an output-token limit, a list of token
ids, an OpenAI option this server does not support) lives here once and is attached to each
field with `Annotated[...]`, so /v1/completions and /v1/chat/completions can never drift apart.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator, Strict

from cluster.protocol.errors import _invalid

# Strict types: OpenAI rejects "16" for an integer and `true` for a number; pydantic's lax mode
# would silently coerce them (and `True` is an `int` in Python). Floats still accept JSON ints.
StrictInt = Annotated[int, Strict()]
StrictBool = Annotated[bool, Strict()]
StrictFloat = Annotated[float, Strict()]
StrictStr = Annotated[str, Strict()]


def _at_least_one(value: int | None) -> int | None:
    if value is not None and value < 1:
        raise _invalid(f"must be at least 1, got {value}")
    return value


def _reject_if_set(value: Any) -> Any:
    if value:
        raise _invalid("is not supported")
    return value


def check_non_negative_ids(token_ids: list[int]) -> list[int]:
    """Token ids are indices into the vocabulary; the upper bound needs the model
    (`check_token_ids`), the lower one does not."""
    if any(t < 0 for t in token_ids):
        raise _invalid("token ids must be >= 0")
    return token_ids


def _exactly_one(value: int | None) -> int | None:
    if value not in (None, 1):
        raise _invalid(f"must be 1: only one candidate per request is supported, got {value}")
    return value


def _no_tool_choice(value: Any) -> Any:
    if value not in (None, "none", "auto"):
        raise _invalid("is not supported: tools are not supported")
    return value


def _null_to_empty_list(value: Any) -> Any:
    return [] if value is None else value


def _null_to_zero(value: Any) -> Any:
    return 0 if value is None else value


# An output-token limit (`max_tokens`, `max_completion_tokens`): unset, or at least 1.
OutputTokenLimit = Annotated[StrictInt | None, AfterValidator(_at_least_one)]
# An OpenAI option that is accepted only at its "off" value (false, 0 or null).
Unsupported = AfterValidator(_reject_if_set)
# Options that would change what a response means when ignored: refused unless they are
# at their plain-text, single-answer value.
ExactlyOne = AfterValidator(_exactly_one)
NoToolChoice = AfterValidator(_no_tool_choice)
# Clients send an explicit null for "unset"; these read it as the field's default.
NullAsEmptyList = BeforeValidator(_null_to_empty_list)
NullAsZero = BeforeValidator(_null_to_zero)
TokenIdList = Annotated[list[StrictInt], NullAsEmptyList, AfterValidator(check_non_negative_ids)]
