"""Tool calling: `tools` / `tool_choice` / `parallel_tool_calls` checked, the constraint
that `required` or a named function implies, and tool calls parsed out of generated text.

- `none`: the tools are not rendered and nothing is parsed;
- `auto`: the tools go to the chat template (its `tools` argument) and calls are parsed from
  whatever the model writes, in the formats of the families served: Qwen2/Hermes
  `<tool_call>{json}</tool_call>` blocks, Mistral `[TOOL_CALLS][{...}]` (the marker may be a
  special token dropped from the text: a bare JSON list of calls is taken too) and Llama 3
  JSON (`{"name": ..., "parameters": {...}}`, optionally after `<|python_tag|>`);
- `required`: decoding is constrained to a JSON list of `{"name", "parameters"}` calls (one
  unless `parallel_tool_calls`), each matching its function's parameter schema;
- a named function: decoding is constrained to that function's arguments object.
Calls come back as OpenAI `tool_calls`: an id each, `arguments` as a JSON string."""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from cluster.protocol.errors import ProtocolError
from cluster.protocol.structured import GrammarRequest
from workers.structured import spec as s

NONE, AUTO, REQUIRED = "none", "auto", "required"
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_MISTRAL = "[TOOL_CALLS]"
_LLAMA_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str


@dataclass(frozen=True)
class ToolPlan:
    tools: tuple[dict[str, Any], ...]  # OpenAI tool objects, as the chat template takes them
    choice: str  # NONE, AUTO, REQUIRED or a function name
    parallel: bool

    @property
    def is_active(self) -> bool:
        """Calls may come back (the answer is parsed, the stream buffered)."""
        return self.choice != NONE

    @property
    def is_named(self) -> bool:
        return self.choice not in (NONE, AUTO, REQUIRED)

    def parameters(self, name: str) -> dict[str, Any]:
        for tool in self.tools:
            if tool["function"]["name"] == name:
                return tool["function"].get("parameters") or {"type": "object"}
        raise KeyError(name)

    @property
    def names(self) -> list[str]:
        return [tool["function"]["name"] for tool in self.tools]


def _bad(param: str, message: str) -> ProtocolError:
    return ProtocolError(400, f"'{param}' {message}", param=param)


def _check_tool(i: int, tool: Any) -> dict[str, Any]:
    param = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise _bad(param, "must be {'type': 'function', 'function': {...}}")
    function = tool.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) \
            or not function["name"]:
        raise _bad(param, "needs 'function' with a non-empty 'name'")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise _bad(f"{param}.function.parameters", "must be a JSON schema object")
    return {"type": "function", "function": function}


def tool_plan(tools: Any, tool_choice: Any, parallel_tool_calls: Any) -> ToolPlan | None:
    """None when the request has no tools (and no tool_choice other than none/auto)."""
    if not tools:
        if tool_choice not in (None, NONE, AUTO):
            raise _bad("tool_choice", "needs 'tools'")
        return None
    if not isinstance(tools, list):
        raise _bad("tools", "must be a list of tools")
    checked = tuple(_check_tool(i, t) for i, t in enumerate(tools))
    names = [t["function"]["name"] for t in checked]
    if len(set(names)) != len(names):
        raise _bad("tools", "must not name a function twice")
    choice = AUTO if tool_choice is None else tool_choice
    if isinstance(choice, dict):
        function = choice.get("function")
        if choice.get("type") != "function" or not isinstance(function, dict):
            raise _bad("tool_choice", "must be 'none', 'auto', 'required' or "
                       "{'type': 'function', 'function': {'name': ...}}")
        choice = function.get("name")
        if choice not in names:
            raise _bad("tool_choice", f"names a function not in 'tools': {choice!r}")
    elif choice not in (NONE, AUTO, REQUIRED):
        raise _bad("tool_choice", "must be 'none', 'auto', 'required' or a named function")
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise _bad("parallel_tool_calls", "must be a boolean")
    return ToolPlan(checked, choice, parallel_tool_calls is not False)


def tool_grammar(plan: ToolPlan) -> GrammarRequest | None:
    """The constraint `required` or a named function implies; None for none/auto."""
    if plan.is_named:
        return GrammarRequest(s.JSON_SCHEMA, s.canonical_json(plan.parameters(plan.choice)),
                              "tool_choice")
    if plan.choice != REQUIRED:
        return None
    calls = [{"type": "object",
              "properties": {"name": {"enum": [name]}, "parameters": plan.parameters(name)},
              "required": ["name", "parameters"], "additionalProperties": False}
             for name in plan.names]
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    if not plan.parallel:
        schema["maxItems"] = 1
    return GrammarRequest(s.JSON_SCHEMA, s.canonical_json(schema), "tool_choice")


def _call(obj: Any, names: list[str]) -> ToolCall | None:
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # already JSON text: it must parse
        try:
            json.loads(args)
        except ValueError:
            return None
    elif isinstance(args, dict):
        args = json.dumps(args, ensure_ascii=False)
    else:
        return None
    return ToolCall(obj["name"], args, f"call_{secrets.token_hex(12)}")


def _json_calls(text: str, names: list[str]) -> list[ToolCall] | None:
    """A JSON object or list of calls (Llama 3 may separate several objects with ';')."""
    try:
        value = json.loads(text)
    except ValueError:
        parts = [p for p in text.split(";") if p.strip()]
        if len(parts) < 2:
            return None
        try:
            value = [json.loads(p) for p in parts]
        except ValueError:
            return None
    items = value if isinstance(value, list) else [value]
    calls = [_call(item, names) for item in items]
    if not calls or any(c is None for c in calls):
        return None
    return [c for c in calls if c is not None]


def parse_tool_calls(text: str, plan: ToolPlan) -> tuple[str | None, list[ToolCall], bool]:
    """(content left over, calls, whether text that looked like calls failed to parse)."""
    if plan.is_named:
        try:
            json.loads(text)
        except ValueError:
            return text, [], True  # cut by max_tokens: not a call
        return None, [ToolCall(plan.choice, text, f"call_{secrets.token_hex(12)}")], False
    names = plan.names
    stripped = text.strip()
    if "<tool_call>" in text:
        calls = []
        for block in _HERMES.findall(text):
            found = _json_calls(block, names)
            if found is None:
                return text, [], True
            calls += found
        content = _HERMES.sub("", text).strip() or None
        return content, calls, False
    looks_like_calls = stripped.startswith(("[", "{", _MISTRAL, _LLAMA_TAG))
    if not looks_like_calls:
        return text, [], False
    body = stripped.removeprefix(_MISTRAL).removeprefix(_LLAMA_TAG).strip()
    calls_found = _json_calls(body, names)
    if calls_found is None:
        return text, [], plan.choice == REQUIRED or stripped.startswith((_MISTRAL, _LLAMA_TAG))
    return None, calls_found, False


def openai_tool_calls(calls: list[ToolCall], streamed: bool = False) -> list[dict[str, Any]]:
    out = []
    for i, call in enumerate(calls):
        item: dict[str, Any] = {"id": call.id, "type": "function",
                                "function": {"name": call.name, "arguments": call.arguments}}
        if streamed:
            item["index"] = i
        out.append(item)
    return out
