"""Tool calls streamed as they are generated, in OpenAI's delta shape: a call's first delta
carries its `index`, `id`, `type` and `function.name` (with empty `arguments`), later ones
`arguments` fragments whose concatenation is the call's arguments JSON (the text the model
wrote for them).

The text is re-read from its start on every feed (answers are short) for the formats
`cluster/protocol/tools.py` parses whole: a named function's arguments object, `required`'s
JSON list of `{"name", "parameters"}`, and for `auto` Hermes `<tool_call>` blocks, Mistral
`[TOOL_CALLS]`, Llama 3 `<|python_tag|>` or a bare JSON call (list). Under `auto` text that
may still turn into a call is held back until it is decided; plain content streams as it
comes. A call once announced cannot be taken back: one whose text then fails to parse
(cut by `max_tokens`) is counted as a parse failure by the caller, as vLLM's parsers do."""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any

from cluster.protocol.tools import AUTO, REQUIRED, ToolPlan

_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_PREFIXES = ("[TOOL_CALLS]", "<|python_tag|>")
_WHITESPACE = " \t\r\n"


def value_end(text: str, start: int) -> int | None:
    """The end (exclusive) of the JSON value at `start`, or None while it is incomplete."""
    if start >= len(text):
        return None
    opener = text[start]
    if opener == '"':
        i = start + 1
        while i < len(text):
            if text[i] == "\\":
                i += 2
                continue
            if text[i] == '"':
                return i + 1
            i += 1
        return None
    if opener not in "{[":  # a number or a literal: ended by a delimiter
        for i in range(start, len(text)):
            if text[i] in ",}]" + _WHITESPACE:
                return i
        return None
    depth, i = 0, start
    while i < len(text):
        char = text[i]
        if char == '"':
            end = value_end(text, i)
            if end is None:
                return None
            i = end
            continue
        if char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


def _skip(text: str, i: int, chars: str = _WHITESPACE) -> int:
    while i < len(text) and text[i] in chars:
        i += 1
    return i


@dataclass
class _CallText:
    """One call object as read so far: its name once complete, its arguments' span."""

    name: str | None = None
    args_start: int | None = None
    args_end: int | None = None  # None while the arguments are incomplete
    end: int | None = None  # the object's end, once complete
    is_call: bool = True  # False: an object that is not a call


def _read_call(text: str, start: int, names: list[str]) -> _CallText:
    """The call object at `start` (a '{'), as far as the text goes."""
    call = _CallText()
    i = _skip(text, start + 1)
    while i < len(text):
        if text[i] == "}":
            call.end = i + 1
            call.is_call = call.name is not None and call.args_start is not None
            return call
        key_end = value_end(text, i)
        if text[i] != '"' or key_end is None:
            call.is_call = text[i] == '"'
            return call
        key = json.loads(text[i:key_end])
        i = _skip(text, key_end)
        if i >= len(text):
            return call
        i = _skip(text, i + 1)  # past ':'
        end = value_end(text, i)
        if key == "name":
            if end is None:
                return call
            name = json.loads(text[i:end])
            if name not in names:
                call.is_call = False
                return call
            call.name = name
        elif key in ("parameters", "arguments"):
            call.args_start, call.args_end = i, end
            if end is None:
                return call
        elif end is None:
            return call
        i = _skip(text, end, _WHITESPACE + ",")
    return call


def read_calls(text: str, start: int, names: list[str]) -> tuple[list[_CallText], bool]:
    """Call objects from `start`: one object, a JSON list of them, or objects joined by ';'
    (Llama 3). -> (the calls so far, whether the text there cannot be calls)."""
    i = _skip(text, start)
    if i < len(text) and text[i] == "[":
        i = _skip(text, i + 1)
    calls: list[_CallText] = []
    while i < len(text):
        if text[i] != "{":
            return calls, text[i] not in "]"
        call = _read_call(text, i, names)
        if not call.is_call:
            return calls, True
        calls.append(call)
        if call.end is None:
            break
        i = _skip(text, call.end, _WHITESPACE + ",;")
    return calls, False


@dataclass
class _Sent:
    id: str
    num_args_chars: int = 0


@dataclass
class ToolCallStream:
    """Feed it the whole text so far; it returns what to send since the last feed."""

    plan: ToolPlan
    _sent: list[_Sent] = field(default_factory=list)
    _num_content_chars: int = 0
    is_calls: bool = False  # the answer turned out to hold calls

    def feed(self, text: str, is_final: bool) -> tuple[str, list[dict[str, Any]]]:
        """(content to send, tool_calls deltas to send)."""
        if self.plan.is_named:
            start = _skip(text, 0)
            calls = [_CallText(self.plan.choice, start, value_end(text, start))]
            return "", self._deltas(text, calls, is_final)
        names = self.plan.names
        content_end, calls_start = len(text), None
        hermes = text.find(_HERMES_OPEN)
        stripped = _skip(text, 0)
        if hermes >= 0:
            content_end, calls_start = hermes, hermes + len(_HERMES_OPEN)
        elif self.plan.choice == REQUIRED:
            content_end, calls_start = 0, 0
        elif self.plan.choice == AUTO:
            rest = text[stripped:]
            prefix = next((p for p in _PREFIXES if rest.startswith(p)), None)
            if prefix is not None:
                content_end, calls_start = 0, stripped + len(prefix)
            elif any(p.startswith(rest) for p in (*_PREFIXES, _HERMES_OPEN)) and not is_final:
                content_end = stripped  # may still become a marker: wait
            elif rest.startswith(("[", "{")):
                calls, is_content = read_calls(text, stripped, names)
                if not is_content and (calls and calls[0].name is not None):
                    content_end, calls_start = 0, stripped
                elif not is_content and not is_final:
                    content_end = stripped  # undecided: held back
            else:  # plain content; hold back a tail that may open a Hermes block
                content_end = _held_tail(text, is_final)
        if calls_start is None or self._num_content_chars > content_end:
            content_end = max(content_end, self._num_content_chars)
        content = text[self._num_content_chars : content_end]
        self._num_content_chars = content_end
        if calls_start is None:
            return content, []
        calls = self._hermes_calls(text, calls_start, names) if hermes >= 0 \
            else read_calls(text, calls_start, names)[0]
        closed = text.rfind(_HERMES_CLOSE)
        if hermes >= 0 and is_final and closed >= 0:  # text after the last block, at the end
            content += text[closed + len(_HERMES_CLOSE) :].strip()
        return content if content.strip() else "", self._deltas(text, calls, is_final)

    def _hermes_calls(self, text: str, start: int, names: list[str]) -> list[_CallText]:
        calls: list[_CallText] = []
        while True:
            found, _ = read_calls(text, start, names)
            calls += found
            close = text.find(_HERMES_CLOSE, start)
            following = text.find(_HERMES_OPEN, close) if close >= 0 else -1
            if following < 0:
                return calls
            start = following + len(_HERMES_OPEN)

    def _deltas(self, text: str, calls: list[_CallText], is_final: bool
                ) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        for index, call in enumerate(calls):
            if call.name is None or call.args_start is None:
                break
            if index == len(self._sent):
                self._sent.append(_Sent(f"call_{secrets.token_hex(12)}"))
                deltas.append({"index": index, "id": self._sent[index].id, "type": "function",
                               "function": {"name": call.name, "arguments": ""}})
                self.is_calls = True
            sent = self._sent[index]
            end = call.args_end if call.args_end is not None else len(text)
            args = text[call.args_start : end]
            if args.startswith('"'):  # arguments as a JSON string: sent once complete
                if call.args_end is None or sent.num_args_chars:
                    continue
                piece = json.loads(args)
                sent.num_args_chars = len(args)
            else:
                if call.args_end is None and not is_final:
                    args = args.rstrip(_WHITESPACE)
                piece = args[sent.num_args_chars :]
                sent.num_args_chars += len(piece)
            if piece:
                deltas.append({"index": index, "function": {"arguments": piece}})
        return deltas


def _held_tail(text: str, is_final: bool) -> int:
    """Where content may be sent up to: not into a tail that could open a Hermes block."""
    if is_final:
        return len(text)
    for size in range(min(len(_HERMES_OPEN) - 1, len(text)), 0, -1):
        if _HERMES_OPEN.startswith(text[-size:]):
            return len(text) - size
    return len(text)
