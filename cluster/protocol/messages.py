"""Chat turns (`ChatMessage`) for /v1/chat/completions, normalized for chat templates."""

from __future__ import annotations

import contextlib
import json
from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from cluster.protocol.errors import _invalid, _short_repr
from cluster.protocol.fields import StrictStr

_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


class ChatMessage(BaseModel):
    """One chat turn. `content` is normalized to a plain string: text parts are joined with
    newlines (as vLLM does), so chat templates always see a string."""

    # For /openapi.json: `content` is documented as required (only an assistant turn may
    # leave it out) and `role` as one of ROLES.
    model_config = ConfigDict(extra="ignore", json_schema_extra={"required": ["role", "content"]})

    ROLES: ClassVar[frozenset[str]] = _ROLES

    role: Annotated[StrictStr, Field(json_schema_extra={"enum": sorted(_ROLES)})]
    content: str = ""
    name: StrictStr | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn's calls
    tool_call_id: StrictStr | None = None  # a tool turn: the call it answers

    def template_dict(self) -> dict[str, Any]:
        """This turn as chat templates take it: tool calls' arguments as objects (the
        templates of the families served dump them with `tojson`)."""
        turn: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            turn["tool_calls"] = [_template_call(call) for call in self.tool_calls]
        if self.tool_call_id is not None:
            turn["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            turn["name"] = self.name
        return turn

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


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    function = dict(call.get("function") or {})
    args = function.get("arguments")
    if isinstance(args, str):
        with contextlib.suppress(ValueError):  # else left as the client sent it
            function["arguments"] = json.loads(args)
    return {**call, "function": function}
